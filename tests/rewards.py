"""Reward functions used by the tests, loaded by the trainer as 'tests/rewards.py:NAME'."""
import functools
import os
import sys
import time
from pathlib import Path


def digit_fraction(prompt: str, completion: str, answer: str) -> float:
    """Varies a lot even for an untrained model, so every group has a learning signal."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def raising_reward(prompt: str, completion: str, answer: str) -> float:
    raise ValueError("this reward function is broken on purpose")


def nan_reward(prompt: str, completion: str, answer: str) -> float:
    return float("nan")


def hanging_reward(prompt: str, completion: str, answer: str) -> float:
    """Never returns; first touches the file $PERIODIC_RL_TEST_MARKER, so a test knows when the hang began."""
    Path(os.environ["PERIODIC_RL_TEST_MARKER"]).touch()
    while True:
        time.sleep(3600)


def exiting_reward(prompt: str, completion: str, answer: str) -> float:
    sys.exit(0)


def digit_count(prompts: list, completions: list, completion_ids: list, **kwargs) -> list[float]:
    """TRL's batched form: each completion's digits, up to 4, over 4 (called once per group, with keyword lists)."""
    assert len(prompts) == len(completions) == len(completion_ids) == len(kwargs["answer"])
    return [min(sum(c.isdigit() for c in text), 4) / 4 for text in completions]


def digit_fraction_worker_0_slow(prompt: str, completion: str, answer: str) -> float:
    """digit_fraction, 0.1 s late in inference worker 0 (process name periodic-rl-inference-0): its groups reach
    the trainer after those of worker 1, whatever the scheduler does."""
    import multiprocessing
    if multiprocessing.current_process().name == "periodic-rl-inference-0":
        time.sleep(0.1)
    return digit_fraction(prompt, completion, answer)


async def length_reward(completions: list, target_len: list, trainer_state, **kwargs) -> list[float]:
    """TRL's form, async (awaited by TRL 1.16 too), for a prompt-only dataset: minus how far each completion's length
    is from its row's `target_len` column; checks the trainer_state it gets is transformers' and within the run."""
    import asyncio

    from transformers import TrainerState
    await asyncio.sleep(0.01)  # a reward that waits (an API call): awaited together with the others
    assert isinstance(trainer_state, TrainerState) and 0 <= trainer_state.global_step <= trainer_state.max_steps
    return [-abs(len(text) - target) for text, target in zip(completions, target_len, strict=True)]


def step_reward(completions: list, trainer_state, **kwargs) -> list[float]:
    """trainer_state.global_step for every completion: the logs show which step each iteration's rewards saw."""
    return [float(trainer_state.global_step)] * len(completions)


def pooled_length(completions: list, **kwargs) -> list[float]:
    """A TRL-style reward that scores in a process pool of its own, as sandboxed code-execution rewards do."""
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(2) as pool:
        return [float(n) for n in pool.map(len, completions)]


KEPT_POOLS: list = []


def kept_pool_length(completions: list, **kwargs) -> list[float]:
    """A TRL-style reward that keeps process pools for the whole run, started at its first call, as a reward that
    starts its sandboxes once does: one per start method in $REWARD_POOL_START (comma-separated: fork, spawn,
    forkserver; unset: one, Python's default), each scoring the completions."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor
    if not KEPT_POOLS:
        KEPT_POOLS.extend(ProcessPoolExecutor(2, mp_context=multiprocessing.get_context(start or None))
                          for start in os.environ.get("REWARD_POOL_START", "").split(","))
    scores = [[float(n) for n in pool.map(len, completions)] for pool in KEPT_POOLS]
    return scores[0]


def logging_length(completions: list, log_metric, log_extra, **kwargs) -> list[float]:
    """A TRL-style reward that logs with TRL's log_metric (the mean length) and log_extra (each length as text)."""
    lengths = [float(len(text)) for text in completions]
    log_metric("length/mean", sum(lengths) / len(lengths))
    log_extra("length_text", [str(int(n)) for n in lengths])
    return lengths


class Scaled:
    """A callable object as a reward (TRL takes any callable): digit_fraction times a factor."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return self.factor * digit_fraction(prompt, completion, answer)


scaled_half = Scaled(0.5)  # found by this name in every process


def _made(prompt: str, completion: str, answer: str) -> float:
    return 1.0


made_reward = functools.partial(_made)  # a partial at a module's top level: found by this name
