"""Helpers more than one benchmark uses: bytes saved for backward, a median timer, a ratio's confidence interval,
a Qwen2.5-0.5B-shaped model, the --json output."""
from __future__ import annotations

import argparse
import builtins
import json
import math
import statistics
import time
from typing import Callable

import torch


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


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of `repeats` calls of fn."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# Student's t, 97.5% quantile, 1 to 30 degrees of freedom
SLOWER_FLOOR = 0.97  # "not slower" also fails below this mean ratio: the toy's old hand-over, whatever the noise


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high): a 95% confidence interval of per-round speed ratios (A's speed / B's, one per
    round of interleaved runs), from Student's t on their logarithms (a ratio's noise is multiplicative):
    exp(m ± t·s/√n), m and s the logs' mean and standard deviation over n rounds; beyond 30 degrees of freedom
    t ≈ 1.96 + 2.4/df (within 0.005). One round: no interval (0, inf).

    "A is not slower than B" (`not_slower`) fails when the whole interval lies below 1: two runs of the same
    schedule differ by the machine's noise alone, and a bare mean >= 1 would be a coin flip.

    >>> [round(x, 3) for x in ratio_interval([1.1, 0.9, 1.0])]
    [0.997, 0.777, 1.279]
    """
    logs = [math.log(r) for r in ratios]
    mean = statistics.mean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    df = len(logs) - 1
    half = (T_975[df - 1] if df <= len(T_975) else 1.96 + 2.4 / df) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def not_slower(ratios: list[float]) -> bool:
    """Whether per-round speed ratios A/B show A not slower than B: the 95% interval (`ratio_interval`) reaches 1x,
    and the mean is at least SLOWER_FLOOR (with 3 noisy rounds the interval alone is wide enough to hide a real
    3% loss)."""
    mean, _, high = ratio_interval(ratios)
    return high >= 1.0 and mean >= SLOWER_FLOOR


def qwen_05b_shaped(tiny: bool, layers: int = 24) -> torch.nn.Module:
    """Random weights in Qwen2.5-0.5B's shape (494M parameters), or the tiny model's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if tiny:
        from infra.models import load_model
        return load_model("tiny")[0]
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1e6, max_position_embeddings=32768)
    with torch.device("cpu"):
        return Qwen2ForCausalLM(config)


def count(minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum` (repeats, rounds, threads, sizes: 1; 0 where the option
    says that 0 chooses for you), so that a bad count is one line before anything is measured."""
    def int(text: str) -> builtins.int:  # named so: argparse says "invalid int value: 'x'"
        value = builtins.int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value})")
        return value
    return int


def write_json(path: str | None, figures: object, indent: int = 1) -> None:
    """Write a benchmark's figures as JSON to `path` (its --json option); nothing when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=indent)
