"""launch/memory.py: the micro-batch fitted to a GPU's free memory, its arithmetic, and its glue run on CPU through a
backend that counts live tensor bytes as the CUDA allocator counts them."""
import dataclasses

import pytest
import torch

from benchmarks.memory import LiveTensorBytes
from counting_backend import CountingBackend
from config import Config
from infra.data import load_task
from infra.models import load_model
from infra.options import MICRO_BATCH_TOKENS, derive, fits_memory
from launch import memory
from launch.setup import Training, adamw
from learner import forward_backward
from packing import logprobs_fn
from tri_model import TriModel


@pytest.mark.parametrize("free, per_token, fixed", [(141e9, 1.3e6, 3e9), (24e9, 2.1e5, 6e8), (8e9, 7e6, 1e9),
                                                    (2e9, 1e6, 1.5e9)])
def test_the_fitted_tokens_fit_and_one_bucket_more_would_not(free, per_token, fixed):
    """Claim: fit_tokens picks n with fixed + per_token·n within (1 - MARGIN) of the free bytes, a multiple of
    BUCKET when at least one fits, and n + BUCKET would not fit (nothing is left on the table but the rounding)."""
    n = memory.fit_tokens(free, per_token, fixed)
    usable = (1 - memory.MARGIN) * free
    assert n >= 1 and (fixed + per_token * n <= usable or n == 1)
    if n >= memory.BUCKET:
        assert n % memory.BUCKET == 0 and fixed + per_token * (n + memory.BUCKET) > usable
    else:
        assert fixed + per_token * (n + 1) > usable


def test_derive_leaves_the_micro_batch_to_the_memory_fit_on_a_gpu_trainer_only():
    """Claim: with --sizes probe on a CUDA (or NPU) trainer and no --micro-batch-tokens, the micro-batch alone is left
    open for launch/memory.py (which inference ranks do not refuse: it probes nothing); given, with --sizes rule,
    with bnpo (whose loss depends on it), or on CPU, it is not."""
    from infra.distributed import Ranks, check
    gpu = derive(Config(device="cuda", max_new_tokens=8))
    assert gpu.micro_batch_tokens is None and fits_memory(gpu) and not gpu.sized
    check(gpu, Ranks(0, 1, 0, 1, inference=1))  # no refusal
    assert derive(Config(device="cuda", max_new_tokens=8, micro_batch_tokens=500)).micro_batch_tokens == 500
    for kept in (derive(Config(device="cuda", max_new_tokens=8, sizes="rule")),
                 derive(Config(device="cuda", max_new_tokens=8, loss_type="bnpo"))):
        assert kept.micro_batch_tokens == MICRO_BATCH_TOKENS and not fits_memory(kept)
    assert not fits_memory(derive(Config(max_new_tokens=8)))  # CPU: the probe's to choose
    sampled_on_cpu = dict(rollout_device="cpu", train_device="cuda:0", groups_per_call=8, rollout_threads=1,
                          train_threads=1, max_new_tokens=8)  # the micro-batch left open for the CPU probe
    assert not fits_memory(derive(Config(loss_type="bnpo", **sampled_on_cpu)))
    assert not fits_memory(derive(Config(sizes="rule", **sampled_on_cpu)))


def test_the_fitted_micro_batch_fits_and_the_fit_changes_nothing(tiny_model_dir, monkeypatch):
    """Claim: fit_micro_batch, on a device whose memory is counted as the CUDA allocator counts it, sets
    --micro-batch-tokens from the measured peak of stand-in rows and the free bytes less the gradients and AdamW's
    moments still to come, says so ("from N GB free"), and leaves the random state, the weights and the gradients as
    they were; and a micro-batch of that many tokens of the run's longest plain rows, trained with the gradients
    held, peaks within that budget."""
    cfg = derive(Config(model=str(tiny_model_dir), data="arithmetic", mode="sync", batch_size=32, group_size=4,
                        max_new_tokens=6))
    policy, tokenizer = load_model(cfg.model)
    train, _ = load_task(cfg.data, eval_size=4)
    tri = TriModel(policy, logprobs_fn(policy, pad_id=tokenizer.pad_token_id), use_reference=True, use_old=False)
    optimizer = adamw(list(policy.parameters()), lr=1e-3, weight_decay=0.0)
    training = Training(tri, optimizer, None, "", 0)
    before, rng = [p.detach().clone() for p in policy.parameters()], torch.get_rng_state()
    free = 12_000_000
    with LiveTensorBytes(existing=[*policy.parameters(), *tri.reference.parameters(), *before]) as live:
        monkeypatch.setattr(memory, "device_memory", lambda device: CountingBackend(live, free))
        still = memory.still_to_come(policy, optimizer)  # gradients + two moments: 3x the float32 weights
        fitted, note = memory.fit_micro_batch(dataclasses.replace(cfg, micro_batch_tokens=None), training, tokenizer,
                                              train)
        assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in policy.parameters())
        assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), before))
        budget = free - still
        assert still == 3 * sum(p.numel() * 4 for p in policy.parameters())
        assert f"micro-batch: {fitted.micro_batch_tokens} tokens from {budget / 1e9:.3g} GB free" in note
        rows = memory.stand_in_groups(cfg, tokenizer, train, policy.get_input_embeddings().num_embeddings,
                                      torch.device("cpu"), count=64)
        width = len(rows[0][0]) + cfg.max_new_tokens  # tokens of one row
        n = fitted.micro_batch_tokens // width
        assert 4 <= n <= len(rows)  # (the test's free bytes leave room for several rows)
        forward_backward(tri, rows[:1], [0.0], cfg)  # the gradients held, as after a run's first micro-batch
        start = live.live
        live.peak = start
        forward_backward(tri, rows[:n], [0.0] * n, cfg)
        assert live.peak - start <= budget
    policy.zero_grad(set_to_none=True)


def open_micro_batch(tiny_model_dir):
    """(a sync config of the tiny model with the micro-batch left open, policy, tokenizer, training examples, the
    training side: policy-only tri-model, so no KL term, and AdamW) for fit_micro_batch."""
    cfg = derive(Config(model=str(tiny_model_dir), data="arithmetic", mode="sync", batch_size=8, group_size=4,
                        max_new_tokens=4, beta=0.0))
    policy, tokenizer = load_model(cfg.model)
    train, _ = load_task(cfg.data, eval_size=4)
    tri = TriModel(policy, logprobs_fn(policy, pad_id=tokenizer.pad_token_id), use_reference=False, use_old=False)
    training = Training(tri, adamw(list(policy.parameters()), lr=1e-3, weight_decay=0.0), None, "", 0)
    return dataclasses.replace(cfg, micro_batch_tokens=None), policy, tokenizer, train, training


def test_without_a_fit_the_default_cap_stays_and_says_why(tiny_model_dir, monkeypatch):
    """Claim: where the device reports no memory (CPU), or the stand-in rows themselves run out of it (here in the
    second forward/backward, after the first made the gradients and drew dropout's randomness), the micro-batch is the
    default cap and the line says why; the gradients are left unset and the random state restored."""
    open_cfg, policy, tokenizer, train, training = open_micro_batch(tiny_model_dir)
    chosen, note = memory.fit_micro_batch(open_cfg, training, tokenizer, train)
    assert chosen.micro_batch_tokens == MICRO_BATCH_TOKENS
    assert note == f"micro-batch: cpu reports no free memory: the default {MICRO_BATCH_TOKENS}"

    passes = []

    def out_of_memory_in_the_second(*args):
        passes.append(1)
        if len(passes) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        real_forward_backward(*args)
        torch.rand(1)  # a draw, as dropout makes in training mode
    real_forward_backward = memory.forward_backward
    state = torch.get_rng_state()
    with LiveTensorBytes(existing=list(policy.parameters())) as live:
        monkeypatch.setattr(memory, "device_memory", lambda device: CountingBackend(live, 10**9))
        monkeypatch.setattr(memory, "forward_backward", out_of_memory_in_the_second)
        chosen, note = memory.fit_micro_batch(open_cfg, training, tokenizer, train)
    assert len(passes) == 2 and chosen.micro_batch_tokens == MICRO_BATCH_TOKENS and "ran out of memory on cpu" in note
    assert note.endswith(f"the default {MICRO_BATCH_TOKENS}") and all(p.grad is None for p in policy.parameters())
    assert torch.equal(torch.get_rng_state(), state)


def test_the_fit_lowers_the_default_cap_and_never_raises_it(tiny_model_dir, monkeypatch):
    """Claim: a fit above the default cap is cut to it, and the line says so (async's micro-batches train beside
    their call's sampling, and sync cuts alike so that the modes stay bitwise equal); a fit below it stands."""
    open_cfg, policy, tokenizer, train, training = open_micro_batch(tiny_model_dir)
    for fit in (8 * MICRO_BATCH_TOKENS, MICRO_BATCH_TOKENS // 2):
        monkeypatch.setattr(memory, "fit_rows", lambda *args, fit=fit: (fit, f"micro-batch: {fit} tokens"))
        chosen, note = memory.fit_micro_batch(open_cfg, training, tokenizer, train)
        assert chosen.micro_batch_tokens == min(fit, MICRO_BATCH_TOKENS)
        assert note.endswith(f"the cap, {MICRO_BATCH_TOKENS} (fits)") == (fit > MICRO_BATCH_TOKENS)


def test_the_sizes_line_says_the_fitted_micro_batch_and_why(tiny_model_dir, capsys):
    """Claim: the run's set-up (launch.setup.sampling_side) fits the micro-batch left open, after the sampler is
    built, without probing, and its sizes line gives the size with the fit's reason on the next line (here a trainer
    whose device reports no memory: the default cap, said so)."""
    from infra.reward import load_rewards
    from launch import setup
    cfg = derive(Config(model=str(tiny_model_dir), data="arithmetic", mode="sync", batch_size=8, group_size=4,
                        max_new_tokens=4))
    cfg = dataclasses.replace(cfg, micro_batch_tokens=None, train_device="cuda", groups_per_call=2)  # as on a GPU
    assert fits_memory(cfg)
    policy, tokenizer = load_model(cfg.model)
    train, _ = load_task(cfg.data, eval_size=4)
    training = setup.training_side(cfg, policy, tokenizer)
    rewards = load_rewards(cfg.reward)
    sized, _, learner = setup.sampling_side(cfg, training, policy, tokenizer, train, [], rewards, {})
    out = capsys.readouterr().out
    assert sized.micro_batch_tokens == learner.cfg.micro_batch_tokens == MICRO_BATCH_TOKENS and "probing" not in out
    assert (f"--micro-batch-tokens {MICRO_BATCH_TOKENS} --rollout-threads" in out
            and f"\nperiodic-rl: micro-batch: cpu reports no free memory: the default {MICRO_BATCH_TOKENS}\n" in out)
