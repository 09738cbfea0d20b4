"""MATH-style answers, checked the way the field checks them: Hugging Face's math-verify (`--reward math-verify`).

    r_j = 1.0 if verify(parse(gold), parse(completion_j)) else 0.0       None if the gold does not parse

math-verify parses both sides into SymPy (\\boxed{}, \\frac, \\sqrt, sets, intervals, plain numbers) and compares
them numerically and symbolically: `\\boxed{\\frac{1}{2}}` earns the reward for the gold 0.5, `\\boxed{\\sqrt{8}}`
for `2\\sqrt{2}`. It is TRL's `trl.rewards.accuracy_reward` (a batched reward, infra/reward.py), changed for GSM8K:

1. The gold is the text after GSM8K's '####' when there is one; bare LaTeX ('2\\sqrt{2}': no $, \\( or \\boxed)
   is read as if between $...$ (math-verify reads the bare text '2\\sqrt{2}' as 2).
2. A completion with a \\boxed{} is read by math-verify's extraction, the boxed answer first (TRL's); else the
   same way as the gold after its last '####' that gives an answer (tasks.marked_answer: not an empty '#### ' at
   the end, nor a Markdown heading '#### Step 2: ...'); else by math-verify's default extraction: an anchored
   answer ('the final answer is $...$'), the last LaTeX between $...$, then a plain number or expression ('the
   answer is 18', the last number). TRL reads LaTeX only, and only anchored, so it gives 0 to '$\\frac{1}{2}$'
   alone and to GSM8K-style plain numbers.

Timeouts: math-verify bounds each parse and comparison with SIGALRM, which only the main thread receives: on
in the main thread (the trainer's in sync mode, the inference process's in async mode), off elsewhere, as TRL
does. --reward-timeout's clock (scoring.RewardClock) uses SIGUSR1 and raises a BaseException, which
math-verify's `except Exception` does not swallow: the two limits do not meet.
"""
from __future__ import annotations

import logging
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from infra.tasks import marked_answer

PARSE_SECONDS, VERIFY_SECONDS = 10, 5  # TRL's accuracy_reward's limits (math-verify's are whole seconds)
COMPLETION = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]  # \boxed{} first, then LaTeX,
# then a plain number or expression (GSM8K style)


def final_part(text: str) -> str:
    """The text after the last '####' (GSM8K's answer line), if any; bare LaTeX wrapped in $...$.

    >>> final_part("She sells 16 - 3 - 4 = 9 eggs.\\n#### 9"), final_part("2\\\\sqrt{2}")
    ('$9$', '$2\\\\sqrt{2}$')
    """
    text = text.rsplit("####", 1)[-1].strip()
    return text if any(mark in text for mark in ("$", "\\(", "\\[", "\\boxed")) else f"${text}$"


def math_verify_reward(completions: list, answer: list[str], **kwargs) -> list[float | None]:
    """1.0 where a completion's answer equals the gold `answer` by math-verify, else 0.0; None (not scored) where the
    gold does not parse. Completions are text or, for conversations, [{"role": "assistant", "content": text}]."""
    main = threading.current_thread() is threading.main_thread()  # SIGALRM reaches the main thread only
    parse_seconds, verify_seconds = (PARSE_SECONDS, VERIFY_SECONDS) if main else (None, None)
    if not main:  # math-verify warns on every call that its timeouts are off
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    golds = {gold: parse(final_part(gold), parsing_timeout=parse_seconds) for gold in set(answer)}
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        if not golds[gold]:
            rewards.append(None)
            continue
        marked = None if "\\boxed" in text else marked_answer(text)
        predicted = parse(text if marked is None else final_part(marked), extraction_config=COMPLETION,
                          extraction_mode="first_match", parsing_timeout=parse_seconds)
        rewards.append(float(verify(golds[gold], predicted, timeout_seconds=verify_seconds)))
    return rewards
