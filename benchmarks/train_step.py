"""`python bench.py gpu --parts train`: one iteration's training, phase by phase, against the device's FLOP floor.

The workload is the GPU table's: the Qwen2.5-0.5B configuration (random weights, float32 masters, matrix products in
bf16 under autocast on CUDA as the trainer runs them), --prompts GSM8K prompts x --group-size responses of
--decode-tokens random tokens each (a random model never stops early), scored as the trainer scores them
(packing.logprobs_fn, shared-prompt rows where they pay, rows padded as --pad-to-multiple-of auto pads them), the
default loss (dapo, β = 0.04), one AdamW step (launch.setup.adamw). Phases, each timed alone (torch.cuda.synchronize
before and after on CUDA, wall clock on CPU), in the learner's order:

    reference   π_ref's log-probs (no grad)                         F
    old policy  π_θk's log-probs (no grad; only when an iteration takes > 1 step: not in the iteration's sum)  F
    forward     the policy's log-probs and entropy                  F
    loss        grpo_loss on the log-probs                          ~0
    backward    loss.backward()                                     2F
    optimizer   clip the gradient norm, AdamW, zero the gradients   (memory-bound: bytes, not FLOPs)
    publish     θ_k into the weight buffer (bf16 on CUDA; a device-to-host copy), the old copy's snapshot
    host gaps   the iteration's wall time less its timed phases (Python between them: building the micro-batches)

FLOP count F of one forward (the useful work, what MFU counts; the recomputation a kernel or checkpointing adds is not
counted):
    F = 2 · W · tokens                   W: the decoder layers' matrix weights; tokens: P + Σ R_i per group (packed)
      + 4 · layers · heads · head_dim · pairs     QKᵀ and A·V over the (query, key) pairs the shared-prompt mask
                                                  allows: P(P+1)/2 + Σ_i R_i·(P + (R_i+1)/2) per group
      + 2 · hidden · vocab · Σ R_i       the LM head, at the positions that predict a response token only
Achieved TFLOP/s = FLOPs / seconds; share of peak = that / the device's dense bf16 peak (PEAK_BF16_TFLOPS, by name;
n/a on CPU and on a device not in the table). Peak memory: torch.cuda.max_memory_allocated on CUDA; on CPU the
process's peak resident set (ru_maxrss, everything the process ever held).

--train-compile both (the default) times two sides, interleaved round by round on the same tri-model and weights:
eager, and the decoder layers compiled as --compile-train on runs them (infra/compiled_training.py: forward and
backward, symbolic rows and length, packed rows under the dense mask); all adds them compiled for this workload's one
shape (static: whether fixed lengths would pay). Each side's first iteration is untimed; a compiled side's, less one
of its timed iterations, is its compilation, printed apart with the graphs Dynamo compiled.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import attention
import packing
from benchmarks.common import count
from benchmarks.engine_cpu import gsm8k_prompts, qwen_wide_model
from config import Config
from grpo import grpo_loss
from infra import compiled_training
from infra.options import PAD_MULTIPLE_ACCELERATOR
from launch.memory import STAND_INS, fit_rows
from launch.setup import adamw
from tri_model import TriModel
from weights import WeightBuffer

PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("A100", 312.0),
                    ("A800", 312.0), ("L40S", 362.1), ("L4", 121.0))  # dense, by device name (first match)
PHASES = ("reference", "old policy", "forward", "loss", "backward", "optimizer", "publish", "host gaps")
FLOPS_PER_F = {"reference": 1, "old policy": 1, "forward": 1, "backward": 2}
GOAL_SHARE = 0.35
SIDES = {"off": ("eager",), "on": ("compiled",), "both": ("eager", "compiled"),
         "all": ("eager", "compiled", "static")}  # --train-compile


def train_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-micro-groups", type=count(0), default=16,
                        help="train part: groups per micro-batch (16: the whole iteration in one; 0: as many as the "
                             "device's memory allows, launch/memory.fit_rows, above the 16,384 a run keeps to)")
    parser.add_argument("--train-compile", choices=tuple(SIDES), default="both",
                        help="train part: the decoder layers eager (off), compiled as --compile-train on runs them "
                             "(on), or both sides, interleaved, the compilation timed apart (default); all: and a "
                             "third side compiled for the workload's one shape (dynamic=False: what fixed lengths "
                             "would give)")


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for mark, peak in PEAK_BF16_TFLOPS if mark in name), None)


def forward_flops(model: torch.nn.Module, lengths: list[tuple[int, list[int]]]) -> float:
    """F of one forward over groups of (prompt length, [response lengths]) in shared-prompt rows (module docstring)."""
    config = model.config
    layers = model.get_decoder().layers
    weights = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tokens = sum(p + sum(rs) for p, rs in lengths)
    pairs = sum(p * (p + 1) / 2 + sum(r * (p + (r + 1) / 2) for r in rs) for p, rs in lengths)
    responses = sum(sum(rs) for _, rs in lengths)
    return (2 * weights * tokens + 4 * len(layers) * config.num_attention_heads * head_dim * pairs
            + 2 * config.hidden_size * config.vocab_size * responses)


def train_workload(args: argparse.Namespace, device: torch.device):
    """The policy (float32 masters) and the iteration's groups [(prompt ids (P,), [response ids (M,)] x G)]."""
    model = qwen_wide_model(args.layers, args.vocab).to(device).train()
    prompts = [[t % args.vocab for t in p] for p in gsm8k_prompts(args.data / "train.jsonl", args.prompts)]
    draw = torch.Generator().manual_seed(0)
    groups = [(torch.tensor(p, device=device),
               [torch.randint(3, args.vocab, (args.decode_tokens,), generator=draw).to(device)
                for _ in range(args.group_size)]) for p in prompts]
    return model, groups


def iteration(tri: TriModel, optimizer, buffer: WeightBuffer | None, groups, micro: int, clock) -> dict[str, float]:
    """One iteration's training as the learner runs it, each phase timed by `clock(name, fn)`; returns seconds."""
    seconds = dict.fromkeys(PHASES, 0.0)

    def timed(name: str, fn):
        out, spent = clock(fn)
        seconds[name] += spent
        return out
    start = time.perf_counter()
    for first in range(0, len(groups), micro):
        batch = groups[first:first + micro]
        with torch.no_grad():
            ref_logp = timed("reference", lambda: tri.logprobs(tri.reference, batch)[0])  # (n·G, T)
            timed("old policy", lambda: tri.logprobs(tri.old, batch)[0])
        logp, mask, entropy = timed("forward", lambda: tri.logprobs(tri.policy, batch, entropy=True))  # (n·G, T)
        advantages = torch.linspace(-1, 1, len(logp), device=logp.device)  # (n·G,)
        loss, _ = timed("loss", lambda: grpo_loss(logp, logp.detach(), ref_logp, advantages, mask, normalizer=1.0))
        timed("backward", loss.backward)

    def step():
        torch.nn.utils.clip_grad_norm_(list(tri.policy.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    timed("optimizer", step)

    def publish():
        tri.start_iteration()
        if buffer is not None:
            buffer.publish(tri.policy, 1)
    timed("publish", publish)
    clock(lambda: None)  # the device's queue drained
    seconds["host gaps"] = time.perf_counter() - start - sum(seconds.values())  # the wall less every timed phase
    return seconds


def clock_on(device: torch.device):
    def clock(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out, time.perf_counter() - begin
    return clock


def scorers(model: torch.nn.Module, pad_id: int, multiple: int, sides: tuple[str, ...]) -> dict:
    """Each side's tri-model scorer: the trainer's (eager), --compile-train on's (compiled), and the same compiled for
    one shape (static)."""
    dense = packing.logprobs_fn(model, "auto", 1.0, pad_id, multiple, dense_mask=True)
    made = {"eager": lambda: packing.logprobs_fn(model, "auto", 1.0, pad_id, multiple),
            "compiled": lambda: compiled_training.compiled_scorer(dense),
            "static": lambda: compiled_training.compiled_scorer(dense, dynamic=False)}
    return {name: made[name]() for name in sides}


def side_figures(rounds: list[dict[str, float]], flops: float, peak: float | None) -> dict:
    """Per phase: the median seconds over rounds, its FLOPs, TFLOP/s and share of peak; and the iteration's."""
    figures: dict = {"phases": {}}
    for name in PHASES:
        spent = statistics.median(r[name] for r in rounds)
        work = FLOPS_PER_F.get(name, 0) * flops
        tflops = work / spent / 1e12 if work and spent > 0 else None
        figures["phases"][name] = {"seconds": spent, "flops": work, "tflops": tflops,
                                   "of_peak": tflops / peak if tflops is not None and peak else None,
                                   "rounds": [r[name] for r in rounds]}
    total = sum(figures["phases"][name]["seconds"] for name in PHASES if name != "old policy")
    work = 4 * flops  # reference, forward, backward
    figures["iteration"] = {"seconds": total, "tflops": work / total / 1e12,
                            "of_peak": work / total / 1e12 / peak if peak else None}
    return figures


def cells(figures: dict) -> str:
    """One side's seconds, TFLOP/s and share of peak, as table cells."""
    tflops, share = figures.get("tflops"), figures.get("of_peak")
    return (f"{figures['seconds']:10.3f} {f'{tflops:.3g}' if tflops else '':>8s} "
            f"{f'{share:.1%}' if share is not None else 'n/a' if tflops else '':>8s}")


def train_part(args: argparse.Namespace, device: torch.device) -> dict:
    model, groups = train_workload(args, device)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    multiple = PAD_MULTIPLE_ACCELERATOR if device.type != "cpu" else 1  # the trainer's --pad-to-multiple-of auto
    sides = scorers(model, args.vocab - 2, multiple, SIDES[args.train_compile])
    tri = TriModel(model, next(iter(sides.values())), use_reference=True, use_old=True, compute_dtype=compute)
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.0)
    try:
        buffer = WeightBuffer(model, compute)
    except Exception as error:  # a small /dev/shm: the rest is still measured
        print(f"gpu train: publish not timed: {error}", flush=True)
        buffer = None
    lengths = [(len(p), [len(r) for r in rs]) for p, rs in groups]
    flops = forward_flops(model, lengths)
    peak = peak_tflops(device)
    tokens = sum(p + sum(rs) for p, rs in lengths)
    # what a run's --sizes probe fits to this device's memory (launch/memory.py), from rows of the workload's shape
    fitted, fit_note = fit_rows(tri, optimizer, [(p, rs[:1]) for p, rs in groups[:STAND_INS]],
                                Config(max_new_tokens=args.decode_tokens))
    group_tokens = max(len(rs) * p + sum(rs) for p, rs in lengths)  # as the learner counts a group: G·P + Σ R
    micro = args.train_micro_groups or max(1, min(len(groups), (fitted or 0) // group_tokens))
    chunk = attention.logits_chunk_bytes(device)
    columns = min(args.vocab, attention.VOCAB_CHUNK)
    micro_tokens = min(micro, len(groups)) * group_tokens
    print(f"gpu train: {fit_note}; here {micro} groups per micro-batch ({micro_tokens} tokens as the learner "
          f"counts them); logit blocks of {chunk // (16 * columns)} rows x {columns} columns ({chunk / 2**20:.0f} "
          f"MiB, attention.logits_chunk_bytes)", flush=True)
    print(f"gpu train: {args.layers} layers, vocabulary {args.vocab}, {len(groups)} groups x {args.group_size} "
          f"responses of {args.decode_tokens} tokens ({tokens} packed tokens), {micro} groups per micro-batch, "
          f"float32 masters, {compute} compute, {device}; one forward F = {flops:.3g} FLOP; peak "
          f"{f'{peak:.0f} TFLOP/s bf16' if peak else 'n/a'}; sides: {', '.join(sides)}", flush=True)
    clock = clock_on(device)
    first, graphs = {}, {}
    for name, scorer in sides.items():  # warm-up: kernels' plans, allocator pools, the compiled side's compilation
        tri.logprobs_fn, before = scorer, compiled_training.compilations()
        first[name] = sum(iteration(tri, optimizer, buffer, groups, micro, clock).values())
        graphs[name] = compiled_training.compilations() - before
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rounds: dict[str, list] = {name: [] for name in sides}
    for _ in range(max(1, args.rounds)):  # interleaved: the machine's drift falls on both sides alike
        for name, scorer in sides.items():
            tri.logprobs_fn = scorer
            rounds[name].append(iteration(tri, optimizer, buffer, groups, micro, clock))
    memory = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
              else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    results = {name: side_figures(rounds[name], flops, peak) for name in sides}
    for name, result in results.items():
        result["first_iteration_seconds"] = first[name]
        result["compile_seconds"] = max(0.0, first[name] - statistics.median(sum(r.values()) for r in rounds[name]))
        result["compiled_graphs"] = graphs[name]
    print(f"{'phase':12s}" + "".join(f" {name + ' s':>10s} {'TFLOP/s':>8s} {'of peak':>8s}" for name in sides)
          + f"   (median of {max(1, args.rounds)} rounds)")
    for name in (*PHASES, "iteration"):
        print(f"{name:12s}" + "".join(" " + cells(result["phases"][name] if name != "iteration"
                                                  else result["iteration"]) for result in results.values()),
              flush=True)
    for name, result in results.items():
        if name != "eager":
            print(f"gpu train: {name} side: first iteration {result['first_iteration_seconds']:.1f} s, of which "
                  f"~{result['compile_seconds']:.1f} s compiling ({result['compiled_graphs']} graphs)"
                  + (f"; training without it: {compiled_training.FAILED}" if compiled_training.FAILED else ""),
                  flush=True)
    print(f"iteration without the old policy (4F of work); peak memory {memory / 2**30:.2f} GiB "
          f"({'cuda allocated' if device.type == 'cuda' else 'process max RSS'}, every side)", flush=True)
    main = results[next(iter(sides))]  # the default's (eager with --train-compile both) at the top level
    return {"forward_flops": flops, "packed_tokens": tokens, "peak_tflops": peak, "micro_groups": micro,
            "micro_tokens": micro_tokens, "fitted_tokens": fitted, "memory_fit": fit_note, "logits_chunk_bytes": chunk,
            "peak_memory_bytes": memory, "peak_memory_kind": "cuda allocated" if device.type == "cuda"
            else "process max RSS", **main, "sides": results}
