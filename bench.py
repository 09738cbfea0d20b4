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
from typing import Callable

import trainer  # noqa: F401  as a run's: a reward's process pools end with it, in spawned processes too
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
