"""timeline.py: busy, idle and overlap per iteration, from spans of both processes."""
import pytest

from timeline import INFERENCE, TRAINING, Span, Timeline


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
        "iteration_s": 6.0, "generate_s": 3.0, "generate_device_s": 3.0, "train_s": 3.0, "idle_inference_s": 3.0, "idle_training_s": 3.0,
        "overlap": 1 / 3})  # both busy during [2, 3] only


def test_summary_from_the_iterations_first_span_is_the_same():
    """Claim: reading only the spans added since the iteration started (linear cost over a run) gives the
    same figures as reading all of them, and spans outside the iteration are clipped away."""
    timeline = Timeline()
    pipeline_iteration(timeline, 0.0)
    first = len(timeline.spans)
    pipeline_iteration(timeline, 6.0)
    assert timeline.summary(6.0, 12.0, first) == timeline.summary(6.0, 12.0)
    assert timeline.summary(6.0, 12.0, first) == timeline.summary(0.0, 6.0)
