"""The inference side as the trainer sees it: where rollouts come from, and how θ_k gets there.

    trainer process                                  N inference workers (async mode; `inference_process`)
    ---------------------------------------------    ----------------------------------------------
    WeightBuffer.publish(θ_k) (weights.py): copy     WeightBuffer.attach: on CPU each worker's
      into one flat shared-memory tensor, then         parameters *are* views of that one tensor;
      version := k                                     on GPU/NPU load_into copies it to its device
    rollouts.generate(k)  ---- ("generate", k) --->  every worker: rollout.rollout_iteration(call_slice):
    rollouts.receive()    <--- ScoredGroup, ...,       its generate calls' groups in completion
                               Span, Evaluation,       order, the evaluation (worker 0, if due),
                               IterationDone           IterationDone(k)

`SyncRollouts` has the same three methods and runs `rollout_iteration` in the trainer's own process
(sync mode); `AsyncRollouts` owns the workers from spawn to close (use it as a `with` block). Each
group carries the version of the weights that sampled it, read from the buffer when its generate call
started and checked again when the group was sent (`rollout.rollout_iteration`): a publish while a call
was sampling marks its groups (version -1) and the trainer refuses them.

N workers per trainer (`--inference-workers N`). An iteration's prompts are cut into generate calls
c = 0, 1, ... of --groups-per-call prompts each; with this trainer's call slice (r, M) (trainer rank r of M:
it owns the calls c with c % M == r), worker w samples the calls c with c % (M·N) == r + M·w
(`worker_call_slices`). All read the same θ_k: one shared-memory buffer, published once per iteration.

The rollouts do not depend on N (a call's tokens depend on its prompts and seeds alone), nor does training:
`in_call_order` hands the trainer the groups in the order one worker would send them, call after call
(docs/design.md, "N inference workers", says why and what it costs).

Departure, on purpose: groups travel as plain Python lists, never tensors: a tensor in a message is passed
by file descriptor, and the sender would have to outlive the receiver's use of it.

A worker's life from spawn to stop (load, attach θ's buffer, generate, stop) is drawn in docs/design.md; one that
dies, stops or hangs is reported by its handle in one line that names it (index and PID) and how it ended.

Commands and results travel over one `multiprocessing.Pipe`, not two `Queue`s: a pipe is a pair of file
descriptors, where a Queue's locks are named semaphores in /dev/shm that stay there for good when the run is
killed before multiprocessing's resource tracker removes them.
"""
from __future__ import annotations

import contextlib
import multiprocessing.connection
import signal
import sys
import time
import traceback
from typing import Iterator

import torch
import torch.multiprocessing as mp

from infra.errors import PipelineError, UserError
from infra.options import available_cores
from infra.processes import (
    FROZEN_SECONDS,
    POLL_SECONDS,
    STOPPED_SECONDS,
    Heartbeat,
    Outbox,
    children_end_with_their_parent,
    die_with_parent,
    next_command,
    process_state,
    sigint_ignored,
)
from infra.timeline import INFERENCE, TRAINING, Span, Timeline
from rollout import IterationDone, Message, ScoredGroup, rollout_iteration
from weights import WeightBuffer, check_shared_memory, published, shared

__all__ = ["AsyncRollouts", "PipelineError", "SyncRollouts", "in_call_order", "owned_calls", "split_threads",
           "worker_devices", "worker_call_slices"]


# --- the inference process: the paper's second column ---
def inference_process(model_name: str, load_kwargs: dict, connection, heartbeat: torch.Tensor,
                      reward_specs: list[str], reward_weights: list[float] | None,
                      call_slice: tuple[int, int] = (0, 1), takes_sigint: bool = True) -> None:
    """Entry point of a spawned worker; it samples the generate calls of its `call_slice` (rollout.rollout_iteration).

    Protocol: import what loading needs, wait for ("load",), load the model and the rewards (--reward and
    --reward-weights, loaded here from their names: functions need not pickle), answer ("loaded", None),
    then wait for ("attach", weights, cfg, threads, train, held_out): the trainer's shared weight buffer
    (WeightBuffer), the run's config, its thread count and the prompts (sent here, not as the process's arguments:
    those are written while the trainer holds SIGINT off, and megabytes of prompts would hold it off for as long as
    the child takes to import torch and read them); answer ("ready", None).
    Then wait for ("generate", k) (sent after θ_k is in `weights`), run `rollout_iteration` and send
    every message; ("evaluate", k) runs only the held-out evaluation; ("stop",) or a closed pipe ends, at any point.
    Any exception is sent as ("error", summary) before exiting non-zero. Ctrl-C (SIGINT to the process group) ends
    it as it ends the trainer, unless the trainer ignores SIGINT (`takes_sigint` False: started by `nohup` or as a
    background job `&`): then both go on, and the trainer stops it when the run ends (else Ctrl-C would kill the
    workers alone and the run would end as if they had crashed).
    """
    die_with_parent()
    children_end_with_their_parent()  # a reward's own pools: also where the trainer's script was not re-imported here
    # (`python -c`, a script on stdin: multiprocessing's spawn imports no __mp_main__ then, so trainer.py's call
    # did not run in this process)
    mp.current_process().daemon = False  # the trainer's handle calls it a daemon, and multiprocessing refuses a
    # daemon children: a reward's process pool (code execution) could not start. This process dies with the trainer
    # all the same (die_with_parent); a pool the reward leaves open is the reward's to close, as in sync mode.
    beating = Heartbeat(heartbeat)
    results = Outbox(connection)
    try:
        if takes_sigint:  # started with SIGINT ignored (Worker)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        import transformers
        torch.set_num_threads(max(1, available_cores() // 2))  # while loading; attach sets the run's count
        transformers.utils.logging.disable_progress_bar()
        from infra.models import (
            load_model,  # seconds of imports, while the trainer does its own
        )
        from infra.reward import load_rewards
        if next_command(connection)[0] == "stop":  # else ("load",)
            return
        model, tokenizer = load_model(model_name, **load_kwargs)
        model.eval()
        rewards = load_rewards(reward_specs, reward_weights)
        results.put(("loaded", None))
        command = next_command(connection)
        if command[0] == "stop":
            return
        _, weights, cfg, threads, train, held_out = command
        torch.set_num_threads(threads)
        weights.attach(model)  # on CPU its parameters now *are* θ's shared memory
        results.put(("ready", None))
        while True:
            command = next_command(connection)
            if command[0] == "stop":
                break
            kind, iteration = command
            start = time.perf_counter()
            weights.load_into(model, expected_version=iteration)
            results.put(("message", Span(f"load θ_{iteration}", INFERENCE, start, time.perf_counter())))
            rollout_iteration(model, tokenizer, train, held_out, rewards, cfg, iteration, weights.version,
                              send=lambda message: results.put(("message", message)),
                              train_prompts=kind == "generate", call_slice=call_slice)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the trainer stops too and reads no more
        results.close(discard=True)  # so what is not sent yet is dropped
        sys.exit(130)
    except BaseException as error:  # report, then die: the trainer turns this into a clear message
        summary = f"{type(error).__name__}: {error}" if isinstance(error, UserError) else traceback.format_exc()
        results.put(("error", summary))
        results.flush()
        sys.exit(1)
    finally:
        results.close()  # both threads end before the interpreter finalizes (Heartbeat, Outbox.close)
        beating.stop()


# --- the trainer's handle on one inference process ---
class Worker:
    """One inference process, its pipe and its heartbeat, seen from the trainer (inference.AsyncRollouts holds N).

    `name` is what every error calls it: "the inference process" when it is the only one, else
    "inference worker w of N". Create it in the main thread: the process dies with the thread that started it.
    """

    def __init__(self, index: int, workers: int, call_slice: tuple[int, int], model_name: str, load_kwargs: dict,
                 reward_specs: list[str] | str, reward_weights: list[float] | None, context):
        self.index = index
        self.name = "the inference process" if workers == 1 else f"inference worker {index} of {workers}"
        self.failed = False
        self.connection, child_end = context.Pipe()
        self.heartbeat = shared(torch.zeros(1, dtype=torch.int64))  # (1,) beats of the worker
        self.last_beat, self.last_sign, self.last_check = 0, None, 0.0  # count last seen, when it last changed,
        # when it was last looked at (trainer's clock: `check_progress`)
        self.reward_timeout = 0.0  # --reward-timeout (from `attach`): a reward may hold the GIL that long, and more
        self.process = context.Process(
            target=inference_process, name=f"periodic-rl-inference-{index}", daemon=True,
            args=(model_name, load_kwargs, child_end, self.heartbeat,
                  [reward_specs] if isinstance(reward_specs, str) else reward_specs, reward_weights, call_slice,
                  signal.getsignal(signal.SIGINT) is not signal.SIG_IGN))  # as the trainer: SIGINT ignored or not
        with sigint_ignored():  # inherited through exec: a Ctrl-C during the child's imports would print their
            self.process.start()  # traceback; it takes Ctrl-C again once `inference_process` runs. A Ctrl-C in
        # this block is lost, so it lasts the fork and exec alone: the arguments are small (the prompts come later)
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
        if beat > 0 and silent > FROZEN_SECONDS + self.reward_timeout:  # 0: still importing, before its heartbeat
            # starts; a reward in C code that holds the GIL is stopped by --reward-timeout's clock first, if it can be
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


# --- which worker samples what, and in which order the trainer takes it ---
def worker_call_slices(call_slice: tuple[int, int], workers: int) -> list[tuple[int, int]]:
    """The rollout shares (s, S) of a trainer's workers: worker w samples the calls c with c % S == s.

    >>> worker_call_slices((1, 2), 2)  # trainer rank 1 of 2, two workers: calls 1, 5, 9, ... and 3, 7, 11, ...
    [(1, 4), (3, 4)]
    """
    rank, ranks = call_slice
    return [(rank + ranks * w, ranks * workers) for w in range(workers)]


def owned_calls(prompts: int, groups_per_call: int, call_slice: tuple[int, int]) -> list[int]:
    """First prompt index of each generate call of the call slice (s, S) (calls[s::S]), in call order.

    >>> owned_calls(16, 4, (1, 2))  # calls 0..3 start at prompts 0, 4, 8, 12; slice 1 of 2 owns calls 1 and 3
    [4, 12]
    """
    start, step = call_slice
    return [first for call, first in enumerate(range(0, prompts, groups_per_call)) if call % step == start]


def worker_devices(rollout_device: str | None, workers: int) -> list[str | None]:
    """The device of each inference worker: --rollout-device is one device for all or one per worker.

    >>> worker_devices("cuda:0,cuda:1", 2), worker_devices("cpu", 2), worker_devices(None, 1)
    (['cuda:0', 'cuda:1'], ['cpu', 'cpu'], [None])
    """
    devices = rollout_device.split(",") if rollout_device else [None]
    if len(devices) not in (1, workers):
        raise ValueError(f"{len(devices)} rollout devices for {workers} inference workers")
    return devices * workers if len(devices) == 1 else devices


def split_threads(threads: int, workers: int) -> list[int]:
    """--rollout-threads split among the inference workers: T // N each, the first T % N one more, at least 1.

    >>> split_threads(5, 2), split_threads(1, 2)
    ([3, 2], [1, 1])
    """
    return [max(1, threads // workers + (w < threads % workers)) for w in range(workers)]


def in_call_order(messages: Iterator[Message], calls: list[int], workers: int) -> Iterator[Message]:
    """The messages of `workers` samplers, merged: groups in the order of `calls` (first prompt of each, as
    `owned_calls`), each call's groups in the order they came; everything else at once; one IterationDone
    after all `workers` have sent theirs. A group waits only while an earlier call is still delivering."""
    held: dict[int, list[ScoredGroup]] = {first: [] for first in calls}
    position, released, done = 0, 0, 0  # the call going through now, its groups released so far, workers done
    for message in messages:
        if isinstance(message, ScoredGroup):
            held[message.call[0]].append(message)
            while position < len(calls) and held[calls[position]]:
                group = held[calls[position]].pop(0)
                released += 1
                if released == group.call[1]:  # call: (first prompt, prompts): the call is complete
                    position, released = position + 1, 0
                yield group
        elif isinstance(message, IterationDone):
            done += 1
            if done == workers:
                yield message
                return
        else:
            yield message


# --- where rollouts come from ---
class SyncRollouts:
    """Generate the whole iteration in this process, then hand the messages over (periodic_rl.Rollouts).

    `sampler` is the model that generates: the policy itself when it computes in its own dtype, else a
    copy in the compute dtype that `publish` refreshes (what training changes: weights.published), as the
    workers' weights are in async mode (so that both modes sample from the same bf16 weights). With `workers` = N
    it samples the N workers' shares one after another, and hands the groups over in the same order as
    `AsyncRollouts` does (`in_call_order`).
    """

    def __init__(self, policy, tokenizer, train, held_out, rewards, cfg, sampler=None, workers: int = 1,
                 call_slice: tuple[int, int] = (0, 1)):
        self.args = (tokenizer, train, held_out, rewards, cfg)
        self.sampler = sampler if sampler is not None else policy
        self.call_slices = worker_call_slices(call_slice, workers)
        self.calls = owned_calls(cfg.prompts_per_iteration, cfg.groups_per_call, call_slice)

    @torch.no_grad()
    def publish(self, policy, version: int) -> None:
        if self.sampler is not policy:
            for target, source in zip(published(self.sampler), published(policy), strict=True):
                target.copy_(source)  # casts to the sampler's dtype (with LoRA: the adapter; the base never moves)
        self.version = version

    def generate(self, iteration: int, train_prompts: bool = True) -> None:
        """Sample iteration k whole, here and now (nothing overlaps in sync mode); `receive` hands it over."""
        self.sampler.eval()
        tokenizer, train, held_out, rewards, cfg = self.args
        self.messages = []
        for call_slice in self.call_slices:
            rollout_iteration(self.sampler, tokenizer, train, held_out, rewards, cfg, iteration,
                              lambda: self.version, self.messages.append, train_prompts, call_slice)

    def receive(self) -> Iterator[Message]:
        yield from in_call_order(iter(self.messages), self.calls, len(self.call_slices))


class AsyncRollouts:
    """The inference workers (`Worker`: process, pipe, heartbeat) and the shared weight buffer, seen from
    the trainer (periodic_rl.Rollouts).

    Start it as early as possible: the workers import their libraries while the trainer imports its own,
    and load their models while the trainer loads the policy. `load=False` makes them wait after their
    imports until `load()` (for a model the trainer must build first); `attach(policy)` hands over the
    weight buffer and waits until every worker is ready. Create it in the main thread: the workers die
    with the thread that started them (`processes.die_with_parent`).

    `workers` = N processes, placed by load_kwargs["device"]: one device for all, or a comma-separated
    list with one per worker (`worker_devices`); `call_slice` = (r, M), this trainer's slice of the
    generate calls, split among its workers (`worker_call_slices`).
    """

    def __init__(self, model_name: str, load_kwargs: dict, train, held_out, reward_specs: list[str] | str,
                 timeline: Timeline | None = None, load: bool = True, workers: int = 1,
                 call_slice: tuple[int, int] = (0, 1), reward_weights: list[float] | None = None):
        check_shared_memory(0)  # a full /dev/shm fails here, in one line, before a process is spawned (weights: attach)
        context = mp.get_context("spawn")  # fork would copy the trainer's threads and CUDA state
        self.timeline = timeline or Timeline()
        self.dtype = load_kwargs.get("dtype")  # the inference side's weights, as published
        self.call_slice = call_slice
        self.prompts = (train, held_out)  # sent with ("attach", ...)
        self.weights: WeightBuffer | None = None  # set by attach()
        self.loading = self.loaded = False
        self.workers: list[Worker] = []
        try:
            for index, (device, worker_slice) in enumerate(zip(worker_devices(load_kwargs.get("device"), workers),
                                                               worker_call_slices(call_slice, workers))):
                kwargs = {**load_kwargs, "device": device} if device else load_kwargs
                self.workers.append(Worker(index, workers, worker_slice, model_name, kwargs, reward_specs,
                                           reward_weights, context))
        except BaseException:  # a Ctrl-C or a failed spawn: none of those started may outlive this
            self.close()
            raise
        self.by_connection = {worker.connection: worker for worker in self.workers}
        self.ready: list = []  # pipes found readable, not read yet
        if load:
            self.load()

    def load(self) -> None:
        """Let the workers load their models (once their imports are done). Idempotent."""
        if not self.loading:
            for worker in self.workers:
                worker.send("load")
            self.loading = True

    def wait_until_loaded(self) -> None:
        """Block until every worker has loaded its model (each answers ("loaded", None)). Idempotent."""
        self.load()
        if not self.loaded:
            self._answers()
            self.loaded = True

    def check_alive(self) -> None:
        """PipelineError naming a worker that died (killed, out of memory), while the trainer does something else."""
        for worker in self.workers:
            if not worker.process.is_alive():
                raise worker.died()

    def attach(self, policy, cfg, threads: int) -> None:
        """Share θ's buffer with the workers (as a handle to shared memory, never a copy), with the config
        (sampling settings, sizes) and their thread counts: `threads` split among them (`split_threads`)."""
        self.wait_until_loaded()
        self.weights = WeightBuffer(policy, self.dtype)  # kept alive here: the receivers map the sender's memory
        self.calls = owned_calls(cfg.prompts_per_iteration, cfg.groups_per_call, self.call_slice)
        for worker, worker_threads in zip(self.workers, split_threads(threads, len(self.workers))):
            worker.reward_timeout = cfg.reward_timeout
            worker.send("attach", self.weights, cfg, worker_threads, *self.prompts)
        self._answers()  # ("ready", None) from each, once its model reads θ from the buffer

    def publish(self, policy, version: int) -> None:
        with self.timeline.span(f"publish θ_{version}"):
            self.weights.publish(policy, version)

    def generate(self, iteration: int, train_prompts: bool = True) -> None:
        """Tell every worker to sample its calls of iteration k (θ_k is published); returns at once."""
        for worker in self.workers:
            worker.send("generate" if train_prompts else "evaluate", iteration)

    def receive(self) -> Iterator[Message]:
        """The iteration's messages as they arrive, groups in call order (`in_call_order`), up to IterationDone."""
        yield from in_call_order(self._messages(), self.calls, len(self.workers))

    def _messages(self):
        while True:
            worker, message = self._next()
            if isinstance(message, Span):
                message.lane = worker.index  # its row in the trace, its part of the busy time
            yield message

    def _answers(self) -> None:
        """Wait until every worker has answered once (("loaded", None) or ("ready", None))."""
        waiting = set(self.workers)
        while waiting:
            waiting.discard(self._next()[0])

    def _next(self) -> tuple[Worker, object]:
        """The next message of any worker; raises PipelineError if one failed, died or froze, naming it."""
        start = time.perf_counter()
        try:
            while not self.ready:  # one message from each readable pipe in turn, so no worker waits behind another
                self.ready = multiprocessing.connection.wait(list(self.by_connection), POLL_SECONDS)
                for worker in self.workers if not self.ready else []:
                    worker.check_progress()
            worker = self.by_connection[self.ready.pop(0)]
            return worker, worker.receive()  # a dead worker's pipe is readable: end-of-file, reported at once
        finally:
            self.timeline.add(Span("wait for rollouts", TRAINING, start, time.perf_counter(), wait=True))

    def __enter__(self) -> AsyncRollouts:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(stopping=kind is not None and issubclass(kind, KeyboardInterrupt))

    def close(self, stopping: bool = False) -> None:
        """Stop the workers: politely, all at once, then by force (at once if one failed: the others may be in the
        middle of an iteration; and on a stop signal, `stopping`: nothing they would finish is kept, and a busy
        machine would stretch the polite wait). Never leaves one running. Idempotent."""
        failed = any(worker.failed for worker in self.workers)
        # (before it loaded, a worker may be importing)
        polite = (self.weights is not None or self.loaded) and not failed and not stopping
        if polite:
            for worker in self.workers:
                worker.ask_to_stop()
        for worker in self.workers:
            worker.end(wait=polite, terminate=not failed)
