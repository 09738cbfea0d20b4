"""The inference side as the trainer sees it: where rollouts come from, and how θ_k gets there.

    trainer process                                  inference process (async mode)
    ---------------------------------------------    ----------------------------------------------
    WeightBuffer.publish(θ_k) (weights.py): copy     WeightBuffer.attach: on CPU its parameters *are*
      into one flat shared-memory tensor, then         views of that tensor (loading θ_k is free);
      version := k                                     on GPU/NPU load_into copies it once
    rollouts.generate(k)  ---- ("generate", k) --->  rollout.rollout_iteration(...): groups in
    rollouts.receive()    <--- Group, ..., Span,       completion order, then the evaluation
                               Evaluation,             (if due), then IterationDone(k)
                               IterationDone

`SyncRollouts` has the same three methods and runs `rollout_iteration` in the trainer's own process
(sync mode); `AsyncRollouts` owns the inference process from spawn to close (use it as a `with`
block). Each group carries the version of the weights that sampled it, read from the buffer when
its generate call started and checked again when the group was sent (`rollout.rollout_iteration`):
a publish while a call was sampling marks its groups (version -1) and the trainer refuses them.

The weight buffer is weights.py's. Departure, on purpose: groups travel as plain Python lists, never
tensors: a tensor in a message is passed by file descriptor, and the sender would have to outlive the
receiver's use of it.
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
import torch.multiprocessing as mp

from config import UserError
from reward import RewardError
from rollout import IterationDone, rollout_iteration
from timeline import INFERENCE, TRAINING, Span, Timeline
from weights import WeightBuffer, check_shared_memory, shared

POLL_SECONDS = 0.2  # how often a waiting trainer checks that the inference process is alive
HEARTBEAT_SECONDS = 1.0  # the inference process's heartbeat thread counts once per second, whatever it computes
STOPPED_SECONDS = 5.0  # no heartbeat for this long and state T (SIGSTOP, Ctrl-Z of that process alone): reported
FROZEN_SECONDS = 60.0  # no heartbeat for this long in any state: hung (a native call holding the GIL, a dead disk)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class PipelineError(UserError):
    """The inference process failed or died; the message says why."""


# --- where rollouts come from ---
class SyncRollouts:
    """Generate the whole iteration in this process, then hand the messages over.

    `sampler` is the model that generates: the policy itself when it computes in its own dtype, else a
    copy in the compute dtype that `publish` refreshes, as the inference process's weights are in async
    mode (so that both modes sample from the same bf16 weights).
    """

    def __init__(self, policy, tokenizer, train, held_out, reward_fn, cfg, sampler=None,
                 share: tuple[int, int] = (0, 1)):
        self.args = (tokenizer, train, held_out, reward_fn, cfg)
        self.sampler = sampler if sampler is not None else policy
        self.share = share  # (r, M): a trainer rank samples its own generate calls (distributed.py)

    @torch.no_grad()
    def publish(self, policy, version: int) -> None:
        if self.sampler is not policy:
            for target, source in zip(self.sampler.parameters(), policy.parameters(), strict=True):
                target.copy_(source)  # casts to the sampler's dtype
        self.version = version

    def generate(self, iteration: int, final_iteration: int, train_prompts: bool = True) -> None:
        """Sample iteration k whole, here and now (nothing overlaps in sync mode); `receive` hands it over."""
        self.sampler.eval()
        tokenizer, train, held_out, reward_fn, cfg = self.args
        self.messages = []
        rollout_iteration(self.sampler, tokenizer, train, held_out, reward_fn, cfg, iteration,
                          lambda: self.version, final_iteration, self.messages.append, train_prompts, self.share)

    def receive(self):
        yield from self.messages


class AsyncRollouts:
    """The inference process, its pipe and the shared weight buffer, seen from the trainer.

    Start it as early as possible: it imports its libraries while the trainer imports its own, and
    loads its model while the trainer loads the policy. `load=False` makes it wait after its imports
    until `load()` (for a model the trainer must build first); `attach(policy)` hands over the
    weight buffer and waits until the inference side is ready. Create it in the main thread: the
    inference process dies with the thread that started it (`die_with_parent`).

    Commands and results travel over one `multiprocessing.Pipe`, not two `Queue`s: a pipe is a pair of
    file descriptors, where a Queue's locks are named semaphores in /dev/shm that stay there for good
    when the run is killed before multiprocessing's resource tracker removes them.
    """

    def __init__(self, model_name: str, load_kwargs: dict, train, held_out, reward_spec: str,
                 timeline: Timeline | None = None, load: bool = True, share: tuple[int, int] = (0, 1)):
        check_shared_memory(0)  # a full /dev/shm fails here, in one line, before a process is spawned (weights: attach)
        context = mp.get_context("spawn")  # fork would copy the trainer's threads and CUDA state
        self.timeline = timeline or Timeline()
        self.dtype = load_kwargs.get("dtype")  # the inference side's weights, as published
        self.weights: WeightBuffer | None = None  # set by attach()
        self.loading = self.loaded = self.failed = False
        self.connection, child_end = context.Pipe()
        self.heartbeat = shared(torch.zeros(1, dtype=torch.int64))  # (1,) beats of the inference process
        self.last_beat, self.last_sign, self.last_check = 0, None, 0.0  # count last seen, when it last changed,
        # when it was last looked at (trainer's clock: `_check_progress`)
        self.process = context.Process(
            target=inference_process, name="periodic-rl-inference", daemon=True,
            args=(model_name, load_kwargs, child_end, self.heartbeat, train, held_out, reward_spec, share))
        with sigint_ignored():  # inherited through exec: a Ctrl-C during the child's imports would print their
            self.process.start()  # traceback; it takes Ctrl-C again once `inference_process` runs
        child_end.close()  # only the child holds its end now: its death reads as end-of-file here
        if load:
            self.load()

    def _send(self, *command) -> None:
        try:
            self.connection.send(command)
        except OSError:  # a broken pipe: the inference process is gone
            raise self._died() from None

    def load(self) -> None:
        """Let the inference process load its model (once its imports are done). Idempotent."""
        if not self.loading:
            self._send("load")
            self.loading = True

    def wait_until_loaded(self) -> None:
        """Block until the inference process has loaded its model (it answers ("loaded", None)). Idempotent."""
        self.load()
        if not self.loaded:
            self._receive()
            self.loaded = True

    def attach(self, policy, cfg, threads: int) -> None:
        """Share θ's buffer with the inference process (as a handle to shared memory, never a copy), with
        the config (sampling settings, sizes) and its thread count."""
        self.wait_until_loaded()
        self.weights = WeightBuffer(policy, self.dtype)  # kept alive here: the receiver maps the sender's memory
        self._send("attach", self.weights, cfg, threads)
        self._receive()  # ("ready", None) once its model reads θ from the buffer

    def publish(self, policy, version: int) -> None:
        with self.timeline.span(f"publish θ_{version}"):
            self.weights.publish(policy, version)

    def generate(self, iteration: int, final_iteration: int, train_prompts: bool = True) -> None:
        """Tell the inference process to sample iteration k (θ_k is published); returns at once."""
        self._send("generate" if train_prompts else "evaluate", iteration, final_iteration)

    def receive(self):
        """The iteration's messages as they arrive, up to IterationDone."""
        while True:
            message = self._receive()
            yield message
            if isinstance(message, IterationDone):
                return

    def _receive(self):
        """Next message from the inference process; raises PipelineError if it failed, died or froze."""
        start = time.perf_counter()
        try:
            while not self.connection.poll(POLL_SECONDS):
                self._check_progress()
            kind, payload = self.connection.recv()
        except (EOFError, OSError):  # its end of the pipe closed: it exited
            raise self._died() from None
        finally:
            self.timeline.add(Span("wait for rollouts", TRAINING, start, time.perf_counter(), wait=True))
        if kind == "error":
            self.failed = True
            raise PipelineError(f"the inference process failed: {payload.strip()}")
        return payload

    def _died(self) -> PipelineError:
        """The error for an inference process that exited without reporting one, naming the signal that killed it."""
        self.failed = True
        self.process.join(timeout=1)  # its pipe closes an instant before it can be reaped
        code = self.process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            how = f"killed by {name}" + (" (most likely by the out-of-memory killer: see dmesg)"
                                         if name == "SIGKILL" else "")
        else:
            how = f"exit code {code}, without reporting an error"
        return PipelineError(f"the inference process (PID {self.process.pid}) died: {how}")

    def _check_progress(self) -> None:
        """Raise PipelineError if the inference process died, is stopped, or its heartbeat stopped (while waiting).

        Silence is counted on the trainer's clock, between its own checks: after a gap (the trainer itself was
        suspended, e.g. Ctrl-Z of the whole job) the count starts again.
        """
        if not self.process.is_alive():
            raise self._died()
        now, beat = time.monotonic(), int(self.heartbeat[0])
        if beat != self.last_beat or self.last_sign is None or now - self.last_check > 4 * POLL_SECONDS:
            self.last_beat, self.last_sign = beat, now
        self.last_check, silent = now, now - self.last_sign
        state = process_state(self.process.pid)
        if state == "T" and silent > STOPPED_SECONDS:
            self.failed = True
            raise PipelineError(f"the inference process (PID {self.process.pid}) is stopped (state T: SIGSTOP, or "
                                f"Ctrl-Z of that process alone) and has not run for {silent:.0f} s")
        if beat > 0 and silent > FROZEN_SECONDS:  # 0: still importing, before its heartbeat starts
            self.failed = True
            raise PipelineError(f"the inference process (PID {self.process.pid}) has shown no sign of life for "
                                f"{silent:.0f} s (state {state}): it hangs, e.g. in a native call that never returns")

    def __enter__(self) -> AsyncRollouts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the inference process: politely, then by force (at once if it failed: it may be stopped or hung).
        Never leaves it running. Idempotent."""
        if self.process.is_alive() and self.weights is not None and not self.failed:  # before attach: loading
            try:
                self.connection.send(("stop",))
                self.process.join(timeout=3)
            except OSError:  # it is gone already
                pass
        if self.process.is_alive() and not self.failed:
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


# --- the inference process (asynchronous mode) ---
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
                      held_out: list, reward_spec: str, share: tuple[int, int] = (0, 1)) -> None:
    """Entry point of the spawned inference process.

    Protocol: import what loading needs, wait for ("load",), load the model, answer ("loaded", None),
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
        signal.signal(signal.SIGINT, signal.default_int_handler)  # started with SIGINT ignored (AsyncRollouts)
        import transformers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))  # while loading; attach sets the run's count
        transformers.utils.logging.disable_progress_bar()
        from models import load_model  # seconds of imports, while the trainer does its own
        from reward import load_reward
        if next_command(connection)[0] == "stop":  # else ("load",)
            return
        model, tokenizer = load_model(model_name, **load_kwargs)
        model.eval()
        reward_fn = load_reward(reward_spec)
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
            rollout_iteration(model, tokenizer, train, held_out, reward_fn, cfg, iteration, weights.version,
                              final_iteration, send=lambda message: results.put(("message", message)),
                              train_prompts=kind == "generate", share=share)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the trainer stops too and reads no more
        sys.exit(130)  # so nothing is flushed: the sender thread is a daemon
    except BaseException as error:  # report, then die: the trainer turns this into a clear message
        summary = f"{type(error).__name__}: {error}" if isinstance(error, RewardError) else traceback.format_exc()
        results.put(("error", summary))
        results.flush()
        sys.exit(1)
