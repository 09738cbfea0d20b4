"""The unified tri-model: policy, old policy and reference in one module, one call.

The paper keeps the three models GRPO needs in the training process, behind one forward:

    policy     π_θ      trainable; the only one with gradients and in the optimizer
    old        π_θk     frozen copy of θ_k, taken at the start of iteration k (the weights that were
                        published to the inference process and sampled this iteration's rollouts)
    reference  π_ref    frozen copy of the initial weights θ_0, for the KL penalty

    logp, old_logp, ref_logp, mask = tri_model(groups)          each (N, T)

How a model scores the groups is passed in (`logprobs_fn(model, groups) -> (logp, mask)`), and the
three copies are scored by that same function: here `packing.logprobs_fn` (the shared-prompt rows
of attention.py); in another project, whatever computes per-token log-probs there. So this file
copies alone, with nothing but torch.

Mixed precision: with compute_dtype=bfloat16 the three forwards run under `torch.autocast` (matrix
products in bf16) while every parameter, the optimizer state and the gradients stay float32, so an
AdamW step of lr 1e-6 is applied, not rounded away (bf16 spacing near 0.02 is 1.2e-4). Log-softmax
is always taken in float32 (attention.py). The frozen copies are float32 too and run the same
kernels as the policy: at θ = θ_0 the policy and the reference forward are the same computation,
and KL = 0 exactly. (The inference side samples from bf16 weights, not from these float32 ones
under autocast: the two distributions differ by rounding, as between any inference engine and
trainer; with one update per iteration the ratio uses the trainer's own scores, old = logp.)

Copies exist only when they are needed:
1. No reference copy and no reference forward when beta == 0 (ref_logp is None).
2. No old copy when an iteration takes one optimizer step: every sample is then scored by θ_k
   itself, so old_logp = logp.detach() exactly and the PPO ratio is exactly 1 (its gradient is
   still the policy gradient: ∇ exp(logp - sg(logp)) = ∇ logp). With N > 1 steps per iteration the
   policy moves after the first step, the ratio departs from 1 and clipping becomes active.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn

Groups = list[tuple[Tensor, list[Tensor]]]  # [(prompt_ids (P,), [response_ids (R_i,), ...]), ...]
LogprobsFn = Callable[[nn.Module, Groups], tuple[Tensor, Tensor]]  # (model, groups) -> logp (N, T), mask (N, T)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy without autograd: parameters with requires_grad=False, eval mode."""
    clone = copy.deepcopy(model)
    clone.requires_grad_(False)
    return clone.eval()


def parameter_bytes(model: nn.Module | None) -> int:
    return 0 if model is None else sum(p.numel() * p.element_size() for p in model.parameters())


class TriModel(nn.Module):
    def __init__(self, policy: nn.Module, logprobs_fn: LogprobsFn, use_reference: bool, use_old: bool,
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.policy = policy
        self.reference = frozen_copy(policy) if use_reference else None
        self.old = frozen_copy(policy) if use_old else None
        self.logprobs_fn, self.compute_dtype = logprobs_fn, compute_dtype

    @torch.no_grad()
    def start_iteration(self) -> None:
        """Snapshot θ_k into the old policy (called right when θ_k is published)."""
        if self.old is not None:
            for old, new in zip(self.old.parameters(), self.policy.parameters()):
                old.copy_(new)

    def logprobs(self, model: nn.Module, groups: Groups) -> tuple[Tensor, Tensor]:
        """One model's log-probs, (N, T) each, under autocast when computing in bf16."""
        device_type = next(model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            return self.logprobs_fn(model, groups)

    def forward(self, groups: Groups):
        """groups: [(prompt_ids (P,), [response_ids (R_i,), ...]), ...] -> logp, old_logp, ref_logp, mask."""
        logp, mask = self.logprobs(self.policy, groups)  # (N, T), (N, T)
        with torch.no_grad():
            old_logp = self.logprobs(self.old, groups)[0] if self.old is not None else logp.detach()
            ref_logp = self.logprobs(self.reference, groups)[0] if self.reference is not None else None
        return logp, old_logp, ref_logp, mask

    def memory_report(self) -> dict[str, int]:
        """Parameter bytes of each copy (0 for a copy that was skipped)."""
        return {"policy_bytes": parameter_bytes(self.policy), "old_bytes": parameter_bytes(self.old),
                "reference_bytes": parameter_bytes(self.reference)}
