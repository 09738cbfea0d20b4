"""Time one training micro-batch in each layout packing.py can use: what decided departure 5 (dense mask off CPU).

    python tools/train_step_layouts.py [--groups 3] [--prompt 450] [--response 128] [--repeats 3] [--small]
                                       [--profile LAYOUT]

One micro-batch is `learner.forward_backward`, as the trainer runs it: the tri-model's policy forward with the
reference forward (beta 0.04), the GRPO loss, its backward; bf16 autocast over float32 weights on CUDA, float32
on CPU. The model is Qwen2.5-0.5B-shaped with random weights (`--small`: a 2-layer toy, to check the script on
CPU); `--groups` groups of G = 8 responses of `--response` tokens (minus 0-2) to a `--prompt`-token prompt. Layouts:

    structured  packed rows through `packing.shared_prompt_attention` (forced, on any device)
    dense       packed rows through the dense (B, 1, L, L) shared-prompt mask, the model's own SDPA
    unpacked    one plain row per response

Layouts are interleaved within each repeat after one warm-up each; each prints every repeat, its best, its peak
CUDA memory, and the loss and gradient norm (equal up to bf16 rounding: the layouts compute the same thing).
`--profile LAYOUT` adds a torch.profiler table of one more micro-batch in that layout.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import learner  # noqa: E402
import packing  # noqa: E402
from config import Config  # noqa: E402
from tools.qwen_shaped_random import QWEN_05B  # noqa: E402
from tri_model import TriModel  # noqa: E402

LAYOUTS = ("structured", "dense", "unpacked")


def layout_scorer(layout: str):
    """The tri-model's logprobs_fn for a layout (the structured kernel forced where packing.py would not use it)."""
    def scorer(model, groups):
        if layout == "unpacked":
            return packing.batch_logprobs(model, groups, "unpacked")
        if layout == "dense":
            return packing.batch_logprobs(model, groups, "packed", dense_mask=True)
        forced, packing.structured_kernel = packing.structured_kernel, lambda model, dense_mask=False: True
        try:
            return packing.batch_logprobs(model, groups, "packed")
        finally:
            packing.structured_kernel = forced
    return scorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=450, help="prompt tokens (a GSM8K question in the chat "
                                                                 "template with the byte-level tokenizer)")
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 2-layer toy of the same shape (CPU check)")
    parser.add_argument("--profile", choices=LAYOUTS, default=None)
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = dict(QWEN_05B)
    if args.small:
        shape.update(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**shape), attn_implementation="sdpa").to(device).train()
    generator = torch.Generator().manual_seed(1)
    G = 8
    batch = [(torch.randint(0, shape["vocab_size"], (args.prompt,), generator=generator).to(device),   # (P,)
              [torch.randint(0, shape["vocab_size"], (args.response - i % 3,), generator=generator).to(device)
               for i in range(G)])                                                                        # G x (R_i,)
             for _ in range(args.groups)]
    advantages = torch.randn(args.groups * G, generator=generator).tolist()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tris = {layout: TriModel(model, layout_scorer(layout), use_reference=False, use_old=False, compute_dtype=dtype)
            for layout in LAYOUTS}
    reference = TriModel(model, None, use_reference=True, use_old=False).reference  # one frozen θ_0 for all
    for tri in tris.values():
        tri.reference = reference

    def step(layout: str) -> tuple[float, float, float, float]:
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss, _ = learner.forward_backward(tris[layout], batch, advantages, Config())
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        return seconds, loss.item(), grad_norm.item(), peak

    for layout in LAYOUTS:
        step(layout)  # warm-up
    best = {layout: float("inf") for layout in LAYOUTS}
    for repeat in range(args.repeats):
        for layout in LAYOUTS:
            seconds, loss, grad_norm, peak = step(layout)
            best[layout] = min(best[layout], seconds)
            print(f"repeat {repeat} {layout:10s} {seconds * 1000:8.1f} ms  loss {loss:+.6f}  |grad| {grad_norm:.6e}  "
                  f"peak {peak:.1f} GiB", flush=True)
    print(f"{args.groups} groups, P={args.prompt}, R<={args.response}, G={G}, {device}, {dtype}: best of "
          f"{args.repeats}: " + ", ".join(f"{layout} {best[layout] * 1000:.0f} ms" for layout in LAYOUTS))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as profiled:
            step(args.profile)
        key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        print(profiled.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=50))


if __name__ == "__main__":
    main()
