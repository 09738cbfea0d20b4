"""Inference ranks: samplers that are torchrun ranks of their own, on any node, fed and read over torch.distributed.

    torchrun --nnodes 2 --nproc-per-node 4 ... trainer.py --inference-ranks 4    (node 1: inference only)

The last K of the W ranks sample (inference rank j = global rank M + j), the first M = W - K train. Iteration k:

    trainer rank 0                                      inference rank j of K (`serve`)
    publish θ_k: θ cast into one flat tensor            broadcast: header (command, k, K_final, clock),
    generate(k): broadcast header, then θ_k  ------->     then θ_k straight into its model's parameters
                 (group "weights": rank 0 + the           (they are views of one flat tensor)
                 inference ranks; NCCL/HCCL/gloo)       rollout_iteration(call_slice=(j, K)): the calls c % K == j,
    every trainer rank r: receive()          <-------     each group, in completion order, to the rank that
      recv_object from any inference rank                 owns its call, c % M (`destination`); the spans and
      (its "transport" group: gloo, Python objects),      the evaluation to rank 0; IterationDone to every
      then in_call_order, as from local workers           trainer rank (a sender thread per trainer rank)

The barrier is the broadcast: an inference rank samples iteration k+1 only with θ_{k+1}, which rank 0 sends only
after its iteration k is done, and rank 0's iteration k ends only after every rank's step of it (the all-reduce).
So a group's weights are always the iteration's: a version check as the shared-memory buffer's has nothing to
catch. The rollouts are the single process's (each call seeded per call: rollout.py), the groups reach each trainer
rank in its calls' order (inference.in_call_order), so the run equals the one with local inference workers
(tests/method/test_distributed.py: the single-process run, two "nodes" of which one samples only).

Clocks: an inference rank's spans (a generate call, an evaluation) are moved onto trainer rank 0's clock with the
offset measured at each broadcast (rank 0's clock sent in the header, less the inference rank's on receipt: off by
the broadcast's latency, a millisecond), so the timeline's busy and idle seconds mean the same across hosts.

Process groups (distributed.process_group): θ on the devices' backend ("weights"), the command and the groups on
gloo ("commands": a CPU tensor, so that a waiting rank takes signals; "transport": one group per trainer rank).

Departures, on purpose: groups travel as pickled Python objects (`send_object`: a few KB per group), θ as one
tensor per iteration on the devices' own backend. One sampler per inference rank (give more ranks, not
--inference-workers). An inference rank failing in its sampling loop sends its error to every trainer
rank before it exits (one failing while it loads prints its own line, and torchrun stops the others).
"""
from __future__ import annotations

import contextlib
import dataclasses
import pickle
import queue
import threading
import time
import traceback
from typing import Iterator

import torch
import torch.distributed as dist

from inference import in_call_order, owned_calls
from infra.distributed import GROUPS, Ranks, collective, owner
from infra.errors import PipelineError
from infra.liveness import RanksError, check_neighbours, interruptibly
from infra.processes import POLL_SECONDS
from infra.reward import RewardError
from infra.timeline import INFERENCE, TRAINING, Span, Timeline
from rollout import Evaluation, IterationDone, Message, ScoredGroup, rollout_iteration
from weights import published, views_of

GENERATE, EVALUATE, STOP = 0, 1, 2  # the header's command


# --- θ as one flat tensor ---
def flat_like(model: torch.nn.Module, dtype: torch.dtype, device) -> torch.Tensor:
    """An empty flat tensor with room for every published parameter of `model` (weights.published: all, tied weights
    once, or a LoRA adapter's), in `dtype` on `device`."""
    return torch.empty(sum(p.numel() for p in published(model)), dtype=dtype, device=device)  # (num_params,)


def views(flat: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    """The slice of `flat` that holds each published parameter, shaped as it (in `weights.published` order)."""
    return views_of(flat, [p.shape for p in published(model)])


def alias(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Make `model`'s parameters views of `flat`: a broadcast into `flat` is then a load of the weights."""
    for view, p in zip(views(flat, model), published(model)):
        p.data = view


def destination(message, ranks: Ranks, groups_per_call: int) -> list[int]:
    """The trainer ranks a message goes to: a group to the owner of its generate call; IterationDone to every
    trainer rank (each counts one per inference rank); a span or an evaluation to rank 0, which logs.

    >>> ranks = Ranks(rank=3, size=2, inference=2)
    >>> destination(IterationDone(0), ranks, 2), destination(Span("x", "inference", 0, 1), ranks, 2)
    ([0, 1], [0])
    """
    if isinstance(message, ScoredGroup):
        return [owner(message.call[0] // groups_per_call, ranks.size)]
    return list(range(ranks.size)) if isinstance(message, IterationDone) else [0]


def shifted(message, offset: float):
    """The message with its times (start, end) moved by `offset` seconds onto trainer rank 0's clock."""
    if isinstance(message, (ScoredGroup, Evaluation, Span)):
        return dataclasses.replace(message, start=message.start + offset, end=message.end + offset)
    return message


# --- Python objects between ranks (torch.distributed's send_object_list cannot receive from any source) ---
def send_object(obj, dst: int, group) -> None:
    """Send a picklable object to global rank `dst`: its size, then its bytes (group: on gloo, CPU tensors)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # (n,)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=group)
    dist.send(data, dst=dst, group=group)


def recv_object(group) -> tuple[object, int]:
    """(the next object any rank of `group` sent with `send_object`, the global rank that sent it)."""
    size = torch.empty(1, dtype=torch.int64)  # (1,)
    sender = dist.recv(size, group=group)  # from any source; its bytes then come from that one
    data = torch.empty(int(size), dtype=torch.uint8)  # (n,)
    dist.recv(data, src=sender, group=group)
    return pickle.loads(data.numpy().tobytes()), sender


# --- the trainer ranks' side (periodic_rl.train sees AsyncRollouts' methods) ---
class RemoteRollouts:
    """The K inference ranks as a trainer rank sees them (periodic_rl.Rollouts). Rank 0 broadcasts θ_k and the
    command; every trainer rank receives its own groups. Use it as a `with` block: leaving it tells the inference
    ranks to stop."""

    def __init__(self, ranks: Ranks, dtype: torch.dtype, timeline: Timeline | None = None):
        self.ranks, self.dtype = ranks, dtype
        self.timeline = timeline or Timeline()
        self.flat: torch.Tensor | None = None  # rank 0's θ_k in the inference dtype (attach)
        self.failed = False

    def load(self) -> None:  # the inference ranks load their own models, as soon as they start
        pass

    def wait_until_loaded(self) -> None:
        pass

    def check_alive(self) -> None:
        """A RanksError if an inference rank of this host has ended (the size probe asks between its calls)."""
        check_neighbours("sizing", set(range(self.ranks.size, self.ranks.world)))

    def attach(self, policy, cfg, threads: int) -> None:
        """The sizes (the calls this rank owns) and, on rank 0, θ's flat tensor. `threads`: each inference rank's own
        --rollout-threads (its options are the same)."""
        self.calls = owned_calls(cfg.prompts_per_iteration, cfg.groups_per_call, self.ranks.call_slice)
        if self.ranks.is_main:
            self.flat = flat_like(policy, self.dtype, next(policy.parameters()).device)

    @torch.no_grad()
    def publish(self, policy, version: int) -> None:
        if self.ranks.is_main:
            with self.timeline.span(f"publish θ_{version}"):
                for view, p in zip(views(self.flat, policy), published(policy)):
                    view.copy_(p)  # casts to the inference dtype

    def generate(self, iteration: int, train_prompts: bool = True) -> None:
        """Rank 0: send the command and θ_k to every inference rank (on gloo, until they have it; on NCCL/HCCL, until
        it is queued on the device); other trainer ranks: nothing."""
        if self.ranks.is_main:
            with self.timeline.span(f"broadcast θ_{iteration}"):
                self._broadcast(GENERATE if train_prompts else EVALUATE, iteration)
                with collective(f"the broadcast of θ_{iteration} to the inference ranks", self.ranks):
                    dist.broadcast(self.flat, src=0, group=GROUPS["weights"])

    def _broadcast(self, command: int, iteration: int = 0) -> None:
        header = torch.tensor([command, iteration, int(time.perf_counter() * 1e6)],
                              dtype=torch.int64)  # (3,) on the CPU: the "commands" group is gloo
        with collective("the command to the inference ranks", self.ranks):
            dist.broadcast(header, src=0, group=GROUPS["commands"])

    def receive(self) -> Iterator[Message]:
        """The iteration's messages as they arrive, groups in call order (`in_call_order`), up to IterationDone."""
        yield from in_call_order(self._messages(), self.calls, self.ranks.inference)

    def _messages(self):
        """The messages of one iteration, received by a thread (`_receive_iteration`) while this one waits on a queue:
        a blocking receive in the main thread could not be interrupted by a stop signal, and gloo does not always
        fail a receive from any source when the sender dies; this loop looks for a dead rank on this host instead."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._receive_iteration, args=(inbox,), daemon=True, name="receiver").start()
        while True:
            start = time.perf_counter()
            kind, payload, sender = self._next(inbox)
            self.timeline.add(Span("wait for rollouts", TRAINING, start, time.perf_counter(), wait=True))
            if kind == "failed":  # the receive itself failed (a RanksError naming what)
                raise payload
            if kind == "error":
                self.failed = True
                raise PipelineError(f"{self.ranks.name(sender)} failed: {payload.strip()}")
            if isinstance(payload, Span):
                payload.lane = sender - self.ranks.size  # its row in the trace
            yield payload

    def _next(self, inbox: queue.SimpleQueue) -> tuple:
        """The receiver thread's next (kind, message, sender); meanwhile, every POLL_SECONDS, a RanksError if an
        inference rank of this host has ended (a RanksError leaving the `with` block: no STOP is sent)."""
        while True:
            try:
                return inbox.get(timeout=POLL_SECONDS)
            except queue.Empty:
                check_neighbours("receiving rollouts", set(range(self.ranks.size, self.ranks.world)))

    def _receive_iteration(self, inbox: queue.SimpleQueue) -> None:
        """The receiver thread: (kind, message, sender) into `inbox` until every inference rank's IterationDone (or
        an error report, or a failed receive)."""
        done = 0
        while done < self.ranks.inference:
            try:
                with collective("receiving rollouts from the inference ranks", self.ranks):
                    (kind, payload), sender = recv_object(GROUPS["transport"][self.ranks.rank])
            except RanksError as error:
                inbox.put(("failed", error, None))
                return
            inbox.put((kind, payload, sender))
            if kind == "error":
                return
            done += isinstance(payload, IterationDone)

    def __enter__(self) -> RemoteRollouts:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
            return
        if issubclass(kind, (KeyboardInterrupt, RanksError)):
            self.failed = True  # a stop signal or a lost rank: torchrun stops every rank, a broadcast could hang
        with contextlib.suppress(Exception):  # the error on its way out is the one to report
            self.close()

    def close(self) -> None:
        """Rank 0 tells the inference ranks to stop, unless a rank failed or a signal came (torchrun then stops
        every rank)."""
        if self.ranks.is_main and self.flat is not None and not self.failed and GROUPS:
            self._broadcast(STOP)


# --- an inference rank's process ---
class Sender:
    """Messages to trainer ranks, sent by one thread per trainer rank, so that sampling never waits for a trainer to
    post its receive, and a message to rank r never waits behind one to rank r' (a gloo send waits for the receive:
    with one queue, rank 0 in the step's all-reduce, waiting for rank 1, would hold back rank 1's last group)."""

    def __init__(self, ranks: Ranks):
        self.pending = [queue.SimpleQueue() for _ in range(ranks.size)]
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self._send_all, args=(ranks, rank), daemon=True, name=f"to {rank}")
                        for rank in range(ranks.size)]
        for thread in self.threads:
            thread.start()

    def put(self, message, to: list[int]) -> None:
        if self.error is not None:
            raise self.error
        for rank in to:
            self.pending[rank].put(message)

    def _send_all(self, ranks: Ranks, rank: int) -> None:
        while (message := self.pending[rank].get()) is not None:
            try:
                with collective(f"sending rollouts to {ranks.name(rank)}", ranks):
                    send_object(message, rank, GROUPS["transport"][rank])
            except BaseException as error:  # a trainer rank is gone: the next put raises it
                self.error = error
                return

    def flush(self) -> None:
        """Send everything put so far (an error report must reach the trainers before this process exits)."""
        for pending in self.pending:
            pending.put(None)
        for thread in self.threads:
            thread.join()


def serve(cfg, ranks: Ranks, train: list, held_out: list, rewards, load_kwargs: dict) -> None:
    """An inference rank's life: load the model (on --rollout-device, in the compute dtype, its parameters views of
    one flat tensor), then for each command broadcast by trainer rank 0: receive θ_k, sample this rank's calls of
    iteration k (or only the evaluation) and send every message where `destination` says; STOP ends it."""
    import transformers

    from infra.models import load_model
    transformers.utils.logging.disable_progress_bar()  # the log is rank 0's
    dtype = getattr(torch, cfg.dtype)
    model, tokenizer = load_model(cfg.model, **{**load_kwargs, "device": cfg.rollout_device, "dtype": dtype})
    model.eval()
    torch.set_num_threads(cfg.rollout_threads)
    device = next(model.parameters()).device
    flat = flat_like(model, dtype, device)
    alias(model, flat)
    call_slice = (ranks.rank - ranks.size, ranks.inference)
    sender = Sender(ranks)
    try:
        while True:
            header = torch.zeros(3, dtype=torch.int64)  # (3,) command, k, clock (us); gloo, CPU
            with collective("waiting for trainer rank 0's next command", ranks):  # (may wait long: interruptibly;
                interruptibly(lambda: dist.broadcast(header, src=0, group=GROUPS["commands"]),  # trainer ranks > 0
                              "waiting for trainer rank 0's next command", watched={0})  # end first, normally
            command, iteration, clock = header.tolist()
            if command == STOP:
                break
            start = time.perf_counter()
            with collective(f"receiving θ_{iteration} from trainer rank 0", ranks):
                dist.broadcast(flat, src=0, group=GROUPS["weights"])
            offset = clock / 1e6 - start  # this clock -> rank 0's (off by the header's latency)
            loaded = Span(f"load θ_{iteration}", INFERENCE, start, time.perf_counter())

            def send(message) -> None:
                sender.put(("message", shifted(message, offset)), destination(message, ranks, cfg.groups_per_call))
            send(loaded)
            rollout_iteration(model, tokenizer, train, held_out, rewards, cfg, iteration, lambda: iteration, send,
                              train_prompts=command == GENERATE, call_slice=call_slice)
        sender.flush()
    except (KeyboardInterrupt, RanksError):
        raise  # a stop signal (torchrun stops every rank), or a trainer rank is gone: nobody is left to tell
    except Exception as error:  # tell every trainer rank, which says so in one line, then fail here too
        summary = f"{type(error).__name__}: {error}" if isinstance(error, RewardError) else traceback.format_exc()
        with contextlib.suppress(BaseException):
            sender.put(("error", summary), list(range(ranks.size)))
            sender.flush()
        raise
