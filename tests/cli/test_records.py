"""What a run records about itself: trackers (infra/tracking.py), <out>/config.json and --config (infra/records.py), plot.py."""
import contextlib
import dataclasses
import json
import math
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import once_per_session

import plot
import trainer
from config import Config
from infra import outputs
from infra.checkpoint import CheckpointError, resumption
from infra.command_line import given_options, parse_args
from infra.records import RunRecord, absolute_paths, git_commit
from infra.tracking import TRL_KEYS, TensorBoard, Trackers, TrackingError, tracker_names
from launch import exits, run_output
import warm

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--mode", "sync", "--iterations", "3", "--batch-size", "16", "--group-size", "4", "--max-new-tokens", "4",
       "--eval-every", "2", "--eval-size", "4", "--report-to", "tensorboard"]


@pytest.fixture(scope="session")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """One 3-iteration run of trainer.py with --report-to tensorboard, run once for the session; its sizes are
    left to the probe."""
    def make(out: Path) -> None:
        argv = ["--model", str(tiny_model_dir), "--data", "arithmetic", *RUN, "--out", str(out)]
        result = warm.run([sys.executable, "trainer.py", *argv], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        (out / "argv.json").write_text(json.dumps(argv))
    return once_per_session(tmp_path_factory, "records-run", make)


# --- trackers ---
def test_tracker_names_are_trls_and_pass_unknown_keys_through():
    """Claim: a row's figures get TRL's names (train/reward, train/kl, eval/reward, ...), timing goes under time/, a
    key this module does not know (another reward's mean, a new timing) still reaches the trackers under train/,
    eval/ or time/, and nothing that is not a number (None, the final flag) or is the step itself is logged."""
    row = {"iteration": 4, "policy_version": 4, "final": False, "eval_reward": None, "reward_mean": 0.5,
           "reward_std": 0.25, "kl": 0.01, "loss": -0.1, "clip_fraction": 0.0, "grad_norm": 2, "response_length": 5.5,
           "generate_s": 0.3, "tokens_per_s": 900.0, "overlap": 0.5, "rewards/format/mean": 1.0,
           "eval_accuracy": 0.75, "publish_s": 0.01, "note": "text"}
    assert tracker_names(row) == {
        "train/reward": 0.5, "train/reward_std": 0.25, "train/kl": 0.01, "train/loss": -0.1,
        "train/clip_ratio/region_mean": 0.0, "train/grad_norm": 2.0, "train/completions/mean_length": 5.5,
        "time/generate_s": 0.3, "time/tokens_per_s": 900.0, "time/overlap": 0.5, "train/rewards/format/mean": 1.0,
        "eval/accuracy": 0.75, "time/publish_s": 0.01}
    assert tracker_names({"iteration": 9, "final": True, "eval_reward": 0.8}) == {"eval/reward": 0.8}


@pytest.mark.parametrize("tracker, module", [("wandb", "wandb"), ("trackio", "trackio"),
                                             ("tensorboard", "torch.utils.tensorboard")])
def test_a_missing_tracker_package_fails_in_one_line_before_any_model_loads(tracker, module, tmp_path, monkeypatch,
                                                                            capsys):
    """Claim: --report-to naming a tracker whose package is not installed ends with one line naming the pip
    command, exit 1, before the task or a model is loaded (and before config.json is written)."""
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError, as when not installed

    def loads(*args, **kwargs):
        raise AssertionError("a model or the task was loaded")
    monkeypatch.setattr(trainer, "prepare", loads)
    monkeypatch.setattr(trainer, "load_policy", loads)
    assert trainer.main(["--report-to", tracker, "--out", str(tmp_path)]) == 1
    package = "tensorboard" if tracker == "tensorboard" else tracker
    assert capsys.readouterr().err == f"error: --report-to {tracker} needs the {package} package: pip install {package}\n"
    assert not (tmp_path / "config.json").exists()


class FakeWandb(types.ModuleType):
    """wandb's calls as trainer.py makes them (wandb is not installed here), recorded."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, names, step):
        self.calls.append(("log", step, names))

    def finish(self, exit_code):
        self.calls.append(("finish", exit_code))


@pytest.mark.parametrize("stop", [None, RuntimeError, KeyboardInterrupt])
def test_wandb_gets_each_row_at_its_iteration_and_is_finished_however_the_run_ends(stop, tmp_path, monkeypatch):
    """Claim: with --report-to wandb the run is opened once with the run's options, each row is logged at step =
    its iteration under tracker_names, and wandb.finish is called when the run ends, also on an error or
    Ctrl-C (exit code 1 then, so wandb marks the run failed)."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    rows = [{"iteration": 2, "reward_mean": 0.5, "kl": None}, {"iteration": 3, "final": True, "eval_reward": 0.7}]
    with pytest.raises(stop) if stop else contextlib.nullcontext():
        with Trackers(["wandb"]) as trackers:
            trackers.start(tmp_path, {"lr": 0.1}, "run-1", first_step=2)
            for row in rows:
                trackers.log(row)
            if stop:
                raise stop()
    assert wandb.calls == [
        ("init", dict(project="periodic-rl", id="run-1", name="run-1", config={"lr": 0.1}, dir=str(tmp_path),
                      resume="allow")),
        ("log", 2, {"train/reward": 0.5}), ("log", 3, {"eval/reward": 0.7}), ("finish", 1 if stop else 0)]


def test_a_tracker_that_cannot_start_is_one_line_naming_it(tmp_path, monkeypatch):
    """Claim: a tracker that fails to start its run (wandb not logged in, no network) stops the run with one line
    naming --report-to and the cause, not a traceback, and the trackers already open are closed."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setattr(wandb, "init", lambda **kwargs: (_ for _ in ()).throw(RuntimeError("api key\nnot set")))
    with pytest.raises(TrackingError, match=r"^--report-to wandb could not start its run \(RuntimeError: api key "
                                            r"not set\)$"):
        with Trackers(["tensorboard", "wandb"]) as trackers:
            trackers.start(tmp_path, {}, "run-1")
    assert not trackers.opened and (tmp_path / "runs").is_dir()


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard log directory, read back by TensorBoard's own reader: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    reader = EventAccumulator(str(log_dir))
    reader.Reload()
    return {tag: [(event.step, event.value) for event in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_events_equal_metrics_jsonl(run_dir):
    """Claim: --report-to tensorboard writes <out>/runs, whose events, read back by TensorBoard's reader, are
    metrics.jsonl's rows under tracker_names at step = iteration: every figure, every row, the final held-out
    reward included (exact: an event holds the float32 of the row's value)."""
    rows = outputs.read_metrics(run_dir / "metrics.jsonl")
    expected = {}
    for row in rows:
        for name, value in tracker_names(row).items():
            expected.setdefault(name, []).append((row["iteration"], float(np.float32(value))))
    assert scalars(run_dir / "runs") == expected
    assert expected["eval/reward"][-1][0] == 3 and len(expected["train/kl"]) == 3


def test_a_resumed_run_replaces_tensorboards_events_from_its_step_on(tmp_path):
    """Claim: a run resumed at iteration k logs into the same <out>/runs from step k, and TensorBoard's reader
    drops the stopped run's events from k on (purge_step), so each step has one value: the resumed run's."""
    from torch.utils import tensorboard
    first = TensorBoard(tensorboard, tmp_path, {}, "run", first_step=0)
    for step in range(4):
        first.log({"train/reward": float(step)}, step)
    first.close(failed=True)  # killed after iteration 3's row; the checkpoint is of iteration 2
    resumed = TensorBoard(tensorboard, tmp_path, {}, "run", first_step=2)
    for step in (2, 3, 4):
        resumed.log({"train/reward": 10.0 + step}, step)
    resumed.close(failed=False)
    assert scalars(tmp_path / "runs") == {"train/reward": [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]}


# --- config.json and --config ---
def test_config_json_records_the_resolved_options_the_versions_and_the_command(run_dir):
    """Claim: <out>/config.json holds every option as the run resolved it, the sizes the probe chose included,
    the versions of Python, torch, transformers and datasets, this checkout's commit, and
    the command line."""
    import torch
    import transformers
    record = json.loads((run_dir / "config.json").read_text())
    assert set(record) == {f.name for f in dataclasses.fields(Config)} | {"run_id", "versions", "command"}
    assert record["micro_batch_tokens"] and record["groups_per_call"] and record["lr"] == 1e-6  # derived: not given
    assert record["command"] == ["trainer.py", *json.loads((run_dir / "argv.json").read_text())]
    versions = record["versions"]
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3])) and "datasets" in versions
    if (ROOT / ".git").exists():  # a checkout (or a worktree): HEAD's commit and whether tracked files changed
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        assert versions["periodic_rl"]["commit"] == head and isinstance(versions["periodic_rl"]["dirty"], bool)


def test_the_commit_is_recorded_only_for_the_top_of_a_checkout(tmp_path):
    """Claim: versions' periodic_rl entry is the checkout's HEAD with dirty = tracked files changed (new untracked
    files, such as runs/, do not count), and None for a folder that is no checkout or only lies inside one."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    assert git_commit(tmp_path) is None
    git("init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "new.txt").write_text("untracked")
    assert git_commit(tmp_path) == {"commit": head.strip(), "dirty": False}
    (tmp_path / "code.py").write_text("a = 2\n")
    assert git_commit(tmp_path) == {"commit": head.strip(), "dirty": True}
    assert git_commit(tmp_path / "runs") is None


def test_a_resumed_run_keeps_its_run_id(tmp_path):
    """Claim: a resumed run rewrites config.json under the same run_id (the name wandb and trackio continue), while
    a new run in the same --out (after --overwrite) gets a new one."""
    first = RunRecord(tmp_path, ["trainer.py"], resumed=False)
    first.write(Config(out=str(tmp_path)))
    assert RunRecord(tmp_path, ["trainer.py", "--resume", "auto"], resumed=True).run_id == first.run_id
    assert RunRecord(tmp_path, ["trainer.py"], resumed=False).run_id != first.run_id
    assert first.run_id.startswith(tmp_path.name[:8])


def test_config_json_records_paths_absolute_and_reruns_from_another_folder(tmp_path, monkeypatch):
    """Claim: config.json's paths are absolute (a local --data file, a local --model directory,
    --cache-dir, --out, --trace, a --resume checkpoint, a reward file 'path.py:function'), while names that are no
    local path (hub ids, built-in tasks and rewards, module:function, tiny) stay as given; so `--config` of it
    from another folder finds the data and the reward file (validate checks --data exists), where the relative
    record failed on --data."""
    run, other = tmp_path / "run", tmp_path / "other"
    (run / "model").mkdir(parents=True), other.mkdir()
    (run / "data.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (run / "my_rewards.py").write_text("def f(prompt, completion, answer):\n    return 1.0\n")
    monkeypatch.chdir(run)
    cfg = parse_args(["--data", "data.jsonl", "--reward", "my_rewards.py:f", "--reward", "math", "--reward",
                      "tests.rewards:digit_fraction", "--out", "out", "--trace", "t.json", "--cache-dir", "cache",
                      "--sizes", "rule"])
    (run / "out").mkdir()
    RunRecord(Path("out"), ["trainer.py"], resumed=False).write(cfg)
    record = json.loads((run / "out" / "config.json").read_text())
    assert (record["data"], record["out"], record["trace"], record["cache_dir"], record["model"]) == \
        (str(run / "data.jsonl"), str(run / "out"), str(run / "t.json"), str(run / "cache"), "tiny")
    assert record["reward"] == [f"{run / 'my_rewards.py'}:f", "math", "tests.rewards:digit_fraction"]
    assert absolute_paths(Config(model="model", resume="ckpt", data="openai/gsm8k")) == \
        Config(model=str(run / "model"), resume=str(run / "ckpt"), data="openai/gsm8k")
    monkeypatch.chdir(other)
    rerun = parse_args(["--config", str(run / "out" / "config.json")])
    assert rerun.data == str(run / "data.jsonl") and rerun.out is None
    assert rerun.trace is None  # the old run's trace, absolute, is not written over (a rerun writes its own outputs)
    assert parse_args(["--config", str(run / "out" / "config.json"), "--trace", "new.json"]).trace == "new.json"
    from infra.reward import load_rewards
    assert load_rewards(rerun.reward[:1]) is not None  # the reward file, found from here


def test_config_json_fed_back_reruns_the_same_options_and_flags_override_it(run_dir):
    """Claim: `--config <out>/config.json` resolves to the run's own options (its sizes included, so a rerun
    batches alike), only `config` itself now naming the file and `out` left open (a rerun gets a folder of its own:
    the record's --out holds that run, and would be refused); a flag on the command line
    overrides the file."""
    record = json.loads((run_dir / "config.json").read_text())
    options = Config(**{f.name: record[f.name] for f in dataclasses.fields(Config)})
    path = str(run_dir / "config.json")
    assert parse_args(["--config", path]) == dataclasses.replace(options, config=path, out=None)
    assert parse_args(["--config", path, "--iterations", "7", "--no-save"]) == \
        dataclasses.replace(options, config=path, iterations=7, save=False, out=None)
    assert parse_args(["--config", path, "--out", "elsewhere"]).out == "elsewhere"
    assert {"lr", "micro_batch_tokens", "iterations"} <= given_options(["--config", path])


def test_a_trl_config_file_runs_with_the_keys_of_no_use_here_ignored(tmp_path, capsys):
    """Claim: a TRL GRPOConfig YAML with keys this trainer has no use for (logging_steps, push_to_hub, bf16,
    max_prompt_length) parses, the other keys as typed flags, with one line naming the ignored keys and why; TRL's
    per-device batch is taken as TRL derives its generation batch, and refused where TRL refuses it (a batch that
    is no whole number of groups), in one line naming TRL's keys."""
    path = tmp_path / "grpo.yaml"
    path.write_text("learning_rate: 1.0e-5\nnum_generations: 4\nbatch_size: 16\nlogging_steps: 10\n"
                    "push_to_hub: true\nbf16: true\nmax_prompt_length: 256\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.lr, cfg.group_size, cfg.batch_size) == (1e-5, 4, 16)
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and out.startswith(f"periodic-rl: --config {path}: ignored TRL's logging_steps: every "
                                                    "iteration is logged"), out
    assert ("defaults of this trainer that are not TRL's and that it leaves unset: --iterations 60 (TRL: 3 "
            "epochs (num_train_epochs)), --beta 0.04") in out  # 2nd
    assert all(key in out for key in ("; push_to_hub: ", "; bf16: --dtype auto", "; max_prompt_length: "))
    assert given_options(["--config", str(path)]) == {"lr", "group_size", "batch_size", "config"}
    assert capsys.readouterr().out == ""  # said once: by parse_args
    path.write_text("logging_steps: 10\nper_device_train_batch_size: 4\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path)])
    assert "per_device_train_batch_size 4 x 1 process(es) x steps_per_generation 1 = 4 completions per batch, not " \
           "a multiple of num_generations 8" in capsys.readouterr().err


def test_a_yaml_config_file_is_read_like_flags(tmp_path):
    """Claim: a YAML file's options are read as the same flags typed (`1e-4`, a string to YAML, is the float
    --lr 1e-4); resume and overwrite in a file are skipped (only the command line may replace or continue a run)."""
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-4\nreport_to: tensorboard\nsave: false\nmax_new_tokens: 6\noverwrite: true\n"
                    "resume: auto\ntrace: null\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.lr, cfg.report_to, cfg.save, cfg.max_new_tokens) == (1e-4, ["tensorboard"], False, 6)
    assert (cfg.overwrite, cfg.resume, cfg.trace) == (False, None, None)


def test_options_derived_from_one_given_anew_are_derived_again(tmp_path, monkeypatch):
    """Claim: config.json holds derived values (lr, max_new_tokens, reward_weights, devices) as resolved; given the
    option they derive from anew on the command line, they are derived again instead of kept (a tiny run's file
    with --model qwen2.5-0.5b trains at the real model's lr and lengths); under torchrun each rank places its own
    devices, so the file's are not kept. A file that is not a run record (no run_id) holds what its author chose:
    its lr and lengths stay under a typed --model, its reward weights go with its rewards."""
    path = tmp_path / "config.json"
    record = {"model": "tiny", "lr": 1e-4, "max_new_tokens": 8, "reward": ["math"], "reward_weights": [1.0],
              "train_device": "cpu", "rollout_device": "cpu"}
    path.write_text(json.dumps({**record, "run_id": "20261127-0001"}))
    cfg = parse_args(["--config", str(path), "--model", "qwen2.5-0.5b", "--reward", "math", "math-verify"])
    assert (cfg.lr, cfg.max_new_tokens, cfg.reward_weights) == (1e-6, 512, [1.0, 1.0])
    (tmp_path / "recipe.json").write_text(json.dumps({**record, "max_new_tokens": 1024, "lr": 2e-5}))
    cfg = parse_args(["--config", str(tmp_path / "recipe.json"), "--model", "qwen2.5-0.5b", "--reward", "math",
                      "math-verify"])
    assert (cfg.lr, cfg.max_new_tokens, cfg.reward_weights) == (2e-5, 1024, [1.0, 1.0])
    assert (parse_args(["--config", str(path)]).lr, parse_args(["--config", str(path), "--lr", "3e-4"]).lr) == \
        (1e-4, 3e-4)
    from infra.command_line import with_config_file
    assert "--train-device=cpu" in with_config_file(["--config", str(path)])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not any("device" in flag for flag in with_config_file(["--config", str(path)]))


def test_a_list_option_on_the_command_line_replaces_the_files(tmp_path):
    """Claim: --reward and --report-to add up when repeated on the command line, but given there they replace a
    --config file's list instead of extending it (the command line wins, as for any other option)."""
    path = tmp_path / "run.json"
    path.write_text('{"reward": ["math", "math-verify"], "reward_weights": [1, 0.5], "report_to": ["tensorboard"]}')
    cfg = parse_args(["--config", str(path)])
    assert (cfg.reward, cfg.reward_weights, cfg.report_to) == (["math", "math-verify"], [1.0, 0.5], ["tensorboard"])
    cfg = parse_args(["--config", str(path), "--reward", "math-verify", "--reward-weights", "2"])
    assert (cfg.reward, cfg.reward_weights, cfg.report_to) == (["math-verify"], [2.0], ["tensorboard"])
    assert parse_args(["--reward", "math", "--reward", "math-verify"]).reward == ["math", "math-verify"]


@pytest.mark.parametrize("text, fragment", [
    ('{"lr": 0.1, "epochs": 2}', "unknown option epochs (the keys are"),
    ('{"lr": 0.1, "iteration": 2}', "unknown option iteration: did you mean iterations?"),
    ('{"per_device_train_batch_size": 4}', "TRL's per_device_train_batch_size 4 x 1 process(es) x "
                                           "steps_per_generation 1 = 4 completions per batch, not a multiple of "
                                           "num_generations 8 (TRL refuses it too)"),
    ('{"lr": 0.1, "learning_rate": 1}', "lr and learning_rate name the same option"),
    ('{"lr": 0.1,', "is not valid JSON"),
    ('[1, 2]', "must hold a mapping"),
    ('{"iterations": null}', "iterations: null is not a value of --iterations"),
    ('{"save": "yes please"}', "save must be true or false"),
    ('{"iterations": "two"}', "argument --iterations: invalid int value: 'two'"),
])
def test_a_bad_config_file_fails_with_one_line_and_exit_2(text, fragment, tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and fragment in err and err.count("\n") == 1, err


def test_config_file_with_resume_is_checked_like_typed_flags(tmp_path):
    """Claim: with --resume, a --config file's options count as given: the run's own config.json resumes with the
    checkpoint's options, while a file whose seed differs is refused naming --seed (as a typed --seed would be)."""
    saved = parse_args(["--out", str(tmp_path), "--iterations", "4"])
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text(json.dumps(
        {"iterations_done": 2, "config": dataclasses.asdict(saved), "reference_fingerprint": "θ_0"}))
    same, other = tmp_path / "config.json", tmp_path / "other.json"
    same.write_text(json.dumps({**dataclasses.asdict(saved), "run_id": "r", "versions": {}, "command": []}))
    other.write_text(json.dumps({**dataclasses.asdict(saved), "seed": 5}))
    for path in (same, other):
        argv = ["--config", str(path), "--resume", "auto", "--out", str(tmp_path)]
        if path == same:
            cfg, found = resumption(parse_args(argv), given_options(argv))
            assert found == checkpoint and cfg == dataclasses.replace(saved, config=str(same), resume="auto")
        else:
            with pytest.raises(CheckpointError, match="--seed 5 differs from the checkpoint's 0"):
                resumption(parse_args(argv), given_options(argv))


def test_records_alone_are_no_previous_run_and_overwrite_deletes_them(tmp_path):
    """Claim: config.json and the trackers' folders left by a run that failed before its first row do not make
    --out a previous run (as an empty metrics.jsonl does not); --overwrite deletes them with the run's files."""
    (tmp_path / "config.json").write_text('{"run_id": "run-1", "versions": {}}')
    (tmp_path / "runs").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    with outputs.claimed(Config(out=str(tmp_path))):
        pass
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    with outputs.claimed(Config(out=str(tmp_path), overwrite=True)):
        assert not any((tmp_path / name).exists() for name in ("config.json", "runs", "metrics.jsonl"))


# --- plot.py ---
def test_plot_draws_the_panels_of_a_run(run_dir, tmp_path):
    """Claim: `python plot.py RUN_DIR -o FILE` writes a PNG of the run; its figure has the reward with the held-out
    points on top, the busy/idle seconds of both processes at the bottom, and between them the KL, response length,
    loss, gradient norm and clipped tokens of each iteration, drawn from metrics.jsonl."""
    output = tmp_path / "run.png"
    assert plot.main([str(run_dir), "-o", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = outputs.read_metrics(run_dir / "metrics.jsonl")
    fig = plot.figure(rows)
    panels = {axes.get_title(loc="left"): axes for axes in fig.axes}
    reward, seconds = fig.axes[0], fig.axes[-1]
    assert (reward.get_title(loc="left"), seconds.get_title(loc="left")) == (plot.REWARD, plot.SECONDS)
    train, held_out = reward.get_lines()
    assert list(train.get_xdata()) == [0, 1, 2] and list(held_out.get_xdata()) == [0, 2, 3]  # eval every 2, final
    assert list(held_out.get_ydata()) == [row["eval_reward"] for row in rows if row["eval_reward"] is not None]
    for title, key in [("KL to the reference", "kl"), ("response length (tokens)", "completions/mean_length"),
                       ("loss", "loss"), ("grad norm (before clipping)", "grad_norm"),
                       ("clipped tokens (fraction)", "clip_ratio/region_mean")]:
        line = next(line for line in panels[title].get_lines() if line.get_label() == key)
        assert list(line.get_ydata()) == [row[key] for row in rows[:3]], title
    assert len(seconds.patches) == 4 * 3  # busy and idle of each process, per iteration


def test_metrics_jsonl_holds_trls_keys_as_the_trackers_name_them(run_dir):
    """Claim: metrics.jsonl's rows are under TRL's keys (reward, clip_ratio/region_mean, completions/mean_length, ...),
    each the trackers' name less its train/, eval/ or time/ prefix (eval_reward: eval/reward), as TRL's log_history
    holds them; none of the learner's own names (reward_mean, response_length, ...) is left."""
    rows = outputs.read_metrics(run_dir / "metrics.jsonl")
    step = rows[0]
    assert {"reward", "reward_std", "kl", "loss", "grad_norm", "learning_rate", "entropy", "clip_ratio/region_mean",
            "clip_ratio/low_mean", "clip_ratio/high_mean", "completions/mean_length", "completions/clipped_ratio",
            "completions/mean_terminated_length", "num_tokens", "epoch", "eval_reward"} <= set(step)
    assert not set(TRL_KEYS) & {key for row in rows for key in row}
    # the held-out evaluation (every 2 iterations here) is timed apart from the sampling of the training batch
    assert rows[0]["eval_s"] > 0 and rows[1]["eval_s"] == 0 and rows[0]["eval_reward"] is not None
    for key in tracker_names(step):
        assert key.partition("/")[2] in step or key == "eval/reward", key


def test_plot_draws_each_reward_and_the_trl_metrics_the_rows_hold(tmp_path):
    """Claim: with several rewards each is drawn alone (its mean ± std); the loss, gradient norm, learning rate,
    entropy and TRL's clip ratios get a panel where the rows hold them, and none where they do not (an older run's
    rows, a run with one reward), without an error."""
    rows = [{"iteration": k, "reward_mean": 0.5, "reward_std": 0.1, "eval_reward": None, "response_length": 3.0,
             "rewards/math/mean": 0.1 * k, "rewards/math/std": 0.2, "rewards/format/mean": 1.0, "rewards/format/std": 0,
             "loss": -0.1, "grad_norm": 2.0 + k, "learning_rate": 1e-6 * (3 - k), "entropy": 1.5,
             "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01, "kl": None} for k in range(3)]
    panels = {axes.get_title(loc="left"): axes for axes in plot.figure(rows).axes}
    assert list(panels) == [plot.REWARD, "reward math (unweighted)", "reward format (unweighted)",
                            "KL to the reference", "response length (tokens)", "loss", "grad norm (before clipping)",
                            "learning rate", "entropy (mean per token)", "clipped tokens (fraction)", plot.SECONDS]
    assert list(panels["reward math (unweighted)"].get_lines()[0].get_ydata()) == [0.0, 0.1, 0.2]
    assert list(panels["learning rate"].get_lines()[0].get_ydata()) == [3e-6, 2e-6, 1e-6]
    assert [line.get_label() for line in panels["clipped tokens (fraction)"].get_lines()] == \
        ["clip_ratio/low_mean", "clip_ratio/high_mean"]
    older = plot.figure(rows).axes[0].get_lines()[0]  # an older run's reward_mean, response_length: still drawn
    assert list(older.get_ydata()) == [0.5] * 3 and list(plot.figure(rows).axes[4].get_lines()[0].get_ydata()) == \
        [3.0] * 3
    bare = [{"iteration": k, "reward_mean": 0.5, "rewards/math/mean": 0.5} for k in range(2)]
    assert [axes.get_title(loc="left") for axes in plot.figure(bare).axes] == \
        [plot.REWARD, "KL to the reference", "response length (tokens)", plot.SECONDS]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert plot.main([str(tmp_path)]) == 0 and (tmp_path / "metrics.png").is_file()


def test_plot_without_metrics_says_so_in_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl has no rows: nothing to draw" in err and err.count("\n") == 1
    assert plot.main([str(tmp_path / "none")]) == 1 and "does not exist" in capsys.readouterr().err


ROW = '{"iteration": 0, "reward_mean": 0.5, "reward_std": 0.1, "eval_reward": null, "kl": 0.01, "response_length": 3}\n'


@pytest.mark.parametrize("text, said", [
    (ROW + "[1, 2]\n", r"line 2, is an array, not a row of metrics"),
    (ROW + '{"reward_mean": 1.0}\n', r'line 2, has no iteration number \("iteration": null\)'),
    (ROW + '{"iteration": 1, "kl": "0.1"}\n', r"""line 2, has a string "0.1" under 'kl', not a number"""),
    (ROW.encode() + b'{"iteration": 1, "note": "\xff"}\n', r"line 2, is not UTF-8 text \(byte 0xff at column 27\)"),
    (ROW + "{not json\n" + ROW, r"line 2, is not JSON"),
    (ROW + '{"iteration": 1, "learning_rate": [1]}\n', r"line 2, has an array \[1\] under 'learning_rate'"),
    (ROW + '{"iteration": 1, "rewards/f/mean": true}\n', r"line 2, has true or false true under 'rewards/f/mean'"),
], ids=["not-an-object", "no-iteration", "not-a-number", "not-utf8", "not-json", "lr-not-a-number",
        "reward-not-a-number"])
def test_plot_of_a_file_that_is_not_metrics_is_one_line(tmp_path, text, said):
    """Claim: plot.py on a metrics.jsonl that trainer.py did not write (a line that is JSON but not an
    object, a row without iteration, text where a number is drawn, a byte that is not UTF-8, a line that is not
    JSON) is one `error:` line naming the file and line, exit 1, no traceback; a last line torn by a kill is
    skipped."""
    (tmp_path / "metrics.jsonl").write_bytes(text if isinstance(text, bytes) else text.encode())
    result = subprocess.run([sys.executable, "plot.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(rf"^error: {re.escape(str(tmp_path))}/metrics.jsonl, {said}", lines[0]), lines
    (tmp_path / "metrics.jsonl").write_text(ROW + '{"iteration": 1, "rew')
    assert plot.main([str(tmp_path)]) == 0 and (tmp_path / "metrics.png").is_file()


def test_plot_draws_a_diverged_run(tmp_path):
    """Claim: the rows of a run that diverged (1e308, -1e308, inf and NaN where numbers are drawn, a std of 1e308)
    are drawn: those values are gaps in their curves (no axis can hold them), the other points are drawn."""
    rows = [{"iteration": 0, "reward": 0.5, "reward_std": 1e308, "loss": 1e308, "grad_norm": 1.0},
            {"iteration": 1, "reward": -1e308, "reward_std": 0.1, "loss": float("inf"), "grad_norm": float("nan")},
            {"iteration": 2, "reward": 0.7, "reward_std": 0.1, "loss": 2.0, "grad_norm": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert plot.main([str(tmp_path)]) == 0 and (tmp_path / "metrics.png").stat().st_size > 0
    _, values = plot.series(rows, "loss")
    assert math.isnan(values[0]) and math.isnan(values[1]) and values[2] == 2.0


def test_plot_writes_the_file_it_names_or_refuses_the_format(tmp_path, capsys):
    """Claim: `-o /tmp/out` says the file it wrote, out.png; `-o x.foo`, a
    format matplotlib cannot write, is one line listing those it can, before anything is drawn."""
    (tmp_path / "metrics.jsonl").write_text(ROW)
    assert plot.main([str(tmp_path), "-o", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'out.png'}\n" and (tmp_path / "out.png").is_file()
    assert plot.main([str(tmp_path), "-o", str(tmp_path / "x.foo")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: -o {tmp_path / 'x.foo'}: matplotlib cannot write .foo files; name a file ending in ")
    assert ".png" in err and err.count("\n") == 1 and not (tmp_path / "x.foo").exists()


def test_a_stop_without_save_options_says_what_was_not_kept(tmp_path):
    """Claim: without --save-every or --save-on-stop, a stop's line ends with how many iterations were done and not
    saved, and the option that keeps them; once training had ended (policy/ written by this process, the stop
    coming during the final evaluation), that the policy is there; before any iteration, nothing more. A policy/ an
    earlier run left in --out is not taken for this one's."""
    import os
    cfg = Config(out=str(tmp_path), iterations=5)
    assert exits.kept_on_stop(cfg, None, None) == ""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"iteration": k}) + "\n" for k in range(3)))
    not_saved = ("; the 3 iterations done were not saved (--save-on-stop keeps them when a run is stopped, "
                 "--save-every N as it goes)")
    assert exits.kept_on_stop(cfg, None, None) == not_saved
    (tmp_path / "policy").mkdir()
    os.utime(tmp_path / "policy", (run_output.PROCESS_STARTED - 60,) * 2)  # an earlier run's
    assert exits.kept_on_stop(cfg, None, None) == not_saved
    os.utime(tmp_path / "policy")  # written now
    assert exits.kept_on_stop(cfg, None, None) == f"; training had ended: the policy is in {tmp_path / 'policy'}"
