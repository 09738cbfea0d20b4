"""A run's options as a file: every run writes <out>/config.json, and `--config FILE` reads one back.

    <out>/config.json   {every Config field as resolved, "run_id": ..., "versions": {...}, "command": [...]}

    "versions": {"python": "3.11.9", "torch": "2.13.0", "transformers": ..., "datasets": ... (null when not
                 installed), "periodic_rl": {"commit": "<sha>", "dirty": false} (null when not a git checkout)}

It is written atomically twice: at start-up, before a model loads (a run that fails still says what it was),
and again once the sizes are known (on CPU `sizing.choose` probes them before iteration 0), so it holds the
sizes the run used: `python trainer.py --config <out>/config.json --out other` reruns it with the same
options, the sizes included (which prompts share a generate call, hence the rollouts). A resumed run
rewrites it with the options it goes on with and keeps its `run_id` (the name under which wandb and
trackio continue the run; tracking.py).

`--config FILE`: a JSON file (`.json`) or YAML (anything else; PyYAML, which transformers requires) holding
a mapping from option names (Config's field names: `max_new_tokens` for --max-new-tokens) to values; the
shape of config.json is accepted (its run_id, versions and command are skipped). The file's options become
command-line flags placed before the command line's own (`with_config_file`), so argparse checks them as it
checks typed ones and the command line wins (argparse keeps an option's last value; a list option given
on the command line, such as --reward, replaces the file's instead of adding to it, and an option the file
holds as derived from one given anew is derived again: `DERIVED_FROM`; under torchrun each rank places its
own devices); they count as given:
with --resume a result-changing one that differs from the checkpoint's is refused, like a typed flag.

Departure, on purpose: `resume`, `overwrite` and `config` in a file are skipped; they act on what --out
already holds, so they are read from the command line only (a rerun of a config.json that was written with
--overwrite must not delete a run by itself).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import secrets
import subprocess
import sys
from pathlib import Path

import outputs
from config import Config

RECORD = "config.json"
NOT_OPTIONS = ("run_id", "versions", "command")  # config.json's keys that are not options
COMMAND_LINE_ONLY = ("resume", "overwrite", "config")
# Options config.json records as `derive` resolved them from another option: given anew on the command line, that
# option re-derives them (a tiny run's config.json with --model qwen2.5-0.5b must not keep the tiny lr and lengths).
SIZES = ("groups_per_chunk", "micro_batch_tokens", "rollout_threads", "train_threads", "tail_threads")
DERIVED_FROM = {"model": ("lr", "max_new_tokens", *SIZES), "reward": ("reward_weights",),
                "device": ("train_device", "rollout_device", "dtype", *SIZES), "mode": ("rollout_device", *SIZES),
                "batch_size": SIZES, "group_size": SIZES, "inference_workers": ("rollout_device", *SIZES)}


# --- --config FILE ---
def config_file(argv: list[str]) -> str | None:
    """The --config path on the command line (its last one, as argparse takes it), or None."""
    finder = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    finder.add_argument("--config")
    try:
        return finder.parse_known_args(argv)[0].config
    except argparse.ArgumentError:  # `--config` without a path: trainer.py's own parser says so
        return None


def file_arguments(path: str, skip: set[str] = frozenset()) -> list[str]:
    """The options in the JSON or YAML file `path` as command-line flags, but those in `skip`; ValueError with the
    reason if it cannot be read, is not a mapping, or names an unknown option.

    Example: {"max_new_tokens": 8, "lr": 1e-4, "save": false, "report_to": ["tensorboard"], "trace": null}
             -> ["--max-new-tokens=8", "--lr=0.0001", "--no-save", "--report-to", "tensorboard"]
    """
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"cannot be read ({error.strerror or error})") from None
    try:
        if path.endswith(".json"):
            values = json.loads(text)
        else:
            import yaml
            values = yaml.safe_load(text)
    except Exception as error:  # json.JSONDecodeError, yaml.YAMLError: the parser's message names the line
        raise ValueError(f"is not valid {'JSON' if path.endswith('.json') else 'YAML'} ({error})".replace("\n", " "))
    if not isinstance(values, dict):
        raise ValueError("must hold a mapping from option names to values, e.g. {\"iterations\": 20}")
    fields = {f.name: f for f in dataclasses.fields(Config)}
    unknown = sorted(str(name) for name in values if name not in fields and name not in NOT_OPTIONS)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}: the keys are trainer.py's options with _ for -, "
                         "e.g. max_new_tokens (see --help)")
    flags = []
    for name, value in values.items():
        if name in NOT_OPTIONS or name in COMMAND_LINE_ONLY or name in skip:
            continue
        flag, kind = "--" + name.replace("_", "-"), fields[name].type
        if value is None:  # an option left open: its default, which is None for every option that may be None
            if fields[name].default is not None:
                raise ValueError(f"{name}: null is not a value of {flag}")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false (got {value!r})")
            flags.append(flag if value else "--no-" + flag[2:])
        elif kind.startswith("list["):
            flags += [flag, *map(str, value if isinstance(value, list) else [value])]
        elif isinstance(value, (list, dict)):
            raise ValueError(f"{name} takes one value (got {value!r})")
        else:
            flags.append(f"{flag}={value}")  # `=`: a value that starts with '-' stays a value
    return flags


def with_config_file(argv: list[str] | None = None, prog: str = "trainer.py") -> list[str]:
    """argv (default: sys.argv[1:]) with its --config file's options put before it; on a bad file one line on
    stderr and exit code 2, as for a bad flag."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = config_file(argv)
    if path is None:
        return argv
    from config import build_parser
    given = set(vars(build_parser(prog, defaults=False).parse_args(argv)))  # a list option given on the command line
    skip = given | {derived for option in given for derived in DERIVED_FROM.get(option, ())}  # replaces the file's
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun each rank places its own devices (distributed.py)
        skip |= {"train_device", "rollout_device"}
    try:
        return file_arguments(path, skip=skip) + argv
    except ValueError as error:
        sys.stderr.write(f"{prog}: error: --config {path} {error}\n")
        raise SystemExit(2) from None


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
    found["periodic_rl"] = git_commit(Path(__file__).resolve().parent)
    return found


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
        record = {**dataclasses.asdict(cfg), "run_id": self.run_id, "versions": self.versions, "command": self.command}
        with outputs.writing("the run's options to", self.path):
            outputs.write_atomically(self.path, json.dumps(record, indent=1) + "\n")
        return record
