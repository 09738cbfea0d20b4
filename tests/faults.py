"""Fault injection for `python trainer.py`: launch it, disturb it, check that it ended cleanly.

    with Launch("--model", model_dir, "--iterations", "1000", "--out", out) as run:
        run.wait_for(r"^iter ")                        # stdout up to the first iteration line
        run.send(signal.SIGTERM)                       # or run.send(SIGKILL, to=run.inference_pid())
        run.assert_stopped(143, r"^interrupted by SIGTERM")

`assert_stopped` checks the whole promise of the README: the exit code, one last stderr line matching
the message and no traceback, the exit within `within` seconds of the signal (`hang_bound`: more on a busy
machine), no process of the run's tree left alive, and nothing new left in /dev/shm. A module for the tests, not a test file.

How leftover processes are found, by PID only: the test process makes itself a child subreaper
(prctl PR_SET_CHILD_SUBREAPER), so a process orphaned anywhere below it is re-parented to it instead
of init; after the run, any child of the test process that did not exist before the launch (PID and
start time, from /proc/PID/stat) is a leftover. Such orphans are reaped here once they have exited.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import warm as warm_start
from warm import as_from_a_terminal  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
STOP_SECONDS = 10  # the README's promise: a failure or a signal ends the run within 10 s


def hang_bound(seconds: float) -> float:
    """The bound a test puts on a wait that must end: `seconds` (the README's promise, or what the code waits for)
    stretched by the machine's load, `max(1, load average / cores)`. A test bounds a hang, never a speed: on a
    quiet machine the promise itself is checked; on a machine busier than its cores (a CI runner shared with
    other jobs, a suite run two tests at a time) every step takes longer by about the ratio of runnable
    processes to cores, and a test that then fails says the machine was busy, not that the run hung."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def become_subreaper() -> None:
    """Orphans below this process are re-parented to it (Linux), so they can be found by PID."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def stat(pid: int) -> tuple[int, str, int] | None:
    """(parent PID, state letter, start time in clock ticks) of a process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[1]), fields[0], int(fields[19])  # fields 4, 3 and 22 of proc(5), after "pid (comm)"


def processes() -> dict[int, tuple[int, str, int]]:
    """Every process: PID -> (parent PID, state, start time)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := stat(int(entry))) is not None:
            table[int(entry)] = info
    return table


def children(pid: int) -> dict[int, int]:
    """Live (not zombie) children of `pid`: PID -> start time."""
    return {p: start for p, (ppid, state, start) in processes().items() if ppid == pid and state != "Z"}


def descendants(pid: int) -> dict[int, int]:
    """Live processes below `pid`: PID -> start time."""
    table, found, frontier = processes(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for p, (ppid, state, start) in table.items():
            if ppid == parent and p not in found:
                if state != "Z":
                    found[p] = start
                frontier.append(p)
    return found


def alive(pid: int, start: int) -> bool:
    """Whether the process that had this PID and start time still runs (not a zombie)."""
    info = stat(pid)
    return info is not None and info[2] == start and info[1] != "Z"


def reap(pids) -> None:
    """Collect exited orphans that were re-parented to this process (no zombies left behind)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child
            pass


def shm_entries() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def mapped_elsewhere(entries: set[str], run: set[int]) -> set[str]:
    """Those of `entries` (in /dev/shm) that a live process outside `run` has mapped: another program's, in use
    (tests run beside other jobs on a shared machine), not a leftover of this run."""
    inodes = {}
    for entry in entries:
        try:
            inodes[(SHM / entry).stat().st_ino] = entry
        except FileNotFoundError:
            pass
    used = set()
    for pid in processes().keys() - run:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:  # gone, or not ours to read
            continue
        # by inode: a mapping's path can be another name of the file (glibc's sem_open maps a temporary one)
        used |= {inodes[int(fields[4])] for fields in map(str.split, maps)
                 if len(fields) > 5 and fields[5].startswith(str(SHM)) and int(fields[4]) in inodes}
    return used


class Launch:
    """`python [LAUNCHER] trainer.py ARGS` in a session of its own (its process group reaches nothing else), stdout
    and stderr read by threads, line by line. As a `with` block it kills whatever is left, by PID, on the way out.
    `launcher`: e.g. ("-m", "torch.distributed.run", "--nproc-per-node", "2") for trainer ranks. `wrapper`: a command
    that runs `python ...` as its child and exits with its code (e.g. `small_disk`): signals then go to that child.
    The trainer starts as from a terminal (`as_from_a_terminal`), but for the signals in `ignored`; in a warm
    interpreter (tests/warm.py) unless `warm` is False (a claim about the interpreter's start itself)."""

    def __init__(self, *args, cwd: Path = ROOT, env: dict | None = None, launcher: tuple[str, ...] = (),
                 wrapper: tuple[str, ...] = (), ignored: tuple[int, ...] = (), warm: bool = True):
        become_subreaper()
        self.shm_before = shm_entries()
        self.children_before = children(os.getpid())
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.line_arrived = threading.Condition()
        self.signalled_at: float | None = None
        self.tree: dict[int, int] = {}  # the run's processes when last looked at: PID -> start time
        self.wrapped = bool(wrapper)
        self.process = warm_start.Popen([*wrapper, sys.executable, *launcher, "trainer.py", *map(str, args)], cwd=cwd,
                                        env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                                        terminal_signals=ignored, warm=warm)
        self.started_at = time.monotonic()
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self.line_arrived:
                lines.append(line.rstrip("\n"))
                self.line_arrived.notify_all()
        with self.line_arrived:
            self.line_arrived.notify_all()

    def wait_for(self, pattern: str, timeout: float = 180) -> str:
        """The first stdout line matching `pattern` (re.search), waiting for it; fails if the run ends first."""
        deadline = time.monotonic() + timeout
        with self.line_arrived:
            while True:
                match = next((line for line in self.stdout if re.search(pattern, line)), None)
                if match is not None:
                    self.tree.update(descendants(self.process.pid))
                    return match
                if self.process.poll() is not None and not any(r.is_alive() for r in self.readers):
                    raise AssertionError(f"the run ended (exit code {self.process.returncode}) before a line "
                                         f"matched {pattern!r}; stderr:\n" + "\n".join(self.stderr[-20:]))
                if time.monotonic() > deadline:
                    raise AssertionError(f"no stdout line matched {pattern!r} within {timeout} s")
                self.line_arrived.wait(0.5)

    def inference_pid(self) -> int:
        """The spawned inference process (multiprocessing's resource tracker is the trainer's other child)."""
        return self.inference_pids()[0]

    def inference_pids(self) -> list[int]:
        """The spawned inference workers, in the order they started (worker 0 first)."""
        spawned = sorted((start, pid) for pid, start in children(self.process.pid).items()
                         if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes())
        if not spawned:
            raise AssertionError(f"no inference process among the children of {self.process.pid}")
        return [pid for _, pid in spawned]

    def trainer_pid(self) -> int:
        """The process that runs `python ... trainer.py` (the launched one, or the wrapper's child)."""
        if not self.wrapped:
            return self.process.pid
        for pid in descendants(self.process.pid):
            with suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if argv[0] == sys.executable.encode() and b"trainer.py" in argv[1:]:
                    return pid
        raise AssertionError(f"no trainer.py process below {self.process.pid}")

    def send(self, signum: int, to: int | None = None, group: bool = False) -> None:
        """Send `signum` to the trainer (or to PID `to`, or to the trainer's whole process group); the
        stop time is measured from here."""
        self.tree.update(descendants(self.process.pid))
        if group:
            os.killpg(self.process.pid, signum)
        else:
            os.kill(to or self.trainer_pid(), signum)
        self.signalled_at = time.monotonic()

    def finish(self, timeout: float) -> float:
        """Wait for the trainer's exit; seconds from the signal (or the launch) to the exit."""
        since = self.signalled_at or self.started_at
        try:
            self.process.wait(timeout=max(0.0, since + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the trainer was still running {timeout} s after the signal; stderr:\n"
                                 + "\n".join(self.stderr[-20:])) from None
        seconds = time.monotonic() - since
        for reader in self.readers:
            reader.join(timeout=5)
        return seconds

    def leftovers(self, grace: float = 3.0) -> tuple[list[int], set[str]]:
        """(processes of the run still alive, new /dev/shm entries), after up to `grace` s for clean-up."""
        deadline = time.monotonic() + grace
        while True:
            new_children = {p: s for p, s in children(os.getpid()).items()
                            if self.children_before.get(p) != s and p not in warm_start.zygote_pids()}
            suspects = {**self.tree, **new_children}
            suspects.pop(self.process.pid, None)  # the trainer itself, reaped by Popen
            reap(suspects)
            running = [p for p, start in suspects.items() if alive(p, start)]
            files = shm_entries() - self.shm_before
            files -= mapped_elsewhere(files, {*suspects, self.process.pid})
            if not running and not files or time.monotonic() > deadline:
                return running, files
            time.sleep(0.2)

    def assert_stopped(self, exit_code: int | None, message: str, within: float = STOP_SECONDS) -> str:
        """The run stopped within `within` s of the signal with `exit_code` (None: the trainer was killed, any
        code), its last stderr line matching `message` (None: not checked), no traceback, nothing left behind.
        Returns stderr."""
        within = hang_bound(within)
        seconds = self.finish(within)
        err = "\n".join(self.stderr)
        if exit_code is not None:
            assert self.process.returncode == exit_code, f"exit code {self.process.returncode}; stderr:\n{err}"
        assert "Traceback" not in err, err
        if message is not None:
            last = [line for line in self.stderr if line.strip()][-1:]
            assert last and re.search(message, last[0]), f"last stderr line {last} does not match {message!r}"
            matching = [line for line in self.stderr if re.search(message, line)]
            assert len(matching) == 1, f"{len(matching)} lines match {message!r}:\n{err}"
        assert seconds <= within, f"stopped after {seconds:.1f} s, more than {within:.1f} s"
        running, files = self.leftovers()
        assert not running, f"processes of the run still alive: {[self.describe(p) for p in running]}"
        assert not files, f"new entries left in {SHM}: {sorted(files)}"
        return err

    @staticmethod
    def describe(pid: int) -> str:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            return f"{pid} {command[:120]}"
        except OSError:
            return str(pid)

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc) -> None:
        """Kill what is left of the run, by PID: the trainer, then every process seen below it or orphaned."""
        self.tree.update(descendants(self.process.pid))
        for pid, start in [(self.process.pid, None), *self.tree.items()]:
            if start is None and self.process.poll() is None or start is not None and alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process.wait()
        for p, s in children(os.getpid()).items():
            if self.children_before.get(p) != s and p not in warm_start.zygote_pids():
                os.kill(p, signal.SIGKILL)
        time.sleep(0.1)
        reap(self.tree)


SMALL_DISK = """
size=$1 disk=$2 keep=$3; shift 3
mount -t tmpfs -o size="$size" tmpfs "$disk" || exit 99
"$@"; code=$?
cp -a "$disk/." "$keep/"
exit $code
"""


def small_disk(size: str, disk: Path, keep: Path) -> tuple[str, ...]:
    """A `wrapper` for Launch: the trainer runs in a mount namespace of its own where the folder `disk` is a tmpfs of
    `size` ("200k", "3m"): a disk that fills up. When the trainer ends, what it left there is copied to `keep` (the
    tmpfs ends with the namespace). Skips the test where unshare cannot make one (user and mount namespaces)."""
    import shutil

    import pytest
    if not shutil.which("unshare") or subprocess.run(["unshare", "--map-root-user", "--mount", "true"]).returncode:
        pytest.skip("needs unshare with user and mount namespaces (a small tmpfs of its own)")
    disk.mkdir(parents=True, exist_ok=True)
    keep.mkdir(parents=True, exist_ok=True)
    return "unshare", "--map-root-user", "--mount", "sh", "-c", SMALL_DISK, "sh", size, str(disk), str(keep)


def frozen_reward(prompt: str, completion: str, answer: str) -> float:
    """A reward function ('tests/faults.py:frozen_reward') stuck for good in a native call that holds the GIL, as a
    hung extension would be: a backtracking regex (the re module never releases the GIL, ~1e13 paths here)."""
    return float(re.fullmatch(r"(a|aa)*c", "a" * 64) is not None)
