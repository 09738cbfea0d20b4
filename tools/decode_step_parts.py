"""Time the pieces of one decode step alone, each way it could be written: which attention kernel (flex attention
over the blocks each row has written among them: not in the engine until it pays), which draw. For the Qwen2.5-0.5B
configuration at 128 rows (docs/benchmarks.md).

    python tools/decode_step_parts.py                      # CUDA: each variant's GPU time, CUDA graphs
    python tools/decode_step_parts.py --device cpu --vocab 4096 --length 128    # a dry run of every variant

Each variant runs `--repeat` times inside one CUDA graph, replayed once untimed, then `--replays` times; the figure
is the median replay over the repeats, in microseconds per call, printed beside each replay's: the GPU's time with
the launches' gaps of a captured step, as infra/compiled_step.DecodeGraphs replays it. On CPU each variant runs
eagerly (no graphs): a check that it runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import engine  # noqa: E402
from infra import compiled_step  # noqa: E402


def timed(fn, device: torch.device, repeat: int, replays: int) -> list[float]:
    """Microseconds per call of fn() in each of `replays` rounds, after warm-up calls: on CUDA `repeat` calls
    captured in one CUDA graph, replayed once untimed, then once per round; on CPU `repeat` eager calls a round."""
    for _ in range(3):
        fn()  # warm-up: compilation, cuBLAS workspaces, lazy initialisations
    if device.type != "cuda":
        rounds = []
        for _ in range(replays):
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            rounds.append((time.perf_counter() - start) / repeat * 1e6)
        return rounds
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeat)
    return times


def attention_variants(rows: int, length: int, device, dtype) -> dict:
    """decode_attention's product: (n, K, H/K, D) queries against (n, K, L, D) keys and values, a (n, 1, 1, L) mask."""
    kv_heads, per, dim = 2, 7, 64  # Qwen2.5-0.5B: 14 query heads on 2 key heads of 64
    query = torch.randn(rows, kv_heads, per, dim, device=device, dtype=dtype)
    key, value = (torch.randn(rows, kv_heads, length, dim, device=device, dtype=dtype) for _ in range(2))
    seen = torch.randint(length // 5, length, (rows, 1)).to(device)  # ~60% written, as the decode part's 53%
    mask = torch.zeros(rows, 1, 1, length, device=device, dtype=dtype).masked_fill_(
        (torch.arange(length, device=device) >= seen)[:, None, None], torch.finfo(dtype).min)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        return run

    def products():  # softmax(q·kᵀ/√D + mask)·v as two batched matrix products
        scores = torch.matmul(query, key.transpose(-1, -2)) * dim ** -0.5 + mask  # (n, K, H/K, L)
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(dtype), value)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    last = seen[:, 0] - 1  # (n,) the last slot each row attends to

    def written(b, h, q_idx, kv_idx):
        return kv_idx <= last[b]
    blocks = -(-length // 128)
    counts = (last // 128 + 1).to(torch.int32).view(rows, 1, 1)                                  # (n, 1, 1)
    order = torch.arange(blocks, dtype=torch.int32, device=device).expand(rows, 1, 1, blocks).contiguous()
    block_mask = BlockMask.from_kv_blocks(counts, order, BLOCK_SIZE=128, mask_mod=written, seq_lengths=(1, length))
    heads = query.reshape(rows, kv_heads * per, 1, dim)                                            # (n, H, 1, D)
    flex = torch.compile(flex_attention) if device.type != "cpu" else flex_attention
    difference = (flex(heads, key, value, block_mask=block_mask, enable_gqa=True).reshape(rows, kv_heads, per, dim)
                  - F.scaled_dot_product_attention(query, key, value, attn_mask=mask)).abs().max()
    print(f"    flex against sdpa: largest difference {float(difference):.2e}", flush=True)
    variants = {"sdpa, default order": lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask),
                "flex, the blocks each row has written": lambda: flex(heads, key, value, block_mask=block_mask,
                                                                      enable_gqa=True),
                "sdpa, cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION),
                "sdpa, memory-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
                "sdpa, math": sdpa(SDPBackend.MATH),
                "two matrix products": products,
                "two matrix products, compiled": torch.compile(products)}
    return variants


def draw_variants(rows: int, vocab: int, device, dtype) -> dict:
    """The draw from (n, V) logits: as the engine ran it before (a transposed product's view), from contiguous
    logits, and through torch.compile."""
    hidden = torch.randn(rows, 896, device=device, dtype=dtype)
    head = torch.randn(vocab, 896, device=device, dtype=dtype) * 0.05
    u = torch.rand(rows, device=device, dtype=torch.float64)
    transposed = torch.mm(head, hidden.t()).t()  # (n, V) a view with strides (1, n)
    rows_first = torch.mm(hidden, head.t())      # (n, V) contiguous

    def old(logits):  # before: .float() then softmax, isfinite over all logits
        finite = torch.isfinite(logits).all()
        return engine.inverse_cdf(torch.softmax(logits.float(), dim=-1), u), finite

    def new(logits):
        low, high = torch.aminmax(logits)
        return engine.draw_tokens(logits, u, 1.0), torch.isfinite(low) & torch.isfinite(high)
    compiled = torch.compile(new)
    return {"head W·hᵀ (transposed)": lambda: torch.mm(head, hidden.t()).t(),
            "head h·Wᵀ (rows first)": lambda: torch.mm(hidden, head.t()),
            "draw before, transposed logits": lambda: old(transposed),
            "draw before, contiguous logits": lambda: old(rows_first),
            "draw now, contiguous logits": lambda: new(rows_first),
            "draw now, compiled": lambda: compiled(rows_first)}


def draw_agrees(rows: int, vocab: int, device, dtype) -> str:
    """Whether the compiled draw (compiled_step.compiled(engine.checked_draw)) picks the eager draw's tokens on this device, for the
    plain draw and a truncated one: the uniforms are integer arithmetic (exact), the rest may round differently."""
    logits = torch.randn(rows, vocab, device=device).mul_(3).to(dtype)
    seeds = torch.randint(-2**62, 2**62, (rows,), device=device)
    lengths = torch.randint(0, 128, (rows,), device=device)
    same = []
    for settings in [(False, 1.0, 1.0, 0, None), (False, 0.7, 0.9, 0, None), (True, 1.0, 1.0, 0, None)]:
        eager = engine.checked_draw(logits, seeds, lengths, *settings)[0]
        same.append(int((compiled_step.compiled(engine.checked_draw)(logits, seeds, lengths, *settings)[0] == eager).sum()))
    return f"compiled draw = eager draw: {same} of {rows} tokens (plain, T 0.7 top-p 0.9, greedy)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--length", type=int, default=640,
                        help="cache slots (the longest prompt, 445, + 128 new tokens, padded to 128)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeat", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--replays", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.no_grad():
        for title, variants in [("attention, one layer", attention_variants(args.rows, args.length, device, dtype)),
                                ("head and draw", draw_variants(args.rows, args.vocab, device, dtype))]:
            print(f"{title} ({args.rows} rows, {device}, {dtype}):", flush=True)
            for name, fn in variants.items():
                try:
                    rounds = timed(fn, device, args.repeat, args.replays)
                    print(f"    {name:48s} {statistics.median(rounds):9.1f} us  (each round: "
                          f"{', '.join(f'{us:.1f}' for us in rounds)})", flush=True)
                except Exception as error:  # a kernel not eligible here (a backend that refuses the mask)
                    print(f"    {name:48s} failed: {str(error).splitlines()[0][:120]}", flush=True)
        print(draw_agrees(args.rows, args.vocab, device, dtype), flush=True)


if __name__ == "__main__":
    main()
