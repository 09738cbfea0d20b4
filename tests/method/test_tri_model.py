"""The tri-model (tri_model.py): one call equals three separate forwards; copies exist only when needed."""
import copy

import torch

from grpo import grpo_loss
from infra.models import load_model
from packing import batch_logprobs, logprobs_fn
from tri_model import TriModel


def group(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 90, (6,), generator=g)
    responses = [torch.randint(3, 90, (n,), generator=g) for n in (3, 5, 2, 4)]
    return [(prompt, responses)]


def perturb(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_three_outputs_equal_separate_forwards(tiny_model_dir):
    """Claim: (logp, old_logp, ref_logp) from one call equal forwards of three independent copies
    (θ now, θ_k at the iteration start, θ_0 at construction)."""
    policy, _ = load_model(str(tiny_model_dir))
    reference = copy.deepcopy(policy)
    tri = TriModel(policy, logprobs_fn(policy), use_reference=True, use_old=True)
    perturb(policy, seed=1)
    tri.start_iteration()
    old = copy.deepcopy(policy)
    perturb(policy, seed=2)  # an optimizer step within the iteration
    logp, old_logp, ref_logp, mask = tri(group())
    for model, got in ((policy, logp), (old, old_logp), (reference, ref_logp)):
        expected, expected_mask = batch_logprobs(model, group(), mode="unpacked")
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert torch.equal(mask, expected_mask)
    assert not torch.allclose(logp, old_logp) and not torch.allclose(old_logp, ref_logp)


def test_one_update_per_iteration_needs_no_old_copy_and_ratio_is_exactly_one(tiny_model_dir):
    """Claim: with one step per iteration no old copy is made and old_logp = logp.detach() exactly (ratio 1);
    with beta = 0 no reference copy is made and ref_logp is None."""
    policy, _ = load_model(str(tiny_model_dir))
    tri = TriModel(policy, logprobs_fn(policy), use_reference=False, use_old=False)
    assert tri.old is None and tri.reference is None
    logp, old_logp, ref_logp, _ = tri(group())
    assert ref_logp is None and torch.equal(old_logp, logp.detach()) and not old_logp.requires_grad
    assert torch.equal(torch.exp(logp - old_logp), torch.ones_like(logp))
    report = tri.memory_report()
    assert report["old_bytes"] == report["reference_bytes"] == 0 and report["policy_bytes"] > 0
    fresh = load_model(str(tiny_model_dir))[0]
    full = TriModel(fresh, logprobs_fn(fresh), use_reference=True, use_old=True).memory_report()
    assert full["old_bytes"] == full["reference_bytes"] == full["policy_bytes"]


def test_frozen_copies_have_no_grad_and_reference_stays_at_initial_weights(tiny_model_dir):
    """Claim: after many optimizer steps the reference still holds θ_0, the frozen copies never get a .grad,
    and only the policy's parameters are in the optimizer."""
    policy, _ = load_model(str(tiny_model_dir))
    initial = [p.detach().clone() for p in policy.parameters()]
    tri = TriModel(policy, logprobs_fn(policy), use_reference=True, use_old=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    frozen = list(tri.reference.parameters()) + list(tri.old.parameters())
    optimizer_params = {id(p) for group_ in optimizer.param_groups for p in group_["params"]}
    assert not optimizer_params & {id(p) for p in frozen}
    assert all(not p.requires_grad for p in frozen)
    for step in range(20):
        if step % 4 == 0:
            tri.start_iteration()
        logp, old_logp, ref_logp, mask = tri(group(step))
        loss, _ = grpo_loss(logp, old_logp, ref_logp, torch.tensor([1.0, -1.0, 0.5, -0.5]), mask, beta=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(p.grad is None for p in frozen)
    for ref, init in zip(tri.reference.parameters(), initial):
        assert torch.equal(ref, init)
    assert any(not torch.equal(p, init) for p, init in zip(policy.parameters(), initial))


def test_old_logp_is_the_iteration_start_snapshot(tiny_model_dir):
    """Claim: with N > 1 updates per iteration old_logp comes from the weights at the iteration start, so after
    the first step the ratio departs from 1 (clipping can act), and start_iteration re-synchronises it."""
    policy, _ = load_model(str(tiny_model_dir))
    tri = TriModel(policy, logprobs_fn(policy), use_reference=False, use_old=True)
    tri.start_iteration()
    snapshot = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    logp, old_logp, _, mask = tri(group())
    torch.testing.assert_close(old_logp, logp.detach(), atol=1e-6, rtol=0)
    loss, _ = grpo_loss(logp, old_logp, None, torch.tensor([2.0, -2.0, 1.0, -1.0]), mask, beta=0.0)
    loss.backward()
    optimizer.step()
    logp, old_logp, _, mask = tri(group())
    torch.testing.assert_close(old_logp, batch_logprobs(snapshot, group(), mode="unpacked")[0], atol=1e-5, rtol=0)
    assert (torch.exp(logp - old_logp) - 1).abs()[mask].max() > 1e-3
    tri.start_iteration()
    logp, old_logp, _, _ = tri(group())
    torch.testing.assert_close(old_logp, logp.detach(), atol=1e-6, rtol=0)
