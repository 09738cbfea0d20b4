"""Helpers more than one benchmark uses: bytes saved for backward, a median timer, a Qwen2.5-0.5B-shaped model,
the --json output."""
from __future__ import annotations

import json
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


def qwen_05b_shaped(tiny: bool, layers: int = 24) -> torch.nn.Module:
    """Random weights in Qwen2.5-0.5B's shape (494M parameters), or the tiny model's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if tiny:
        from models import load_model
        return load_model("tiny")[0]
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1e6, max_position_embeddings=32768)
    with torch.device("cpu"):
        return Qwen2ForCausalLM(config)


def write_json(path: str | None, figures: object, indent: int = 1) -> None:
    """Write a benchmark's figures as JSON to `path` (its --json option); nothing when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=indent)
