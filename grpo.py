"""GRPO math: group-relative advantages and the clipped, KL-regularised policy loss.

Pure functions of tensors; imports only torch, so this file can be copied alone.

Advantages (DeepSeekMath, eq. 3; TRL `GRPOTrainer._generate_and_score_completions`). For the G
responses o_1..o_G to one prompt with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + eps)        every token of o_i gets A_i

std is the *sample* std (Bessel-corrected, torch's default) over the group, exactly as TRL, so the
numbers compare line by line; eps = 1e-4 keeps an all-equal group (std 0) at A = 0 instead of NaN.
TRL's other `scale_rewards` ("none", "batch") and unscored rewards: `group_advantages`.

Per-token loss (TRL 1.16 `GRPOTrainer._compute_loss`, its defaults), with the ratio against the old
policy θ_k (which sampled the tokens):

    ρ_t    = exp(logp_t - old_logp_t)                             (differentiable in logp)
    l_t    = -min(ρ_t A, clip(ρ_t, 1 - ε_low, 1 + ε_high) A) + β ρ_t k3_t
    k3_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1           (k3 estimator of KL, ≥ 0)

ρ_t multiplies k3 (TRL's `use_bias_correction_kl=True`, its default; DeepSeek-V3.2) so that the term's gradient is
that of KL(π_θ‖π_ref), the KL it reports; the plain k3 term (`kl_bias_correction=False`) pulls toward the reverse
KL (derived in docs/design.md, "GRPO as implemented").

Aggregation over a batch of N responses with m_{i,t} ∈ {0, 1} marking real response tokens:

    dapo     L = Σ_i Σ_t m l / Σ_i Σ_t m             token mean over the whole batch (default, TRL's too)
    grpo     L = (1/N) Σ_i (Σ_t m l / Σ_t m)          per-sequence mean, then mean (the paper's eq.)
    dr_grpo  L = Σ_i Σ_t m l / (N · max_new_tokens)   constant denominator (Dr. GRPO)
    bnpo     L = (1/M) Σ_b (Σ_{i∈b} Σ_t m l / Σ_{i∈b} Σ_t m)   token mean per micro-batch b, mean over the M

dapo, grpo and dr_grpo are a weighted *sum* over tokens divided by one batch-level normaliser D. That
is what makes the update independent of how the batch is cut into micro-batches and of the order
they arrive in, which the asynchronous pipeline relies on: each micro-batch backpropagates its partial
sum (`normalizer=1`), and the accumulated gradient is divided by D (`loss_normalizer`) once, at the
optimizer step, when D is known. D over several optimizer steps per batch: `loss_normalizer`; bnpo's
micro-batches: `micro_batch_normalizer`; truncated responses: `grpo_loss`.

Departures from TRL, on purpose:
1. bnpo's local batch is the micro-batch (sized by tokens), not a fixed number of sequences.
2. The normaliser is passed in rather than taken from the batch, so a caller can stream.
"""
from __future__ import annotations

import torch

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGE_EPS = 1e-4  # A = (r - mean) / (std + eps): an all-equal group gets 0, not NaN


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str | bool = "group",
                     eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """Group-relative advantages for rewards laid out group after group.

    `scale` is TRL's `scale_rewards`: "group" (True) divides by each group's std (the module docstring); "none"
    (False) returns the centred rewards (Dr. GRPO, arXiv 2503.20783: the std favours easy and hard prompts);
    "batch" (PPO Lite, arXiv 2508.08221) is A_i = (r_i - mean(r_group)) / (std(r_batch) + eps), known only once
    the last group is in, so this returns the centred rewards and `batch_std` gives the divisor. While streaming:
    the policy term is positively homogeneous in A, so with β = 0 a learner trains on the centred advantages and
    divides the accumulated gradient by std(r_batch) + eps at the step; with β > 0 the passes wait for it
    (docs/design.md). A reward of NaN marks a response no reward function scored (TRL's None,
    infra/scoring.py): it is left out of its group's mean and std, and its advantage is 0, as in TRL.

    >>> group_advantages(torch.tensor([1., 0., 0., 0.]), group_size=2)
    tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
    """
    by_group = scale in ("group", True)
    grouped = rewards.view(-1, group_size)  # (num_prompts, G)
    if grouped.isnan().any():
        return _advantages_of_scored(grouped, by_group, eps)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # (num_prompts, G)
    if by_group:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1)  # (num_prompts * G,)


def _advantages_of_scored(grouped: torch.Tensor, scale: bool, eps: float) -> torch.Tensor:
    """`group_advantages` over the scored (non-NaN) rewards of each group; 0 for the others.

    >>> _advantages_of_scored(torch.tensor([[1., 0., float("nan")]]), scale=True, eps=1e-4)
    tensor([ 0.7070, -0.7070,  0.0000])
    """
    scored = (~grouped.isnan()).sum(dim=1, keepdim=True)  # (num_prompts, 1)
    advantages = grouped - grouped.nanmean(dim=1, keepdim=True)  # (num_prompts, G), NaN where not scored
    if scale:  # sample std over the scored ones, as `std` (NaN with fewer than two: then A = 0 below)
        std = (advantages.nan_to_num(0.0).square().sum(dim=1, keepdim=True) / (scored - 1)).sqrt()
        advantages = advantages / (std + eps)
    return advantages.nan_to_num(0.0).reshape(-1)  # (num_prompts * G,)


def batch_std(rewards: torch.Tensor) -> torch.Tensor:
    """Sample std over every scored (non-NaN) reward of the batch, 0-d; NaN with fewer than two (TRL's `nanstd`).
    scale_rewards="batch" divides the centred rewards by it + eps.

    >>> batch_std(torch.tensor([1., 0., float("nan"), 1.]))
    tensor(0.5774)
    """
    scored = rewards[~rewards.isnan()]  # (n,)
    return scored.std() if len(scored) > 1 else torch.tensor(float("nan"))


def sequence_weights(mask: torch.Tensor, loss_type: str, max_new_tokens: int | None = None) -> torch.Tensor:
    """Per-token weights w with L = Σ w·l / D: 1 (dapo, bnpo), 1/|o_i| (grpo), 1/max_new_tokens (dr_grpo)."""
    mask = mask if mask.is_floating_point() else mask.float()  # (N, T)
    if loss_type in ("dapo", "bnpo"):
        return mask
    if loss_type == "grpo":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (N, T)
    if loss_type == "dr_grpo":
        if not max_new_tokens:
            raise ValueError("loss_type='dr_grpo' needs max_new_tokens")
        return mask / max_new_tokens
    raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")


def micro_batch_normalizer(loss_type: str, num_tokens: int) -> float:
    """What one micro-batch's weighted sum is divided by before its backward: its own tokens for bnpo, else 1.

    bnpo is TRL's per-device token mean under gradient accumulation (`(per_token_loss * mask).sum() /
    mask.sum()`, then / accumulation steps), with the micro-batch in the role of TRL's local batch: each
    micro-batch divides by its own tokens, the step by M. It weights tokens by the size of the micro-batch they
    happened to land in, so it depends on --micro-batch-tokens (TRL's: on per_device_train_batch_size); still a
    function of the sampled tokens alone, since micro-batches are cut by completion order (learner.py).
    """
    return float(max(num_tokens, 1)) if loss_type == "bnpo" else 1.0


def loss_normalizer(loss_type: str, num_sequences: int, num_tokens: float, num_micro_batches: int = 1) -> float:
    """The step's denominator D: tokens for dapo (with S steps per batch: the batch's tokens / S), the mini-batch's
    sequences for grpo and dr_grpo, its micro-batches for bnpo.

    When an iteration's batch is split into S optimizer steps (mini-batches), grpo and dr_grpo take N as the
    mini-batch's sequences, and dapo divides each step's sum by the *batch's* tokens / S, as TRL 1.16 does
    (`num_items_in_batch`, the generation batch's tokens, x accumulation steps / steps_per_generation): every
    token weighs the same whichever step it lands in, but the first step needs the last group's length.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    count = {"dapo": num_tokens, "bnpo": num_micro_batches}.get(loss_type, num_sequences)
    return float(max(count, 1))


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(π_θ || π_ref) per token (Schulman, 'Approximating KL divergence')."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.04,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: str = "dapo",
    max_new_tokens: int | None = None,
    normalizer: float | None = None,
    kl_bias_correction: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective of one batch of responses; returns (loss, sums for logging).

    logp, old_logp, ref_logp, mask: (N, T) per response token; advantages: (N,).
    normalizer: what L = Σ w·l is divided by; None = this batch alone (`micro_batch_normalizer` x
    `loss_normalizer`). Pass 1.0 (bnpo: `micro_batch_normalizer`) to get the partial sum of one
    micro-batch when accumulating, and divide the gradient by D later.
    kl_bias_correction: multiply k3 by ρ (the module docstring says why); False = the plain k3 term.
    The returned stats are sums over the masked tokens, so they add up across micro-batches, as 0-d tensors (no
    host synchronisation): tokens, clipped tokens (low: ρ < 1 - ε_low with A < 0, high: ρ > 1 + ε_high with
    A > 0, as TRL counts them) and the KL term as TRL logs it (ρ·k3 with the correction, else k3); and two
    extremes, which combine across micro-batches by min and max: the least low-clipped fraction of a response's
    tokens and the most high-clipped one.
    A truncated response (no EOS within max_new_tokens) left out of the loss, as TRL's
    `mask_truncated_completions` asks, has a mask row of 0: it adds no token to any sum or to dapo's and bnpo's
    D; grpo and dr_grpo still count it in N, as TRL does (its row's mean is 0, not dropped).
    """
    mask = mask.to(logp.dtype)  # (N, T)
    ratio = torch.exp(logp - old_logp)  # (N, T)
    adv = advantages.unsqueeze(1)  # (N, 1)
    unclipped = ratio * adv  # (N, T)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv  # (N, T)
    per_token = -torch.min(unclipped, clipped)  # (N, T)
    kl = kl_k3(logp, ref_logp) if ref_logp is not None else None  # (N, T)
    if kl is not None and kl_bias_correction:
        kl = kl * ratio  # (N, T)
    if beta != 0.0:
        if kl is None:
            raise ValueError("beta > 0 needs ref_logp")
        per_token = per_token + beta * kl

    weights = sequence_weights(mask, loss_type, max_new_tokens)  # (N, T)
    if normalizer is None:
        tokens = int(mask.sum().item())
        normalizer = micro_batch_normalizer(loss_type, tokens) * loss_normalizer(loss_type, mask.shape[0], tokens)
    loss = (per_token * weights).sum() / normalizer

    with torch.no_grad():
        # A token is "clipped" when the clip is the active branch of the min (as TRL counts it).
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype) * mask  # (N, T)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype) * mask  # (N, T)
        lengths = mask.sum(1)  # (N,)
        per_response = lengths.clamp(min=1)  # (N,)
        stats = {  # 0-d tensors on logp's device: reading them would make the host wait for the device
            "tokens": mask.sum(),
            "clipped_tokens": (low + high).sum(),  # TRL's region: the two are disjoint (A < 0, A > 0)
            "clipped_low": low.sum(),
            "clipped_high": high.sum(),
            # the extremes over responses of their clipped fraction (TRL's clip_ratio/low_min and high_max); a
            # response without loss tokens counts for neither (inf, -inf where there is none)
            "clipped_low_min": torch.where(lengths > 0, low.sum(1) / per_response, torch.inf).min(),
            "clipped_high_max": torch.where(lengths > 0, high.sum(1) / per_response, -torch.inf).max(),
            "kl_sum": (kl * mask).sum() if kl is not None else torch.full((), float("nan"), device=logp.device),
        }
    return loss, stats
