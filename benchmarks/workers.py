"""`python bench.py workers`: seconds per iteration with N = 1 and N = 2 inference workers per trainer, against
the prediction from the N = 1 run's phase times.

The same training run (tiny model, 16 prompts x 8 responses, evaluation off, every size fixed: 4 generate
calls of 4 prompts, so that two workers get two calls each) with --inference-workers 1 and 2, in `--rounds`
interleaved runs (N = 1, N = 2, N = 1, ...) so that drifting machine load hits both alike; the first
iteration of each run is dropped. From the N = 1 runs' busy times T_gen (inference) and T_train (training)
the prediction for N workers, each on its own device (`sizing.split_seconds`: rounds of N calls side by
side, fill and drain not overlapped), and the split of devices that
would balance the two sides (sizing.balanced_split).

What to expect on a CPU machine: the workers share its cores, so N = 2 is no faster (and its threads,
one per worker plus the trainer's, oversubscribe 2 cores, so the sides sample then train: setup.oversubscribed);
the prediction is what separate devices would give. No targets: a figure to read. `--tail` (default both): the
table with rows to the cap, then with the tail (benchmarks/tail.py).
"""
from __future__ import annotations

import argparse
import shlex
import statistics

from benchmarks import tail
from benchmarks.common import count, write_json
from benchmarks.pipeline import time_schedule
from benchmarks.tail import TAILS

WORKLOAD = ["--groups-per-call", "4", "--micro-batch-tokens", "16384"]  # tiny defaults otherwise: 16 prompts x 8
THREADS = ["--rollout-threads", "1", "--train-threads", "1"]  # one per worker, one for the trainer


def workers_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=count(), default=8, help="timed iterations per run (one more is dropped)")
    parser.add_argument("--rounds", type=count(), default=2, help="runs per worker count, interleaved")
    parser.add_argument("--trainer-args", default="", metavar="ARGS", help="trainer.py options added to every run")
    tail.add_tail_option(parser)
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


def workers(args: argparse.Namespace) -> bool:
    """Seconds per iteration with 1 and 2 inference workers per trainer, against the prediction."""
    figures = {}
    for tailed in TAILS[args.tail]:
        print("with the tail (benchmarks/tail.py)" if tailed else "rows to the cap")
        with tail.enabled(tailed):
            figures["tail" if tailed else "to the cap"] = worker_counts(args)
    write_json(args.json, figures)
    return True


def worker_counts(args: argparse.Namespace) -> dict:
    """`workers`' runs and table, with the tail as it is set."""
    from infra.command_line import parse_args
    from launch import sizing
    argv = [*WORKLOAD, *THREADS, *shlex.split(args.trainer_args)]
    counts = (1, 2)
    runs: dict[int, list[list[dict]]] = {n: [] for n in counts}
    for _ in range(args.rounds):
        for n in counts:
            runs[n].append(time_schedule([*argv, "--inference-workers", str(n)], args.iterations))

    def mean(n: int, key: str, round_: int | None = None) -> float:
        chosen = runs[n] if round_ is None else [runs[n][round_]]
        return statistics.mean(row[key] for rows in chosen for row in rows)

    calls = parse_args(argv).calls_per_iteration
    t_gen, t_train = mean(1, "generate_s"), mean(1, "train_s")
    print(f"model {parse_args(argv).model}, {calls} generate calls per iteration, {args.rounds} interleaved runs "
          f"per N, {args.iterations} timed iterations each; N = 1 phase times: T_gen {t_gen:.3f} s, "
          f"T_train {t_train:.3f} s; mean response {mean(1, 'response_length'):.1f} tokens")
    print(f"{'workers':>7s} {'s/iter':>7s} {'per round':>13s} {'predicted':>9s} {'gen dev-s':>9s} {'T_train':>7s} "
          f"{'overlap':>7s}")
    figures = {"calls": calls, "t_gen": t_gen, "t_train": t_train, "iterations": args.iterations,
               "rounds": args.rounds, "options": " ".join(argv), "workers": {}}
    for n in counts:
        per_round = [mean(n, "iteration_s", r) for r in range(args.rounds)]
        row = figures["workers"][n] = {
            "s_per_iter": mean(n, "iteration_s"), "per_round": per_round,
            "predicted": sizing.split_seconds(t_gen, t_train, calls, inference=n),
            "generate_device_s": mean(n, "generate_device_s"), "train_s": mean(n, "train_s"),
            "overlap": mean(n, "overlap")}
        print(f"{n:7d} {row['s_per_iter']:7.3f} {f'{min(per_round):.3f}-{max(per_round):.3f}':>13s} "
              f"{row['predicted']:9.3f} {row['generate_device_s']:9.3f} {row['train_s']:7.3f} {row['overlap']:7.0%}",
              flush=True)
    print(sizing.split_report(t_gen, t_train, 1, 1, calls))
    return figures
