"""Stopping a run on a signal, and leaving without lingering: what trainer.py's main wraps the run in.

    with stopped_by_signals():     # Ctrl-C (SIGINT), SIGTERM, SIGHUP -> Interrupted(signum), raised in the main thread
        ... the run ...
        with stops_deferred():     # a block a stop does not cut (an optimizer step): raised as it ends
            ...
    exit_without_lingering(code)   # sys.exit, but at most `grace` seconds for threads that are not daemons

A stop signal becomes an exception like Ctrl-C's KeyboardInterrupt, so every `with` block on the way out (the
inference processes, the shared-memory buffer, the output folder's lock) closes as it would for Ctrl-C; the
first signal is kept (`Interrupted.received`) even when something swallows its exception, and raised again at
the next safe point (`Interrupted.check`). A signal the launcher ignores (nohup: SIGHUP; a shell's background
job: SIGINT) stays ignored.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager, suppress


class Interrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C's SIGINT, SIGTERM from kill / timeout / Slurm / docker stop, SIGHUP when the terminal
    closes), raised in the main thread as Ctrl-C's KeyboardInterrupt is: `with` blocks stop the inference
    process on the way out, and the schedule may catch it at a safe point."""

    received: int | None = None  # the run's first stop signal, kept even if something swallowed its exception
    deferring: int = 0  # how many `stops_deferred` blocks the main thread is in
    held: int | None = None  # a stop signal that came inside one, raised as the outermost ends

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @classmethod
    def check(cls) -> None:
        """Raise again a stop signal whose exception something swallowed (called at safe points)."""
        if cls.received is not None:
            raise cls(cls.received)


STOP_SIGNALS = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])


@contextmanager
def stopped_by_signals():
    """Inside the block every stop signal raises `Interrupted`; a signal the launcher ignores stays ignored (nohup
    ignores SIGHUP, a shell's background job SIGINT). The previous handlers come back afterwards."""
    def interrupt(signum, frame):
        Interrupted.received = Interrupted.received or signum
        if Interrupted.deferring:
            Interrupted.held = Interrupted.held or signum
            return
        raise Interrupted(signum)
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def stops_deferred():
    """A block that a stop signal does not cut: one arriving inside is raised as the block ends (as `Interrupted`, in
    the main thread, where signals are handled). For a few milliseconds of work whose half-done state is worth
    nothing, such as an optimizer step: θ and AdamW's state then change together or not at all, and a stop
    checkpoint can hold them. Not for a wait: the stop would wait with it."""
    Interrupted.deferring += 1
    try:
        yield
    finally:
        Interrupted.deferring -= 1
    if not Interrupted.deferring and Interrupted.held is not None:
        signum, Interrupted.held = Interrupted.held, None
        raise Interrupted(signum)


def exit_without_lingering(code: int, grace: float = 5.0) -> None:
    """sys.exit(code), but without waiting more than `grace` seconds for threads that are not daemons and do not end
    (a reward function's client library may start one): Python waits for them forever after "done". Ctrl-C in that
    time ends the process at once (no traceback from threading's shutdown)."""
    def leave() -> None:
        time.sleep(grace)
        names = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
        with suppress(OSError, ValueError):
            sys.stderr.write(f"periodic-rl: exiting without waiting for thread(s) {', '.join(names)} (not daemon "
                             f"threads, started by a reward function or a library it uses): still running {grace:g} s "
                             "after the run ended\n")
            sys.stderr.flush()
            sys.stdout.flush()
        os._exit(code)
    if any(not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        threading.Thread(target=leave, name="exit-without-lingering", daemon=True).start()
    sys.exit(code)
