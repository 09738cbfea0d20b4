"""infra/reward.py's two forms and several weighted rewards: a TRL-style batched reward gets TRL's
keyword lists, its failures are one line each, None is 'not scored', and weighted rewards add up and are logged
each on its own, in both modes."""
import asyncio
import functools
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from faults import hang_bound
import torch

import grpo
import trainer
from infra import checkpoint
from infra.command_line import parse_args
from infra.reward import RewardError, Rewards, is_batched, load_rewards, needed_columns
from infra.scoring import score, score_batch, score_group, trainer_state, trl_arguments, weighted_total
from learner import mean_std
import warm

ROOT = Path(__file__).resolve().parents[2]


def accuracy_reward(completions, solution, **kwargs):  # TRL's trl.rewards.accuracy_reward signature
    return [1.0] * len(completions)


@pytest.mark.parametrize("function, batched", [
    (lambda prompt, completion, answer: 1.0, False),
    (lambda prompt, completion, answer, **kwargs: 1.0, False),
    (lambda prompts, completions, **kwargs: [1.0], True),
    (accuracy_reward, True),
    (lambda **kwargs: [1.0], True),
    (functools.partial(accuracy_reward, solution=["1"]), True),
])
def test_the_form_is_told_by_the_parameter_names(function, batched):
    """Claim: the documented rule: a parameter `prompts` or `completions`, or **kwargs without `completion`, is TRL's
    batched form (TRL's own accuracy_reward included); (prompt, completion, answer) is the plain form."""
    assert is_batched(function) is batched


@pytest.mark.parametrize("prompt, answer, columns, completions", [
    ("1+1=", "2", {}, ["2", "3"]),
    ([{"role": "user", "content": "1+1?"}], "2", {"level": 1},
     [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "3"}]]),
    ("1+1=", "2", {"answer": "1+1 = 2\n#### 2", "prompt": "hidden", "trainer_state": "column"}, ["2", "3"]),
    ("Say hi", None, {"target_len": 3}, ["2", "3"]),
], ids=["text", "conversation", "own-answer-column", "prompt-only"])
def test_a_batched_reward_gets_trls_keyword_lists(prompt, answer, columns, completions):
    """Claim: a batched reward is called once per group, with keywords only, as TRL's _calculate_rewards calls it:
    prompts and completions (a conversation's completions as assistant messages), completion_ids, each dataset
    column as a list of G values, and trainer_state; `answer` is the gold answer unless the row has its own `answer`
    column (passed as it is), and not there when the data has none (a prompt-only dataset); a column named
    prompt/completion/completion_ids/trainer_state is left out, as TRL does; and TRL's log_metric and log_extra, into
    the group's RewardLogs, where a column adds up over calls, as TRL extends it, and must end the group with one
    value per completion (its values could not be matched to the completions: they were dropped). None means 'not
    scored' (NaN)."""
    from infra.scoring import RewardLogs
    calls, state, logs = [], object(), RewardLogs()

    def recorder(*args, **kwargs):  # **kwargs alone: the batched form
        calls.append((args, kwargs))
        kwargs["log_metric"]("my/len", 2.0)
        kwargs["log_extra"]("note", ["a", "b"])
        return [1.0, None]
    values = score_group(Rewards([recorder], [1.0]), prompt, answer, columns, ["2", "3"], [[5, 0], [6]], state=state,
                         logs=logs)
    gold = {} if answer is None else {"answer": [answer] * 2}
    expected = {"prompts": [prompt, prompt], "completions": completions, "completion_ids": [[5, 0], [6]], **gold,
                **{k: [v] * 2 for k, v in columns.items() if k not in ("prompt", "trainer_state")},
                "trainer_state": state, "log_metric": logs.log_metric, "log_extra": logs.log_extra}
    assert calls == [((), expected)]
    assert values[0][0] == 1.0 and math.isnan(values[0][1])
    assert (logs.metrics, logs.columns) == ({"my/len": [2.0]}, {"note": ["a", "b"]})
    with pytest.raises(ValueError, match=r"log_metric\('x', nan\): the value must be a finite number"):
        logs.log_metric("x", float("nan"))
    with pytest.raises(ValueError, match=r"log_extra\('note', ...\): 3 values for the group's 2 completions"):
        logs.log_extra("note", ["c"])  # its values could not be matched to the completions
    one_by_one = RewardLogs()  # TRL extends a column: one call per completion adds up to the group's

    def per_completion(completions, log_extra, **kwargs):
        for text in completions:
            log_extra("text", [text])
        return [0.0] * len(completions)
    score_group(Rewards([per_completion], [1.0]), prompt, answer, columns, ["2", "3"], [[5, 0], [6]], logs=one_by_one)
    assert one_by_one.columns == {"text": completions}  # as the reward got them (messages for a conversation)

    def short(completions, log_extra, **kwargs):
        log_extra("short", completions[:1])
        return [0.0] * len(completions)
    with pytest.raises(RewardError, match=r"log_extra\('short', ...\) gave 1 values for the 2 completions"):
        score_group(Rewards([short], [1.0]), prompt, answer, columns, ["2", "3"], [[5, 0], [6]], logs=RewardLogs())


def reward_len(completions, **kwargs):  # TRL's prompt-only example
    return [-abs(20 - len(completion)) for completion in completions]


@pytest.mark.parametrize("function, columns", [
    (lambda prompt, completion, answer: 1.0, ["answer"]),
    (lambda prompt, completion, answer=None: 1.0, []),
    (lambda prompt, completion, *rest: 1.0, []),
    (reward_len, []),
    (accuracy_reward, ["solution"]),
    (functools.partial(accuracy_reward, solution=["1"]), []),
    (lambda completions, answer, trainer_state, completion_ids, **kwargs: [], ["answer"]),
    (lambda prompts, completions, *, level, weight=1.0, **kwargs: [], ["level"]),
], ids=["plain", "plain-default", "plain-args", "reward_len", "accuracy_reward", "partial", "trl-keywords",
        "keyword-only"])
def test_the_columns_a_reward_needs_are_read_from_its_parameters(function, columns):
    """Claim: a plain reward needs the gold answer (its third argument, unless that has a default); a TRL-style one
    needs each parameter without a default that TRL's own keywords (prompts, completions, completion_ids,
    trainer_state) do not fill: math-verify 'answer', TRL's accuracy_reward 'solution', reward_len nothing."""
    assert needed_columns(function) == columns


def test_the_run_names_the_reward_that_needs_a_column():
    """Claim: Rewards.needed_columns maps each needed column to the first --reward that needs it, as given."""
    rewards = load_rewards(["tests/rewards.py:length_reward", "math-verify", "math"])
    assert rewards.needed_columns() == {"target_len": "--reward tests/rewards.py:length_reward",
                                        "answer": "--reward math-verify"}
    assert Rewards([reward_len], [1.0]).needed_columns() == {}


def test_a_reward_that_needs_an_answer_without_one_is_one_line():
    """Claim: scoring a group whose example has no gold answer with a reward that needs one (data.load_task refuses
    that data first) is one RewardError line naming the function, never a crash inside it."""
    def plain(prompt, completion, answer):
        return 1.0
    with pytest.raises(RewardError, match=r"^reward function 'plain' needs the gold answer, and the data has none"):
        score_group(Rewards([plain], [1.0]), "p", None, {}, ["x"], [[1]])
    assert score_group(Rewards([reward_len], [1.0]), "p", None, {}, ["x" * 20], [[1]]) == [[0.0]]


def test_trainer_state_is_transformers_with_the_runs_steps():
    """Claim: trainer_state is a transformers.TrainerState (TRL passes its Trainer's): global_step counts the
    optimizer steps before iteration k's rollouts (k x --updates-per-iteration), max_steps the run's, epoch the passes
    over the training prompts so far; a batched reward gets it by keyword, a fresh one when none is given."""
    from transformers import TrainerState
    cfg = parse_args(["--iterations", "10", "--batch-size", "64", "--group-size", "8"])  # 8 prompts an iteration
    state = trainer_state(cfg, iteration=3, num_examples=32)
    assert isinstance(state, TrainerState)
    assert (state.global_step, state.max_steps, state.epoch, state.num_train_epochs) == (3, 10, 0.75, 3)
    two = trainer_state(parse_args(["--iterations", "10", "--updates-per-iteration", "2"]), 3, 32)
    assert (two.global_step, two.max_steps) == (6, 20)
    assert trl_arguments("p", "1", {}, ["x"], [[1]])["trainer_state"] == TrainerState()


# --- async rewards (TRL 1.16 awaits them concurrently) ---
def test_async_rewards_are_awaited_together_after_the_sync_ones():
    """Claim: `async def` rewards of either form are awaited (batched: one call per group; plain: one per
    completion), all of a group's async calls concurrently (two 0.3 s waits, a batched one and a plain one over 2
    completions, all begin before any ends), after the sync rewards, which run first and in order; the values come back
    in reward order; and the calls run on one event loop that outlives them (a client bound to it keeps working)."""
    order, loops = [], []

    async def slow_batched(prompts, completions, **kwargs):
        order.append("async batched")
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.3)
        order.append("done")
        return [1.0, None]

    async def slow_plain(prompt, completion, answer):
        order.append("async plain")
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.3)
        order.append("done")
        return len(completion)

    def sync_batched(completions, **kwargs):
        order.append("sync")
        return [0.5, 0.5]
    rewards = Rewards([slow_batched, sync_batched, slow_plain], [1.0, 1.0, 1.0])
    values = score_group(rewards, "p", "a", {}, ["x", "yz"], [[1], [2]], time_limit=5)
    assert values[0][0] == 1.0 and math.isnan(values[0][1]) and values[1:] == [[0.5, 0.5], [1.0, 2.0]]
    assert order == ["sync", "async batched", "async plain", "async plain", "done", "done", "done"]  # all at once
    score_group(rewards, "p", "a", {}, ["x", "yz"], [[1], [2]])
    assert len(set(loops)) == 1 and loops[0].is_running()  # the same loop, still running, for the next group
    assert score(slow_plain, "p", "abc", "a") == 3.0  # the one-call helpers await too
    assert score_batch(slow_batched, {"prompts": ["p"] * 2, "completions": ["x", "y"]})[0] == 1.0


def test_an_async_reward_that_fails_is_one_line_naming_it():
    """Claim: an async reward that raises (SystemExit too), runs past --reward-timeout (the group's async calls share
    the clock, from their common start) or returns something that is not a reward is one RewardError line naming
    it and the sample, as a sync one; the event loop survives it and serves the next call."""
    async def broken(prompts, completions, **kwargs):
        raise ValueError("broken on purpose")

    async def exiting(prompt, completion, answer):
        sys.exit(3)

    async def stuck(prompts, completions, **kwargs):
        await asyncio.sleep(60)

    async def wrong(prompts, completions, **kwargs):
        return "1.0"

    async def fine(prompts, completions, **kwargs):
        await asyncio.sleep(0.1)
        return [1.0] * len(completions)
    group = ("p", "a", {}, ["x", "y"], [[1], [2]])
    with pytest.raises(RewardError, match=r"broken' raised ValueError: broken on purpose \(at \S+test_reward_forms.py, "
                                          r"line \d+: raise ValueError\(\"broken on purpose\"\)\) \(prompt 'p', 2 "
                                          r"completions"):
        score_group(Rewards([fine, broken], [1.0, 1.0]), *group)
    with pytest.raises(RewardError, match=r"exiting' raised SystemExit: 3 \(at \S+, line \d+: sys.exit\(3\)\) "
                                          r"\(prompt 'p', completion 'x', answer 'a'\)"):
        score_group(Rewards([exiting], [1.0]), *group)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"stuck' did not return within 0.5 s \(--reward-timeout"):
        score_group(Rewards([fine, stuck], [1.0, 1.0]), *group, time_limit=0.5)
    assert time.monotonic() - start < hang_bound(2)
    with pytest.raises(RewardError, match=r"wrong' returned a str \('1.0'\): return a list of 2 numbers"):
        score_group(Rewards([wrong], [1.0]), *group)
    assert score_group(Rewards([fine], [1.0]), *group) == [[1.0, 1.0]]
    assert next(t for t in threading.enumerate() if t.name == "reward-event-loop").daemon


def test_a_sync_reward_failing_leaves_no_coroutine_unawaited(recwarn):
    """Claim: when a sync reward fails after an async one was called, the async one's coroutine is closed, not left
    to warn 'never awaited'."""
    async def later(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    def broken(prompts, completions, **kwargs):
        raise ValueError("no")
    with pytest.raises(RewardError, match="broken' raised ValueError"):
        score_group(Rewards([later, broken], [1.0, 1.0]), "p", "a", {}, ["x"], [[1]])
    import gc
    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def test_a_plain_reward_is_called_once_per_completion():
    """Claim: the plain form is called as before, f(prompt, completion, answer) per completion, in order."""
    calls = []

    def plain(prompt, completion, answer):
        calls.append((prompt, completion, answer))
        return len(completion)
    assert score_group(Rewards([plain], [1.0]), "p=", "7", {"x": 1}, ["a", "bcd"], [[1], [2]]) == [[1.0, 3.0]]
    assert calls == [("p=", "a", "7"), ("p=", "bcd", "7")]


@pytest.mark.parametrize("returned, said", [
    ([1.0], "returned 1 values for 2 completions: return one per completion"),
    ("1.0", "returned a str ('1.0'): return a list of 2 numbers"),
    (0.5, "returned a float (0.5): return a list of 2 numbers"),
    (None, "returned None: return a list of 2 numbers"),
    (np.ones((2, 2)), "returned an array of shape (2, 2)"),
    ([1.0, float("inf")], "returned inf, not a finite number for completion 1: return a real number, or None"),
    ([1.0, "x"], "returned a str ('x') for completion 1"),
    ([1.0, "nan"], "returned a str ('nan') for completion 1"),
], ids=["short", "str", "float", "None", "2-d", "inf", "str-item", "str-nan"])
def test_a_wrong_batched_result_is_one_line(returned, said):
    """Claim: a batched reward that does not return one real number or None per completion is refused in one line
    naming the function, what it returned and the prompt (TRL would fail later, or train on NaN)."""
    def batched(prompts, completions, **kwargs):
        return returned
    with pytest.raises(RewardError) as error:
        score_group(Rewards([batched], [1.0]), "1+1=", "2", {}, ["2", "3"], [[1], [2]])
    assert f"'test_a_wrong_batched_result_is_one_line.<locals>.batched' {said}" in str(error.value)
    assert "prompt '1+1='" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("returned", [np.array([1.0, 0.5]), torch.tensor([1.0, 0.5]), (1, 0.5),
                                      [np.float32(1.0), None], [True, False], np.array([True, False]),
                                      [1.0, float("nan")], torch.tensor([1.0, float("nan")])],
                         ids=["numpy", "tensor", "tuple", "float32-None", "bools", "numpy-bools", "nan", "tensor-nan"])
def test_batched_results_torch_would_take_are_taken(returned):
    """Claim: what TRL turns into a tensor (a list, tuple, 1-d array or tensor of real numbers or bools, None) is
    accepted; a bool counts 1 or 0, as in TRL's float32 tensor of the list; NaN skips the completion as None does
    (TRL makes None NaN and sums with nansum: the two are one)."""
    values = score_group(Rewards([lambda completions, **kwargs: returned], [1.0]), "p", "a", {}, ["x", "y"], [[1], [2]])
    skipped = returned[1] is None or math.isnan(float(returned[1]))
    second = None if skipped else {0.5: 0.5, False: 0.0}[float(returned[1])]
    assert values[0][0] == 1.0 and (values[0][1] == second or skipped and math.isnan(values[0][1]))


def test_a_batched_reward_raising_or_hanging_is_one_line():
    """Claim: a batched reward that raises, or runs past the time limit of its one call, is a RewardError line."""
    def broken(prompts, completions, **kwargs):
        raise ValueError("broken on purpose")

    def stuck(prompts, completions, **kwargs):
        time.sleep(60)
    with pytest.raises(RewardError, match=r"broken' raised ValueError: broken on purpose \(at \S+test_reward_forms.py, "
                                          r"line \d+: raise ValueError\(\"broken on purpose\"\)\) \(prompt 'p', 2 "
                                          r"completions"):
        score_group(Rewards([broken], [1.0]), "p", "a", {}, ["x", "y"], [[1], [2]])
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"stuck' did not return within 0.5 s \(--reward-timeout"):
        score_group(Rewards([stuck], [1.0]), "p", "a", {}, ["x", "y"], [[1], [2]], time_limit=0.5)
    assert time.monotonic() - start < hang_bound(5)


def test_weighted_rewards_add_up_and_unscored_responses_leave_the_baseline():
    """Claim: the reward trained on is Σ_k w_k r_k over the rewards that scored a response (TRL's nansum); a response
    no reward scored is NaN, and then gets advantage 0 while the others get exactly the advantages of a group made of
    them alone (TRL #5902) (up to float32 rounding of the two ways of summing: 1e-6); its logged mean skips it."""
    nan = float("nan")
    per_reward = [[1.0, 0.0, nan, 1.0], [nan, 0.5, nan, 0.25]]
    totals = weighted_total(per_reward, [1.0, 2.0])
    assert totals[:2] + totals[3:] == [1.0, 1.0, 1.5] and math.isnan(totals[2])
    advantages = grpo.group_advantages(torch.tensor(totals), group_size=4)
    alone = grpo.group_advantages(torch.tensor([1.0, 1.0, 1.5]), group_size=3)
    assert advantages[2] == 0 and torch.allclose(advantages[[0, 1, 3]], alone, atol=1e-6)
    assert advantages.abs().sum() > 0  # the scored ones do learn
    assert mean_std(totals) == pytest.approx((7 / 6, torch.tensor([1.0, 1.0, 1.5]).std().item()))
    assert mean_std([nan, nan]) == (None, None) and mean_std([2.0]) == (2.0, None)


def test_reward_names_are_trls_and_unique():
    """Claim: each reward is logged under its function's __name__ (through functools.partial, as TRL's
    get_callable_name), numbered when two share it, so no column overwrites another."""
    def f(prompt, completion, answer):
        return 0.0
    assert Rewards([f, accuracy_reward, f, functools.partial(f)], [1.0] * 4).names == ["f", "accuracy_reward", "f_2",
                                                                                       "f_3"]


def test_reward_is_repeatable_and_weights_default_to_one():
    """Claim: `--reward a --reward b` (or `--reward a b`) names two rewards, weighted 1.0 each unless
    --reward-weights gives one number per reward; not given, the reward is `math`."""
    assert (parse_args([]).reward, parse_args([]).reward_weights) == (["math"], [1.0])
    for argv in (["--reward", "a.py:f", "--reward", "b.py:g"], ["--reward", "a.py:f", "b.py:g"]):
        assert (parse_args(argv).reward, parse_args(argv).reward_weights) == (["a.py:f", "b.py:g"], [1.0, 1.0])
    assert parse_args(["--reward", "a.py:f", "b.py:g", "--reward-weights", "1", "0.2"]).reward_weights == [1.0, 0.2]


def test_a_checkpoint_with_the_old_single_reward_resumes(tmp_path):
    """Claim: a checkpoint written when `reward` was one string resumes as that one reward, and giving that reward
    again is not taken for a change; other rewards or weights change the run and are refused, naming the option."""
    cfg = parse_args(["--reward", "math", "--out", str(tmp_path)])
    (tmp_path / "checkpoint-1").mkdir()
    config = {**{k: v for k, v in vars(cfg).items() if k != "reward_weights"}, "reward": "math"}
    (tmp_path / "checkpoint-1" / "state.json").write_text(json.dumps(
        {"iterations_done": 1, "config": config, "reference_fingerprint": "x"}))
    state = checkpoint.read_state(tmp_path / "checkpoint-1")
    assert state["config"]["reward"] == ["math"]
    resumed = checkpoint.resumed_config(cfg, {"reward"}, state)
    assert resumed.reward == ["math"] and resumed.reward_weights == [1.0]
    for argv, option in ((["--reward", "math-verify"], "--reward"), (["--reward-weights", "0.5"], "--reward-weights")):
        with pytest.raises(checkpoint.CheckpointError, match=f"^{option} .* differs from the checkpoint's"):
            checkpoint.resumed_config(parse_args(argv), {option[2:].replace("-", "_")}, state)


@pytest.mark.slow
def test_a_prompt_only_dataset_with_trl_rewards_in_both_modes(tiny_model_dir, tmp_path, capsys):
    """Claim: a prompt-only dataset (TRL's 'prompt' column and a 'target_len' column, no
    answer) trains with TRL-style rewards, in both modes: an async one that reads the column and trainer_state, and
    one that returns trainer_state.global_step, which is the iteration's index; the async run (rewards and examples in
    the inference process) logs what the sync run logs. With --reward math the same data is refused before a model
    loads, in one line naming the reward and the column."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "target_len": 1 + i % 3}) + "\n"
                            for i in range(40)))
    args = [sys.executable, "trainer.py", "--model", str(tiny_model_dir), "--data", str(data), "--iterations", "3",
            "--batch-size", "8", "--group-size", "4", "--max-new-tokens", "4", "--eval-every", "1", "--eval-size", "4",
            "--eval-samples", "2", "--groups-per-call", "2", "--micro-batch-tokens", "16384", "--rollout-threads",
            "1", "--train-threads", "1", "--no-save"]
    rows = {}
    for mode in ("sync", "async"):
        result = warm.run([*args, "--mode", mode, "--out", str(tmp_path / mode), "--reward",
                                 "tests/rewards.py:length_reward", "--reward", "tests/rewards.py:step_reward"],
                                cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        rows[mode] = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    iterations = [row for row in rows["sync"] if not row.get("final")]
    assert [row["rewards/step_reward/mean"] for row in iterations] == [0.0, 1.0, 2.0]
    assert all(row["rewards/length_reward/mean"] <= 0 for row in iterations)
    keys = [key for key in rows["sync"][0] if key.startswith("reward") or key == "eval_reward"]
    assert [[row.get(k) for k in keys] for row in rows["sync"]] == [[row.get(k) for k in keys] for row in rows["async"]]
    capsys.readouterr()
    assert trainer.main([*args[2:], "--mode", "sync", "--out", str(tmp_path / "math")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert (f"--reward math needs a gold answer, and {data} (train split) has no column 'answer' to take it from; its "
            "columns are 'prompt', 'target_len'.") in err


@pytest.mark.slow
def test_weighted_rewards_of_every_kind_are_logged_each_on_its_own_in_both_modes(tiny_model_dir, tmp_path):
    """Claim: a run with a plain reward, a TRL-style batched one, math-verify, one that scores in a process pool of its
    own (ProcessPoolExecutor, as sandboxed code-execution rewards do) and one that logs with TRL's log_metric and
    log_extra, weights 1 0.5 0.25 0.125 0.0625, logs each reward's mean and std (TRL's `rewards/<name>/mean`) and
    trains on their weighted sum: reward_mean = Σ w_k mean_k (all responses scored: equal up to float32 rounding,
    1e-5 on values <= 4); the held-out evaluation is one number; each row has the logged metric's mean over the
    iteration (the mean length, which is the logging reward's mean) and completions.jsonl each completion's logged
    column. The async run, whose rewards run in the inference process (math-verify's SIGALRM timeouts in its main
    thread, the pool's processes started there, log_metric and log_extra sent from there), logs exactly what the
    sync run logs."""
    names = ["digit_fraction", "digit_count", "math_verify_reward", "pooled_length", "logging_length"]
    weights = [1.0, 0.5, 0.25, 0.125, 0.0625]
    rows = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        result = warm.run(
            [sys.executable, "trainer.py", "--model", str(tiny_model_dir), "--data", "arithmetic", "--iterations", "2",
             "--batch-size", "8", "--group-size", "4", "--max-new-tokens", "4", "--eval-every", "1", "--eval-size", "4",
             "--eval-samples", "2", "--groups-per-call", "2", "--micro-batch-tokens", "16384", "--rollout-threads",
             "1", "--train-threads", "1", "--no-save", "--log-completions", "--out", str(out), "--mode", mode,
             "--reward", "tests/rewards.py:digit_fraction", "--reward", "tests/rewards.py:digit_count",
             "--reward", "math-verify", "--reward", "tests/rewards.py:pooled_length",
             "--reward", "tests/rewards.py:logging_length", "--reward-weights", *map(str, weights)],
            cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        rows[mode] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        iterations = rows[mode][:-1]
        assert len(iterations) == 2
        for row in iterations:
            means = [row[f"rewards/{name}/mean"] for name in names]
            assert all(isinstance(row[f"rewards/{name}/std"], float) for name in names)
            assert row["reward"] == pytest.approx(sum(w * m for w, m in zip(weights, means)), abs=1e-5)
            assert isinstance(row["eval_reward"], float)
            assert row["rewards/pooled_length/mean"] > 0  # the pool's processes scored
            assert row["length/mean"] == pytest.approx(row["rewards/logging_length/mean"], abs=1e-6)
        records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        assert len(records) == 16 and all(r["extra"]["length_text"] == str(len(r["completion"])) for r in records)
    assert any(row["rewards/digit_count/mean"] > 0 for row in rows["sync"][:-1])  # the batched reward did score
    keys = [key for key in rows["sync"][0] if key.startswith("reward") or key in ("eval_reward", "length/mean")]
    assert [[row.get(k) for k in keys] for row in rows["sync"]] == [[row.get(k) for k in keys] for row in rows["async"]]


def test_a_reward_spec_missing_its_function_or_naming_a_model_says_what_to_write(tmp_path):
    """Claim: `--reward file.py` (no function) names the functions the file defines, read without running it, so the
    user can pick one; a Hub id (TRL's reward_funcs also takes a reward model's) says reward models are not supported
    and what a reward is here."""
    from infra.reward import RewardError, load_reward
    (tmp_path / "rewards.py").write_text("import os\n\ndef accuracy(completions, **kw):\n    return [0.0]\n\n"
                                         "async def length(completions, **kw):\n    return [1.0]\n\nos.exit(3)\n")
    with pytest.raises(RewardError, match=r"names a file, not the function in it: use '.*rewards.py:NAME', with NAME "
                                          r"one of: accuracy, length$"):
        load_reward(str(tmp_path / "rewards.py"))
    with pytest.raises(RewardError, match="looks like a model on the Hub: reward models are not supported here"):
        load_reward("OpenAssistant/reward-model-deberta-v3-large-v2")


def test_top_k_minus_one_is_off_as_in_trl():
    """Claim: TRL's and vLLM's top_k -1 (off) is taken as 0, this trainer's off; -2 is refused."""
    assert parse_args(["--top_k", "-1"]).top_k == 0
    with pytest.raises(SystemExit):
        parse_args(["--top-k", "-2"])
