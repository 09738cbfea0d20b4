"""A realistic tail of response lengths for the benchmarks: each row forced to stop at a length drawn by the seed.

Random weights (the GPU table's Qwen2.5-0.5B configuration) never emit a stop token, and a toy model's answers are
all alike, so every group of a call ends at the same step and the pipeline has nothing to stream early. Real runs
have a long tail of lengths, which is what periodic asynchrony overlaps. With the tail on, row i of prompt j in
iteration k stops at

    L = clamp(ceil(M · exp(σ (z - Z_CAP))), 1, M)       z = Φ⁻¹(u),  u from engine.row_seed((seed, k, j), i)

(M = --max-new-tokens) or at its own stop token, whichever comes first: a log-normal whose 99.9th percentile
(Z_CAP = 3.09 standard deviations) fills the cap, so the median row uses exp(-σ·Z_CAP) = 21% of it and one row in
a thousand reaches it. σ = SIGMA is the spread of log length of GSM8K's reference solutions in its training split
(measured in characters and in words: docs/benchmarks.md; a log-normal's σ does not depend on the unit, so it holds
in tokens too). Real instruct models answer GSM8K at greater length than its references: the shape, not the
median, is what the references tell.

The stop is forced where the engine records a drawn token (engine.GenerateCall.record, patched here, never in a
training run): at step L the row's token becomes its first stop id, as if the model had stopped. L depends on
(seed, k, j, i) alone, so sync and async draw the same tails and stay bitwise equal, and a rerun is the same run.
Models sampled by Hugging Face `generate` (--engine hf) are not cut: the tail is the engine's.

A benchmark turns it on per run with `TAIL_ENV=1` in the environment (`enabled`): for a run in this process, and
for the inference process it spawns, which inherits the variable and imports this module again as the spawned
script's (bench.py's, or this module's with `python -m benchmarks.tail trainer.py ...`, which runs trainer.py's main
with the patch installed).
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
from typing import Iterator

import torch

import engine

TAILS = {"both": (False, True), "on": (True,), "off": (False,)}  # --tail: the runs without it, with it
SIGMA = 0.5    # spread of log length: GSM8K's reference solutions (between its values in characters and in words)
Z_CAP = 3.09   # the cap sits at the log-normal's 99.9th percentile
TAIL_ENV = "PERIODIC_RL_BENCH_TAIL"


def tail_length(key: tuple[int, ...], sample: int, max_new_tokens: int) -> int:
    """The length row `sample` of the prompt with `key` (seed, iteration, prompt index) is cut at.

    >>> tail_length((0, 0, 0), 0, 512) == tail_length((0, 0, 0), 0, 512), tail_length((0, 0, 0), 0, 1)
    (True, 1)
    """
    u = ((engine.row_seed((*key, 1 << 20), sample) & ((1 << 53) - 1)) + 0.5) / (1 << 53)  # in (0, 1)
    z = statistics.NormalDist().inv_cdf(u)
    return max(1, min(max_new_tokens, math.ceil(max_new_tokens * math.exp(SIGMA * (z - Z_CAP)))))


def add_tail_option(parser, part: str = "") -> None:
    """A benchmark's --tail option (`TAILS`): rows to the cap, with the tail, or both side by side (the default)."""
    parser.add_argument("--tail", choices=tuple(TAILS), default="both",
                        help=f"{part}rows to the cap (off), ended at lengths drawn from GSM8K's answer lengths (on: "
                             "benchmarks/tail.py), or both, side by side")


def is_on() -> bool:
    return os.environ.get(TAIL_ENV) == "1"


def install(rollouts: type = engine.GenerateCall) -> None:
    """Patch engine.GenerateCall (once; or another copy's, `rollouts`) so that, while the tail is on (`is_on` when a
    call starts), row i of prompt j stops at tail_length(keys[j], i, M). Off: the engine as it is."""
    if getattr(rollouts, "tail_installed", False):
        return
    original_init, original_record = rollouts.__init__, rollouts.record

    def __init__(self, model, prompts, group_size, max_new_tokens, temperature, top_p, stop_ids, keys, *args,
                 **kwargs):
        original_init(self, model, prompts, group_size, max_new_tokens, temperature, top_p, stop_ids, keys, *args,
                      **kwargs)
        self.tail_caps = None
        if is_on():
            caps = [tail_length(tuple(keys[j]), i, max_new_tokens) for j in range(len(prompts))
                    for i in range(group_size)]
            self.tail_caps = torch.tensor(caps + [max_new_tokens], device=self.device)  # (C·G + 1,) stand-in last

    def record(self, rows, lengths, running, new):
        if self.tail_caps is not None:  # token L of the row is its stop id: it ends as if the model had stopped
            new = torch.where(running & (lengths + 1 >= self.tail_caps[rows]), self.stop_ids[0], new)  # (n,)
        original_record(self, rows, lengths, running, new)

    rollouts.__init__, rollouts.record, rollouts.tail_installed = __init__, record, True


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """The tail on (or off) for the block: in this process and in every process it starts meanwhile."""
    install()
    saved = os.environ.get(TAIL_ENV)
    os.environ[TAIL_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[TAIL_ENV]
        else:
            os.environ[TAIL_ENV] = saved


install()  # in a spawned inference process too: it imports this module again as its script's, or through bench.py

if __name__ == "__main__":  # python -m benchmarks.tail trainer.py ARGS: trainer.py's run, with the tail (this
    # module stays the script, so that the spawned inference process imports it again, and patches its engine)
    import trainer
    if sys.argv[1:2] != ["trainer.py"]:
        raise SystemExit("usage: python -m benchmarks.tail trainer.py [trainer options]")
    os.environ[TAIL_ENV] = "1"
    trainer.exit_without_lingering(trainer.main(sys.argv[2:]))
