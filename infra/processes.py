"""Process plumbing of the inference side: a child that dies with its parent, a heartbeat the parent can watch, a
pipe that never blocks the sender, and SIGINT held off while a child starts (used by inference.py); and the
children a reward starts of its own (a process pool) ending with the process that started them (trainer.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import queue
import signal
import sys
import threading
import time

POLL_SECONDS = 0.2  # how often a waiting trainer checks that its workers are alive
HEARTBEAT_SECONDS = 1.0  # the worker's heartbeat thread counts once per second, whatever it computes
STOPPED_SECONDS = 5.0  # no heartbeat for this long and state T (SIGSTOP, Ctrl-Z of that process alone): reported
FROZEN_SECONDS = 60.0  # no heartbeat for this long in any state: hung (a native call holding the GIL, a dead disk)
ORPHAN_SECONDS = 1.0  # how often a reward's pool worker checks that the process that started it is alive
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored inside the block (in the main thread; elsewhere handlers cannot change and nothing does)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def process_state(pid: int) -> str | None:
    """A process's state letter from /proc/PID/stat (R running, S sleeping, T stopped, ...); None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def killed_with_parent(parent: int) -> bool:
    """Ask Linux to SIGKILL this process when the thread that started it exits (prctl PR_SET_PDEATHSIG); exit now if
    that parent (PID `parent`, read before) is gone already, re-parented before the prctl. False off Linux."""
    if sys.platform != "linux" or ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0):
        return False
    if os.getppid() != parent:  # orphaned already
        os._exit(1)
    return True


def die_with_parent() -> None:
    """End this process when the trainer ends, however it ends (SIGKILL included): else it would sample forever.

    On Linux the kernel sends SIGKILL when the thread that spawned us exits (prctl PR_SET_PDEATHSIG); a
    trainer that died before the prctl is caught by comparing the parent PID. Elsewhere, a thread waits
    on multiprocessing's parent sentinel.
    """
    parent = multiprocessing.parent_process()
    if killed_with_parent(parent.pid):
        return
    threading.Thread(target=lambda: (multiprocessing.connection.wait([parent.sentinel]), os._exit(1)),
                     daemon=True).start()


def running(pid: int) -> bool:
    """Whether process PID exists and has not exited (a zombie, exited but not yet reaped, has). POSIX."""
    state = process_state(pid)
    if state is not None:
        return state not in ("Z", "X")
    if sys.platform == "win32":  # os.kill(pid, 0) would terminate it there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def exit_when_orphaned(seconds: float = ORPHAN_SECONDS) -> None:
    """End this process within `seconds` of its parent's death, in a daemon thread that watches the parent PID (it
    changes when the kernel re-parents an orphan) and the process multiprocessing names as the parent once it has
    (`parent_process()`: for a child of a forkserver, the process that asked for it; the forkserver lives as long as
    its children do; for a spawned child, the spawner, also when it died before this ran). For multiprocessing's
    children that are not ours (a reward's pool), where PR_SET_PDEATHSIG would fire when the *thread* that started
    the child ends. Once per process."""
    global _watching
    if _watching == os.getpid():
        return
    _watching, parent = os.getpid(), os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            requester = multiprocessing.parent_process()  # None while a spawned child imports its parent's module
            if requester is not None and not running(requester.pid):
                break
            time.sleep(seconds)
        os._exit(1)
    threading.Thread(target=watch, name="exit-when-orphaned", daemon=True).start()


def children_end_with_their_parent(spawned: bool = False) -> None:
    """Every process multiprocessing starts from now on in this process exits within a second of its parent's death,
    SIGKILL included: the workers of a reward's ProcessPoolExecutor would otherwise wait on their task queue forever.
    Children by fork or a forkserver run multiprocessing's after-fork hooks; a spawned child skips them, but imports
    the caller's main module again (as __mp_main__), which calls this with `spawned=True`."""
    global _hooked
    if not _hooked:
        multiprocessing.util.register_after_fork(exit_when_orphaned, lambda _: exit_when_orphaned())
        _hooked = True
    if spawned:
        exit_when_orphaned()


_hooked = False  # the after-fork hook is registered in this process (a forked child inherits it)
_watching: int | None = None  # the PID of the process whose parent a thread watches (a forked child's is not its)


class Heartbeat:
    """The heartbeat thread: counts into `counter` (a shared (1,) tensor the trainer reads) once a second, also while
    the main thread is inside `generate` (torch releases the GIL), so only a stopped or truly hung process falls
    silent. Call `stop` before the process exits: a daemon thread caught inside a torch call when the interpreter
    finalizes aborts the process (std::terminate: "terminate called without an active exception", SIGABRT)."""

    def __init__(self, counter, seconds: float = HEARTBEAT_SECONDS):
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._beat, args=(counter, seconds), name="heartbeat", daemon=True)
        self.thread.start()

    def _beat(self, counter, seconds: float) -> None:
        while not self.stopping.is_set():
            counter.add_(1)
            self.stopping.wait(seconds)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


class Outbox:
    """Messages to the trainer, sent by a thread, so that `put` never blocks: sampling goes on while the trainer
    trains instead of reading (what a multiprocessing.Queue's feeder thread does)."""

    def __init__(self, connection):
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.thread = threading.Thread(target=self._send_all, args=(connection,), name="outbox", daemon=True)
        self.thread.start()

    def put(self, message) -> None:
        self.pending.put(message)

    def _send_all(self, connection) -> None:
        while (message := self.pending.get()) is not None:
            try:
                connection.send(message)
            except OSError:  # the trainer is gone
                return

    def flush(self) -> None:
        """Send everything put so far (an error report must reach the trainer before this process exits)."""
        self.pending.put(None)
        self.thread.join()

    def close(self, discard: bool = False, timeout: float = 2.0) -> None:
        """End the sender before the process exits, so that no daemon thread is inside a send (pickling tensors)
        while the interpreter finalizes (the abort Heartbeat's docstring describes); `discard`: drop what is not
        sent yet (after Ctrl-C nobody reads it). Waits at most `timeout` seconds: a trainer that stopped reading
        leaves a send blocked on a full pipe, and then the process exits as it did without this."""
        if self.closed or not self.thread.is_alive():  # closed, or flushed, already: the timeout is spent once
            return
        self.closed = True
        if discard:
            with contextlib.suppress(queue.Empty):
                while True:
                    self.pending.get_nowait()
        self.pending.put(None)
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C while exiting: exit all the same
            self.thread.join(timeout)


def next_command(connection) -> tuple:
    """The trainer's next command; ("stop",) once it has closed its end of the pipe."""
    try:
        return connection.recv()
    except EOFError:
        return ("stop",)
