"""Mixed precision: bf16 compute over float32 master weights applies small updates, and async == sync still holds."""
import pytest
import torch

from attention import recomputes_attention
from models import load_model
from periodic_rl import WeightBuffer
from test_pipeline import SAME_THREADS, make_cfg, run_training

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


def test_bf16_async_equals_sync_and_publishes_bf16(tiny_model_dir):
    """Claim: in bf16, both modes sample from the same bf16 copy of the float32 masters (async: the shared buffer,
    2 bytes a parameter; sync: a bf16 model in the trainer), so with equal thread counts they stay bitwise equal."""
    extra = ["--dtype", "bfloat16", *SAME_THREADS]
    sync_policy, sync_rows = run_training(make_cfg(tiny_model_dir, "--mode", "sync", *extra))
    async_policy, async_rows = run_training(make_cfg(tiny_model_dir, "--mode", "async", *extra))
    for p, q in zip(sync_policy.parameters(), async_policy.parameters()):
        assert torch.equal(p, q)
    for s, a in zip(sync_rows, async_rows):
        for key in ("reward_mean", "response_length", "eval_reward", "loss", "grad_norm"):
            assert s.get(key) == a.get(key), key
    buffer = WeightBuffer(async_policy, torch.bfloat16)  # what AsyncRollouts allocates for --dtype bfloat16
    buffer.publish(async_policy, 0)
    assert buffer.flat.element_size() == 2
    assert all(torch.equal(view, p.bfloat16()) for view, p in zip(buffer.views(), async_policy.parameters()))


def test_bf16_run_learns(tmp_path):
    """Claim: `python trainer.py --dtype bfloat16` (the warmed-up tiny model, sync mode) learns: held-out reward
    rises by well over the noise in 16 iterations (measured: 0.301 -> 0.469 at 10 iterations, 0.688 at 20; the
    float32 run is in the README). In bf16 *weights* with bf16 AdamW the same run would barely move (see above)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "trainer.py", "--dtype", "bfloat16", "--mode", "sync", "--iterations", "16",
                             "--eval-every", "16", "--eval-size", "64", "--no-save", "--out", str(tmp_path)],
                            cwd=root, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start, end = rows[0]["eval_reward"], rows[-1]["eval_reward"]
    assert end >= start + 0.15, (start, end)


def test_gradient_checkpointing_trains_the_same(tiny_model_dir):
    """Claim: --gradient-checkpointing only trades compute for memory. The forward is the same computation (same
    loss, bitwise); backward sums the same gradient terms in another order (the recomputed layers' contributions
    arrive separately), so the gradient norm agrees to fp32 summation noise (1e-5 relative, ~10^3 terms at 2^-24
    each) and, after Adam's sign-like first step (lr·g/(|g|+eps)), the weights agree except where a gradient element
    is itself at noise level, which can step either way: |Δw| <= 2·lr. Packed rows under checkpointing take the
    dense mask, tested equal to the structured kernel in test_attention.py."""
    runs = [run_training(make_cfg(tiny_model_dir, "--mode", "sync", "--iterations", "1", *SAME_THREADS, *flag))
            for flag in ([], ["--gradient-checkpointing"])]
    (plain, plain_rows), (checkpointed, checkpointed_rows) = runs
    assert recomputes_attention(checkpointed.train()) and not recomputes_attention(plain.train())
    assert plain_rows[0]["loss"] == checkpointed_rows[0]["loss"]
    assert checkpointed_rows[0]["grad_norm"] == pytest.approx(plain_rows[0]["grad_norm"], rel=1e-5)
    for p, q in zip(plain.parameters(), checkpointed.parameters()):
        assert (p - q).abs().max().item() <= 2 * 1e-2
