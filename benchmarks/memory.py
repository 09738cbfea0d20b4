"""`python bench.py memory`: peak training memory of one GRPO step on the Qwen2.5-0.5B configuration.

One GRPO step (the policy forward/backward with the reference forward, beta 0.04, AdamW step) for
the Qwen2.5-0.5B configuration with random weights on one group, P=256, R=512, G=8, as `TriModel`
runs it: log-probs from the hidden states in checkpointed chunks (the default), the same with
`--gradient-checkpointing`, and the whole (tokens x vocab) float32 logits at once (what chunking
replaces). Measured as the peak of live tensor bytes (`LiveTensorBytes`: what
torch.cuda.max_memory_allocated reports on a GPU, without the allocator's rounding and cache), at
2, 4 and 24 layers: every layer is the same computation, so the peak is linear in the layers and a
variant too big for this machine's RAM at 24 layers is skipped with its linear prediction. float32
compute on CPU by default (this CPU has no native bf16).
"""
from __future__ import annotations

import argparse
import os
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import attention
import packing
from benchmarks.common import count, qwen_05b_shaped, write_json
from infra.options import available_cores

MEMORY_VARIANTS = ("chunked", "checkpointed", "whole-logits")  # default; + --gradient-checkpointing; unchunked


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of tensor storage alive and their peak, counting `existing` tensors and every one made inside.

    The CPU counterpart of torch.cuda.max_memory_allocated (without allocator rounding or cache): a
    storage is counted when an op returns it and uncounted when it is freed.
    """

    def __init__(self, existing=()):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        for tensor in existing:
            self._count(tensor)

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = id(storage), storage.nbytes()
        if key in self._refs:
            return

        def freed(_, key=key, size=size):
            self._refs.pop(key, None)
            self.live -= size
        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out


def memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", default="2,4,24",
                        help="decoder layer counts, comma-separated (Qwen2.5-0.5B has 24); variants that do not fit in "
                             "RAM at a count are skipped")
    parser.add_argument("--prompt-len", type=count(), default=256)
    parser.add_argument("--response-len", type=count(), default=512)
    parser.add_argument("--group-size", type=count(), default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype (bf16 matrix products are ~80x slower than float32 on a CPU without "
                             "native bf16)")
    parser.add_argument("--threads", type=count(), default=available_cores())
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE")


def grpo_step_peak(variant: str, dtype: torch.dtype, layers: int, P: int, R: int, G: int) -> dict:
    """Peak live tensor bytes of one GRPO step (policy fwd/bwd + reference fwd + AdamW step) as the trainer runs it."""
    from grpo import grpo_loss
    from tri_model import TriModel
    torch.manual_seed(0)
    policy = qwen_05b_shaped(tiny=False, layers=layers).train()
    if variant == "checkpointed":
        packing.enable_activation_checkpointing(policy)
    tri = TriModel(policy, packing.logprobs_fn(policy), use_reference=True, use_old=False, compute_dtype=dtype)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    vocab = policy.config.vocab_size
    group = (torch.randint(vocab, (P,)), [torch.randint(vocab, (R,)) for _ in range(G)])
    weights = list(policy.parameters()) + list(tri.reference.parameters())
    chunk_bytes, columns = attention.LOGITS_CHUNK_BYTES, attention.VOCAB_CHUNK
    if variant == "whole-logits":  # one block: every row, every column
        attention.LOGITS_CHUNK_BYTES, attention.VOCAB_CHUNK = 2 ** 62, 2 ** 62
    start = time.perf_counter()
    try:
        with LiveTensorBytes(weights) as tracker:
            logp, old, ref, mask = tri([group])
            loss, _ = grpo_loss(logp, old, ref, torch.randn(G), mask, beta=0.04)
            loss.backward()
            backward_peak = tracker.peak
            optimizer.step()
    finally:
        attention.LOGITS_CHUNK_BYTES, attention.VOCAB_CHUNK = chunk_bytes, columns
    return {"variant": variant, "dtype": str(dtype).removeprefix("torch."), "layers": layers,
            "layout": ("packed" if packing.packing_pays(P, [R] * G, dense=not packing.structured_kernel(policy))
                       else "plain rows"),
            "parameters": sum(p.numel() for p in policy.parameters()),
            "weight_bytes": sum(w.untyped_storage().nbytes() for w in weights),
            "backward_peak_bytes": backward_peak, "peak_bytes": tracker.peak, "step_s": time.perf_counter() - start}


def memory(args: argparse.Namespace) -> bool:
    """Peak training memory of one GRPO step on the Qwen2.5-0.5B configuration, per log-prob / checkpointing variant."""
    torch.set_num_threads(args.threads)
    dtype, layer_counts = getattr(torch, args.dtype), [int(n) for n in args.layers.split(",")]
    print(f"one GRPO step (policy fwd/bwd + reference fwd + AdamW), Qwen2.5-0.5B config, random weights, "
          f"P={args.prompt_len}, R={args.response_len}, G={args.group_size}, {args.dtype} compute on CPU; "
          f"peak live tensor bytes (LiveTensorBytes); GiB = 2^30 bytes")
    print(f"{'variant':<14} {'layers':>6} {'layout':<10} {'weights':>8} {'fwd/bwd peak':>12} {'above weights':>13} "
          f"{'peak with AdamW':>15} {'step s':>7}")
    rows, gib = [], 2 ** 30
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for variant in MEMORY_VARIANTS:
        fitted = []
        for layers in layer_counts:
            if len(fitted) >= 2:  # the rise is linear in the layers (identical layers): predict before running
                (l1, b1), (l2, b2) = fitted[:2]
                predicted = b1 + (b2 - b1) / (l2 - l1) * (layers - l1)
                if predicted > 0.8 * ram:
                    print(f"{variant:<14} {layers:6d}  skipped: predicted fwd/bwd peak {predicted / gib:.1f} GiB "
                          f"(linear in the layers from {l1} and {l2}) > 80% of this machine's {ram / gib:.0f} GiB")
                    continue
            row = grpo_step_peak(variant, dtype, layers, args.prompt_len, args.response_len, args.group_size)
            rows.append(row)
            fitted.append((layers, row["backward_peak_bytes"]))
            print(f"{variant:<14} {layers:6d} {row['layout']:<10} {row['weight_bytes'] / gib:8.2f} "
                  f"{row['backward_peak_bytes'] / gib:12.2f} "
                  f"{(row['backward_peak_bytes'] - row['weight_bytes']) / gib:13.2f} "
                  f"{row['peak_bytes'] / gib:15.2f} {row['step_s']:7.1f}", flush=True)
    write_json(args.json, rows)
    return True
