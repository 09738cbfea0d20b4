"""Bad inputs end the run with one clear line: reward functions that hang, exit or return the
wrong type, unreadable data and reward files, models that cannot be trained, prompts longer than the context.

Pure checks run in-process; the end-to-end claims (exit code, one line, no traceback, how fast, nothing left
running) run `python trainer.py` in a subprocess, as tests/cli/test_end_to_end.py does.
"""
import decimal
import fractions
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults
import trainer
import numpy as np
import pytest
import torch

from infra.reward import RewardError
from infra.scoring import score
import warm

ROOT = Path(__file__).resolve().parents[2]


# --- reward functions, in-process ---
@pytest.mark.parametrize("value", [np.float32(0.5), np.int64(1), torch.tensor(0.5), np.array(1.0), 1, 0.5,
                                   fractions.Fraction(1, 2), decimal.Decimal("0.5"), True, np.bool_(False),
                                   torch.tensor(True)],
                         ids=lambda v: f"{type(v).__name__}-{v}")
def test_every_real_scalar_is_a_reward(value):
    """Claim: a reward may return any one real number: numpy's float32 and int64, a 0-d tensor or array, int,
    float, Fraction, Decimal (numpy.float32 as numpy.float64), and a
    bool as 1 or 0, as TRL takes a list of bools (`return predicted == gold`)."""
    scored = score(lambda prompt, completion, answer: value, "1+1=", "2", "2")
    assert type(scored) is float and scored == float(value)


@pytest.mark.parametrize("value, said", [
    ("1.0", "returned a str ('1.0')"),
    ([1.0], "returned a list ([1.0])"), (None, "returned None"), (np.ones(2), "returned an array of shape (2,)"),
    (float("nan"), "returned nan, not a finite number"), (np.float32("inf"), "returned inf, not a finite number"),
    (1e40, "returned 1e+40, beyond float32's range (±3.4e+38), in which advantages are computed"),
    (10 ** 400, "returned an int too large for any float"),
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
    assert time.monotonic() - start < faults.hang_bound(5)
    assert score(lambda prompt, completion, answer: time.sleep(0.2) or 1.0, "1+1=", "2", "2", time_limit=0.5) == 1.0
    time.sleep(0.5)  # a late signal from the clock must not hit the code after a call that returned
    assert score(lambda prompt, completion, answer: 0.0, "1+1=", "2", "2", time_limit=0) == 0.0


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="shared memory is a size-limited file system on Linux only")
def test_a_full_shared_memory_is_reported_before_anything_is_made_there(monkeypatch):
    """Claim: with /dev/shm (nearly) full, async mode fails with the one line naming --shm-size before it puts
    anything there or starts the inference process (the weights' own size is checked before their buffer is
    allocated: tests/method/test_pipeline.py)."""
    import multiprocessing
    import shutil

    import inference
    import weights
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**20, 2**20 - 4096, 4096))
    with pytest.raises(weights.SharedMemoryError, match="--shm-size"):
        inference.AsyncRollouts("tiny", {}, [], [], "math")
    assert multiprocessing.active_children() == []


# --- end to end: python trainer.py in a subprocess ---
def trainer_args(model_dir, out, *extra) -> list[str]:
    """A tiny run with every size given (no probe), so it starts in seconds."""
    return [sys.executable, "trainer.py", "--model", str(model_dir), "--data", "arithmetic", "--iterations", "2",
            "--batch-size", "8", "--group-size", "4", "--max-new-tokens", "4", "--eval-every", "0",
            "--groups-per-call", "2", "--micro-batch-tokens", "16384", "--rollout-threads", "1",
            "--train-threads", "1", "--out", str(out), *map(str, extra)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hanging_reward_ends_the_run_within_its_limit(tiny_model_dir, tmp_path, mode):
    """Claim: a reward call that never returns ends the run, in either mode, within --reward-timeout plus a few
    seconds of its start: exit 1, one `error:` line naming the function, the limit and the option, no traceback,
    no process left running, nothing saved."""
    marker = tmp_path / "reward-started"
    process = warm.Popen(trainer_args(tiny_model_dir, tmp_path / "out", "--mode", mode, "--reward",
                                            "tests/rewards.py:hanging_reward", "--reward-timeout", "2"),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PERIODIC_RL_TEST_MARKER": str(marker)}, start_new_session=True)
    try:
        while not marker.exists():
            assert process.poll() is None, process.communicate()
            time.sleep(0.05)
        hang_began, children = time.monotonic(), faults.children(process.pid)  # PID -> start time
        _, err = process.communicate(timeout=60)
        elapsed = time.monotonic() - hang_began
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 1, err
    assert "hanging_reward' did not return within 2 s (--reward-timeout" in err and "Traceback" not in err
    assert err.count("error:") == 1 and err.strip().splitlines()[-1].startswith("error:"), err
    assert elapsed < faults.hang_bound(2 + 5), f"the run took {elapsed:.1f} s after the reward began to hang"
    deadline = time.monotonic() + 3  # the resource tracker exits when it sees the trainer's pipe close
    while any(faults.alive(*child) for child in children.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [child for child in children.items() if faults.alive(*child)], "a child process outlived the trainer"
    assert not (tmp_path / "out" / "policy").exists()


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_reward_that_calls_sys_exit_is_an_error(tiny_model_dir, tmp_path, capsys, mode):
    """Claim: a reward that calls sys.exit(0) fails the run in either mode: exit 1, one line naming the function and
    SystemExit, no traceback, no policy saved (sync exited 0 silently with nothing saved; async printed a
    traceback). Sync mode scores in the trainer's process: run in this one; async's inference process is a
    subprocess's."""
    args = trainer_args(tiny_model_dir, tmp_path, "--mode", mode, "--reward", "tests/rewards.py:exiting_reward")
    if mode == "sync":
        code, err = trainer.main(args[2:]), capsys.readouterr().err
    else:
        result = warm.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
        code, err = result.returncode, result.stderr
    assert code == 1, err
    assert "exiting_reward' raised SystemExit: 0" in err and "Traceback" not in err
    assert not (tmp_path / "policy").exists()


def test_a_prompt_longer_than_the_context_is_refused_at_start_up(tiny_model_dir, tmp_path, capsys):
    """Claim: a --data file with a prompt that leaves no room for --max-new-tokens in the model's context
    (max_position_embeddings: 4096 for the tiny model) is refused before training, naming the prompt's length."""
    import json
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(80)]
    rows[3]["question"] = "1+" * 2100 + "1?"  # 4202 bytes: 4202 tokens of the byte-level tiny tokenizer
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = trainer_args(tiny_model_dir, tmp_path / "out", "--mode", "sync", "--eval-size", "8")
    args[args.index("arithmetic")] = str(data)
    assert trainer.main(args[2:]) == 1
    out, err = capsys.readouterr()
    assert "the longest prompt is 4202 tokens" in err and "context of 4096 tokens" in err
    assert "iter " not in out and "Traceback" not in err


# --- rewards that misbehave in other ways, data that is not there or too big ---
LINGERING = """import threading, time
def reward(prompt, completion, answer):
    if not any(t.name == "flusher" for t in threading.enumerate()):  # a client library's background flusher
        threading.Thread(target=lambda: time.sleep(10**9), name="flusher").start()
    return 1.0
"""
CLOSES_STDOUT = """import sys
def reward(prompt, completion, answer):
    sys.stdout.close()
    return 1.0
"""


@pytest.mark.slow
def test_a_reward_thread_that_never_ends_does_not_hang_the_run(tiny_model_dir, tmp_path):
    """Claim: a reward that starts a thread that is not a daemon and never ends (a client library's
    flusher) does not hang the run after "done": the run exits 0 a few seconds after, with one line naming the thread, nothing left."""
    (tmp_path / "lingering.py").write_text(LINGERING)
    with faults.Launch(*trainer_args(tiny_model_dir, tmp_path / "out", "--mode", "sync", "--reward",
                                     f"{tmp_path / 'lingering.py'}:reward")[2:]) as run:
        run.wait_for(r"^done in ", timeout=300)
        run.signalled_at = time.monotonic()  # the time to exit is counted from "done"
        run.assert_stopped(0, r"^periodic-rl: exiting without waiting for thread\(s\) flusher \(not daemon threads")
    assert (tmp_path / "out" / "policy" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_reward_that_closes_stdout_is_one_line(tiny_model_dir, tmp_path):
    """Claim: a reward that closes sys.stdout ends the run with one line saying so, exit 1, no
    traceback."""
    (tmp_path / "closes.py").write_text(CLOSES_STDOUT)
    with faults.Launch(*trainer_args(tiny_model_dir, tmp_path / "out", "--mode", "sync", "--reward",
                                     f"{tmp_path / 'closes.py'}:reward")[2:]) as run:
        run.assert_stopped(1, r"^error: standard output was closed inside the run \(sys.stdout.close\(\) in a reward "
                              r"function, or in a library it calls\).* \(the run stopped before training ended: no "
                              r"policy was saved\)$", within=300)


@pytest.mark.slow
def test_a_reward_stuck_in_c_code_holding_the_gil_times_out_in_sync_mode(tiny_model_dir, tmp_path):
    """Claim: a reward stuck in C code that holds the GIL (a catastrophically backtracking regex) is
    stopped by --reward-timeout in sync mode too (the watchdog thread could not run to send its signal: it never
    fired); a timer on the process's CPU time does. One line, exit 1, within the limit and a few seconds."""
    with faults.Launch(*trainer_args(tiny_model_dir, tmp_path / "out", "--mode", "sync", "--reward",
                                     "tests/faults.py:frozen_reward", "--reward-timeout", "2")[2:]) as run:
        run.wait_for(r"^periodic-rl: sizes")
        run.signalled_at = time.monotonic()  # the first reward call is moments away
        run.assert_stopped(1, r"^error: .*reward function 'frozen_reward' did not return within 2 s \(--reward-timeout",
                           within=30)


@pytest.mark.slow
def test_a_huge_prompt_is_refused_before_it_is_tokenized(tiny_model_dir, tmp_path):
    """Claim: a 10 MB prompt is refused in one line after encoding only its start: the refusal comes within seconds of the start and names its size."""
    import json
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(80)]
    rows[3]["question"] = "1+" * 5_000_000 + "1?"
    data = tmp_path / "huge.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = trainer_args(tiny_model_dir, tmp_path / "out", "--mode", "sync", "--eval-size", "8")
    args[args.index("arithmetic")] = str(data)
    with faults.Launch(*args[2:]) as run:
        run.assert_stopped(1, r"^error: a prompt of 10000002 bytes \('1\+1\+.*\) has \d+ tokens in its first \d+ "
                              r"characters alone: with --max-new-tokens 4 that exceeds the model's context of 4096 "
                              r"tokens", within=60)


@pytest.mark.slow
@pytest.mark.parametrize("data", ["", "  "])
def test_a_blank_data_option_is_refused(tiny_model_dir, tmp_path, data):
    """Claim: `--data ''` (`--data "$DATA"` with DATA unset) is one line, exit 1, before any model
    loads: it trained on the built-in task and exited 0."""
    model = "periodic-rl-tests/no-such-model"  # a hub id that is not there: loading it would fail
    result = warm.run(trainer_args(model, tmp_path / "out", "--data", data), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --data {data!r} names no data (an unset shell variable?): "
                                                  "give 'arithmetic', 'chain', 'gsm8k', a hub dataset id, a file or a "
                                                  "directory, or leave --data out for the model's default"]


@pytest.mark.parametrize("model", ["/nonexistent", "./models/nope", "~/no-such-model"])
def test_a_local_model_path_that_is_not_there_is_said_first(model, capsys):
    """Claim: a --model that is a local path (starts with /, ., ~ or has two slashes) and is not a directory gets one
    usage line naming it, before anything loads."""
    from infra.command_line import parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", model])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and f"--model {model!r} is not a directory" in err


def test_an_update_that_overflows_is_one_line_naming_the_metrics_and_the_options(tiny_model_dir, tmp_path, capsys):
    """Claim: a run whose update overflows float32 (here --temperature 1e-40: the trainer's logits / T are inf)
    stops with one short line naming the metrics that are not finite and the options that scale the loss, not the
    whole metrics row."""
    code = trainer.main([*trainer_args(tiny_model_dir, tmp_path / "out", "--mode", "sync", "--temperature", "1e-40",
                                       "--no-save")[2:]])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1 and len(err) < 200, err
    assert err.startswith("error: iteration 0: loss nan") and "--lr" in err and "--temperature" in err, err
