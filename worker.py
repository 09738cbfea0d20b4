"""One inference worker: a spawned process that samples its share of each iteration, and the trainer's handle on it.

    trainer (Worker, this file)                  the worker's process (`inference_process`)
    -----------------------------------------    ---------------------------------------------------
    spawn (SIGINT ignored during its imports)     imports; die_with_parent; heartbeat thread
    send ("load",)                          --->  load the model            ---> ("loaded", None)
    send ("attach", weights, cfg, threads)  --->  θ's buffer attached       ---> ("ready", None)
    send ("generate" | "evaluate", k, K)    --->  rollout_iteration(share)  ---> ("message", Group | Span
                                                                                  | Evaluation | IterationDone)
    poll: alive? stopped? heartbeat?              any exception             ---> ("error", summary), exit 1
    close: ("stop",), then SIGTERM, SIGKILL       ("stop",) or a closed pipe: exit

inference.AsyncRollouts owns N of these and merges their messages. A worker that dies, stops or hangs is
reported by its handle in one line that names it (index and PID) and how it ended.

Commands and results travel over one `multiprocessing.Pipe`, not two `Queue`s: a pipe is a pair of file
descriptors, where a Queue's locks are named semaphores in /dev/shm that stay there for good when the run is
killed before multiprocessing's resource tracker removes them.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import traceback

import torch

from config import UserError, available_cores
from reward import RewardError
from rollout import rollout_iteration
from timeline import INFERENCE, Span
from weights import shared

POLL_SECONDS = 0.2  # how often a waiting trainer checks that its workers are alive
HEARTBEAT_SECONDS = 1.0  # the worker's heartbeat thread counts once per second, whatever it computes
STOPPED_SECONDS = 5.0  # no heartbeat for this long and state T (SIGSTOP, Ctrl-Z of that process alone): reported
FROZEN_SECONDS = 60.0  # no heartbeat for this long in any state: hung (a native call holding the GIL, a dead disk)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class PipelineError(UserError):
    """An inference worker failed or died; the message says which one and why."""


# --- the trainer's handle ---
class Worker:
    """One inference process, its pipe and its heartbeat, seen from the trainer (inference.AsyncRollouts holds N).

    `name` is what every error calls it: "the inference process" when it is the only one, else
    "inference worker w of N". Create it in the main thread: the process dies with the thread that started it.
    """

    def __init__(self, index: int, workers: int, share: tuple[int, int], model_name: str, load_kwargs: dict,
                 train, held_out, reward_specs: list[str] | str, reward_weights: list[float] | None, context):
        self.index = index
        self.name = "the inference process" if workers == 1 else f"inference worker {index} of {workers}"
        self.failed = False
        self.connection, child_end = context.Pipe()
        self.heartbeat = shared(torch.zeros(1, dtype=torch.int64))  # (1,) beats of the worker
        self.last_beat, self.last_sign, self.last_check = 0, None, 0.0  # count last seen, when it last changed,
        # when it was last looked at (trainer's clock: `check_progress`)
        self.process = context.Process(
            target=inference_process, name=f"periodic-rl-inference-{index}", daemon=True,
            args=(model_name, load_kwargs, child_end, self.heartbeat, train, held_out,
                  [reward_specs] if isinstance(reward_specs, str) else reward_specs, reward_weights, share))
        with sigint_ignored():  # inherited through exec: a Ctrl-C during the child's imports would print their
            self.process.start()  # traceback; it takes Ctrl-C again once `inference_process` runs
        child_end.close()  # only the child holds its end now: its death reads as end-of-file here

    def send(self, *command) -> None:
        try:
            self.connection.send(command)
        except OSError:  # a broken pipe: the process is gone
            raise self.died() from None

    def receive(self):
        """The message waiting on the pipe (call when it is readable); PipelineError if it failed or died."""
        try:
            kind, payload = self.connection.recv()
        except (EOFError, OSError):  # its end of the pipe closed: it exited
            raise self.died() from None
        if kind == "error":
            self.failed = True
            raise PipelineError(f"{self.name} (PID {self.process.pid}) failed: {payload.strip()}")
        return payload

    def died(self) -> PipelineError:
        """The error for a worker that exited without reporting one, naming the signal that killed it."""
        self.failed = True
        self.process.join(timeout=1)  # its pipe closes an instant before it can be reaped
        code = self.process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            how = f"killed by {name}" + (" (most likely by the out-of-memory killer: see dmesg)"
                                         if name == "SIGKILL" else "")
        else:
            how = f"exit code {code}, without reporting an error"
        return PipelineError(f"{self.name} (PID {self.process.pid}) died: {how}")

    def check_progress(self) -> None:
        """Raise PipelineError if the worker died, is stopped, or its heartbeat stopped (while the trainer waits).

        Silence is counted on the trainer's clock, between its own checks: after a gap (the trainer itself was
        suspended, e.g. Ctrl-Z of the whole job) the count starts again.
        """
        if not self.process.is_alive():
            raise self.died()
        now, beat = time.monotonic(), int(self.heartbeat[0])
        if beat != self.last_beat or self.last_sign is None or now - self.last_check > 4 * POLL_SECONDS:
            self.last_beat, self.last_sign = beat, now
        self.last_check, silent = now, now - self.last_sign
        state = process_state(self.process.pid)
        if state == "T" and silent > STOPPED_SECONDS:
            self.failed = True
            raise PipelineError(f"{self.name} (PID {self.process.pid}) is stopped (state T: SIGSTOP, or "
                                f"Ctrl-Z of that process alone) and has not run for {silent:.0f} s")
        if beat > 0 and silent > FROZEN_SECONDS:  # 0: still importing, before its heartbeat starts
            self.failed = True
            raise PipelineError(f"{self.name} (PID {self.process.pid}) has shown no sign of life for "
                                f"{silent:.0f} s (state {state}): it hangs, e.g. in a native call that never returns")

    def ask_to_stop(self) -> None:
        """Send ("stop",); it exits once it reads it (between commands, never inside one)."""
        with contextlib.suppress(OSError):  # it is gone already
            self.connection.send(("stop",))

    def end(self, wait: bool, terminate: bool) -> None:
        """Never leaves it running: wait a few seconds for it to exit (after `ask_to_stop`), then SIGTERM (a failed
        one may be stopped or hung: skipped), then SIGKILL."""
        if wait and self.process.is_alive():
            self.process.join(timeout=3)
        if terminate and self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.connection.close()


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


# --- the worker's process ---
def die_with_parent() -> None:
    """End this process when the trainer ends, however it ends (SIGKILL included): else it would sample forever.

    On Linux the kernel sends SIGKILL when the thread that spawned us exits (prctl PR_SET_PDEATHSIG); a
    trainer that died before the prctl is caught by comparing the parent PID. Elsewhere, a thread waits
    on multiprocessing's parent sentinel.
    """
    parent = multiprocessing.parent_process()
    if sys.platform == "linux":
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent.pid:  # orphaned already: re-parented before the prctl
                os._exit(1)
            return
    threading.Thread(target=lambda: (multiprocessing.connection.wait([parent.sentinel]), os._exit(1)),
                     daemon=True).start()


def beat(heartbeat: torch.Tensor) -> None:
    """The heartbeat thread: counts once a second, also while the main thread is inside `generate` (torch releases
    the GIL), so only a stopped or truly hung process falls silent."""
    while True:
        heartbeat.add_(1)
        time.sleep(HEARTBEAT_SECONDS)


class Outbox:
    """Messages to the trainer, sent by a thread, so that `put` never blocks: sampling goes on while the trainer
    trains instead of reading (what a multiprocessing.Queue's feeder thread does)."""

    def __init__(self, connection):
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._send_all, args=(connection,), daemon=True)
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


def next_command(connection) -> tuple:
    """The trainer's next command; ("stop",) once it has closed its end of the pipe."""
    try:
        return connection.recv()
    except EOFError:
        return ("stop",)


def inference_process(model_name: str, load_kwargs: dict, connection, heartbeat: torch.Tensor, train: list,
                      held_out: list, reward_specs: list[str], reward_weights: list[float] | None,
                      share: tuple[int, int] = (0, 1)) -> None:
    """Entry point of a spawned worker; it samples the generate calls of its `share` (rollout.rollout_iteration).

    Protocol: import what loading needs, wait for ("load",), load the model and the rewards (--reward and
    --reward-weights, loaded here from their names: functions need not pickle), answer ("loaded", None),
    then wait for ("attach", weights, cfg, threads): the trainer's shared weight buffer
    (WeightBuffer), the run's config and its thread count; answer ("ready", None).
    Then wait for ("generate", k, final_iteration) (sent after θ_k is in `weights`), run `rollout_iteration` and send
    every message; ("evaluate", k) runs only the held-out evaluation; ("stop",) or a closed pipe ends, at any point.
    Any exception is sent as ("error", summary) before exiting non-zero.
    """
    die_with_parent()
    threading.Thread(target=beat, args=(heartbeat,), name="heartbeat", daemon=True).start()
    results = Outbox(connection)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # started with SIGINT ignored (Worker)
        import transformers
        torch.set_num_threads(max(1, available_cores() // 2))  # while loading; attach sets the run's count
        transformers.utils.logging.disable_progress_bar()
        from models import load_model  # seconds of imports, while the trainer does its own
        from reward import load_rewards
        if next_command(connection)[0] == "stop":  # else ("load",)
            return
        model, tokenizer = load_model(model_name, **load_kwargs)
        model.eval()
        rewards = load_rewards(reward_specs, reward_weights)
        results.put(("loaded", None))
        command = next_command(connection)
        if command[0] == "stop":
            return
        _, weights, cfg, threads = command
        torch.set_num_threads(threads)
        weights.attach(model)  # on CPU its parameters now *are* θ's shared memory
        results.put(("ready", None))
        while True:
            command = next_command(connection)
            if command[0] == "stop":
                break
            kind, iteration, final_iteration = command
            start = time.perf_counter()
            weights.load_into(model, expected_version=iteration)
            results.put(("message", Span(f"load θ_{iteration}", INFERENCE, start, time.perf_counter())))
            rollout_iteration(model, tokenizer, train, held_out, rewards, cfg, iteration, weights.version,
                              final_iteration, send=lambda message: results.put(("message", message)),
                              train_prompts=kind == "generate", share=share)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the trainer stops too and reads no more
        sys.exit(130)  # so nothing is flushed: the sender thread is a daemon
    except BaseException as error:  # report, then die: the trainer turns this into a clear message
        summary = f"{type(error).__name__}: {error}" if isinstance(error, RewardError) else traceback.format_exc()
        results.put(("error", summary))
        results.flush()
        sys.exit(1)
