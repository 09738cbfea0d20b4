"""TRL's training options: the learning-rate schedule, scale_rewards, mask_truncated_completions,
num_iterations (μ), bnpo, disable_dropout, and the metrics TRL logs, each against a reference computed in one
piece. The learner's runs here are in float64 but for Qwen2's RMSNorm, which computes in float32 whatever the
model's dtype (as every Hugging Face Llama-family norm): a gradient scaled at another point (1/D or 1/s before
or after the backward) rounds differently there, by up to 2^-24 ≈ 6e-8 relative per norm and element, summed
over the tiny model's 5 norms (1.2e-7 of the largest gradient element measured). The check allows 1e-5, while
each wrong normalisation or scale checked here is off by 3% or more (dapo's D of one mini-batch against the
batch's / 2: 17 or 14 against 15.5 tokens; an unscaled A: std_batch + eps = 0.96)."""
import copy
import json
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

import grpo
from config import LR_SCHEDULERS, SCALE_REWARDS
from infra.models import load_model
from infra.command_line import parse_args, typed_trl, with_config_file
from infra.trl_names import TRL_STEP_KEYS, TRL_UNUSED
from infra.timeline import Timeline
from launch import setup
from learner import Learner, minibatch_of
from rollout import ScoredGroup
from conftest import learn_iteration

ROOT = Path(__file__).resolve().parents[2]
EOS, G, MAX_NEW = 0, 4, 4
# 4 prompts x 4 responses: rewards with unequal group stds, one all-equal group (frac_reward_zero_std), responses
# that stop with EOS and some cut at MAX_NEW tokens without it (truncated)
REWARDS = [[1.0, 0.0, 0.0, 0.5], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 1.0, 1.0], [0.25, 0.0, 1.0, 0.0]]
RESPONSES = [[[5, 6, 7, EOS], [8, EOS], [9, 10, 11, 12], [13, 14, EOS]],
             [[15, EOS], [16, 17, 18, 19], [20, 21, 22, EOS], [23, EOS]],
             [[24, 25, 26, 27], [28, 29, EOS], [30, EOS], [31, 32, 33, 34]],
             [[35, 36, EOS], [37, 38, 39, 40], [41, EOS], [42, 43, 44, EOS]]]
PROMPTS = [[50, 51, 52], [53, 54], [55, 56, 57, 58], [59, 60, 61]]


def make_groups(scale_rewards: str) -> list[ScoredGroup]:
    """The groups as the inference side sends them (rollout.py: group_advantages of each group alone)."""
    return [ScoredGroup(0, j, 0, PROMPTS[j], RESPONSES[j], REWARDS[j],
                  grpo.group_advantages(torch.tensor(REWARDS[j]), G, scale_rewards).tolist(), call=(0, 4),
                  rewards_per_function=[REWARDS[j]]) for j in range(4)]


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradient of each step."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
        return super().step(closure)


def config(model_dir, *options):
    return parse_args(["--model", str(model_dir), "--batch-size", "16", "--group-size", str(G), "--max-new-tokens",
                       str(MAX_NEW), "--sizes", "rule", "--groups-per-call", "4", "--micro-batch-tokens", "1",
                       "--max-grad-norm", "0", *map(str, options)])


def tri_model(cfg, model_dir):
    """θ_0 in float64 with a reference moved off θ_0 (so that the KL term has a gradient) and θ_old when needed."""
    policy, _ = load_model(str(model_dir))
    policy.double()
    tri = setup.build_tri_model(dataclasses.replace(cfg, beta=0.04), policy, pad_id=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tri.reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    if cfg.beta == 0:
        tri.reference = None
    return tri


def learner_run(cfg, tri, groups, lr=0.5, scheduler_of=None):
    """One iteration through the Learner as periodic_rl.train drives it: groups in arrival order, ready micro-batches
    (here one group each: --micro-batch-tokens 1), a step whenever a mini-batch is done."""
    optimizer = RecordingSGD(tri.policy.parameters(), lr)
    scheduler = scheduler_of(optimizer) if scheduler_of else None
    learner = Learner(tri, optimizer, cfg, torch.device("cpu"), Timeline(), reward_names=["r"], scheduler=scheduler,
                      stop_ids=[EOS])
    tri.start_iteration()
    learner.start(0)
    learn_iteration(learner, groups)
    return learner.metrics(), optimizer.grads


def batch_of(groups):
    return [(torch.tensor(g.prompt_ids), [torch.tensor(r) for r in g.responses]) for g in groups]


def reference_run(cfg, tri, groups, lr=0.5):
    """The same steps written out in one piece per optimizer step, TRL's formulas: advantages (r - mean_group) /
    (std_batch + eps) (or per group), truncated responses masked, D per loss type (dapo: the batch's tokens / N
    steps; grpo: the mini-batch's sequences; bnpo: the mean of each micro-batch's token mean, a micro-batch being
    one group here), μ passes over the mini-batches in order, the ratio against θ_k's log-probs."""
    N, passes = cfg.updates_per_iteration, cfg.num_iterations
    params = list(tri.policy.parameters())
    blocks = [[g for g in groups if minibatch_of(g.index, 4, N) == b] for b in range(N)]
    keep = {g.index: [not (cfg.mask_truncated_completions and len(r) == MAX_NEW and r[-1] != EOS)
                      for r in g.responses] for g in groups}
    if cfg.scale_rewards == "batch":
        divisor = float(grpo.batch_std(torch.tensor([r for g in groups for r in g.rewards])) + 1e-4)
        advantages = {g.index: torch.tensor(g.advantages, dtype=torch.float64) / divisor for g in groups}
    else:
        advantages = {g.index: torch.tensor(g.advantages, dtype=torch.float64) for g in groups}
    with torch.no_grad():
        old = {g.index: tri.logprobs(tri.policy, batch_of([g]))[0] for g in groups}  # θ_k's
    tokens = sum(len(r) for g in groups for r, k in zip(g.responses, keep[g.index]) if k)
    grads = []
    for step in range(N * passes):
        block = blocks[step % N]
        losses = []
        for part in ([[g] for g in block] if cfg.loss_type == "bnpo" else [block]):
            logp, _, ref_logp, mask = tri(batch_of(part))
            old_logp = torch.cat([torch.nn.functional.pad(old[g.index], (0, logp.shape[1] - old[g.index].shape[1]))
                                  for g in part])
            mask = mask & torch.tensor([k for g in part for k in keep[g.index]])[:, None]
            normalizer = {"dapo": tokens / N, "grpo": sum(len(g.responses) for g in block),
                          "bnpo": max(int(mask.sum()), 1) * len(block)}[cfg.loss_type]
            loss, _ = grpo.grpo_loss(logp, old_logp, ref_logp, torch.cat([advantages[g.index] for g in part]), mask,
                                     beta=cfg.beta, loss_type=cfg.loss_type, max_new_tokens=MAX_NEW,
                                     normalizer=normalizer)
            losses.append(loss)
        grad = torch.autograd.grad(sum(losses), params)
        with torch.no_grad():
            for p, g in zip(params, grad):
                p.add_(g, alpha=-lr)
        grads.append(grad)
    return grads


def assert_same_steps(learned, reference):
    assert len(learned) == len(reference)
    for step, (ours, theirs) in enumerate(zip(learned, reference)):
        scale = max(t.abs().max().item() for t in theirs)
        assert scale > 1e-6, "a zero gradient would make the comparison vacuous"
        worst = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
        assert worst <= 1e-5 * scale, f"step {step}: {worst:.3g} off a gradient of {scale:.3g}"


@pytest.mark.parametrize("options", [
    ["--scale-rewards", "batch", "--beta", "0"],                       # streams on centred A, ∇ / s at the step
    ["--scale-rewards", "batch", "--beta", "0.04"],                    # the KL term: the passes wait for s
    ["--scale-rewards", "batch", "--beta", "0", "--updates-per-iteration", "2", "--num-iterations", "2"],
    ["--num-iterations", "3", "--mask-truncated-completions"],         # μ passes against θ_k; truncated left out
    ["--updates-per-iteration", "2", "--mask-truncated-completions"],  # dapo: each step / (the batch's tokens / 2)
    ["--loss-type", "bnpo", "--updates-per-iteration", "2"],           # token mean per micro-batch, mean over them
    ["--loss-type", "grpo", "--scale-rewards", "none", "--num-iterations", "2", "--mask-truncated-completions"],
])
def test_the_learner_takes_trls_steps(tiny_model_dir, options):
    """Claim: streaming groups through the Learner (one group per micro-batch, in arrival order 3, 0, 2, 1) takes
    the optimizer steps TRL's formulas give when each step is computed in one piece: scale_rewards="batch" (β = 0:
    the gradient of the centred advantages divided by std(r_batch) + eps at the step, exact by the positive
    homogeneity of the clipped term, grpo.py; β > 0: A / s before the passes), μ passes over the stored batch with
    the ratio against θ_k, truncated responses masked (grpo still counts them in N), dapo's D = the batch's
    tokens / N steps, bnpo's micro-batch means. Float64; the tolerance is the module docstring's."""
    cfg = config(tiny_model_dir, *options)
    groups = make_groups(cfg.scale_rewards)
    arrival = [groups[i] for i in (3, 0, 2, 1)]
    _, learned = learner_run(cfg, tri_model(cfg, tiny_model_dir), arrival)
    reference = reference_run(cfg, tri_model(cfg, tiny_model_dir), arrival)
    assert len(learned) == cfg.updates_per_iteration * cfg.num_iterations
    assert_same_steps(learned, reference)


def test_batch_scaling_needs_the_kl_term_apart():
    """Claim (grpo.py): the clipped policy term is positively homogeneous in A (loss(cA) = c·loss(A), the clipped
    tokens the same) with the ratio off 1, so ∇ can be divided by s after the fact; the KL term is not, which is
    why scale_rewards="batch" with β > 0 waits for s instead."""
    generator = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=generator, dtype=torch.float64).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    ref = logp.detach() + 0.5 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    centred, mask, s = torch.tensor([1.0, -0.5, -0.5], dtype=torch.float64), torch.ones(3, 5), 0.37
    for beta in (0.0, 0.04):
        scaled, scaled_stats = grpo.grpo_loss(logp, old, ref, centred / s, mask, beta=beta)
        plain, plain_stats = grpo.grpo_loss(logp, old, ref, centred, mask, beta=beta)
        (g_scaled,), (g_plain,) = torch.autograd.grad(scaled, logp), torch.autograd.grad(plain, logp)
        homogeneous = torch.allclose(g_scaled, g_plain / s, rtol=1e-12, atol=0)
        assert homogeneous == (beta == 0.0), beta
        assert scaled_stats["clipped_tokens"] == plain_stats["clipped_tokens"] > 0


def test_advantage_scaling_and_batch_std_as_trl():
    """Claim: scale_rewards "group" (True) divides by the group's std, "none" (False) and "batch" leave the centred
    rewards (the batch's std comes once the batch is whole); batch_std is TRL's nanstd (Bessel-corrected, NaN
    left out; NaN with fewer than two scored)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 2.0, 2.0])
    centred = torch.tensor([0.625, -0.375, -0.375, 0.125, 0.0, 0.0, 0.0, 0.0])
    for scale in ("none", False, "batch"):
        assert torch.equal(grpo.group_advantages(rewards, 4, scale), centred)
    assert torch.equal(grpo.group_advantages(rewards, 4, True), grpo.group_advantages(rewards, 4, "group"))
    values = torch.tensor([1.0, float("nan"), 0.0, 3.0, 0.5])
    scored = values[~values.isnan()]
    trl_nanstd = ((scored - scored.mean()).square().mean() * len(scored) / (len(scored) - 1)).sqrt()
    assert grpo.batch_std(values).item() == pytest.approx(trl_nanstd.item(), rel=1e-6)
    assert grpo.batch_std(torch.tensor([1.0, float("nan")])).isnan()
    assert SCALE_REWARDS == grpo.SCALE_REWARDS


def test_bnpo_and_masked_rows_hand_computed():
    """Claim: bnpo is the token mean of the batch (one micro-batch: TRL's `sum / mask.sum()`); a masked
    (truncated) row adds nothing to any sum, and grpo still counts it in N (TRL: the row's mean is 0)."""
    logp = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    bnpo, _ = grpo.grpo_loss(logp, logp, None, adv, mask, beta=0.0, loss_type="bnpo")
    assert bnpo.item() == pytest.approx((-1 - 1 + 2) / 3)
    masked = torch.tensor([[True, True], [False, False]])
    assert grpo.grpo_loss(logp, logp, None, adv, masked, beta=0.0, loss_type="dapo")[0].item() == -1.0
    assert grpo.grpo_loss(logp, logp, None, adv, masked, beta=0.0, loss_type="grpo")[0].item() == -0.5
    assert grpo.micro_batch_normalizer("bnpo", 3) == 3.0 and grpo.micro_batch_normalizer("dapo", 3) == 1.0
    assert grpo.loss_normalizer("bnpo", 8, 30, num_micro_batches=4) == 4.0


def test_metrics_are_trls(tiny_model_dir):
    """Claim: the iteration's metrics are the numbers TRL logs, against references computed apart: the mean
    per-token entropy of softmax(logits / T) (from the model's full logits, one plain forward per response),
    the KL term and clipped fractions over the loss tokens, frac_reward_zero_std (1 of 4 groups all-equal), the
    completion lengths (mean, min, max; mean, min and max of the terminated ones) and the truncated fraction, the
    tokens the step adds to TRL's num_tokens (each prompt once per response, and the responses), the learning rate of
    step (transformers' linear schedule over 2 steps, one of warmup: 0 at the first step, the full rate at the
    second, which the row logs), and no grad_norm with clipping off (transformers logs none then)."""
    cfg = config(tiny_model_dir, "--temperature", "0.7", "--updates-per-iteration", "2")
    tri = tri_model(cfg, tiny_model_dir)
    policy = copy.deepcopy(tri.policy)
    reference = copy.deepcopy(tri.reference)
    from transformers import get_scheduler
    linear = lambda optimizer: get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=2)
    metrics, _ = learner_run(cfg, tri, make_groups("group"), lr=0.2, scheduler_of=linear)
    entropies, kls = [], []
    with torch.no_grad():
        for prompt, responses in zip(PROMPTS, RESPONSES):
            for response in responses:
                ids = torch.tensor([prompt + response])
                logits = policy(ids).logits[0, len(prompt) - 1:-1] / 0.7  # (R, V) the logits of each response token
                entropies += (-(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)).tolist()
                targets = torch.tensor(response)[:, None]
                logp = (policy(ids).logits[0, len(prompt) - 1:-1] / 0.7).log_softmax(-1).gather(-1, targets)
                ref = (reference(ids).logits[0, len(prompt) - 1:-1] / 0.7).log_softmax(-1).gather(-1, targets)
                kls += grpo.kl_k3(logp, ref).flatten().tolist()
    # step 0 (mini-batch 0) runs at θ_0, step 1 (mini-batch 1) at θ_1 but its rate is 0 at step 0: still θ_0
    # (float32 norms, batched otherwise than here: the module docstring's rounding, 6e-9 relative measured)
    assert metrics["entropy"] == pytest.approx(sum(entropies) / len(entropies), rel=1e-6)
    assert metrics["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-6)
    assert metrics["clip_fraction"] == metrics["clip_fraction_low"] == metrics["clip_fraction_high"] == 0.0
    assert metrics["clip_fraction_low_min"] == metrics["clip_fraction_high_max"] == 0.0
    assert metrics["frac_reward_zero_std"] == 0.25
    lengths = [len(r) for group in RESPONSES for r in group]
    truncated = [len(r) == MAX_NEW and r[-1] != EOS for group in RESPONSES for r in group]
    terminated = [n for n, cut in zip(lengths, truncated) if not cut]
    assert (metrics["response_length_min"], metrics["response_length_max"]) == (2, 4)
    assert metrics["response_length"] == sum(lengths) / 16
    assert metrics["terminated_length"] == sum(terminated) / len(terminated)
    assert (metrics["terminated_length_min"], metrics["terminated_length_max"]) == (min(terminated), max(terminated))
    assert metrics["input_tokens"] == sum(len(p) * G for p in PROMPTS) + sum(lengths)  # TRL's num_tokens' step
    assert metrics["truncated_fraction"] == sum(truncated) / 16 == 5 / 16
    assert metrics["learning_rate"] == 0.2 and metrics["grad_norm"] is None
    assert metrics["frac_reward_unscored"] == 0.0


def test_the_share_of_responses_no_reward_scored_is_logged(tiny_model_dir):
    """Claim: frac_reward_unscored is the share of the iteration's responses that every reward returned None for
    (their weighted total is NaN): a whole group of 4 and one more response of 16 here, 5/16; the reward mean skips
    them. (The trainer warns on the first iteration where it is above 0: tests/cli/test_config.py.)"""
    cfg = config(tiny_model_dir)
    nan = float("nan")
    rewards = [[nan] * 4, [1.0, nan, 0.0, 1.0], *REWARDS[2:]]
    groups = [ScoredGroup(0, j, 0, PROMPTS[j], RESPONSES[j], rewards[j],
                    grpo.group_advantages(torch.tensor(rewards[j]), G).tolist(), call=(0, 4),
                    rewards_per_function=[rewards[j]]) for j in range(4)]
    metrics, _ = learner_run(cfg, tri_model(cfg, tiny_model_dir), groups)
    assert metrics["frac_reward_unscored"] == 5 / 16
    scored = [r for group in rewards for r in group if not math.isnan(r)]
    assert metrics["reward_mean"] == pytest.approx(sum(scored) / 11)


def test_learning_rate_schedule_as_transformers(tiny_model_dir, tmp_path, capsys):
    """Claim: --lr-scheduler-type and --warmup-ratio build transformers' schedule over iterations x
    updates-per-iteration x num-iterations optimizer steps, warmed up over ceil(ratio x steps) (TRL's defaults:
    linear, no warmup), or TRL's --warmup_steps (whole steps, or below 1 a fraction); both, or a fractional count of
    steps above 1, are one usage line; every offered schedule builds, with its arguments where transformers needs them;
    TRL's lr_scheduler_kwargs (typed as JSON, or a --config file's mapping) reach transformers' schedule; a ratio
    outside [0, 1], an unknown schedule, arguments a schedule refuses or needs, and arguments that are not a JSON
    object are one usage line before any model loads."""
    cfg = parse_args(["--model", str(tiny_model_dir), "--iterations", "5", "--batch-size", "8", "--group-size", "4",
                      "--updates-per-iteration", "2", "--num-iterations", "3", "--warmup-ratio", "0.25"])
    defaults = parse_args([])
    assert (defaults.lr_scheduler_type, defaults.warmup_ratio, defaults.num_iterations, defaults.scale_rewards,
            defaults.mask_truncated_completions, defaults.loss_type) == ("linear", 0.0, 1, "group", False, "dapo")
    policy, _ = load_model(str(tiny_model_dir))
    optimizer, scheduler = setup.build_optimizer(cfg, policy)
    rates = []
    for _ in range(30):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    warmup = math.ceil(30 * 0.25)  # 8 steps
    expected = [cfg.lr * s / warmup if s < warmup else cfg.lr * (30 - s) / (30 - warmup) for s in range(30)]
    assert rates == pytest.approx(expected, rel=1e-12, abs=0)
    for warmup in (["--warmup_steps", "8"], ["--warmup-steps", "0.25"]):  # TRL's; below 1 a fraction (transformers 5)
        steps_cfg = dataclasses.replace(cfg, warmup_ratio=0.0, warmup_steps=parse_args(warmup).warmup_steps)
        optimizer, scheduler = setup.build_optimizer(steps_cfg, policy)
        assert scheduler.lr_lambdas[0](3) == pytest.approx(3 / 8) and scheduler.lr_lambdas[0](8) == 1.0, warmup
    needed = {"cosine_with_min_lr": '{"min_lr_rate": 0.1}', "cosine_warmup_with_min_lr": '{"min_lr": 1e-6}',
              "warmup_stable_decay": '{"num_decay_steps": 4}'}
    for name in LR_SCHEDULERS:
        setup.build_optimizer(dataclasses.replace(cfg, lr_scheduler_type=name, lr_scheduler_kwargs=needed.get(name)),
                              policy)
    # TRL's lr_scheduler_kwargs, typed or as a --config file's mapping, reach transformers' schedule
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup
    config = tmp_path / "grpo.yaml"
    config.write_text("lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs:\n  min_lr_rate: 0.1\n")
    typed = ["--lr-scheduler-type", "cosine_with_min_lr", "--lr-scheduler-kwargs", '{"min_lr_rate": 0.1}']
    for argv in (typed, with_config_file(["--config", str(config)])):
        min_cfg = dataclasses.replace(cfg, **{k: getattr(parse_args(argv), k)
                                              for k in ("lr_scheduler_type", "lr_scheduler_kwargs")})
        optimizer, scheduler = setup.build_optimizer(min_cfg, policy)
        reference = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 8, 30, min_lr_rate=0.1)
        assert [scheduler.lr_lambdas[0](s) for s in range(31)] == [reference.lr_lambdas[0](s) for s in range(31)]
        assert scheduler.lr_lambdas[0](30) == pytest.approx(0.1), argv
    assert parse_args(["--scale-rewards", "true"]).scale_rewards == "group"
    assert parse_args(["--scale-rewards", "False"]).scale_rewards == "none"
    for argv in (["--warmup-ratio", "1.5"], ["--warmup-steps", "2.5"], ["--warmup-steps", "4", "--warmup-ratio", "0.1"],
                 ["--lr-scheduler-type", "reduce_lr_on_plateau"], ["--lr-scheduler-type", "cosine_with_min_lr"],
                 ["--lr-scheduler-kwargs", '{"min_lr_rate": 0.1}'], ["--lr-scheduler-kwargs", "[1]"],
                 ["--lr-scheduler-type", "constant", "--lr-scheduler-kwargs", '{"num_cycles": 2}'],
                 ["--lr-scheduler-type", "warmup_stable_decay"],
                 ["--num-iterations", "0"], ["--scale-rewards", "sometimes"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            parse_args(argv)
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert argv[0] in stderr


@pytest.mark.parametrize("schedule, arguments, refusal", [
    ("polynomial", '{"power": -1}', " fails after 3 of its 3 optimizer steps: ZeroDivisionError: 0.0 cannot be "
                                    "raised to a negative power"),
    ("inverse_sqrt", '{"timescale": -1}', " fails after 1 of its 3 optimizer steps: ZeroDivisionError"),
    ("inverse_sqrt", '{"timescale": 0}', " fails after 0 of its 3 optimizer steps: ZeroDivisionError"),
    ("polynomial", '{"lr_end": -1}', " gives the learning rate -0.333267 after 1 of its 3 optimizer steps: a rate "
                                     "must be a finite number >= 0"),
    ("cosine_with_min_lr", '{"min_lr_rate": NaN}', ": min_lr_rate must be a finite number"),
    ("cosine_warmup_with_min_lr", '{"min_lr": Infinity}', ": min_lr must be a finite number")])
def test_a_schedule_that_fails_at_any_step_is_refused_before_a_model_loads(schedule, arguments, refusal, capsys):
    """Claim: the schedule is evaluated at every step of the run, 0 to the rate after the last optimizer step, as
    options are read: an arithmetic error at any of them (a negative power at the step after the last, a timescale of
    0 as the schedule is built), a negative rate, and a non-finite argument (NaN is clamped to a rate of 0 at every
    step: a run that trains nothing) are one usage line naming the option and its value (they crashed the run at its
    end, or at its first step, or trained nothing without a word)."""
    argv = ["--iterations", "3", "--lr-scheduler-type", schedule, "--lr-scheduler-kwargs", arguments]
    with pytest.raises(SystemExit) as refused:
        parse_args(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"error: --lr-scheduler-type {schedule} with --lr-scheduler-kwargs {arguments}{refusal}" in err, err
    assert parse_args(["--iterations", "3", "--lr-scheduler-type", schedule, "--lr-scheduler-kwargs",
                       {"polynomial": '{"power": 2}', "inverse_sqrt": '{"timescale": 2}'}.get(schedule, '{"min_lr": 0}')
                       ]).lr_scheduler_type == schedule  # the same schedule, with arguments that work


def test_disable_dropout_zeroes_every_rate():
    """Claim (TRL's disable_dropout, on by default here): after setup.disable_dropout a model in training mode
    computes the same output twice, for dropout modules (GPT-2's nn.Dropout) and for rates read at forward time
    (Qwen2's attention_dropout, an attribute of each attention module; Persimmon's, read from its config); without it
    the outputs differ. A save writes the config's own rates (setup.config_as_loaded), and training goes on at 0."""
    from transformers import (GPT2Config, GPT2LMHeadModel, PersimmonConfig, PersimmonForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)
    torch.manual_seed(0)
    models = [GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)),
              Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                           num_key_value_heads=1, intermediate_size=32, vocab_size=50,
                                           attention_dropout=0.5, attn_implementation="eager")),
              PersimmonForCausalLM(PersimmonConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                   intermediate_size=32, vocab_size=50, attention_dropout=0.5,
                                                   hidden_dropout=0.0, bos_token_id=1, eos_token_id=2,
                                                   attn_implementation="eager"))]
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    for model in models:
        model.train()
        assert not torch.equal(model(ids).logits, model(ids).logits), "dropout must act for the test to bite"
        loaded = model.config.to_json_string()
        setup.disable_dropout(model)
        assert torch.equal(model(ids).logits, model(ids).logits)
        with setup.config_as_loaded(model):
            assert model.config.to_json_string() == loaded  # what a save writes: the model's own rates
        assert torch.equal(model(ids).logits, model(ids).logits)


def policy_entropies(policy, temperature: float) -> list[list[float]]:
    """Per response of RESPONSES, its tokens' entropies of softmax(logits / T), from one plain forward each."""
    found = []
    with torch.no_grad():
        for prompt, responses in zip(PROMPTS, RESPONSES):
            for response in responses:
                logits = policy(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1] / temperature  # (R, V)
                found.append((-(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)).tolist())
    return found


def test_entropy_leaves_out_the_masked_responses(tiny_model_dir):
    """Claim: under --mask-truncated-completions the entropy metric is the mean over the loss
    tokens only, as TRL's (its completion mask zeroes a truncated response, and the entropy is averaged under that
    mask): the 5 truncated responses of the 16 are left out. One update: every group is scored at
    θ_0, which the reference scores apart (float32 norms: the module docstring's rounding, rel 1e-6; the mean over
    every token is 3e-4 off)."""
    cfg = config(tiny_model_dir, "--temperature", "0.7", "--mask-truncated-completions")
    tri = tri_model(cfg, tiny_model_dir)
    policy = copy.deepcopy(tri.policy)
    metrics, _ = learner_run(cfg, tri, make_groups("group"))
    truncated = [len(r) == MAX_NEW and r[-1] != EOS for group in RESPONSES for r in group]
    kept = [h for h, cut in zip(policy_entropies(policy, 0.7), truncated) if not cut for h in h]
    everything = [h for response in policy_entropies(policy, 0.7) for h in response]
    mean, mean_of_all = sum(kept) / len(kept), sum(everything) / len(everything)
    assert sum(truncated) == 5 and abs(mean - mean_of_all) > 100 * 1e-6 * mean  # (3e-4 relative: not vacuous)
    assert metrics["entropy"] == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize("options", [["--beta", "0.04"], ["--beta", "0"], ["--scale-rewards", "group"]])
def test_completions_log_the_advantages_trained_on(tiny_model_dir, options):
    """Claim: --log-completions writes the advantage the learner trained on: with
    --scale-rewards batch the centred reward / (std(r_batch) + eps), for β > 0 (divided before the passes) and β = 0 (∇ divided at the step: the same update);
    scale_rewards group: the group's own. The learner's float32 against a float64 reference: rel 1e-6."""
    from infra.completions import records
    scale = "batch" if "--beta" in options else "group"
    cfg = config(tiny_model_dir, "--scale-rewards", scale, *options)
    tri = tri_model(cfg, tiny_model_dir)
    optimizer = torch.optim.SGD(tri.policy.parameters(), lr=0.1)
    learner = Learner(tri, optimizer, cfg, torch.device("cpu"), Timeline(), reward_names=["r"], stop_ids=[EOS])
    tri.start_iteration()
    learner.start(0)
    learn_iteration(learner, make_groups(scale))
    tokenizer = type("Tokenizer", (), {"decode": lambda self, ids, **kw: str(ids),
                                       "batch_decode": lambda self, batch, **kw: [str(ids) for ids in batch]})()
    logged = [record["advantage"] for record in records(0, learner.taken, tokenizer, ["r"])]
    rewards = torch.tensor(REWARDS, dtype=torch.float64)  # (4 groups, G)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    divisor = rewards.std() + 1e-4 if scale == "batch" else rewards.std(dim=1, keepdim=True) + 1e-4
    assert logged == pytest.approx((centred / divisor).flatten().tolist(), rel=1e-6, abs=1e-7)


def test_trainer_state_counts_every_pass_as_trl():
    """Claim: the trainer_state a batched reward gets counts TRL's optimizer steps, μ per
    mini-batch: before iteration k, k x updates-per-iteration x num-iterations, and max_steps is the
    run's, the schedule's length (launch/setup.build_optimizer)."""
    from infra.scoring import trainer_state
    cfg = parse_args(["--iterations", "10", "--updates-per-iteration", "2", "--num-iterations", "3"])
    state = trainer_state(cfg, 3, 32)
    assert (state.global_step, state.max_steps) == (3 * 2 * 3, 10 * 2 * 3)
    assert trainer_state(parse_args(["--iterations", "10"]), 3, 32).global_step == 3


# --- a TRL config file's keys (review: TRL files rarely ran as they were) ---
def parse_yaml(tmp_path, text, *argv):
    path = tmp_path / "trl.yaml"
    path.write_text("model: tiny\n" + text)
    return parse_args(["--config", str(path), *argv])


def refusal(capsys, call) -> str:
    """The one line `call` exits with, code 2."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    return err


def test_trl_bookkeeping_keys_are_skipped_with_a_line(tmp_path, capsys):
    """Claim: TrainingArguments' bookkeeping keys that change nothing here (run_name, logging_dir, log_level,
    remove_unused_columns, logging_strategy, overwrite_output_dir, ...) are skipped in a --config file with one line
    naming each and why; typed on the command line, as a TRL command line has them
    (--bf16, --logging-steps 10, --run-name x), they are skipped with the same kind of line."""
    keys = ("run_name: my-run\nlogging_dir: logs\nlog_level: info\nremove_unused_columns: false\n"
            "logging_strategy: steps\nlogging_first_step: true\noverwrite_output_dir: true\ndisable_tqdm: true\n")
    cfg = parse_yaml(tmp_path, keys + "num_generations: 4\nbatch_size: 16\n")
    assert (cfg.group_size, cfg.batch_size, cfg.overwrite) == (4, 16, False)
    out = capsys.readouterr().out
    assert len(skipped_lines(out)) == 1 and "ignored TRL's run_name: " in out, out
    assert all(f"{line.split(':')[0]}: " in out for line in keys.splitlines())
    typed = parse_args(["--bf16", "--logging_steps", "10", "--run-name=x", "--per-device-eval-batch-size", "4",
                        "--lr", "3e-6", "--push-to-hub"])
    assert typed.lr == 3e-6 and typed.dtype == parse_args([]).dtype
    line = capsys.readouterr().out.strip()
    assert line.startswith("periodic-rl: ignored TRL's --bf16: --dtype auto computes in bfloat16") and "\n" not in line
    assert all(f"{flag}: " in line for flag in ("--logging-steps", "--run-name", "--per-device-eval-batch-size",
                                                 "--push-to-hub")), line


def skipped_lines(out: str) -> list[str]:
    """The lines a --config file's reading printed, but the one that names our defaults it leaves (tested below)."""
    return [line for line in out.splitlines() if "defaults of this trainer that are not TRL's" not in line]


@pytest.mark.parametrize("text", ["use_vllm: false", "fp16: false", "optim: adamw_torch", "optim: adamw_torch_fused", "adam_beta1: 0.9",
                                  "adam_beta2: 0.999", "adam_epsilon: 1e-8"])
def test_trl_keys_at_what_this_trainer_does_are_skipped(text, tmp_path, capsys):
    """Claim: a TRL key at a value that is what this trainer does anyway (TRL's own defaults: use_vllm false, fp16
    false, optim adamw_torch(_fused): torch's AdamW, launch/setup.build_optimizer, at its
    default betas (0.9, 0.999) and eps 1e-8) is skipped with one line saying what this trainer
    does; the run is the one without it."""
    assert dataclasses.replace(parse_yaml(tmp_path, text + "\n"), config=None) == parse_args(["--model", "tiny"])
    out = capsys.readouterr().out
    assert len(skipped_lines(out)) == 1 and f"ignored TRL's {text.split(':')[0]} " in out, out


def test_trls_vllm_settings_are_skipped_without_use_vllm(tmp_path, capsys):
    """Claim: GRPOConfig's vLLM settings (vllm_mode, vllm_gpu_memory_utilization, ...), which TRL reads only with
    use_vllm true, are skipped in a --config file with one line naming them together (vllm_mode
    included); with use_vllm true the file is refused, naming use_vllm."""
    vllm = "vllm_mode: colocate\nvllm_gpu_memory_utilization: 0.3\nvllm_tensor_parallel_size: 1\n"
    cfg = parse_yaml(tmp_path, "use_vllm: false\n" + vllm)
    assert dataclasses.replace(cfg, config=None) == parse_args(["--model", "tiny"])
    out = capsys.readouterr().out
    assert len(skipped_lines(out)) == 1 and ("vllm_mode, vllm_gpu_memory_utilization, vllm_tensor_parallel_size: TRL reads "
                                      "vLLM's settings only with use_vllm true") in out, out
    assert "use_vllm: True is not what this trainer does" in refusal(capsys, lambda: parse_yaml(
        tmp_path, "use_vllm: true\n" + vllm))


@pytest.mark.parametrize("strategy", ["'no'", "no"])  # YAML 1.1 reads an unquoted no as false
def test_trl_strategy_no_turns_evaluation_and_checkpoints_off(strategy, tmp_path, capsys):
    """Claim: eval_strategy and save_strategy "no" are taken as TRL means them, --eval-every 0 (this trainer's
    default evaluates every 10 iterations) and --save-every 0, said in a line; eval_every in the file or on the
    command line wins, and the line says so, also with TRL's eval_steps beside the strategy."""
    cfg = parse_yaml(tmp_path, f"eval_strategy: {strategy}\nsave_strategy: {strategy}\nsave_steps: 7\n")
    assert (cfg.eval_every, cfg.save_every) == (0, 0)
    out = capsys.readouterr().out
    assert "took TRL's eval_strategy 'no' as --eval-every 0" in out and "save_strategy 'no' as --save-every 0" in out
    assert parse_yaml(tmp_path, f"eval_strategy: {strategy}\neval_every: 5\n").eval_every == 5
    assert "ignored TRL's eval_strategy: --eval-every is given" in capsys.readouterr().out
    assert parse_yaml(tmp_path, f"eval_strategy: {strategy}\neval_steps: 4\n", "--eval-every", "3").eval_every == 3
    assert "ignored TRL's eval_steps, eval_strategy: --eval-every is given" in capsys.readouterr().out


@pytest.mark.parametrize("text, fragment", [
    ("use_vllm: true", "use_vllm: True is not what this trainer does (sampling runs in this trainer's own engine"),
    ("fp16: true", "use --dtype bfloat16"),
    ("save_strategy: epoch", "use --save-every N"),
    ("optim: adafactor", "torch.optim.AdamW"),
    ("adam_beta2: 0.98", "adam_beta2: 0.98 is not what this trainer does (AdamW's betas are (0.9, 0.999)"),
    ("adam_epsilon: 1.0e-6", "no option changes it"),
])
def test_trl_keys_at_another_value_are_refused(text, fragment, tmp_path, capsys):
    """Claim: the same keys at a value this trainer does not do are refused in one line saying what it does and
    what to use instead (or that no option changes it: AdamW's betas and eps); typed on the command line they are
    refused too."""
    assert fragment in refusal(capsys, lambda: parse_yaml(tmp_path, text + "\n"))
    assert "--use-vllm is TRL's; here sampling runs" in refusal(capsys, lambda: parse_args(["--use-vllm"]))


# TRL 1.16's GRPOConfig, its own fields at their defaults (trl/trainer/grpo_config.py; a `GRPOConfig` written out)
GRPO_CONFIG_DEFAULTS = {'learning_rate': 1e-06, 'model_init_kwargs': None, 'trust_remote_code': False,
                        'router_aux_loss_coef': None, 'disable_dropout': False, 'cast_lm_head_to_fp32': False,
                        'remove_unused_columns': False, 'num_generations': 8, 'num_generations_eval': None,
                        'max_completion_length': 512, 'ds3_gather_for_generation': True, 'shuffle_dataset': True,
                        'pad_to_multiple_of': 'auto', 'generation_batch_size': None, 'steps_per_generation': None,
                        'temperature': 1.0, 'top_p': 1.0, 'top_k': 0, 'min_p': None, 'generation_kwargs': None,
                        'chat_template_kwargs': None, 'repetition_penalty': 1.0, 'cache_implementation': None,
                        'use_vllm': False, 'vllm_mode': 'colocate', 'vllm_model_impl': 'vllm',
                        'vllm_enable_sleep_mode': False, 'vllm_structured_outputs_regex': None,
                        'vllm_server_base_url': None, 'vllm_server_host': '0.0.0.0', 'vllm_server_port': 8000,
                        'vllm_server_timeout': 240.0, 'vllm_group_port': 51216, 'vllm_gpu_memory_utilization': 0.3,
                        'vllm_max_model_length': None, 'vllm_tensor_parallel_size': 1, 'beta': 0.0,
                        'num_iterations': 1, 'epsilon': 0.2, 'delta': None, 'epsilon_high': None,
                        'sapo_temperature_neg': 1.05, 'sapo_temperature_pos': 1.0, 'vespo_k_pos': 2.0,
                        'vespo_lambda_pos': 3.0, 'vespo_k_neg': 3.0, 'vespo_lambda_neg': 2.0,
                        'importance_sampling_level': 'token', 'reward_weights': None,
                        'multi_objective_aggregation': 'sum_then_normalize', 'scale_rewards': 'group',
                        'loss_type': 'dapo', 'mask_truncated_completions': False, 'sync_ref_model': False,
                        'ref_model_mixup_alpha': 0.6, 'ref_model_sync_steps': 512, 'top_entropy_quantile': 1.0,
                        'entropy_coef': 0.0, 'use_adaptive_entropy': False, 'entropy_coef_min': 0.0,
                        'entropy_coef_max': 1.0, 'entropy_coef_delta': 0.005, 'entropy_target': 0.2,
                        'max_tool_calling_iterations': None, 'vllm_importance_sampling_correction': True,
                        'vllm_importance_sampling_mode': 'sequence_mask', 'vllm_importance_sampling_clip_max': 3.0,
                        'vllm_importance_sampling_clip_min': None, 'off_policy_mask_threshold': None,
                        'use_bias_correction_kl': True, 'log_completions': False, 'log_multimodal': True,
                        'num_completions_to_print': None, 'log_unique_prompts': False,
                        'log_completions_hub_repo': None, 'use_transformers_continuous_batching': False,
                        'transformers_continuous_batching_config': None, 'use_transformers_paged': False,
                        'vllm_importance_sampling_cap': None}


def test_a_grpo_config_at_its_defaults_runs_as_it_is(tmp_path, capsys):
    """Claim: a --config file holding every field of TRL 1.16's GRPOConfig at TRL's default parses: each key is one of
    our options (under its name or TRL's), or is skipped with the one line naming it with why (a switch at the value
    this trainer does: repetition_penalty 1.0, importance_sampling_level 'token', sync_ref_model false, ...; a setting
    read only by what is off: sapo_*, entropy_coef_*; TRL's nulls that mean "derive it": generation_batch_size,
    steps_per_generation, num_generations_eval; epsilon_high null is epsilon's value, num_completions_to_print null
    is our 0, said in a second line; a third names our defaults that GRPOConfig's own fields leave, such as the seed,
    which TrainingArguments holds). The line names
    the ~58 keys without their reasons (which it gave for 8 or fewer: 3,000 characters here before), vLLM's 17 as
    vllm_*; a key read as one of our options (eval_strategy 'no': --eval-every 0) has a line of its own."""
    import json
    (tmp_path / "grpo.json").write_text(json.dumps(GRPO_CONFIG_DEFAULTS))
    cfg = parse_args(["--config", str(tmp_path / "grpo.json")])
    out = capsys.readouterr().out
    assert out.count("\n") == 3 and "--seed 0 (TRL: 42)" in out and "--beta" not in out.splitlines()[1], out
    ours = {field.name for field in dataclasses.fields(cfg)} | {"learning_rate", "num_generations", "epsilon",
                                                               "max_completion_length", "use_bias_correction_kl"}
    skipped = [key for key in GRPO_CONFIG_DEFAULTS if key not in ours]
    named = set(re.findall(r"\w+", out))  # whole words: "delta" is not named by "entropy_coef_delta"
    assert all(key in named or key.startswith("vllm_") for key in skipped), [key for key in skipped if key not in named]
    assert "vllm_* (17 keys)" in out and len(out.splitlines()[0]) < 1300, out
    (tmp_path / "grpo.json").write_text(json.dumps({**GRPO_CONFIG_DEFAULTS, "eval_strategy": "no"}))
    assert parse_args(["--config", str(tmp_path / "grpo.json")]).eval_every == 0
    assert "took TRL's eval_strategy 'no' as --eval-every 0" in capsys.readouterr().out
    assert (cfg.lr, cfg.beta, cfg.epsilon_low, cfg.epsilon_high, cfg.group_size, cfg.max_new_tokens) == \
        (1e-6, 0.0, 0.2, 0.2, 8, 512)
    assert cfg.num_completions_to_print == 0 and "num_completions_to_print null" in out
    (tmp_path / "grpo.json").write_text(json.dumps({**GRPO_CONFIG_DEFAULTS, "epsilon": 0.3}))
    cfg = parse_args(["--config", str(tmp_path / "grpo.json")])
    assert (cfg.epsilon_low, cfg.epsilon_high) == (0.3, 0.3)  # TRL: epsilon_high null is epsilon's value


@pytest.mark.parametrize("text, fragment", [
    ("importance_sampling_level: sequence", "importance_sampling_level: 'sequence' is not what this trainer does "
                                            "(token-level importance ratios"),
    ("repetition_penalty: 1.1", "no repetition penalty"),
    ("sync_ref_model: true", "use --beta 0 for none"),
    ("generation_kwargs: {top_k: 5}", "use --temperature, --top-p, --top-k, --min-p"),
    ("trust_remote_code: true", "a model's own code is not run"),
])
def test_grpo_switches_at_another_value_are_refused(text, fragment, tmp_path, capsys):
    """Claim: GRPOConfig's switches for what this trainer does not do (GSPO's sequence-level ratios, a repetition
    penalty, a moving reference, generate's other arguments, a model's own code) are refused at any other value in
    one line saying what this trainer does."""
    assert fragment in refusal(capsys, lambda: parse_yaml(tmp_path, text + "\n"))


@pytest.mark.parametrize("text, world, batch, updates", [
    ("per_device_train_batch_size: 4\ngradient_accumulation_steps: 8\n", 1, 32, 1),  # TRL: spg = accumulation
    ("per_device_train_batch_size: 16\n", 2, 32, 1),  # 2 processes (torchrun's WORLD_SIZE)
    ("per_device_train_batch_size: 4\ngradient_accumulation_steps: 2\nsteps_per_generation: 8\n", 1, 32, 4),
    ("per_device_train_batch_size: 8\ngeneration_batch_size: 64\n", 1, 64, 8),
    ("gradient_accumulation_steps: 2\n", 1, 16, 1),  # TRL's per-device default, 8
])
def test_trls_batch_keys_in_a_file_become_our_batch(text, world, batch, updates, tmp_path, capsys, monkeypatch):
    """Claim: TRL's batch keys in a --config file give the batch TRL would sample and the optimizer steps it would
    take on it, as GRPOConfig.__post_init__ derives them (generation batch = per_device x processes x
    steps_per_generation, steps_per_generation defaulting to gradient_accumulation_steps; one optimizer step per
    gradient_accumulation_steps of them), said in one line."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = parse_yaml(tmp_path, text + "num_generations: 8\n")
    assert (cfg.batch_size, cfg.updates_per_iteration) == (batch, updates)
    assert f"as --batch-size {batch} (TRL's generation batch)" in capsys.readouterr().out


def test_trls_batch_keys_give_way_or_are_refused(tmp_path, capsys):
    """Claim: with --batch-size given (in the file or typed) TRL's batch keys are skipped with a line saying so; where
    TRL refuses them (steps_per_generation and generation_batch_size together, unless they agree, as a GRPOConfig's
    to_dict() writes them; a batch that does not divide), or the
    steps would not divide into optimizer steps, or the trainer ranks are not the processes (--inference-ranks), the
    file is refused in one line."""
    assert parse_yaml(tmp_path, "per_device_train_batch_size: 4\nbatch_size: 64\n").batch_size == 64
    assert "ignored TRL's per_device_train_batch_size: --batch-size is given" in capsys.readouterr().out
    assert parse_yaml(tmp_path, "per_device_train_batch_size: 4\n", "--batch-size", "16").batch_size == 16
    capsys.readouterr()
    cfg = parse_yaml(tmp_path, "steps_per_generation: 4\nupdates_per_iteration: 2\n")  # ours wins, and is said to
    assert (cfg.batch_size, cfg.updates_per_iteration) == (32, 2)
    assert "as --batch-size 32 (TRL's generation batch) (--updates-per-iteration is given)" in capsys.readouterr().out
    cfg = parse_yaml(tmp_path, "steps_per_generation: 2\ngeneration_batch_size: 16\n")  # both, as to_dict() writes
    assert (cfg.batch_size, cfg.updates_per_iteration) == (16, 2)  # them: 8 per device x 1 process x 2 steps
    for text, fragment in [("steps_per_generation: 2\ngeneration_batch_size: 64\n", "are both set and disagree"),
                           ("per_device_train_batch_size: 6\ngeneration_batch_size: 64\n", "is not a multiple of"),
                           ("gradient_accumulation_steps: 4\nsteps_per_generation: 6\n", "give --batch-size and"),
                           ("per_device_train_batch_size: 4\ninference_ranks: 1\n", "with --inference-ranks give"),
                           ("per_device_train_batch_size: 0\n", "must be positive whole numbers"),
                           ("steps_per_generation: 4\nnum_generations: 16\n", "= 2 groups of num_generations 16, "
                                                                               "which 4 optimizer steps cannot share")]:
        assert fragment in refusal(capsys, lambda: parse_yaml(tmp_path, text)), text


@pytest.mark.parametrize("text, argv, batch, updates", [
    ("per_device_train_batch_size: 4\n", ["--gradient-accumulation-steps", "4"], 16, 1),  # TRL: both, 4 x 4
    ("num_generations: 4\n", ["--per-device-train-batch-size", "4"], 4, 1),  # the file's groups of 4, not our 8
    ("updates_per_iteration: 2\n", ["--steps-per-generation", "4"], 32, 2),  # the file's own steps stay
    ("per_device_train_batch_size: 16\ngradient_accumulation_steps: 2\n", ["--per_device_train_batch_size=4"], 8, 1),
])
def test_trls_batch_keys_typed_and_in_a_file_make_one_batch(text, argv, batch, updates, tmp_path):
    """Claim: TRL's batch keys typed and in a --config file are translated together, as TRL takes them from its
    command line and its config file (a typed key wins over the file's), with the file's num_generations and
    updates_per_iteration: the same batch as TRL's."""
    cfg = parse_yaml(tmp_path, text, *argv)
    assert (cfg.batch_size, cfg.updates_per_iteration) == (batch, updates)


@pytest.mark.parametrize("argv, batch, updates, said", [
    (["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "8"], 32, 1, "as --batch-size 32"),
    (["--per-device-train-batch-size=4", "--steps-per-generation", "8", "--gradient-accumulation-steps", "2"], 32, 4,
     "8 / gradient_accumulation_steps 2 as --updates-per-iteration 4"),
    (["--gradient-accumulation-steps", "2", "--batch-size", "64"], 64, 1, "ignored TRL's gradient_accumulation_steps: "
                                                                         "--batch-size is given"),
])
def test_trls_batch_flags_typed_become_our_batch(argv, batch, updates, said, capsys):
    """Claim: TRL's batch flags typed as TRL's CLI takes them (either spelling, `=` or a separate value) give the batch
    and optimizer steps a --config file's do (TRL's generation batch), said in one line; a typed --batch-size wins.
    Bad values end in one line, exit 2: not a whole number, no value, a batch of partial groups."""
    cfg = parse_args(argv)
    assert (cfg.batch_size, cfg.updates_per_iteration) == (batch, updates)
    assert said in capsys.readouterr().out
    for bad, fragment in [(["--per-device-train-batch-size", "x"], "takes a whole number (got 'x')"),
                          (["--steps-per-generation"], "needs a value"),
                          (["--per-device-train-batch-size", "12"], "12 completions per batch, not a multiple of "
                                                                    "num_generations 8")]:
        assert fragment in refusal(capsys, lambda: parse_args(bad)), bad


def test_transformers_trainer_settings_at_their_defaults_are_skipped(tmp_path, capsys):
    """Claim: TrainingArguments' settings for transformers' Trainer that a TRL config carries (do_eval, use_liger_kernel,
    dataloader_num_workers, ...) are skipped at their defaults (read from the installed transformers) with one line,
    and refused at another value in one line naming each; TRL's ModelConfig keys at their defaults are skipped too
    (model_revision main, load_in_4bit false, ...) and torch_dtype is dtype."""
    cfg = parse_yaml(tmp_path, "tf32: null\nuse_liger_kernel: false\ntorch_compile: false\n"
                               "model_revision: main\nload_in_4bit: false\ntorch_dtype: float32\n")
    assert cfg.dtype == "float32"
    out = capsys.readouterr().out
    assert "ignored transformers' TrainingArguments tf32, use_liger_kernel: " \
           "at their defaults" in out and "model_revision 'main'" in out, out
    assert "torch_compile: compiling the training side is --compile-train" in out  # true is taken (below)
    assert parse_yaml(tmp_path, "eval_strategy: steps\ndo_eval: true\n").eval_every == 10  # as TrainingArguments
    capsys.readouterr()  # sets it
    err = refusal(capsys, lambda: parse_yaml(tmp_path, "use_liger_kernel: true\n"))
    assert "use_liger_kernel: True is a setting of transformers' Trainer" in err
    assert "hf download MODEL --revision R" in refusal(capsys, lambda: parse_yaml(tmp_path, "model_revision: v2\n"))


def test_reward_funcs_is_trls_name_for_reward(tmp_path, capsys):
    """Claim: TRL's CLI name reward_funcs is --reward, a string or a list of them, in a file or typed, and TRL's
    spelling package.module.function of a reward loads as package.module:function; reward and reward_funcs
    together are refused as naming the same option."""
    from infra.reward import load_reward, math_reward
    assert parse_yaml(tmp_path, "reward_funcs: math-verify\n").reward == ["math-verify"]
    cfg = parse_yaml(tmp_path, "reward_funcs: [math, math-verify]\n")
    assert (cfg.reward, cfg.reward_weights) == (["math", "math-verify"], [1.0, 1.0])
    assert parse_args(["--reward-funcs", "math", "math-verify"]).reward == ["math", "math-verify"]
    assert load_reward("infra.reward.math_reward") is load_reward("infra.reward:math_reward") is math_reward
    assert "reward and reward_funcs name the same option" in \
        refusal(capsys, lambda: parse_yaml(tmp_path, "reward: [math]\nreward_funcs: [math]\n"))


def test_dataset_test_split_is_trls_name_for_eval_split(tmp_path):
    """Claim: TRL's dataset_test_split (the split evaluated on) is --eval-split, typed with - or _ or as a --config
    key; not given, the held-out split is chosen from the data."""
    assert parse_args(["--dataset_test_split", "validation"]).eval_split == "validation"
    assert parse_args(["--dataset-test-split", "dev"]).eval_split == "dev"
    assert parse_yaml(tmp_path, "dataset_test_split: validation\n").eval_split == "validation"
    assert parse_args([]).eval_split is None


@pytest.mark.parametrize("key", ["logging_strategyx", "reward_model_name_or_path", "ddp_timeoutx", "lora_task_kind",
                                 "vllm_enable_prefix_cachingx", "save_on_each_rank"])
def test_an_unknown_key_gets_no_far_fetched_hint(key, tmp_path, capsys):
    """Claim: an unknown key or option that is no misspelling of one of ours gets no "did you mean"; a real misspelling still gets its name."""
    err = refusal(capsys, lambda: parse_yaml(tmp_path, f"{key}: 1\n"))
    assert f"unknown option {key} (the keys are" in err and "did you mean" not in err, err
    err = refusal(capsys, lambda: parse_args([f"--{key}", "1"]))
    assert f"unrecognized option --{key.replace('_', '-')} (see --help)" in err, err
    assert "did you mean max_new_tokens?" in refusal(capsys, lambda: parse_yaml(tmp_path, "max_new_token: 3\n"))
    assert "did you mean --num-iterations?" in refusal(capsys, lambda: parse_args(["--nun-iterations", "2"]))


@pytest.mark.parametrize("argv, expected", [
    (["--gradient_checkpointing", "true", "--log_completions", "True"], (True, True, True)),
    (["--gradient-checkpointing=false", "--disable_dropout", "no"], (False, False, False)),
    (["--gradient-checkpointing", "--log-completions", "1", "--disable-dropout=off"], (True, True, False)),
    (["--no-gradient-checkpointing", "--no-log-completions"], (False, False, True)),
])
def test_yes_no_options_take_trls_true_and_false(argv, expected):
    """Claim: a yes/no option takes a value as TRL's launch scripts write it (`--gradient_checkpointing true`,
    transformers' HfArgumentParser: true/false, yes/no, 1/0, any case), besides --name and --no-name."""
    cfg = parse_args(argv)
    assert (cfg.gradient_checkpointing, cfg.log_completions, cfg.disable_dropout) == expected


@pytest.mark.parametrize("argv, fragment", [
    (["--gradient-checkpointing", "maybe"], "--gradient-checkpointing takes true or false, or no value (got 'maybe')"),
    (["--no-log-completions", "true"], "--no-log-completions takes no value (got 'true')"),
])
def test_a_yes_no_option_with_another_value_is_one_line(argv, fragment, capsys):
    """Claim: any other value, or a value after --no-name, is refused in one line (exit 2) naming the option."""
    assert fragment in refusal(capsys, lambda: parse_args(argv))


def whole_grpo_config() -> dict:
    """A GRPOConfig written out whole, as TRL 1.16's `GRPOConfig(output_dir=...).to_dict()` does: transformers'
    TrainingArguments at the installed version's defaults, TRL's base config's own defaults over them
    (trl/trainer/base_config.py: logging_steps 10, gradient_checkpointing true, bf16 true after its __post_init__),
    then GRPOConfig's fields (GRPO_CONFIG_DEFAULTS)."""
    import json

    from transformers import TrainingArguments
    values = {}
    for field in dataclasses.fields(TrainingArguments):
        if field.init:
            default = (field.default if field.default is not dataclasses.MISSING else field.default_factory()
                       if field.default_factory is not dataclasses.MISSING else None)
            try:
                json.dumps(default)
            except TypeError:
                default = str(default)
            values[field.name] = default
    return {**values, "logging_steps": 10, "gradient_checkpointing": True, "bf16": True, "lr_scheduler_kwargs": None,
            "use_liger_kernel": False, "torch_empty_cache_steps": None, **GRPO_CONFIG_DEFAULTS, "output_dir": "out"}


def test_a_whole_grpo_config_written_out_runs_as_it_is(tmp_path, capsys):
    """Claim: a GRPOConfig written out whole (~190 keys: transformers' TrainingArguments under it too) parses: the
    Trainer's settings at their defaults are counted in one line (not named: ~80 of them), TRL's keys that mean
    something else here are ignored at their defaults (max_steps -1: unset, eval_steps null under eval_strategy
    'no'), num_train_epochs 3.0 is three passes over the data, as in TRL, and TrainingArguments' default
    save_strategy 'steps' with save_steps 500 is read as --save-every 500 (one optimizer step per iteration here),
    said in a line."""
    import json
    (tmp_path / "grpo.json").write_text(json.dumps(whole_grpo_config()))
    cfg = parse_args(["--config", str(tmp_path / "grpo.json")])
    out = capsys.readouterr().out
    assert (cfg.save_every, cfg.gradient_checkpointing, cfg.group_size, cfg.max_new_tokens) == (500, True, 8, 512)
    assert cfg.num_train_epochs == 3.0
    assert "took TRL's save_strategy 'steps', save_steps 500 as --save-every 500, of 1 optimizer step each" in out
    assert max(len(line) for line in out.splitlines()) < 2000, out  # the ~88 TRL keys named, without reasons
    assert "defaults of this trainer that are not TRL's" not in out  # the file sets every one of them


def test_a_grpo_config_dumped_by_to_dict_runs_as_it_is(tmp_path, capsys):
    """Claim: what `GRPOConfig(...).to_dict()` writes, transformers' TrainingArguments after its __post_init__ (on the
    installed transformers: CI runs this on 5.x and on the 4.56 floor) under GRPOConfig's fields, parses: the values
    __post_init__ fills in (local_rank 0, accelerator_config's and fsdp_config's settings, activation_checkpointing
    false, average_tokens_across_devices) and the masked tokens ('<HUB_TOKEN>') are ignored with the other keys of
    no use here, report_to [] is 'none', and generation_batch_size beside steps_per_generation (both derived) is the
    batch they agree on; activation_checkpointing, transformers 5's name for gradient_checkpointing, which to_dict()
    writes beside it, is --gradient-checkpointing. (Checked against TRL 1.16's own
    GRPOConfig(...).to_dict(), trl installed from its wheel.)"""
    import json

    from transformers import TrainingArguments
    dumped = {**TrainingArguments(output_dir=str(tmp_path / "out")).to_dict(), **GRPO_CONFIG_DEFAULTS,
              "output_dir": str(tmp_path / "out"), "generation_batch_size": 8, "steps_per_generation": 1,
              "gradient_checkpointing": True, "activation_checkpointing": True}  # TRL's base config: True
    assert dumped.get("hub_token") == "<HUB_TOKEN>"  # what to_dict writes in place of a token
    (tmp_path / "dumped.json").write_text(json.dumps(dumped))
    cfg = parse_args(["--config", str(tmp_path / "dumped.json")])
    assert (cfg.out, cfg.save_every, cfg.eval_every, cfg.num_train_epochs) == (str(tmp_path / "out"), 500, 0, 3.0)
    assert (cfg.batch_size, cfg.updates_per_iteration, cfg.gradient_checkpointing) == (8, 1, True)
    assert cfg.report_to == (["none"] if dumped["report_to"] in ([], "none", ["none"]) else dumped["report_to"])
    out = capsys.readouterr().out
    assert "hub_token" in out and "local_rank" in out and "accelerator_config" in out, out
    assert parse_yaml(tmp_path, "activation_checkpointing: true\n").gradient_checkpointing
    assert "activation_checkpointing and gradient_checkpointing name the same option" in refusal(
        capsys, lambda: parse_yaml(tmp_path, "activation_checkpointing: true\ngradient_checkpointing: false\n"))


def test_trls_own_grpo_config_dump_runs_as_it_is(tmp_path, capsys):
    """Claim: TRL's own `GRPOConfig(...).to_dict()` (where trl is installed; CI's set-up has none) runs with what it
    sets: max_steps 20 as 20 iterations (1 optimizer step each), the batch its keys make, save_steps, the learning
    rate and the group size, evaluation off, its num_train_epochs giving way to max_steps."""
    trl = pytest.importorskip("trl")
    import json
    config = trl.GRPOConfig(output_dir=str(tmp_path / "out"), learning_rate=1e-5, num_generations=4,
                            per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=20, save_steps=10,
                            bf16=False)
    (tmp_path / "grpo.json").write_text(json.dumps(config.to_dict()))
    cfg = parse_args(["--config", str(tmp_path / "grpo.json")])
    assert (cfg.iterations, cfg.batch_size, cfg.updates_per_iteration, cfg.save_every, cfg.eval_every, cfg.lr,
            cfg.group_size, cfg.num_train_epochs) == (20, 16, 1, 10, 0, 1e-5, 4, None)
    assert "ignored TRL's num_train_epochs 3.0: max_steps sets the run's length" in capsys.readouterr().out


def test_a_trl_file_is_told_which_of_our_defaults_it_runs_with(tmp_path, capsys):
    """Claim: a TRL config file that leaves out an option whose default here is not TRL's and changes what the run
    learns or costs (beta 0.04 against 0.0, seed, dropout, checkpointing, evaluation) gets one line naming each with
    both values, since the run would silently differ from the same file under TRL; save_steps without save_strategy
    is TRL's default strategy, 'steps': a checkpoint every save_steps (a reviewer's file with save_steps 500 kept no
    checkpoint, said to "change nothing"). A file of our own option names, and the options set, are not named."""
    (tmp_path / "trl.yaml").write_text("num_generations: 4\nlearning_rate: 1.0e-5\nsave_steps: 50\nseed: 42\n")
    cfg = parse_args(["--config", str(tmp_path / "trl.yaml"), "--eval-every", "0"])
    out = capsys.readouterr().out
    assert cfg.save_every == 50 and "save_steps 50 as --save-every 50, of 1 optimizer step each" in out
    line = next(line for line in out.splitlines() if "defaults of this trainer that are not TRL's" in line)
    for fragment in ("--beta 0.04 (TRL: 0.0)", "--gradient-checkpointing off (TRL: on)", "--disable-dropout on "
                     "(TRL: off)", "--batch-size 128"):
        assert fragment in line, (fragment, line)
    assert "--seed" not in line and "--eval-every" not in line and "--save-every" not in line, line
    (tmp_path / "ours.yaml").write_text("group_size: 4\nlr: 1.0e-5\n")
    parse_args(["--config", str(tmp_path / "ours.yaml")])
    assert "defaults of this trainer" not in capsys.readouterr().out
    (tmp_path / "fraction.yaml").write_text("num_generations: 4\nsave_steps: 0.1\n")  # transformers: 10% of the run
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "fraction.yaml")])
    said = capsys.readouterr()
    assert "save_steps 0.1 (a fraction of the run's steps) has no equivalent here" in said.err
    assert "defaults of this trainer" not in said.out  # a refused file is not described


def test_every_refused_key_of_a_file_is_said_at_once(tmp_path, capsys):
    """Claim: a --config file's refused keys are all named in its one error line: a TRL switch at a value this
    trainer does not do, a setting of transformers' Trainer at another value than its default, a TRL name that means
    something else here at another value than TRL's default, and an unknown key."""
    text = ("model: tiny\nuse_vllm: true\nlabel_smoothing_factor: 0.1\nnum_generations_eval: 4\n"
            "use_liger_loss_typo: false\n")
    (tmp_path / "trl.yaml").write_text(text)
    err = refusal(capsys, lambda: parse_args(["--config", str(tmp_path / "trl.yaml")]))
    assert "4 keys refused: " in err, err
    for fragment in ("use_vllm: True is not what this trainer does", "label_smoothing_factor: 0.1 is a setting of "
                     "transformers' Trainer", "num_generations_eval is TRL's and means something else here",
                     "unknown option use_liger_loss_typo"):
        assert fragment in err, (fragment, err)


def test_report_to_all_is_every_installed_tracker(monkeypatch, capsys):
    """Claim: TRL's --report_to all reports to each tracker whose package is installed (here tensorboard, a
    requirement; wandb and trackio when present), and to none when none is; it cannot be combined with a name."""
    import importlib.util

    from infra.tracking import TRACKERS
    installed = [name for name, kind in TRACKERS.items() if importlib.util.find_spec(kind.package)]
    assert "tensorboard" in installed and parse_args(["--report_to", "all"]).report_to == installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    assert parse_args(["--report-to", "all"]).report_to == ["none"]
    assert "--report-to all cannot be combined" in refusal(capsys, lambda: parse_args(["--report-to", "all", "wandb"]))


def test_num_train_epochs_counts_the_runs_iterations_from_the_data(tmp_path, capsys):
    """Claim (TRL's num_train_epochs, in every open-r1 recipe): --num-train-
    epochs E makes the run ceil(E x train prompts / prompts per iteration) iterations, counted once the data is
    loaded and said in the first line; typed with --iterations it is one usage line; a config file's epochs give way
    to a typed --iterations (TRL's max_steps wins over num_train_epochs), said in a line, and a file's --iterations
    to typed epochs; a run record's iterations, which its epochs counted, are counted again from them."""
    import trainer
    cfg = parse_args(["--num-train-epochs", "0.5", "--batch-size", "16", "--group-size", "4", "--eval-every", "0"])
    prepared, task, _, _ = trainer.prepare(cfg)
    assert prepared.iterations == math.ceil(0.5 * len(task.train) / 4) and len(task.train) > 100
    assert f"--num-train-epochs 0.5: {prepared.iterations} iterations" in task.notes
    assert "both set the run's length: give one" in refusal(capsys, lambda: parse_args(
        ["--num-train-epochs", "1", "--iterations", "3"]))
    (tmp_path / "trl.yaml").write_text("num_train_epochs: 1\n")
    typed = parse_args(["--config", str(tmp_path / "trl.yaml"), "--iterations", "5"])
    assert (typed.iterations, typed.num_train_epochs) == (5, None)
    assert "num_train_epochs: --iterations, given, sets the run's length instead" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({**dataclasses.asdict(prepared), "run_id": "r"}))
    from infra.command_line import file_arguments
    flags = file_arguments(str(tmp_path / "config.json"))
    assert "--num-train-epochs=0.5" in flags and not any(flag.startswith("--iterations") for flag in flags)
    rerun = parse_args(["--config", str(tmp_path / "config.json"), "--iterations", "10"])  # typed wins over both
    assert (rerun.iterations, rerun.num_train_epochs) == (10, None)
    (tmp_path / "length.yaml").write_text("iterations: 7\n")
    by_epochs = parse_args(["--config", str(tmp_path / "length.yaml"), "--num-train-epochs", "1"])
    assert by_epochs.num_train_epochs == 1  # typed epochs win over a file's --iterations
    capsys.readouterr()


def test_a_run_by_epochs_trains_its_counted_iterations_and_saves_the_policy(tiny_model_dir, tmp_path, capsys):
    """Claim: a run given --num-train-epochs trains the iterations counted from its data, not --iterations' default
    60, to the end: one metrics row per counted iteration, then the final row and the policy saved (a sync run:
    trainer.main in this process). (Its saving once read the unprepared options: a run of fewer than 60 iterations
    saved no policy.)"""
    import json

    import trainer
    out = tmp_path / "run"
    code = trainer.main(["--model", str(tiny_model_dir), "--data", "arithmetic", "--num-train-epochs", "0.002",
                         "--batch-size", "8", "--group-size", "4", "--max-new-tokens", "4", "--eval-every", "0",
                         "--mode", "sync", "--groups-per-call", "2", "--micro-batch-tokens", "16384",
                         "--rollout-threads", "1", "--train-threads", "1", "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    counted = json.loads((out / "config.json").read_text())["iterations"]
    assert counted == math.ceil(0.002 * 2255 / 2) and "--num-train-epochs 0.002: 3 iterations" in stdout
    assert [row["iteration"] for row in rows if not row.get("final")] == list(range(counted))
    assert (out / "policy" / "config.json").exists() and "policy in" in stdout


def test_overwrite_output_dir_is_explained_among_many_ignored_keys():
    """Claim: among more keys than get their reasons (a whole GRPOConfig file), overwrite_output_dir true still gets
    its own: a file never replaces a run, so the run may stop at a full --out, and the line says why."""
    from infra.trl_config import SAY_WHY_UP_TO, unused_line
    from infra.trl_names import TRL_UNUSED
    many = dict.fromkeys([key for key in TRL_UNUSED if key != "overwrite_output_dir"][:SAY_WHY_UP_TO + 1], 1)
    line = unused_line({**many, "overwrite_output_dir": True})
    assert line.endswith("; TRL's overwrite_output_dir: a run in --out is refused, not written over; --overwrite, "
                         "typed, replaces it (deleting its checkpoints and policy, which transformers' flag never "
                         "did)") and f"ignored {SAY_WHY_UP_TO + 1} of TRL's keys" in line
    assert "overwrite_output_dir" not in unused_line({**many, "overwrite_output_dir": False}).split("(why")[1]


def test_what_rewards_log_with_log_metric_is_in_the_row(tiny_model_dir):
    """Claim: the values TRL-style rewards logged with TRL's log_metric while scoring the iteration's groups are in its
    row, each name's mean over every call (TRL: the mean over a logging step), whatever order the groups arrived in;
    a name that is one of the row's own keys gives way to it."""
    import dataclasses
    cfg = config(tiny_model_dir)
    groups = make_groups("group")
    logged = [{"judge/score": [1.0, 2.0]}, {}, {"judge/score": [6.0], "kl": [99.0]}, {"other": [0.5]}]
    groups = [dataclasses.replace(group, logged=values) for group, values in zip(groups, logged)]
    metrics, _ = learner_run(cfg, tri_model(cfg, tiny_model_dir), groups[::-1])
    assert metrics["judge/score"] == 3.0 and metrics["other"] == 0.5 and metrics["kl"] != 99.0


def test_trls_resume_from_checkpoint_true_is_auto():
    """Claim: TRL's --resume-from-checkpoint true (resume from the newest checkpoint in the output folder) is
    --resume auto, false is no resume, and a path stays a path (true was taken as a directory named "true")."""
    assert parse_args(["--resume_from_checkpoint", "true", "--out", "o"]).resume == "auto"
    assert parse_args(["--resume-from-checkpoint", "False"]).resume is None
    assert parse_args(["--resume", "runs/x/checkpoint-3"]).resume == "runs/x/checkpoint-3"


def test_trls_max_steps_is_the_runs_optimizer_steps(tmp_path, capsys):
    """Claim (TRL's max_steps, save_steps and eval_steps count optimizer steps): --max-steps N runs N / (--updates-per-iteration x --num-iterations) iterations, so the learning-rate
    schedule, and the TrainerState a reward sees, has TRL's N optimizer steps; said in a line. A count that is not a
    whole number of iterations is one line naming the two nearest that are; typed beside --iterations it is one line,
    beside --num-train-epochs it wins, as in TRL; a bare --max-steps is one line."""
    from infra.options import schedule_lengths
    cfg = parse_args(["--max-steps", "40", "--updates-per-iteration", "4", "--batch-size", "32", "--group-size", "4"])
    assert cfg.iterations == 10 and schedule_lengths(cfg)[1] == 40
    assert "took TRL's max_steps 40 as --iterations 10, of 4 optimizer steps each (--updates-per-iteration 4 x " \
           "--num-iterations 1)" in capsys.readouterr().out
    cfg = parse_args(["--max_steps=12", "--num-iterations", "3"])
    assert cfg.iterations == 4 and schedule_lengths(cfg)[1] == 12
    assert "give --max-steps 8 or 12, or --iterations" in refusal(capsys, lambda: parse_args(
        ["--max-steps", "10", "--updates-per-iteration", "4", "--batch-size", "32", "--group-size", "4"]))
    assert "give --max-steps 4, or --iterations" in refusal(capsys, lambda: parse_args(
        ["--max-steps", "3", "--num-iterations", "4"]))
    assert "both set the run's length: give one" in refusal(capsys, lambda: parse_args(["--max-steps", "6",
                                                                                        "--iterations", "3"]))
    cfg = parse_args(["--max-steps", "6", "--num-train-epochs", "1"])  # TRL's max_steps wins, typed too
    assert (cfg.iterations, cfg.num_train_epochs) == (6, None)
    assert "ignored --num-train-epochs 1: --max-steps sets the run's length, as in TRL" in capsys.readouterr().out
    assert "--max-steps needs a number of optimizer steps" in refusal(capsys, lambda: parse_args(["--max-steps"]))
    assert "max_steps takes a number of optimizer steps (got 'x')" in refusal(capsys, lambda: parse_args(
        ["--max-steps", "x"]))


def test_trls_max_steps_in_a_file_beats_its_epochs_and_gives_way_to_a_typed_length(tmp_path, capsys):
    """Claim: in a --config file max_steps wins over num_train_epochs, as in TRL (a GRPOConfig written out holds
    num_train_epochs 3.0 beside the max_steps that sets its run), said in a line, and is counted in the optimizer
    steps the file's TRL batch keys make (steps_per_generation 4 / gradient_accumulation_steps 2 = 2 per iteration);
    a typed --iterations wins over it, and a typed --max-steps over the file's iterations; max_steps beside
    iterations in the same file is one line; -1 (TrainingArguments' default) is unset."""
    text = ("num_train_epochs: 3.0\nmax_steps: 100\nper_device_train_batch_size: 8\ngradient_accumulation_steps: 2\n"
            "steps_per_generation: 4\nnum_generations: 8\n")
    cfg = parse_yaml(tmp_path, text)
    out = capsys.readouterr().out
    assert (cfg.iterations, cfg.num_train_epochs, cfg.updates_per_iteration, cfg.batch_size) == (50, None, 2, 32)
    assert "ignored TRL's num_train_epochs 3.0: max_steps sets the run's length, as in TRL" in out
    assert "max_steps 100 as --iterations 50, of 2 optimizer steps each" in out
    assert "--iterations 60" not in out  # the departures line does not call the run's length ours
    assert parse_yaml(tmp_path, "max_steps: 100\n", "--iterations", "5").iterations == 5
    assert "ignored TRL's max_steps 100: --iterations, given, sets the run's length instead" in capsys.readouterr().out
    assert parse_yaml(tmp_path, "iterations: 100\nnum_train_epochs: 2\n", "--max-steps", "8").iterations == 8
    assert "max_steps 100 and iterations 3 both set the run's length: keep one" in refusal(
        capsys, lambda: parse_yaml(tmp_path, "max_steps: 100\niterations: 3\n"))
    assert parse_yaml(tmp_path, "max_steps: -1\n").iterations == 60


def test_trls_save_and_eval_steps_are_whole_iterations(tmp_path, capsys):
    """Claim: save_steps and eval_steps (under their strategy 'steps'; save_steps alone is transformers' default
    strategy) are --save-every and --eval-every in iterations of updates x passes optimizer steps, rounded up where
    a count falls inside an iteration (a checkpoint or an evaluation comes at an iteration's end), said in a line;
    eval_strategy 'steps' without eval_steps evaluates every logging_steps (transformers' rule; TRL's 10); eval_steps
    without a strategy is ignored with a line (transformers evaluates only under one); 'epoch', and a fraction of
    the run, are one line."""
    cfg = parse_args(["--num-iterations", "2", "--save-steps", "5", "--eval-strategy", "steps", "--eval-steps", "4"])
    out = capsys.readouterr().out
    assert (cfg.save_every, cfg.eval_every) == (3, 2)
    assert "save_steps 5 as --save-every 3, of 2 optimizer steps each (--updates-per-iteration 1 x --num-iterations " \
           "2) (save_steps 5 falls inside an iteration: rounded up to its end)" in out
    assert "eval_steps 4 as --eval-every 2" in out and "eval_steps 4 falls" not in out
    assert parse_args(["--eval-strategy", "steps", "--logging-steps", "5"]).eval_every == 5
    assert "eval_steps 5 (TRL's default: logging_steps) as --eval-every 5" in capsys.readouterr().out
    assert parse_yaml(tmp_path, "eval_strategy: steps\n").eval_every == 10
    assert parse_yaml(tmp_path, "eval_steps: 3\n").eval_every == 10
    assert "ignored TRL's eval_steps: TRL reads it only with eval_strategy 'steps'" in capsys.readouterr().out
    assert parse_yaml(tmp_path, "eval_strategy: epoch\n").eval_every_epoch
    assert "use --save-every N, or save_strategy 'steps' with save_steps" in refusal(
        capsys, lambda: parse_yaml(tmp_path, "save_strategy: epoch\n"))
    assert "--save-steps 0.1 (a fraction of the run's steps) has no equivalent here" in refusal(
        capsys, lambda: parse_args(["--save-steps", "0.1"]))


def test_trls_step_counts_against_a_file_a_record_and_a_resume(tmp_path, capsys):
    """Claim: a typed TRL count wins over a --config file's option for the same thing (a run
    record always holds save_every and eval_every: a typed --save-steps was ignored); a typed --max-steps -1 is TRL's
    "unset", so the file's num_train_epochs set the run, not its max_steps; eval_strategy 'steps' in a file without
    eval_steps evaluates every logging_steps; a resumed run counts in its checkpoint's optimizer steps per
    iteration, not those of the command line (4 here: --max-steps 800 was 800 iterations, not 200); an infinite
    count is one line, not a traceback."""
    record = tmp_path / "config.json"
    record.write_text(json.dumps({"run_id": "x", "model": "tiny", "save_every": 5, "eval_every": 10,
                                  "iterations": 20}))
    cfg = parse_args(["--config", str(record), "--save-steps", "100", "--eval-strategy", "no"])
    assert (cfg.save_every, cfg.eval_every, cfg.iterations) == (100, 0, 20)
    assert parse_yaml(tmp_path, "save_every: 5\nsave_steps: 100\n").save_every == 5  # in one file: ours wins
    assert "ignored TRL's save_steps: --save-every is given" in capsys.readouterr().out
    cfg = parse_yaml(tmp_path, "max_steps: 100\nnum_train_epochs: 3\n", "--max-steps=-1")
    assert (cfg.num_train_epochs, cfg.iterations) == (3, 60)  # 60: counted from the data once it is read
    assert parse_yaml(tmp_path, "eval_strategy: steps\nlogging_steps: 5\n").eval_every == 5
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "state.json").write_text(json.dumps(
        {"iterations_done": 2, "config": {"updates_per_iteration": 4, "num_iterations": 1}}))
    cfg = parse_args(["--resume", "auto", "--out", str(run), "--max-steps", "800", "--save-steps", "100"])
    assert (cfg.iterations, cfg.save_every) == (200, 25)
    assert "max_steps 800 as --iterations 200, of 4 optimizer steps each" in capsys.readouterr().out
    for argv in (["--max-steps", "1e400"], ["--max-steps", "inf"]):
        assert "max_steps takes a number of optimizer steps" in refusal(capsys, lambda: parse_args(argv))
    assert "max_steps takes a number of optimizer steps" in refusal(capsys, lambda: parse_yaml(
        tmp_path, "max_steps: .inf\n"))


def test_trl_flags_typed_at_what_this_trainer_does_run(capsys):
    """Claim: as in a file, a TRL switch typed at what this
    trainer does (--use_vllm false, --optim adamw_torch, --adam-beta1 0.9) is ignored with a line, as in a file;
    at another value it is one line; --bf16 false, typed or in a file, is --dtype float32, as TRL computes then;
    a --dtype given wins."""
    assert parse_args(["--use_vllm", "false", "--optim", "adamw_torch", "--adam-beta1", "0.9"]).iterations == 60
    out = capsys.readouterr().out
    assert "ignored TRL's --use-vllm False: here sampling runs" in out and "--adam-beta1 0.9" in out, out
    assert "--use-vllm is TRL's; here sampling runs" in refusal(capsys, lambda: parse_args(["--use-vllm", "true"]))
    assert parse_args(["--bf16", "false", "--device", "cpu"]).dtype == "float32"
    assert "took TRL's --bf16 false as --dtype float32" in capsys.readouterr().out
    assert parse_args(["--bf16=False", "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert parse_args(["--bf16", "--dtype", "bfloat16"]).dtype == "bfloat16"
    # TRL's numeric defaults typed as 0 and 1, a typed
    # --bf16 over a file's bf16 false, a --bf16 typo, and an option after --bf16 that is not its value
    assert parse_args(["--entropy-coef", "0", "--repetition-penalty", "1"]).iterations == 60
    assert "--entropy-coef 0: here no entropy bonus" in capsys.readouterr().out
    assert "--bf16 takes true or false" in refusal(capsys, lambda: parse_args(["--bf16", "fals"]))
    assert typed_trl(["--bf16", "-h"], TRL_UNUSED) == ({"bf16": True}, ["-h"])
    assert typed_trl(["--max-steps", "-1"], TRL_STEP_KEYS) == ({"max_steps": "-1"}, [])


def test_a_files_bf16_false_gives_way_to_a_typed_bf16_and_a_broken_checkpoint_is_one_line(tmp_path, capsys):
    """Claim: a --config file's bf16 false is --dtype float32 unless --bf16 is typed (any
    value: the typed one wins, as any typed option over a file's); a resumed checkpoint whose state.json holds no
    usable options leaves TRL's counts to this command line's, and infra/checkpoint.py says what is wrong with it."""
    (tmp_path / "bf.yaml").write_text("bf16: false\n")
    assert "--dtype=float32" in with_config_file(["--config", str(tmp_path / "bf.yaml")])
    assert not any("dtype" in flag for flag in with_config_file(["--config", str(tmp_path / "bf.yaml"), "--bf16"]))
    (tmp_path / "ck" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / "ck" / "checkpoint-3" / "state.json").write_text('{"iterations_done": 3, "config": null}')
    cfg = parse_args(["--max-steps", "8", "--resume", "auto", "--out", str(tmp_path / "ck")])
    assert cfg.iterations == 8


def test_trls_use_cpu_is_our_device_and_overwrite_output_dir_says_what_overwrites(tmp_path, capsys):
    """Claim: TRL's use_cpu true is --device cpu, typed or in a file (a dumped
    GRPOConfig(use_cpu=True) too), unless --device is given; --overwrite-output-dir, typed or in a file, is
    ignored with a line saying what --overwrite does instead (it deletes the run in --out, which transformers' flag
    never did: a recipe's habit must not delete a run); the DataLoader's settings are ignored with a line."""
    assert parse_args(["--use-cpu"]).device == "cpu" and parse_args(["--use_cpu", "true"]).device == "cpu"
    assert "took TRL's --use-cpu as --device cpu" in capsys.readouterr().out
    assert parse_args(["--use-cpu", "false"]).device == "auto"
    assert not parse_args(["--overwrite_output_dir"]).overwrite
    assert "--overwrite, typed, replaces it (deleting its checkpoints and policy" in capsys.readouterr().out
    config = tmp_path / "grpo.yaml"
    config.write_text("use_cpu: true\ndataloader_pin_memory: false\noverwrite_output_dir: true\n")
    cfg = parse_args(["--config", str(config)])
    assert cfg.device == "cpu" and not cfg.overwrite
    out = capsys.readouterr().out
    assert "took TRL's use_cpu true as --device cpu" in out and "dataloader_pin_memory: this trainer has no" in out
    assert "use_cpu:" not in out, out  # taken, not also said to be ignored
    assert parse_args(["--config", str(config), "--device", "auto"]).device == "auto"  # a typed --device wins


def test_trls_torch_compile_is_our_compile_train(tmp_path, capsys):
    """Claim: TRL's torch_compile true (transformers' TrainingArguments) is --compile-train on, typed or in a file,
    unless --compile-train is given; false leaves the default; in a file beside gradient_checkpointing true (TRL's
    default, whose recomputation runs the layers eagerly) it is ignored with a line instead of refused, unless
    --gradient-checkpointing is typed: off, the file's switch compiles; on, both were asked for: one line (naming
    TRL's switch), as typed side by side; a switch's word that is not true or false is one line."""
    assert parse_args(["--torch-compile"]).compile_train == "on"
    assert "took TRL's --torch-compile as --compile-train on" in capsys.readouterr().out
    assert parse_args(["--torch_compile", "false"]).compile_train == "auto"
    config = tmp_path / "grpo.yaml"
    config.write_text("torch_compile: true\n")
    assert parse_args(["--config", str(config)]).compile_train == "on"
    assert "took TRL's torch_compile true as --compile-train on" in capsys.readouterr().out
    assert parse_args(["--config", str(config), "--compile-train", "off"]).compile_train == "off"
    config.write_text("torch_compile: true\ngradient_checkpointing: true\n")  # TRL's default: checkpointing on
    cfg = parse_args(["--config", str(config)])
    assert cfg.compile_train == "auto" and cfg.gradient_checkpointing
    assert "ignored TRL's torch_compile true: gradient_checkpointing is on" in capsys.readouterr().out
    typed_off = parse_args(["--config", str(config), "--gradient-checkpointing", "false"])
    assert typed_off.compile_train == "on" and not typed_off.gradient_checkpointing
    assert "ignored TRL's torch_compile" not in capsys.readouterr().out
    for argv in (["--config", str(config), "--gradient-checkpointing"], ["--torch-compile", "--gradient-checkpointing"]):
        assert "--compile-train on (TRL: --torch-compile) and --gradient-checkpointing cannot be combined" in refusal(
            capsys, lambda: parse_args(argv))
    assert "--torch-compile takes true or false, or no value (got 'maybe')" in refusal(
        capsys, lambda: parse_args(["--torch-compile", "maybe"]))


def test_one_option_typed_by_trls_name_and_ours_is_one_line(capsys):
    """Claim: `--learning_rate 1e-4 --lr 2e-4` took the last silently; an option typed by TRL's
    name and ours is one line, as in a --config file; the same name twice is argparse's (the last wins)."""
    assert "--learning-rate and --lr name the same option" in refusal(
        capsys, lambda: parse_args(["--learning_rate", "1e-4", "--lr", "2e-4"]))
    assert "--num-generations and --group-size name the same option" in refusal(
        capsys, lambda: parse_args(["--num-generations=4", "--group-size", "8"]))
    assert parse_args(["--lr", "1e-4", "--lr", "2e-4"]).lr == 2e-4


def test_trls_model_init_kwargs_are_our_dtype_and_attention(tmp_path, capsys):
    """Claim (TRL recipes carry model_init_kwargs {torch_dtype: bfloat16}):
    its torch_dtype (or dtype) and attn_implementation are --dtype and --attn-implementation, each said, unless typed;
    any other from_pretrained keyword is one line naming it."""
    cfg = parse_yaml(tmp_path, "model_init_kwargs:\n  torch_dtype: bfloat16\n  attn_implementation: eager\n")
    assert (cfg.dtype, cfg.attn_implementation) == ("bfloat16", "eager")
    assert "took TRL's model_init_kwargs torch_dtype 'bfloat16' as --dtype bfloat16" in capsys.readouterr().out
    assert parse_yaml(tmp_path, "model_init_kwargs: {dtype: bfloat16}\n", "--dtype", "float32").dtype == "float32"
    assert "model_init_kwargs: device_map: models load with --dtype and --attn-implementation only" in refusal(
        capsys, lambda: parse_yaml(tmp_path, "model_init_kwargs: {device_map: auto}\n"))


def test_a_typed_step_count_is_refused_under_the_flag_typed(capsys):
    """Claim: typed, a TRL step count that is refused is named as typed (--max-steps 3, --save-strategy), in a file as
    the file's key (max_steps 3): the line named TRL's key for a flag the user typed."""
    from infra.command_line import parse_args
    assert refusal(capsys, lambda: parse_args(["--max-steps", "3", "--num-iterations", "2"])) == (
        "trainer.py: error: --max-steps 3 is not a whole number of iterations of 2 optimizer steps each (--updates-per-iteration 1 x "
        "--num-iterations 2): give --max-steps 2 or 4, or --iterations\n")
    assert "--save-strategy 'epoch' is not what this trainer does" in refusal(
        capsys, lambda: parse_args(["--save-strategy", "epoch"]))


def test_open_r1_recipe_keys_are_mapped_or_skipped(tmp_path, capsys):
    """Claim: an open-r1 recipe runs as it is: dataset_prompt_column is --prompt-column (typed too), the parameters of
    open-r1's own rewards and its hub and wandb settings are ignored with the one line TRL's other keys get, and a
    dataset_mixture, which would change the data, is refused naming --data."""
    cfg = parse_yaml(tmp_path, "dataset_prompt_column: problem\ncosine_max_len: 1000\nrepetition_n_grams: 3\n"
                               "code_provider: e2b\nmax_completion_len: 16384\nsoft_punish_cache: 4096\n"
                               "wandb_project: r1\nbenchmarks: []\ndataset_mixture: null\n")
    assert cfg.prompt_column == "problem"
    out = capsys.readouterr().out
    assert "ignored TRL's cosine_max_len, repetition_n_grams, code_provider, max_completion_len, soft_punish_cache: " \
           "a setting of open-r1's reward functions" in out
    assert "wandb_project: --report-to wandb reads WANDB_ENTITY" in out and "unknown" not in out
    assert parse_args(["--dataset-prompt-column", "problem"]).prompt_column == "problem"
    assert "dataset_mixture: {'datasets': []} is not what this trainer does (the data is one dataset (--data)): " \
           "use --data" in refusal(capsys, lambda: parse_yaml(tmp_path, "dataset_mixture: {datasets: []}\n"))


def test_a_refused_resume_names_the_options_as_typed(tmp_path, capsys):
    """Claim: a resume refused for a changed option names it as the user typed it: --max-steps (in optimizer steps,
    the iterations beside them where an iteration takes several), TRL's --learning-rate; not the --iterations and
    --lr they were read as."""
    import trainer
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    saved = dataclasses.asdict(parse_args(["--iterations", "4", "--lr-scheduler-type", "cosine",
                                           "--updates-per-iteration", "2", "--batch-size", "16"]))
    (out / "checkpoint-2" / "state.json").write_text(json.dumps({"iterations_done": 2, "config": saved,
                                                                 "reference_fingerprint": "x"}))
    assert trainer.main(["--resume", "auto", "--out", str(out), "--max-steps", "6"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --max-steps 6 (3 iterations of 2 optimizer steps) differs from the checkpoint's 8 "
                          "(4 iterations): it would change the run (its learning-rate schedule, cosine,") and \
        "(drop --max-steps," in err and "--iterations" not in err, err
    assert trainer.main(["--resume", "auto", "--out", str(out), "--learning-rate", "1e-3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --learning-rate 0.001 differs from the checkpoint's") and "--lr " not in err, err


def test_trls_evaluation_switches_are_honoured(tmp_path, capsys):
    """Claim: TRL's do_eval, eval_strategy and eval_steps mean here what transformers' TrainingArguments makes of them,
    typed, in a --config file or in train's args: do_eval false with eval_strategy unset (TRL's 'no') evaluates
    nothing and holds nothing out; eval_strategy 'steps' sets do_eval true, so
    its eval_steps win; 'no' is none; 'epoch' is once per pass over the training prompts, counted once the data is
    read."""
    import trainer
    from infra import python_args
    assert (parse_yaml(tmp_path, "do_eval: false\n").eval_every, parse_yaml(tmp_path, "do_eval: false\n").eval_size) \
        == (0, 0)
    assert "took TRL's do_eval false, with eval_strategy unset (TRL's 'no'), as --eval-every 0" in \
        capsys.readouterr().out
    assert parse_yaml(tmp_path, "do_eval: false\neval_strategy: steps\neval_steps: 5\n").eval_every == 5
    assert parse_yaml(tmp_path, "do_eval: true\neval_strategy: 'no'\n").eval_every == 0
    assert parse_args(["--do-eval", "false"]).eval_every == parse_args(["--do_eval", "False"]).eval_every == 0
    assert parse_args(["--do-eval"]).eval_every == 10  # true: our default cadence (a departure: --help's end)
    assert parse_args(python_args.train_argv("tiny", "math", args={"do_eval": False})).eval_every == 0
    cfg = parse_args(["--eval-strategy", "epoch", "--data", "arithmetic", "--batch-size", "64", "--group-size", "8"])
    assert cfg.eval_every_epoch
    cfg, task, _, _ = trainer.prepare(cfg)
    assert cfg.eval_every == math.ceil(len(task.train) / 8) and "--eval-every-epoch: every" in task.notes[-1]
