"""Bad inputs end the run with one clear line (issue #13, part C): reward functions that hang, exit or return the
wrong type, unreadable data and reward files, models that cannot be trained, prompts longer than the context.

Pure checks run in-process; the end-to-end claims (exit code, one line, no traceback, how fast, nothing left
running) run `python trainer.py` in a subprocess, as tests/test_end_to_end.py does.
"""
import decimal
import fractions
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout import RewardError, score

ROOT = Path(__file__).resolve().parents[1]


# --- reward functions, in-process ---
@pytest.mark.parametrize("value", [np.float32(0.5), np.int64(1), torch.tensor(0.5), np.array(1.0), 1, 0.5,
                                   fractions.Fraction(1, 2), decimal.Decimal("0.5")],
                         ids=lambda v: type(v).__name__)
def test_every_real_scalar_is_a_reward(value):
    """Claim: a reward may return any one real number: numpy's float32 and int64, a 0-d tensor or array, int,
    float, Fraction, Decimal (numpy.float32 was refused as 'not a finite number' while numpy.float64 passed)."""
    assert score(lambda prompt, completion, answer: value, "1+1=", "2", "2") == float(value)


@pytest.mark.parametrize("value, said", [
    (True, "returned a bool (True)"), (np.bool_(False), "returned a bool"), ("1.0", "returned a str ('1.0')"),
    ([1.0], "returned a list ([1.0])"), (None, "returned None"), (np.ones(2), "returned an array of shape (2,)"),
    (float("nan"), "returned nan, not a finite number"), (np.float32("inf"), "returned inf, not a finite number"),
])
def test_a_wrong_reward_type_is_named(value, said):
    """Claim: a reward that is not one finite real number is refused in one line that says plainly what it was."""
    def odd(prompt, completion, answer):
        return value
    with pytest.raises(RewardError) as error:
        score(odd, "1+1=", "2", "2")
    assert f"odd' {said}" in str(error.value) and "\n" not in str(error.value)


def test_a_reward_that_exits_is_an_error_of_the_reward():
    """Claim: sys.exit() inside a reward is a RewardError (not the end of the run: a sync run exited 0 with nothing
    saved), while Ctrl-C (KeyboardInterrupt) still goes through to stop the run."""
    with pytest.raises(RewardError, match="raised SystemExit: 0"):
        score(lambda prompt, completion, answer: sys.exit(0), "1+1=", "2", "2")

    def interrupted(prompt, completion, answer):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        score(interrupted, "1+1=", "2", "2")


def test_a_reward_call_has_a_time_limit():
    """Claim: a reward call that runs past its limit is stopped there, in a sleep or in a Python loop that swallows
    exceptions, and named with the limit and the option; calls within it, and the limit 0, are untouched."""
    def stubborn(prompt, completion, answer):
        while True:
            try:
                time.sleep(60)
            except Exception:
                pass
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"stubborn' did not return within 0.5 s \(--reward-timeout"):
        score(stubborn, "1+1=", "2", "2", time_limit=0.5)
    assert time.monotonic() - start < 5
    assert score(lambda prompt, completion, answer: time.sleep(0.2) or 1.0, "1+1=", "2", "2", time_limit=0.5) == 1.0
    time.sleep(0.5)  # a late signal from the clock must not hit the code after a call that returned
    assert score(lambda prompt, completion, answer: 0.0, "1+1=", "2", "2", time_limit=0) == 0.0
