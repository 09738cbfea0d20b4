"""Whether the run's other processes are still there: the ranks of this host, and waiting without going deaf.

A rank of a torchrun launch can die in ways its peers do not hear about: killed, out of memory, or its own
error. torchrun then SIGTERMs the others, and gloo does not always fail a pending receive when its sender is
gone. So every rank remembers the PIDs of the other ranks on its host once the process group is up
(`distributed.note_neighbours` fills NEIGHBOURS) and, when a wait fails or is cut short, reads /proc to say
which of them ended first (`gone_neighbours`, `ended_first`, `check_neighbours`). A wait that blocks in C++,
where Python's signal handlers cannot run, runs in a thread while the main thread polls (`interruptibly`):
a stop signal is handled at once and a dead neighbour is named within processes.POLL_SECONDS.

Used by infra/distributed.py (a collective's failure), launch/remote.py (inference ranks' waits) and trainer.py
(the line printed when torchrun stops a rank).
"""
from __future__ import annotations

import os
import threading
import time

from infra.errors import UserError
from infra.processes import POLL_SECONDS, process_state


class RanksError(UserError):
    """Options that do not work with trainer ranks, or a collective that failed (a rank died or timed out)."""


NEIGHBOURS: dict[int, tuple[int, str]] = {}  # the other ranks on this host: rank -> (PID, name)


def gone_neighbours(watched: set[int] | None = None) -> list[str]:
    """'trainer rank r of M (PID n)' (or 'inference rank ...') for each other rank on this host whose process has
    ended (gone from /proc, or a zombie torchrun has not reaped yet); [] off Linux, where /proc cannot tell."""
    if not os.path.isdir("/proc"):
        return []
    return [f"{name} (PID {pid})" for rank, (pid, name) in sorted(NEIGHBOURS.items())  # state None: no /proc/PID
            if (watched is None or rank in watched) and process_state(pid) in (None, "Z", "X")]


def gone_neighbours_settled(seconds: float = 2.0) -> list[str]:
    """`gone_neighbours`, waiting up to `seconds` for one: a killed process's sockets close while the kernel is still
    tearing it down, before /proc shows it ended, so a collective fails (connection reset) a moment before its
    cause can be named. For error paths only: with neighbours that all live on (a rank of another host failed) it
    waits the time; with none on this host it returns at once."""
    if not NEIGHBOURS:
        return []
    deadline = time.monotonic() + seconds
    while not (gone := gone_neighbours()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone


def check_neighbours(what: str, watched: set[int] | None = None) -> None:
    """Raise RanksError naming the ranks of this host that have ended (`gone_neighbours`), if any; only the
    `watched` ranks if given (others may have ended normally: trainer ranks > 0 end before rank 0 stops the rest)."""
    if gone := gone_neighbours(watched):
        raise RanksError(f"{what} failed: {ended_first(gone)}; torchrun's report names the rank")


def ended_first(gone: list[str]) -> str:
    """What a rank says of the ranks of its host that ended before it (`gone_neighbours`)."""
    return f"{', '.join(gone)} ended first (killed, out of memory, or its own error line)"


def interruptibly(call, what: str, watched: set[int] | None = None):
    """call() in a thread while this (main) thread waits for it: a stop signal is handled at once (a gloo receive
    blocks in C++, where Python's signal handlers cannot run), and a rank of this host that ended is named within
    POLL_SECONDS (gloo does not always fail a pending receive when its sender dies): of the `watched` ranks, if
    given (`check_neighbours`). Returns what call returns."""
    outcome: dict = {}
    finished = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:
            outcome["error"] = error
        finally:
            finished.set()
    threading.Thread(target=target, daemon=True, name=what).start()
    while not finished.wait(POLL_SECONDS):
        check_neighbours(what, watched)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
