"""infra/checkpoint.py and the long-run options: checkpoints are atomic, a resume is exact, a stop keeps what is exact."""
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infra import checkpoint
from infra.models import load_model
from infra.options import given_options, parse_args

ROOT = Path(__file__).resolve().parents[1]
# Sizes fixed, so that the probe's timing cannot pick other ones for the two runs compared.
RUN = ["--data", "arithmetic", "--iterations", "4", "--batch-size", "16", "--group-size", "4", "--max-new-tokens", "4",
       "--eval-every", "2", "--eval-size", "4", "--groups-per-chunk", "2", "--micro-batch-tokens", "64",
       "--rollout-threads", "1", "--train-threads", "1"]
TIMINGS = ("_s", "overlap", "tokens_per_s")  # what differs between two runs of the same computation


def trainer(*args: str) -> list[str]:
    return [sys.executable, "trainer.py", *map(str, args)]


def outcome(out: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """metrics.jsonl without the timings, and the saved policy's tensors."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in row.items() if not k.endswith(TIMINGS)} for row in rows]
    return rows, load_file(out / "policy" / "model.safetensors")


def assert_same_run(a: Path, b: Path) -> None:
    rows_a, weights_a = outcome(a)
    rows_b, weights_b = outcome(b)
    assert rows_a == rows_b
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.parametrize("mode, updates, stop", [("sync", "2", signal.SIGKILL), ("async", "2", signal.SIGKILL),
                                                 ("async", "1", signal.SIGTERM)])
def test_a_stopped_run_resumed_equals_the_uninterrupted_one(tiny_model_dir, tmp_path, mode, updates, stop):
    """Claim: a run killed (SIGKILL) after a checkpoint, or stopped (SIGTERM, exit 143), and resumed with
    `--resume auto` gives the same metrics (timings aside) and bitwise the same final weights as the run that was
    never interrupted, with equal thread counts, in sync and async mode, with 1 and 2 updates per iteration;
    metrics.jsonl continues. Rollouts are the same too: their rewards and lengths are in the metrics, and
    any other rollout would move the weights elsewhere."""
    run = ["--model", tiny_model_dir, *RUN, "--mode", mode, "--updates-per-iteration", updates]
    straight = subprocess.run(trainer(*run, "--out", tmp_path / "straight"), cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
    assert straight.returncode == 0, straight.stderr
    out = tmp_path / "stopped"
    saving = ["--save-every", "1"] if stop == signal.SIGKILL else ["--save-every", "2", "--save-on-stop"]
    process = subprocess.Popen(trainer(*run, *saving, "--out", out), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (list(out.glob("checkpoint-2")) if stop == signal.SIGKILL else
                   (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        process.send_signal(stop)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == (-signal.SIGKILL if stop == signal.SIGKILL else 128 + signal.SIGTERM), err
    assert checkpoint.checkpoints(out), "no checkpoint was written"
    assert not (out / "policy").exists()
    resumed = subprocess.run(trainer("--resume", "auto", "--out", out, "--model", tiny_model_dir), cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    assert_same_run(tmp_path / "straight", out)


def test_resume_refuses_options_that_change_the_run(tiny_model_dir):
    """Claim: a resumed run takes the checkpoint's options; a result-changing one given with another value is one
    line naming it; harmless ones (iterations, evaluation, threads) are the checkpoint's unless given anew."""
    saved = parse_args(["--model", str(tiny_model_dir), *RUN, "--seed", "3", "--lr", "0.01", "--tail-threads", "2"])
    state = {"iterations_done": 2, "config": dataclasses.asdict(saved), "reference_fingerprint": "x"}
    for argv, option in ((["--seed", "4"], "--seed"), (["--lr", "0.02"], "--lr"), (["--group-size", "8"], "--group-size"),
                         (["--groups-per-chunk", "4"], "--groups-per-chunk"),
                         (["--eval-size", "8"], "--eval-size")):  # data without a test split: fewer training rows
        with pytest.raises(checkpoint.CheckpointError, match=f"^{option} .* differs from the checkpoint's"):
            checkpoint.resumed_config(parse_args(argv), given_options(argv), state)
    argv = ["--seed", "3", "--iterations", "9", "--out", "elsewhere", "--train-threads", "2", "--mode", "sync"]
    cfg = checkpoint.resumed_config(parse_args(argv), given_options(argv), state)
    assert cfg.mode == "sync" != saved.mode
    assert (cfg.seed, cfg.lr, cfg.model, cfg.batch_size, cfg.groups_per_chunk) == (3, 0.01, str(tiny_model_dir), 16, 2)
    assert (cfg.iterations, cfg.eval_every, cfg.out, cfg.train_threads, cfg.rollout_threads) == (9, 2, "elsewhere", 2, 1)
    assert cfg.tail_threads == 2  # the probe's elastic tail is the saved run's too (setup.elastic_threads)
    argv = ["--tail-threads", "1"]  # harmless given anew (float rounding only)
    assert checkpoint.resumed_config(parse_args(argv), given_options(argv), state).tail_threads == 1


def test_a_checkpoint_from_before_tail_threads_resumes_without_a_switch(tiny_model_dir, tmp_path):
    """Claim: a checkpoint written before --tail-threads existed resumes with every size fixed (no probe, which
    would pick other sizes): its tail is its training threads, so the trainer never switches (as it ran)."""
    saved = dataclasses.asdict(parse_args(["--model", str(tiny_model_dir), *RUN]))
    del saved["tail_threads"]
    (tmp_path / "state.json").write_text(json.dumps({"iterations_done": 2, "config": saved,
                                                     "reference_fingerprint": "x"}))
    state = checkpoint.read_state(tmp_path)
    cfg = checkpoint.resumed_config(parse_args([]), set(), state)
    assert cfg.tail_threads == cfg.train_threads == 1 and cfg.sized


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
        with pytest.raises(OSError):
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
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.find("auto", tmp_path / "empty")
    (tmp_path / "checkpoint-2" / "state.json").write_text("{")
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.read_state(tmp_path / "checkpoint-2")


def test_a_bad_resume_is_one_line(tmp_path):
    """Claim: `--resume` of something that is not a checkpoint ends with one line and exit 1, before any loading."""
    result = subprocess.run(trainer("--resume", tmp_path, "--out", tmp_path / "out"), cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --resume {tmp_path}: not a checkpoint directory (no "
                                                  f"state.json in it); pass a <out>/checkpoint-<k> directory or "
                                                  f"--resume auto"]


def test_a_stop_writes_a_checkpoint_of_the_iterations_done(tiny_model_dir, tmp_path):
    """Claim: with --save-on-stop, a stop (the KeyboardInterrupt trainer.py raises for SIGINT, SIGTERM and SIGHUP)
    arriving while iteration 1's row is being logged writes checkpoint-1 (θ_1, AdamW after one step), and that
    checkpoint restores the weights the run had."""
    from launch import setup
    from infra.data import load_task
    from infra.reward import load_rewards
    cfg = parse_args(["--model", str(tiny_model_dir), *RUN, "--mode", "sync", "--save-on-stop", "--out", str(tmp_path)])
    policy, tokenizer = load_model(cfg.model)
    train, held_out = load_task(cfg.data, eval_size=cfg.eval_size)
    rows = setup.train(cfg, policy, tokenizer, train, held_out, load_rewards(cfg.reward), {})
    assert next(rows)["iteration"] == 0
    with pytest.raises(KeyboardInterrupt):
        rows.throw(KeyboardInterrupt())
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-1"]
    fresh, _ = load_model(cfg.model)
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=cfg.lr)
    assert checkpoint.restore(tmp_path / "checkpoint-1", fresh, optimizer, checkpoint.fingerprint(fresh)) == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), policy.parameters()))


KILLED_WHILE_SAVING = """
import sys, time, torch
from infra import checkpoint
from infra.options import parse_args
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
