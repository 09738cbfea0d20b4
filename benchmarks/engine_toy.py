"""Sampling one toy iteration (the quick start's): the engine with packed prefill, the engine with one prefill per
prompt, and Hugging Face `generate`, interleaved, one thread.

    python benchmarks/engine_toy.py [--rounds 15] [--prompts 4 --tail] [--against OLD_ENGINE_PY]

16 arithmetic prompts (~6 tokens) x 8 samples x 8 new tokens of the cached `tiny` model, in generate calls of
--prompts prompts: a call is all fixed costs, where prefilling each prompt in a forward of its own (prefill_tokens=1)
showed. --tail ends rows at benchmarks/tail.py's lengths (the engine's sides only); --against times another
engine.py beside this one (an earlier commit's, `git show REV:engine.py > FILE`), the same calls, interleaved.
Prints each side's median and min ms per iteration and per call, and its median CPU ms per call (the process's
CPU time: on a busy machine, less inflated than wall time by the waits for a core).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import engine  # noqa: E402
import rollout  # noqa: E402
from benchmarks import tail  # noqa: E402
from benchmarks.common import count  # noqa: E402
from infra import hf_generate  # noqa: E402
from infra.models import load_model  # noqa: E402
from infra.tasks import arithmetic_examples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=count(), default=15)
    parser.add_argument("--prompts", type=count(), default=16, help="prompts per generate call (16: one call)")
    parser.add_argument("--tail", action="store_true", help="rows end at benchmarks/tail.py's lengths")
    parser.add_argument("--against", metavar="ENGINE_PY", help="another engine.py, timed beside this one")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("tiny")
    prompts = [tokenizer.encode(example.prompt) for example in arithmetic_examples("train")[:16]]
    stops = rollout.stop_token_ids(model, tokenizer)
    settings = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_new_tokens=8)
    generation = hf_generate.sampling_config(settings, stops, tokenizer.pad_token_id)
    calls = range(0, len(prompts), args.prompts)

    def engine_side(module, prefill_tokens: int):
        return lambda: [module.sample_groups(model, prompts[first:first + args.prompts], 8, max_new_tokens=8,
                                             stop_ids=stops, keys=[(0, 0, j) for j in range(first, first + args.prompts)][:len(prompts) - first],
                                             prefill_tokens=prefill_tokens) for first in calls]
    sides = {"engine, packed prefill": engine_side(engine, engine.PREFILL_TOKENS), "engine, one prefill per prompt":
             engine_side(engine, 1), "generate": lambda: [hf_generate.sample_responses(
                 model, prompts[first:first + args.prompts], 8, generation, first) for first in calls]}
    if args.against:
        spec = importlib.util.spec_from_file_location("engine_against", args.against)
        against = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(against)
        tail.install(against.GenerateCall)
        sides[f"engine, packed prefill ({args.against})"] = engine_side(against, engine.PREFILL_TOKENS)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    with torch.no_grad(), tail.enabled(args.tail):
        if args.against and sides[f"engine, packed prefill ({args.against})"]() != sides["engine, packed prefill"]():
            raise SystemExit(f"{args.against} samples other tokens than engine.py: no like-for-like timing")
        for _ in range(args.rounds):
            for name, sample in sides.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                sample()
                seconds[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    for name, values in seconds.items():
        median, least = statistics.median(values) * 1e3, min(values) * 1e3
        print(f"{name:32s} median {median:6.1f} ms  min {least:6.1f} ms  per call {median / len(calls):5.2f} / "
              f"{least / len(calls):5.2f} ms, CPU {statistics.median(cpu[name]) * 1e3 / len(calls):5.2f} ms")


if __name__ == "__main__":
    main()
