"""Time one training micro-batch in each layout packing.py can use: what decided departure 5 (dense mask off CPU).

    python tools/train_step_layouts.py [--groups 3] [--prompt 450] [--response 128] [--repeats 3] [--small]
                                       [--vocab N] [--device cuda|cpu] [--vary-lengths] [--profile LAYOUT]
                                       [--layouts L ...] [--pad-to-multiple-of N]

One micro-batch is `learner.forward_backward`, as the trainer runs it: the tri-model's policy forward with the
reference forward (beta 0.04), the GRPO loss, its backward; bf16 autocast over float32 weights on CUDA, float32
on CPU. The model is Qwen2.5-0.5B-shaped with random weights (`--small`: a 2-layer toy, to check the script on
CPU); `--groups` groups of G = 8 responses of `--response` tokens (minus 0-2) to a `--prompt`-token prompt. Layouts:

    structured  packed rows through `packing.shared_prompt_attention` (forced, on any device)
    dense       packed rows through the dense (B, 1, L, L) shared-prompt mask, the model's own SDPA
    unpacked    one plain row per response
    dense-padded, unpacked-padded   the same, rows padded to a multiple of --pad-to-multiple-of (default 128)

Layouts are interleaved within each repeat after one warm-up each; each prints every repeat, its best, its peak
CUDA memory, and how far its gradient is from plain rows' (`|g - g_unpacked| / |g_unpacked|`: rounding only, the
layouts compute the same thing; about 1e-3 in bf16, 1e-7 in float32). `--profile LAYOUT` adds a torch.profiler
table of one more micro-batch in that layout. `--vary-lengths`: a new batch for every repeat, prompts of P/2 to P
tokens and responses of R/2 to R, so that no shape repeats (as in a run, where every micro-batch has its own
lengths); each layout's gradient is then compared with plain rows' on the same batch. With varied lengths the
padded layouts' shapes recur (one per 128 tokens of row length), the unpadded ones' do not: where a kernel is planned
per shape (cuDNN's attention on recent GPUs) the difference is that planning.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import learner  # noqa: E402
import packing  # noqa: E402
from config import Config  # noqa: E402
from tools.qwen_shaped_random import QWEN_05B  # noqa: E402
from tri_model import TriModel, frozen_copy  # noqa: E402

LAYOUTS = ("structured", "dense", "unpacked", "dense-padded", "unpacked-padded")


def layout_scorer(layout: str, multiple: int) -> Callable[[torch.nn.Module, list], tuple[torch.Tensor, torch.Tensor]]:
    """The tri-model's logprobs_fn for a layout (the structured kernel on any device, where packing.py would not)."""
    if layout == "structured":
        return packing.structured_batch_logprobs
    pad = multiple if layout.endswith("-padded") else 1
    if layout.startswith("dense"):
        return lambda model, groups, **options: packing.batch_logprobs(model, groups, "packed", dense_mask=True,
                                                                       pad_to_multiple_of=pad, **options)
    return lambda model, groups, **options: packing.batch_logprobs(model, groups, "unpacked", pad_to_multiple_of=pad,
                                                                   **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=450, help="prompt tokens (a GSM8K question in the chat "
                                                                 "template with the byte-level tokenizer)")
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 2-layer toy of the same shape (CPU check)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary size (with --small and 258: the shape of trainer.py's tiny model)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda where there is one (bf16 autocast there, float32 on CPU)")
    parser.add_argument("--vary-lengths", action="store_true", help="a new batch of other lengths every repeat")
    parser.add_argument("--profile", choices=LAYOUTS, default=None)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["structured", "dense", "unpacked"],
                        help="the layouts to time (default: the unpadded three)")
    parser.add_argument("--pad-to-multiple-of", type=int, default=128, help="the padded layouts' multiple")
    args = parser.parse_args()
    layouts = list(dict.fromkeys([*args.layouts, "unpacked"]))  # plain rows: the gradients' reference
    from transformers import Qwen2Config, Qwen2ForCausalLM
    device = args.device
    shape = dict(QWEN_05B)
    if args.small:
        shape.update(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4)
    if args.vocab:
        shape.update(vocab_size=args.vocab)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**shape), attn_implementation="sdpa").to(device).train()
    generator = torch.Generator().manual_seed(1)
    G = 8

    def draw_batch(vary: bool) -> list:
        def length(most: int, fixed: int) -> int:
            return int(torch.randint(most // 2, most + 1, (1,), generator=generator)) if vary else fixed
        return [(torch.randint(0, shape["vocab_size"], (length(args.prompt, args.prompt),),
                               generator=generator).to(device),                                        # (P,)
                 [torch.randint(0, shape["vocab_size"], (length(args.response, args.response - i % 3),),
                                generator=generator).to(device) for i in range(G)])                    # G x (R_i,)
                for _ in range(args.groups)]
    batch = draw_batch(vary=False)
    advantages = torch.randn(args.groups * G, generator=generator).tolist()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # as the trainer's --dtype auto
    tris = {layout: TriModel(model, layout_scorer(layout, args.pad_to_multiple_of), use_reference=False,
                             use_old=False, compute_dtype=dtype)
            for layout in layouts}
    reference = frozen_copy(model)  # one frozen θ_0 for all layouts
    for tri in tris.values():
        tri.reference = reference

    def step(layout: str, batch: list) -> tuple[float, torch.Tensor, float]:
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        learner.forward_backward(tris[layout], batch, advantages, Config())  # ∇ in .grad
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).float()  # (params,)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        return seconds, grad, peak

    reference_grad = {layout: step(layout, batch)[1] for layout in layouts}["unpacked"]  # warm-up
    best = {layout: float("inf") for layout in layouts}
    for repeat in range(args.repeats):
        if args.vary_lengths:
            batch = draw_batch(vary=True)
        results = {layout: step(layout, batch) for layout in layouts}
        if args.vary_lengths:
            reference_grad = results["unpacked"][1]  # plain rows on this batch (0 against itself)
        for layout, (seconds, grad, peak) in results.items():
            best[layout] = min(best[layout], seconds)
            off = ((grad - reference_grad).norm() / reference_grad.norm()).item()
            print(f"repeat {repeat} {layout:10s} {seconds * 1000:8.1f} ms  grad vs unpacked {off:.1e}  "
                  f"peak {peak:.1f} GiB", flush=True)
    lengths = "varied lengths up to " if args.vary_lengths else ""
    print(f"{args.groups} groups, {lengths}P={args.prompt}, R<={args.response}, G={G}, {device}, {dtype}: best of "
          f"{args.repeats}: " + ", ".join(f"{layout} {best[layout] * 1000:.0f} ms" for layout in layouts))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as profiled:
            step(args.profile, batch)
        key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        print(profiled.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=50))


if __name__ == "__main__":
    main()
