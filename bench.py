"""Benchmarks: `python bench.py <which> [options]`, one subcommand per claim the project makes.

shared-prompt
    One GRPO training step (forward + backward of -(A · logp · mask).sum() / mask.sum()) on a
    random-weight 6-layer Qwen2-shaped model, over a grid of prompt length P and response length R
    with G = 8 responses per prompt, in three modes of `packing.batch_logprobs`:
      packed    one row [p | r_1 | ... | r_G]: under sdpa the structured kernel
                `packing.shared_prompt_attention` (causal prompt, each response against the
                prompt and itself), under eager the dense shared-prompt mask
      unpacked  G rows [p | r_i] with an ordinary causal mask (the baseline)
      auto      per group, `packing.packing_pays` picks one of the two
    How to read a row: `tokens x` = G(P+R) / (P+GR) is the ideal speedup if only token count
    mattered; `MAC ceil` (`mac_ceiling`) is the most packing can give once the work that does not
    shrink with the tokens is counted: the causal prompt and every response against the whole
    prompt (attention shrinks less than the tokens) and the lm head, applied to the same G·R
    response positions in either layout; `unp/pk` is the measured speedup, to be read against
    `MAC ceil`. Where responses are long and
    prompts short it drops to about 1 or below; `unp/auto` should then stay at about 1: auto falls
    back to plain rows. `--mask dense` sends packed rows through the dense mask instead of the
    structured kernel: what making the mask cheap is worth. `pred pk/unp` is `packing.packing_cost_ratio`, the cost model auto decides
    by (< 1 packs); the bench also prints the break-even length its own timings fit, to re-tune
    `packing.ATTENTION_BREAK_EVEN_LEN` for other hardware.
    Memory: on CPU, the bytes of distinct non-parameter tensors autograd saved for backward (a
    deterministic stand-in for peak activation memory); on CUDA, peak allocated bytes during the
    step. `mask MB` is the dense (B, 1, L, L) mask handed to the model: 0 under sdpa, whose kernel
    takes the layout as a few index tensors instead.
    Timings on a shared machine drift: modes are interleaved within each repeat so drift hits them
    alike, and each mode reports its fastest repeat (the work is deterministic, so noise from other
    jobs only ever adds time; `timeit` takes the minimum for the same reason). Targets, checked at
    the end: packed >= 5x unpacked
    at P=512, R=32, and auto never more than 5% slower than unpacked anywhere on the grid.

async
    The same training run (tiny model, default options, evaluation off) in --mode sync and --mode
    async, in `--rounds` interleaved pairs of runs (sync, async, sync, async, ...) so that drifting
    machine load hits both alike: seconds per iteration of each (mean over all timed iterations,
    each run's first iteration dropped), the speedup and its range over the rounds, the phase
    times T_gen and T_train measured in sync mode, and two bounds: `ideal`
    (T_gen + T_train) / max(T_gen, T_train), a perfect pipeline, and `bound`, what the pipeline can
    gain at the sizes it runs: the probe's prediction (`sizing.choose`: the probe's measured arrival of
    every group, trained by the learner's rule, against the same sizes taken in turns at all cores), so
    streaming by completion inside one generate call counts, and the fill (until the first
    micro-batch is there) and the drain (the last one's training) overlap nothing; exactly 1.00x when
    the probe takes turns. With every size given (no probe) it is `pipeline_bound`: n equal chunks
    per iteration, the first chunk's generation and the last one's training overlapping nothing.
    `--chunk-sweep` runs the default
    workload at several --groups-per-chunk instead: batching vs streaming. Both modes run at the sizes
    async's probe picks (`probed_sizes`, probed once per workload: the same generate calls and
    micro-batch, so the two compare at the same sizes); sync uses all cores, async the probe's split.
    Workloads beyond the default vary the balance (long responses, big groups, few groups, 4 prompts
    per generate call, several updates per iteration). Targets, on the default workload: async at
    least 90% of its `bound`; on every
    workload async at least as fast as sync.

peer
    The same work through TRL 1.16's `GRPOTrainer` (`tools/trl_grpo_run.py`, run by `--trl-python`, a
    separate virtualenv: TRL is never a requirement) and through `trainer.py --mode sync` and
    `--mode async` at their defaults: the tiny model, 16 arithmetic prompts x 8 samples per step, at
    most 8 new tokens, temperature 1, beta 0.04, dapo loss, AdamW lr 1e-4, float32, all cores, no
    evaluation or saving on either side. Each run is a fresh process; contenders are interleaved
    within each of `--rounds` rounds; samples/s = 128 / mean seconds per step (first step dropped),
    and each contender's ratio to TRL, with each one's mean response length (the two train their own
    policies, so lengths drift apart a little). `--task chain`: the `tiny-chain` model on the chain
    task (worked sums, responses of 5 to ~100 tokens with a long tail, <= 128 new tokens), the
    workload where streaming groups by completion pays. Targets: both modes at least TRL's
    samples/s, async at least sync's, and on `--task chain` async at least 1.5x TRL's.

publish
    Moving θ_k to the inference process: `WeightBuffer.publish` (copy into shared memory),
    `load_into` when the inference model's parameters alias the buffer (CPU: a version check) and
    when they do not (GPU/NPU: one copy), a plain memcpy of the same bytes, and the alternative of
    sending a pickled state_dict through a multiprocessing queue to a spawned process. For the tiny
    model and a Qwen2.5-0.5B-shaped random model (494 M parameters, fp32).

tri-model
    One GRPO training step on one group (P=64, R=32, G=8) through `TriModel`, with the reference
    off (beta = 0) or on, and one or four updates per iteration (the old-policy copy exists only
    with more than one): parameter bytes of each copy, AdamW state bytes, bytes saved for
    backward, and step time.

memory
    Peak training memory of one GRPO step (the policy forward/backward with the reference forward,
    beta 0.04, AdamW step) for the Qwen2.5-0.5B configuration with random weights on one group,
    P=256, R=512, G=8, as `TriModel` runs it: log-probs from the hidden states in checkpointed
    chunks (the default), the same with `--gradient-checkpointing`, and the whole (tokens x vocab)
    float32 logits at once (what chunking replaces). Measured as the peak of live tensor bytes
    (`LiveTensorBytes`: what torch.cuda.max_memory_allocated reports on a GPU, without the
    allocator's rounding and cache), at 2, 4 and 24 layers: every layer is the same computation, so
    the peak is linear in the layers and a variant too big for this machine's RAM at 24 layers is
    skipped with its linear prediction. float32 compute on CPU by default (this CPU has no native
    bf16).

To add a benchmark: write `<name>_args(parser)` and `<name>(args) -> bool` (True = all targets
met) and register them in BENCHMARKS.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import pickle
import shlex
import statistics
import sys
import time
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import attention
import packing


# --- shared-prompt ---

SHARED_PROMPT_GRID = [(P, R) for P in (32, 128, 512, 1024) for R in (16, 64, 256)] + [(512, 32)]
SHARED_PROMPT_QUICK = [(512, 32), (32, 256)]
TARGET_CELL = (512, 32)
MODES = ("packed", "unpacked", "auto")


def shared_prompt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two cells only (smoke test)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt (G)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed steps per mode and cell, after one warm-up; the fastest is reported")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 by default because on a shared 2-core machine a second "
                             "thread waiting on a busy core made every op ~10x slower, swamping the comparison")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention implementation")
    parser.add_argument("--mask", default="structured", choices=("structured", "dense"),
                        help="packed rows under sdpa: the structured kernel, or the dense (1, 1, L, L) mask "
                             "(what the structured kernel saves; eager always takes the dense mask)")


def bench_model(attn_implementation: str, device: str) -> torch.nn.Module:
    """Random-weight Qwen2-shaped model: 6 layers, hidden 256, 4 query / 2 KV heads, vocab 4096."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=704, vocab_size=4096, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(config, attn_implementation=attn_implementation).to(device).train()


def grpo_like_step(model: torch.nn.Module, groups: list, advantages: torch.Tensor, mode: str,
                   dense_mask: bool = False) -> None:
    """Forward + backward of the token-mean policy-gradient loss; gradients are cleared first."""
    model.zero_grad(set_to_none=True)
    logp, mask = packing.batch_logprobs(model, groups, mode=mode, dense_mask=dense_mask)  # (N, T)
    loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
    loss.backward()


def saved_for_backward_bytes(model: torch.nn.Module, step: Callable[[], None]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during `step`."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        step()
    return sum(saved.values())


def peak_bytes(model: torch.nn.Module, step: Callable[[], None], device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    return saved_for_backward_bytes(model, step)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of `repeats` calls of fn."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def clock(device: str, threads: int) -> Callable[[], float]:
    """Wall clock; single-threaded on CPU, this process's CPU time, so time other jobs hold the core is not counted."""
    return time.process_time if device == "cpu" and threads == 1 else time.perf_counter


def timed(step: Callable[[], None], device: str, now: Callable[[], float]) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = now()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return now() - start


def forward_macs(config, P: int, R: int, G: int, packed: bool) -> float:
    """Multiply-accumulates of one forward over G responses of length R to one P-token prompt.

    h hidden, H / H_kv query / key-value heads of width D, I MLP width, V vocabulary, n layers:
        per token and layer       h·H·D (q) + 2·h·H_kv·D (k, v) + H·D·h (o) + 3·h·I (MLP)
        per score pair and layer  2·H·D (q·k, then weights·v)
        per response token        h·V (lm head; the same G·R positions in either layout)
    Tokens: G(P+R) unpacked, P+GR packed. Pairs, what the mask allows: G(P+R)(P+R+1)/2 unpacked,
    P(P+1)/2 + G·R·(P + (R+1)/2) packed. Backward costs about twice every term, so
    forward_macs(unpacked) / forward_macs(packed) is the most packing can speed up a whole step when
    every kernel runs at one speed: the ceiling a measured unp/pk is read against.
    """
    h, n, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or h // H
    per_token = h * H * D + 2 * h * H_kv * D + H * D * h + 3 * h * config.intermediate_size
    per_pair = 2 * H * D
    if packed:
        tokens, pairs = P + G * R, P * (P + 1) / 2 + G * R * (P + (R + 1) / 2)
    else:
        tokens, pairs = G * (P + R), G * (P + R) * (P + R + 1) / 2
    return n * (tokens * per_token + pairs * per_pair) + G * R * h * V


def mac_ceiling(config, P: int, R: int, G: int) -> float:
    """forward_macs unpacked / packed: the speedup packing would give if time were proportional to work."""
    return forward_macs(config, P, R, G, packed=False) / forward_macs(config, P, R, G, packed=True)


QWEN25_SHAPES = {  # published configs (config.json on the Hub), for the ceiling at the target cell
    "Qwen2.5-0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "Qwen2.5-7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
}


def shared_prompt_cell(model: torch.nn.Module, P: int, R: int, G: int, repeats: int, device: str,
                       now: Callable[[], float], dense_mask: bool = False) -> dict:
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (P,), device=device)
    responses = [torch.randint(1, vocab, (R,), device=device) for _ in range(G)]
    groups = [(prompt, responses)]
    advantages = torch.randn(G, device=device)
    steps = {mode: (lambda mode=mode: grpo_like_step(model, groups, advantages, mode, dense_mask)) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(repeats + 1):  # modes interleaved, order rotated, so drifting load hits all alike
        for mode in MODES[repeat % 3:] + MODES[:repeat % 3]:
            seconds = timed(steps[mode], device, now)
            if repeat > 0:  # the first round is warm-up
                times[mode].append(seconds)
    best = {mode: min(times[mode]) for mode in MODES}  # noise only ever adds time: the minimum is the cost
    L = P + G * R
    # the structured kernel takes no mask; else a dense (1, 1, L, L) mask: additive floats (eager), bool (sdpa)
    if model.config._attn_implementation == "sdpa":
        dense_mask_bytes = L * L if dense_mask else 0
    else:
        dense_mask_bytes = L * L * model.dtype.itemsize
    return {
        "P": P, "R": R, "G": G, "packed_len": L, "token_ratio": G * (P + R) / L,
        "mac_ceiling": mac_ceiling(model.config, P, R, G),
        "packed_s": best["packed"], "unpacked_s": best["unpacked"], "auto_s": best["auto"],
        "auto_choice": "packed" if packing.packing_pays(P, [R] * G) else "unpacked",
        "predicted_packed_over_unpacked": packing.packing_cost_ratio(P, [R] * G),
        "speedup_packed": best["unpacked"] / best["packed"], "speedup_auto": best["unpacked"] / best["auto"],
        "memory_packed_bytes": peak_bytes(model, steps["packed"], device),
        "memory_unpacked_bytes": peak_bytes(model, steps["unpacked"], device),
        "mask_bytes": dense_mask_bytes,
    }


def fit_break_even_len(rows: list[dict]) -> int:
    """The `break_even_len` whose `packing_cost_ratio` best matches the measured packed/unpacked (log least squares)."""
    def error(length: float) -> float:
        return sum((math.log(packing.packing_cost_ratio(row["P"], [row["R"]] * row["G"], length))
                    - math.log(row["packed_s"] / row["unpacked_s"])) ** 2 for row in rows)
    candidates = [round(100 * 1.05 ** i) for i in range(100)]  # 100 .. ~12000
    return min(candidates, key=error)


def shared_prompt(args: argparse.Namespace) -> bool:
    """Training-step time and memory, packed vs unpacked vs auto, over a (P, R) grid."""
    from transformers import Qwen2Config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    model = bench_model(args.attn, device)
    dense_mask = args.mask == "dense"
    cells = SHARED_PROMPT_QUICK if args.quick else SHARED_PROMPT_GRID
    memory_measure = ("peak CUDA bytes allocated during the step" if device == "cuda" else
                      "bytes of distinct non-parameter tensors saved for backward")
    packed_path = "dense mask" if dense_mask or args.attn == "eager" else "structured kernel"
    c = model.config
    print(f"shared-prompt: Qwen2-shaped, {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads "
          f"{c.num_attention_heads}/{c.num_key_value_heads}, vocab {c.vocab_size}, {model.dtype}, {args.attn}, "
          f"packed rows through the {packed_path}, {device}, {args.threads} thread(s), G={args.group_size}; "
          f"one step = forward + backward; fastest of {args.repeats} after 1 warm-up")
    time_measure = "process CPU seconds" if clock(device, args.threads) is time.process_time else "wall-clock seconds"
    print(f"time: {time_measure}; memory: {memory_measure}; mask = dense (B,1,L,L) mask passed to the model; "
          f"MAC ceil = forward_macs unpacked / packed, the most packing can give")
    header = (f"{'P':>5} {'R':>4} {'L':>5} {'tokens x':>8} {'MAC ceil':>8} {'packed s':>9} {'unpack s':>9} "
              f"{'auto s':>8} {'auto':>8} {'pred pk/unp':>11} {'unp/pk':>7} {'unp/auto':>8} {'mem pk MB':>9} "
              f"{'mem unp MB':>10} {'mask MB':>7}")
    print(header)
    rows = []
    for P, R in cells:
        row = shared_prompt_cell(model, P, R, args.group_size, args.repeats, device, clock(device, args.threads),
                                 dense_mask)
        rows.append(row)
        print(f"{P:>5} {R:>4} {row['packed_len']:>5} {row['token_ratio']:>8.2f} {row['mac_ceiling']:>8.2f} "
              f"{row['packed_s']:>9.3f} {row['unpacked_s']:>9.3f} {row['auto_s']:>8.3f} {row['auto_choice']:>8} "
              f"{row['predicted_packed_over_unpacked']:>11.2f} {row['speedup_packed']:>7.2f} "
              f"{row['speedup_auto']:>8.2f} {row['memory_packed_bytes'] / 2**20:>9.1f} "
              f"{row['memory_unpacked_bytes'] / 2**20:>10.1f} {row['mask_bytes'] / 2**20:>7.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "shared-prompt", "device": device, "threads": args.threads, "time": time_measure,
                       "memory_measure": memory_measure, "packed_path": packed_path, "rows": rows}, f, indent=2)

    print(f"packing_pays: ATTENTION_BREAK_EVEN_LEN={packing.ATTENTION_BREAK_EVEN_LEN} in use; "
          f"this run's timings fit {fit_break_even_len(rows)}")
    P, R = TARGET_CELL
    G = args.group_size
    target = next(row for row in rows if (row["P"], row["R"]) == TARGET_CELL)
    shapes = ", ".join(f"{name} {mac_ceiling(Qwen2Config(**shape), P, R, G):.2f}x"
                       for name, shape in QWEN25_SHAPES.items())
    print(f"MAC ceiling at P={P}, R={R}, G={G}: this model {target['mac_ceiling']:.2f}x (measured "
          f"{target['speedup_packed']:.2f}x = {target['speedup_packed'] / target['mac_ceiling']:.0%} of it); {shapes}")
    slowest_auto = min(rows, key=lambda row: row["speedup_auto"])
    checks = [
        (target["speedup_packed"] >= 5.0,
         f"packed >= 5x faster than unpacked at P={P}, R={R}, G={G}: {target['speedup_packed']:.2f}x"),
        (slowest_auto["speedup_auto"] >= 1 / 1.05,
         f"auto never > 5% slower than unpacked: worst unpacked/auto = {slowest_auto['speedup_auto']:.3f} "
         f"at P={slowest_auto['P']}, R={slowest_auto['R']}"),
    ]
    for ok, line in checks:
        print(("PASS " if ok else "FAIL ") + line)
    return all(ok for ok, _ in checks)


# --- async: the same work, synchronous vs periodic asynchrony ---
ASYNC_WORKLOADS = {  # name -> trainer options on top of the tiny defaults (16 prompts x 8, <= 8 new tokens)
    "default": [],
    "long responses": ["--max-new-tokens", "24", "--reward", "tests/rewards.py:digit_fraction"],
    "big groups": ["--group-size", "16"],
    "few groups": ["--batch-size", "32"],
    "chunks of 4": ["--groups-per-chunk", "4"],
    "4 updates/iter": ["--updates-per-iteration", "4"],
}
PHASE_KEYS = ("iteration_s", "generate_s", "train_s", "idle_inference_s", "idle_training_s", "overlap")


def time_schedule(argv: list[str], iterations: int) -> list[dict[str, float]]:
    """Run trainer.py's schedule in this process; the per-iteration figures, first iteration dropped."""
    import periodic_rl
    import trainer
    from config import parse_args

    cfg = parse_args([*argv, "--iterations", str(iterations + 1), "--eval-every", "0", "--no-save"])
    loaded = trainer.load(cfg)  # the trainer's own loading: devices, task, reward, inference process, policy
    try:
        rows = [row for row in periodic_rl.train(cfg, **loaded._asdict()) if not row.get("final")][1:]
    finally:
        if loaded.rollouts is not None:
            loaded.rollouts.close()
    return [{key: row[key] for key in PHASE_KEYS} for row in rows]


def async_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the default workload only")
    parser.add_argument("--iterations", type=int, default=10, help="timed iterations per run (one more is dropped)")
    parser.add_argument("--rounds", type=int, default=3, help="sync/async run pairs per workload, interleaved")
    parser.add_argument("--trainer-args", default="", metavar="ARGS",
                        help="trainer.py options added to every workload, "
                             "e.g. \"--groups-per-chunk 8 --rollout-threads 2\"")
    parser.add_argument("--chunk-sweep", action="store_true",
                        help="instead: the default workload at 1, 2, 4, 8 and 16 prompts per chunk (no targets)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


CHUNK_SWEEP = (1, 2, 4, 8, 16)


def pipeline_bound(t_gen: float, t_train: float, chunks: int) -> float:
    """Best speedup of a two-stage pipeline over running the stages back to back, n equal chunks.

    A chunk is what flows through the pipeline: one group, or --groups-per-chunk groups. Per chunk
    g = T_gen / n and t = T_train / n. Sync takes n(g + t); the pipeline takes
    g + t + (n - 1) max(g, t): the first chunk's generation (fill) and the last chunk's training
    (drain) overlap nothing. As n grows this tends to (T_gen + T_train) / max(T_gen, T_train).
    """
    g, t = t_gen / chunks, t_train / chunks
    return chunks * (g + t) / (g + t + (chunks - 1) * max(g, t))


def probed_sizes(argv: list[str]) -> tuple[list[str], list[str], float | None]:
    """The options async mode's probe picks for `argv` (probed once, here): (the generate calls and the
    micro-batch, which both modes then use, so that they compare at the same sizes; the thread split,
    async's only; the probe's predicted speedup over taking turns at these sizes, None if nothing was probed)."""
    import sizing
    import trainer
    from config import parse_args
    from periodic_rl import settings_of
    from tri_model import TriModel

    cfg = parse_args([*argv, "--mode", "async"])
    if cfg.sized:
        return [], [], None
    loaded = trainer.load(dataclasses.replace(cfg, mode="sync"))  # the policy only, no inference process
    tri = TriModel(loaded.policy, use_reference=cfg.beta > 0, use_old=cfg.updates_per_iteration > 1,
                   pad_id=loaded.tokenizer.pad_token_id)
    chosen, _, gain = sizing.choose(cfg, tri, loaded.tokenizer, loaded.train_examples, settings_of(cfg))
    return (["--groups-per-chunk", str(chosen.groups_per_chunk), "--micro-batch-tokens", str(chosen.micro_batch_tokens)],
            ["--rollout-threads", str(chosen.rollout_threads), "--train-threads", str(chosen.train_threads)], gain)


def async_workload(argv: list[str], iterations: int, rounds: int) -> dict:
    """`rounds` pairs of runs, sync then async, so that drifting machine load hits both modes alike,
    both at the generate calls async's probe picks (`probed_sizes`).

    Seconds per iteration are means over all timed iterations of all rounds (what a long run would
    see); the speedup is their ratio, and each round's own ratio shows the spread.
    """
    from config import parse_args
    calls, threads, predicted = probed_sizes(argv)
    argv = [*argv, *calls]
    runs: dict[str, list[list[dict]]] = {"sync": [], "async": []}
    for _ in range(rounds):
        for mode in runs:
            runs[mode].append(time_schedule([*argv, "--mode", mode, *(threads if mode == "async" else [])],
                                            iterations))

    def mean(mode: str, key: str, round_: int | None = None) -> float:
        chosen = runs[mode] if round_ is None else [runs[mode][round_]]
        return statistics.mean(row[key] for rows in chosen for row in rows)

    t_gen, t_train = mean("sync", "generate_s"), mean("sync", "train_s")
    chunks = parse_args(argv).chunks_per_iteration  # the pipeline's units
    per_round = [mean("sync", "iteration_s", r) / mean("async", "iteration_s", r) for r in range(rounds)]
    return {"sync_s_per_iter": mean("sync", "iteration_s"), "async_s_per_iter": mean("async", "iteration_s"),
            "speedup": mean("sync", "iteration_s") / mean("async", "iteration_s"), "speedup_per_round": per_round,
            "ideal_speedup": (t_gen + t_train) / max(t_gen, t_train),
            "pipeline_bound": pipeline_bound(t_gen, t_train, chunks), "chunks_per_iteration": chunks,
            "predicted_speedup": predicted,  # the probe's: streaming by completion counted, at async's threads
            "bound": predicted if predicted is not None else pipeline_bound(t_gen, t_train, chunks),
            "sync_generate_s": t_gen,
            "sync_train_s": t_train, "async_generate_s": mean("async", "generate_s"),
            "async_train_s": mean("async", "train_s"), "async_overlap": mean("async", "overlap"),
            "sizes": " ".join(calls + threads), "iterations": iterations, "rounds": rounds}


def async_speedup(args: argparse.Namespace) -> bool:
    """Seconds per iteration, synchronous vs periodic asynchrony, on the same work."""
    results = {}
    if args.chunk_sweep:
        workloads = {f"chunks of {c}": ["--groups-per-chunk", str(c)] for c in CHUNK_SWEEP}
    else:
        workloads = {name: ASYNC_WORKLOADS[name] for name in (["default"] if args.quick else ASYNC_WORKLOADS)}
    print(f"{args.rounds} rounds x (sync run, async run) per workload, {args.iterations} timed iterations each; "
          f"sync: {os.cpu_count()} threads; async: the cores split between the two processes "
          f"(all to each when an iteration is one chunk)")
    print(f"{'workload':16s} {'sync s/it':>10s} {'async s/it':>10s} {'speedup':>8s} {'per round':>12s} "
          f"{'bound':>6s} {'ideal':>6s} {'T_gen':>6s} {'T_train':>7s} {'overlap':>8s}")
    for name, argv in workloads.items():
        row = results[name] = async_workload([*argv, *shlex.split(args.trainer_args)], args.iterations, args.rounds)
        spread = f"{min(row['speedup_per_round']):.2f}-{max(row['speedup_per_round']):.2f}x"
        print(f"{name:16s} {row['sync_s_per_iter']:10.3f} {row['async_s_per_iter']:10.3f} {row['speedup']:7.2f}x "
              f"{spread:>12s} {row['bound']:5.2f}x {row['ideal_speedup']:5.2f}x "
              f"{row['sync_generate_s']:6.3f} {row['sync_train_s']:7.3f} "
              f"{row['async_overlap']:8.0%}", flush=True)
    if args.chunk_sweep:  # a trade-off to read, not a target: one chunk per iteration has nothing to overlap
        fastest = min(results, key=lambda name: min(results[name]["sync_s_per_iter"],
                                                     results[name]["async_s_per_iter"]))
        print(f"fastest configuration: {fastest}, "
              f"{'sync' if results[fastest]['sync_s_per_iter'] < results[fastest]['async_s_per_iter'] else 'async'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"workloads": results}, f, indent=1)
        return True
    default = results["default"]
    checks = [(default["speedup"] >= 0.9 * default["bound"],
               f"async >= 90% of its pipeline bound on the default workload: {default['speedup']:.2f}x of "
               f"{default['bound']:.2f}x"),
              (all(r["speedup"] >= 1.0 for r in results.values()),
               "async never slower than sync: worst " + f"{min(r['speedup'] for r in results.values()):.2f}x")]
    for ok, line in checks:
        print(("PASS " if ok else "FAIL ") + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**default, "workloads": results}, f, indent=1)
    return all(ok for ok, _ in checks)


# --- peer: the same work through TRL's GRPOTrainer ---
PEER_TASKS = {"arithmetic": ("tiny", 8), "chain": ("tiny-chain", 128)}  # --task -> (model, default max new tokens)
PEER_TARGETS = {"arithmetic": 1.0, "chain": 1.5}  # async at least this times TRL's samples/s
PEER_CONTENDERS = {  # name -> trainer.py options (None: TRL)
    "TRL GRPOTrainer": None,
    "periodic-rl sync": ["--mode", "sync"],
    "periodic-rl async": ["--mode", "async"],
}


def peer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trl-python", default=".venv-trl/bin/python",
                        help="a Python with trl==1.16.0 installed (see tools/trl_grpo_run.py)")
    parser.add_argument("--iterations", type=int, default=10, help="timed steps per run (one more is dropped)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each contender, interleaved")
    parser.add_argument("--task", choices=PEER_TASKS, default="arithmetic",
                        help="arithmetic: the toy (responses of ~4 tokens); chain: long-tailed responses of 5-100 "
                             "tokens (the tiny-chain model)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 8 (arithmetic), 128 (chain)")
    parser.add_argument("--trainer-args", default="", metavar="ARGS",
                        help="extra trainer.py options for both periodic-rl contenders")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


def peer_run(name: str, argv: list[str] | None, args: argparse.Namespace) -> tuple[float, float]:
    """One fresh process of a contender: its mean seconds per step (optimizer step = 128 samples) and mean
    response length in tokens, first step dropped."""
    import subprocess
    import tempfile
    model, default_tokens = PEER_TASKS[args.task]
    common = ["--model", model, "--max-new-tokens", str(args.max_new_tokens or default_tokens)]
    if argv is None:
        out = subprocess.run([args.trl_python, "tools/trl_grpo_run.py", "--steps", str(args.iterations), *common],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"TRL run failed (is trl==1.16.0 installed in {args.trl_python}?):\n{out.stderr[-2000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        return statistics.mean(result["seconds_per_step"]), result["mean_completion_length"]
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "trainer.py", *argv, *common, "--iterations", str(args.iterations + 1),
                   "--eval-every", "0", "--no-save", "--out", tmp, *shlex.split(args.trainer_args)]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(os.path.join(tmp, "metrics.jsonl"))]
    timed = [row for row in rows if not row.get("final") and row["iteration"] > 0]
    return (statistics.mean(row["iteration_s"] for row in timed),
            statistics.mean(row["response_length"] for row in timed))


def peer(args: argparse.Namespace) -> bool:
    """Samples/s of TRL's GRPOTrainer and of periodic-rl (sync, async) on the same work, interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in PEER_CONTENDERS}
    lengths: dict[str, list[float]] = {name: [] for name in PEER_CONTENDERS}
    model, default_tokens = PEER_TASKS[args.task]
    print(f"{args.rounds} rounds x {len(times)} contenders, {args.iterations} timed steps each ({args.task}: {model}, "
          f"16 prompts x 8, <= {args.max_new_tokens or default_tokens} new tokens, beta 0.04, {os.cpu_count()} "
          "cores), fresh process per run")
    for round_ in range(args.rounds):
        for name, argv in PEER_CONTENDERS.items():
            seconds, length = peer_run(name, argv, args)
            times[name].append(seconds)
            lengths[name].append(length)
            print(f"round {round_}: {name:20s} {128 / seconds:7.0f} samples/s  (mean response {length:.1f} tokens)",
                  flush=True)
    trl = [128 / t for t in times["TRL GRPOTrainer"]]
    results = {}
    print(f"{'contender':20s} {'samples/s':>10s} {'vs TRL':>8s} {'per round':>12s}  {'mean response':>13s}")
    for name, seconds in times.items():
        rates = [128 / t for t in seconds]
        ratios = [r / q for r, q in zip(rates, trl)]
        results[name] = {"samples_per_s": statistics.mean(rates), "vs_trl": statistics.mean(rates) / statistics.mean(trl),
                         "vs_trl_per_round": ratios, "seconds_per_step": seconds,
                         "mean_response_tokens": statistics.mean(lengths[name])}
        print(f"{name:20s} {results[name]['samples_per_s']:10.0f} {results[name]['vs_trl']:7.2f}x "
              f"{min(ratios):5.2f}-{max(ratios):.2f}x  {results[name]['mean_response_tokens']:6.1f} tokens", flush=True)
    target = PEER_TARGETS[args.task]
    checks = [(results["periodic-rl async"]["vs_trl"] >= target, f"async (defaults) >= {target}x TRL"),
              (results["periodic-rl sync"]["vs_trl"] >= 1.0, "sync (defaults) >= TRL"),
              (results["periodic-rl async"]["samples_per_s"] >= results["periodic-rl sync"]["samples_per_s"],
               "async >= sync")]
    for ok, line in checks:
        print(("PASS " if ok else "FAIL ") + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return all(ok for ok, _ in checks)


# --- publish: cost of moving θ to the inference process ---
def qwen_05b_shaped(tiny: bool, layers: int = 24) -> torch.nn.Module:
    """Random weights in Qwen2.5-0.5B's shape (494M parameters), or the tiny model's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if tiny:
        from models import load_model
        return load_model("tiny")[0]
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1e6, max_position_embeddings=32768)
    with torch.device("cpu"):
        return Qwen2ForCausalLM(config)


def _receive_pickled(q, done):
    """Child process: receive a pickled state_dict, unpickle it, report the time it finished."""
    done.put("ready")  # start-up (importing torch) is not part of the cost being measured
    blob = q.get()
    pickle.loads(blob)
    done.put(time.perf_counter())


def publish_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


def publish(args: argparse.Namespace) -> bool:
    """Cost of publishing θ through the shared-memory buffer vs memcpy vs a pickled state_dict on a queue."""
    import torch.multiprocessing as mp
    from periodic_rl import WeightBuffer
    results = {}
    print(f"{'model':22s} {'MB':>7s} {'publish':>8s} {'load(view)':>10s} {'load(copy)':>10s} {'memcpy':>8s} "
          f"{'pickle+queue':>12s}   (seconds, median of {args.repeats})")
    for name, tiny in (("tiny", True), ("qwen2.5-0.5b-shaped", False)):
        model = qwen_05b_shaped(tiny)
        buffer = WeightBuffer(model)
        receiver = copy.deepcopy(model) if tiny else qwen_05b_shaped(False)
        nbytes = buffer.flat.numel() * buffer.flat.element_size()
        src, dst = torch.empty_like(buffer.flat), torch.empty_like(buffer.flat)
        publish = median_seconds(lambda: buffer.publish(model, 1), args.repeats)
        aliased = copy.deepcopy(receiver) if tiny else receiver
        buffer.attach(aliased)
        load_view = median_seconds(lambda: buffer.load_into(aliased, 1), args.repeats)
        buffer.aliased = False  # as on a GPU: a real copy into the receiver's own parameters
        copy_target = copy.deepcopy(model)
        load_copy = median_seconds(lambda: buffer.load_into(copy_target, 1), args.repeats)
        memcpy = median_seconds(lambda: dst.copy_(src), args.repeats)
        context = mp.get_context("spawn")
        q, done = context.Queue(), context.Queue()
        child = context.Process(target=_receive_pickled, args=(q, done), daemon=True)
        child.start()
        done.get()
        start = time.perf_counter()
        q.put(pickle.dumps(model.state_dict()))
        pickled = done.get() - start
        child.join()
        results[name] = {"bytes": nbytes, "publish_s": publish, "load_view_s": load_view, "load_copy_s": load_copy,
                         "memcpy_s": memcpy, "pickle_queue_s": pickled}
        print(f"{name:22s} {nbytes / 2**20:7.1f} {publish:8.4f} {load_view:10.6f} {load_copy:10.4f} {memcpy:8.4f} "
              f"{pickled:12.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return True


# --- tri-model: memory and step time with/without the reference and old copies ---
def tri_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", dest="tri_model", default="tiny", help="model name or path (models.load_model)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps; the median is reported")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


def tri_model(args: argparse.Namespace) -> bool:
    """Memory and step time of the tri-model with the reference on/off and 1 or 4 updates per iteration."""
    from grpo import grpo_loss
    from tri_model import TriModel
    from models import load_model
    results = {}
    policy_template, tokenizer = load_model(args.tri_model)
    torch.manual_seed(0)
    prompt = torch.randint(3, len(tokenizer), (64,))  # (P,)
    responses = [torch.randint(3, len(tokenizer), (32,)) for _ in range(8)]  # G x (R,)
    advantages = torch.randn(8)
    print(f"{'reference':>9s} {'N':>3s} {'params MB (policy/old/ref)':>28s} {'optimizer MB':>12s} "
          f"{'saved activations MB':>20s} {'step ms':>8s}")
    for beta, updates in ((0.0, 1), (0.04, 1), (0.0, 4), (0.04, 4)):
        policy = copy.deepcopy(policy_template)
        tri = TriModel(policy, use_reference=beta > 0, use_old=updates > 1)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)

        def step():
            logp, old, ref, mask = tri([(prompt, responses)])
            loss, _ = grpo_loss(logp, old, ref, advantages, mask, beta=beta)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        activation = saved_for_backward_bytes(policy, step)  # also the warm-up step
        step_s = median_seconds(step, args.repeats)
        memory = tri.memory_report()
        optim = sum(s.numel() * s.element_size() for state in optimizer.state.values() for s in state.values()
                    if torch.is_tensor(s))
        row = {**memory, "optimizer_bytes": optim, "activation_bytes": activation,
               "step_s": step_s, "beta": beta, "updates_per_iteration": updates}
        results[f"beta={beta},N={updates}"] = row
        mb = 2 ** 20
        print(f"{'on' if beta > 0 else 'off':>9s} {updates:3d} "
              f"{memory['policy_bytes'] / mb:9.1f} /{memory['old_bytes'] / mb:7.1f} "
              f"/{memory['reference_bytes'] / mb:7.1f} "
              f"{optim / mb:12.1f} {activation / mb:20.1f} {row['step_s'] * 1e3:8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return True


# --- memory ---

MEMORY_VARIANTS = ("chunked", "checkpointed", "whole-logits")  # default; + --gradient-checkpointing; unchunked


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of tensor storage alive and their peak, counting `existing` tensors and every one made inside.

    The CPU counterpart of torch.cuda.max_memory_allocated (without allocator rounding or cache): a
    storage is counted when an op returns it and uncounted when it is freed.
    """

    def __init__(self, existing=()):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        for tensor in existing:
            self._count(tensor)

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = id(storage), storage.nbytes()
        if key in self._refs:
            return

        def freed(_, key=key, size=size):
            self._refs.pop(key, None)
            self.live -= size
        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out


def memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", default="2,4,24", help="decoder layer counts, comma-separated (Qwen2.5-0.5B has "
                                                           "24); variants that do not fit in RAM at a count are skipped")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype (bf16 matrix products are ~80x slower than float32 on a CPU without "
                             "native bf16)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE")


def grpo_step_peak(variant: str, dtype: torch.dtype, layers: int, P: int, R: int, G: int) -> dict:
    """Peak live tensor bytes of one GRPO step (policy fwd/bwd + reference fwd + AdamW step) as the trainer runs it."""
    from grpo import grpo_loss
    from tri_model import TriModel
    torch.manual_seed(0)
    policy = qwen_05b_shaped(tiny=False, layers=layers).train()
    if variant == "checkpointed":
        packing.enable_activation_checkpointing(policy)
    tri = TriModel(policy, use_reference=True, use_old=False, compute_dtype=dtype)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    vocab = policy.config.vocab_size
    group = (torch.randint(vocab, (P,)), [torch.randint(vocab, (R,)) for _ in range(G)])
    weights = list(policy.parameters()) + list(tri.reference.parameters())
    chunk_bytes = attention.LOGITS_CHUNK_BYTES
    attention.LOGITS_CHUNK_BYTES = 2 ** 62 if variant == "whole-logits" else chunk_bytes
    start = time.perf_counter()
    try:
        with LiveTensorBytes(weights) as tracker:
            logp, old, ref, mask = tri([group])
            loss, _ = grpo_loss(logp, old, ref, torch.randn(G), mask, beta=0.04)
            loss.backward()
            backward_peak = tracker.peak
            optimizer.step()
    finally:
        attention.LOGITS_CHUNK_BYTES = chunk_bytes
    return {"variant": variant, "dtype": str(dtype).removeprefix("torch."), "layers": layers,
            "layout": "packed" if packing.packing_pays(P, [R] * G) else "plain rows",
            "parameters": sum(p.numel() for p in policy.parameters()),
            "weight_bytes": sum(w.untyped_storage().nbytes() for w in weights),
            "backward_peak_bytes": backward_peak, "peak_bytes": tracker.peak, "step_s": time.perf_counter() - start}


def memory(args: argparse.Namespace) -> bool:
    """Peak training memory of one GRPO step on the Qwen2.5-0.5B configuration, per log-prob / checkpointing variant."""
    torch.set_num_threads(args.threads)
    dtype, layer_counts = getattr(torch, args.dtype), [int(n) for n in args.layers.split(",")]
    print(f"one GRPO step (policy fwd/bwd + reference fwd + AdamW), Qwen2.5-0.5B config, random weights, "
          f"P={args.prompt_len}, R={args.response_len}, G={args.group_size}, {args.dtype} compute on CPU; "
          f"peak live tensor bytes (LiveTensorBytes); GiB = 2^30 bytes")
    print(f"{'variant':<14} {'layers':>6} {'layout':<10} {'weights':>8} {'fwd/bwd peak':>12} {'above weights':>13} "
          f"{'peak with AdamW':>15} {'step s':>7}")
    rows, gib = [], 2 ** 30
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for variant in MEMORY_VARIANTS:
        fitted = []
        for layers in layer_counts:
            if len(fitted) >= 2:  # the rise is linear in the layers (identical layers): predict before running
                (l1, b1), (l2, b2) = fitted[:2]
                predicted = b1 + (b2 - b1) / (l2 - l1) * (layers - l1)
                if predicted > 0.8 * ram:
                    print(f"{variant:<14} {layers:6d}  skipped: predicted fwd/bwd peak {predicted / gib:.1f} GiB "
                          f"(linear in the layers from {l1} and {l2}) > 80% of this machine's {ram / gib:.0f} GiB")
                    continue
            row = grpo_step_peak(variant, dtype, layers, args.prompt_len, args.response_len, args.group_size)
            rows.append(row)
            fitted.append((layers, row["backward_peak_bytes"]))
            print(f"{variant:<14} {layers:6d} {row['layout']:<10} {row['weight_bytes'] / gib:8.2f} "
                  f"{row['backward_peak_bytes'] / gib:12.2f} "
                  f"{(row['backward_peak_bytes'] - row['weight_bytes']) / gib:13.2f} "
                  f"{row['peak_bytes'] / gib:15.2f} {row['step_s']:7.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return True


# --- dispatch ---

BENCHMARKS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], bool]]] = {
    "shared-prompt": (shared_prompt_args, shared_prompt),
    "async": (async_args, async_speedup),
    "publish": (publish_args, publish),
    "tri-model": (tri_model_args, tri_model),
    "memory": (memory_args, memory),
    "peer": (peer_args, peer),
}


def main() -> None:
    import transformers
    transformers.utils.logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    subparsers = parser.add_subparsers(dest="which", required=True)
    for name, (add_args, run) in BENCHMARKS.items():
        add_args(subparsers.add_parser(name, help=run.__doc__.splitlines()[0]))
    args = parser.parse_args()
    run = BENCHMARKS[args.which][1]
    raise SystemExit(0 if run(args) else 1)


if __name__ == "__main__":
    main()
