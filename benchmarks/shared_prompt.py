"""`python bench.py shared-prompt`: training-step time and memory, packed vs unpacked vs auto, over a (P, R) grid.

One GRPO training step (forward + backward of -(A · logp · mask).sum() / mask.sum()) on a
random-weight 6-layer Qwen2-shaped model, over a grid of prompt length P and response length R
with G = 8 responses per prompt, in three modes of `packing.batch_logprobs`:
  packed    one row [p | r_1 | ... | r_G]: under sdpa on CPU the structured kernel
            `packing.shared_prompt_attention` (causal prompt, each response against the
            prompt and itself), under eager the dense shared-prompt mask
  unpacked  G rows [p | r_i] with an ordinary causal mask (the baseline)
  auto      per group, `packing.packing_pays` picks one of the two
How to read a row: `tokens x` = G(P+R) / (P+GR) is the ideal speedup if only token count
mattered; `MAC ceil` (`mac_ceiling`) is the most packing can give once the work that does not
shrink with the tokens is counted: the causal prompt and every response against the whole
prompt (attention shrinks less than the tokens) and the lm head, applied to the same G·R
response positions in either layout; `unp/pk` is the measured speedup, to be read against
`MAC ceil`. Where responses are long and prompts short it drops to about 1 or below; `unp/auto`
should then stay at about 1: auto falls back to plain rows. `--mask dense` sends packed rows
through the dense mask instead of the structured kernel: what making the mask cheap is worth.
`pred pk/unp` is `packing.packing_cost_ratio`, the cost model auto decides by (< 1 packs); the
bench also prints the break-even length its own timings fit, to re-tune
`packing.ATTENTION_BREAK_EVEN_LEN` for other hardware.

Memory: on CPU, the bytes of distinct non-parameter tensors autograd saved for backward (a
deterministic stand-in for peak activation memory); on CUDA, peak allocated bytes during the
step. `mask MB` is the dense (B, 1, L, L) mask handed to the model: 0 where the structured kernel
runs (it takes the layout as a few index tensors instead), L^2 bytes or more otherwise. On CUDA packed
rows always take the dense mask (packing.py departure 5): `--mask` changes nothing there.

Timings on a shared machine drift: modes are interleaved within each repeat so drift hits them
alike, and each mode reports its fastest repeat (the work is deterministic, so noise from other
jobs only ever adds time; `timeit` takes the minimum for the same reason).

Targets, checked at the end: packed >= 5x unpacked at P=512, R=32, and auto never more than 5%
slower than unpacked anywhere on the grid.
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Callable

import torch

import packing
from benchmarks.common import count, saved_for_backward_bytes, write_json

SHARED_PROMPT_GRID = [(P, R) for P in (32, 128, 512, 1024) for R in (16, 64, 256)] + [(512, 32)]
SHARED_PROMPT_QUICK = [(512, 32), (32, 256)]
TARGET_CELL = (512, 32)
MODES = ("packed", "unpacked", "auto")


def shared_prompt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two cells only (smoke test)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE")
    parser.add_argument("--group-size", type=count(), default=8, help="responses per prompt (G)")
    parser.add_argument("--repeats", type=count(), default=5,
                        help="timed steps per mode and cell, after one warm-up; the fastest is reported")
    parser.add_argument("--threads", type=count(), default=1,
                        help="torch CPU threads; 1 by default because on a shared 2-core machine a second "
                             "thread waiting on a busy core made every op ~10x slower, swamping the comparison")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention implementation")
    parser.add_argument("--mask", default="structured", choices=("structured", "dense"),
                        help="packed rows under sdpa on CPU: the structured kernel, or the dense (1, 1, L, L) "
                             "mask (what the structured kernel saves; eager models and CUDA always take the dense "
                             "mask)")


def bench_model(attn_implementation: str, device: str) -> torch.nn.Module:
    """Random-weight Qwen2-shaped model: 6 layers, hidden 256, 4 query / 2 KV heads, vocab 4096."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=704, vocab_size=4096, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(config, attn_implementation=attn_implementation).to(device).train()


def grpo_like_step(model: torch.nn.Module, groups: list, advantages: torch.Tensor, mode: str,
                   dense_mask: bool = False) -> None:
    """Forward + backward of the token-mean policy-gradient loss; gradients are cleared first."""
    model.zero_grad(set_to_none=True)
    logp, mask = packing.batch_logprobs(model, groups, mode=mode, dense_mask=dense_mask)  # (N, T)
    loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
    loss.backward()


def peak_bytes(model: torch.nn.Module, step: Callable[[], None], device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    return saved_for_backward_bytes(model, step)


def clock(device: str, threads: int) -> Callable[[], float]:
    """Wall clock; single-threaded on CPU, this process's CPU time, so time other jobs hold the core is not counted."""
    return time.process_time if device == "cpu" and threads == 1 else time.perf_counter


def timed(step: Callable[[], None], device: str, now: Callable[[], float]) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = now()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return now() - start


def forward_macs(config, P: int, R: int, G: int, packed: bool) -> float:
    """Multiply-accumulates of one forward over G responses of length R to one P-token prompt.

    h hidden, H / H_kv query / key-value heads of width D, I MLP width, V vocabulary, n layers:
        per token and layer       h·H·D (q) + 2·h·H_kv·D (k, v) + H·D·h (o) + 3·h·I (MLP)
        per score pair and layer  2·H·D (q·k, then weights·v)
        per response token        h·V (lm head; the same G·R positions in either layout)
    Tokens: G(P+R) unpacked, P+GR packed. Pairs, what the mask allows: G(P+R)(P+R+1)/2 unpacked,
    P(P+1)/2 + G·R·(P + (R+1)/2) packed. Backward costs about twice every term, so
    forward_macs(unpacked) / forward_macs(packed) is the most packing can speed up a whole step when
    every kernel runs at one speed: the ceiling a measured unp/pk is read against.
    """
    h, n, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or h // H
    per_token = h * H * D + 2 * h * H_kv * D + H * D * h + 3 * h * config.intermediate_size
    per_pair = 2 * H * D
    if packed:
        tokens, pairs = P + G * R, P * (P + 1) / 2 + G * R * (P + (R + 1) / 2)
    else:
        tokens, pairs = G * (P + R), G * (P + R) * (P + R + 1) / 2
    return n * (tokens * per_token + pairs * per_pair) + G * R * h * V


def mac_ceiling(config, P: int, R: int, G: int) -> float:
    """forward_macs unpacked / packed: the speedup packing would give if time were proportional to work."""
    return forward_macs(config, P, R, G, packed=False) / forward_macs(config, P, R, G, packed=True)


QWEN25_SHAPES = {  # published configs (config.json on the Hub), for the ceiling at the target cell
    "Qwen2.5-0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "Qwen2.5-7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
}


def shared_prompt_cell(model: torch.nn.Module, P: int, R: int, G: int, repeats: int, device: str,
                       now: Callable[[], float], dense_mask: bool = False) -> dict:
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (P,), device=device)
    responses = [torch.randint(1, vocab, (R,), device=device) for _ in range(G)]
    groups = [(prompt, responses)]
    advantages = torch.randn(G, device=device)
    steps = {mode: (lambda mode=mode: grpo_like_step(model, groups, advantages, mode, dense_mask)) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(repeats + 1):  # modes interleaved, order rotated, so drifting load hits all alike
        for mode in MODES[repeat % 3:] + MODES[:repeat % 3]:
            seconds = timed(steps[mode], device, now)
            if repeat > 0:  # the first round is warm-up
                times[mode].append(seconds)
    best = {mode: min(times[mode]) for mode in MODES}  # noise only ever adds time: the minimum is the cost
    L = P + G * R
    dense = not packing.structured_kernel(model, dense_mask)  # packed rows under the dense mask (departures 1, 5)
    # the structured kernel takes no mask; else a dense (1, 1, L, L) mask: additive floats (eager), bool (sdpa)
    if model.config._attn_implementation == "sdpa":
        dense_mask_bytes = L * L if dense else 0
    else:
        dense_mask_bytes = L * L * model.dtype.itemsize
    return {
        "P": P, "R": R, "G": G, "dense": dense, "packed_len": L, "token_ratio": G * (P + R) / L,
        "mac_ceiling": mac_ceiling(model.config, P, R, G),
        "packed_s": best["packed"], "unpacked_s": best["unpacked"], "auto_s": best["auto"],
        "auto_choice": "packed" if packing.packing_pays(P, [R] * G, dense=dense) else "unpacked",
        "predicted_packed_over_unpacked": packing.packing_cost_ratio(P, [R] * G, dense=dense),
        "speedup_packed": best["unpacked"] / best["packed"], "speedup_auto": best["unpacked"] / best["auto"],
        "memory_packed_bytes": peak_bytes(model, steps["packed"], device),
        "memory_unpacked_bytes": peak_bytes(model, steps["unpacked"], device),
        "mask_bytes": dense_mask_bytes,
    }


def fit_break_even_len(rows: list[dict]) -> int:
    """The `break_even_len` whose `packing_cost_ratio` best matches the measured packed/unpacked (log least squares)."""
    def error(length: float) -> float:
        return sum((math.log(packing.packing_cost_ratio(row["P"], [row["R"]] * row["G"], length, row["dense"]))
                    - math.log(row["packed_s"] / row["unpacked_s"])) ** 2 for row in rows)
    candidates = [round(100 * 1.05 ** i) for i in range(100)]  # 100 .. ~12000
    return min(candidates, key=error)


def shared_prompt(args: argparse.Namespace) -> bool:
    """Training-step time and memory, packed vs unpacked vs auto, over a (P, R) grid."""
    from transformers import Qwen2Config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    model = bench_model(args.attn, device)
    dense_mask = args.mask == "dense"
    cells = SHARED_PROMPT_QUICK if args.quick else SHARED_PROMPT_GRID
    memory_measure = ("peak CUDA bytes allocated during the step" if device == "cuda" else
                      "bytes of distinct non-parameter tensors saved for backward")
    packed_path = "structured kernel" if packing.structured_kernel(model, dense_mask) else "dense mask"
    c = model.config
    print(f"shared-prompt: Qwen2-shaped, {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads "
          f"{c.num_attention_heads}/{c.num_key_value_heads}, vocab {c.vocab_size}, {model.dtype}, {args.attn}, "
          f"packed rows through the {packed_path}, {device}, {args.threads} thread(s), G={args.group_size}; "
          f"one step = forward + backward; fastest of {args.repeats} after 1 warm-up")
    time_measure = "process CPU seconds" if clock(device, args.threads) is time.process_time else "wall-clock seconds"
    print(f"time: {time_measure}; memory: {memory_measure}; mask = dense (B,1,L,L) mask passed to the model; "
          f"MAC ceil = forward_macs unpacked / packed, the most packing can give")
    header = (f"{'P':>5} {'R':>4} {'L':>5} {'tokens x':>8} {'MAC ceil':>8} {'packed s':>9} {'unpack s':>9} "
              f"{'auto s':>8} {'auto':>8} {'pred pk/unp':>11} {'unp/pk':>7} {'unp/auto':>8} {'mem pk MB':>9} "
              f"{'mem unp MB':>10} {'mask MB':>7}")
    print(header)
    rows = []
    for P, R in cells:
        row = shared_prompt_cell(model, P, R, args.group_size, args.repeats, device, clock(device, args.threads),
                                 dense_mask)
        rows.append(row)
        print(f"{P:>5} {R:>4} {row['packed_len']:>5} {row['token_ratio']:>8.2f} {row['mac_ceiling']:>8.2f} "
              f"{row['packed_s']:>9.3f} {row['unpacked_s']:>9.3f} {row['auto_s']:>8.3f} {row['auto_choice']:>8} "
              f"{row['predicted_packed_over_unpacked']:>11.2f} {row['speedup_packed']:>7.2f} "
              f"{row['speedup_auto']:>8.2f} {row['memory_packed_bytes'] / 2**20:>9.1f} "
              f"{row['memory_unpacked_bytes'] / 2**20:>10.1f} {row['mask_bytes'] / 2**20:>7.2f}", flush=True)
    write_json(args.json, {"benchmark": "shared-prompt", "device": device, "threads": args.threads,
                           "time": time_measure, "memory_measure": memory_measure, "packed_path": packed_path,
                           "rows": rows}, indent=2)

    print(f"packing_pays: ATTENTION_BREAK_EVEN_LEN={packing.ATTENTION_BREAK_EVEN_LEN} in use; "
          f"this run's timings fit {fit_break_even_len(rows)}")
    P, R = TARGET_CELL
    G = args.group_size
    target = next(row for row in rows if (row["P"], row["R"]) == TARGET_CELL)
    shapes = ", ".join(f"{name} {mac_ceiling(Qwen2Config(**shape), P, R, G):.2f}x"
                       for name, shape in QWEN25_SHAPES.items())
    print(f"MAC ceiling at P={P}, R={R}, G={G}: this model {target['mac_ceiling']:.2f}x (measured "
          f"{target['speedup_packed']:.2f}x = {target['speedup_packed'] / target['mac_ceiling']:.0%} of it); {shapes}")
    slowest_auto = min(rows, key=lambda row: row["speedup_auto"])
    checks = [
        (target["speedup_packed"] >= 5.0,
         f"packed >= 5x faster than unpacked at P={P}, R={R}, G={G}: {target['speedup_packed']:.2f}x"),
        (slowest_auto["speedup_auto"] >= 1 / 1.05,
         f"auto never > 5% slower than unpacked: worst unpacked/auto = {slowest_auto['speedup_auto']:.3f} "
         f"at P={slowest_auto['P']}, R={slowest_auto['R']}"),
    ]
    for ok, line in checks:
        print(("PASS " if ok else "FAIL ") + line)
    return all(ok for ok, _ in checks)
