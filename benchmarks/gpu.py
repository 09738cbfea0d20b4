"""`python bench.py gpu`: the GPU table in one command (~10-20 minutes of one H100), five parts, each printed as it
finishes and all written to --json.

1. decode: 16 GSM8K questions x 8 samples = 128 rows of the Qwen2.5-0.5B configuration (random weights, bfloat16,
   sdpa), sampled by the engine with CUDA graphs, with its decoder layers compiled, then captured (--engine compile),
   without graphs, and Hugging Face `generate` (the hf path, rollout.sample_responses); then the compiled step with
   what is not a trainer option until measured: q|k|v and gate|up as one product each (a copy of the model through
   engine.fuse_projections), flex attention (attention="flex"), both; interleaved over --rounds rounds, after one
   untimed call each (its seconds printed: the compiled sides' compilation). Each side runs 1, M/2 and M new tokens:
       prefill s     = T(1)                                   (the prompts, and the first token's draw)
       decode ms     = (T(M) - T(M/2)) / (M - M/2)            per step, 128 rows (graph captures cancel out)
       capture s     = T(M/2) - T(1) - (M/2 - 1)·decode       (the engine's one CUDA graph per call, else ~0)
   prefill tokens/s counts each prompt's tokens once (generate computes them G times: that is its cost), decode
   tokens/s = rows / decode step. Bandwidth: the bytes a decode step cannot avoid moving (every weight once, the
   keys and values of every row's context at mid-response, the logits written in float32) over the step's time,
   against the device's own copy bandwidth (a 1 GiB device-to-device copy, bytes read + written): the floor is
   those bytes at that bandwidth. Goal: 2 ms or less per step.
2. kernels: what one decode step launches, eager, with --engine compile's fused layers, with flex attention, with
   flex and fused projections (no graphs, so every
   kernel is seen): profiled calls of 2 and 2 + S new tokens, differenced, per kernel and by kind (matrix
   products, attention, indexing, draw, fused, elementwise): counts, and their summed GPU time, which is what a
   CUDA graph replays without the launch gaps. On CPU the operators the dispatcher runs, counted the same way.
3. pipeline: `trainer.py --mode sync` against `--mode async` on the one device, --groups-per-chunk 4 (4 generate
   calls per iteration, so async has groups to overlap), seconds per iteration (first dropped).
4. peer: `bench.py peer --model DIR --data GSM8K --device cuda`: samples/s against TRL 1.16's GRPOTrainer with
   HF generate (goal: 3x or more), when --trl-python has trl (else skipped, and said why).
5. train: one iteration's training on the decode part's workload (responses of M random tokens), phase by phase,
   with achieved TFLOP/s against the device's bf16 peak (benchmarks/train_step.py; goal: 35% or more).

The model is tools/qwen_shaped_random.py's directory (Qwen2.5-0.5B-Instruct's config, chat template and generation
config; a byte-level tokenizer, so a GSM8K question in the chat template is ~450 tokens), built into a temporary
folder unless --model names one. Nothing here needs the hub. On CPU (`--device cpu --layers 1 --vocab 512 ...`)
every part runs, without CUDA graphs: tests/test_bench.py runs it so, so that a lent GPU's minutes go to measuring.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

import engine
import rollout
from benchmarks.common import write_json
from benchmarks.engine_cpu import eos_ids, gsm8k_prompts, qwen_wide_model
from benchmarks.peer import peer, peer_run
from benchmarks.train_step import GOAL_SHARE, train_args, train_part

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("decode", "kernels", "pipeline", "peer", "train")
GOAL_DECODE_MS = 2.0


def gpu_args(parser: argparse.ArgumentParser) -> None:
    places = (ROOT / ".gpu-data" / "gsm8k", ROOT / "shared" / "data" / "gsm8k",
              ROOT.parent / "shared" / "data" / "gsm8k")
    default_data = next((path for path in places if path.is_dir()), places[-1])
    parser.add_argument("--device", default="cuda", help="where everything runs (cpu: a dry run of every part)")
    parser.add_argument("--data", type=Path, default=default_data, help="GSM8K folder (train.jsonl, test.jsonl)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts, comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--layers", type=int, default=24, help="decode, kernels: decoder layers (Qwen2.5-0.5B: 24)")
    parser.add_argument("--vocab", type=int, default=151936, help="decode, kernels: vocabulary (Qwen2.5's by default)")
    parser.add_argument("--prompts", type=int, default=16, help="decode, kernels: prompts (x --group-size rows)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=128, help="decode part: M, the longest run's new tokens")
    parser.add_argument("--rounds", type=int, default=3, help="decode part: interleaved rounds per side")
    parser.add_argument("--profile-steps", type=int, default=16, help="kernels part: decode steps profiled per side")
    parser.add_argument("--model", default=None, help="pipeline and peer parts: a model directory or name "
                                                      "(default: tools/qwen_shaped_random.py's, built in a temp dir)")
    parser.add_argument("--train-tokens", type=int, default=256,
                        help="pipeline and peer parts: --max-new-tokens (TRL's max_completion_length default)")
    parser.add_argument("--iterations", type=int, default=3, help="pipeline and peer parts: timed steps per run")
    parser.add_argument("--peer-rounds", type=int, default=2, help="pipeline and peer parts: runs per contender")
    parser.add_argument("--trl-python", default=sys.executable, help="peer part: a Python with trl==1.16.0")
    parser.add_argument("--trainer-args", default="", help="pipeline and peer parts: extra trainer.py options for "
                                                           "periodic-rl's runs (e.g. '--engine compile')")
    parser.add_argument("--trl-args", default="--micro-batch 16", help="peer part: extra tools/trl_grpo_run.py "
                                                                       "options")
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


def fused_copy(model):
    """A copy of `model` with its projections concatenated (engine.fuse_projections), for the fused sides."""
    fused = copy.deepcopy(model)
    reason = engine.fuse_projections(fused)
    if reason is not None:
        raise RuntimeError(f"fuse_projections: {reason}")
    return fused


def decode_sides(model, prompts: list[list[int]], group_size: int, stops: list[int], device: torch.device) -> dict:
    """name -> sample(M): each side sampling the prompts' group_size rows with M new tokens."""
    keys = [(0, 0, j) for j in range(len(prompts))]
    fused = fused_copy(model)

    def engine_side(graphs: bool, compiled: bool = False, attention: str = "sdpa", on=model):
        return lambda m: engine.sample_groups(on, prompts, group_size, max_new_tokens=m, stop_ids=stops, keys=keys,
                                              cuda_graphs=graphs, compile_step=compiled, attention=attention)

    def hf_side(m: int):
        settings = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_new_tokens=m)
        return rollout.sample_responses(model, prompts, group_size, rollout.sampling_config(settings, stops, stops[1]),
                                        seed=0)
    if device.type != "cuda":  # graphs: the same code as eager off CUDA; flex: compiled only there (engine.py)
        return {"engine, eager": engine_side(False), "hf generate": hf_side,
                "engine, eager, fused": engine_side(False, on=fused)}
    return {"engine, CUDA graphs": engine_side(True), "engine, compiled+graphs": engine_side(True, compiled=True),
            "engine, eager": engine_side(False), "hf generate": hf_side,  # flex's sides last: see decode_part
            "engine, compiled+graphs, fused": engine_side(True, compiled=True, on=fused),
            "engine, compiled, flex": engine_side(True, compiled=True, attention="flex"),
            "engine, compiled, flex, fused": engine_side(True, compiled=True, attention="flex", on=fused)}


def decode_workload(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, list[list[int]]]:
    """The decode and kernels parts' model (the Qwen2.5-0.5B configuration, random weights; bf16 on CUDA, else float32)
    and GSM8K prompts in its vocabulary."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = qwen_wide_model(args.layers, args.vocab).to(device=device, dtype=dtype)
    return model, [[token % args.vocab for token in prompt] for prompt in
                   gsm8k_prompts(args.data / "train.jsonl", args.prompts)]


def fallen_back(compiled: bool, flex: bool) -> str | None:
    """Why a side with compiled layers or flex attention no longer runs what it is named for: compilation failed in
    this process, for it or another side (the engine then goes on without it: engine.COMPILE_FAILED, FLEX_FAILED)."""
    if compiled and engine.COMPILE_FAILED:
        return f"torch.compile failed: {engine.COMPILE_FAILED}"
    if flex and engine.FLEX_FAILED:
        return f"compiling flex attention failed: {engine.FLEX_FAILED}"
    return None


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
        for name, sample in sides.items():  # warm-up: lazy initialisation, cuBLAS workspaces, allocator pools
            before = engine.COMPILE_FAILED
            try:
                first_call[name] = seconds_of(lambda: sample(2), device)  # torch.compile's compilation, for one
                if fallen_back("compiled" in name, "flex" in name):  # eager layers or eager flex: not this side
                    raise RuntimeError(fallen_back("compiled" in name, "flex" in name))
            except Exception as error:  # a side that cannot run here is reported, the others still measured
                failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                print(f"gpu decode: {name} failed: {failed[name]}", flush=True)
                traceback.print_exc()
                if "flex" in name:  # its compilation failing must not turn the (earlier) compiled side eager
                    engine.COMPILE_FAILED = before
        for round_ in range(args.rounds):
            names = [name for name in sides if name not in failed]
            for name in names if round_ % 2 == 0 else names[::-1]:
                try:
                    for m in (1, half, steps):
                        times[name][m].append(seconds_of(lambda: sides[name](m), device))
                    if fallen_back("compiled" in name, "flex" in name):  # a recompilation failed, or another side's
                        raise RuntimeError(fallen_back("compiled" in name, "flex" in name))
                except Exception as error:
                    failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                    print(f"gpu decode: {name} failed in round {round_}: {failed[name]}", flush=True)
                    traceback.print_exc()
    figures = {"rows": rows, "decode_tokens": steps, "copy_bandwidth_GBps": bandwidth / 1e9,
               "step_bytes": step_bytes, "floor_ms": step_bytes / bandwidth * 1e3, "failed": failed, "sides": {}}
    print(f"{'side':24s} {'prefill s':>9s} {'prefill tok/s':>13s} {'decode ms':>9s} {'decode tok/s':>12s} "
          f"{'GB/s':>7s} {'of copy':>7s} {'capture s':>9s} {'first call s':>12s}")
    prompt_tokens = sum(map(len, prompts))
    for name, by_m in times.items():
        if name in failed:
            continue
        t1, th, tm = (statistics.median(by_m[m]) for m in (1, half, steps))
        step = (tm - th) / max(1, steps - half)
        row = {"prefill_s": t1, "prefill_tokens_per_s": prompt_tokens / t1, "decode_ms": step * 1e3,
               "decode_tokens_per_s": rows / step, "achieved_GBps": step_bytes / step / 1e9,
               "of_copy_bandwidth": step_bytes / step / bandwidth, "capture_s": th - t1 - (half - 1) * step,
               "first_call_s": first_call[name], "seconds": {str(m): by_m[m] for m in by_m}}
        figures["sides"][name] = row
        print(f"{name:24s} {t1:9.3f} {row['prefill_tokens_per_s']:13.0f} {row['decode_ms']:9.2f} "
              f"{row['decode_tokens_per_s']:12.0f} {row['achieved_GBps']:7.0f} {row['of_copy_bandwidth']:7.0%} "
              f"{row['capture_s']:9.3f} {row['first_call_s']:12.1f}", flush=True)
    if "hf generate" in figures["sides"]:
        for name, row in figures["sides"].items():
            row["decode_vs_hf"] = figures["sides"]["hf generate"]["decode_ms"] / row["decode_ms"]
    return figures


# --- part 2: kernels ---
KINDS = (("attention", ("triton_tem", "flex")),  # first match wins: flex attention's Triton templates before fusions,
         ("fused (torch.compile)", ("triton_", "cpp_fused")),  # attention before cutlass's GEMMs
         ("attention", ("fmha", "flash", "attention", "cudnn", "scaled_dot_product")),
         ("matrix products", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitk", "aten::mm", "aten::addmm",
                              "aten::bmm")),
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
            if func.is_view or func.__name__.split(".")[0] in ("empty", "empty_strided", "detach", "lift_fresh",
                                                                             "_unsafe_view"):
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
    fused = fused_copy(model)
    sides = {"engine, eager": (False, "sdpa", model), "engine, compiled": (True, "sdpa", model),
             "engine, compiled, flex": (True, "flex", model), "engine, compiled, flex, fused": (True, "flex", fused)}
    if device.type != "cuda":  # CPU: benchmarks/engine_cpu.py --compile's
        sides = {"engine, eager": (False, "sdpa", model), "engine, eager, fused": (False, "sdpa", fused)}
    figures: dict = {"rows": len(prompts) * args.group_size, "steps": steps, "sides": {}}
    for name, (compiled, attention, on) in sides.items():
        def run(m: int):
            return lambda: engine.sample_groups(on, prompts, args.group_size, max_new_tokens=m, stop_ids=stops,
                                                keys=keys, cuda_graphs=False, compile_step=compiled, check_every=1,
                                                attention=attention)
        with torch.no_grad():
            try:
                run(2)(), run(2 + steps)()  # compilation (both cache lengths), lazy initialisation
            except Exception as error:  # a side that cannot run here is reported, the others still measured
                figures["sides"][name] = {"failed": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
                print(f"gpu kernels: {name} failed: {figures['sides'][name]['failed']}", flush=True)
                continue
            reason = fallen_back(compiled, attention == "flex")
            if reason:  # the engine fell back to eager layers or eager flex: not the side named
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
    """Seconds per iteration, sync against async, --groups-per-chunk 4, interleaved."""
    run = SimpleNamespace(model=model, data=str(args.data), device=args.device, iterations=args.iterations,
                          max_new_tokens=args.train_tokens, task=None,
                          trainer_args=f"--groups-per-chunk 4 {args.trainer_args}")
    modes = {"sync": ["--mode", "sync"], "async": ["--mode", "async"]}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.peer_rounds):
        for mode, argv in modes.items():
            seconds[mode].append(peer_run(f"periodic-rl {mode}", argv, run)[0])
            print(f"gpu pipeline: round {round_}: {mode:5s} {seconds[mode][-1]:.2f} s per iteration", flush=True)
    ratios = [s / a for s, a in zip(seconds["sync"], seconds["async"])]
    print(f"gpu pipeline: async {statistics.mean(ratios):.2f}x sync (per round {min(ratios):.2f}-{max(ratios):.2f}x; "
          f"4 generate calls per iteration, {args.train_tokens} new tokens)", flush=True)
    return {"seconds_per_iteration": seconds, "async_vs_sync": ratios}


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
        graphs = figures["decode"]["sides"].get("engine, CUDA graphs")
        if device.type == "cuda":
            ok = graphs is not None and graphs["decode_ms"] <= GOAL_DECODE_MS
            print(("PASS " if ok else "FAIL ") + f"engine decode step <= {GOAL_DECODE_MS} ms at "
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
