"""`python bench.py gpu`: the GPU table in one command (~10-20 minutes of one H100), five parts, each printed as it
finishes and all written to --json.

1. decode: 16 GSM8K questions x 8 samples = 128 rows of the Qwen2.5-0.5B configuration (random weights, bfloat16,
   sdpa), sampled by the engine with its decoder layers compiled, then captured as CUDA graphs (the default on
   CUDA), with CUDA graphs alone (--engine eager), without either, and Hugging Face `generate` (the hf path,
   hf_generate.sample_responses); interleaved over --rounds rounds. Each side runs 1, M/2 and M new tokens, each
   length first called once untimed (its seconds printed: the compiled side's compilations; a compiled step's
   first call at a new cache length compiles again, which timed would count as decoding); each round's decode
   figure is printed beside the median:
       prefill s     = T(1)                                   (the prompts, and the first token's draw)
       decode ms     = (T(M) - T(M/2)) / (M - M/2)            per step, 128 rows (graph captures cancel out)
       capture s     = T(M/2) - T(1) - (M/2 - 1)·decode       (the engine's one CUDA graph per call, else ~0)
   prefill tokens/s counts each prompt's tokens once (generate computes them G times: that is its cost), decode
   tokens/s = rows / decode step. Bandwidth: the bytes a decode step cannot avoid moving (every weight once, the
   keys and values of every row's context at mid-response, the logits written in float32) over the step's time,
   against the device's own copy bandwidth (a 1 GiB device-to-device copy, bytes read + written): the floor is
   those bytes at that bandwidth. Goal: 1.6 ms or less per step for the default side.
2. kernels: what one decode step launches, eager and with --engine compile's fused layers (no graphs, so every
   kernel is seen): profiled calls of 2 and 2 + S new tokens, differenced, per kernel and by kind (matrix
   products, attention, indexing, draw, fused, elementwise): counts, and their summed GPU time, which is what a
   CUDA graph replays without the launch gaps. On CPU the operators the dispatcher runs, counted the same way.
3. pipeline: `trainer.py --mode sync`, `--mode async` and `--mode auto` on the one device at the default sizes, with
   rows to the cap and with the tail (`--tail`: benchmarks/tail.py, rows ended at lengths drawn from GSM8K's
   answer-length spread, so groups stream early as with real weights), seconds per iteration (first dropped) and
   overlap; the first line says whether MPS runs, and what auto picks. Targets (printed, not checked): with the
   tail and MPS async >= 1.3x sync; without MPS auto = sync (>= 0.98x).
4. peer: `bench.py peer --model DIR --data GSM8K --device cuda`: samples/s against TRL 1.16's GRPOTrainer with
   HF generate (goal: 3x or more), when --trl-python has trl (else skipped, and said why).
5. train: one iteration's training on the decode part's workload (responses of M random tokens), phase by phase,
   with achieved TFLOP/s against the device's bf16 peak (benchmarks/train_step.py; goal: 35% or more).

The model is tools/qwen_shaped_random.py's directory (Qwen2.5-0.5B-Instruct's config, chat template and generation
config; a byte-level tokenizer, so a GSM8K question in the chat template is ~450 tokens), built into a temporary
folder unless --model names one. Nothing here needs the hub. On CPU (`--device cpu --layers 1 --vocab 512 ...`)
every part runs, without CUDA graphs: tests/cli/test_bench.py runs it so, so that a lent GPU's minutes go to measuring.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

import engine
from infra import compiled_step, hf_generate
from benchmarks.common import count, write_json
from benchmarks.engine_cpu import eos_ids, gsm8k_prompts, qwen_wide_model
from benchmarks.peer import peer, peer_run
from benchmarks.tail import TAILS, add_tail_option
from benchmarks.train_step import GOAL_SHARE, train_args, train_part

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("decode", "kernels", "pipeline", "peer", "train")
GOAL_DECODE_MS = 1.6


def gpu_args(parser: argparse.ArgumentParser) -> None:
    places = (ROOT / ".gpu-data" / "gsm8k", ROOT / "shared" / "data" / "gsm8k",
              ROOT.parent / "shared" / "data" / "gsm8k")
    default_data = next((path for path in places if path.is_dir()), places[-1])
    parser.add_argument("--device", default="cuda", help="where everything runs (cpu: a dry run of every part)")
    parser.add_argument("--data", type=Path, default=default_data, help="GSM8K folder (train.jsonl, test.jsonl)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts, comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--layers", type=count(), default=24, help="decode, kernels: decoder layers (Qwen2.5-0.5B: 24)")
    parser.add_argument("--vocab", type=count(3), default=151936,
                        help="decode, kernels: vocabulary (Qwen2.5's by default)")
    parser.add_argument("--prompts", type=count(), default=16, help="decode, kernels: prompts (x --group-size rows)")
    parser.add_argument("--group-size", type=count(), default=8)
    parser.add_argument("--decode-tokens", type=count(), default=128,
                        help="decode part: M, the longest run's new tokens")
    parser.add_argument("--rounds", type=count(), default=3, help="decode part: interleaved rounds per side")
    parser.add_argument("--profile-steps", type=count(), default=16,
                        help="kernels part: decode steps profiled per side")
    parser.add_argument("--model", default=None, help="pipeline and peer parts: a model directory or name "
                                                      "(default: tools/qwen_shaped_random.py's, built in a temp dir)")
    parser.add_argument("--train-tokens", type=count(), default=256,
                        help="pipeline and peer parts: --max-new-tokens (TRL's max_completion_length default)")
    parser.add_argument("--iterations", type=count(), default=3, help="pipeline and peer parts: timed steps per run")
    parser.add_argument("--peer-rounds", type=count(), default=2, help="pipeline and peer parts: runs per contender")
    parser.add_argument("--trl-python", default=sys.executable, help="peer part: a Python with trl==1.16.0")
    parser.add_argument("--trainer-args", default="", help="pipeline and peer parts: extra trainer.py options for "
                                                           "periodic-rl's runs (e.g. '--engine compile')")
    parser.add_argument("--trl-args", default="--micro-batch 16", help="peer part: extra tools/trl_grpo_run.py "
                                                                       "options")
    add_tail_option(parser, "pipeline part: ")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    train_args(parser)


# --- part 1: decode ---
def synchronized(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(fn, device: torch.device) -> float:
    synchronized(device)
    start = time.perf_counter()
    fn()
    synchronized(device)
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy, read + written (the device's own ceiling for a decode step)."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    seconds = min(seconds_of(lambda: target.copy_(source), device) for _ in range(5))
    return 2 * nbytes / seconds


def decode_step_bytes(model, rows: int, context: int) -> int:
    """Bytes one decode step of `rows` rows at mean context `context` must move: each weight once, each row's keys
    and values, the logits written in float32."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embeddings once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    cache = 2 * config.num_hidden_layers * rows * config.num_key_value_heads * context * head_dim * element
    return weights + cache + rows * config.vocab_size * 4


def decode_sides(model, prompts: list[list[int]], group_size: int, stops: list[int], device: torch.device) -> dict:
    """name -> sample(M): each side sampling the prompts' group_size rows with M new tokens."""
    keys = [(0, 0, j) for j in range(len(prompts))]

    def engine_side(graphs: bool, compiled: bool = False):
        step = partial(compiled_step.decode_step, compiled=compiled, graphs=graphs)
        return lambda m: engine.sample_groups(model, prompts, group_size, max_new_tokens=m, stop_ids=stops, keys=keys,
                                              decode_step=step)

    def hf_side(m: int):
        settings = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_new_tokens=m)
        return hf_generate.sample_responses(model, prompts, group_size, hf_generate.sampling_config(settings, stops, stops[1]),
                                        seed=0)
    if device.type != "cuda":  # graphs: CUDA's alone
        return {"engine, eager": engine_side(False), "hf generate": hf_side}
    return {"engine, compiled+graphs": engine_side(True, compiled=True), "engine, CUDA graphs": engine_side(True),
            "engine, eager": engine_side(False), "hf generate": hf_side}


def decode_workload(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, list[list[int]]]:
    """The decode and kernels parts' model (the Qwen2.5-0.5B configuration, random weights; bf16 on CUDA, else float32)
    and GSM8K prompts in its vocabulary."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = qwen_wide_model(args.layers, args.vocab).to(device=device, dtype=dtype)
    return model, [[token % args.vocab for token in prompt] for prompt in
                   gsm8k_prompts(args.data / "train.jsonl", args.prompts)]


def fallen_back(compiled: bool) -> str | None:
    """Why a side with compiled layers no longer runs what it is named for: compilation failed in this process (the
    engine then goes on without it: compiled_step.COMPILE_FAILED)."""
    if compiled and compiled_step.COMPILE_FAILED:
        return f"torch.compile failed: {compiled_step.COMPILE_FAILED}"
    return None


def decode_ms(long_s: float, short_s: float, steps: int, half: int) -> float:
    """Milliseconds per decode step from calls of M and M/2 new tokens: (T(M) - T(M/2)) / (M - M/2)."""
    return (long_s - short_s) / max(1, steps - half) * 1e3


def decode_part(args: argparse.Namespace, device: torch.device) -> dict:
    model, prompts = decode_workload(args, device)
    rows, steps = len(prompts) * args.group_size, args.decode_tokens
    stops, half = eos_ids(args.vocab), max(1, steps // 2)
    sides = decode_sides(model, prompts, args.group_size, stops, device)
    bandwidth = copy_bandwidth(device)
    context = statistics.mean(map(len, prompts)) + steps / 2
    step_bytes = decode_step_bytes(model, rows, round(context))
    print(f"gpu decode: Qwen2.5-0.5B configuration ({args.layers} layers, vocabulary {args.vocab}, {model.dtype}), "
          f"{len(prompts)} GSM8K prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x "
          f"{args.group_size} = {rows} rows, M = {steps}, {device}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; a "
          f"step moves >= {step_bytes / 1e9:.2f} GB: floor {step_bytes / bandwidth * 1e3:.2f} ms", flush=True)
    times: dict[str, dict[int, list[float]]] = {name: {1: [], half: [], steps: []} for name in sides}
    failed: dict[str, str] = {}
    first_call: dict[str, float] = {}
    with torch.no_grad():
        for name, sample in sides.items():  # every timed length once: compilations, cuBLAS workspaces, allocator pools
            try:
                first_call[name] = sum(seconds_of(lambda: sample(m), device) for m in (1, half, steps))
                if fallen_back("compiled" in name):  # eager layers: not this side
                    raise RuntimeError(fallen_back("compiled" in name))
            except Exception as error:  # a side that cannot run here is reported, the others still measured
                failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                print(f"gpu decode: {name} failed: {failed[name]}", flush=True)
                traceback.print_exc()
        for round_ in range(args.rounds):
            names = [name for name in sides if name not in failed]
            for name in names if round_ % 2 == 0 else names[::-1]:
                try:
                    for m in (1, half, steps):
                        times[name][m].append(seconds_of(lambda: sides[name](m), device))
                    print(f"gpu decode: round {round_}: {name:24s} decode "
                          f"{decode_ms(times[name][steps][-1], times[name][half][-1], steps, half):.2f} ms per step",
                          flush=True)
                    if fallen_back("compiled" in name):  # a recompilation failed
                        raise RuntimeError(fallen_back("compiled" in name))
                except Exception as error:
                    failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                    print(f"gpu decode: {name} failed in round {round_}: {failed[name]}", flush=True)
                    traceback.print_exc()
    figures = {"rows": rows, "decode_tokens": steps, "copy_bandwidth_GBps": bandwidth / 1e9,
               "step_bytes": step_bytes, "floor_ms": step_bytes / bandwidth * 1e3, "failed": failed, "sides": {}}
    print(f"{'side':24s} {'prefill s':>9s} {'prefill tok/s':>13s} {'decode ms':>9s} {'decode tok/s':>12s} "
          f"{'GB/s':>7s} {'of copy':>7s} {'capture s':>9s} {'first calls s':>13s}  decode ms each round")
    prompt_tokens = sum(map(len, prompts))
    for name, by_m in times.items():
        if name in failed:
            continue
        t1, th, tm = (statistics.median(by_m[m]) for m in (1, half, steps))
        step = decode_ms(tm, th, steps, half) / 1e3
        rounds = [decode_ms(long, short, steps, half) for long, short in zip(by_m[steps], by_m[half])]
        row = {"prefill_s": t1, "prefill_tokens_per_s": prompt_tokens / t1, "decode_ms": step * 1e3,
               "decode_tokens_per_s": rows / step, "achieved_GBps": step_bytes / step / 1e9,
               "of_copy_bandwidth": step_bytes / step / bandwidth, "capture_s": th - t1 - (half - 1) * step,
               "first_calls_s": first_call[name], "decode_ms_each_round": rounds,
               "seconds": {str(m): by_m[m] for m in by_m}}
        figures["sides"][name] = row
        print(f"{name:24s} {t1:9.3f} {row['prefill_tokens_per_s']:13.0f} {row['decode_ms']:9.2f} "
              f"{row['decode_tokens_per_s']:12.0f} {row['achieved_GBps']:7.0f} {row['of_copy_bandwidth']:7.0%} "
              f"{row['capture_s']:9.3f} {row['first_calls_s']:13.1f}  {', '.join(f'{ms:.2f}' for ms in rounds)}",
              flush=True)
    if "hf generate" in figures["sides"]:
        for name, row in figures["sides"].items():
            row["decode_vs_hf"] = figures["sides"]["hf generate"]["decode_ms"] / row["decode_ms"]
    return figures


# --- part 2: kernels ---
KINDS = (("fused (torch.compile)", ("triton_", "cpp_fused")),  # first match wins: attention before cutlass's GEMMs
         ("attention", ("fmha", "flash", "attention", "cudnn", "scaled_dot_product")),
         ("matrix products", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitk", "aten::mm", "aten::addmm",
                              "aten::bmm", "aten::linear")),  # linear: whole under inference_mode
         ("indexing (cache writes, row bookkeeping)", ("index", "scatter")),
         ("draw", ("sort", "softmax", "cumsum", "scan", "searchsorted", "argmax", "gather", "uniform")))
def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KINDS if any(mark in lowered for mark in marks)), "elementwise and other")


def kernels_of(run, device: torch.device) -> dict[str, list[float]]:
    """name -> [count, microseconds] of the kernels one call of `run` launches: on CUDA the GPU's kernels and their
    time on the GPU (torch.profiler); on CPU the operators that compute, as the dispatcher sees them below autograd
    (views and allocations left out), each timed around its call."""
    found: dict[str, list[float]] = {}

    def add(name: str, micros: float) -> None:
        entry = found.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += micros
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
            run()
            synchronized(device)
        for event in profiled.events():
            name = event.name.lower()
            if event.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in name and "memset" not in name:
                add(event.name, event.time_range.elapsed_us())
        return found
    from torch.utils._python_dispatch import TorchDispatchMode

    class Kernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.is_view or func.__name__.split(".")[0] in ("empty", "empty_strided", "detach", "detach_",
                                                                             "lift_fresh", "_unsafe_view"):
                return func(*args, **(kwargs or {}))
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            add(f"aten::{func.__name__.split('.')[0]}", (time.perf_counter() - start) * 1e6)
            return out
    with Kernels():
        run()
    return found


def kernels_part(args: argparse.Namespace, device: torch.device) -> dict:
    """What one decode step launches, per side: profiled calls of 2 and 2 + S new tokens (the same prompts and
    prefill; the host looks after every step, so they run 1 and 1 + S decode steps), their difference over S. On a
    GPU a CUDA graph replays these kernels without the launch gaps, so their summed time is what graphs can reach
    without fusing; their count is what fusing (--engine compile) cuts."""
    model, prompts = decode_workload(args, device)
    keys, stops, steps = [(0, 0, j) for j in range(len(prompts))], eos_ids(args.vocab), args.profile_steps
    sides = {"engine, eager": False, "engine, compiled": True}
    if device.type != "cuda":  # CPU: benchmarks/engine_cpu.py --compile's
        sides = {"engine, eager": False}
    figures: dict = {"rows": len(prompts) * args.group_size, "steps": steps, "sides": {}}
    for name, compiled in sides.items():
        def run(m: int):
            step = partial(compiled_step.decode_step, compiled=compiled, graphs=False)
            return lambda: engine.sample_groups(model, prompts, args.group_size, max_new_tokens=m, stop_ids=stops,
                                                keys=keys, decode_step=step, check_every=1)
        with torch.no_grad():
            try:
                run(2)(), run(2 + steps)()  # compilation (both cache lengths), lazy initialisation
            except Exception as error:  # a side that cannot run here is reported, the others still measured
                figures["sides"][name] = {"failed": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
                print(f"gpu kernels: {name} failed: {figures['sides'][name]['failed']}", flush=True)
                continue
            reason = fallen_back(compiled)
            if reason:  # the engine fell back to eager layers: not the side named
                print(f"gpu kernels: {name} failed: {reason}", flush=True)
                figures["sides"][name] = {"failed": reason}
                continue
            short, long = kernels_of(run(2), device), kernels_of(run(2 + steps), device)
        per_step = {kernel: [(count - short.get(kernel, [0, 0.0])[0]) / steps,
                             (micros - short.get(kernel, [0, 0.0])[1]) / steps]
                    for kernel, (count, micros) in long.items()}
        per_step = {kernel: v for kernel, v in per_step.items() if v[0] > 0}
        by_kind: dict[str, list[float]] = {}
        for kernel, (count, micros) in per_step.items():
            entry = by_kind.setdefault(kind_of(kernel), [0.0, 0.0])
            entry[0] += count
            entry[1] += micros
        total = [sum(v[0] for v in per_step.values()), sum(v[1] for v in per_step.values())]
        figures["sides"][name] = {"kernels_per_step": total[0], "kernel_us_per_step": total[1], "by_kind": by_kind,
                                  "top": sorted(per_step.items(), key=lambda item: -item[1][1])[:12]}
        where = "GPU" if device.type == "cuda" else "CPU"
        print(f"gpu kernels: {name}: {total[0]:.0f} kernels per decode step, {total[1] / 1e3:.2f} ms of {where} time "
              f"in them ({figures['rows']} rows, {steps} steps profiled)", flush=True)
        for kind, (count, micros) in sorted(by_kind.items(), key=lambda item: -item[1][1]):
            print(f"    {kind:40s} {count:6.0f} kernels {micros / 1e3:8.3f} ms", flush=True)
        for kernel, (count, micros) in figures["sides"][name]["top"]:
            print(f"      {count:6.0f} x {micros / max(count, 1):8.1f} us  {kernel[:90]}", flush=True)
    return figures


# --- parts 3 and 4: whole runs ---
def model_directory(args: argparse.Namespace, scratch: Path) -> str:
    """--model, or tools/qwen_shaped_random.py's directory built into `scratch`."""
    if args.model:
        return args.model
    out = scratch / "qwen2.5-0.5b-shaped"
    subprocess.run([sys.executable, "tools/qwen_shaped_random.py", str(out)], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    return str(out)


def pipeline_part(args: argparse.Namespace, model: str) -> dict:
    """Seconds per iteration and overlap, sync, async and auto (what --mode auto picks here: infra/sharing.py), with
    rows to the cap and with the tail (benchmarks/tail.py), interleaved."""
    from infra import sharing
    run = SimpleNamespace(model=model, data=str(args.data), device=args.device, iterations=args.iterations,
                          max_new_tokens=args.train_tokens, task=None, trainer_args=args.trainer_args)
    auto, why = sharing.auto_mode(args.device, args.device)
    print(f"gpu pipeline: MPS {'running' if sharing.mps_running() else 'not running'}; --mode auto here: {auto} "
          f"({why})", flush=True)
    runs = [(mode, tailed) for tailed in TAILS[args.tail] for mode in ("sync", "async", "auto")]
    seconds: dict[str, list[float]] = {}
    overlaps: dict[str, list[float]] = {}
    for round_ in range(args.peer_rounds):
        for mode, tailed in runs:
            label = f"{mode} +tail" if tailed else mode
            step_s, length, _, overlap = peer_run(f"periodic-rl {label}", ["--mode", mode], run, tailed)
            seconds.setdefault(label, []).append(step_s)
            overlaps.setdefault(label, []).append(overlap)
            print(f"gpu pipeline: round {round_}: {label:11s} {step_s:.2f} s per iteration, overlap {overlap:.0%}, "
                  f"mean response {length:.0f} tokens", flush=True)
    ratios = {}
    for tailed in TAILS[args.tail]:
        plus = " +tail" if tailed else ""
        for mode in ("async", "auto"):
            ratios[mode + plus] = [s / a for s, a in zip(seconds["sync" + plus], seconds[mode + plus])]
            print(f"gpu pipeline: {mode + plus} {statistics.mean(ratios[mode + plus]):.2f}x sync (per round "
                  f"{min(ratios[mode + plus]):.2f}-{max(ratios[mode + plus]):.2f}x, overlap "
                  f"{statistics.mean(overlaps[mode + plus]):.0%}; {args.train_tokens} new tokens)", flush=True)
    return {"mps": sharing.mps_running(), "auto": auto, "seconds_per_iteration": seconds, "overlap": overlaps,
            "vs_sync": ratios}


def has_trl(python: str) -> str | None:
    """Why `python` cannot run the TRL side (None: it can)."""
    try:
        found = subprocess.run([python, "-c", "import trl, datasets; print(trl.__version__)"], capture_output=True,
                               text=True, timeout=300)
    except OSError as error:
        return str(error)
    return None if found.returncode == 0 else found.stderr.strip().splitlines()[-1]


def peer_part(args: argparse.Namespace, model: str) -> dict:
    reason = has_trl(args.trl_python)
    if reason is not None:
        print(f"gpu peer: skipped: {args.trl_python} cannot import trl ({reason}); docs/benchmarks.md says how to "
              "carry TRL's wheels to the GPU machine", flush=True)
        return {"skipped": reason}
    with tempfile.NamedTemporaryFile(suffix=".json") as figures:
        run = argparse.Namespace(trl_python=args.trl_python, iterations=args.iterations, rounds=args.peer_rounds,
                                 task="arithmetic", max_new_tokens=args.train_tokens, model=model, data=str(args.data),
                                 device=args.device, trainer_args=args.trainer_args, trl_args=args.trl_args,
                                 json=figures.name)
        passed = peer(run)
        return {"passed_peer_checks": passed, **json.loads(Path(figures.name).read_text())}


def gpu(args: argparse.Namespace) -> bool:
    """The GPU table: decode step, pipeline, and end to end against TRL (one command)."""
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"error: --parts: unknown {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    if not (args.data / "train.jsonl").is_file():
        raise SystemExit(f"error: --data {args.data}: no train.jsonl there (a GSM8K folder)")
    device = torch.device(args.device)
    figures: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__}
    ok = True
    if "decode" in parts:
        figures["decode"] = decode_part(args, device)
        default = figures["decode"]["sides"].get("engine, compiled+graphs")
        if device.type == "cuda":
            ok = default is not None and default["decode_ms"] <= GOAL_DECODE_MS
            print(("PASS " if ok else "FAIL ") + f"default engine decode step <= {GOAL_DECODE_MS} ms at "
                  f"{figures['decode']['rows']} rows", flush=True)
    if "kernels" in parts:
        figures["kernels"] = kernels_part(args, device)
    if "train" in parts:  # benchmarks/train_step.py
        figures["train"] = train_part(args, device)
        share = figures["train"]["iteration"]["of_peak"]
        if share is not None:
            ok = ok and share >= GOAL_SHARE
            print(("PASS " if share >= GOAL_SHARE else "FAIL ") + f"training at {share:.0%} of the bf16 peak (goal "
                  f">= {GOAL_SHARE:.0%})", flush=True)
        sides = figures["train"]["sides"]
        if {"eager", "compiled"} <= set(sides):  # --compile-train's decision (docs/benchmarks.md)
            speedup = sides["eager"]["iteration"]["seconds"] / sides["compiled"]["iteration"]["seconds"]
            print(f"compiled training: iteration {speedup:.2f}x eager's, {sides['compiled']['compile_seconds']:.0f} s "
                  f"compiling (auto should compile on this device where >= 1.1x and under 120 s: docs/benchmarks.md)",
                  flush=True)
    if "pipeline" in parts or "peer" in parts:
        with tempfile.TemporaryDirectory() as scratch:
            model = model_directory(args, Path(scratch))
            if "pipeline" in parts:
                figures["pipeline"] = pipeline_part(args, model)
            if "peer" in parts:
                figures["peer"] = peer_part(args, model)
                ok = ok and figures["peer"].get("passed_peer_checks", True)
    write_json(args.json, figures)
    return ok
