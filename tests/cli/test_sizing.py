"""launch/sizing.py: the pipeline model that picks the generate calls, and the probe that feeds it."""
import dataclasses
import math

import pytest
import torch

from config import Config
from infra.data import load_task
from infra.models import load_model
from infra.options import derive
from launch import sizing
from packing import logprobs_fn
from tri_model import TriModel


def probe_of(lengths, step=(0.003, 0.0), per_token=1e-5, prompt=10, group_size=8):
    """A probe whose calls of k prompts take (a + b·rows) seconds per decode step (each group ready the step
    after its longest response, each call as long as its longest), whose forward/backward costs
    per_token·tokens."""
    tokens = [group_size * (prompt + length) for length in lengths]
    timelines, seconds = {}, {}
    for k in sizing.candidate_calls(len(lengths)):
        step_s, clock, timeline = step[0] + step[1] * k * group_size, 0.0, []
        for first in range(0, len(lengths), k):
            call = lengths[first:first + k]
            timeline += [(clock + (length + 1) * step_s, g, first) for g, length in enumerate(call, first)]
            clock += (max(call) + 1) * step_s
        timelines[k], seconds[k] = sorted(timeline), clock
    return sizing.Probe(timelines, seconds, {k: tokens for k in timelines}, (0.0, per_token))


def test_equal_lengths_in_one_call_overlap_nothing():
    """Claim: when every group stops at the same step, a single call delivers them all at its end: the predicted
    iteration is generation + training exactly (nothing to overlap), and two calls overlap the first call's
    training with the second call's generation."""
    probe = probe_of([4] * 16)
    total, gen, train = sizing.predict_seconds(probe, 1, 16384)
    assert math.isclose(total, gen + train) and math.isclose(gen, 5 * 0.003)
    total2, gen2, train2 = sizing.predict_seconds(probe, 2, 16384)
    assert math.isclose(gen2, 2 * gen) and total2 < gen2 + train2


def test_streaming_by_completion_overlaps_within_one_call():
    """Claim: with a long tail of lengths and micro-batches of one group, one call already overlaps: the short
    groups train while the long one decodes, so the prediction is below generation + training by at least the
    short groups' training. With micro-batches as big as the iteration, the short groups wait for the call to
    end (the learner's rule) and nothing overlaps: the micro-batch size decides whether streaming pays."""
    lengths = [5] * 15 + [100]
    probe = probe_of(lengths)
    tokens = probe.tokens[16]
    total, gen, train = sizing.predict_seconds(probe, 1, tokens[0])
    short_training = 1e-5 * sum(tokens[:15])
    assert total <= gen + train - short_training + 1e-12
    whole = sizing.predict_seconds(probe, 1, sum(tokens))
    assert math.isclose(whole[0], whole[1] + whole[2])
    calls, micro = sizing.best_sizes(probe, 16384)
    assert calls == 1 and micro < sum(tokens)


def test_best_sizes_follow_the_measured_costs():
    """Claim: a fixed cost per decode step (accelerator-like, or generate's bookkeeping on CPU) favours one call;
    a cost per row (a compute-bound CPU) with training as long as generation favours several calls, so the
    trainer starts on the first call's groups while the rest is sampled."""
    fixed = probe_of([4] * 16, step=(0.01, 0.0), per_token=1e-6)
    assert sizing.best_sizes(fixed, 16384)[0] == 1
    per_row = probe_of([4] * 16, step=(0.0, 1e-3), per_token=0.64 / (16 * 8 * 14))  # train = generate = 0.64 s
    calls, micro = sizing.best_sizes(per_row, 16384)
    assert calls > 1 and sizing.predict_seconds(per_row, calls, micro)[0] < sizing.predict_seconds(per_row, 1, micro)[0]


def test_the_fastest_pass_of_each_size_undoes_one_slow_measurement():
    """Claim: the probe's choice survives one noisy pass. On a long tail where one call is the right size, a pass
    in which another process slowed the one-call measurement alone (x1.6, as measured here: 0.82 vs 1.31 s) makes
    `best_sizes` pick more calls (teeth); keeping each size's fastest of two passes (`fastest`) restores the
    choice of the undisturbed probe, timelines included."""
    clean = probe_of([5] * 15 + [100], step=(0.003, 0.0), per_token=2e-5)  # a fixed cost per step: one call
    slow = {k: [(t * (1.6 if k == 16 else 1.0), g, first) for t, g, first in timeline]
            for k, timeline in clean.timelines.items()}
    noisy = sizing.Probe(slow, {k: s * (1.6 if k == 16 else 1.0) for k, s in clean.generate_seconds.items()},
                         clean.tokens, clean.train_seconds)
    assert sizing.best_sizes(clean, 16384)[0] == 1 and sizing.best_sizes(noisy, 16384)[0] > 1
    runs = {k: [(noisy.generate_seconds[k], noisy.timelines[k]), (clean.generate_seconds[k], clean.timelines[k])]
            for k in clean.timelines}
    seconds, timelines = sizing.fastest(runs)
    merged = sizing.Probe(timelines, seconds, clean.tokens, clean.train_seconds)
    assert merged == clean and sizing.best_sizes(merged, 16384) == sizing.best_sizes(clean, 16384)


def test_a_micro_batch_costs_its_rows_padded_to_the_longest():
    """Claim: with the groups' widths known, a micro-batch costs G·n·(its longest row) tokens, as the unpadded-row
    forward computes them: the whole long-tailed iteration in one micro-batch costs far more than its plain tokens,
    and one group per micro-batch costs exactly its own rows; so the probe does not charge small micro-batches the
    padding of the whole iteration."""
    lengths = [5] * 15 + [100]
    plain = probe_of(lengths)
    widths = {k: [10 + length for length in lengths] for k in plain.timelines}
    probe = sizing.Probe(plain.timelines, plain.generate_seconds, plain.tokens, plain.train_seconds, widths, 8)
    assert sizing.padded_tokens(probe, 16, list(range(16))) == 8 * 16 * 110 > sum(plain.tokens[16])
    assert all(sizing.padded_tokens(probe, 16, [g]) == plain.tokens[16][g] for g in range(16))
    one_group = plain.tokens[16][0]
    assert sizing.predict_seconds(probe, 1, one_group) == sizing.predict_seconds(plain, 1, one_group)
    assert sizing.predict_seconds(probe, 1, 16384)[2] > sizing.predict_seconds(plain, 1, 16384)[2]


def test_sample_then_train_takes_the_least_generation_and_the_whole_training():
    """Claim: when the sides sample then train (sync mode, or async when that is predicted faster), the fewest calls
    whose measured generation is within 5% of the least win, and the prediction is that generation plus the
    whole iteration's training; a given call count is kept."""
    probe = probe_of([4] * 16, step=(0.01, 0.0), per_token=1e-5)
    calls, seconds = sizing.predict_sample_then_train(probe, 16, 16384)
    assert calls == 1 and math.isclose(seconds, probe.generate_seconds[16] + 1e-5 * sum(probe.tokens[16]))
    assert sizing.predict_sample_then_train(probe, 16, 16384, calls=4)[0] == 4


def test_with_ranks_every_sampler_gets_a_call():
    """Claim (torchrun probing): the sizes chosen for M ranks x N workers give at least M·N generate calls
    (`min_calls`), where the single process would take one (a fixed cost per step favours one call): a rank with no
    call would sit idle, and distributed.check refuses that."""
    fixed = probe_of([4] * 16, step=(0.01, 0.0), per_token=1e-6)
    assert sizing.best_sizes(fixed, 16384)[0] == 1 and sizing.predict_sample_then_train(fixed, 16, 16384)[0] == 1
    assert sizing.best_sizes(fixed, 16384, min_calls=2)[0] == 2
    assert sizing.best_sizes(fixed, 16384, min_calls=3)[0] == 4  # the probe's next call count: calls of 4 prompts
    assert sizing.predict_sample_then_train(fixed, 16, 16384, min_calls=2)[0] == 2


@pytest.mark.slow
def test_probe_changes_nothing_and_choose_fills_only_open_sizes(tiny_model_dir, monkeypatch, capsys):
    """Claim: the probe leaves the RNG state, the weights and the gradients as they were (the run that follows is
    the run that would have happened), measures positive costs, and `choose` fills exactly the sizes left open,
    with at least one thread per side. It says so before it starts, and
    says nothing when every size is given."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    cfg = derive(Config(model=str(tiny_model_dir), data="arithmetic", mode="async", batch_size=32, group_size=4,
                        max_new_tokens=6))
    policy, tokenizer = load_model(cfg.model)
    train, _ = load_task(cfg.data, eval_size=4)
    tri = TriModel(policy, logprobs_fn(policy, pad_id=tokenizer.pad_token_id), use_reference=True, use_old=False)
    before = [p.detach().clone() for p in policy.parameters()]
    rng = torch.get_rng_state()
    chosen, note, gain = sizing.choose(cfg, tri, tokenizer, train)
    assert capsys.readouterr().out == ("periodic-rl: probing sizes (the toy: 5-25 s; by rule instead if its first "
                                       "call predicts more than 30 s and 10% of the run's sampling; pass the printed "
                                       "flags to skip) ...\n")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), before))
    assert all(p.grad is None for p in policy.parameters())
    assert chosen.sized and chosen.groups_per_call in sizing.candidate_calls(cfg.prompts_per_iteration)
    assert "sample then train at 2 threads" in note  # async with open threads weighs sampling then training too
    assert 1 <= chosen.micro_batch_tokens <= 16384 and "probe:" in note
    assert chosen.rollout_threads >= 1 and chosen.train_threads >= 1
    assert chosen.rollout_threads + chosen.train_threads in (2, 4)  # split (1 + 1), or one after the other (2 + 2)
    # over its budget (a big model on CPU: 262 s of a 344 s run), the probe stops after its first timed call and the
    # sizes are the rule's, nothing changed either
    monkeypatch.setattr(sizing, "PROBE_BUDGET_S", 0.0)
    monkeypatch.setattr(sizing, "PROBE_SHARE", 0.0)
    ruled, note, gain = sizing.choose(cfg, tri, tokenizer, train)
    assert "over its budget: sizes by rule instead (--sizes rule)" in note and gain == 1.0
    assert (ruled.groups_per_call, ruled.micro_batch_tokens, ruled.rollout_threads, ruled.train_threads) == \
        (4, 16384, 1, 1) == tuple(getattr(derive(dataclasses.replace(cfg, sizes="rule")), name) for name in
                                  ("groups_per_call", "micro_batch_tokens", "rollout_threads", "train_threads"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), before))
    assert all(p.grad is None for p in policy.parameters())
    # the predicted gain over sampling then training at the same sizes: exactly 1 when it samples then trains; when
    # it overlaps, the overlap beat sampling then training at the calls of least generation, which are at most
    # AS_FAST slower to generate than these
    assert gain == 1.0 if chosen.train_threads == 2 else gain > 1 / sizing.AS_FAST
    fixed = derive(Config(model=str(tiny_model_dir), data="arithmetic", mode="async", batch_size=32, group_size=4,
                          max_new_tokens=6, groups_per_call=3))
    kept, _, _ = sizing.choose(fixed, tri, tokenizer, train)
    assert kept.groups_per_call == 3 and kept.sized
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})  # one core: one thread per side, whatever is predicted
    one = sizing.choose(dataclasses.replace(cfg, rollout_threads=None, train_threads=None), tri, tokenizer, train)[0]
    assert (one.rollout_threads, one.train_threads, one.train_threads_after_sampling) == (1, 1, 1)
    given = derive(Config(model=str(tiny_model_dir), mode="async", groups_per_call=2, micro_batch_tokens=100,
                          rollout_threads=1, train_threads=1))
    capsys.readouterr()
    assert sizing.choose(given, tri, tokenizer, train) == (given, "", 1.0)
    assert capsys.readouterr().out == ""


def test_the_probe_asks_after_each_group_whether_the_inference_side_lives(tiny_model_dir):
    """Claim: the probe calls `alive()` after each group it samples (and before it times the training), so an
    inference process that dies during a probe of minutes is reported from inside it, not once it ends: its error
    stops the probe at the group where it is seen."""
    from infra.errors import PipelineError
    cfg = derive(Config(model=str(tiny_model_dir), data="arithmetic", mode="async", batch_size=16, group_size=4,
                        max_new_tokens=4, rollout_threads=1, train_threads=1))
    policy, tokenizer = load_model(cfg.model)
    train, _ = load_task(cfg.data, eval_size=4)
    tri = TriModel(policy, logprobs_fn(policy, pad_id=tokenizer.pad_token_id), use_reference=True, use_old=False)
    asked = []

    def alive() -> None:
        asked.append(len(asked))
        if len(asked) == 3:
            raise PipelineError("the inference process (PID 1) died: killed by SIGKILL")
    with pytest.raises(PipelineError, match="died: killed by SIGKILL"):
        sizing.probe(cfg, tri, tokenizer, train, threads=1, alive=alive)
    assert asked == [0, 1, 2]
    asked.clear()
    sizing.probe(cfg, tri, tokenizer, train, threads=1, alive=lambda: asked.append(1))
    assert len(asked) > cfg.prompts_per_iteration * sizing.PASSES  # each group of each pass, then before the training
