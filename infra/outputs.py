"""The run's output directory: checked before anything is loaded, locked for the run, written atomically.

    <out>/
        .lock           held (fcntl.flock) while a run writes here; holds that run's PID
        metrics.jsonl   one JSON row per iteration, appended as they come
        completions.jsonl  with --log-completions: one JSON object per sampled completion (infra/completions.py)
        policy/         θ_final as a Hugging Face model directory, saved once the last step is done
        config.json     every option as resolved, the versions, the command (infra/records.py)
        runs/, wandb/   --report-to tensorboard's event files, wandb's local files (infra/tracking.py)

Rules (each a one-line `OutputError` when broken; trainer.py prints it and exits 1):
1. Every path the run writes (`--out`, the `--trace` file's folder) is created and checked at start-up,
   before a model is loaded: a file where a directory should be, or no write permission, fails in a
   second instead of after training. (The tiny-model cache is checked by `tiny.ensure_tiny_model`
   only when it must build there: a read-only cache that already holds the model is fine.)
2. One run per directory: a second run on a busy `--out` is refused and told the other run's PID. The
   kernel drops the lock when its process ends, however it ends, so a killed run never blocks the next.
3. A directory that holds a previous run (metrics.jsonl with rows, policy/, checkpoints) is refused unless
   `--resume` continues that run or `--overwrite` deletes it first: a new run's files are never mixed with
   an old run's, and an old run is never lost unless the user asked. `--overwrite` deletes only what this
   trainer wrote there (`run_files`): metrics.jsonl, completions.jsonl, policy/, checkpoint-<k>/, config.json,
   TensorBoard's event files in runs/ and wandb's folders of that run's id; never another run's folder below
   --out (`--out .` beside runs/latest deletes nothing of runs/latest). A path with one of those names that this
   trainer did not write (another tool's config.json or checkpoint-500/, a policy/ package) is refused, with or
   without --overwrite: the run would replace it. The records alone (config.json, an empty metrics.jsonl) are no run:
   they are left by a run that failed before its first iteration ended, and a new run replaces them.
   `--resume CHECKPOINT --out B` continues that checkpoint's run in B only if B holds no other run.
4. `save_atomically` writes a directory beside its target, syncs it to disk and renames it into place
   (`write_atomically`, the same for one file): a kill or a full disk at any moment leaves the previous
   directory or the new one, never a torn one.
5. Without --out each run gets a folder of its own, runs/<model>-<YYYYmmdd-HHMMSS> (`run_folder`: -2, -3, ...
   when two start in the same second), and runs/latest becomes a link to it once the run starts (`link_latest`; a
   start refused for its data, rewards or model removes the folder and leaves runs/latest as it was), so `python
   plot.py runs/latest` and `--config runs/latest/config.json` find the newest run, and any command can be run
   again. An
   explicit --out keeps rules 2 and 3. `--resume auto` needs --out (runs/latest may be another run by the time a
   preempted job is resubmitted); where --out holds no run to continue it starts one (`resume_or_start`), and
   where it holds a run that stopped before its first checkpoint it starts that run again from iteration 0,
   replacing its outputs (`claimed`, with a line; not a finished run, nor one that asked for no checkpoints), so
   that the same command serves every submission of a preemptible job.

Departure, on purpose: replacing an existing directory takes two renames (the old one aside, the new one
in), as POSIX renames no directory over a non-empty one; a kill between the two (microseconds) leaves the
previous copy, complete, as `.policy.old-*` beside the missing target.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

from config import Config, is_model_name
from infra.errors import UserError
from infra.tracking import TENSORBOARD_DIR

LOCK_FILE = ".lock"
RUNS, LATEST = Path("runs"), "latest"  # --out not given: runs/<model>-<time>, and runs/latest links to the newest
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # <out>/checkpoint-<k> (infra/checkpoint.py)
WANDB_DIR = "wandb"  # wandb.init(dir=<out>) writes <out>/wandb/run-<time>-<run id>/ (infra/tracking.py)


class OutputError(UserError):
    """An output path that cannot be written: the message names the path, the reason and the fix."""


@contextmanager
def writing(what: str, path: Path | str) -> Iterator[None]:
    """Turn an OSError while writing `what` (full disk, read-only file system, ...) into one line naming it; so too
    a writer's own exception that stands for one (`os_error`)."""
    try:
        yield
    except Exception as error:
        cause = os_error(error)
        if cause is None:
            raise
        raise OutputError(f"could not write {what} {path}: {cause.strerror or cause}") from None


def is_writer_error(error: BaseException) -> bool:
    """An exception of a tensor writer rather than an OSError: safetensors' SafetensorError (a Rust error), torch.save's
    RuntimeError from its zip stream writer ("[enforce fail at inline_container.cc:...]")."""
    return type(error).__name__ == "SafetensorError" or isinstance(error, RuntimeError) and any(
        mark in str(error) for mark in ("inline_container", "PytorchStreamWriter"))


def os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, or the one a writer's exception names ("... (os error 28)", safetensors).
    torch.save's names none: save_atomically raises ENOSPC for it where it finds the disk full."""
    if isinstance(error, OSError):
        return error
    named = re.search(r"\(os error (\d+)\)", str(error)) if is_writer_error(error) else None
    return OSError(int(named.group(1)), os.strerror(int(named.group(1)))) if named else None


FULL_BYTES = 2**20  # a file system with less room than this left after a failed write was full


def is_full(folder: Path) -> bool:
    """Whether the file system holding `folder` has (almost) no room left for this user (root may use the blocks
    reserved for it)."""
    try:
        usage = os.statvfs(folder)
    except OSError:
        return False
    return (usage.f_bfree if os.geteuid() == 0 else usage.f_bavail) * usage.f_frsize < FULL_BYTES


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where built models, copied datasets and train's args files are kept: --cache-dir, else $PERIODIC_RL_CACHE,
    else ~/.cache/periodic-rl."""
    return Path(cache_dir or os.environ.get("PERIODIC_RL_CACHE") or "~/.cache/periodic-rl").expanduser()


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


def is_metrics(path: Path) -> bool:
    """A metrics.jsonl of this trainer: its first row has an "iteration" (an empty one holds nothing to lose)."""
    try:
        with path.open(errors="replace") as f:
            first = f.readline()
        return not first.strip() or isinstance(row := json.loads(first), dict) and "iteration" in row
    except (OSError, ValueError):
        return False


def is_completions(path: Path) -> bool:
    """A completions.jsonl of this trainer (infra/completions.py): its first line has an "iteration" and a "completion"
    (an empty one holds nothing to lose)."""
    try:
        with path.open(errors="replace") as f:
            first = f.readline()
        row = json.loads(first) if first.strip() else {"iteration": None, "completion": None}
        return isinstance(row, dict) and {"iteration", "completion"} <= row.keys()
    except (OSError, ValueError):
        return False


def is_record(path: Path) -> bool:
    """A config.json of this trainer (infra/records.py): a JSON object with its run_id and versions."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"run_id", "versions"} <= record.keys()


def is_model_directory(path: Path) -> bool:
    """A policy/ of this trainer: a Hugging Face model directory (config.json and safetensors), a LoRA adapter's
    (--use-peft: peft's adapter_config.json and adapter_model.safetensors), or empty."""
    if not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    return not names or bool({"config.json", "adapter_config.json"} & names) and any(
        name.endswith(".safetensors") for name in names)


def has_policy(folder: Path) -> bool:
    """Whether `folder` holds a trained policy/ (`is_model_directory`, not empty): a finished run's."""
    return is_model_directory(folder / "policy") and any((folder / "policy").iterdir())


def is_checkpoint(path: Path) -> bool:
    """A checkpoint-<k>/ of this trainer (it has state.json; a torn one never has the name), or empty."""
    return path.is_dir() and (not any(path.iterdir()) or (path / "state.json").is_file())


def run_files(out: Path) -> tuple[list[Path], list[Path]]:
    """(what a run of this trainer left in `out`, paths with the names it writes that it did not write there)."""
    checks = {out / "metrics.jsonl": is_metrics, out / "policy": is_model_directory, out / "config.json": is_record,
              out / "completions.jsonl": is_completions}  # (--log-completions: infra/completions.py)
    checks.update({path: is_checkpoint for path in sorted(out.iterdir(), key=lambda p: p.name)
                   if CHECKPOINT.match(path.name)})
    ours, foreign = [], []
    for path, check in checks.items():
        if path.exists() or path.is_symlink():
            (ours if check(path) else foreign).append(path)
    return ours, foreign


def checkpoint_number(path: Path) -> int:
    """k of a checkpoint-<k> folder (-1 for another name)."""
    match = CHECKPOINT.match(path.resolve().name)
    return int(match.group(1)) if match else -1


def checkpoints(out: str | Path) -> list[Path]:
    """The complete checkpoints in `out`, oldest first (a torn write never has a checkpoint-<k> name; written and
    read by infra/checkpoint.py)."""
    found = [(int(m.group(1)), p) for p in Path(out).glob("checkpoint-*") if (m := CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found) if (p / "state.json").is_file()]


def is_run(path: Path) -> bool:
    """Whether one of `run_files` makes a run (the records alone, config.json and an empty metrics.jsonl, do not)."""
    return path.name != "config.json" and (path.is_dir() or path.stat().st_size > 0)


def trained_policy(model: str) -> Path | None:
    """The trained policy/ (resolved: runs/latest moves) that `model` names when this trainer wrote it: a run's --out
    (its config.json a run record) -> <out>/policy, a checkpoint-<k>/ -> its policy/, either policy/ itself (what the
    done line prints); None for any other path. A TRL user passes the output_dir to from_pretrained; here the model
    is one folder down, beside the run's records. ValueError for a run that has no trained policy yet (it stopped
    before its last iteration), naming what it has."""
    if is_model_name(model):
        return None
    folder = Path(os.path.expanduser(model)).resolve()
    if folder.name == "policy" and (is_checkpoint(folder.parent) or is_record(folder.parent / "config.json")):
        folder = folder.parent  # (is_checkpoint: an empty folder is one too; the policy/ check below decides)
    if CHECKPOINT.match(folder.name) and is_checkpoint(folder) and is_model_directory(folder / "policy"):
        return folder / "policy"
    if not is_record(folder / "config.json"):
        return None
    if has_policy(folder):
        return folder / "policy"
    found = checkpoints(folder)
    newest = (f"its newest checkpoint's is {found[-1] / 'policy'}; --resume auto --out {model} finishes the run"
              if found else "it has no checkpoint either")
    raise ValueError(f"--model {model}: a run's folder with no trained policy (policy/ is written after the last "
                     f"iteration): {newest}")


def tracker_files(out: Path) -> list[Path]:
    """The trackers' files of the run whose config.json is in `out`: TensorBoard's event files directly in <out>/runs
    (its log_dir: infra/tracking.py), wandb's folders named with that run's id in <out>/wandb and its latest-run
    link to one of them. Another run's folder under runs/ or wandb/ is never among them."""
    found = sorted((out / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    record = out / "config.json"
    run_id = json.loads(record.read_text())["run_id"] if is_record(record) else None
    wandb = out / WANDB_DIR
    if run_id and wandb.is_dir():
        folders = [p for p in wandb.glob(f"*run-*-{run_id}") if p.is_dir() and not p.is_symlink()]
        latest = wandb / "latest-run"
        found += folders + ([latest] if latest.is_symlink() and latest.resolve() in
                            {folder.resolve() for folder in folders} else [])
    return found


def listed(paths: list[Path]) -> str:
    names = [path.name + ("/" if path.is_dir() else "") for path in paths]
    return ", ".join(names[:3]) + (", ..." if names[3:] else "")


def continues_here(cfg: Config, out: Path) -> bool:
    """Whether --resume continues the run in `out` (auto, or a checkpoint there), not one of another folder."""
    return cfg.resume == "auto" or Path(cfg.resume).resolve().parent == out.resolve()


# --- --out when it is not given (rule 5) ---
def run_folder(model: str, runs: Path = RUNS, now: float | None = None) -> Path:
    """A new, empty folder runs/<model>-<YYYYmmdd-HHMMSS> (-2, -3, ... when that second's is taken), created here:
    mkdir fails when the name exists, so two runs that start in the same second get two folders.

    Example: run_folder("Qwen/Qwen2.5-0.5B") -> runs/Qwen2.5-0.5B-20261125-101500; a run's policy/ (--model
    runs/latest) is named after that run's folder.
    """
    path = Path(model.rstrip("/"))
    if path.name == "policy":  # a run's policy/, or a checkpoint's: named after that run's folder
        path = path.parent.resolve()
        path = path.parent if CHECKPOINT.match(path.name) else path
    name = path.name
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.") or "run"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    make_directory(runs, "the runs folder")
    for n in itertools.count(1):
        folder = runs / (f"{slug}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
        except OSError as error:
            raise OutputError(f"{folder} cannot be created ({error.strerror}): pass --out DIR, a directory you can "
                              "write") from None


def link_latest(folder: Path) -> str:
    """Point runs/latest (beside `folder`) at `folder`: a relative symbolic link, replaced atomically (a new link
    renamed over the old). Returns '' or, when runs/latest is a folder of its own (written before it was a link),
    a line saying that it was left as it is."""
    latest = folder.parent / LATEST
    if latest.exists() and not latest.is_symlink():
        return (f"{latest} is a run folder of its own (from before runs/latest became a link to the newest run): left "
                f"as it is; this run is in {folder}")
    staging = folder.parent / f".{LATEST}-{os.getpid()}"
    with writing("the link to the newest run", latest):
        staging.unlink(missing_ok=True)
        os.symlink(folder.name, staging)
        os.replace(staging, latest)
    return ""


def remove_unstarted(folder: Path) -> None:
    """Delete a run folder of its own (`run_folder`) whose run never started: it holds its record and lock alone."""
    with suppress(OSError):  # (what failed first is what the run says)
        if {path.name for path in folder.iterdir()} <= {"config.json", LOCK_FILE}:
            shutil.rmtree(folder, ignore_errors=True)


def holds_run(out: str | Path) -> bool:
    """Whether `out` holds a run of this trainer (`is_run`: rows, a policy, a checkpoint)."""
    out = Path(out)
    return out.is_dir() and any(is_run(path) for path in run_files(out)[0])


def resume_or_start(cfg: Config) -> Config:
    """`cfg`, but `--resume auto` where --out holds no run to continue starts one (resume None, with a line), so
    that one command serves every submission of a preemptible job. (--resume auto needs --out, infra/options.py:
    runs/latest may link another run by the time the job is resubmitted.)"""
    if cfg.resume == "auto" and not holds_run(cfg.out) and not any(Path(cfg.out).glob("checkpoint-*")):
        print(f"periodic-rl: --resume auto: {cfg.out} holds no run to continue; starting a new one", flush=True)
        return dataclasses.replace(cfg, resume=None)
    return cfg


def check_restartable(out: Path, found: list[Path]) -> None:
    """Refuse to replace, for --resume auto, a run without checkpoints that did not stop before its first: a finished
    one (its policy/), or one that never asked for any (no --save-every or --save-on-stop in its config.json)."""
    if out / "policy" in found:
        raise OutputError(f"--resume auto: --out {out} holds a finished run ({listed(found)}) and no checkpoint: there "
                          "is nothing to continue; pass --overwrite instead of --resume auto to run it again, "
                          "replacing it, or choose another --out")
    record = out / "config.json"
    options = json.loads(record.read_text()) if is_record(record) else {}
    if not (options.get("save_every") or options.get("save_on_stop")):
        raise OutputError(f"--resume auto: --out {out} holds a run ({listed(found)}) with no checkpoint, started "
                          "without --save-every or --save-on-stop: there is nothing to continue; pass --overwrite "
                          "instead of --resume auto to replace it, or choose another --out")


@contextmanager
def claimed(cfg: Config) -> Iterator[Path]:
    """`--out`, checked, locked for the run (rule 2) and free of any other run's files (rule 3)."""
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
        ours, foreign = run_files(out)
        if foreign:
            raise OutputError(f"--out {out} holds {listed(foreign)}, not written by this trainer: a run writes there "
                              "and would replace it; move it away, or choose another --out")
        found, kept = [path for path in ours if is_run(path)], checkpoints(out)
        restarted = bool(cfg.resume == "auto" and found and not kept)  # a run stopped before its first checkpoint
        if restarted:
            check_restartable(out, found)
            print(f"periodic-rl: --resume auto: no checkpoint in {out} yet: starting the run from iteration 0 "
                  f"(replacing the outputs of the run that stopped before its first checkpoint: {listed(found)})",
                  flush=True)
        if found and not cfg.overwrite and (cfg.resume is None or not continues_here(cfg, out)):
            if cfg.resume is None:
                raise OutputError(f"--out {out} holds a previous run ({listed(found)}): "
                                  + ("pass --resume auto to continue it, --overwrite to replace it" if kept else
                                     "it has no checkpoint to continue from: pass --overwrite to replace it")
                                  + ", or choose another --out")
            raise OutputError(f"--out {out} holds another run ({listed(found)}) than the one --resume {cfg.resume} "
                              "continues, and the two would mix: choose another --out, or pass --overwrite to "
                              "replace it")
        newer = [path for path in kept if cfg.resume not in (None, "auto") and continues_here(cfg, out)
                 and checkpoint_number(path) > checkpoint_number(Path(cfg.resume))]
        if newer:  # continued here, it would rotate the newer checkpoints against its own and leave a gap in the rows
            raise OutputError(f"--resume {cfg.resume}: the run in --out {out} went on past it ({listed(newer)}): "
                              f"continue it from its newest with --resume auto, or branch from this checkpoint into "
                              f"another folder, nothing lost: --resume {cfg.resume} --out NEW_FOLDER")
        if cfg.overwrite and cfg.resume is not None and continues_here(cfg, out) and not restarted:
            raise OutputError(f"--overwrite would delete the run in --out {out} that --resume {cfg.resume} continues, "
                              "its checkpoints included: drop --overwrite")
        replacing = cfg.overwrite or restarted
        for path in [*tracker_files(out), *ours] if replacing else []:  # (config.json names the trackers' files)
            remove(path)
        for folder in (out / TENSORBOARD_DIR, out / WANDB_DIR) if replacing else ():
            for link in folder.iterdir() if folder.is_dir() else ():
                if link.is_symlink() and not link.exists():  # wandb's debug.log links into a deleted run
                    link.unlink()
            with suppress(OSError):
                folder.rmdir()  # if nothing else is left in it
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


def fsync_tree(root: Path | str) -> None:
    """Flush every file under `root`, then each directory's names, contents first (before `root` is renamed into
    place: the new name then never points at files still in the page cache)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in [*files, "."]:
            fsync(os.path.join(folder, name))


def save_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Rule 4: `write(folder)` fills a temporary sibling of `target`, which is synced and renamed to `target`.

    Example: save_atomically(out / "policy", lambda d: (model.save_pretrained(d), tokenizer.save_pretrained(d)))
    Whatever stops it (an exception, a signal, SIGKILL, a full disk), `target` is either the previous
    directory or the new one, complete; on an exception the temporary folder is removed. A full disk is an
    OSError (ENOSPC), whatever the writer raised.
    """
    target = Path(target)
    staging, aside = (target.with_name(f".{target.name}.{state}-{os.getpid()}") for state in ("saving", "old"))
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed process that had this PID
    try:
        staging.mkdir()  # (not mkdtemp: the folder gets the usual permissions, as save_pretrained's files do)
        write(staging)
        fsync_tree(staging)
        if target.exists():
            target.rename(aside)
        staging.rename(target)
        fsync(target.parent)  # the renames themselves
    except BaseException as error:
        full = is_writer_error(error) and os_error(error) is None and is_full(target.parent)  # before the clean-up
        if aside.exists() and not target.exists():  # stopped between the two renames: the previous one back
            aside.rename(target)
        shutil.rmtree(staging, ignore_errors=True)
        if full:  # torch.save's writer says only "unexpected pos"
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target)) from error
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
