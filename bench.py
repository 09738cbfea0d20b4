"""Benchmarks: `python bench.py <which> [options]`, one subcommand per claim the project makes.

shared-prompt  training-step time and memory, packed vs unpacked vs auto, over a (P, R) grid
               (benchmarks/shared_prompt.py)
async          seconds per iteration, synchronous vs periodic asynchrony, against the pipeline's bound
               (benchmarks/pipeline.py)
peer           samples/s of TRL's GRPOTrainer and of periodic-rl sync and async on the same work
               (benchmarks/peer.py)
publish        the cost of moving θ_k to the inference process (benchmarks/publish.py)
tri-model      memory and step time with and without the reference and old-policy copies
               (benchmarks/tri_model_copies.py)
memory         peak training memory of one GRPO step on the Qwen2.5-0.5B configuration
               (benchmarks/memory.py)
workers        seconds per iteration with 1 and 2 inference workers per trainer, against the prediction
               (benchmarks/workers.py)
gpu            the GPU table in one command: decode ms per step (engine with CUDA graphs, eager, generate),
               prefill and decode tokens/s, bandwidth; sync vs async; end to end against TRL (benchmarks/gpu.py)

Each module's docstring says what it measures, how to read its output and its targets. To add a
benchmark: write `<name>_args(parser)` and `<name>(args) -> bool` (True = all targets met) in a
module of benchmarks/ and register them in BENCHMARKS.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import trainer  # noqa: F401  as a run's: a reward's process pools end with it, in spawned processes too
from infra.errors import UserError
from infra.options import OneLineParser
from launch.start import shorten_openmp_spinning

shorten_openmp_spinning()  # before the benchmarks import torch: as trainer.py runs
from benchmarks import gpu, memory, peer, pipeline, publish, shared_prompt, tri_model_copies, workers  # noqa: E402
from benchmarks import tail  # noqa: E402,F401  the tail's patch, also in the inference processes (they import bench.py)

BENCHMARKS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], bool]]] = {
    "shared-prompt": (shared_prompt.shared_prompt_args, shared_prompt.shared_prompt),
    "async": (pipeline.async_args, pipeline.async_speedup),
    "publish": (publish.publish_args, publish.publish),
    "tri-model": (tri_model_copies.tri_model_args, tri_model_copies.tri_model),
    "memory": (memory.memory_args, memory.memory),
    "peer": (peer.peer_args, peer.peer),
    "workers": (workers.workers_args, workers.workers),
    "gpu": (gpu.gpu_args, gpu.gpu),
}


def main(argv: list[str] | None = None) -> int:
    """0 when every target is met, 1 when one is not or the run failed (one `error:` line), 2 for options that
    cannot run (one line, before anything is measured), 130 after Ctrl-C."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    parser = OneLineParser(prog="bench.py", description=__doc__.split("\n")[0])  # a bad option: one line
    subparsers = parser.add_subparsers(dest="which", required=True)
    for name, (add_args, run) in BENCHMARKS.items():
        add_args(subparsers.add_parser(name, help=run.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    if problem := refused(args):
        print(f"bench.py {args.which}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return 0 if BENCHMARKS[args.which][1](args) else 1
    except UserError as error:  # a model or data that cannot be read, a failed run the benchmark started
        print(f"error: {error}", file=sys.stderr)
    except OSError as error:  # a file it could not write
        print(f"error: {error.filename}: {error.strerror}" if error.filename else f"error: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted by SIGINT: the benchmark was stopped; its figures so far are above", file=sys.stderr)
        return 130
    return 1


def refused(args: argparse.Namespace) -> str | None:
    """A --json file whose folder does not exist, found before the benchmark runs rather than after its minutes."""
    folder = os.path.dirname(os.path.abspath(args.json)) if getattr(args, "json", None) else None
    if folder and not os.path.isdir(folder):
        return f"--json {args.json}: its folder {folder} does not exist (or is not a folder)"
    return None



if __name__ == "__main__":
    raise SystemExit(main())
