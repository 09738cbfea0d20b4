"""Reward functions used by the tests, loaded by the trainer as 'tests/rewards.py:NAME'."""


def digit_fraction(prompt: str, completion: str, answer: str) -> float:
    """Varies a lot even for an untrained model, so every group has a learning signal."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def raising_reward(prompt: str, completion: str, answer: str) -> float:
    raise ValueError("this reward function is broken on purpose")


def nan_reward(prompt: str, completion: str, answer: str) -> float:
    return float("nan")
