"""The iteration schedule: periodic asynchrony (async) and its synchronous baseline (sync).

Periodic asynchrony (arXiv 2511.18871, Fig. 2), iteration k:

    trainer                                   inference process
    ------------------------------------      ------------------------------------------
    publish θ_k -> shared-memory buffer  ->   load θ_k (CPU: its parameters *are* views
    send ("generate", k)                        of the buffer, so nothing is copied)
                                              for each chunk of C prompts: one generate call;
                                                each group pushed the step its last
                                                response stops (completion order)
    for each micro-batch of arrived groups: <-  ... (generation continues meanwhile)
        forward, backward (accumulate ∇)      evaluate θ_k on held-out prompts (if due)
    optimizer step(s)                    <-   IterationDone(k): θ_k no longer read
    publish θ_{k+1} ...

The barrier is the publish: the inference process never samples iteration k+1 before θ_{k+1}
exists, and the trainer rejects any group whose `policy_version` is not k. Hence every sample of
iteration k comes from θ_k: the method is strictly on-policy. And the update equals the
synchronous one, because with one optimizer step per iteration

    ∇L(θ_k) = (1/D) Σ_{groups g} ∇ S_g(θ_k)       (grpo.py: each loss is a sum over tokens / D)

is a sum over the same samples evaluated at the same θ_k; a sum does not depend on the order of
its terms (up to float rounding), so streaming groups in any order gives the synchronous gradient.
With N > 1 optimizer steps per iteration the same holds per mini-batch, because mini-batch
membership is fixed by prompt index (`minibatch_of`), never by arrival order. Micro-batches (which
groups share a forward) are cut by arrival order, but arrival order is completion order, a function
of the sampled tokens alone: the two modes, and any rerun, batch the same groups together, so with
equal thread counts they are bitwise the same run (tests/test_pipeline.py).

Synchronous mode runs the same `rollout_iteration` in the trainer's process and only then trains:
same seeds, same groups, same gradients, no overlap.

Departures, on purpose:
1. The held-out evaluation runs in the inference process after the iteration's groups, so it
   overlaps the training tail instead of stalling the trainer; except when the sides take turns
   (`takes_turns`: more CPU threads than cores), where overlapping would only slow both.
2. The weight buffer lives in CPU shared memory even for GPU runs (one device-to-host copy per
   publish, one host-to-device copy per load); CUDA IPC would save a copy but ties both
   processes to one driver context and does not cover NPUs.
3. Groups travel as plain Python lists, never tensors: a tensor on a queue is passed by file
   descriptor, and the sender would have to outlive the receiver's use of it.
"""
from __future__ import annotations

import math
import os
import queue
import shutil
import time
from typing import Iterator

import torch
import torch.multiprocessing as mp

import sizing
from grpo import grpo_loss, loss_normalizer
from packing import enable_activation_checkpointing
from rollout import Evaluation, Group, IterationDone, Settings, inference_process, rollout_iteration
from timeline import INFERENCE, TRAINING, Span, Timeline
from tri_model import TriModel

POLL_SECONDS = 0.2  # how often a waiting trainer checks that the inference process is alive


class PipelineError(RuntimeError):
    """The inference process failed or died; the message says why."""


class OffPolicyError(RuntimeError):
    """A group sampled by weights other than the current iteration's: on-policy would be broken."""


# --- shared-memory weights ---
SHM_SLACK_BYTES = 8 * 2**20  # what else lands in /dev/shm during a run (semaphores, queues: kilobytes)


def check_shared_memory(nbytes: int, path: str = "/dev/shm") -> None:
    """Fail in one line, naming the fix, when `path` cannot hold `nbytes` (Docker's default is 64 MB)."""
    if not os.path.isdir(path):  # not Linux: shared memory is not a size-limited file system there
        return
    free = shutil.disk_usage(path).free
    if nbytes + SHM_SLACK_BYTES > free:
        need_gib = math.ceil((1.25 * nbytes + SHM_SLACK_BYTES) / 2**30)  # with room to spare
        raise PipelineError(f"the shared-memory weight buffer needs {nbytes / 2**20:,.0f} MiB (+{SHM_SLACK_BYTES // 2**20} "
                            f"MiB for queues) but {path} has {free / 2**20:,.0f} MiB free: give the container more "
                            f"(docker run --shm-size={need_gib}g, or Kubernetes: an emptyDir with medium Memory on "
                            f"/dev/shm), free some, or use --mode sync")


class WeightBuffer:
    """θ as one flat tensor in shared memory plus a version counter.

    publish(model, k): copy every parameter into its slice (casting to the buffer's dtype), then set version = k.
    attach(model):     on CPU, make the model's parameters views of their slices (zero copy).
    load_into(model):  check the version; copy only where attach could not alias (GPU, NPU).

    `dtype` is what the inference side computes in: bf16 halves the bytes published per iteration while
    the trainer keeps float32 masters.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None):
        params = list(model.parameters())  # tied weights (embeddings = lm_head) appear once
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"WeightBuffer needs one parameter dtype, got {dtypes}")
        dtype = dtype or params[0].dtype
        self.shapes = [p.shape for p in params]
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        check_shared_memory(self.offsets[-1] * dtype.itemsize)
        self.flat = torch.empty(self.offsets[-1], dtype=dtype).share_memory_()  # (num_params,)
        self._version = torch.full((1,), -1, dtype=torch.int64).share_memory_()  # (1,) shared too
        self.aliased = False

    def views(self) -> list[torch.Tensor]:
        return [self.flat[start:end].view(shape)
                for start, end, shape in zip(self.offsets, self.offsets[1:], self.shapes)]

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        for view, param in zip(self.views(), model.parameters()):
            view.copy_(param)
        self._version.fill_(version)

    def version(self) -> int:
        return int(self._version[0])

    def attach(self, model: torch.nn.Module) -> None:
        params = list(model.parameters())
        if [p.shape for p in params] != self.shapes:
            raise ValueError("the inference model's parameters do not match the trainer's (same --model?)")
        if all(p.device.type == "cpu" and p.dtype == self.flat.dtype for p in params):
            for view, param in zip(self.views(), params):
                param.data = view
            self.aliased = True

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module, expected_version: int) -> None:
        if self.version() != expected_version:
            raise OffPolicyError(f"weight buffer holds version {self.version()}, expected {expected_version}")
        if not self.aliased:
            for param, view in zip(model.parameters(), self.views()):
                param.copy_(view, non_blocking=True)


# --- where rollouts come from ---
class SyncRollouts:
    """Generate the whole iteration in this process, then hand the messages over.

    `sampler` is the model that generates: the policy itself when it computes in its own dtype, else a
    copy in the compute dtype that `publish` refreshes, as the inference process's weights are in async
    mode (so that both modes sample from the same bf16 weights).
    """

    def __init__(self, policy, tokenizer, train, held_out, reward_fn, settings: Settings, sampler=None):
        self.args = (tokenizer, train, held_out, reward_fn, settings)
        self.sampler = sampler if sampler is not None else policy

    @torch.no_grad()
    def publish(self, policy, version: int) -> None:
        if self.sampler is not policy:
            for target, source in zip(self.sampler.parameters(), policy.parameters(), strict=True):
                target.copy_(source)  # casts to the sampler's dtype
        self.version = version

    def messages(self, iteration: int, final_iteration: int, train_prompts: bool = True):
        self.sampler.eval()
        tokenizer, train, held_out, reward_fn, settings = self.args
        messages = []  # the whole iteration first: nothing overlaps in sync mode
        rollout_iteration(self.sampler, tokenizer, train, held_out, reward_fn, settings, iteration, self.version,
                          final_iteration, messages.append, train_prompts)
        yield from messages

    def close(self) -> None:
        pass


class AsyncRollouts:
    """The inference process, its two queues and the shared weight buffer, seen from the trainer.

    Start it as early as possible: it imports its libraries while the trainer imports its own, and
    loads its model while the trainer loads the policy. `load=False` makes it wait after its imports
    until `load()` (for a model the trainer must build first); `attach(policy)` hands over the
    weight buffer and waits until the inference side is ready.
    """

    def __init__(self, model_name: str, load_kwargs: dict, train, held_out, reward_spec: str,
                 timeline: Timeline | None = None, load: bool = True):
        context = mp.get_context("spawn")  # fork would copy the trainer's threads and CUDA state
        self.timeline = timeline or Timeline()
        self.dtype = load_kwargs.get("dtype")  # the inference side's weights, as published
        self.weights: WeightBuffer | None = None  # set by attach()
        self.loading = self.loaded = False
        self.commands, self.results = context.Queue(), context.Queue()
        self.process = context.Process(
            target=inference_process, name="periodic-rl-inference", daemon=True,
            args=(model_name, load_kwargs, self.commands, self.results, train, held_out, reward_spec))
        self.process.start()
        if load:
            self.load()

    def load(self) -> None:
        """Let the inference process load its model (once its imports are done). Idempotent."""
        if not self.loading:
            self.commands.put(("load",))
            self.loading = True

    def wait_until_loaded(self) -> None:
        """Block until the inference process has loaded its model (it answers ("loaded", None)). Idempotent."""
        self.load()
        if not self.loaded:
            self._receive()
            self.loaded = True

    def attach(self, policy, settings: Settings, threads: int) -> None:
        """Share θ's buffer with the inference process (as a handle to shared memory, never a copy), with
        the sampling settings and its thread count."""
        self.wait_until_loaded()
        self.weights = WeightBuffer(policy, self.dtype)  # kept alive here: the receiver maps the sender's memory
        self.commands.put(("attach", self.weights, settings, threads))
        self._receive()  # ("ready", None) once its model reads θ from the buffer

    def publish(self, policy, version: int) -> None:
        with self.timeline.span(f"publish θ_{version}"):
            self.weights.publish(policy, version)

    def messages(self, iteration: int, final_iteration: int, train_prompts: bool = True):
        self.commands.put(("generate" if train_prompts else "evaluate", iteration, final_iteration))
        while True:
            message = self._receive()
            yield message
            if isinstance(message, IterationDone):
                return

    def _receive(self):
        """Next message from the inference process; raises PipelineError if it failed or died."""
        start = time.perf_counter()
        try:
            while True:
                try:
                    kind, payload = self.results.get(timeout=POLL_SECONDS)
                    break
                except queue.Empty:
                    if not self.process.is_alive():
                        raise PipelineError(
                            f"the inference process died (exit code {self.process.exitcode}) without reporting "
                            "an error; it was probably killed (out of memory, or a signal)") from None
        finally:
            self.timeline.add(Span("wait for rollouts", TRAINING, start, time.perf_counter(), wait=True))
        if kind == "error":
            raise PipelineError(f"the inference process failed: {payload.strip()}")
        return payload

    def close(self) -> None:
        """Stop the inference process: politely, then by force. Never leaves it running. Idempotent."""
        if self.process.is_alive() and self.weights is not None:  # before attach it may still be loading
            self.commands.put(("stop",))
            self.process.join(timeout=3)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        for q in (self.commands, self.results):
            q.cancel_join_thread()
            q.close()


# --- the training side ---
def minibatch_of(prompt_index: int, prompts_per_iteration: int, updates_per_iteration: int) -> int:
    """Mini-batch of a group: contiguous blocks of prompt indices, independent of arrival order."""
    return prompt_index * updates_per_iteration // prompts_per_iteration


def group_tokens(groups: list[Group]) -> int:
    """Tokens a micro-batch's forward processes, counted as plain rows: G·P + Σ R_i per group."""
    return sum(len(g.responses) * len(g.prompt_ids) + sum(len(r) for r in g.responses) for g in groups)


class Learner:
    """Consumes one iteration's groups in arrival order: forward/backward in micro-batches, an optimizer
    step per mini-batch.

    A micro-batch is the waiting groups of the current mini-batch, in arrival order, up to
    `micro_batch_tokens`. Groups wait until that many tokens are there, or until nothing more will
    come soon: their generate call (chunk) has delivered every group, or the mini-batch is complete.
    Arrival order is completion order, which depends only on the sampled tokens, so the micro-batches
    (and hence the float rounding of the accumulated gradient) are the same in both modes and in
    every rerun. Statistics stay on the device until `metrics`: no host synchronisation per group.
    """

    def __init__(self, tri_model: TriModel, optimizer: torch.optim.Optimizer, cfg, device: torch.device,
                 timeline: Timeline):
        self.tri, self.optimizer, self.cfg, self.device, self.timeline = tri_model, optimizer, cfg, device, timeline
        self.groups_per_minibatch = cfg.prompts_per_iteration // cfg.updates_per_iteration

    def start(self, iteration: int) -> None:
        self.iteration, self.minibatch = iteration, 0
        updates = self.cfg.updates_per_iteration
        self.waiting: list[list[Group]] = [[] for _ in range(updates)]  # per mini-batch, in arrival order
        self.arrived = [0] * updates  # groups received, per mini-batch
        self.chunk_arrivals: dict[tuple[int, int], int] = {}
        self.sums = torch.zeros(4, device=self.device)  # loss, clipped tokens, KL sum, grad norm (device-side)
        self.tokens = 0  # response tokens of the iteration (known on the host from the lengths)
        self.minibatch_tokens = self.minibatch_sequences = 0
        self.minibatch_loss = torch.zeros((), device=self.device)  # partial sum, divided by its D at the step
        self.rewards: list[float] = []

    def add(self, group: Group) -> None:
        """Take one group; train whatever is ready."""
        if group.policy_version != self.iteration:
            raise OffPolicyError(f"group {group.index} was sampled by weights version {group.policy_version} "
                                 f"but this is iteration {self.iteration}: refusing an off-policy sample")
        block = minibatch_of(group.index, self.cfg.prompts_per_iteration, self.cfg.updates_per_iteration)
        self.waiting[block].append(group)
        self.arrived[block] += 1
        self.chunk_arrivals[group.chunk] = self.chunk_arrivals.get(group.chunk, 0) + 1
        while self.minibatch < self.cfg.updates_per_iteration:
            waiting = self.waiting[self.minibatch]
            complete = self.arrived[self.minibatch] == self.groups_per_minibatch
            while waiting and (complete or self._calls_done(waiting)
                               or group_tokens(waiting) >= self.cfg.micro_batch_tokens):
                size = sizing.micro_batch_size([group_tokens([g]) for g in waiting], self.cfg.micro_batch_tokens)
                self._accumulate(waiting[:size])
                del waiting[:size]
            if not complete:
                return
            self._step()

    def _calls_done(self, groups: list[Group]) -> bool:
        """Whether the generate calls that sampled `groups` have sent all their groups (none is coming soon)."""
        return all(self.chunk_arrivals[g.chunk] == g.chunk[1] for g in groups)

    def _accumulate(self, groups: list[Group]) -> None:
        """One forward/backward over a micro-batch of the current mini-batch."""
        name = f"train group {groups[0].index}" if len(groups) == 1 else f"train {len(groups)} groups"
        with self.timeline.span(name):
            batch = [(torch.tensor(g.prompt_ids, device=self.device),                  # (P,)
                      [torch.tensor(r, device=self.device) for r in g.responses])      # G x (R_i,)
                     for g in groups]
            logp, old_logp, ref_logp, mask = self.tri(batch)  # (n·G, T) each, groups in order
            advantages = torch.tensor([a for g in groups for a in g.advantages], device=self.device,
                                      dtype=logp.dtype)  # (n·G,)
            loss, stats = grpo_loss(logp, old_logp, ref_logp, advantages, mask, beta=self.cfg.beta,
                                    epsilon_low=self.cfg.epsilon_low, epsilon_high=self.cfg.epsilon_high,
                                    loss_type=self.cfg.loss_type, max_new_tokens=self.cfg.max_new_tokens,
                                    kl_bias_correction=self.cfg.kl_bias_correction,
                                    normalizer=1.0)  # a partial sum; divided by D at the step
            loss.backward()
        self.minibatch_loss += loss.detach()
        self.sums[1:3] += torch.stack([stats["clipped_tokens"], stats["kl_sum"]])
        tokens = sum(len(r) for g in groups for r in g.responses)
        self.minibatch_tokens += tokens
        self.tokens += tokens
        for g in groups:
            self.minibatch_sequences += len(g.responses)
            self.rewards += g.rewards

    def _step(self) -> None:
        with self.timeline.span(f"optimizer step {self.minibatch}"):
            normalizer = loss_normalizer(self.cfg.loss_type, self.minibatch_sequences, self.minibatch_tokens)
            params = [p for p in self.tri.policy.parameters() if p.grad is not None]
            for p in params:
                p.grad.div_(normalizer)
            if self.cfg.max_grad_norm > 0:
                self.sums[3] += torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.sums[0] += self.minibatch_loss / normalizer  # this mini-batch's loss, as optimised
        self.minibatch += 1
        self.minibatch_tokens = self.minibatch_sequences = 0
        self.minibatch_loss = torch.zeros((), device=self.device)

    def metrics(self) -> dict[str, float]:
        if self.minibatch != self.cfg.updates_per_iteration:
            raise PipelineError(f"iteration {self.iteration} ended after {self.minibatch} of "
                                f"{self.cfg.updates_per_iteration} optimizer steps: groups are missing")
        rewards = torch.tensor(self.rewards)
        loss, clipped, kl_sum, grad_norm = self.sums.tolist()  # the iteration's one host synchronisation
        tokens = max(self.tokens, 1)
        return {
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "loss": loss / self.cfg.updates_per_iteration,  # mean over the mini-batches
            "kl": kl_sum / tokens if self.cfg.beta > 0 else None,
            "clip_fraction": clipped / tokens,
            "grad_norm": grad_norm / self.cfg.updates_per_iteration,
            "response_length": self.tokens / len(self.rewards),
            "response_tokens": self.tokens,
        }


# --- the loop ---
def settings_of(cfg) -> Settings:
    """What the inference side needs from the config."""
    return Settings(seed=cfg.seed, group_size=cfg.group_size, prompts_per_iteration=cfg.prompts_per_iteration,
                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                    eval_every=cfg.eval_every, eval_samples=cfg.eval_samples, scale_rewards=cfg.scale_rewards,
                    groups_per_chunk=cfg.groups_per_chunk)


def takes_turns(cfg) -> bool:
    """Whether the two sides must not compute at once: async on CPU with more threads than cores (the probe's
    "in turns", sync's schedule in two processes). Oversubscribed cores slow both sides, so the trainer then
    takes the inference side's whole iteration, held-out evaluation included, before it computes."""
    on_cpu = cfg.rollout_device.startswith("cpu") and cfg.train_device.startswith("cpu")
    return on_cpu and cfg.rollout_threads + cfg.train_threads > (os.cpu_count() or 1)


def start_inference(cfg, load_kwargs: dict, train_examples, held_out, load: bool = True) -> AsyncRollouts:
    """Spawn the inference process for `cfg` (it loads its model at once, unless load=False)."""
    return AsyncRollouts(cfg.model, load_kwargs, train_examples, held_out, cfg.reward, load=load)


def train(cfg, policy, tokenizer, train_examples, held_out, reward_fn, load_kwargs: dict,
          rollouts: AsyncRollouts | None = None) -> Iterator[dict]:
    """Run cfg.iterations iterations and yield one metrics dict per iteration, then a final evaluation.

    `policy` is already on cfg.train_device; `load_kwargs` tells the inference process how to load
    its own copy (async mode), unless `rollouts` is an inference process already started. The last
    yielded dict has `"final": True` and only the evaluation.
    """
    device = next(policy.parameters()).device
    compute_dtype = getattr(torch, cfg.dtype)
    load_kwargs = {**load_kwargs, "dtype": compute_dtype}  # the inference side's weights: the compute dtype
    if cfg.gradient_checkpointing:  # the policy's layers recompute activations in backward (training mode only)
        enable_activation_checkpointing(policy)
    tri = TriModel(policy, use_reference=cfg.beta > 0, use_old=cfg.updates_per_iteration > 1,
                   packing="auto" if cfg.shared_prompt else "unpacked", temperature=cfg.temperature,
                   pad_id=tokenizer.pad_token_id, compute_dtype=compute_dtype)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if rollouts is not None and not cfg.sized:
        rollouts.wait_until_loaded()  # the probe times this machine's cores, not the inference side's loading
    cfg, probed, _ = sizing.choose(cfg, tri, tokenizer, train_examples, settings_of(cfg))  # sizes left open
    print(f"periodic-rl: sizes: --groups-per-chunk {cfg.groups_per_chunk} ({cfg.chunks_per_iteration} generate "
          f"call(s) per iteration) --micro-batch-tokens {cfg.micro_batch_tokens} --rollout-threads "
          f"{cfg.rollout_threads} --train-threads {cfg.train_threads} (pass these to fix them)"
          + (f"\nperiodic-rl: {probed}" if probed else ""), flush=True)
    torch.set_num_threads(cfg.train_threads)
    if cfg.mode == "async":
        rollouts = rollouts or start_inference(cfg, load_kwargs, train_examples, held_out)
        timeline = rollouts.timeline  # both processes' spans on one timeline
    else:
        sampler = None
        if compute_dtype != policy.dtype:  # sample from weights in the compute dtype, as the async side does
            from models import load_model
            sampler, _ = load_model(cfg.model, **{**load_kwargs, "device": str(device)})
        rollouts = SyncRollouts(policy, tokenizer, train_examples, held_out, reward_fn, settings_of(cfg), sampler)
        timeline = Timeline()
    learner = Learner(tri, optimizer, cfg, device, timeline)
    in_turns = cfg.mode == "async" and takes_turns(cfg)
    try:
        if cfg.mode == "async":
            rollouts.attach(policy, settings_of(cfg), cfg.rollout_threads)
        for iteration in range(cfg.iterations + 1):
            final = iteration == cfg.iterations  # one more round that only evaluates θ_final
            start, first_span = time.perf_counter(), len(timeline.spans)
            rollouts.publish(policy, iteration)
            tri.start_iteration()
            learner.start(iteration)
            evaluation = None
            messages = rollouts.messages(iteration, cfg.iterations, train_prompts=not final)
            if in_turns:  # the inference side's whole iteration first, then training: each side on every core
                messages = list(messages)
            for message in messages:
                if isinstance(message, Group):
                    policy.train()
                    learner.add(message)
                elif isinstance(message, Evaluation):
                    timeline.add(Span("evaluate", INFERENCE, message.start, message.end))
                    evaluation = message.reward
                elif isinstance(message, Span):
                    timeline.add(message)
            row = {"iteration": iteration, "policy_version": iteration, "eval_reward": evaluation}
            if final:
                yield {**row, "final": True}
                return
            row.update(learner.metrics())
            row.update(timeline.summary(start, time.perf_counter(), first_span))
            row["tokens_per_s"] = row.pop("response_tokens") / row["iteration_s"]
            if not all(math.isfinite(v) for v in row.values() if isinstance(v, float)):
                raise PipelineError(f"iteration {iteration} produced a non-finite metric: {row}")
            yield row
    finally:
        rollouts.close()
        if cfg.trace:
            timeline.write_chrome_trace(cfg.trace)
