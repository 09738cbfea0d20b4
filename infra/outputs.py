"""The run's output directory: checked before anything is loaded, locked for the run, written atomically.

    <out>/
        .lock           held (fcntl.flock) while a run writes here; holds that run's PID
        metrics.jsonl   one JSON row per iteration, appended as they come
        policy/         θ_final as a Hugging Face model directory, saved once the last step is done
        config.json     every option as resolved, the versions, the command (infra/records.py)
        runs/, wandb/   --report-to tensorboard's event files, wandb's local files (infra/tracking.py)

Rules (each a one-line `OutputError` when broken; trainer.py prints it and exits 1):
1. Every path the run writes (`--out`, the `--trace` file's folder) is created and checked at start-up,
   before a model is loaded: a file where a directory should be, or no write permission, fails in a
   second instead of after training. (The tiny-model cache is checked by `models.ensure_tiny_model`
   only when it must build there: a read-only cache that already holds the model is fine.)
2. One run per directory: a second run on a busy `--out` is refused and told the other run's PID. The
   kernel drops the lock when its process ends, however it ends, so a killed run never blocks the next.
3. A directory that holds a previous run (metrics.jsonl with rows, policy/, checkpoints) is refused unless
   `--resume` continues it or `--overwrite` deletes those first (and its records: config.json, the
   trackers' files): a new run's files are never mixed with an old run's, and an old run is never lost
   unless the user asked. The records alone, like an empty metrics.jsonl, are no run: they are left by
   a run that failed before its first iteration ended, and a new run replaces them.
4. `save_atomically` writes a directory beside its target, syncs it to disk and renames it into place
   (`write_atomically`, the same for one file): a kill or a full disk at any moment leaves the previous
   directory or the new one, never a torn one.

Departure, on purpose: replacing an existing directory takes two renames (the old one aside, the new one
in), as POSIX renames no directory over a non-empty one; a kill between the two (microseconds) leaves the
previous copy, complete, as `.policy.old-*` beside the missing target.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

from config import Config
from infra.errors import UserError

LOCK_FILE = ".lock"
RUN_FILES = ("metrics.jsonl", "policy")  # what a run leaves in --out besides checkpoint-* (--overwrite deletes them)
RECORDS = ("config.json", "runs", "wandb")  # what it says about itself: no run alone, deleted with it by --overwrite


class OutputError(UserError):
    """An output path that cannot be written: the message names the path, the reason and the fix."""


@contextmanager
def writing(what: str, path: Path | str) -> Iterator[None]:
    """Turn an OSError while writing `what` (full disk, read-only file system, ...) into one line naming it."""
    try:
        yield
    except OSError as error:
        raise OutputError(f"could not write {what} {path}: {error.strerror or error}") from None


def make_directory(path: Path, what: str) -> Path:
    """Create `path` (and its parents) if needed; fail in one line unless it is a directory this user can write."""
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file, not a directory: name a directory (or remove the file)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{what} {path} cannot be created ({error.strerror}): name a directory you can "
                          "write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path} is not writable (permission denied): name a directory you can write")
    return path


def check_paths(cfg: Config) -> None:
    """Rule 1: `--out` and the `--trace` file's folder exist (created here) and are writable directories."""
    make_directory(Path(cfg.out), "--out")
    if cfg.trace:
        trace = Path(cfg.trace)
        make_directory(trace.parent, "the folder of --trace")
        if trace.is_dir() or trace.exists() and not os.access(trace, os.W_OK):
            raise OutputError(f"--trace {trace} is {'a directory' if trace.is_dir() else 'not writable'}: "
                              "name a file you can write")


def previous_run(out: Path) -> list[str]:
    """The files of an earlier run in `out`, its checkpoints included (an empty metrics.jsonl, from a run that
    failed early, is none)."""
    paths = [out / name for name in RUN_FILES] + sorted(out.glob("checkpoint-*"))
    return [path.name for path in paths if path.is_dir() or path.is_file() and path.stat().st_size > 0]


@contextmanager
def claimed(cfg: Config) -> Iterator[Path]:
    """`--out`, checked, locked for the run (rule 2) and free of any previous run's files (rule 3)."""
    check_paths(cfg)
    out = Path(cfg.out)
    with writing("the lock file", out / LOCK_FILE):
        lock = open(out / LOCK_FILE, "a+")
    with lock:  # the kernel releases the lock when the file is closed, or its process ends
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise OutputError(f"--out {out} is in use by another run (PID {holder}): wait for it to end, "
                              "or choose another --out") from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        found = previous_run(out)
        if found and not (cfg.overwrite or cfg.resume):
            raise OutputError(f"--out {out} holds a previous run ({', '.join(found[:3])}{', ...' if found[3:] else ''}"
                              "): pass --resume auto to continue it, --overwrite to replace it, or choose another "
                              "--out")
        for name in [*found, *RECORDS] if cfg.overwrite else []:
            remove(out / name)
        for stale in out.glob(".*.saving-*"):  # a save killed half-way (rule 4); the lock says it is not running
            with suppress(OSError):
                remove(stale)
        yield out


def remove(path: Path) -> None:
    """Delete a file or a directory tree, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl (none if it is missing; a row torn by a kill is dropped)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def fsync(path: Path | str) -> None:
    """Flush a file, or a directory's list of names, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Rule 4: `write(folder)` fills a temporary sibling of `target`, which is synced and renamed to `target`.

    Example: save_atomically(out / "policy", lambda d: (model.save_pretrained(d), tokenizer.save_pretrained(d)))
    Whatever stops it (an exception, a signal, SIGKILL, a full disk), `target` is either the previous
    directory or the new one, complete; on an exception the temporary folder is removed.
    """
    target = Path(target)
    staging, aside = (target.with_name(f".{target.name}.{state}-{os.getpid()}") for state in ("saving", "old"))
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed process that had this PID
    try:
        staging.mkdir()  # (not mkdtemp: the folder gets the usual permissions, as save_pretrained's files do)
        write(staging)
        for folder, _, files in os.walk(staging, topdown=False):  # contents first, then the names
            for name in [*files, "."]:
                fsync(os.path.join(folder, name))
        if target.exists():
            target.rename(aside)
        staging.rename(target)
        fsync(target.parent)  # the renames themselves
    except BaseException:
        if aside.exists() and not target.exists():  # stopped between the two renames: the previous one back
            aside.rename(target)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def write_atomically(path: Path, text: str) -> None:
    """Rule 4 for one file: `text` goes to a sibling, synced and renamed over `path` (the old file or the new)."""
    staging = path.with_name(f".{path.name}.saving-{os.getpid()}")
    try:
        staging.write_text(text)
        fsync(staging)
        os.replace(staging, path)
        fsync(path.parent)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
