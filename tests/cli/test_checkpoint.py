"""infra/checkpoint.py and the long-run options: checkpoints are atomic, a resume is exact, a stop keeps what is exact."""
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import once_per_session
import torch
from safetensors.torch import load_file

import faults
from infra import checkpoint
from infra.outputs import OutputError
from infra.models import load_model
from infra.options import validate
from infra.command_line import given_options, parse_args
import warm

ROOT = Path(__file__).resolve().parents[2]
# Sizes fixed, so that the probe's timing cannot pick other ones for the two runs compared.
RUN = ["--data", "arithmetic", "--iterations", "4", "--batch-size", "16", "--group-size", "4", "--max-new-tokens", "4",
       "--eval-every", "2", "--eval-size", "4", "--groups-per-call", "2", "--micro-batch-tokens", "64",
       "--rollout-threads", "1", "--train-threads", "1"]
TIMINGS = ("_s", "overlap", "tokens_per_s")  # what differs between two runs of the same computation


def trainer(*args: str) -> list[str]:
    return [sys.executable, "trainer.py", *map(str, args)]


def outcome(out: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """metrics.jsonl without the timings, and the saved policy's tensors."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in row.items() if not k.endswith(TIMINGS)} for row in rows]
    return rows, load_file(out / "policy" / "model.safetensors")


def assert_same_run(a: Path, b: Path, cut_short: int | None = None) -> None:
    """The same metrics (timings aside) and bitwise the same policy; but row `cut_short` of `b` (a stop's last
    iteration) may lack the held-out reward: the stop came before the evaluation of θ_k (launch/setup.checkpointed)."""
    rows_a, weights_a = outcome(a)
    rows_b, weights_b = outcome(b)
    if cut_short is not None and rows_b[cut_short]["eval_reward"] is None:
        rows_b[cut_short]["eval_reward"] = rows_a[cut_short]["eval_reward"]
    assert rows_a == rows_b
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


SCHEDULE = ["--lr-scheduler-type", "cosine", "--warmup-ratio", "0.3", "--num-iterations", "2"]


def stopped(command: list, ready, stop: signal.Signals) -> tuple[str, str]:
    """Run `command` until `ready()`, then send it `stop`; its exit code is SIGKILL's, or 143 after SIGTERM's stop.
    (stdout, stderr)."""
    process = warm.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        process.send_signal(stop)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == (-signal.SIGKILL if stop == signal.SIGKILL else 128 + signal.SIGTERM), err
    return out, err


def iterations_kept(out: Path) -> int:
    """The iterations done that the run's newest checkpoint holds (0: none)."""
    found = checkpoint.checkpoints(out)
    return checkpoint.read_state(found[-1])["iterations_done"] if found else 0


@pytest.mark.slow
@pytest.mark.parametrize("mode, updates, stops, extra", [("async", "2", (signal.SIGTERM, signal.SIGKILL), []),
                                                         ("sync", "1", (signal.SIGKILL, signal.SIGTERM), SCHEDULE)])
def test_a_stopped_run_resumed_equals_the_uninterrupted_one(tiny_model_dir, tmp_path, mode, updates, stops, extra):
    """Claim: a run killed (SIGKILL) after a checkpoint, or stopped (SIGTERM, exit 143), and resumed with
    `--resume auto` gives the same metrics (timings aside) and bitwise the same final weights as the run that was
    never interrupted, with equal thread counts, in sync and async mode, with 1 and 2 updates per iteration;
    metrics.jsonl continues. Here each run is stopped twice, once each way, the second time while it runs resumed.
    Rollouts are the same too: their rewards and lengths are in the metrics, and any other rollout would move the
    weights elsewhere. The learning-rate schedule (the default linear decay, a warmed-up cosine over 2 passes per
    iteration) continues where it was: its state is in the checkpoint. (A stop after an iteration's step but before
    θ_k's evaluation came keeps that iteration without its held-out reward.)"""
    run = ["--model", tiny_model_dir, *RUN, "--iterations", "8", "--mode", mode, "--updates-per-iteration", updates,
           *extra]
    straight = warm.run(trainer(*run, "--out", tmp_path / "straight"), cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
    assert straight.returncode == 0, straight.stderr
    out, cut_short = tmp_path / "stopped", None
    command = trainer(*run, "--save-every", "2", "--save-on-stop", "--out", out)
    for stop in stops:
        done = iterations_kept(out)
        if stop == signal.SIGKILL:  # after a checkpoint newer than the one it started from
            def ready() -> bool:
                return iterations_kept(out) > done
        else:  # two iterations logged past the one it started from
            def ready() -> bool:
                metrics = out / "metrics.jsonl"
                return metrics.exists() and len(metrics.read_text().splitlines()) >= done + 2
        stdout, err = stopped(command, ready, stop)
        assert done == 0 or "resuming from" in stdout
        assert iterations_kept(out) > done, "no checkpoint was written"
        kept = iterations_kept(out)
        if stop == signal.SIGTERM:  # the stop line says what was kept
            assert re.search(r"^interrupted by SIGTERM: .*; (.*checkpoint-(\d) holds the \2 iterations done|no "
                             r"checkpoint holds iterations \d to \d): --resume auto --out \S+ continues from",
                             err.splitlines()[-1]), err
            cut_short = kept - 1
        assert not (out / "policy").exists()
        command = trainer("--resume", "auto", "--out", out, "--model", tiny_model_dir)
    resumed = warm.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    assert_same_run(tmp_path / "straight", out, cut_short)


def test_resume_refuses_options_that_change_the_run(tiny_model_dir):
    """Claim: a resumed run takes the checkpoint's options; a result-changing one given with another value is one
    line naming it; harmless ones (iterations, at a constant rate; evaluation, threads) are the checkpoint's unless
    given anew. --eval-size (0 when derived from --eval-every 0: no prompt held out) stays the checkpoint's, so the
    training prompts do too, whatever --eval-every is given anew."""
    saved = parse_args(["--model", str(tiny_model_dir), *RUN, "--seed", "3", "--lr", "0.01",
                        "--train-threads-after-sampling", "2", "--lr-scheduler-type", "constant"])
    state = {"iterations_done": 2, "config": dataclasses.asdict(saved), "reference_fingerprint": "x"}
    for argv, option in ((["--seed", "4"], "--seed"), (["--lr", "0.02"], "--lr"), (["--group-size", "8"], "--group-size"),
                         (["--groups-per-call", "4"], "--groups-per-call"),
                         (["--eval-size", "8"], "--eval-size")):  # data without a test split: fewer training rows
        with pytest.raises(checkpoint.CheckpointError, match=f"^{option} .* differs from the checkpoint's"):
            checkpoint.resumed_config(parse_args(argv), given_options(argv), state)
    argv = ["--seed", "3", "--iterations", "9", "--out", "elsewhere", "--train-threads", "2", "--mode", "sync"]
    cfg = checkpoint.resumed_config(parse_args(argv), given_options(argv), state)
    assert cfg.mode == "sync" != saved.mode
    assert (cfg.seed, cfg.lr, cfg.model, cfg.batch_size, cfg.groups_per_call) == (3, 0.01, str(tiny_model_dir), 16, 2)
    assert (cfg.iterations, cfg.eval_every, cfg.out, cfg.train_threads, cfg.rollout_threads) == (9, 2, "elsewhere", 2, 1)
    assert cfg.train_threads_after_sampling == 2  # the probe's switch is the saved run's too
    argv = ["--eval-every", "0"]  # a run that evaluated held its prompts out: it still does, only it evaluates none
    assert checkpoint.resumed_config(parse_args(argv), given_options(argv), state).eval_size == 4
    old = {**state, "config": {**state["config"], "eval_every": 0, "eval_size": 64}}  # before eval_size was derived
    assert checkpoint.resumed_config(parse_args([]), set(), old).eval_size == 64  # held out as it was
    argv = ["--eval-every", "5"]  # a run that held none out cannot start evaluating: that would change its prompts
    none = {**state, "config": {**state["config"], "eval_every": 0, "eval_size": 0}}
    resumed = checkpoint.resumed_config(parse_args(argv), given_options(argv), none)
    assert any(problem.startswith("--eval-every 5 evaluates held-out prompts, and --eval-size is 0 (a run started "
                                  "with --eval-every 0 holds none out") for problem in validate(resumed))
    argv = ["--train-threads-after-sampling", "1"]  # harmless given anew (float rounding only)
    assert checkpoint.resumed_config(parse_args(argv), given_options(argv), state).train_threads_after_sampling == 1


def test_a_checkpoint_keeps_absolute_paths(tiny_model_dir, tmp_path, monkeypatch):
    """Claim (for checkpoints as for config.json): a checkpoint records a relative --data as an
    absolute path, so `--resume DIR/checkpoint-k` works from any folder; the same relative --data given again from
    the folder the run started in is the same option, not a change that refuses the resume."""
    monkeypatch.chdir(tmp_path)
    for name in ("prompts.jsonl", "other.jsonl"):
        (tmp_path / name).write_text('{"question": "1+1=", "answer": "2"}\n')
    cfg = parse_args(["--model", str(tiny_model_dir), *RUN, "--data", "prompts.jsonl"])
    policy, tokenizer = load_model(str(tiny_model_dir))
    (tmp_path / "run").mkdir()
    path = checkpoint.save(tmp_path / "run", 1, policy, tokenizer, torch.optim.AdamW(policy.parameters()), cfg, "x")
    state = checkpoint.read_state(path)
    assert state["config"]["data"] == str(tmp_path / "prompts.jsonl")
    argv = ["--data", "prompts.jsonl"]
    assert checkpoint.resumed_config(parse_args(argv), given_options(argv), state).data == str(tmp_path / "prompts.jsonl")
    argv = ["--data", "other.jsonl"]
    with pytest.raises(checkpoint.CheckpointError, match="^--data .* differs from the checkpoint's"):
        checkpoint.resumed_config(parse_args(argv), given_options(argv), state)


def test_a_checkpoint_from_before_threads_after_sampling_resumes_without_a_switch(tiny_model_dir, tmp_path):
    """Claim: a checkpoint written before --train-threads-after-sampling existed resumes with every size fixed (no
    probe, which would pick other sizes): its threads after sampling are its training threads, so the trainer never
    switches (as it ran)."""
    saved = dataclasses.asdict(parse_args(["--model", str(tiny_model_dir), *RUN]))
    del saved["train_threads_after_sampling"]
    (tmp_path / "state.json").write_text(json.dumps({"iterations_done": 2, "config": saved,
                                                     "reference_fingerprint": "x"}))
    state = checkpoint.read_state(tmp_path)
    cfg = checkpoint.resumed_config(parse_args([]), set(), state)
    assert cfg.train_threads_after_sampling == cfg.train_threads == 1 and cfg.sized


@pytest.mark.parametrize("old, new", [("groups_per_chunk", "groups_per_call"),
                                      ("tail_threads", "train_threads_after_sampling")])
def test_a_checkpoint_naming_an_option_by_its_old_name_resumes_with_it(tiny_model_dir, tmp_path, old, new):
    """Claim: a checkpoint whose config names an option by its old name (groups_per_chunk for --groups-per-call,
    tail_threads for --train-threads-after-sampling) resumes with that value, every size fixed (no probe)."""
    saved = dataclasses.asdict(parse_args(["--model", str(tiny_model_dir), *RUN, "--train-threads-after-sampling",
                                           "2"]))
    saved[old] = saved.pop(new)
    (tmp_path / "state.json").write_text(json.dumps({"iterations_done": 2, "config": saved,
                                                     "reference_fingerprint": "x"}))
    cfg = checkpoint.resumed_config(parse_args([]), set(), checkpoint.read_state(tmp_path))
    assert getattr(cfg, new) == saved[old] == 2 and cfg.sized


def test_checkpoints_are_atomic_pruned_and_checked(tiny_model_dir, tmp_path, monkeypatch):
    """Claim: a checkpoint whose write fails half-way leaves no checkpoint-<k> (the previous one stays complete and
    `--resume auto` picks it); --keep-checkpoints prunes the oldest; a damaged checkpoint, a missing one or one from
    other initial weights is one CheckpointError line."""
    policy, tokenizer = load_model(str(tiny_model_dir))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    cfg, theta_0 = parse_args(["--model", str(tiny_model_dir)]), checkpoint.fingerprint(policy)
    for k in (1, 2, 3):
        checkpoint.save(tmp_path, k, policy, tokenizer, optimizer, cfg, theta_0, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]

    def torn(*args, **kwargs):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", torn)
        with pytest.raises(OutputError, match=r"^could not write the checkpoint .*checkpoint-4: No space left on "
                                              r"device$"):
            checkpoint.save(tmp_path, 4, policy, tokenizer, optimizer, cfg, theta_0, keep=2)
    assert checkpoint.find("auto", tmp_path).name == "checkpoint-3"
    assert not (tmp_path / "checkpoint-4").exists()
    fresh, _ = load_model(str(tiny_model_dir))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert checkpoint.restore(tmp_path / "checkpoint-3", fresh, fresh_optimizer, theta_0) == 3
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), policy.parameters()))
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())
    with pytest.raises(checkpoint.CheckpointError, match="other initial weights"):
        checkpoint.restore(tmp_path / "checkpoint-3", fresh, fresh_optimizer, "another")
    (tmp_path / "checkpoint-3" / "optimizer.pt").write_bytes(b"torn")
    with pytest.raises(checkpoint.CheckpointError, match="damaged"):
        checkpoint.restore(tmp_path / "checkpoint-3", fresh, fresh_optimizer, theta_0)
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint"):
        checkpoint.find(str(tmp_path / "nothing"), tmp_path)
    assert checkpoint.find("auto", tmp_path / "empty") is None  # none yet: the run starts from iteration 0
    (tmp_path / "checkpoint-2" / "state.json").write_text("{")
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.read_state(tmp_path / "checkpoint-2")


def test_the_schedule_is_kept_and_old_checkpoints_resume(tiny_model_dir, tmp_path):
    """Claim: a checkpoint holds the learning-rate schedule's state (restored, the next rates are the uninterrupted
    run's; without it the schedule would restart from its first rate); a checkpoint written before the schedule
    existed (no scheduler.pt, scale_rewards a boolean) resumes at the constant rate it ran at, with TRL's name for
    its scale_rewards; one whose scheduler.pt is missing under a decaying schedule is damaged; with bnpo,
    --micro-batch-tokens changes the loss, so it is refused anew."""
    from launch.setup import build_optimizer
    cfg = parse_args(["--model", str(tiny_model_dir), *RUN, "--warmup-ratio", "0.25"])
    policy, tokenizer = load_model(str(tiny_model_dir))
    optimizer, scheduler = build_optimizer(cfg, policy)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    theta_0 = checkpoint.fingerprint(policy)
    checkpoint.save(tmp_path, 2, policy, tokenizer, optimizer, cfg, theta_0, scheduler=scheduler)
    fresh_optimizer, fresh_scheduler = build_optimizer(cfg, policy)
    assert checkpoint.restore(tmp_path / "checkpoint-2", policy, fresh_optimizer, theta_0, fresh_scheduler) == 2

    def rates(optimizer, scheduler) -> list[float]:
        seen = []
        for _ in range(2):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen
    # 4 steps, 1 of warmup: rates 0, lr, lr·2/3, lr·1/3 (a restarted schedule would give 0, lr again)
    expected = [cfg.lr * (2 / 3), cfg.lr * (1 / 3)]
    assert rates(fresh_optimizer, fresh_scheduler) == rates(optimizer, scheduler) == expected
    # as written before the schedule: AdamW at a constant rate, no scheduler.pt, scale_rewards a boolean
    checkpoint.save(tmp_path, 3, policy, tokenizer, torch.optim.AdamW(policy.parameters(), lr=cfg.lr), cfg, theta_0)
    old_checkpoint = tmp_path / "checkpoint-3"
    state = json.loads((old_checkpoint / "state.json").read_text())
    for key in ("lr_scheduler_type", "warmup_ratio", "num_iterations"):
        del state["config"][key]
    state["config"]["scale_rewards"] = False
    (old_checkpoint / "state.json").write_text(json.dumps(state))
    old = checkpoint.resumed_config(parse_args([]), set(), checkpoint.read_state(old_checkpoint))
    assert (old.lr_scheduler_type, old.scale_rewards, old.num_iterations) == ("constant", "none", 1)
    constant_optimizer, constant_scheduler = build_optimizer(old, policy)
    checkpoint.restore(old_checkpoint, policy, constant_optimizer, theta_0, constant_scheduler)
    assert rates(constant_optimizer, constant_scheduler) == [old.lr, old.lr]
    state["config"]["lr_scheduler_type"] = "linear"
    (old_checkpoint / "state.json").write_text(json.dumps(state))
    linear_optimizer, linear_scheduler = build_optimizer(cfg, policy)
    with pytest.raises(checkpoint.CheckpointError, match="damaged"):
        checkpoint.restore(old_checkpoint, policy, linear_optimizer, theta_0, linear_scheduler)
    bnpo = {"iterations_done": 2, "config": dataclasses.asdict(parse_args(["--loss-type", "bnpo", *RUN])),
            "reference_fingerprint": "x"}
    argv = ["--micro-batch-tokens", "32"]
    with pytest.raises(checkpoint.CheckpointError, match="^--micro-batch-tokens 32 differs"):
        checkpoint.resumed_config(parse_args(argv), given_options(argv), bnpo)


def test_a_bad_resume_is_one_line(tmp_path):
    """Claim: `--resume` of something that is not a checkpoint ends with one line and exit 1, before any loading."""
    result = warm.run(trainer("--resume", tmp_path, "--out", tmp_path / "out"), cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --resume {tmp_path}: not a checkpoint directory (no "
                                                  f"state.json in it); pass a <out>/checkpoint-<k> directory or "
                                                  f"--resume auto"]
    assert checkpoint.find("auto", tmp_path) is None  # none yet: the run starts from iteration 0 (outputs.claimed)


def test_a_stop_writes_a_checkpoint_of_the_iterations_done(tiny_model_dir, tmp_path):
    """Claim: with --save-on-stop, a stop (the KeyboardInterrupt trainer.py raises for SIGINT, SIGTERM and SIGHUP)
    arriving while iteration 1's row is being logged writes checkpoint-1 (θ_1, AdamW after one step), and that
    checkpoint restores the weights the run had."""
    import trainer
    cfg = parse_args(["--model", str(tiny_model_dir), *RUN, "--mode", "sync", "--save-on-stop", "--out", str(tmp_path)])
    with trainer.started(cfg) as (rows, policy, _):
        assert next(rows)["iteration"] == 0
        with pytest.raises(KeyboardInterrupt):
            rows.throw(KeyboardInterrupt())
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-1"]
    fresh, _ = load_model(cfg.model)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=cfg.lr)
    assert checkpoint.restore(tmp_path / "checkpoint-1", fresh, optimizer, checkpoint.fingerprint(fresh)) == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), policy.parameters()))


STOPPED_AT = """
import os, runpy, signal, sys
import torch
import learner
from infra import completions
owner, name = {"optimizer step": (torch.optim.AdamW, "step"), "after the step": (learner.Learner, "step"),
               "writing completions": (completions.CompletionsLog, "write")}[os.environ["STOP_AT"]]
signum, calls, real = int(os.environ["STOP_SIGNAL"]), [], getattr(owner, name)
def patched(*args, **kwargs):
    result = real(*args, **kwargs)
    calls.append(1)
    if len(calls) == 3:  # iteration 2's: the signal as Ctrl-C sends it (the whole group) or kill (the trainer alone)
        os.killpg(0, signum) if signum == signal.SIGINT else os.kill(os.getpid(), signum)
    return result
setattr(owner, name, patched)
sys.argv = sys.argv[1:]
runpy.run_path("trainer.py", run_name="__main__")
"""
# Async (the inference process streams the groups), one step per iteration, no evaluation at iteration 2.
ASYNC_RUN = ["--data", "arithmetic", "--iterations", "6", "--batch-size", "16", "--group-size", "4", "--max-new-tokens",
             "4", "--eval-every", "4", "--eval-size", "4", "--groups-per-call", "2", "--micro-batch-tokens", "64",
             "--rollout-threads", "1", "--train-threads", "1", "--log-completions"]


def checkpoint_contents(path: Path) -> tuple[dict, dict, dict]:
    """A checkpoint's θ, AdamW's state and the schedule's, to compare bitwise."""
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    return (load_file(path / "policy" / "model.safetensors"), optimizer["state"],
            torch.load(path / "scheduler.pt", weights_only=True))


def same(a, b) -> bool:
    """Bitwise equal: tensors, and the dicts, lists and tuples that hold them (a state_dict)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.fixture(scope="session")
def straight_async_run(tiny_model_dir, tmp_path_factory) -> Path:
    """ASYNC_RUN run through, with --save-every 3: its checkpoint-3 is the state a stop after iteration 2 must keep
    (run once for the session: conftest.once_per_session)."""
    def make(folder: Path) -> None:
        done = warm.run(trainer("--model", tiny_model_dir, *ASYNC_RUN, "--save-every", "3", "--out",
                                      folder / "run"), cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    return once_per_session(tmp_path_factory, "straight-async", make) / "run"


@pytest.mark.slow
@pytest.mark.parametrize("where, signum", [("after the step", signal.SIGINT), ("optimizer step", signal.SIGTERM),
                                           ("writing completions", signal.SIGINT)])
def test_a_stop_at_any_moment_keeps_the_last_iteration_done(straight_async_run, tiny_model_dir, tmp_path, where,
                                                            signum):
    """Claim: with --save-on-stop, an async run stopped at any moment keeps a checkpoint of its last completed
    iteration, bitwise the uninterrupted run's (θ, AdamW's state, the schedule's), and that iteration's row: a stop
    right after iteration 2's optimizer step, while the trainer still waits for the iteration's end (Ctrl-C to the
    group: the inference process dies with it), inside the step (SIGTERM after AdamW moved θ, before the schedule's
    step: the stop waits for the step's end), or while iteration 2's completions are written. Each wrote no
    checkpoint at all ("no checkpoint holds iterations 0 to 2": a stop between the step and the row was taken for a
    half-done iteration)."""
    out = tmp_path / "run"
    with faults.Launch("--model", tiny_model_dir, *ASYNC_RUN, "--save-on-stop", "--out", out,
                       launcher=("-c", STOPPED_AT), env={"STOP_AT": where, "STOP_SIGNAL": str(int(signum))}) as run:
        run.assert_stopped(128 + signum, rf"^interrupted by {signum.name}: the run was stopped, nothing is left "
                                         r"running; .*checkpoint-3 holds the 3 iterations done: --resume auto --out "
                                         r"\S+ continues from there$", within=240)
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-3"]
    assert same(checkpoint_contents(out / "checkpoint-3"), checkpoint_contents(straight_async_run / "checkpoint-3"))
    rows, _ = outcome(straight_async_run)
    assert [{k: v for k, v in row.items() if not k.endswith(TIMINGS)} for row in
            map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == rows[:3]


def test_a_stop_between_the_step_and_the_row_keeps_that_iteration(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Claim: with --save-on-stop, a stop right after iteration 1's optimizer step, before its row is out (where an
    async trainer waits for the iteration's end, or its evaluation), still hands iteration 1's row out, then stops
    and writes checkpoint-2 (θ_2, AdamW after two steps), which restores the weights the run had, saying at once
    that the stop waits for it. It wrote no checkpoint (the iterations done, 2, were taken for a half-done
    iteration against the 1 row out)."""
    import learner
    import trainer
    real_step, steps = learner.Learner.step, []

    def step_then_stop(self):
        real_step(self)
        steps.append(self.iteration)
        if len(steps) == 2:
            raise KeyboardInterrupt  # as a signal handled right after the step would
    monkeypatch.setattr(learner.Learner, "step", step_then_stop)
    cfg = parse_args(["--model", str(tiny_model_dir), *RUN, "--mode", "sync", "--save-on-stop", "--out", str(tmp_path)])
    handed_out = []
    with trainer.started(cfg) as (rows, policy, _), pytest.raises(KeyboardInterrupt):
        for row in rows:
            handed_out.append(row["iteration"])
    assert handed_out == [0, 1]
    assert capsys.readouterr().out.endswith("periodic-rl: stopping: writing the checkpoint of the 2 iterations done "
                                            "first\n")
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-2"]
    fresh, _ = load_model(cfg.model)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=cfg.lr)
    assert checkpoint.restore(tmp_path / "checkpoint-2", fresh, optimizer, checkpoint.fingerprint(fresh)) == 2
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), policy.parameters()))


def test_a_stop_inside_a_deferred_block_waits_for_its_end():
    """Claim: a stop signal inside `stops_deferred` (the update of Learner.step: θ, AdamW's state and the schedule)
    lets the block run to its end and is raised there, as `Interrupted`; outside such a block it is raised at once.
    (A stop half-way through the update left a state no checkpoint could hold, and none was written.)"""
    from infra.stopping import Interrupted, stopped_by_signals, stops_deferred
    reached = []
    try:
        with stopped_by_signals():
            with pytest.raises(Interrupted) as stop:
                with stops_deferred():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.05)
                    reached.append("the block's end")
            assert reached == ["the block's end"] and stop.value.signum == signal.SIGTERM
            with pytest.raises(Interrupted):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                reached.append("past the signal")
            assert reached == ["the block's end"]
    finally:
        Interrupted.received = Interrupted.held = None


KILLED_WHILE_SAVING = """
import sys, time, torch
from infra import checkpoint
from infra.outputs import OutputError
from infra.command_line import parse_args
from infra.models import load_model
out, model = sys.argv[1], sys.argv[2]
policy, tokenizer = load_model(model)
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
cfg = parse_args(["--model", model])
checkpoint.save(out, 1, policy, tokenizer, optimizer, cfg, "θ0")
real_save = torch.save
def slow_save(*args, **kwargs):
    real_save(*args, **kwargs)
    print("writing", flush=True)
    time.sleep(60)  # killed here: the policy and optimizer of checkpoint-2 are on disk, its state.json is not
torch.save = slow_save
checkpoint.save(out, 2, policy, tokenizer, optimizer, cfg, "θ0")
"""


@pytest.mark.slow
def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one(tiny_model_dir, tmp_path):
    """Claim: SIGKILL in the middle of writing checkpoint-2 leaves no checkpoint-2 and checkpoint-1 complete;
    `--resume auto` (checkpoint.find) picks checkpoint-1 and it restores."""
    process = subprocess.Popen([sys.executable, "-c", KILLED_WHILE_SAVING, str(tmp_path), str(tiny_model_dir)],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "writing"
        process.kill()
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert checkpoint.find("auto", tmp_path).name == "checkpoint-1" and not (tmp_path / "checkpoint-2").exists()
    policy, _ = load_model(str(tiny_model_dir))
    assert checkpoint.restore(tmp_path / "checkpoint-1", policy, torch.optim.AdamW(policy.parameters()), "θ0") == 1


@pytest.mark.slow
def test_the_preemptible_recipe_survives_a_kill_before_the_first_checkpoint(tiny_model_dir, tmp_path):
    """Claim: the README's preemptible recipe (`--save-every N --resume auto --out DIR`, the same command at every
    submission) works when a job is killed before its first checkpoint: the next submission starts the run again
    from iteration 0, saying so in one line, and finishes it."""
    out = tmp_path / "run"
    command = ["--model", tiny_model_dir, *RUN, "--save-every", "3", "--resume", "auto", "--out", out]
    with faults.Launch(*command) as first:
        first.wait_for(r"^iter ")
        deadline = time.monotonic() + 60
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline, "\n".join(first.stderr)
            time.sleep(0.01)
        first.send(signal.SIGKILL)  # preempted: nothing can be saved
        first.assert_stopped(None, None)
    assert not checkpoint.checkpoints(out) and (out / "metrics.jsonl").read_text()
    again = warm.run(trainer(*command), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert (f"periodic-rl: --resume auto: no checkpoint in {out} yet: starting the run from iteration 0 (replacing "
            "the outputs of the run that stopped before its first checkpoint: metrics.jsonl") in again.stdout
    assert metrics_iterations(out) == [0, 1, 2, 3, "final"] and [p.name for p in checkpoint.checkpoints(out)] == [
        "checkpoint-3"] and (out / "policy" / "model.safetensors").is_file()


# --- resuming: nothing lost, nothing mixed ---
FINISHED = ["--data", "arithmetic", "--iterations", "2", "--batch-size", "16", "--group-size", "4", "--max-new-tokens",
            "4", "--eval-every", "1", "--eval-size", "4", "--eval-samples", "2", "--groups-per-call", "2",
            "--micro-batch-tokens", "64", "--rollout-threads", "1", "--train-threads", "1", "--mode", "sync",
            "--lr-scheduler-type", "constant"]  # (at a constant rate a resume may give another --iterations)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file below `folder` (its run's metrics, policy, checkpoints), by relative path: to check it untouched."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != ".lock"}


def metrics_iterations(out: Path) -> list:
    return [row.get("final") and "final" or row["iteration"]
            for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="session")
def finished_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished run of 2 iterations with --save-every 2: metrics rows 0, 1 and the final one, policy/, and
    checkpoint-2, taken at the last iteration (run once for the session). Tests copy it before they touch it."""
    def make(folder: Path) -> None:
        done = warm.run(trainer("--model", tiny_model_dir, *FINISHED, "--save-every", "2", "--seed", "1",
                                      "--out", folder / "run"), cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    out = once_per_session(tmp_path_factory, "finished", make) / "run"
    assert metrics_iterations(out) == [0, 1, "final"] and (out / "checkpoint-2").is_dir()
    return out


def copy_of(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns(".lock"))
    return to


def assert_one_error_line(result: subprocess.CompletedProcess, pattern: str) -> None:
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]), result.stderr


def in_process(capsys, *args) -> subprocess.CompletedProcess:
    """`python trainer.py *args` as trainer.main in this process (a sync run, or one that fails before it starts:
    what it writes and says is the claim, not its processes), with its exit code, stdout and stderr."""
    import trainer as entry
    capsys.readouterr()
    code = entry.main([*map(str, args)])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.mark.slow
def test_resuming_a_checkpoint_of_the_last_iteration_writes_its_policy(finished_run, tiny_model_dir, tmp_path, capsys):
    """Claim: resuming a checkpoint taken at the last iteration (its policy/ lost) runs the final
    evaluation and writes policy/, the checkpoint's θ, before saying where it is;
    metrics.jsonl keeps rows 0 and 1 and gets the final row. An --iterations below the checkpoint's iterations is
    one line, and nothing on disk changes (θ_2 would have been saved as θ_1)."""
    out = copy_of(finished_run, tmp_path / "run")
    shutil.rmtree(out / "policy")
    before = snapshot(out)
    fewer = in_process(capsys, "--resume", "auto", "--out", out, "--iterations", "1")
    assert_one_error_line(fewer, r"^error: --iterations 1 is fewer than the 2 iterations checkpoint .*checkpoint-2 "
                                 r"has done: give --iterations 2 or more")
    assert snapshot(out) == before
    resumed = in_process(capsys, "--resume", "auto", "--out", out, "--model", tiny_model_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"policy in {out / 'policy'}" in resumed.stdout
    saved, kept = (load_file(out / folder / "model.safetensors") for folder in ("policy", "checkpoint-2/policy"))
    assert saved.keys() == kept.keys() and all(torch.equal(saved[k], kept[k]) for k in saved)
    assert metrics_iterations(out) == [0, 1, "final"]


SLOW_FINAL_SAVE = """
import runpy, sys, time
import transformers
save = transformers.PreTrainedModel.save_pretrained
def slow(self, folder, **kwargs):  # the final policy's save takes a minute: a stop comes in the middle of it
    save(self, folder, **kwargs)
    if "checkpoint-" not in str(folder):
        print("saving the policy", flush=True)
        time.sleep(60)
transformers.PreTrainedModel.save_pretrained = slow
sys.argv = sys.argv[1:]
runpy.run_path("trainer.py", run_name="__main__")
"""


@pytest.mark.slow
def test_a_stop_during_the_final_save_keeps_the_last_row_and_the_policy(tiny_model_dir, tmp_path, capsys):
    """Claim: SIGTERM while the finished policy is being saved, with --save-on-stop, loses nothing: the
    last iteration's row is written, the stop checkpoint holds θ_2 and the stop line says so; `--resume auto` then
    writes the policy."""
    out = tmp_path / "run"
    with faults.Launch("--model", tiny_model_dir, *FINISHED, "--save-on-stop", "--out", out,
                       launcher=("-c", SLOW_FINAL_SAVE)) as run:
        run.wait_for("^saving the policy")
        run.send(signal.SIGTERM)
        run.assert_stopped(143, r"^interrupted by SIGTERM: the run was stopped, nothing is left running; "
                                r".*checkpoint-2 holds the 2 iterations done: --resume auto --out \S+ continues from there$")
    assert metrics_iterations(out) == [0, 1] and not (out / "policy").exists()
    resumed = in_process(capsys, "--resume", "auto", "--out", out, "--model", tiny_model_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert metrics_iterations(out) == [0, 1, "final"] and (out / "policy" / "model.safetensors").is_file()


@pytest.mark.slow
def test_resuming_into_another_runs_folder_is_refused(finished_run, tiny_model_dir, tmp_path, capsys):
    """Claim: `--resume A/checkpoint-2 --out B`, B holding another run, is one line and leaves both
    runs as they were (B's metrics got A's rows after its own, its policy A's); with --overwrite, B's run is replaced
    by A's continued: A's rows before the checkpoint, then this run's, nothing of B's."""
    a = copy_of(finished_run, tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    (b / "metrics.jsonl").write_text('{"iteration": 0, "reward_mean": 0.25}\n{"iteration": 1, "reward_mean": 0.5}\n')
    before = snapshot(a), snapshot(b)
    args = ["--resume", a / "checkpoint-2", "--out", b, "--model", tiny_model_dir, "--iterations", "3"]
    refused = in_process(capsys, *args)
    checkpoint_2 = re.escape(str(a / "checkpoint-2"))
    assert_one_error_line(refused, rf"^error: --out {re.escape(str(b))} holds another run \(metrics.jsonl\) than the "
                                   rf"one --resume {checkpoint_2} continues, and the two would mix")
    assert (snapshot(a), snapshot(b)) == before
    replaced = in_process(capsys, *args, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    rows = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert rows[:2] == [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()[:2]]
    assert [row.get("final") and "final" or row["iteration"] for row in rows] == [0, 1, 2, "final"]
    assert snapshot(a) == before[0]
    overwrite_own = in_process(capsys, "--resume", "auto", "--out", a, "--overwrite")
    assert_one_error_line(overwrite_own, r"--overwrite would delete the run in --out .* that --resume auto continues")
    assert snapshot(a) == before[0]


@pytest.mark.slow
def test_a_resume_that_fails_leaves_the_metrics_and_says_the_policy_is_there(finished_run, tiny_model_dir, tmp_path, capsys):
    """Claim: a resume that fails once started (a truncated optimizer.pt) has not rewritten
    metrics.jsonl and says that the
    policy saved before is still there, not that no policy was saved."""
    out = copy_of(finished_run, tmp_path / "run")
    optimizer = out / "checkpoint-2" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    before = snapshot(out)
    result = in_process(capsys, "--resume", "auto", "--out", out, "--model", tiny_model_dir, "--iterations", "3")
    assert_one_error_line(result, rf"^error: checkpoint .*checkpoint-2 is damaged .*\(the run stopped before training "
                                  rf"ended: {re.escape(str(out / 'policy'))} is still the policy saved before\)$")
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k != "config.json"} == {k: v for k, v in before.items()
                                                                      if k != "config.json"}


def test_a_resume_whose_model_link_moved_or_whose_source_is_gone(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Claim: the preemptible recipe started from `--model latest` (a link to run A) resumes, once the link has moved
    to run C, from A's policy, where the checkpoint's run began, with one line saying the link moved; the resumed θ_0 is A's (restore checks the
    fingerprint; C's weights differ); resubmitted once complete, it has nothing to do. Once A is gone, the same command is one line that names it gone and what to
    pass: with A's path, that it no longer exists; through the link to C, that C's initial weights are not the
    checkpoint's."""
    import trainer
    from safetensors.torch import load_file, save_file
    monkeypatch.chdir(tmp_path)
    run = ["--mode", "sync", *RUN[:2], *RUN[4:], "--eval-every", "0", "--lr-scheduler-type", "constant"]
    for source in ("A", "C"):
        assert trainer.main(["--model", str(tiny_model_dir), *run, "--iterations", "1", "--out", source]) == 0
    weights = load_file("C/policy/model.safetensors")
    name = sorted(weights)[0]
    save_file({**weights, name: weights[name] + 0.01}, "C/policy/model.safetensors", {"format": "pt"})
    os.symlink("A", "latest")
    recipe = ["--model", "latest", *run, "--save-every", "1", "--out", "B", "--resume", "auto"]
    assert trainer.main([*recipe, "--iterations", "1"]) == 0
    os.remove("latest")
    os.symlink("C", "latest")  # another run moved it
    capsys.readouterr()
    a, c = (tmp_path / "A" / "policy"), (tmp_path / "C" / "policy")
    assert trainer.main([*recipe, "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert (f"periodic-rl: --model latest now leads to {c}, not to {a}, where the run in --out began (the link moved): "
            f"continuing from {a}\n") in out and "resuming from B/checkpoint-1 at iteration 1 of 2" in out
    assert json.loads(Path("B/config.json").read_text())["model"] == str(a)
    assert trainer.main([*recipe, "--iterations", "2"]) == 0  # resubmitted once complete: nothing to do
    assert "periodic-rl: --resume auto: the run in B is complete (2 iterations" in capsys.readouterr().out
    shutil.rmtree("A")
    assert trainer.main([*recipe, "--model", "A", "--iterations", "3"]) == 1
    assert capsys.readouterr().err == (f"error: --model A: the checkpoint's source model, {a}, no longer exists (moved "
                                       "or deleted): put it back, or pass --model with the folder it is in now (its "
                                       "weights are checked against the checkpoint's initial ones)\n")
    with pytest.raises(SystemExit):  # a path that is not there is refused as options are read, saying so too
        trainer.main([*recipe, "--model", str(tmp_path / "A"), "--iterations", "3"])
    assert "a resumed run's source model must be where its run found it: put it back" in capsys.readouterr().err
    assert trainer.main([*recipe, "--iterations", "3"]) == 1
    captured = capsys.readouterr()
    assert (f"periodic-rl: --model latest: the checkpoint's source model, {a}, no longer exists: continuing from {c}, "
            "whose weights are checked against the checkpoint's initial ones\n") in captured.out
    assert captured.err.startswith("error: checkpoint ") and "other initial weights" in captured.err


@pytest.mark.parametrize("schedule, warmup, refused", [("linear", "0", True), ("cosine", "0.3", True),
                                                       ("constant", "0.3", False), ("constant_with_warmup", "0", False),
                                                       ("constant_with_warmup", "0.3", True),
                                                       ("inverse_sqrt", "0", False)])
def test_another_iterations_is_refused_where_the_schedule_spans_the_run(schedule, warmup, refused):
    """Claim: --iterations given anew to a resume is refused, in one line naming the
    schedule, where the learning rates depend on the run's length (a decaying schedule, or a warmup given as a ratio
    of the steps: rebuilt over another length, every rate from the checkpoint on would differ, and the run would be
    neither the one it continues nor one started that long), as transformers' rates show; a constant rate, and
    constant_with_warmup or inverse_sqrt without warmup, may be extended. The same --iterations is no change."""
    from transformers import get_scheduler
    saved = parse_args([*RUN, "--lr-scheduler-type", schedule, "--warmup-ratio", warmup])
    state = {"iterations_done": 2, "config": dataclasses.asdict(saved), "reference_fingerprint": "x"}

    def rates(iterations: int) -> list[float]:  # the first 8 steps' rates at this length (launch/setup's schedule)
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        steps = iterations * saved.updates_per_iteration * saved.num_iterations
        scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=math.ceil(steps * saved.warmup_ratio),
                                  num_training_steps=steps)
        seen = []
        for _ in range(8):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen
    assert (rates(4) != rates(9)) == refused  # what the rule stands for
    argv = ["--iterations", "9"]
    if refused:
        with pytest.raises(checkpoint.CheckpointError, match=rf"^--iterations 9 differs from the checkpoint's 4: it "
                                                             rf"would change the run \(its learning-rate schedule, "
                                                             rf"{schedule}"):
            checkpoint.resumed_config(parse_args(argv), given_options(argv), state)
    else:
        assert checkpoint.resumed_config(parse_args(argv), given_options(argv), state).iterations == 9
    argv = ["--iterations", "4"]
    assert checkpoint.resumed_config(parse_args(argv), given_options(argv), state).iterations == 4


@pytest.mark.slow
def test_a_run_starts_from_a_finished_runs_folder_through_a_link(finished_run, tmp_path):
    """Claim: `--model runs/latest` (the README's way to go on from a finished run) trains from that run's saved
    policy, end to end: the line names the resolved policy/ and the defaults taken from its run, the new run's
    config.json records that resolved path (a link that moves on would hand a resume or a rerun another run's
    weights), and its θ_0 is the finished run's policy (its checkpoint's fingerprint of θ_0 is that policy's, loaded
    as the trainer loads it); the source run is untouched. The same command (--resume auto), resubmitted once the new
    run is complete, exits 0 with every file as it was."""
    from infra.checkpoint import fingerprint
    from infra.models import load_model
    from safetensors.torch import load_file, save_file
    source = copy_of(finished_run, tmp_path / "source")
    weights = load_file(source / "policy" / "model.safetensors")  # (the untrained tiny model's rewards are all 0:
    name = sorted(weights)[0]                                       # its 2 iterations left the base's weights)
    save_file({**weights, name: weights[name] + 0.01}, source / "policy" / "model.safetensors", {"format": "pt"})
    latest = tmp_path / "latest"
    latest.symlink_to(source)
    before = snapshot(source)
    out = tmp_path / "next"
    command = trainer("--model", latest, "--iterations", "1", "--eval-every", "0", "--sizes", "rule", "--save-every",
                      "1", "--out", out, "--resume", "auto")  # the preemptible recipe: the same command each time
    done = warm.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    policy = (source / "policy").resolve()
    assert f"periodic-rl: --model {latest}: a run's folder: took its trained policy, {policy}" in done.stdout
    record = json.loads((out / "config.json").read_text())
    saved = json.loads((source / "config.json").read_text())
    assert record["model"] == str(policy) and (record["lr"], record["max_new_tokens"]) == (saved["lr"],
                                                                                          saved["max_new_tokens"])
    theta_0 = json.loads((out / "checkpoint-1" / "state.json").read_text())["reference_fingerprint"]
    assert theta_0 == fingerprint(load_model(str(policy))[0]) != fingerprint(load_model(saved["model"])[0])
    assert snapshot(source) == before
    finished = snapshot(out)
    again = warm.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)  # resubmitted at the end
    assert again.returncode == 0 and f"the run in {out} is complete (1 iteration," in again.stdout, again.stderr
    assert snapshot(out) == finished and snapshot(source) == before


def test_resume_takes_the_default_task_typed_out_as_the_same_data():
    """Claim: a run started without --data trained on its model's default task; resuming it with that task typed
    out (`--data arithmetic` for tiny) is the same data and resumes, while another task is refused naming --data."""
    state = {"iterations_done": 2, "config": dataclasses.asdict(parse_args(RUN[2:])), "reference_fingerprint": "x"}
    assert state["config"]["data"] is None and state["config"]["model"] == "tiny"
    argv = ["--data", "arithmetic"]
    assert checkpoint.resumed_config(parse_args(argv), given_options(argv), state).data is None  # the saved, the same
    argv = ["--data", "chain"]
    with pytest.raises(checkpoint.CheckpointError, match="^--data chain differs from the checkpoint's None"):
        checkpoint.resumed_config(parse_args(argv), given_options(argv), state)
