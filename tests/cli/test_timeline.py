"""infra/timeline.py: busy, idle and overlap per iteration, from spans of both processes."""
import pytest

from infra.console import format_row
from infra.timeline import EVALUATE, INFERENCE, TRAINING, Span, Timeline


def pipeline_iteration(timeline: Timeline, t0: float) -> None:
    """Spans of one iteration starting at t0, added when they end, as the trainer adds them.

    Inference works [t0, t0+3] (two overlapping spans); training waits until t0+2, then works to t0+5.
    """
    timeline.add(Span("generate group 0", INFERENCE, t0, t0 + 2))
    timeline.add(Span("wait for rollouts", TRAINING, t0, t0 + 2, wait=True))
    timeline.add(Span("generate group 1", INFERENCE, t0 + 1, t0 + 3))
    timeline.add(Span("train group 0", TRAINING, t0 + 2, t0 + 5))


def test_summary_busy_idle_overlap():
    """Claim: busy time is the union of work spans (waits excluded), overlap is the shared busy time over
    the shorter side's busy time."""
    timeline = Timeline()
    pipeline_iteration(timeline, 0.0)
    assert timeline.summary(0.0, 6.0) == pytest.approx({
        "iteration_s": 6.0, "generate_s": 3.0, "generate_device_s": 3.0, "eval_s": 0.0, "train_s": 3.0,
        "idle_inference_s": 3.0, "idle_training_s": 3.0,
        "overlap": 1 / 3, "bound_s": 5.0})  # both busy during [2, 3] only; bound: fill 2 + training 3


def test_the_held_out_evaluation_is_timed_apart_from_sampling():
    """Claim: the held-out evaluation's time is eval_s, not part of generate_s (nor of generate_device_s, which
    balances the devices): the sampling figures are the training batch's alone; the inference side's idle time is
    the wall time less both."""
    timeline = Timeline()
    pipeline_iteration(timeline, 0.0)
    timeline.add(Span(EVALUATE, INFERENCE, 3.0, 5.5))
    summary = timeline.summary(0.0, 6.0)
    assert (summary["generate_s"], summary["generate_device_s"], summary["eval_s"]) == pytest.approx((3.0, 3.0, 2.5))
    assert summary["idle_inference_s"] == pytest.approx(0.5)
    row = {"iteration": 0, "reward_mean": 0.5, "reward_std": 0.1, **summary}
    assert "gen 3.00s  (+2.50s eval)  train 3.00s" in format_row(row)
    assert "eval)" not in format_row({**row, "eval_s": 0.0})


def test_bound_is_the_longer_chain_of_work_that_cannot_overlap():
    """Claim: the pipeline bound is the later of (publish, generation, then the last micro-batch and the step) and
    (the fill, then all training); the waits and the idle time between micro-batches are what it leaves out."""
    timeline = Timeline()
    timeline.add(Span("publish θ_0", TRAINING, 0.0, 0.5))
    timeline.add(Span("generate groups 0-1", INFERENCE, 0.5, 2.5))
    timeline.add(Span("generate groups 2-3", INFERENCE, 2.5, 4.5))
    timeline.add(Span("train 2 groups", TRAINING, 3.0, 5.0))  # started 0.5 s after its groups: dispatch lost
    timeline.add(Span("train 2 groups", TRAINING, 5.0, 6.0))
    timeline.add(Span("optimizer step 0", TRAINING, 6.0, 6.5))
    summary = timeline.summary(0.0, 6.5)
    # generation chain: 0.5 + 4.0 + (1.0 + 0.5) = 6.0; training chain: fill 3.0 + 3.5 = 6.5
    assert summary["bound_s"] == pytest.approx(6.5)
    timeline.spans[3] = Span("train 2 groups", TRAINING, 2.5, 4.5)  # the first micro-batch on arrival
    assert timeline.summary(0.0, 6.5)["bound_s"] == pytest.approx(6.0)  # now generation is the longer chain


def test_summary_from_the_iterations_first_span_is_the_same():
    """Claim: reading only the spans added since the iteration started (linear cost over a run) gives the
    same figures as reading all of them, and spans outside the iteration are clipped away."""
    timeline = Timeline()
    pipeline_iteration(timeline, 0.0)
    first = len(timeline.spans)
    pipeline_iteration(timeline, 6.0)
    assert timeline.summary(6.0, 12.0, first) == timeline.summary(6.0, 12.0)
    assert timeline.summary(6.0, 12.0, first) == timeline.summary(0.0, 6.0)
