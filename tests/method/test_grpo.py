"""GRPO math (grpo.py) against hand-computed values, and the micro-batch invariance the pipeline needs."""
import math
import random

import pytest
import torch

from grpo import group_advantages, grpo_loss, kl_k3, loss_normalizer


def test_advantages_match_hand_computation():
    """A_i = (r_i - mean) / (sample std + 1e-4), per group; an all-equal group gets 0, not NaN."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, group_size=4)
    std = math.sqrt(((0.5 ** 2) * 4) / 3)  # rewards 1,0,0,1: mean .5, Bessel-corrected
    expected_first = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4)]
    assert adv[:4].tolist() == pytest.approx(expected_first, rel=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert group_advantages(rewards, 4, scale=False)[:4].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_kl_k3_hand_values():
    """k3 = exp(ref - logp) - (ref - logp) - 1: zero at equality, e - 2 when ref - logp = 1."""
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.0, math.e - 2])


def test_loss_hand_computed_with_clipping():
    """Two responses, hand-computed per-token terms, each loss type's normalisation."""
    logp = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    old = torch.tensor([[0.0, -0.5], [0.0, 0.0]])  # token (0,1) has ratio e^0.5 = 1.65 > 1.2
    ref = torch.tensor([[0.0, 0.0], [-1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    beta = 0.1
    # per token: -min(rho*A, clip(rho)*A) + beta*k3
    t00 = -1.0
    t01 = -min(math.exp(0.5) * 1.0, 1.2 * 1.0)  # clipped branch active
    t10 = 2.0 + beta * (math.exp(-1.0) + 1.0 - 1.0)
    kwargs = dict(beta=beta, epsilon_low=0.2, epsilon_high=0.2)
    dapo, stats = grpo_loss(logp, old, ref, adv, mask, loss_type="dapo", **kwargs)
    assert dapo.item() == pytest.approx((t00 + t01 + t10) / 3)
    assert stats["tokens"] == 3 and stats["clipped_tokens"] == 1
    grpo, _ = grpo_loss(logp, old, ref, adv, mask, loss_type="grpo", **kwargs)
    assert grpo.item() == pytest.approx(((t00 + t01) / 2 + t10) / 2)
    dr, _ = grpo_loss(logp, old, ref, adv, mask, loss_type="dr_grpo", max_new_tokens=4, **kwargs)
    assert dr.item() == pytest.approx((t00 + t01 + t10) / (2 * 4))


def test_clip_extremes_are_each_responses_clipped_fraction():
    """Claim: clipped_low_min and clipped_high_max are the least and the most clipped fraction of one response's
    loss tokens, low-clipped (ρ < 1 - ε, A < 0) and high-clipped (ρ > 1 + ε, A > 0): TRL's clip_ratio/low_min and
    high_max (its masked_seq_mean, then nanmin and nanmax); a response without loss tokens counts for neither.
    Exact: each fraction is k/n of small integers, computed the same way (one division)."""
    up, down = math.log(1.5), math.log(0.5)  # ρ = 1.5 (> 1.2), ρ = 0.5 (< 0.8)
    old = torch.zeros(4, 4)
    logp = torch.tensor([[up, up, 0.0, 0.0],        # A > 0: 2 of 4 tokens high-clipped
                         [up, 0.0, 0.0, 0.0],       # A > 0: 1 of 3 (the last token masked)
                         [down, down, down, 0.0],   # A < 0: 3 of 4 low-clipped
                         [down, down, down, down]])  # A < 0, no loss token: counts for neither
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    _, stats = grpo_loss(logp, old, None, torch.tensor([1.0, 1.0, -1.0, -1.0]), mask, beta=0.0)
    assert stats["clipped_high_max"].item() == 2 / 4
    assert stats["clipped_low_min"].item() == 0.0  # the responses with A > 0 have none, as in TRL
    _, stats = grpo_loss(logp[2:], old[2:], None, torch.tensor([-1.0, -1.0]), mask[2:], beta=0.0)
    assert stats["clipped_low_min"].item() == 3 / 4 and stats["clipped_high_max"].item() == 0.0
    _, stats = grpo_loss(logp[3:], old[3:], None, torch.tensor([-1.0]), mask[3:], beta=0.0)
    assert stats["clipped_low_min"].item() == math.inf and stats["clipped_high_max"].item() == -math.inf


def test_ratio_one_gives_policy_gradient():
    """With old_logp = logp.detach() the ratio is 1 and the gradient is -A * ∇logp / D."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = grpo_loss(logp, logp.detach(), None, torch.tensor([3.0]), torch.ones(1, 2), beta=0.0)
    loss.backward()
    assert logp.grad.tolist() == [[-1.5, -1.5]]


def test_beta_needs_reference():
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.zeros(1), torch.ones(1, 1), beta=0.1)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batch_and_order_invariance(loss_type):
    """Claim: summing per-micro-batch partial losses (normalizer=1) in any split and order, then dividing
    the gradient by the batch's D, equals the full-batch gradient. This is what lets the async trainer
    consume groups in completion order."""
    torch.manual_seed(0)
    n, t = 12, 7
    theta = torch.randn(n, t, requires_grad=True)  # stands in for the policy: logp = theta - 1
    old = (torch.randn(n, t) * 0.1 - 1).detach()
    ref = (torch.randn(n, t) * 0.1 - 1).detach()
    adv = torch.randn(n)
    lengths = torch.randint(1, t + 1, (n,))
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    kwargs = dict(beta=0.05, loss_type=loss_type, max_new_tokens=t)

    full, _ = grpo_loss(theta - 1, old, ref, adv, mask, **kwargs)
    (full_grad,) = torch.autograd.grad(full, theta)

    rows = list(range(n))
    random.Random(1).shuffle(rows)
    cuts = [0, 1, 4, 5, 9, n]
    grad = torch.zeros_like(theta)
    for a, b in zip(cuts, cuts[1:]):
        idx = torch.tensor(rows[a:b])
        part, _ = grpo_loss(theta[idx] - 1, old[idx], ref[idx], adv[idx], mask[idx], normalizer=1.0, **kwargs)
        grad += torch.autograd.grad(part, theta)[0]
    grad /= loss_normalizer(loss_type, n, int(mask.sum()))
    torch.testing.assert_close(grad, full_grad, rtol=1e-6, atol=1e-7)


def test_per_micro_batch_mean_is_not_invariant():
    """Why the normaliser is global: averaging each micro-batch by its own token count changes the gradient."""
    torch.manual_seed(0)
    theta = torch.randn(4, 5, requires_grad=True)
    mask = torch.tensor([[1.0] * 5, [1.0] * 1 + [0.0] * 4, [1.0] * 3 + [0.0] * 2, [1.0] * 2 + [0.0] * 3])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    full, _ = grpo_loss(theta, theta.detach(), None, adv, mask, beta=0.0)
    (full_grad,) = torch.autograd.grad(full, theta)
    halves = [grpo_loss(theta[i:i + 2], theta[i:i + 2].detach(), None, adv[i:i + 2], mask[i:i + 2], beta=0.0)[0]
              for i in (0, 2)]
    (naive_grad,) = torch.autograd.grad(sum(halves) / 2, theta)
    assert not torch.allclose(naive_grad, full_grad)


def expected_kl_gradient(logits: torch.Tensor, ref_logp: torch.Tensor, kl_bias_correction: bool) -> torch.Tensor:
    """E_{o ~ π_θ}[∇ (KL term of grpo_loss at token o)], on-policy, enumerated exactly over a small vocabulary."""
    logp = logits.log_softmax(-1)  # (V,) differentiable
    probs = logp.exp().detach()  # the sampling distribution: no gradient flows through it
    per_token = []
    for o in range(len(logits)):
        token = logp[o].view(1, 1)
        loss, _ = grpo_loss(token, token.detach(), ref_logp[o].view(1, 1), torch.zeros(1), torch.ones(1, 1),
                            beta=1.0, normalizer=1.0, kl_bias_correction=kl_bias_correction)
        per_token.append(loss)
    (grad,) = torch.autograd.grad((probs * torch.stack(per_token)).sum(), logits)
    return grad


def test_bias_corrected_kl_has_the_gradient_of_the_kl_it_reports():
    """Claim (grpo.py docstring): on-policy, E[∇(ρ·k3)] = ∇ KL(π_θ ‖ π_ref), the KL the k3 value estimates, while
    the plain term's E[∇k3] = ∇ KL(π_ref ‖ π_θ), the reverse KL. Exact expectations over a 6-token vocabulary."""
    torch.manual_seed(0)
    logits = (torch.randn(6, dtype=torch.float64) * 2).requires_grad_()
    ref_logp = (torch.randn(6, dtype=torch.float64) * 2).log_softmax(-1)
    logp = logits.log_softmax(-1)
    (forward_kl,) = torch.autograd.grad((logp.exp() * (logp - ref_logp)).sum(), logits)
    (reverse_kl,) = torch.autograd.grad((ref_logp.exp() * (ref_logp - logits.log_softmax(-1))).sum(), logits)
    torch.testing.assert_close(expected_kl_gradient(logits, ref_logp, True), forward_kl)
    torch.testing.assert_close(expected_kl_gradient(logits, ref_logp, False), reverse_kl)
    assert not torch.allclose(forward_kl, reverse_kl, rtol=0.05), "the two KLs must differ for the test to bite"


def test_kl_bias_correction_scales_the_term_by_the_ratio():
    """Claim: the corrected per-token KL term is ρ·k3 (TRL's `per_token_kl * coef_1`), the plain one k3, in value;
    the logged KL is that same term, as TRL logs it."""
    logp, old, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([[-2.0]])
    k3 = math.exp(-1.0) + 1.0 - 1.0
    for correction, expected in ((True, math.exp(0.5) * k3), (False, k3)):
        loss, stats = grpo_loss(logp, old, ref, torch.zeros(1), torch.ones(1, 1), beta=1.0,
                                kl_bias_correction=correction)
        assert loss.item() == pytest.approx(expected) and float(stats["kl_sum"]) == pytest.approx(expected)
