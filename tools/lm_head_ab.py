"""One training micro-batch with attention.token_logprobs as it is and as it was at another commit, interleaved.

    python tools/lm_head_ab.py [--before 7fb1e7f] [--layers 1] [--vocab 151936] [--prompt 64] [--group-size 4]
                               [--response 32] [--rounds 6]

The micro-batch is the trainer's on CPU in float32: the reference's and the policy's log-probs (with the entropy)
of one group on a Qwen2.5-0.5B-wide model (random weights, tied embeddings), the GRPO loss, its backward. Only the
LM head's log-prob function differs between the sides (the other one is loaded from `git show REV:attention.py`
and put in attention's place); the order alternates each round after one warm-up each. Prints every round.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import attention  # noqa: E402
import packing  # noqa: E402
from benchmarks.engine_cpu import qwen_wide_model  # noqa: E402
from grpo import grpo_loss  # noqa: E402
from tri_model import TriModel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="7fb1e7f", help="the commit whose attention.token_logprobs is 'before'")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    source = subprocess.run(["git", "show", f"{args.before}:attention.py"], cwd=ROOT, capture_output=True, text=True)
    if source.returncode != 0:
        raise SystemExit(f"error: --before {args.before}: {source.stderr.strip()}")
    old = types.ModuleType("attention_before")
    exec(compile(source.stdout, f"{args.before}:attention.py", "exec"), old.__dict__)
    sides = {"before": old.token_logprobs, "after": attention.token_logprobs}

    model = qwen_wide_model(args.layers, args.vocab).train()
    tri = TriModel(model, packing.logprobs_fn(model), use_reference=True, use_old=False)
    draw = torch.Generator().manual_seed(0)
    groups = [(torch.randint(3, args.vocab, (args.prompt,), generator=draw),
               [torch.randint(3, args.vocab, (args.response,), generator=draw) for _ in range(args.group_size)])]

    def step(side: str) -> float:
        attention.token_logprobs = sides[side]
        start = time.perf_counter()
        logp, old_logp, ref_logp, mask, _ = tri(groups, entropy=True)  # (G, R) each
        loss, _ = grpo_loss(logp, old_logp, ref_logp, torch.linspace(-1, 1, len(logp)), mask)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start
    for side in sides:
        step(side)  # warm-up
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
            seconds[side].append(step(side))
        print(f"round {round_}: before {seconds['before'][-1]:.3f} s, after {seconds['after'][-1]:.3f} s", flush=True)
    ratios = [b / a for b, a in zip(seconds["before"], seconds["after"])]
    print(f"medians: before {statistics.median(seconds['before']):.3f} s, after {statistics.median(seconds['after']):.3f}"
          f" s; before/after per round {min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
