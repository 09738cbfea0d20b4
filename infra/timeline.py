"""Timeline of both processes: spans, per-iteration busy/idle/overlap, and a Chrome trace file.

A span is (name, process, start, end) on `time.perf_counter()`, which on Linux reads the
system-wide monotonic clock, so spans recorded in the inference process line up with the trainer's.

Per iteration, over its wall time W (from publishing θ_k to the optimizer step that makes θ_{k+1}):

    busy_p   = |union of p's work spans|             p ∈ {inference, training}
    idle_p   = W - busy_p
    generate_s = busy_inference less its held-out evaluation, eval_s = |union of the evaluation's spans|
    generate_device_s = Σ_w generate_s of inference worker w   (device-seconds; = generate_s with one worker)
    overlap  = |busy_inference ∩ busy_training| / min(busy_inference, busy_training)

overlap = 1 means the shorter side was completely hidden behind the longer one (the ideal of the
pipeline); synchronous mode has overlap 0 by construction. The pipeline's bound at the sizes and
threads the iteration ran, from its own spans (`bound_s`, a lower bound on W for these phase times):

    bound_s = max(lead + sampling + tail,  fill + busy_training after the fill)

lead: the training side's work before the inference side starts (publishing θ_k); sampling: the
inference side's busy time until the last micro-batch starts (an evaluation after the last group
overlaps the tail); tail: the training side's work from the last micro-batch on (it holds the last
group to arrive; then the optimizer step); fill: until the first micro-batch starts (its groups had to
arrive). The three parts of each chain are disjoint in time, so bound_s <= W; a perfect pipeline of
the same spans would hide the rest: bound_s / W is how close the schedule came (`bench.py async`).
`write_chrome_trace` writes the trace-event JSON that chrome://tracing and https://ui.perfetto.dev open:
one row per process (per inference worker: its lane).
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass

INFERENCE, TRAINING = "inference", "training"
EVALUATE = "evaluate"  # the inference side's span of a held-out evaluation: eval_s, apart from generate_s


@dataclass
class Span:
    name: str
    process: str  # INFERENCE or TRAINING
    start: float
    end: float
    wait: bool = False  # waiting, not working: excluded from busy time
    lane: int = 0  # which of the side's processes (inference worker w): its own row in the trace


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as sorted, disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two disjoint, sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


TRAIN = "train "  # a micro-batch's span name begins so (learner.py: "train group g", "train n groups")


def pipeline_bound(start: float, inference: list[tuple[float, float]], training: list[tuple[float, float]],
                   micro_batches: list[float]) -> float:
    """The shortest the iteration from `start` could take with these busy intervals (merged, sorted) and
    micro-batch start times: max(lead + |inference| + tail, fill + |training after the fill|) (module docstring).

    >>> round(pipeline_bound(0.0, [(0.1, 3.0)], [(0.0, 0.1), (1.0, 2.0), (3.2, 4.0)], [1.0, 3.2]), 9)  # 0.1 + 2.9 + 0.8
    3.8
    """
    fill, last, end = min(micro_batches), max(micro_batches), float("inf")
    lead = intersection(training, [(start, inference[0][0])]) if inference else 0.0
    sampling = intersection(inference, [(start, last)])  # to the last group (an evaluation after it overlaps the tail)
    return max(lead + sampling + intersection(training, [(last, end)]),
               fill - start + intersection(training, [(fill, end)]))


class Timeline:
    def __init__(self) -> None:
        self.spans: list[Span] = []

    def add(self, span: Span) -> None:
        self.spans.append(span)

    @contextmanager
    def span(self, name: str, process: str = TRAINING, wait: bool = False):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(Span(name, process, start, time.perf_counter(), wait))

    def summary(self, start: float, end: float, first: int = 0) -> dict[str, float]:
        """Busy, idle and overlap of both processes inside [start, end] (one iteration).

        Only spans[first:] are read: pass len(spans) as it was at `start`, so a long run costs time
        linear in its length. Exact, because a span is added once it has ended: any span that ends
        after `start` was added after `start`.
        """
        def busy(process: str, lane: int | None = None, names=lambda name: True) -> list[tuple[float, float]]:
            clipped = [(max(s.start, start), min(s.end, end)) for s in self.spans[first:]
                       if s.process == process and not s.wait and s.end > start and s.start < end
                       and lane in (None, s.lane) and names(s.name)]
            return merge(clipped)

        def sampling(name: str) -> bool:  # the inference side's work but the held-out evaluation
            return name != EVALUATE

        inference, training = busy(INFERENCE), busy(TRAINING)
        wall = end - start
        micro_batches = [s.start for s in self.spans[first:] if s.process == TRAINING and s.name.startswith(TRAIN)
                         and start <= s.start < end]
        gen, train = length(busy(INFERENCE, names=sampling)), length(training)
        shorter = min(length(inference), train)
        lanes = {s.lane for s in self.spans[first:] if s.process == INFERENCE}
        return {
            "iteration_s": wall,
            "generate_s": gen,
            "generate_device_s": sum(length(busy(INFERENCE, lane, sampling)) for lane in lanes),
            "eval_s": length(busy(INFERENCE, names=lambda name: name == EVALUATE)),
            "train_s": train,
            "idle_inference_s": wall - length(inference),
            "idle_training_s": wall - train,
            "overlap": intersection(inference, training) / shorter if shorter > 0 else 0.0,
            "bound_s": pipeline_bound(start, inference, training, micro_batches) if micro_batches else wall,
        }

    def write_chrome_trace(self, path: str) -> None:
        origin = min((s.start for s in self.spans), default=0.0)
        pids = {INFERENCE: 1, TRAINING: 2}
        events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
                  for name, pid in pids.items()]
        events += [{"ph": "X", "name": s.name, "cat": "wait" if s.wait else "work", "pid": pids[s.process],
                    "tid": s.lane, "ts": (s.start - origin) * 1e6, "dur": (s.end - s.start) * 1e6}
                   for s in self.spans]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
