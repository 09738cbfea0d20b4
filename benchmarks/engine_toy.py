"""Sampling one toy iteration (the quick start's): the engine with packed prefill, the engine with one prefill per
prompt, and Hugging Face `generate`, interleaved, one thread.

    python benchmarks/engine_toy.py [--rounds 15]

16 arithmetic prompts (~6 tokens) x 8 samples x 8 new tokens of the cached `tiny` model: a call is all fixed costs,
where prefilling each prompt in a forward of its own (prefill_tokens=1) showed. Prints each side's median and min ms.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import engine  # noqa: E402
import rollout  # noqa: E402
from infra import hf_generate  # noqa: E402
from infra.models import load_model  # noqa: E402
from infra.tasks import arithmetic_examples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("tiny")
    prompts = [tokenizer.encode(example.prompt) for example in arithmetic_examples("train")[:16]]
    stops = rollout.stop_token_ids(model, tokenizer)
    settings = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_new_tokens=8)
    generation = hf_generate.sampling_config(settings, stops, tokenizer.pad_token_id)

    def engine_side(prefill_tokens: int):
        return lambda: engine.sample_groups(model, prompts, 8, max_new_tokens=8, stop_ids=stops,
                                            keys=[(0, 0, j) for j in range(16)], prefill_tokens=prefill_tokens)
    sides = {"engine, packed prefill": engine_side(engine.PREFILL_TOKENS), "engine, one prefill per prompt":
             engine_side(1), "generate": lambda: hf_generate.sample_responses(model, prompts, 8, generation, 0)}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, sample in sides.items():
                start = time.perf_counter()
                sample()
                seconds[name].append(time.perf_counter() - start)
    for name, values in seconds.items():
        print(f"{name:32s} median {statistics.median(values) * 1e3:6.1f} ms  min {min(values) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
