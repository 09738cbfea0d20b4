"""Mixed precision: bf16 compute over float32 master weights applies small updates, and async == sync still holds."""
import pytest
import torch
from test_pipeline import SAME_THREADS, kept_inference_sides, make_cfg, run_training

from launch import setup
from infra.models import load_model
from packing import enable_activation_checkpointing, logprobs_fn, recomputes_attention
from tri_model import TriModel
import warm

LR = 1e-6


def test_bf16_keeps_float32_masters_and_applies_lr_sized_steps(tiny_model_dir):
    """Claim: --dtype bfloat16 trains float32 master weights under bf16 autocast, so one AdamW step at lr 1e-6 moves
    the weights by lr-sized steps (Adam's first step is lr·g/(|g|+eps): exactly ±lr where the gradient is not tiny),
    steps that bf16 weights could not hold: near |w| = 0.02 bf16's spacing is 1.2e-4, and rounding the moved
    weights to bf16 gives back the old ones almost everywhere (what bf16 parameters with bf16 AdamW did)."""
    cfg = make_cfg(tiny_model_dir, "--mode", "sync", "--dtype", "bfloat16", "--lr", LR, "--iterations", "1",
                   "--eval-every", "0")
    assert cfg.dtype == "bfloat16"
    policy, rows = run_training(cfg)
    initial, _ = load_model(str(tiny_model_dir))
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    step = torch.cat([(p - q).flatten() for p, q in zip(policy.parameters(), initial.parameters())]).detach()
    start = torch.cat([q.flatten() for q in initial.parameters()]).detach()
    rounding = torch.finfo(torch.float32).eps * start.abs()  # storing w + step in fp32 rounds by <= half a spacing
    assert (step.abs() <= LR + rounding).all()  # |lr·g/(|g|+eps)| <= lr
    moved = step.abs() > LR / 2
    assert moved.float().mean().item() > 0.5, "most weights should take a full lr step"
    lost = (start + step).bfloat16() == start.bfloat16()
    assert lost[moved].float().mean().item() > 0.9, "in bf16 most of these steps would round away"
    assert rows[0]["loss"] == rows[0]["loss"]  # finite (not NaN)


def test_bf16_async_equals_sync_and_publishes_bf16(tiny_model_dir, monkeypatch):
    """Claim: in bf16, both modes sample from the same bf16 copy of the float32 masters (async: the shared buffer the
    inference process is given, 2 bytes a parameter; sync: a bf16 model in the trainer), so with equal thread counts
    they stay bitwise equal."""
    extra = ["--dtype", "bfloat16", *SAME_THREADS]
    sync_policy, sync_rows = run_training(make_cfg(tiny_model_dir, "--mode", "sync", *extra))
    spawned = kept_inference_sides(monkeypatch)
    async_policy, async_rows = run_training(make_cfg(tiny_model_dir, "--mode", "async", *extra))
    rollouts, = spawned
    assert rollouts.weights.flat.dtype == torch.bfloat16  # what was published, for the inference process to read
    assert all(p.dtype == torch.float32 for p in async_policy.parameters())
    for p, q in zip(sync_policy.parameters(), async_policy.parameters()):
        assert torch.equal(p, q)
    for s, a in zip(sync_rows, async_rows, strict=True):
        for key in ("reward_mean", "response_length", "eval_reward", "loss", "grad_norm"):
            assert s.get(key) == a.get(key), key


@pytest.mark.slow
def test_bf16_run_learns(tmp_path):
    """Claim: `python trainer.py --dtype bfloat16` (the warmed-up tiny model, sync mode) learns: held-out reward
    rises by well over the noise (0.15) in 16 iterations. The learning rate is constant: the default linear decay
    halves the mean step, and the claim is about bf16, not the schedule. In bf16 *weights* with bf16 AdamW the
    same run would barely move (see above)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    result = warm.run([sys.executable, "trainer.py", "--dtype", "bfloat16", "--mode", "sync", "--iterations", "16",
                             "--lr-scheduler-type", "constant", "--eval-every", "16", "--eval-size", "64", "--no-save", "--out", str(tmp_path)],
                            cwd=root, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start, end = rows[0]["eval_reward"], rows[-1]["eval_reward"]
    assert end >= start + 0.15, (start, end)


def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(tiny_model_dir):
    """Claim: --gradient-checkpointing only trades compute for memory. For packed and plain groups, the policy's
    log-probs are the same with it (packed rows then take the dense mask instead of the structured kernel: the
    same attention, another summation order, so 1e-5 as in test_attention.py), the reference's log-probs equal the
    policy's at θ_0 exactly (KL = 0: TriModel runs the frozen copy through the same kernels), and every parameter's
    gradient agrees to 1e-5 relative (backward sums the recomputed layers' terms in another order)."""
    generator = torch.Generator().manual_seed(0)
    groups = [(torch.randint(2, 200, (40,), generator=generator),  # a long prompt: packed
               [torch.randint(2, 200, (n,), generator=generator) for n in (3, 5, 2, 4)]),
              (torch.randint(2, 200, (3,), generator=generator),  # long responses: plain rows
               [torch.randint(2, 200, (n,), generator=generator) for n in (30, 28)])]
    advantages = torch.randn(6, generator=generator)
    results = []
    for checkpointing in (False, True):
        policy, _ = load_model(str(tiny_model_dir))
        if checkpointing:
            enable_activation_checkpointing(policy)
        policy.train()
        tri = TriModel(policy, logprobs_fn(policy), use_reference=True, use_old=False)
        logp, _, ref_logp, mask = tri(groups)
        assert recomputes_attention(policy) == checkpointing
        assert torch.equal(ref_logp, logp.detach())  # KL = 0 at θ_0, with or without checkpointing
        grads = torch.autograd.grad(-(advantages[:, None] * logp * mask).sum(), list(policy.parameters()))
        results.append((logp.detach(), grads))
    (plain_logp, plain_grads), (ckpt_logp, ckpt_grads) = results
    torch.testing.assert_close(ckpt_logp, plain_logp, rtol=0, atol=1e-5)
    for g, h in zip(plain_grads, ckpt_grads):
        assert (g - h).norm() <= 1e-5 * g.norm() + 1e-9


def test_gradient_checkpointing_flag_reaches_the_policy(tiny_model_dir):
    """Claim: `--gradient-checkpointing` turns checkpointing on in the trainer's policy, and a run trains."""
    policy, rows = run_training(make_cfg(tiny_model_dir, "--mode", "sync", "--iterations", "1", "--eval-every", "0",
                                         "--gradient-checkpointing"))
    assert recomputes_attention(policy.train()) and rows[0]["grad_norm"] > 0


def test_adamw_on_cpu_is_the_multi_tensor_form_with_the_same_update():
    """Claim: the trainer's AdamW (launch.setup.adamw) off CUDA is torch's multi-tensor (foreach) form, fused only
    where every parameter is on CUDA, and over several steps with weight decay it moves the weights exactly as the
    per-tensor loop does (the same element-wise operations in the same order: torch.equal)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(37, 13), (13,), (5, 3, 2)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    optimizer = setup.adamw(ours, lr=1e-3, weight_decay=0.1)
    reference = torch.optim.AdamW(plain, lr=1e-3, weight_decay=0.1, foreach=False)
    assert optimizer.defaults["foreach"] and not optimizer.defaults["fused"]
    for _ in range(4):
        for p, q in zip(ours, plain):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        optimizer.step()
        reference.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, plain))
