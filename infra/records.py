"""A run's record: every run writes <out>/config.json with the options it ran with; `--config FILE` reads one
back (infra/command_line.py).

    <out>/config.json   {every Config field as resolved, "run_id": ..., "versions": {...}, "command": [...]}

    "versions": {"python": "3.11.9", "torch": "2.13.0", "transformers": ..., "datasets": ... (null when not
                 installed), "periodic_rl": {"commit": "<sha>", "dirty": false} (null when not a git checkout)}

It is written atomically twice: at start-up, before a model loads (a run that fails still says what it was),
and again once the sizes are known (on CPU `sizing.choose` probes them before iteration 0), so it holds the
sizes the run used: `python trainer.py --config <out>/config.json --out other` reruns it with the same
options, the sizes included (which prompts share a generate call, hence the rollouts). A resumed run
rewrites it with the options it goes on with and keeps its `run_id` (the name under which wandb and
trackio continue the run; infra/tracking.py).

Its paths are absolute (`absolute_paths`: --data when it is a local path, a local --model directory, --cache-dir,
--out, --trace, --config, a --resume checkpoint, a reward's 'path/to/file.py:function'), so that `--config
RUN/config.json` reruns the run from any folder; the command line is kept as it was typed.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import secrets
import subprocess
from pathlib import Path

from config import Config, is_model_name
from infra import outputs
from infra.options import with_new_names

RECORD = "config.json"


# --- <out>/config.json ---
def git_commit(directory: Path) -> dict | None:
    """{"commit": HEAD's sha, "dirty": whether tracked files differ from it} when `directory` is the top of a git
    checkout (not a folder inside another project's repository), else None; also None without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    try:
        top, commit = git("rev-parse", "--show-toplevel", "HEAD").split()
        if Path(top).resolve() != directory.resolve():
            return None
        return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}
    except (OSError, ValueError, subprocess.SubprocessError):  # no git, not a checkout, no commit yet
        return None


def versions() -> dict:
    """What the run ran on: Python, torch, transformers, datasets (None when not installed), this code's commit."""
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "datasets"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    found["periodic_rl"] = git_commit(Path(__file__).resolve().parent.parent)  # the checkout (this file is in infra/)
    return found


def absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def absolute_paths(cfg: Config) -> Config:
    """`cfg` with every local path made absolute (relative ones are read from the folder the run started in).

    Example: data 'train.jsonl', reward ['math', 'rewards.py:length'], out 'runs/a' (started in /home/u/exp)
             -> data '/home/u/exp/train.jsonl', reward ['math', '/home/u/exp/rewards.py:length'],
                out '/home/u/exp/runs/a'
    """
    from infra.data import looks_like_path

    def reward(spec: str) -> str:
        module, sep, function = spec.rpartition(":")
        return absolute(module) + sep + function if module.endswith(".py") else spec
    # an alias names a hub model even where a folder has its name
    local_model = not is_model_name(cfg.model) and os.path.isdir(os.path.expanduser(cfg.model))
    local_data = cfg.data is not None and looks_like_path(cfg.data) and os.path.exists(os.path.expanduser(cfg.data))
    optional = {name: absolute(getattr(cfg, name)) for name in ("cache_dir", "out", "trace", "config")
                if getattr(cfg, name)}
    return dataclasses.replace(
        cfg, **optional, model=absolute(cfg.model) if local_model else cfg.model,
        data=absolute(cfg.data) if local_data else cfg.data, reward=[reward(spec) for spec in cfg.reward],
        resume=absolute(cfg.resume) if cfg.resume not in (None, "auto") else cfg.resume)


def through_moved_link(typed: str | None, recorded: str) -> bool:
    """Whether --model as typed (`typed`) goes through a link (runs/latest) and the model a run recorded, where the
    link led then, still exists: the same command, though the link may lead elsewhere now."""
    if typed is None:
        return False
    path = os.path.expanduser(typed)
    return os.path.realpath(path) != os.path.abspath(path) and os.path.isabs(recorded) and os.path.exists(recorded)


def finished(cfg: Config, given: set[str], typed_model: str | None = None) -> str | None:
    """With --resume auto, a line saying the run in --out is complete (its policy/ saved, metrics.jsonl's final row
    written) when every option given is at the run's value (config.json); else None, and the resume goes on as
    before: more --iterations continue the run, another value is refused. The same command resubmitted after the
    run's end then exits 0 and rewrites nothing (it was refused without checkpoints, and with them re-ran the final
    evaluation and rewrote the final row). `typed_model`: --model as typed, the same through a link that has moved
    since (`through_moved_link`)."""
    out = Path(cfg.out) if cfg.resume == "auto" and cfg.out and not cfg.overwrite else None  # (both: refused)
    if out is None or not outputs.has_policy(out):
        return None
    rows = outputs.read_metrics(out / "metrics.jsonl") if outputs.is_metrics(out / "metrics.jsonl") else []
    final = next((row for row in reversed(rows) if isinstance(row, dict) and row.get("final")), None)
    record = with_new_names(json.loads((out / "config.json").read_text())) if outputs.is_record(
        out / "config.json") else None
    if final is None or record is None:
        return None
    recorded = absolute_paths(cfg)  # as config.json writes them: paths absolute, ~ expanded, rewards' files too

    def as_run_had(name: str) -> bool:  # (a path through a link is the path it leads to)
        value, saved = getattr(recorded, name), record.get(name)
        return value == saved or isinstance(value, str) and isinstance(saved, str) and os.path.exists(value) \
            and Path(value).resolve() == Path(saved).resolve()
    if not all(as_run_had(name) or name == "model" and through_moved_link(typed_model, record.get("model", ""))
               for name in given if name not in ("out", "resume", "config", "overwrite")):
        return None
    more = "; more --iterations go on from its newest checkpoint" if outputs.checkpoints(out) else ""
    done = final["iteration"]
    return (f"--resume auto: the run in {out} is complete ({done} iteration{'s' * (done != 1)}, its policy in "
            f"{out / 'policy'}): nothing to do{more}")


class RunRecord:
    """<out>/config.json of one run: `write(cfg)` (again) whenever the run's options are final or change."""

    def __init__(self, out: Path, command: list[str], resumed: bool):
        self.path, self.command, self.versions = Path(out) / RECORD, command, versions()
        previous = self.read_run_id() if resumed else None
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(out).resolve().name).strip("-.") or "run"
        self.run_id = previous or f"{slug}-{secrets.token_hex(4)}"

    def read_run_id(self) -> str | None:
        try:
            return str(json.loads(self.path.read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or from before run ids
            return None

    def write(self, cfg: Config) -> dict:
        record = {**dataclasses.asdict(absolute_paths(cfg)), "run_id": self.run_id, "versions": self.versions,
                  "command": self.command}
        with outputs.writing("the run's options to", self.path):
            outputs.write_atomically(self.path, json.dumps(record, indent=1) + "\n")
        return record
