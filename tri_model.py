"""The unified tri-model: policy, old policy and reference in one module, one call.

The paper keeps the three models GRPO needs in the training process, behind one forward:

    policy     π_θ      trainable; the only one with gradients and in the optimizer
    old        π_θk     frozen copy of θ_k, taken at the start of iteration k (the weights that were
                        published to the inference process and sampled this iteration's rollouts)
    reference  π_ref    frozen copy of the initial weights θ_0, for the KL penalty

    logp, old_logp, ref_logp, mask = tri_model(groups)          each (N, T)
    logp, old_logp, ref_logp, mask, entropy = tri_model(groups, entropy=True)   + the policy's H per token

How a model scores the groups is passed in (`logprobs_fn(model, groups) -> (logp, mask)`; with entropy=True
`-> (logp, mask, entropy)`, the per-token entropy TRL logs, measured from the policy's own logits), and the
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
3. No model copy at all with an adapter (LoRA: θ = (W_0, A, B), only A and B trainable, a layer computes
   W_0 x + (α/r)·B A x with B = 0 at the start): π_ref is the base W_0 alone, i.e. the policy itself
   with the adapter switched off (`adapter_off`, peft's `disable_adapter`), and the old policy is a
   copy of the adapter alone, swapped in for its forward. Those two forwards run before the policy's
   (whose graph must find its parameters unchanged), on the policy's kernels, with its dropout modules
   off as a frozen copy's are (LoRA dropout). At θ_0 the adapter adds exact zeros: KL = 0 still.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, ContextManager, Iterator

import torch
from torch import Tensor, nn

Groups = list[tuple[Tensor, list[Tensor]]]  # [(prompt_ids (P,), [response_ids (R_i,), ...]), ...]
LogprobsFn = Callable[..., tuple[Tensor, ...]]  # (model, groups[, entropy=True]) -> logp (N, T), mask (N, T)[, entropy]
AdapterOff = Callable[[], ContextManager]  # () -> a context inside which the policy computes as its base model


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy without autograd: parameters with requires_grad=False, eval mode."""
    clone = copy.deepcopy(model)
    clone.requires_grad_(False)
    return clone.eval()


def parameter_bytes(model: nn.Module | list[Tensor] | None) -> int:
    tensors = [] if model is None else model.parameters() if isinstance(model, nn.Module) else model
    return sum(p.numel() * p.element_size() for p in tensors)


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """The model's dropout modules in eval mode (the rest keeps its mode, so the same kernels run), then as before."""
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.training]
    for m in dropouts:
        m.eval()
    try:
        yield
    finally:
        for m in dropouts:
            m.train()


@contextlib.contextmanager
def swapped_in(parameters: list[Tensor], values: list[Tensor]) -> Iterator[None]:
    """`values` in place of `parameters` inside the block (the old adapter), the parameters' own bits after."""
    with torch.no_grad():
        saved = [p.detach().clone() for p in parameters]
        for p, v in zip(parameters, values, strict=True):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(parameters, saved):
                p.copy_(s)


class TriModel(nn.Module):
    """`adapter_off`: for a policy that is a frozen base plus a trainable adapter (LoRA), a factory of the context
    under which it computes as its base (peft: `policy.disable_adapter`): no copy is made (departure 3)."""

    def __init__(self, policy: nn.Module, logprobs_fn: LogprobsFn, use_reference: bool, use_old: bool,
                 compute_dtype: torch.dtype = torch.float32, adapter_off: AdapterOff | None = None):
        super().__init__()
        self.policy = policy
        self.logprobs_fn, self.compute_dtype = logprobs_fn, compute_dtype
        self.adapter_off, self.use_reference = adapter_off, use_reference
        self.reference = frozen_copy(policy) if use_reference and adapter_off is None else None
        self.old = frozen_copy(policy) if use_old and adapter_off is None else None
        self.adapter = [p for p in policy.parameters() if p.requires_grad] if adapter_off else []  # A, B (peft
        # freezes the base)
        self.old_adapter = [p.detach().clone() for p in self.adapter] if use_old and adapter_off else None

    @torch.no_grad()
    def start_iteration(self) -> None:
        """Snapshot θ_k into the old policy (called right when θ_k is published)."""
        if self.old is not None:
            for old, new in zip(self.old.parameters(), self.policy.parameters()):
                old.copy_(new)
        for old, new in zip(self.old_adapter or [], self.adapter):
            old.copy_(new)

    def logprobs(self, model: nn.Module, groups: Groups, **options) -> tuple[Tensor, ...]:
        """One model's log-probs, (N, T) each, under autocast when computing in bf16."""
        device_type = next(model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            return self.logprobs_fn(model, groups, **options)

    @torch.no_grad()
    def frozen_logprobs(self, groups: Groups) -> tuple[Tensor | None, Tensor | None]:
        """(old_logp, ref_logp), each (N, T), or None where the run needs none (old: when old_logp = logp)."""
        if self.adapter_off is None:
            old_logp = self.logprobs(self.old, groups)[0] if self.old is not None else None
            ref_logp = self.logprobs(self.reference, groups)[0] if self.reference is not None else None
            return old_logp, ref_logp
        old_logp = ref_logp = None
        with dropout_off(self.policy):
            if self.old_adapter is not None:
                with swapped_in(self.adapter, self.old_adapter):
                    old_logp = self.logprobs(self.policy, groups)[0]
            if self.use_reference:
                with self.adapter_off():
                    ref_logp = self.logprobs(self.policy, groups)[0]
        return old_logp, ref_logp

    def forward(self, groups: Groups, entropy: bool = False):
        """groups: [(prompt_ids (P,), [response_ids (R_i,), ...]), ...] -> logp, old_logp, ref_logp, mask
        (entropy=True: and the policy's entropy per token, (N, T), without gradient)."""
        old_logp, ref_logp = self.frozen_logprobs(groups)  # (N, T) each, or None; first: an adapter's are the policy's
        logp, mask, *measured = self.logprobs(self.policy, groups, **({"entropy": True} if entropy else {}))  # (N, T)
        return logp, logp.detach() if old_logp is None else old_logp, ref_logp, mask, *measured

    def memory_report(self) -> dict[str, int]:
        """Parameter bytes of each copy (0 for a copy that was skipped; an adapter's old copy is the adapter)."""
        return {"policy_bytes": parameter_bytes(self.policy),
                "old_bytes": parameter_bytes(self.old) + parameter_bytes(self.old_adapter),
                "reference_bytes": parameter_bytes(self.reference)}
