"""Outputs and saves fail cleanly: bad output paths are one line at start-up, one run per --out,
no previous run mixed in or lost, the policy saved before anything that can still fail, and saved atomically."""
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import trainer
from config import Config
from infra import checkpoint, outputs
from infra.command_line import given_options, parse_args
from infra.options import derive, validate
from infra.stopping import Interrupted
from infra.tiny import ensure_tiny_model
from launch import run_output
import warm

ROOT = Path(__file__).resolve().parents[2]
FIXED_SIZES = ["--groups-per-call", "2", "--micro-batch-tokens", "1000", "--rollout-threads", "1",
               "--train-threads", "1"]  # no probe: the run is short and its reward calls countable


def small_run(out, *extra) -> list[str]:
    return ["--data", "arithmetic", "--iterations", "2", "--batch-size", "16", "--group-size", "4",
            "--max-new-tokens", "4", "--eval-every", "0", *FIXED_SIZES, "--out", str(out), *extra]


def trainer_py(*args, **kwargs) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "trainer.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, **kwargs)


def assert_one_error_line(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr


def read_only(path: Path) -> Path:
    """`path`, made read-only; skips the test where that denies nothing (root, with CAP_DAC_OVERRIDE)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    if os.access(path, os.W_OK):
        pytest.skip("this user writes into read-only directories (root)")
    return path


def assert_loadable(policy_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    ids = torch.tensor([tokenizer.encode("12+7=", add_special_tokens=False)])
    assert torch.isfinite(model(ids).logits).all()


# --- the output paths, at start-up ---
@pytest.mark.parametrize("out", ["", "  "])
def test_blank_out_is_refused(out):
    """Claim: `--out ''` and a blank --trace are refused by validate."""
    assert any(p.startswith("--out must name a directory") for p in validate(Config(out=out)))
    assert any(p.startswith("--trace must name a file") for p in validate(Config(trace=out)))


@pytest.mark.parametrize("option, fragment", [("--out", "is a file, not a directory"),
                                              ("--trace", "is a directory")])
def test_bad_output_path_fails_before_any_model_is_loaded(tmp_path, option, fragment):
    """Claim: an --out that is a file, or a --trace that is a directory (found only after training before), is one
    `error:` line at once: the run stops before loading the model (a model that does not exist is never reached)."""
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "folder").mkdir()
    paths = {"--out": tmp_path / "file", "--trace": tmp_path / "folder"}
    args = ["--model", "periodic-rl-tests/no-such-model",  # a hub id that is not there: loading it would fail
            "--out", paths["--out"] if option == "--out" else tmp_path / "run"]
    result = trainer_py(*args, *(["--trace", paths["--trace"]] if option == "--trace" else []))
    assert_one_error_line(result, fragment)
    assert "no-such-model" not in result.stderr


def test_read_only_paths_are_one_line(tmp_path):
    """Claim: a read-only --out, a read-only folder for --trace or for a new --out, and a read-only --cache-dir
    where the tiny model must be built are each reported as one line naming the path, before anything is written."""
    locked = read_only(tmp_path / "locked")
    for cfg, fragment in [(Config(out=str(locked)), f"--out {locked} is not writable"),
                          (Config(out=str(locked / "run")), f"--out {locked / 'run'} cannot be created"),
                          (Config(out=str(tmp_path / "run"), trace=str(locked / "trace.json")), "--trace")]:
        with pytest.raises(outputs.OutputError, match=fragment):
            outputs.check_paths(cfg)
    with pytest.raises(outputs.OutputError, match=f"tiny-model cache .* {re.escape(str(locked))} is not writable"):
        ensure_tiny_model(locked)
    assert not any(locked.iterdir())


WITHOUT_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="for root only (others run it directly)")
def test_read_only_paths_are_one_line_for_root_too():
    """Claim: as root (CI's user here), the read-only test above runs too: in a subprocess that has dropped the
    capability to write anywhere (setpriv), where read-only means read-only, instead of skipping."""
    if subprocess.run([*WITHOUT_OVERRIDE, "true"]).returncode:
        pytest.skip("setpriv may not drop capabilities here")
    result = subprocess.run([*WITHOUT_OVERRIDE, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"{__file__}::test_read_only_paths_are_one_line"], cwd=faults.ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-2000:]


# --- one run per directory, nothing mixed, nothing lost ---
def test_a_busy_out_is_refused_naming_the_other_run(tmp_path):
    """Claim: while a run holds --out, a second run on it stops at once with one line naming the first run's PID;
    the lock is released when the first run ends."""
    cfg = Config(out=str(tmp_path))
    with outputs.claimed(cfg):
        result = trainer_py("--model", "periodic-rl-tests/no-such-model", "--out", tmp_path)
        assert_one_error_line(result, f"--out {tmp_path} is in use by another run (PID {os.getpid()})")
    with outputs.claimed(cfg):  # free again
        pass


def test_a_previous_run_is_refused_unless_overwrite(tmp_path):
    """Claim: --out holding a previous run (metrics.jsonl with rows, policy/, checkpoints) is refused and left
    untouched; --overwrite deletes those files first (and a half-written save); an empty metrics.jsonl is no run."""
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (tmp_path / "policy").mkdir()
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "state.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("the user's own file")
    (tmp_path / ".policy.saving-123").mkdir()
    with pytest.raises(outputs.OutputError, match=r"holds a previous run \(metrics.jsonl, policy/, checkpoint-2/\): "
                                                  r"pass --resume auto"):
        with outputs.claimed(Config(out=str(tmp_path))):
            pass
    assert (tmp_path / "metrics.jsonl").read_text() and (tmp_path / "policy").is_dir()
    with outputs.claimed(Config(out=str(tmp_path), overwrite=True)):
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "notes.txt"]
    (tmp_path / "metrics.jsonl").write_text("")
    with outputs.claimed(Config(out=str(tmp_path))):
        pass


def fake_run(out: Path, run_id: str = "run-0") -> Path:
    """A folder holding what a run of trainer.py leaves (its files' shapes: infra/outputs.run_files), with
    TensorBoard's events and a wandb folder of its run id."""
    (out / "policy").mkdir(parents=True)
    (out / "policy" / "config.json").write_text("{}")
    (out / "policy" / "model.safetensors").write_bytes(b"weights")
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "state.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (out / "config.json").write_text(json.dumps({"run_id": run_id, "versions": {}, "command": ["trainer.py"]}))
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents.1.host.2.0").write_bytes(b"events")
    (out / "wandb" / f"run-20260101_000000-{run_id}").mkdir(parents=True)
    (out / "wandb" / "latest-run").symlink_to(f"run-20260101_000000-{run_id}")
    (out / "wandb" / "debug.log").symlink_to(f"run-20260101_000000-{run_id}/debug.log")
    (out / "wandb" / f"run-20260101_000000-{run_id}" / "debug.log").write_text("log")
    return out


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_overwrite_deletes_only_the_run_in_out(tmp_path):
    """Claim: --overwrite deletes the run in --out, its metrics.jsonl, policy/, checkpoints, config.json,
    TensorBoard's events and its wandb folder, and nothing else: `--out . --overwrite` beside runs/latest and
    runs/exp2 (other runs, under the TensorBoard folder's name) and another run's wandb folder leaves them byte for
    byte. A path with a run's name that trainer.py did not write (another tool's config.json,
    a Hugging Face Trainer's checkpoint-500/, a policy/ without weights) is refused, with or without --overwrite."""
    fake_run(tmp_path)
    fake_run(tmp_path / "runs" / "latest", "latest-1")
    fake_run(tmp_path / "runs" / "exp2", "exp2-1")
    (tmp_path / "wandb" / "run-20250101_000000-other").mkdir()
    (tmp_path / "wandb" / "run-20250101_000000-other" / "files").write_text("another run's")
    (tmp_path / "notes.txt").write_text("the user's own file")
    others = {name: content for name, content in files(tmp_path).items()
              if name.startswith(("runs/latest/", "runs/exp2/", "wandb/run-20250101")) or name == "notes.txt"}
    with outputs.claimed(Config(out=str(tmp_path), overwrite=True)):
        assert files(tmp_path) == {**others, ".lock": files(tmp_path)[".lock"]}
    assert sorted(p.name for p in (tmp_path / "wandb").iterdir()) == ["run-20250101_000000-other"]
    for name, make in [("config.json", lambda p: p.write_text('{"model": "bert"}')),
                       ("checkpoint-500", lambda p: (p.mkdir(), (p / "trainer_state.json").write_text("{}"))),
                       ("policy", lambda p: (p.mkdir(), (p / "__init__.py").write_text("")))]:
        make(tmp_path / name)
        before = files(tmp_path)
        for overwrite in (False, True):
            with pytest.raises(outputs.OutputError, match=rf"^--out .* holds {name}/?, not written by this trainer: a "
                                                          "run writes there and would replace it; move it away"):
                with outputs.claimed(Config(out=str(tmp_path), overwrite=overwrite)):
                    pass
        assert files(tmp_path) == before
        outputs.remove(tmp_path / name)


# --- the policy: saved first, saved atomically ---
def test_replacing_a_directory_keeps_nothing_of_the_old_one(tmp_path):
    """Claim: save_atomically over an existing directory leaves exactly the new contents (none of the previous
    run's files beside them) and no temporary folder; a write that fails leaves the previous directory as it was."""
    target = tmp_path / "policy"
    target.mkdir()
    (target / "model.safetensors").write_text("previous weights")

    def write_new(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
    outputs.save_atomically(target, write_new)
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]
    assert [p.name for p in target.iterdir()] == ["config.json"]

    def write_then_fail(folder: Path) -> None:
        (folder / "config.json").write_text('{"torn": true}')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(OSError):
        outputs.save_atomically(target, write_then_fail)
    assert [p.name for p in tmp_path.iterdir()] == ["policy"] and (target / "config.json").read_text() == "{}"


def test_a_save_killed_half_way_leaves_the_previous_policy(tiny_model_dir, tmp_path):
    """Claim: SIGKILL while save_atomically writes (config written, weights not yet) leaves the previous policy/
    byte for byte, and from_pretrained loads it."""
    target = tmp_path / "policy"
    shutil.copytree(tiny_model_dir, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    script = (f"import sys, time; from pathlib import Path; sys.path.insert(0, {str(ROOT)!r})\n"
              "from infra import outputs\n"
              "def write(folder):\n"
              "    (folder / 'config.json').write_text('{}')\n"
              "    print('writing', flush=True)\n"
              "    time.sleep(60)\n"
              f"outputs.save_atomically(Path({str(target)!r}), write)\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "writing\n"
    finally:
        process.kill()
        process.wait()
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert_loadable(target)


def test_metrics_on_a_full_disk_is_one_line_saying_what_became_of_the_policy(tiny_model_dir, tmp_path, monkeypatch):
    """Claim: a full disk while appending to metrics.jsonl stops the run with one OutputError naming the file and
    the cause, and saying whether the trained policy was saved: before the last iteration it was not; at the
    final evaluation's row it was, complete and loadable (it is saved right after the last optimizer step). A full
    disk while saving the policy is one line too, and leaves the previous policy/ as it was."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = derive(Config(out=str(tmp_path), iterations=2))
    rows = [{"iteration": 0, "policy_version": 0, "eval_reward": 0.5},
            {"iteration": 1, "policy_version": 1, "eval_reward": None},
            {"iteration": 2, "policy_version": 2, "final": True, "eval_reward": 0.75}]
    open_path = Path.open

    def disk_full_at(iteration):
        def fake_open(path, mode="r", *args, **kwargs):
            if path.name == "metrics.jsonl" and mode == "a" and (  # (the file is created with the first row)
                    len(path.read_text().splitlines()) if path.exists() else 0) == iteration:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return open_path(path, mode, *args, **kwargs)
        return fake_open

    monkeypatch.setattr(Path, "open", disk_full_at(0))
    with pytest.raises(outputs.OutputError, match=r"^could not write metrics to .*metrics.jsonl: No space left on "
                                                  r"device \(the run stopped before training ended: no policy"):
        run_output.log_and_save(cfg, iter([dict(r) for r in rows]), model, tokenizer)
    assert not (tmp_path / "policy").exists()
    monkeypatch.setattr(Path, "open", disk_full_at(2))
    with pytest.raises(outputs.OutputError, match=r"No space left on device \(the trained policy was saved in "):
        run_output.log_and_save(cfg, iter([dict(r) for r in rows]), model, tokenizer)
    assert_loadable(tmp_path / "policy")
    monkeypatch.undo()
    (tmp_path / "metrics.jsonl").write_text("")  # a full disk at save time: the previous policy/ stays whole
    before = {p.name: p.read_bytes() for p in (tmp_path / "policy").iterdir()}
    save = model.save_pretrained

    def save_then_disk_full(folder, **kwargs):
        save(folder, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(model, "save_pretrained", save_then_disk_full)
    with pytest.raises(outputs.OutputError, match=r"^could not write the trained policy to .*policy: No space left "
                                                  r"on device$"):
        run_output.log_and_save(cfg, iter([dict(r) for r in rows]), model, tokenizer)
    assert {p.name: p.read_bytes() for p in (tmp_path / "policy").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "policy"]


def test_inference_process_dying_in_the_final_evaluation_keeps_the_policy(tiny_model_dir, tmp_path):
    """Claim: the inference process killed during the final evaluation ends the run with one `error:` line that
    says the policy was saved; policy/ is complete and loadable, nothing is left running or in /dev/shm; with
    --overwrite nothing of the previous run in --out survives beside the new one."""
    reward = tmp_path / "reward.py"  # 2 iterations x 16 responses + the first evaluation's 4 x 4: then the final one
    reward.write_text("import os, signal\ncalls = 0\n"
                      "def reward(prompt, completion, answer):\n"
                      "    global calls\n    calls += 1\n"
                      "    if calls > 48:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
                      "    return 1.0\n")
    out = tmp_path / "run"
    fake_run(out)  # a previous run, its policy/ included
    (out / "policy" / "stale.bin").write_text("the previous run's file")
    run = faults.Launch("--model", tiny_model_dir, *small_run(out, "--eval-every", "2", "--eval-size", "4",
                                                              "--eval-samples", "4", "--reward", f"{reward}:reward",
                                                              "--overwrite"))
    with run:
        run.assert_stopped(1, r"^error: .*inference process.*\(the trained policy was saved in .*policy first\)$",
                           within=300)
    assert [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert not (out / "policy" / "stale.bin").exists()
    assert_loadable(out / "policy")


def test_a_failure_after_the_last_optimizer_step_saves_the_policy_first(tiny_model_dir, tmp_path, monkeypatch,
                                                                        capsys):
    """Claim: an error that no check foresaw, raised after the last optimizer step (transformers' polynomial schedule
    with a negative power divides by zero computing the rate after the last step; the start-up check that refuses it
    is bypassed here), still leaves the trained policy/ and every iteration's metrics row, and ends with one `error:`
    line naming the error and where the policy is, exit 1."""
    from infra import options
    monkeypatch.setattr(options, "schedule_problem", lambda cfg: None)
    out = tmp_path / "run"
    code = trainer.main(["--model", str(tiny_model_dir), "--mode", "sync", *small_run(out, "--iterations", "3"),
                         "--lr-scheduler-type", "polynomial", "--lr-scheduler-kwargs", '{"power": -1}'])
    err = capsys.readouterr().err
    assert code == 1 and err == (f"error: the run failed after its last optimizer step: ZeroDivisionError: 0.0 cannot "
                                 f"be raised to a negative power (the trained policy was saved in {out / 'policy'} "
                                 "first)\n")
    assert rows_of(out) == [0, 1, 2]
    assert_loadable(out / "policy")


@pytest.mark.slow
def test_closed_stdout_stops_the_run_without_a_traceback(tiny_model_dir, tmp_path):
    """Claim: `python trainer.py | head -n 1` prints that line, then the trainer stops (exit 1) with one `error:`
    line on stderr, no traceback, and leaves no process behind."""
    faults.become_subreaper()  # an orphaned inference process would be re-parented to this process
    before = faults.children(os.getpid())
    command = " ".join([sys.executable, "trainer.py", "--model", str(tiny_model_dir),
                        *small_run(tmp_path, "--iterations", "1000")])
    shm_before = faults.shm_entries()
    result = subprocess.run(["bash", "-c", f'{command} | head -n 1; exit "${{PIPESTATUS[0]}}"'], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.stdout.startswith("periodic-rl: async") and result.stdout.count("\n") == 1
    assert_one_error_line(result, "standard output was closed")
    time.sleep(1)
    left = {p: s for p, s in faults.children(os.getpid()).items() if before.get(p) != s}
    faults.reap(left)
    assert not [p for p, s in left.items() if faults.alive(p, s)], left
    assert faults.shm_entries() <= shm_before


# --- a full disk while saving: one line naming the path, nothing torn ---
def rows_of(out: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("size, extra, message, rows", [
    ("200k", [], r"^error: could not write the trained policy to .*/policy: No space left on device$", [0, 1]),
    ("3m", ["--save-every", "1"], r"^error: could not write the checkpoint .*/checkpoint-1: No space left on device "
                                  r"\(the run stopped before training ended: no policy was saved\)$", [0]),
], ids=["final-policy", "checkpoint"])
@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_line(tiny_model_dir, tmp_path, size, extra, message, rows):
    """Claim: a disk that fills up while the final policy is saved (safetensors' SafetensorError) or while a
    checkpoint is written (torch.save's RuntimeError, "unexpected pos": it names no cause) ends the run with one line
    naming the path and "No space left on device", exit 1, no traceback, nothing left running; no torn policy/ or
    checkpoint, no half-written folder, and metrics.jsonl holds every iteration done. Here --out is a tmpfs of
    `size` (the tiny policy: 1.3 MB, a checkpoint 3.9 MB)."""
    disk, keep = tmp_path / "disk", tmp_path / "left"
    with faults.Launch("--model", tiny_model_dir, *small_run(disk / "run", *extra),
                       wrapper=faults.small_disk(size, disk, keep)) as run:
        run.assert_stopped(1, message, within=300)
    left = keep / "run"
    assert rows_of(left) == rows
    assert sorted(p.name for p in left.iterdir()) == [".lock", "config.json", "metrics.jsonl"]


@pytest.mark.slow
def test_a_full_disk_on_the_stop_checkpoint_says_so(tiny_model_dir, tmp_path):
    """Claim: with --save-on-stop, a stop checkpoint that does not fit on the disk is named in the stop line (it
    said only "stopped"): exit 143, no traceback, no torn checkpoint, nothing left running."""
    disk, keep = tmp_path / "disk", tmp_path / "left"
    with faults.Launch("--model", tiny_model_dir, *small_run(disk / "run", "--iterations", "1000", "--save-on-stop",
                                                             "--no-save"),
                       wrapper=faults.small_disk("3m", disk, keep)) as run:
        run.wait_for(r"^iter ")
        run.send(signal.SIGTERM)
        run.assert_stopped(143, r"^interrupted by SIGTERM: the run was stopped, nothing is left running; the stop "
                                r"checkpoint could not be written \(could not write the checkpoint .*/checkpoint-\d+: "
                                r"No space left on device\): there is no checkpoint to resume from$")
    assert not [p.name for p in (keep / "run").iterdir() if "checkpoint" in p.name]


@pytest.mark.parametrize("stop_first", [True, False], ids=["stop-checkpoint", "periodic-checkpoint"])
def test_a_full_disk_is_named_whatever_stop_comes_while_its_error_goes_up(tiny_model_dir, tmp_path, monkeypatch,
                                                                          capsys, stop_first):
    """Claim: a checkpoint that does not fit on the disk is named in the stop line however the stop and the error
    meet: the stop checkpoint fails and a second stop comes while the run winds down (waiting for the inference
    process), or a periodic checkpoint fails and the stop comes as its error goes up. Either way the line names the
    full disk and the checkpoint --resume auto continues from (the stop raised on the way out replaced the disk's
    error, and the line said only "no checkpoint holds iterations 1 to 1")."""
    import learner
    from infra import tracking
    out, real_save, real_step, steps = tmp_path / "run", checkpoint.save, learner.Learner.step, []

    def save(directory, iterations_done, *args, **kwargs):
        if iterations_done < 2:
            return real_save(directory, iterations_done, *args, **kwargs)
        with outputs.writing("the checkpoint", Path(directory) / f"checkpoint-{iterations_done}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def step_then_stop(self):  # a stop right after iteration 1's step (the stop checkpoint then holds 2 iterations)
        real_step(self)
        steps.append(1)
        if stop_first and len(steps) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    def exit_stopped(self, *exc):  # a stop (the second, or the first) while the run winds down
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
    monkeypatch.setattr(checkpoint, "save", save)
    monkeypatch.setattr(learner.Learner, "step", step_then_stop)
    monkeypatch.setattr(tracking.Trackers, "__exit__", exit_stopped)
    code = trainer.main(["--model", str(tiny_model_dir), "--mode", "sync", *small_run(out, "--iterations", "4"),
                         "--save-every", "1"])
    lost = f"could not write the checkpoint {out / 'checkpoint-2'}: No space left on device"
    lost = (f"the stop checkpoint could not be written ({lost})" if stop_first
            else f"as the stop came, {lost} (the run stopped before training ended: no policy was saved)")
    assert code == 143 and capsys.readouterr().err == (
        f"interrupted by SIGTERM: the run was stopped, nothing is left running; {lost}: --resume auto --out {out} "
        f"continues from {out / 'checkpoint-1'} (1 of the 2 iterations done)\n")
    Interrupted.check()  # the stops were this run's: none is left pending for what the process does next


# --- without --out: a folder per run, runs/latest links the newest ---
def test_each_run_without_out_gets_a_folder_and_runs_latest_links_the_newest(tmp_path, monkeypatch):
    """Claim: two runs started in the same second get two folders (runs/<model>-<time>, then -2); runs/latest is a
    relative link to the newest, replaced atomically (plot.py, --config and --resume auto read through it); a
    runs/latest that is a run folder of its own (written before the link) is left as it is, with a line saying so."""
    monkeypatch.chdir(tmp_path)
    first, second = (outputs.run_folder("Qwen/Qwen2.5-0.5B", now=1.8e9) for _ in range(2))
    assert first.name == "Qwen2.5-0.5B-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(1.8e9))
    assert second.name == first.name + "-2" and first.is_dir() and second.is_dir()
    assert outputs.link_latest(first) == "" and os.readlink("runs/latest") == first.name
    assert outputs.link_latest(second) == "" and Path("runs/latest").resolve() == second.resolve()
    assert sorted(p.name for p in Path("runs").iterdir()) == sorted([first.name, second.name, "latest"])
    os.remove("runs/latest")
    Path("runs/latest").mkdir()
    note = outputs.link_latest(second)
    assert "runs/latest is a run folder of its own" in note and Path("runs/latest").is_dir()
    assert not Path("runs/latest").is_symlink()


def test_a_refused_start_without_out_leaves_no_folder_and_runs_latest_where_it_was(tiny_model_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    """Claim: a run without --out whose start is refused (here its reward file is missing, found once the task is
    read, after its folder was made) ends with its one line and leaves nothing under runs/: no folder of its own,
    runs/latest still the previous run."""
    monkeypatch.chdir(tmp_path)
    previous = outputs.run_folder("tiny")
    outputs.link_latest(previous)
    code = trainer.main(["--model", str(tiny_model_dir), "--data", "arithmetic", "--reward", "missing.py:score",
                         "--iterations", "1"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "missing.py" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in Path("runs").iterdir()) == sorted([previous.name, "latest"])
    assert Path("runs/latest").resolve() == previous.resolve()


def test_resume_auto_needs_out_and_starts_a_run_where_there_is_none(tmp_path, monkeypatch, capsys):
    """Claim: `--resume auto` without --out is refused in one line;
    with an --out that holds no run it starts one, with a line saying so, so that the same command serves every
    submission of a preemptible job; an --out that holds a run is left to resume."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--resume", "auto"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == ("trainer.py: error: --resume auto needs --out DIR: the run to continue "
                                                 "(runs/latest may be another run by the time a job is resubmitted)\n")
    assert parse_args(["--resume", "auto", "--out", "elsewhere"]).out == "elsewhere"
    assert outputs.resume_or_start(Config(resume="auto", out="elsewhere")) == Config(resume=None, out="elsewhere")
    assert "periodic-rl: --resume auto: elsewhere holds no run to continue; starting a new one" in capsys.readouterr().out
    run = outputs.run_folder("tiny")
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    assert outputs.resume_or_start(Config(resume="auto", out=str(run))).resume == "auto"
    assert outputs.resume_or_start(Config()) == Config()  # a new run's folder is made by rank 0 (trainer.main)


def stopped_run(out: Path, **options) -> Path:
    """What a run leaves when it stops before its first checkpoint: its record (with `options`) and a row."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"run_id": "run-0", "versions": {}, **options}))
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n')
    return out


def test_resume_auto_restarts_a_run_that_stopped_early_with_its_own_options(tmp_path, capsys):
    """Claim: `--resume auto --out DIR` alone, where DIR holds a run that stopped before its first checkpoint,
    restarts that run as it was started (its command line, as config.json records it), not with the defaults, and
    says which options it took; what follows from them (the model's defaults, the devices, the sizes) is derived
    again; options given now win; a recorded command that no longer reads (a relative --config file, from another
    folder) restarts with the options given now, saying so."""
    def restart(*argv: str) -> Config:
        argv = ["--resume", "auto", "--out", str(out), *argv]
        cfg, found = checkpoint.resumption(parse_args(argv), given_options(argv), None, argv)
        assert found is None
        return cfg

    command = ["trainer.py", "--model", "tiny-chain", "--lr", "0.25", "--group-size", "6", "--batch-size", "12",
               "--save-every", "20", "--iterations", "9", "--out", "DIR", "--overwrite"]
    out = stopped_run(tmp_path / "early", command=command, save_every=20, lr=0.25, group_size=6, batch_size=12,
                      model="tiny-chain", iterations=9, max_new_tokens=128, groups_per_call=3, rollout_threads=1)
    cfg = restart()
    chain = parse_args(command[1:-3])  # the run as first started: tiny-chain's defaults derived from its name
    assert (cfg.model, cfg.lr, cfg.group_size, cfg.save_every, cfg.iterations) == ("tiny-chain", 0.25, 6, 20, 9)
    assert cfg.max_new_tokens == chain.max_new_tokens != Config().max_new_tokens
    assert (cfg.groups_per_call, cfg.rollout_threads, cfg.overwrite) == (chain.groups_per_call, chain.rollout_threads,
                                                                         False)
    assert (cfg.out, cfg.resume) == (str(out), "auto")
    assert capsys.readouterr().out == (f"periodic-rl: --resume auto: restarting with the options of the run in {out}: "
                                       "--batch-size --group-size --iterations --lr --model --save-every\n")
    cfg = restart("--group-size", "4", "--iterations", "4")
    assert (cfg.lr, cfg.group_size, cfg.iterations, cfg.model) == (0.25, 4, 4, "tiny-chain")
    capsys.readouterr()
    (out / "config.json").write_text(json.dumps({"run_id": "r", "versions": {}, "lr": 0.25,
                                                 "command": ["trainer.py", "--config", "moved.yaml"]}))
    assert restart().lr == parse_args([]).lr != 0.25
    assert f"periodic-rl: --resume auto: the command of the run in {out} (--config moved.yaml) no longer reads (" \
        in capsys.readouterr().out


def test_resume_auto_starts_again_a_run_that_stopped_before_its_first_checkpoint(tmp_path, capsys):
    """Claim: `--resume auto` where --out holds a run that stopped before its first checkpoint (it asked for them:
    --save-every or --save-on-stop) starts the run from iteration 0, replacing that run's outputs, with one line
    saying so. It still refuses, touching nothing, a run that is finished (its
    policy/) or asked for no checkpoints (only its rows would be lost, and --overwrite says so), and an --out in
    use. Without --resume, such a run is refused without the advice to pass --resume auto (there is nothing to
    continue)."""
    out = stopped_run(tmp_path / "early", save_every=20)
    cfg = Config(out=str(out), resume="auto", save_every=20)
    assert checkpoint.resumption(cfg, {"out", "resume", "save_every"}) == (cfg, None)
    with pytest.raises(outputs.OutputError, match=rf"^--out {out} holds a previous run \(metrics.jsonl\): it has no "
                                                  r"checkpoint to continue from: pass --overwrite to replace it, or "
                                                  r"choose another --out$"):
        with outputs.claimed(Config(out=str(out))):
            pass
    with open(out / ".lock", "a+") as lock:  # in use by another run: refused, nothing said or removed
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(outputs.OutputError, match="is in use by another run"):
            with outputs.claimed(cfg):
                pass
    assert not capsys.readouterr().out and (out / "metrics.jsonl").read_text()
    with outputs.claimed(cfg):
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    assert capsys.readouterr().out == (f"periodic-rl: --resume auto: no checkpoint in {out} yet: starting the run from "
                                       "iteration 0 (replacing the outputs of the run that stopped before its first "
                                       "checkpoint: metrics.jsonl)\n")
    on_stop = stopped_run(tmp_path / "on-stop", save_on_stop=True)
    with outputs.claimed(Config(out=str(on_stop), resume="auto", overwrite=True)):  # --overwrite too: the same
        assert not (on_stop / "metrics.jsonl").exists()
    for refused, why in [(stopped_run(tmp_path / "no-checkpoints", save_every=0), "started without --save-every or "
                                                                                  "--save-on-stop"),
                         (stopped_run(tmp_path / "finished", save_every=20), "holds a finished run")]:
        if refused.name == "finished":
            (refused / "policy").mkdir()
            (refused / "policy" / "config.json").write_text("{}")
            (refused / "policy" / "model.safetensors").write_bytes(b"weights")
        before = sorted(p.name for p in refused.iterdir())
        with pytest.raises(outputs.OutputError, match=rf"^--resume auto: --out {refused} .*{why}.*; pass --overwrite "
                                                      r"instead of --resume auto"):
            with outputs.claimed(Config(out=str(refused), resume="auto")):
                pass
        assert sorted(p.name for p in refused.iterdir() if p.name != ".lock") == before


def test_a_finished_lora_run_can_be_resumed_or_overwritten(tmp_path):
    """Claim: a finished --use-peft run's policy/ (peft's adapter_config.json and adapter_model.safetensors, no
    config.json) is this trainer's: its --out is continued by --resume auto and replaced by --overwrite, not refused
    as "not written by this trainer"; a folder of another tool named policy/ still is."""
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (tmp_path / "policy" / "adapter_model.safetensors").write_bytes(b"adapter")
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (tmp_path / "checkpoint-2").mkdir()  # (without one, there would be nothing to continue)
    (tmp_path / "checkpoint-2" / "state.json").write_text("{}")
    with outputs.claimed(Config(out=str(tmp_path), resume="auto")):
        assert (tmp_path / "policy" / "adapter_model.safetensors").is_file()
    with outputs.claimed(Config(out=str(tmp_path), overwrite=True)):
        assert not (tmp_path / "policy").exists() and not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "adapter_config.json").write_text("{}")  # no weights: not a saved adapter
    with pytest.raises(outputs.OutputError, match="holds policy/, not written by this trainer"):
        with outputs.claimed(Config(out=str(tmp_path), overwrite=True)):
            pass


@pytest.mark.slow
def test_the_readme_commands_run_again_and_rerun_from_another_folder(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Claim: `python trainer.py` twice without --out makes two runs, runs/latest links the
    second, `python plot.py runs/latest` draws it; its config.json records absolute paths, so `--config
    A/runs/latest/config.json` reruns it from another folder B (its relative --data file and reward file found),
    into a folder of its own there. The first run is the command as typed, in a subprocess; the second, the plot and
    the rerun are the same entry points (trainer.main, plot.main) called in this process from those folders."""
    import plot
    first, other = tmp_path / "A", tmp_path / "B"
    first.mkdir(), other.mkdir()
    (first / "data.jsonl").write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                              for i in range(40)))
    shutil.copy(ROOT / "tests" / "rewards.py", first / "my_rewards.py")
    args = ["--model", str(tiny_model_dir), "--data", "data.jsonl", "--reward", "my_rewards.py:digit_fraction",
            "--iterations", "1", "--batch-size", "8", "--group-size", "4", "--max-new-tokens", "4", "--eval-every",
            "0", "--eval-size", "4", "--mode", "sync", "--sizes", "rule", "--no-save"]
    done = warm.run([sys.executable, ROOT / "trainer.py", *args], cwd=first, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    monkeypatch.chdir(first)
    assert trainer.main(args) == 0, capsys.readouterr().err
    runs = sorted(p for p in (first / "runs").iterdir() if p.name != "latest")
    assert len(runs) == 2 and (first / "runs/latest").resolve() == runs[-1].resolve()
    assert plot.main(["runs/latest"]) == 0 and (runs[-1] / "metrics.png").is_file(), capsys.readouterr().err
    record = json.loads((first / "runs/latest/config.json").read_text())
    assert record["data"] == str(first / "data.jsonl") and record["out"] == str(runs[-1])
    assert record["reward"] == [f"{first / 'my_rewards.py'}:digit_fraction"]
    monkeypatch.chdir(other)
    capsys.readouterr()
    assert trainer.main(["--config", str(first / "runs/latest/config.json")]) == 0, capsys.readouterr().err
    rerun = next(p for p in (other / "runs").iterdir() if p.name != "latest")
    assert f"out runs/{rerun.name}" in capsys.readouterr().out
    assert json.loads((rerun / "config.json").read_text())["data"] == record["data"]


def test_a_runs_folder_as_model_is_its_trained_policy(tmp_path, capsys, monkeypatch):
    """Claim: --model naming a folder this trainer wrote takes the model inside it, as a TRL user passes output_dir
    to from_pretrained: a run's --out (config.json a run record) -> its policy/, a checkpoint-<k>/ -> its policy/,
    and either policy/ itself (the path the done line prints), resolved (runs/latest moves on: recorded through the
    link, a resume or a rerun would take another run's weights); a run with no policy/ yet is one line naming its
    newest checkpoint's (or saying it has none); any other folder is left as it is. What derive fills from the
    model's name (--data, --lr, --max-new-tokens) follows the run that trained it, where not given. --overwrite of
    an --out holding the model is refused: the run's deletion would come before the model loads."""
    from infra import outputs
    from infra.command_line import parse_args
    from infra.outputs import trained_policy
    run = (tmp_path / "run").resolve()
    (run / "policy").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"run_id": "r", "versions": {}}))
    with pytest.raises(ValueError, match="no trained policy .*it has no checkpoint either"):
        trained_policy(str(run))
    checkpoint = run / "checkpoint-3"
    (checkpoint / "policy").mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"config": {"model": "tiny", "lr": 1e-4, "max_new_tokens": 8}}))
    for folder in (run / "policy", checkpoint / "policy"):
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")
    assert trained_policy(str(checkpoint)) == trained_policy(str(checkpoint / "policy") + "/") == checkpoint / "policy"
    (run / "policy" / "model.safetensors").unlink()
    (run / "policy" / "config.json").unlink()
    with pytest.raises(ValueError, match=f"newest checkpoint's is {checkpoint / 'policy'}; --resume auto"):
        trained_policy(str(run))
    (run / "policy" / "config.json").write_text("{}")
    (run / "policy" / "model.safetensors").write_bytes(b"")
    latest = tmp_path / "latest"
    latest.symlink_to(run)
    assert trained_policy(str(run)) == trained_policy(str(latest)) == trained_policy(str(run / "policy")) == \
        trained_policy(str(latest / "policy")) == run / "policy"
    assert trained_policy(str(tmp_path / "missing")) is None and trained_policy("Qwen/Qwen2.5-0.5B-Instruct") is None
    model_folder = tmp_path / "model"  # a Hugging Face model directory of no run: loaded as it is
    (model_folder / "policy").mkdir(parents=True)
    assert trained_policy(str(model_folder)) is None and trained_policy(str(model_folder / "policy")) is None

    assert parse_args(["--model", str(latest), "--data", "arithmetic"]).model == str(run / "policy")
    assert f"--model {latest}: a run's folder: took its trained policy, {run / 'policy'}" in capsys.readouterr().out
    for model in (run, run / "policy", latest):  # --overwrite would delete the model before it loads
        with pytest.raises(SystemExit):
            parse_args(["--model", str(model), "--out", str(latest), "--overwrite"])
        assert capsys.readouterr().err == (f"trainer.py: error: --model {model} is in --out {latest}, whose run "
                                           "--overwrite deletes before the model loads: choose another --out\n")
    (run / "config.json").write_text(json.dumps({"run_id": "r", "versions": {}, "model": "tiny", "data": None,
                                                 "lr": 1e-4, "max_new_tokens": 8}))
    cfg = parse_args(["--model", str(run), "--lr", "3e-5"])
    assert (cfg.model, cfg.data, cfg.lr, cfg.max_new_tokens) == (str(run / "policy"), "arithmetic", 3e-5, 8)
    assert capsys.readouterr().out.endswith(f"took its trained policy, {run / 'policy'}, --data arithmetic, "
                                            "--max-new-tokens 8 (the defaults its run had, not given)\n")
    cfg = parse_args(["--model", str(checkpoint / "policy")])  # the policy/ itself, a checkpoint's
    assert (cfg.model, cfg.data, cfg.lr, cfg.max_new_tokens) == (str(checkpoint / "policy"), "arithmetic", 1e-4, 8)
    assert capsys.readouterr().out == (f"periodic-rl: --model {checkpoint / 'policy'}: a run's trained policy: took "
                                       "--data arithmetic, --lr 0.0001, --max-new-tokens 8 (the defaults its run had, "
                                       "not given)\n")
    assert outputs.run_folder(str(run / "policy"), tmp_path / "runs", now=1.8e9).name.startswith("run-2027")
    assert outputs.run_folder(str(checkpoint / "policy"), tmp_path / "runs", now=1.8e9).name.startswith("run-2027")
    (tmp_path / "tiny").symlink_to(run)  # a run's folder named as the built-in model: the name wins, as it did
    monkeypatch.chdir(tmp_path)
    assert trained_policy("tiny") is None and parse_args(["--data", "arithmetic"]).model == "tiny"
    assert parse_args(["--out", "tiny", "--overwrite", "--data", "arithmetic"]).model == "tiny"  # not refused


def test_resuming_in_place_from_a_checkpoint_the_run_went_past_is_refused(tmp_path):
    """Claim: --resume <out>/checkpoint-200 where the run in <out> went on to checkpoint-241 is refused in one line
    naming the newer checkpoint and both ways on (--resume auto; the same checkpoint into another --out), nothing
    touched: continued in place it rotated checkpoint-200 away against the stale checkpoint-241, and --resume auto
    then jumped from 227 to 241, leaving iterations 227-240 out of metrics.jsonl for good. Resuming from the newest,
    or branching into another folder, goes on as before."""
    from config import Config
    from infra import outputs
    out = tmp_path / "run"
    for k in (200, 241):
        (out / f"checkpoint-{k}").mkdir(parents=True)
        (out / f"checkpoint-{k}" / "state.json").write_text("{}")
    (out / "metrics.jsonl").write_text(json.dumps({"iteration": 0}) + "\n")
    (out / "config.json").write_text(json.dumps({"run_id": "r", "versions": {}}))
    old = str(out / "checkpoint-200")
    with pytest.raises(outputs.OutputError, match=rf"--resume {re.escape(old)}: the run in --out {re.escape(str(out))} "
                       r"went on past it \(checkpoint-241/\): continue it from its newest with --resume auto, or "
                       rf"branch .* --resume {re.escape(old)} --out NEW_FOLDER"):
        with outputs.claimed(Config(out=str(out), resume=old)):
            pass
    assert sorted(p.name for p in out.iterdir() if p.name != ".lock") == [
        "checkpoint-200", "checkpoint-241", "config.json", "metrics.jsonl"]
    for resume, folder in ((str(out / "checkpoint-241"), out), ("auto", out), (old, tmp_path / "branch")):
        with outputs.claimed(Config(out=str(folder), resume=resume)):
            pass


def test_resume_auto_on_a_complete_run_exits_0_and_rewrites_nothing(tmp_path, capsys, monkeypatch):
    """Claim: the preemptible recipe's command (--resume auto --out X) resubmitted after the run's end says the run
    is complete and exits 0, every file as it was, with or without checkpoints: neither the final evaluation nor
    the final row runs again. Options given at the
    run's values (config.json, which writes paths absolute: a reward file and a ~ given as typed; --num-train-epochs
    too, a path through a link) are the same command; more --iterations still go on, and another value is still
    refused by the resume (None: the resume proceeds)."""
    import trainer
    from config import Config
    from infra import records
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "rw.py").write_text("def length(prompt, completion, answer):\n    return float(len(completion))\n")
    out = tmp_path / "run"
    (out / "policy").mkdir(parents=True)
    (out / "policy" / "config.json").write_text("{}")
    (out / "policy" / "model.safetensors").write_bytes(b"")
    (out / "config.json").write_text(json.dumps({
        "run_id": "r", "versions": {}, "iterations": 2, "data": "arithmetic", "lr": 1e-4, "num_train_epochs": 0.01,
        "model": str(out), "reward": ["math", f"{tmp_path / 'rw.py'}:length"], "cache_dir": str(tmp_path / "home/hf")}))
    rows = [{"iteration": 0, "eval_reward": 0.5}, {"iteration": 1}, {"iteration": 2, "final": True, "elapsed_s": 18.7}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert trainer.main(["--resume", "auto", "--out", "run", "--iterations", "2", "--data", "arithmetic", "--reward",
                         "math", "rw.py:length", "--cache-dir=~/hf"]) == 0
    assert f"--resume auto: the run in run is complete (2 iterations, its policy in {Path('run/policy')}): nothing " \
           "to do" in capsys.readouterr().out
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    assert records.finished(Config(out=str(out), resume="auto", iterations=3), {"iterations"}) is None  # goes on
    assert records.finished(Config(out=str(out), resume="auto", lr=5e-5), {"lr"}) is None  # refused, as before
    link = tmp_path / "link"
    link.symlink_to(out)
    assert records.finished(Config(out=str(out), resume="auto", lr=1e-4, num_train_epochs=0.01, model=str(link)),
                            {"lr", "num_train_epochs", "model"})  # the run's own values (a path through a link)
    assert records.finished(Config(out=str(out), resume=None), set()) is None
    (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))  # stopped before the end
    assert records.finished(Config(out=str(out), resume="auto"), set()) is None
