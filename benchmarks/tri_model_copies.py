"""`python bench.py tri-model`: memory and step time with and without the reference and old-policy copies.

One GRPO training step on one group (P=64, R=32, G=8) through `TriModel`, with the reference off
(beta = 0) or on, and one or four updates per iteration (the old-policy copy exists only with more
than one): parameter bytes of each copy, AdamW state bytes, bytes saved for backward, and step time.
"""
from __future__ import annotations

import argparse
import copy

import torch

from benchmarks.common import count, median_seconds, saved_for_backward_bytes, write_json


def tri_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", dest="tri_model", default="tiny", help="model name or path (models.load_model)")
    parser.add_argument("--repeats", type=count(), default=5, help="timed steps; the median is reported")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")


def tri_model(args: argparse.Namespace) -> bool:
    """Memory and step time of the tri-model with the reference on/off and 1 or 4 updates per iteration."""
    from grpo import grpo_loss
    from infra.models import load_model
    from packing import logprobs_fn
    from tri_model import TriModel
    results = {}
    policy_template, tokenizer = load_model(args.tri_model)
    torch.manual_seed(0)
    prompt = torch.randint(3, len(tokenizer), (64,))  # (P,)
    responses = [torch.randint(3, len(tokenizer), (32,)) for _ in range(8)]  # G x (R,)
    advantages = torch.randn(8)
    print(f"{'reference':>9s} {'N':>3s} {'params MB (policy/old/ref)':>28s} {'optimizer MB':>12s} "
          f"{'saved activations MB':>20s} {'step ms':>8s}")
    for beta, updates in ((0.0, 1), (0.04, 1), (0.0, 4), (0.04, 4)):
        policy = copy.deepcopy(policy_template)
        tri = TriModel(policy, logprobs_fn(policy), use_reference=beta > 0, use_old=updates > 1)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)

        def step():
            logp, old, ref, mask = tri([(prompt, responses)])
            loss, _ = grpo_loss(logp, old, ref, advantages, mask, beta=beta)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        activation = saved_for_backward_bytes(policy, step)  # also the warm-up step
        step_s = median_seconds(step, args.repeats)
        memory = tri.memory_report()
        optim = sum(s.numel() * s.element_size() for state in optimizer.state.values() for s in state.values()
                    if torch.is_tensor(s))
        row = {**memory, "optimizer_bytes": optim, "activation_bytes": activation,
               "step_s": step_s, "beta": beta, "updates_per_iteration": updates}
        results[f"beta={beta},N={updates}"] = row
        mb = 2 ** 20
        print(f"{'on' if beta > 0 else 'off':>9s} {updates:3d} "
              f"{memory['policy_bytes'] / mb:9.1f} /{memory['old_bytes'] / mb:7.1f} "
              f"/{memory['reference_bytes'] / mb:7.1f} "
              f"{optim / mb:12.1f} {activation / mb:20.1f} {row['step_s'] * 1e3:8.1f}", flush=True)
    write_json(args.json, results)
    return True
