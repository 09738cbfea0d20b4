"""`python bench.py async`: seconds per iteration, synchronous vs periodic asynchrony, on the same work.

The same training run (tiny model, default options, evaluation off) in --mode sync and --mode
async, in `--rounds` interleaved pairs of runs (sync, async, sync, async, ...) so that drifting
machine load hits both alike: seconds per iteration of each (mean over all timed iterations,
each run's first iteration dropped), the speedup and its range over the rounds, the phase
times T_gen and T_train measured in sync mode, and two bounds:
  ideal  (T_gen + T_train) / max(T_gen, T_train), a perfect pipeline
  bound  the pipeline's bound from async's own spans at the sizes and threads it chose (infra/timeline.py's
         bound_s: publish + generation + the last micro-batch and the step, or the fill + the training
         after it, whichever is longer), as a speedup over sync: what a perfect pipeline of the same phase
         times would reach. Streaming by completion inside one generate call counts (the fill ends when
         the first micro-batch starts). It judges the pipeline, not the choice of sizes and threads
         (slower spans lower the bound too): "async never slower than sync" judges that. `predicted` is
         the probe's speedup before the run (`sizing.choose`, 1.00x when it samples then trains): a check of the
         probe's model, not a target.
`--call-sweep` runs the default workload at several --groups-per-call instead: batching vs
streaming. Both modes run at the sizes async's probe picks (`probed_sizes`, probed once per
workload: the same generate calls and micro-batch, so the two compare at the same sizes); sync
uses all cores, async the probe's split. Workloads beyond the default vary the balance (long
responses, big groups, few groups, 4 prompts per generate call, several updates per iteration).

`--tail` (default both): each workload with rows to the cap, and with the tail (`+tail`: rows ended at lengths drawn
by the seed from the spread of GSM8K's answer lengths, benchmarks/tail.py), side by side; `auto` names the mode
--mode auto picks there (infra/sharing.py), `overlap` async's share of the iteration with both sides busy.
`--split-check` checks the closing `split:` line's model instead (launch/sizing.split_seconds, docs/distributed.md)
at one inference and one training core group: each side's busy seconds per iteration measured in sync at one
thread, the async iteration predicted from them, against async measured at one thread per side, with and without
the tail.

Targets, on the default workload: async at least 90% of its `bound` (its seconds per iteration at most
bound_s / 0.9); on every workload async not slower than sync: the 95% interval of the per-round speedups
reaches 1x and their mean is at least 0.97x (`benchmarks.common.not_slower`); with the tail, async at least
TAIL_TARGET x sync on the default workload. `--split-check`: measured within SPLIT_TOLERANCE of predicted. Where
async samples then trains (the toy's default on 2 cores) it runs sync's schedule in one process
(`setup.async_runs_as_sync`): the two differ by the machine's noise alone, and a bare mean >= 1x would be a coin flip.
"""
from __future__ import annotations

import argparse
import shlex
import statistics

from benchmarks import tail
from benchmarks.tail import TAILS
from benchmarks.common import SLOWER_FLOOR, count, not_slower, ratio_interval, write_json
from infra.options import available_cores

TAIL_TARGET = 1.3  # async over sync with the tail, default workload
SPLIT_TOLERANCE = 0.15  # the split model's prediction against the measured seconds per iteration

ASYNC_WORKLOADS = {  # name -> trainer options on top of the tiny defaults (16 prompts x 8, <= 8 new tokens)
    "default": [],
    "long responses": ["--max-new-tokens", "24", "--reward", "tests/rewards.py:digit_fraction"],
    "big groups": ["--group-size", "16"],
    "few groups": ["--batch-size", "32"],
    "calls of 4": ["--groups-per-call", "4"],
    "4 updates/iter": ["--updates-per-iteration", "4"],
}
PHASE_KEYS = ("iteration_s", "generate_s", "generate_device_s", "train_s", "idle_inference_s", "idle_training_s",
              "overlap", "bound_s", "response_length")


def time_schedule(argv: list[str], iterations: int) -> list[dict[str, float]]:
    """Run trainer.py's schedule in this process; the per-iteration figures, first iteration dropped."""
    import trainer
    from infra.command_line import parse_args

    cfg = parse_args([*argv, "--iterations", str(iterations + 1), "--eval-every", "0", "--no-save"])
    with trainer.started(cfg) as (schedule, _, _):  # the trainer's own start: devices, task, inference process, policy
        rows = [row for row in schedule if not row.get("final")][1:]
    return [{key: row[key] for key in PHASE_KEYS} for row in rows]


def async_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the default workload only")
    parser.add_argument("--iterations", type=count(), default=10,
                        help="timed iterations per run (one more is dropped)")
    parser.add_argument("--rounds", type=count(), default=3, help="sync/async run pairs per workload, interleaved")
    parser.add_argument("--trainer-args", default="", metavar="ARGS",
                        help="trainer.py options added to every workload, "
                             "e.g. \"--groups-per-call 8 --rollout-threads 2\"")
    parser.add_argument("--call-sweep", "--chunk-sweep", action="store_true",
                        help="instead: the default workload at 1, 2, 4, 8 and 16 prompts per generate call (no targets)")
    tail.add_tail_option(parser)
    parser.add_argument("--split-check", action="store_true",
                        help="instead: the split model's prediction at one inference and one training core group "
                             "against the measured seconds per iteration, with and without the tail")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


CALL_SWEEP = (1, 2, 4, 8, 16)


def pipeline_bound(t_gen: float, t_train: float, calls: int) -> float:
    """Best speedup of a two-stage pipeline over running the stages back to back, n equal generate calls.

    A generate call (--groups-per-call groups) is what flows through the pipeline. Per call
    g = T_gen / n and t = T_train / n. Sync takes n(g + t); the pipeline takes
    g + t + (n - 1) max(g, t): the first call's generation (fill) and the last call's training
    (drain) overlap nothing. As n grows this tends to (T_gen + T_train) / max(T_gen, T_train).
    """
    g, t = t_gen / calls, t_train / calls
    return calls * (g + t) / (g + t + (calls - 1) * max(g, t))


def probed_sizes(argv: list[str]) -> tuple[list[str], list[str], float | None]:
    """The options async mode's probe picks for `argv` (probed once, here): (the generate calls and the
    micro-batch, which both modes then use, so that they compare at the same sizes; the thread split,
    async's only; the probe's predicted speedup over sampling then training at these sizes, None if nothing was
    probed)."""
    from launch import setup
    import trainer
    from infra.command_line import parse_args
    from infra.options import fits_memory
    from launch import sizing

    cfg = parse_args([*argv, "--mode", "async"])
    if cfg.sized or fits_memory(cfg):  # (on a GPU only the micro-batch is open: each run fits it to its memory)
        return [], [], None
    cfg, task, _, load_kwargs = trainer.prepare(cfg)
    train_examples = task.train
    policy, tokenizer = trainer.load_policy(cfg, load_kwargs)  # the policy only, no inference process
    tri = setup.build_tri_model(cfg, policy, tokenizer.pad_token_id)
    chosen, _, gain = sizing.choose(cfg, tri, tokenizer, train_examples)
    return (["--groups-per-call", str(chosen.groups_per_call),
             "--micro-batch-tokens", str(chosen.micro_batch_tokens)],
            ["--rollout-threads", str(chosen.rollout_threads), "--train-threads", str(chosen.train_threads),
             "--train-threads-after-sampling", str(chosen.train_threads_after_sampling)], gain)


def async_workload(argv: list[str], iterations: int, rounds: int, tailed: bool = False) -> dict:
    """`rounds` pairs of runs, sync then async, so that drifting machine load hits both modes alike,
    both at the generate calls async's probe picks (`probed_sizes`); `tailed`: with the tail (benchmarks/tail.py),
    the probe too.

    Seconds per iteration are means over all timed iterations of all rounds (what a long run would
    see); the speedup is their ratio, and each round's own ratio shows the spread.
    """
    with tail.enabled(tailed):
        return timed_workload(argv, iterations, rounds)


def timed_workload(argv: list[str], iterations: int, rounds: int) -> dict:
    """`async_workload`'s runs and figures, with the tail as it is set."""
    from infra.command_line import parse_args
    sizes, threads, predicted = probed_sizes(argv)
    argv = [*argv, *sizes]
    runs: dict[str, list[list[dict]]] = {"sync": [], "async": []}
    for _ in range(rounds):
        for mode in runs:
            runs[mode].append(time_schedule([*argv, "--mode", mode, *(threads if mode == "async" else [])],
                                            iterations))

    def mean(mode: str, key: str, round_: int | None = None) -> float:
        chosen = runs[mode] if round_ is None else [runs[mode][round_]]
        return statistics.mean(row[key] for rows in chosen for row in rows)

    t_gen, t_train = mean("sync", "generate_s"), mean("sync", "train_s")
    calls = parse_args(argv).calls_per_iteration  # the pipeline's units
    per_round = [mean("sync", "iteration_s", r) / mean("async", "iteration_s", r) for r in range(rounds)]
    return {"sync_s_per_iter": mean("sync", "iteration_s"), "async_s_per_iter": mean("async", "iteration_s"),
            "speedup": mean("sync", "iteration_s") / mean("async", "iteration_s"), "speedup_per_round": per_round,
            "ideal_speedup": (t_gen + t_train) / max(t_gen, t_train),
            "pipeline_bound": pipeline_bound(t_gen, t_train, calls), "calls_per_iteration": calls,
            "predicted_speedup": predicted,  # the probe's, before the run: streaming counted, at async's threads
            "bound": mean("sync", "iteration_s") / mean("async", "bound_s"),  # async's own spans (infra/timeline.py)
            "efficiency": mean("async", "bound_s") / mean("async", "iteration_s"),
            "sync_generate_s": t_gen,
            "sync_train_s": t_train, "async_generate_s": mean("async", "generate_s"),
            "async_train_s": mean("async", "train_s"), "async_overlap": mean("async", "overlap"),
            "sizes": " ".join(sizes + threads), "iterations": iterations, "rounds": rounds,
            "auto": parse_args(argv).mode, "response_length": mean("sync", "response_length")}


def async_speedup(args: argparse.Namespace) -> bool:
    """Seconds per iteration, synchronous vs periodic asynchrony, on the same work."""
    if args.split_check:
        return split_check(args)
    results = {}
    if args.call_sweep:
        workloads = {f"calls of {c}": ["--groups-per-call", str(c)] for c in CALL_SWEEP}
    else:
        workloads = {name: ASYNC_WORKLOADS[name] for name in (["default"] if args.quick else ASYNC_WORKLOADS)}
    print(f"{args.rounds} rounds x (sync run, async run) per workload, {args.iterations} timed iterations each; "
          f"sync: {available_cores()} threads; async: the cores split between the two processes, or all of them "
          f"in one process when the sides sample then train")
    print(f"{'workload':22s} {'len':>5s} {'sync s/it':>10s} {'async s/it':>10s} {'speedup':>8s} {'per round':>12s} "
          f"{'bound':>6s} {'predicted':>9s} {'ideal':>6s} {'T_gen':>6s} {'T_train':>7s} {'overlap':>8s} {'auto':>5s}")
    for name, argv in workloads.items():
        for tailed in TAILS[args.tail]:
            label = f"{name} +tail" if tailed else name
            row = results[label] = async_workload([*argv, *shlex.split(args.trainer_args)], args.iterations,
                                                  args.rounds, tailed)
            spread = f"{min(row['speedup_per_round']):.2f}-{max(row['speedup_per_round']):.2f}x"
            predicted = "-" if row["predicted_speedup"] is None else f"{row['predicted_speedup']:.2f}x"
            print(f"{label:22s} {row['response_length']:5.1f} {row['sync_s_per_iter']:10.3f} "
                  f"{row['async_s_per_iter']:10.3f} {row['speedup']:7.2f}x "
                  f"{spread:>12s} {row['bound']:5.2f}x {predicted:>9s} {row['ideal_speedup']:5.2f}x "
                  f"{row['sync_generate_s']:6.3f} {row['sync_train_s']:7.3f} "
                  f"{row['async_overlap']:8.0%} {row['auto']:>5s}", flush=True)
    if args.call_sweep:  # a trade-off to read, not a target: one call per iteration has nothing to overlap
        fastest = min(results, key=lambda name: min(results[name]["sync_s_per_iter"],
                                                     results[name]["async_s_per_iter"]))
        print(f"fastest configuration: {fastest}, "
              f"{'sync' if results[fastest]['sync_s_per_iter'] < results[fastest]['async_s_per_iter'] else 'async'}")
        write_json(args.json, {"workloads": results})
        return True
    default = results.get("default") or results["default +tail"]
    intervals = {name: ratio_interval(r["speedup_per_round"]) for name, r in results.items()}
    worst = min(intervals, key=lambda name: intervals[name][2])  # the least evidence that async is not slower
    checks = [(default["efficiency"] >= 0.9,
               f"async >= 90% of its pipeline bound on the default workload: {default['speedup']:.2f}x of "
               f"{default['bound']:.2f}x ({default['efficiency']:.0%})"),
              *([(results["default +tail"]["speedup"] >= TAIL_TARGET,
                  f"async >= {TAIL_TARGET}x sync with the tail on the default workload: "
                  f"{results['default +tail']['speedup']:.2f}x")] if "default +tail" in results else []),
              (all(not_slower(r["speedup_per_round"]) for r in results.values()),
               f"async never slower than sync (95% interval of the per-round speedups reaching 1x, mean >= "
               f"{SLOWER_FLOOR}x): worst "
               f"{worst}, {intervals[worst][0]:.2f}x ({intervals[worst][1]:.2f}-{intervals[worst][2]:.2f}x)")]
    for ok, line in checks:
        print(("PASS " if ok else "FAIL ") + line)
    write_json(args.json, {**default, "workloads": results})
    return all(ok for ok, _ in checks)


def split_check(args: argparse.Namespace) -> bool:
    """The split model (sizing.split_seconds) at one inference and one training core group: each side's busy seconds
    per iteration measured in sync at one thread (T_gen, T_train: one 'device' each), the async iteration predicted
    from them, against async measured at one thread per side (--train-threads-after-sampling 1: no switch after
    sampling), in interleaved rounds, with and without the tail. `from own`: the same model fed async's own busy
    seconds, which include what the two sides cost each other when they compute at once (shared cores, caches, memory bandwidth, other jobs):
    a check of the overlap alone, where `predicted` also assumes each side runs as fast beside the other as alone."""
    from infra.command_line import parse_args
    from launch import sizing
    one_each = ["--rollout-threads", "1", "--train-threads", "1", "--train-threads-after-sampling", "1"]
    argv = [*SPLIT_WORKLOAD, *one_each, *shlex.split(args.trainer_args)]
    calls = parse_args(argv).calls_per_iteration
    print(f"split model at 1 inference + 1 training core group: {calls} generate calls per iteration, {args.rounds} "
          f"rounds x (sync, async), {args.iterations} timed iterations each")
    print(f"{'workload':16s} {'len':>5s} {'T_gen':>6s} {'T_train':>7s} {'predicted':>9s} {'measured':>8s} "
          f"{'ratio':>6s} {'per round':>12s} {'overlap':>7s} {'busy async/sync':>15s} {'from own':>8s} {'ratio':>6s}")
    figures, ok, own_ok = {}, True, True
    for tailed in TAILS[args.tail]:
        runs: dict[str, list[list[dict]]] = {"sync": [], "async": []}
        with tail.enabled(tailed):
            for _ in range(args.rounds):
                for mode in runs:
                    runs[mode].append(time_schedule([*argv, "--mode", mode], args.iterations))

        def mean(mode: str, key: str, rounds: list[int] | None = None) -> float:
            chosen = [runs[mode][r] for r in (rounds if rounds is not None else range(args.rounds))]
            return statistics.mean(row[key] for rows in chosen for row in rows)
        predicted = [sizing.split_seconds(mean("sync", "generate_s", [r]), mean("sync", "train_s", [r]), calls)
                     for r in range(args.rounds)]
        ratios = [mean("async", "iteration_s", [r]) / p for r, p in enumerate(predicted)]
        row = figures["tail" if tailed else "to the cap"] = {
            "t_gen": mean("sync", "generate_s"), "t_train": mean("sync", "train_s"),
            "predicted": sizing.split_seconds(mean("sync", "generate_s"), mean("sync", "train_s"), calls),
            "measured": mean("async", "iteration_s"), "ratio_per_round": ratios,
            "overlap": mean("async", "overlap"), "response_length": mean("sync", "response_length"),
            # the sides' busy seconds in async (both at once) over sync's (each alone): > 1 where they slow each other
            "busy_async_over_sync": ((mean("async", "generate_s") + mean("async", "train_s"))
                                     / (mean("sync", "generate_s") + mean("sync", "train_s"))),
            "predicted_from_own": sizing.split_seconds(mean("async", "generate_s"), mean("async", "train_s"), calls)}
        row["ratio"] = row["measured"] / row["predicted"]
        row["ratio_from_own"] = row["measured"] / row["predicted_from_own"]
        ok = ok and abs(row["ratio"] - 1) <= SPLIT_TOLERANCE
        own_ok = own_ok and abs(row["ratio_from_own"] - 1) <= SPLIT_TOLERANCE
        print(f"{'default +tail' if tailed else 'default':16s} {row['response_length']:5.1f} {row['t_gen']:6.3f} "
              f"{row['t_train']:7.3f} {row['predicted']:9.3f} {row['measured']:8.3f} {row['ratio']:5.2f}x "
              f"{f'{min(ratios):.2f}-{max(ratios):.2f}x':>12s} {row['overlap']:7.0%} "
              f"{row['busy_async_over_sync']:14.2f}x {row['predicted_from_own']:8.3f} {row['ratio_from_own']:5.2f}x",
              flush=True)
    print(("PASS " if ok else "FAIL ") + f"measured within {SPLIT_TOLERANCE:.0%} of the split model's prediction "
          "from each side's busy seconds alone (sync)")
    print(("PASS " if own_ok else "FAIL ") + f"measured within {SPLIT_TOLERANCE:.0%} of the overlap model fed async's "
          "own busy seconds (what the sides cost each other left out of the check)")
    write_json(args.json, {"calls": calls, "options": " ".join(argv), **figures})
    return ok


SPLIT_WORKLOAD = ["--groups-per-call", "4", "--micro-batch-tokens", "16384"]  # tiny defaults otherwise: 4 calls
