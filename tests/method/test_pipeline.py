"""Periodic asynchrony (periodic_rl.py): async equals sync, stays on-policy, and fails loudly and cleanly."""
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest
import torch

import inference
import periodic_rl
import trainer
from infra.distributed import Ranks
from launch import setup
from tri_model import TriModel
import weights
from infra.data import load_task
from infra.models import load_model
from infra.command_line import parse_args
from infra.reward import load_reward
from infra.timeline import Timeline
from learner import Learner
from packing import logprobs_fn
from rollout import Evaluation, ScoredGroup, IterationDone, rollout_iteration
from conftest import learn_iteration
from launch import run_output
import warm

ROOT = Path(__file__).resolve().parents[2]
DIGITS = "tests/rewards.py:digit_fraction"


def make_cfg(model_dir, *extra):
    return parse_args(["--model", str(model_dir), "--data", "arithmetic", "--reward", DIGITS,
                       "--iterations", "3", "--batch-size", "16", "--group-size", "4", "--max-new-tokens", "6",
                       "--eval-every", "2", "--eval-size", "4", "--eval-samples", "2", "--lr", "1e-2",
                       "--no-save", "--sizes", "rule", *map(str, extra)])  # fixed sizes: runs comparable


def run_training(cfg):
    """θ after cfg.iterations, and the metrics rows: the run as trainer.py runs it, in this process."""
    with trainer.started(cfg) as (rows, policy, _):
        return policy, list(rows)


def kept_inference_sides(monkeypatch) -> list:
    """The inference sides that the runs which follow start (setup.inference_side's), for checks on them."""
    spawned, inference_side = [], setup.inference_side

    def kept(*args, **kwargs):
        spawned.append(inference_side(*args, **kwargs))
        return spawned[-1]
    monkeypatch.setattr(setup, "inference_side", kept)
    return spawned


SAME_THREADS = ["--rollout-threads", "1", "--train-threads", "1"]


TRL_OPTIONS = [  # TRL's options: steps that wait for the whole batch, μ passes over it, bnpo, masks, schedules
    ["--scale-rewards", "batch", "--beta", "0", "--num-iterations", "2", "--loss-type", "bnpo",
     "--lr-scheduler-type", "cosine", "--warmup-ratio", "0.3", "--groups-per-call", "3",
     "--micro-batch-tokens", "60"],
    ["--scale-rewards", "batch", "--updates-per-iteration", "2", "--num-iterations", "2", "--epsilon-low", "0.01",
     "--epsilon-high", "0.01", "--groups-per-call", "3"]]


@pytest.mark.parametrize("extra", [[], ["--updates-per-iteration", "2", "--epsilon-low", "0.01",
                                        "--epsilon-high", "0.01"],
                                   ["--groups-per-call", "3", "--micro-batch-tokens", "60",
                                    "--updates-per-iteration", "2", "--epsilon-low", "0.01", "--epsilon-high", "0.01"],
                                   *TRL_OPTIONS])
def test_async_equals_sync(tiny_model_dir, extra):
    """Claim: with the same thread counts on each side, async and sync are *bitwise* the same run: the same
    rollouts, the same metrics and, after several iterations, the same weights (torch.equal). The schedule changes
    only when each group is trained, and each side runs the same kernels on the same inputs. It holds with several
    updates per iteration too (mini-batches are fixed by prompt index, not arrival order) and with several prompts
    per generate call and per training forward (4 prompts in calls of 3, streamed in completion order, two
    mini-batches of 2 that the first call straddles, micro-batches capped at 60 tokens, i.e. one or two groups of
    4 x (~6 + <= 6) tokens): micro-batches are cut by arrival order, which is completion order, the same in both
    modes. And with TRL's options: scale_rewards="batch" (the first step, or with β > 0 every pass,
    waits for the last group), μ = 2 passes over the stored batch, bnpo's per-micro-batch means, a warmed-up
    cosine schedule: every metric TRL logs is equal too."""
    sync_policy, sync_rows = run_training(make_cfg(tiny_model_dir, "--mode", "sync", *SAME_THREADS, *extra))
    async_policy, async_rows = run_training(make_cfg(tiny_model_dir, "--mode", "async", *SAME_THREADS, *extra))
    initial, _ = load_model(str(tiny_model_dir))
    moved = max((p - q).abs().max().item() for p, q in zip(sync_policy.parameters(), initial.parameters()))
    assert moved > 1e-3, "training did not change the weights: the comparison would be vacuous"
    for p, q in zip(sync_policy.parameters(), async_policy.parameters()):
        assert torch.equal(p, q)
    assert len(sync_rows) == len(async_rows) == 4
    for s, a in zip(sync_rows, async_rows):
        for key in ("reward_mean", "reward_std", "response_length", "eval_reward", "kl", "clip_fraction", "loss",
                    "grad_norm", "entropy", "learning_rate", "clip_fraction_low", "clip_fraction_high",
                    "frac_reward_zero_std", "truncated_fraction"):
            assert s.get(key) == a.get(key), key
    if "--updates-per-iteration" in extra:
        assert max(r["clip_fraction"] for r in sync_rows[:-1]) > 0, "N > 1 updates should activate clipping"


@pytest.fixture(scope="module")
def dropout_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with attention dropout 0.5 (Qwen2 reads the rate at forward time, in training mode)."""
    import json
    import shutil
    out = tmp_path_factory.mktemp("dropout") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    return out


def test_a_model_with_dropout_trains_bitwise(dropout_model_dir, tmp_path):
    """Claim (TRL's disable_dropout, on by default): the policy's dropout is set to 0 before training, so a model
    with attention dropout 0.5 gives async == sync bitwise, and a rerun the same run; the saved policy/config.json
    keeps the model's own 0.5. With --no-disable-dropout the masks are drawn: the run differs from the one without
    them (what the option prevents)."""
    import json

    from transformers import AutoTokenizer
    sync_policy, sync_rows = run_training(make_cfg(dropout_model_dir, "--mode", "sync", *SAME_THREADS))
    async_policy, async_rows = run_training(make_cfg(dropout_model_dir, "--mode", "async", *SAME_THREADS))
    assert all(torch.equal(p, q) for p, q in zip(sync_policy.parameters(), async_policy.parameters()))
    assert [r.get("loss") for r in sync_rows] == [r.get("loss") for r in async_rows]
    assert all(m.attention_dropout == 0.0 for m in sync_policy.modules() if hasattr(m, "attention_dropout"))
    run_output.save_policy(sync_policy, AutoTokenizer.from_pretrained(dropout_model_dir), tmp_path / "policy")
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["attention_dropout"] == 0.5
    dropping, _ = run_training(make_cfg(dropout_model_dir, "--mode", "sync", *SAME_THREADS, "--no-disable-dropout"))
    assert not all(torch.equal(p, q) for p, q in zip(dropping.parameters(), sync_policy.parameters()))


@pytest.mark.slow
def test_async_matches_sync_across_thread_counts(tiny_model_dir):
    """Claim: with the default thread split (sync: 2 threads, async: 1 + 1 on a 2-core machine) the runs differ only
    by float summation order. Tolerances, from the arithmetic:
    - rollouts (rewards, lengths, held-out reward) equal in every iteration: a sampled token changes only if a
      uniform draw falls within the logits' ~1e-7 rounding noise of a CDF boundary, probability ~1e-7 per token,
      and the weights of the two runs stay that close (below);
    - iteration 0's loss and gradient norm (sums of ~10^3 fp32 products at the same weights) within 1e-4
      relative: n·2^-24 for n = 10^3 terms is 6e-5.
    Later iterations' weights are not compared elementwise: Adam divides each gradient element by its own
    magnitude, so an element whose gradient is at the noise level may step either way by up to lr; that is why
    equality is claimed only for equal thread counts (test_async_equals_sync)."""
    sync_policy, sync_rows = run_training(make_cfg(tiny_model_dir, "--mode", "sync", "--rollout-threads", "2",
                                                   "--train-threads", "2"))
    async_policy, async_rows = run_training(make_cfg(tiny_model_dir, "--mode", "async", *SAME_THREADS))
    for s, a in zip(sync_rows, async_rows, strict=True):
        for key in ("reward_mean", "reward_std", "response_length", "eval_reward"):
            assert s.get(key) == a.get(key), key
    for key in ("loss", "grad_norm"):
        assert async_rows[0][key] == pytest.approx(sync_rows[0][key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow
def test_async_sampling_then_training_never_computes_both_sides_at_once(tiny_model_dir, monkeypatch):
    """Claim: when the two sides' threads oversubscribe the cores (here 2 + 2 threads on 2 cores, two inference
    workers), the trainer takes the inference side's whole iteration, held-out evaluation included, before it
    computes: no training span overlaps an inference span. Exact, not timing luck: both processes time their spans
    on one monotonic clock, and the trainer starts computing only after the message sent after the inference
    side's last span. The run is still sync's, bitwise (the same workers' call slices, the same thread counts)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    oversubscribing = ("--rollout-threads", "2", "--train-threads", "2", "--inference-workers", "2")
    then = make_cfg(tiny_model_dir, "--mode", "async", *oversubscribing)
    assert setup.oversubscribed(then) and not setup.async_runs_as_sync(then)  # two workers: processes
    assert not setup.oversubscribed(make_cfg(tiny_model_dir, "--mode", "async", *SAME_THREADS))
    async_policy, async_rows = run_training(then)
    assert any(r["eval_reward"] is not None for r in async_rows[:-1])  # an evaluation fell inside an iteration
    assert all(r["overlap"] == 0.0 for r in async_rows[:-1])
    sync_policy, sync_rows = run_training(make_cfg(tiny_model_dir, "--mode", "sync", *oversubscribing))
    for p, q in zip(sync_policy.parameters(), async_policy.parameters()):
        assert torch.equal(p, q)
    assert [r.get("eval_reward") for r in sync_rows] == [r.get("eval_reward") for r in async_rows]


@pytest.mark.slow
def test_async_sampling_then_training_in_one_process_is_sync(tiny_model_dir, monkeypatch, capsys):
    """Claim (setup.async_runs_as_sync): async whose sides would sample then train with one inference process and
    one thread count samples in the trainer's process, sync's schedule: with the sizes given, no inference process
    is started; with them open, the one started for the probe is stopped once the probe chose to sample then train
    (here: made to
    choose it, as it does on the toy on 2 cores), before iteration 0. Either way the run is sync's bit for bit
    (torch.equal: the same calls, groups and thread counts in the same process), and the output says so."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    given = make_cfg(tiny_model_dir, "--mode", "async", "--rollout-threads", "2", "--train-threads", "2")
    assert setup.async_runs_as_sync(given) and given.sized
    assert not setup.async_runs_as_sync(make_cfg(tiny_model_dir, "--mode", "async", *SAME_THREADS))
    assert not setup.async_runs_as_sync(dataclasses.replace(given, mode="sync"))
    uneven = dataclasses.replace(given, train_threads=1, train_threads_after_sampling=1)  # 2 + 1 on 2 cores, two counts
    assert setup.oversubscribed(uneven) and not setup.async_runs_as_sync(uneven)  # sampling keeps its 2 threads
    assert not setup.async_runs_as_sync(dataclasses.replace(given, inference_workers=2))
    with setup.inference_side(given, {}, [], []) as rollouts:
        assert rollouts is None  # nothing spawned
    sync_policy, sync_rows = run_training(make_cfg(tiny_model_dir, "--mode", "sync", "--rollout-threads", "2",
                                                   "--train-threads", "2"))
    given_policy, given_rows = run_training(given)

    open_sizes = dataclasses.replace(given, rollout_threads=None, train_threads=None,
                                     train_threads_after_sampling=None)
    assert not open_sizes.sized
    monkeypatch.setattr(setup.sizing, "choose", lambda cfg, *args, **kwargs: (given, "", 1.0))  # as if probed
    spawned = kept_inference_sides(monkeypatch)
    with trainer.started(open_sizes) as (rows, policy, _):
        rollouts, = spawned
        assert isinstance(rollouts, inference.AsyncRollouts)  # for the probe
        probed_rows = [next(rows)]
        assert not any(worker.process.is_alive() for worker in rollouts.workers)  # stopped before iteration 0
        probed_rows += list(rows)
    assert "sampling in this process, sync's schedule, no inference process" in capsys.readouterr().out
    for run_policy in (given_policy, policy):
        assert all(torch.equal(p, q) for p, q in zip(sync_policy.parameters(), run_policy.parameters()))
    keys = ("reward_mean", "eval_reward", "loss", "grad_norm", "kl")
    for run_rows in (given_rows, probed_rows):
        assert [[r.get(k) for k in keys] for r in run_rows] == [[r.get(k) for k in keys] for r in sync_rows]


@pytest.mark.slow
def test_the_trainer_takes_every_core_once_sampling_is_done(tiny_model_dir, monkeypatch):
    """Claim (setup.train_threads_after_sampling): when the probe split the cores (here: made to pick 1 + 1 on 2
    cores and --train-threads-after-sampling 2, as it does when it splits them), every micro-batch trained before the
    iteration's last group is in runs at the trainer's share (1 thread), every one after it (and the step) at all
    cores, each iteration again; an evaluation due keeps the share until its result is in. Which micro-batches get
    all cores follows from arrival order alone, so a rerun is bitwise the same run. Exact: the loop trains between
    messages, and two calls of two prompts put the first call's micro-batch before the second call's groups are
    read."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    cfg = parse_args(["--model", str(tiny_model_dir), "--data", "arithmetic", "--reward", DIGITS, "--iterations", "3",
                      "--batch-size", "16", "--group-size", "4", "--max-new-tokens", "6", "--eval-every", "2",
                      "--eval-size", "4", "--eval-samples", "2", "--lr", "1e-2", "--no-save", "--mode", "async",
                      "--groups-per-call", "2", "--micro-batch-tokens", "40"])  # threads open: the probe's to pick
    assert cfg.rollout_threads is None and cfg.train_threads is None and cfg.train_threads_after_sampling is None
    split, ranks = dataclasses.replace(cfg, rollout_threads=1, train_threads=1, train_threads_after_sampling=2), Ranks()
    assert setup.train_threads_after_sampling(split, ranks) == 2
    as_given = dataclasses.replace(split, train_threads_after_sampling=1)
    assert setup.train_threads_after_sampling(as_given, ranks) is None  # as given: no switch
    assert setup.train_threads_after_sampling(dataclasses.replace(split, mode="sync"), ranks) is None
    assert setup.train_threads_after_sampling(dataclasses.replace(split, inference_workers=2), ranks) is None
    monkeypatch.setattr(setup.sizing, "choose", lambda cfg, *args, **kwargs: (split, "", 1.0))  # as if the probe chose it
    seen, accumulate = [], Learner.accumulate

    def recording(learner, groups):
        seen.append((learner.iteration, learner.all_taken(), torch.get_num_threads()))
        return accumulate(learner, groups)
    monkeypatch.setattr(Learner, "accumulate", recording)
    policy, rows = run_training(cfg)
    evaluating = {0, 2}  # --eval-every 2: the evaluation comes after the last group, so its iterations keep the share
    assert {(taken, threads) for i, taken, threads in seen if i not in evaluating} == {(False, 1), (True, 2)}
    assert {threads for i, _, threads in seen if i in evaluating} == {1}
    assert {iteration for iteration, taken, _ in seen if not taken} == {0, 1, 2}  # the share again each iteration
    again, again_rows = run_training(cfg)
    for p, q in zip(policy.parameters(), again.parameters()):
        assert torch.equal(p, q)
    assert [r.get("loss") for r in rows] == [r.get("loss") for r in again_rows]


def test_chunked_sampling_continues_each_prompt(tiny_model_dir):
    """Claim: sampling several prompts of different lengths in one left-padded generate call continues each
    prompt exactly as sampling it alone does (checked with greedy decoding, where both are deterministic)."""
    from transformers import GenerationConfig

    from infra.hf_generate import sample_responses
    model, tokenizer = load_model(str(tiny_model_dir))
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("1+2=", "31+45=", "100+2000=")]
    assert len({len(p) for p in prompts}) == 3, "the check needs prompts of different lengths"
    greedy = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    together = sample_responses(model, prompts, 2, greedy, seed=0)
    alone = [sample_responses(model, [p], 2, greedy, seed=0)[0] for p in prompts]
    assert together == alone
    assert [len(samples) for samples in together] == [2, 2, 2]


def test_async_groups_are_streamed_and_tagged_with_the_version(tiny_model_dir):
    """The inference process sends every group of iteration k tagged policy_version == k, then IterationDone;
    the groups equal those of the in-process (sync) generator token for token."""
    cfg = make_cfg(tiny_model_dir)
    policy, tokenizer = load_model(cfg.model)
    train, held_out = load_task("arithmetic", eval_size=4)
    sampling = dataclasses.replace(cfg, eval_every=0, groups_per_call=1)
    sync = inference.SyncRollouts(policy, tokenizer, train, held_out, load_reward(DIGITS), sampling)
    with inference.AsyncRollouts(cfg.model, {}, train, held_out, DIGITS, Timeline()) as remote:
        remote.attach(policy, sampling, 1)
        for iteration in range(2):
            sync.publish(policy, iteration)
            remote.publish(policy, iteration)
            sync.generate(iteration)
            remote.generate(iteration)
            local = [m for m in sync.receive() if isinstance(m, ScoredGroup)]
            received = list(remote.receive())
            streamed = [m for m in received if isinstance(m, ScoredGroup)]
            assert isinstance(received[-1], IterationDone)
            assert [g.policy_version for g in streamed] == [iteration] * cfg.prompts_per_iteration
            assert [g.responses for g in streamed] == [g.responses for g in local]
            assert [g.rewards for g in streamed] == [g.rewards for g in local]
            with torch.no_grad():  # a new version: the next iteration must sample from the new weights
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
    assert not remote.workers[0].process.is_alive()


def test_learner_refuses_off_policy_group(tiny_model_dir):
    """A group sampled by another weight version is rejected, not silently trained on."""
    cfg = make_cfg(tiny_model_dir)
    policy, _ = load_model(cfg.model)
    tri = TriModel(policy, logprobs_fn(policy), use_reference=False, use_old=False)
    learner = Learner(tri, torch.optim.SGD(policy.parameters(), lr=0.1), cfg, torch.device("cpu"),
                                  Timeline())
    learner.start(3)
    stale = ScoredGroup(3, 0, 2, [1, 2], [[3, 4]] * 4, [0.0] * 4, [0.0] * 4)
    with pytest.raises(weights.OffPolicyError, match="version 2"):
        learner.take(stale)


def test_a_publish_while_sampling_is_caught(tiny_model_dir):
    """Claim: a group's tag is the version of the weights that sampled it, read from the weight buffer when its
    generate call started and again when it is sent, not the iteration the trainer meant. If θ_1 is published while
    iteration 0 is still being sampled (a broken barrier, provoked here by a reward function that publishes), no
    group of iteration 0 is tagged 0, and the learner refuses them. Without the early publish every tag is 0. The held-out
    evaluation's tag is checked the same way."""
    cfg = make_cfg(tiny_model_dir)
    policy, tokenizer = load_model(cfg.model)
    sampler, _ = load_model(cfg.model)
    train, _ = load_task("arithmetic", eval_size=4)
    buffer = weights.WeightBuffer(policy)
    buffer.attach(sampler)  # on CPU the sampler's parameters are views of the buffer, as in the inference process

    def sample_iteration_0(reward_fn) -> list[ScoredGroup]:
        buffer.publish(policy, 0)
        messages = []
        rollout_iteration(sampler, tokenizer, train, [], reward_fn, cfg, 0, buffer.version, messages.append)
        return [m for m in messages if isinstance(m, ScoredGroup)]

    assert [g.policy_version for g in sample_iteration_0(lambda *args: 0.0)] == [0] * cfg.prompts_per_iteration

    def publishes_early(*args) -> float:
        if buffer.version() == 0:
            buffer.publish(policy, 1)  # the trainer's bug this guards against: θ_1 while iteration 0 samples
        return 0.0

    groups = sample_iteration_0(publishes_early)
    assert len(groups) == cfg.prompts_per_iteration and all(g.policy_version != 0 for g in groups)
    learner = Learner(TriModel(policy, logprobs_fn(policy), use_reference=False, use_old=False),
                                  torch.optim.SGD(policy.parameters(), lr=0.1), cfg, torch.device("cpu"), Timeline())
    learner.start(0)
    with pytest.raises(weights.OffPolicyError, match="off-policy"):
        learner.take(groups[0])
    buffer.publish(policy, 0)  # the held-out evaluation's tag is as honest as a group's
    messages = []
    rollout_iteration(sampler, tokenizer, train, train[:2], publishes_early, cfg, 0, buffer.version,
                      messages.append, train_prompts=False)
    evaluation = next(m for m in messages if isinstance(m, Evaluation))
    with pytest.raises(weights.OffPolicyError, match="evaluation"):
        periodic_rl.held_out_reward(evaluation, 0)


def test_batched_training_forward_gives_the_same_update(tiny_model_dir):
    """Claim: training a call's groups in one forward (a micro-batch cap above their tokens) or one at a time (a
    cap of 1 token: each group alone) gives the same optimizer step (<= 1e-6): the loss is a sum over groups,
    however it is batched."""
    generator = torch.Generator().manual_seed(0)
    groups = [ScoredGroup(0, i, 0, torch.randint(2, 50, (3 + i,), generator=generator).tolist(),
                    [torch.randint(2, 50, (1 + (i + j) % 4,), generator=generator).tolist() for j in range(4)],
                    [0.0] * 4, torch.randn(4, generator=generator).tolist(), call=(0, 4)) for i in range(4)]
    trained = []
    for cap in (1, 10_000):
        cfg = make_cfg(tiny_model_dir, "--groups-per-call", "4", "--micro-batch-tokens", cap)
        policy, _ = load_model(cfg.model)
        tri = TriModel(policy, logprobs_fn(policy), use_reference=True, use_old=False)
        learner = Learner(tri, torch.optim.SGD(policy.parameters(), lr=1.0), cfg, torch.device("cpu"),
                                      Timeline())
        learner.start(0)
        learn_iteration(learner, groups)
        learner.metrics()  # raises unless the iteration's step was taken
        trained.append([p.detach().clone() for p in policy.parameters()])
    initial, _ = load_model(str(tiny_model_dir))
    assert max((p - q).abs().max().item() for p, q in zip(trained[0], initial.parameters())) > 1e-4
    for p, q in zip(*trained):
        assert (p - q).abs().max().item() <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("when", ["while loading", "while generating"])
def test_killed_inference_process_is_noticed_within_seconds(tiny_model_dir, when):
    """Claim: if the inference process dies, whether still loading its model or already serving, the trainer
    raises a clear PipelineError within 10 s (no hang)."""
    cfg = make_cfg(tiny_model_dir)
    policy, _ = load_model(cfg.model)
    train, held_out = load_task("arithmetic", eval_size=4)
    sampling = dataclasses.replace(cfg, eval_every=0, groups_per_call=1)
    with inference.AsyncRollouts(cfg.model, {}, train, held_out, DIGITS, Timeline()) as remote:
        if when == "while generating":
            remote.attach(policy, sampling, 1)
        os.kill(remote.workers[0].process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(inference.PipelineError, match="died"):
            if when == "while loading":
                remote.attach(policy, sampling, 1)
            remote.publish(policy, 0)
            remote.generate(0)
            list(remote.receive())
        assert time.monotonic() - start < faults.hang_bound(faults.STOP_SECONDS)
    assert not remote.workers[0].process.is_alive()


@pytest.mark.slow
def test_deferred_load_waits_for_the_trainer(tiny_model_dir, tmp_path):
    """Claim: with load=False the inference process imports, then waits: it loads the model only once told
    (trainer.py builds the tiny model first), so a model directory that appears only after the spawn is
    found; closing it before it loads stops it within seconds."""
    import shutil
    cfg = make_cfg(tiny_model_dir)
    policy, _ = load_model(cfg.model)
    train, held_out = load_task("arithmetic", eval_size=4)
    sampling = dataclasses.replace(cfg, eval_every=0, groups_per_call=1)
    later = tmp_path / "model"
    with inference.AsyncRollouts(str(later), {}, train, held_out, DIGITS, Timeline(), load=False) as remote:
        time.sleep(5)  # past its imports (~4 s here): loading at once would have failed on the missing directory
        shutil.copytree(tiny_model_dir, later)
        remote.attach(policy, sampling, 1)  # sends ("load",), then the buffer
        remote.publish(policy, 0)
        remote.generate(0)
        assert isinstance(list(remote.receive())[-1], IterationDone)
    idle = inference.AsyncRollouts(str(later), {}, train, held_out, DIGITS, Timeline(), load=False)
    start = time.monotonic()
    idle.close()
    assert not idle.workers[0].process.is_alive() and time.monotonic() - start < faults.hang_bound(10)


def run_trainer(*args, timeout=240):
    return warm.run([sys.executable, "trainer.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("reward, fragment", [("tests/rewards.py:raising_reward",
                                               r"broken on purpose \(at tests/rewards.py, line \d+: raise ValueError"),
                                              ("tests/rewards.py:nan_reward", "not a finite number")])
def test_bad_reward_stops_trainer_with_clear_message(tiny_model_dir, tmp_path, reward, fragment):
    """A reward function that raises or returns NaN in the inference process ends the run: exit code 1, a message
    naming the function, the line that raised and the prompt, no traceback. The sizes are given: on 2 cores the probe
    picks turns in one process, and the claim is about the inference process's error reaching the trainer. (No hang:
    the subprocess's timeout; no wall-clock assertion, the start-up alone takes 10-60 s on a loaded 2-core machine.)"""
    result = run_trainer("--model", tiny_model_dir, "--data", "arithmetic", "--reward", reward,
                         "--max-new-tokens", "4", "--out", tmp_path, "--groups-per-call", "4", "--micro-batch-tokens",
                         "16384", *SAME_THREADS, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "the inference process" in result.stderr, result.stderr
    assert re.search(fragment, result.stderr) and reward.split(":")[1] in result.stderr and "prompt" in result.stderr
    assert "Traceback" not in result.stderr


def inference_process_of(pid: int) -> int:
    """The spawned inference process (not multiprocessing's resource tracker, the other child)."""
    for child in faults.children(pid):
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
    raise AssertionError(f"no inference process among the children of {pid}")


def wait_for_iteration(process, metrics: Path, deadline: float = 120) -> None:
    start = time.monotonic()
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() - start < deadline, "the trainer did not start"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill-child", "ctrl-c"])
def test_trainer_stops_cleanly(tiny_model_dir, tmp_path, how):
    """Claim: a killed inference process stops the trainer within 10 s (exit != 0, clear message; threads within
    the cores, so that there is one: setup.async_runs_as_sync); Ctrl-C at the defaults (the probe's inference process
    stopped once it chose, or kept) stops the run within 5 s. No child process and no shared-memory file is left
    behind."""
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    split = ["--rollout-threads", "1", "--train-threads", "1"] if how == "kill-child" else []
    process = warm.Popen(
        [sys.executable, "trainer.py", "--model", str(tiny_model_dir), "--data", "arithmetic", "--reward", DIGITS,
         "--iterations", "1000", "--max-new-tokens", "4", "--eval-every", "0", "--out", str(tmp_path), *split],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        terminal_signals=())
    try:
        wait_for_iteration(process, tmp_path / "metrics.jsonl")
        children = faults.children(process.pid)  # PID -> start time
        start = time.monotonic()
        if how == "kill-child":
            os.kill(inference_process_of(process.pid), signal.SIGKILL)
            _, err = process.communicate(timeout=faults.hang_bound(10))
            assert process.returncode == 1 and "died: killed by SIGKILL" in err and "Traceback" not in err
        else:
            os.killpg(process.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
            _, err = process.communicate(timeout=faults.hang_bound(5))
            assert process.returncode == 130 and "interrupted" in err
        assert time.monotonic() - start < faults.hang_bound(10 if how == "kill-child" else 5)
        deadline = time.monotonic() + 3  # the resource tracker exits when it sees the trainer's pipe close
        while any(faults.alive(*child) for child in children.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [child for child in children.items() if faults.alive(*child)], "a child process outlived the trainer"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    new = {f for f in shm_after - shm_before if "torch" in f}
    new -= faults.mapped_elsewhere(new, {process.pid, *children})  # in use by another program: not ours
    assert not new, "shared-memory segments left behind"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="shared memory is a size-limited file system on Linux only")
def test_too_small_shared_memory_is_one_line_naming_the_fix(tiny_model_dir, monkeypatch):
    """Claim: before allocating the weight buffer the trainer checks that /dev/shm can hold it (Docker's default is
    64 MB; Qwen2.5-0.5B in bf16 needs ~1 GB) and fails with one line naming --shm-size, allocating nothing."""
    import shutil
    free = 64 * 2**20
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    with pytest.raises(weights.SharedMemoryError, match=r"--shm-size=2g") as error:
        weights.check_shared_memory(10**9)
    assert "\n" not in str(error.value)
    policy, _ = load_model(str(tiny_model_dir))
    weights.check_shared_memory(sum(p.numel() * 4 for p in policy.parameters()) // 2)  # tiny: 0.7 MB, fits
    with pytest.raises(weights.SharedMemoryError, match="shm-size"):
        weights.check_shared_memory(free)


def test_every_inference_side_has_the_rollouts_protocols_methods():
    """Claim: the three inference sides the loop takes (sync, async, inference ranks) have publish, generate and
    receive with periodic_rl.Rollouts' parameters (names, kinds, defaults), so the loop calls each the same way."""
    import inspect
    from launch.remote import RemoteRollouts

    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]
    for side in (inference.SyncRollouts, inference.AsyncRollouts, RemoteRollouts):
        for method in ("publish", "generate", "receive"):
            assert parameters(getattr(side, method)) == parameters(getattr(periodic_rl.Rollouts, method)), \
                (side.__name__, method)
