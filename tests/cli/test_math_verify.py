"""`--reward math-verify`: answers checked as the field checks them, on hand-written LaTeX and
on real GSM8K lines, in the main thread (math-verify's SIGALRM timeouts, under --reward-timeout's clock) and off it."""
import json
import threading

import pytest
from conftest import GSM8K_DIR

from infra.data import dataset_examples, load_splits
from infra.math_verify_reward import math_verify_reward
from infra.reward import Rewards, load_reward
from infra.scoring import score_group
from infra.tasks import math_reward


@pytest.mark.parametrize("gold, completion, expected", [
    ("0.5", r"The answer is \boxed{\frac{1}{2}}", 1.0),
    (r"\frac{1}{2}", r"so it is \boxed{0.5}.", 1.0),
    (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}", 0.0),
    (r"2\sqrt{2}", r"\boxed{\sqrt{8}}", 1.0),
    (r"2\sqrt{2}", r"\boxed{2\sqrt{3}}", 0.0),
    (r"\dfrac{3}{4}", r"so we get $\frac{6}{8}$.", 1.0),
    (r"\{1,2\}", r"\boxed{\{2,1\}}", 1.0),
    (r"\{1,2\}", r"\boxed{\{1,3\}}", 0.0),
    ("(0,1]", r"\boxed{(0,1]}", 1.0),
    ("(0,1]", r"\boxed{[0,1]}", 0.0),
    ("x^2+1", r"\boxed{1+x^2}", 1.0),
    (r"\frac{\pi}{2}", r"\boxed{\frac{\pi}{2}}", 1.0),
    (r"\pi", r"\boxed{3.14}", 0.0),
    ("-3", r"First 2 - 5 = -3, so \boxed{-3}", 1.0),
    ("1080", "The total is 1,080 dollars.\n#### 1,080", 1.0),
    ("", "anything", None),
    # as instruct models write GSM8K answers: a '####' that gives no answer is not read
    ("72", "#### Step 2: Total of 24 + 48\n$\\boxed{72}$", 1.0),
    ("72", "The answer is 72.\n#### ", 1.0),
    ("72", "So she earns 72 dollars.\n#### 72\n#### Verification\n72 / 3 = 24", 1.0),
    (r"\frac{1}{2}", "#### \\frac{1}{2}\n#### Check", 1.0),
])
def test_hand_written_latex_answers(gold, completion, expected):
    """Claim: equal values in other LaTeX forms earn the reward (fractions, decimals, roots, sets, intervals,
    polynomials, π), other values do not, and a gold that does not parse is not scored (None, as TRL's
    accuracy_reward); a boxed answer is read first, then the last '####' that gives one (not an empty one, not a
    Markdown heading)."""
    assert math_verify_reward([completion], [gold]) == [expected]


def test_it_checks_what_the_final_number_reward_cannot():
    """Claim (teeth): the GSM8K final-number reward gives 0 where math-verify sees an equal value."""
    assert math_reward("", r"\boxed{\frac{1}{2}}", "0.5") == 0.0 and math_reward("", r"\boxed{\sqrt{8}}", "2") == 0.0
    assert math_verify_reward([r"\boxed{\frac{1}{2}}"], ["0.5"]) == [1.0]


@pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason="GSM8K not found (PERIODIC_RL_GSM8K)")
def test_real_gsm8k_lines_in_the_main_thread_and_off_it():
    """Claim: on the first 40 lines of GSM8K's test split (a reference solution ending '#### N', N up to 1,450,000
    or negative), math-verify gives 1.0 to the reference solution itself, to a completion ending '\\boxed{N}' and to
    one ending '#### N', and 0.0 to '\\boxed{N+1}', against the gold N (Example.answer) and against the raw solution
    as a dataset `answer` column; called through score_group under a time limit in the main thread (its SIGALRM
    timeouts inside RewardClock's), and in a worker thread (timeouts off: it would raise there otherwise)."""
    path = GSM8K_DIR / "test.jsonl"
    solutions = [json.loads(line)["answer"] for line in path.read_text().splitlines()[:40]]
    examples = list(zip(dataset_examples(load_splits(str(path))["train"].select(range(40)), "question", "answer",
                                         "gsm8k test"), solutions))
    rewards = Rewards([load_reward("math-verify")], [1.0])
    results = []
    for example, solution in examples:
        n = example.answer
        completions = [solution, f"Adding it up gives \\boxed{{{n}}}.", f"So that is it.\n#### {n}",
                       f"\\boxed{{{int(float(n)) + 1}}}"]
        for columns in ({}, {"answer": solution}):
            results.append(score_group(rewards, example.prompt, n, columns, completions, [[1]] * 4, time_limit=5)[0])
    assert results == [[1.0, 1.0, 1.0, 0.0]] * 80
    worker = []
    example, solution = examples[0]
    thread = threading.Thread(target=lambda: worker.append(math_verify_reward([solution, r"\boxed{0}"],
                                                                              [example.answer] * 2)))
    thread.start()
    thread.join()
    assert worker == [[1.0, 0.0]]

