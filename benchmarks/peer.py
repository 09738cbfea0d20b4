"""`python bench.py peer`: samples/s of TRL's GRPOTrainer and of periodic-rl (sync, async) on the same work.

The same work through TRL 1.16's `GRPOTrainer` (`tools/trl_grpo_run.py`, run by `--trl-python`, a
separate virtualenv: TRL is never a requirement) and through `trainer.py --mode sync` and
`--mode async` at their defaults: the tiny model, 16 arithmetic prompts x 8 samples per step, at
most 8 new tokens, temperature 1, beta 0.04, dapo loss, AdamW lr 1e-4, float32, all cores, no
evaluation or saving on either side. Each run is a fresh process; contenders are interleaved
within each of `--rounds` rounds; samples/s = 128 / mean seconds per step (first step dropped),
and each contender's ratio to TRL, with each one's mean response length (the two train their own
policies, so lengths drift apart a little). `--task chain`: the `tiny-chain` model on the chain
task (worked sums, responses of 5 to ~100 tokens with a long tail, <= 128 new tokens), the
workload where streaming groups by completion pays. `--model DIR --data GSM8K --device cuda`: the GPU
comparison, e.g. on tools/qwen_shaped_random.py's Qwen2.5-0.5B-shaped directory: GSM8K questions in the
chat template, lr 1e-6, training in bf16 autocast over float32 weights on both sides (periodic-rl samples
from a bf16 copy of the weights, TRL from its float32 model).

Targets: both modes at least TRL's samples/s (the means' ratio), async not slower than sync (the 95% interval
of their per-round ratios reaches 1x and their mean is at least 0.97x: `benchmarks.common.not_slower`; on the
toy's 2 cores async samples then trains in one process, sync's schedule, so only noise tells them apart), and on
`--task chain` async at least 1.5x TRL's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import sys
from pathlib import Path

from benchmarks.common import SLOWER_FLOOR, count, not_slower, ratio_interval, write_json
from infra.options import available_cores

ROOT = Path(__file__).resolve().parents[1]  # both sides run from the repository's root, wherever bench.py is called


PEER_TASKS = {"arithmetic": ("tiny", 8), "chain": ("tiny-chain", 128)}  # --task -> (model, default max new tokens)
PEER_TARGETS = {"arithmetic": 1.0, "chain": 1.5}  # async at least this times TRL's samples/s
PEER_CONTENDERS = {  # name -> trainer.py options (None: TRL)
    "TRL GRPOTrainer": None,
    "periodic-rl sync": ["--mode", "sync"],
    "periodic-rl async": ["--mode", "async"],
}


def peer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"),
                        help="a Python with trl==1.16.0 installed (see tools/trl_grpo_run.py); default: the "
                             "repository's .venv-trl")
    parser.add_argument("--iterations", type=count(), default=10, help="timed steps per run (one more is dropped)")
    parser.add_argument("--rounds", type=count(), default=3, help="runs of each contender, interleaved")
    parser.add_argument("--task", choices=PEER_TASKS, default="arithmetic",
                        help="arithmetic: the toy (responses of ~4 tokens); chain: long-tailed responses of 5-100 "
                             "tokens (the tiny-chain model)")
    parser.add_argument("--max-new-tokens", type=count(0), default=None,
                        help="default: 8 (arithmetic), 128 (chain), 512 (--model DIR)")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="instead of --task: a local chat-model directory (e.g. tools/qwen_shaped_random.py's), "
                             "trained on --data")
    parser.add_argument("--data", default=None, help="with --model DIR: GSM8K-style prompts (train.jsonl/test.jsonl)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides run")
    parser.add_argument("--trainer-args", default="", metavar="ARGS",
                        help="extra trainer.py options for both periodic-rl contenders")
    parser.add_argument("--trl-args", default="", metavar="ARGS",
                        help="extra tools/trl_grpo_run.py options, e.g. '--micro-batch 16' (a 0.5B model's 128 "
                             "completions do not fit one forward on an 80 GB GPU)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


def chosen_sizes(stdout: str) -> str:
    """The sizes a periodic-rl run chose, from its `sizes:` line ('' if none): what to look at when a run is slow.

    >>> chosen_sizes("periodic-rl: sizes: --groups-per-call 8 (2 generate call(s) per iteration) "
    ...              "--micro-batch-tokens 314 --rollout-threads 1 --train-threads 1 (pass these to fix them)")
    '2 call(s), --micro-batch-tokens 314 --rollout-threads 1 --train-threads 1'
    """
    found = re.search(r"sizes: --groups-per-call \d+ \((\d+) generate call\(s\) per iteration\) (.*) \(pass", stdout)
    return f"{found.group(1)} call(s), {found.group(2)}" if found else ""


def workload(args: argparse.Namespace) -> tuple[str, int]:
    """(model, default max new tokens) of the run: --task's tiny model, or --model DIR."""
    if args.model is None:
        if args.data is not None:
            raise SystemExit("error: --data goes with --model DIR (the tasks bring their own prompts)")
        return PEER_TASKS[args.task]
    if args.data is None:
        raise SystemExit("error: --model DIR needs --data (GSM8K-style prompts)")
    return (os.path.abspath(args.model) if os.path.exists(args.model) else args.model), 512


def peer_run(name: str, argv: list[str] | None, args: argparse.Namespace, tailed: bool = False
             ) -> tuple[float, float, str, float]:
    """One fresh process of a contender: its mean seconds per step (optimizer step = 128 samples), mean
    response length in tokens (first step dropped), the sizes it chose ('' for TRL) and its mean overlap (0 for TRL).
    `tailed`: periodic-rl's run through `python -m benchmarks.tail` (rows cut at drawn lengths)."""
    import subprocess
    import tempfile
    model, default_tokens = workload(args)
    common = ["--model", model, "--max-new-tokens", str(args.max_new_tokens or default_tokens), "--device",
              args.device, "--lr", "1e-4" if args.model is None else "1e-6"]  # periodic-rl's default lr, both sides
    if args.model is not None:
        common += ["--data", os.path.abspath(args.data) if os.path.exists(args.data) else args.data]
    if argv is None:
        python = shutil.which(args.trl_python)  # a path (relative to where bench.py was called) or a name on PATH
        if python is None:
            raise SystemExit(f"error: --trl-python {args.trl_python} is not an executable Python: make a virtualenv "
                             "with trl==1.16.0 (tools/trl_grpo_run.py says how) and pass its python")
        out = subprocess.run([os.path.abspath(python), "tools/trl_grpo_run.py", "--steps", str(args.iterations),
                              *common, *shlex.split(args.trl_args)],
                             capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            raise SystemExit(f"TRL run failed (is trl==1.16.0 installed in {args.trl_python}?):\n{out.stderr[-2000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        return statistics.mean(result["seconds_per_step"]), result["mean_completion_length"], "", 0.0
    with tempfile.TemporaryDirectory() as tmp:
        system = ["--system-prompt", "math"] if args.model is not None else []  # tools/trl_grpo_run.py's prompts
        launcher = ["-m", "benchmarks.tail"] if tailed else []
        command = [sys.executable, *launcher, "trainer.py", *argv, *common, *system, "--lr-scheduler-type", "constant",
                   "--iterations", str(args.iterations + 1),
                   "--eval-every", "0", "--no-save", "--out", tmp, *shlex.split(args.trainer_args)]
        out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(os.path.join(tmp, "metrics.jsonl"))]
    timed = [row for row in rows if not row.get("final") and row["iteration"] > 0]
    return (statistics.mean(row["iteration_s"] for row in timed),
            statistics.mean(row["completions/mean_length"] for row in timed), chosen_sizes(out.stdout),
            statistics.mean(row["overlap"] for row in timed))


def peer(args: argparse.Namespace) -> bool:
    """Samples/s of TRL's GRPOTrainer and of periodic-rl (sync, async) on the same work, interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in PEER_CONTENDERS}
    lengths: dict[str, list[float]] = {name: [] for name in PEER_CONTENDERS}
    model, default_tokens = workload(args)
    print(f"{args.rounds} rounds x {len(times)} contenders, {args.iterations} timed steps each "
          f"({args.task if args.model is None else args.data}: {model}, "
          f"16 prompts x 8, <= {args.max_new_tokens or default_tokens} new tokens, beta 0.04, {available_cores()} "
          f"cores, device {args.device}), fresh process per run")
    for round_ in range(args.rounds):
        for name, argv in PEER_CONTENDERS.items():
            seconds, length, sizes, _ = peer_run(name, argv, args)
            times[name].append(seconds)
            lengths[name].append(length)
            print(f"round {round_}: {name:20s} {128 / seconds:7.0f} samples/s  (mean response {length:.1f} tokens)"
                  + (f"  sizes: {sizes}" if sizes else ""), flush=True)
    trl = [128 / t for t in times["TRL GRPOTrainer"]]
    results = {}
    print(f"{'contender':20s} {'samples/s':>10s} {'vs TRL':>8s} {'per round':>12s}  {'mean response':>13s}")
    for name, seconds in times.items():
        rates = [128 / t for t in seconds]
        ratios = [r / q for r, q in zip(rates, trl)]
        results[name] = {"samples_per_s": statistics.mean(rates),
                         "vs_trl": statistics.mean(rates) / statistics.mean(trl), "vs_trl_per_round": ratios,
                         "seconds_per_step": seconds,
                         "mean_response_tokens": statistics.mean(lengths[name])}
        print(f"{name:20s} {results[name]['samples_per_s']:10.0f} {results[name]['vs_trl']:7.2f}x "
              f"{min(ratios):5.2f}-{max(ratios):.2f}x  {results[name]['mean_response_tokens']:6.1f} tokens", flush=True)
    target = PEER_TARGETS[args.task] if args.model is None else 1.0
    per_round = [s / a for s, a in zip(times["periodic-rl sync"], times["periodic-rl async"])]  # async's speed / sync's
    versus_sync = ratio_interval(per_round)
    results["periodic-rl async"]["vs_sync_interval"] = versus_sync
    checks = [(results["periodic-rl async"]["vs_trl"] >= target, f"async (defaults) >= {target}x TRL"),
              (results["periodic-rl sync"]["vs_trl"] >= 1.0, "sync (defaults) >= TRL"),
              (not_slower(per_round), f"async not slower than sync: {versus_sync[0]:.2f}x (>= {SLOWER_FLOOR}x), "
                                      f"95% interval of the per-round ratios {versus_sync[1]:.2f}-"
                                      f"{versus_sync[2]:.2f}x reaching 1x")]
    for ok, line in checks:
        print(("PASS " if ok else "FAIL ") + line)
    write_json(args.json, {"workload": {"model": model, "task": args.task if args.model is None else None,
                                        "data": args.data, "device": args.device,
                                        "max_new_tokens": args.max_new_tokens or default_tokens,
                                        "trl_args": args.trl_args, "trainer_args": args.trainer_args},
                           **results})
    return all(ok for ok, _ in checks)
