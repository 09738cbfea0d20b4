"""The iteration schedule: periodic asynchrony (async) and its synchronous baseline (sync).

Periodic asynchrony (arXiv 2511.18871, Fig. 2), iteration k (`train`, line for line):

    trainer                                   inference process (inference.py)
    ------------------------------------      ------------------------------------------
    publish θ_k -> shared-memory buffer  ->   load θ_k (CPU: its parameters *are* views
    generate(k): send ("generate", k)           of the buffer, so nothing is copied)
                                              for each chunk of C prompts: one generate call;
                                                each group pushed the step its last
                                                response stops (completion order)
    for each group as it arrives:        <-   ... (generation continues meanwhile)
        forward, backward the micro-batches   evaluate θ_k on held-out prompts (if due)
        that are ready (accumulate ∇)
        optimizer step once a mini-batch is complete
                                         <-   IterationDone(k): θ_k no longer read
    publish θ_{k+1} ...

The barrier is the publish: the inference process never samples iteration k+1 before θ_{k+1}
exists, and the trainer rejects any group whose `policy_version` is not k (the version of the
weights that sampled it, read from the buffer: inference.py). Hence every sample of iteration k
comes from θ_k: the method is strictly on-policy. And the update equals the synchronous one,
because with one optimizer step per iteration

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

Trainer ranks (`torchrun`, distributed.py): each rank runs this loop for its own generate calls, with its
own inference process; each step sums ∇ and D over the ranks, so it is the same step (docs/distributed.md).

Departures, on purpose:
1. The held-out evaluation runs in the inference process after the iteration's groups, so it
   overlaps the training tail instead of stalling the trainer; except when the sides take turns
   (`takes_turns`: more CPU threads than cores), where overlapping would only slow both.
2. θ_final (after the last iteration) is published once more, for the final evaluation only.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Iterator

import torch

import checkpoint
import distributed
import outputs
import sizing
from distributed import Ranks
from grpo import grpo_loss, loss_normalizer
from inference import AsyncRollouts, PipelineError, SyncRollouts
from packing import enable_activation_checkpointing, logprobs_fn
from reward import as_rewards
from rollout import Evaluation, Group
from timeline import INFERENCE, Span, Timeline
from tri_model import TriModel
from weights import OffPolicyError


# --- the training side ---
def minibatch_of(prompt_index: int, prompts_per_iteration: int, updates_per_iteration: int) -> int:
    """Mini-batch of a group: contiguous blocks of prompt indices, independent of arrival order."""
    return prompt_index * updates_per_iteration // prompts_per_iteration


def group_tokens(groups: list[Group]) -> int:
    """Tokens a micro-batch's forward processes, counted as plain rows: G·P + Σ R_i per group."""
    return sum(len(g.responses) * len(g.prompt_ids) + sum(len(r) for r in g.responses) for g in groups)


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample std of the values that are not NaN (a response no reward scored); None where undefined."""
    scored = torch.tensor([value for value in values if not math.isnan(value)])  # (n,)
    return scored.mean().item() if len(scored) else None, scored.std().item() if len(scored) > 1 else None


class Learner:
    """Consumes one iteration's groups in arrival order: forward/backward in micro-batches, an optimizer
    step per mini-batch.

    A micro-batch is the waiting groups of the current mini-batch, in arrival order, up to
    `micro_batch_tokens`. Groups wait until that many tokens are there, or until nothing more will
    come soon: their generate call (chunk) has delivered every group, or the mini-batch is complete.
    Arrival order is completion order, which depends only on the sampled tokens, so the micro-batches
    (and hence the float rounding of the accumulated gradient) are the same in both modes and in
    every rerun. Statistics stay on the device until `metrics`: no host synchronisation per group.

    With trainer ranks (distributed.py) it takes only its rank's groups, so a mini-batch may hold none
    of them: `ready` then yields an empty micro-batch, and the rank still joins the step's all-reduce.
    `reward_names` label each reward's own statistics (`rewards/<name>/mean`, TRL's names).
    """

    def __init__(self, tri_model: TriModel, optimizer: torch.optim.Optimizer, cfg, device: torch.device,
                 timeline: Timeline, ranks: Ranks = Ranks(), reward_names: list[str] = ()):
        self.tri, self.optimizer, self.cfg, self.device, self.timeline = tri_model, optimizer, cfg, device, timeline
        self.ranks, self.reward_names = ranks, list(reward_names)
        prompts, updates = cfg.prompts_per_iteration, cfg.updates_per_iteration
        self.groups_per_minibatch = [0] * updates  # this rank's groups in each mini-batch
        for index in range(prompts):
            if distributed.owner(index // cfg.groups_per_chunk, ranks.size) == ranks.rank:
                self.groups_per_minibatch[minibatch_of(index, prompts, updates)] += 1
        self.iteration, self.minibatch, self.stepping = None, 0, False

    def start(self, iteration: int) -> None:
        self.iteration, self.minibatch = iteration, 0
        updates = self.cfg.updates_per_iteration
        self.waiting: list[list[Group]] = [[] for _ in range(updates)]  # per mini-batch, in arrival order
        self.arrived = [0] * updates  # groups received, per mini-batch
        self.chunk_arrivals: dict[tuple[int, int], int] = {}
        self.loss_sum, self.clipped_tokens, self.kl_sum, self.grad_norm_sum = (  # running sums, kept on the
            torch.zeros((), device=self.device) for _ in range(4))           # device until `metrics`
        self.tokens = 0  # response tokens of the iteration (known on the host from the lengths)
        self.minibatch_tokens = self.minibatch_sequences = 0
        self.minibatch_loss = torch.zeros((), device=self.device)  # partial sum, divided by its D at the step
        self.rewards: dict[int, tuple] = {}  # by group index: (weighted sums, [reward k][response]); metrics in
        # index order, whatever the arrival

    def take(self, group: Group) -> None:
        """Take one group, refused unless θ_k sampled it (nothing is trained here: see `ready`)."""
        if group.policy_version != self.iteration:
            changed = " (weights that changed while it was sampled)" if group.policy_version == -1 else ""
            raise OffPolicyError(f"group {group.index} was sampled by weights version {group.policy_version}"
                                 f"{changed} but this is iteration {self.iteration}: refusing an off-policy sample")
        if (owner := distributed.owner(group.index // self.cfg.groups_per_chunk, self.ranks.size)) != self.ranks.rank:
            raise PipelineError(f"group {group.index} belongs to trainer rank {owner}, not rank {self.ranks.rank}")
        block = minibatch_of(group.index, self.cfg.prompts_per_iteration, self.cfg.updates_per_iteration)
        self.waiting[block].append(group)
        self.arrived[block] += 1
        self.chunk_arrivals[group.chunk] = self.chunk_arrivals.get(group.chunk, 0) + 1

    def ready(self) -> Iterator[list[Group]]:
        """The micro-batches that can train now: the current mini-batch's waiting groups, in arrival order,
        once they reach `micro_batch_tokens` or nothing more will come soon (their generate calls have
        ended, or the mini-batch is complete). Call `step` inside the loop as soon as `minibatch_done()`:
        the next mini-batch's waiting groups follow only after it (with N > 1 updates per iteration)."""
        while self.minibatch < self.cfg.updates_per_iteration:
            waiting = self.waiting[self.minibatch]
            if self.groups_per_minibatch[self.minibatch] == 0:  # none of this rank's groups: an empty micro-batch,
                yield []                                         # and the caller steps (the all-reduce) at once
                continue
            if not waiting or not (self._all_arrived() or self._calls_done(waiting)
                                   or group_tokens(waiting) >= self.cfg.micro_batch_tokens):
                return
            size = sizing.micro_batch_size([group_tokens([g]) for g in waiting], self.cfg.micro_batch_tokens)
            micro_batch = waiting[:size]
            del waiting[:size]
            yield micro_batch

    def minibatch_done(self) -> bool:
        """Every group of the current mini-batch has arrived and been trained: time for its optimizer step."""
        return self.minibatch < self.cfg.updates_per_iteration and self._all_arrived() and not self.waiting[self.minibatch]

    def _all_arrived(self) -> bool:
        return self.arrived[self.minibatch] == self.groups_per_minibatch[self.minibatch]

    def _calls_done(self, groups: list[Group]) -> bool:
        """Whether the generate calls that sampled `groups` have sent all their groups (none is coming soon)."""
        return all(self.chunk_arrivals[g.chunk] == g.chunk[1] for g in groups)  # chunk: (first prompt, prompts)

    def accumulate(self, groups: list[Group]) -> None:
        """One forward/backward over a micro-batch of the current mini-batch: ∇ += Σ_g ∇S_g (divided by D
        at the step). An empty micro-batch (another rank's groups only) computes nothing."""
        if not groups:
            return
        self.tri.policy.train()
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
        self.clipped_tokens += stats["clipped_tokens"]
        self.kl_sum += stats["kl_sum"]
        tokens = sum(len(r) for g in groups for r in g.responses)
        self.minibatch_tokens += tokens
        self.tokens += tokens
        for g in groups:
            self.minibatch_sequences += len(g.responses)
            self.rewards[g.index] = (g.rewards, g.rewards_per_function)

    def step(self) -> None:
        """The current mini-batch's optimizer step: ∇ /= D, clip, AdamW. With ranks, ∇, D's counts and the loss
        are first summed over the ranks (distributed.py): the same step on every rank."""
        self.stepping = True
        with self.timeline.span(f"optimizer step {self.minibatch}"):
            sequences, tokens, minibatch_loss = self.minibatch_sequences, self.minibatch_tokens, self.minibatch_loss
            if self.ranks.size > 1:
                params = distributed.sum_gradients(  # ∇ = Σ_r ∇_r
                    [p for p in self.tri.policy.parameters() if p.requires_grad], self.ranks)
                sequences, tokens, minibatch_loss = distributed.sum_values(
                    [sequences, tokens, minibatch_loss], self.ranks, self.device)
            else:
                params = [p for p in self.tri.policy.parameters() if p.grad is not None]
            normalizer = loss_normalizer(self.cfg.loss_type, int(sequences), int(tokens))
            for p in params:
                p.grad.div_(normalizer)  # = each micro-batch's loss / D (nanoGPT: loss / accumulation steps), but D
                # (the mini-batch's tokens or sequences) is known only once all its groups have arrived
            if self.cfg.max_grad_norm > 0:
                self.grad_norm_sum += torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.loss_sum += minibatch_loss / normalizer  # this mini-batch's loss, as optimised
        self.minibatch += 1
        self.minibatch_tokens = self.minibatch_sequences = 0
        self.minibatch_loss = torch.zeros((), device=self.device)
        self.stepping = False

    def iterations_done(self) -> int | None:
        """How many iterations the weights and AdamW's state hold exactly, or None half-way through an
        iteration's steps (or inside one): what a checkpoint written now can claim."""
        if self.iteration is None or self.stepping:
            return None
        if self.minibatch == 0:
            return self.iteration
        return self.iteration + 1 if self.minibatch == self.cfg.updates_per_iteration else None

    def metrics(self) -> dict[str, float]:
        if self.minibatch != self.cfg.updates_per_iteration:
            raise PipelineError(f"iteration {self.iteration} ended after {self.minibatch} of "
                                f"{self.cfg.updates_per_iteration} optimizer steps: groups are missing")
        loss, clipped, kl_sum, grad_norm = torch.stack(  # the iteration's one host synchronisation
            [self.loss_sum, self.clipped_tokens, self.kl_sum, self.grad_norm_sum]).tolist()
        all_tokens, by_group = self.tokens, self.rewards
        if self.ranks.size > 1:  # the whole iteration's (loss and grad_norm are already every rank's, from `step`)
            clipped, kl_sum, all_tokens = distributed.sum_values([clipped, kl_sum, all_tokens], self.ranks, self.device)
            by_group = distributed.gather_dicts(self.rewards, self.ranks)
        ordered = [by_group[index] for index in sorted(by_group)]  # (weighted sums, per reward) of each group
        reward_mean, reward_std = mean_std([r for total, _ in ordered for r in total])
        per_function = {}
        for k, name in enumerate(self.reward_names):
            per_function[f"rewards/{name}/mean"], per_function[f"rewards/{name}/std"] = mean_std(
                [r for _, parts in ordered for r in parts[k]])
        self.all_tokens = all_tokens  # response tokens of the iteration, every rank's
        tokens = max(all_tokens, 1)
        return {
            "reward_mean": reward_mean,  # of the weighted sum
            "reward_std": reward_std,
            **per_function,
            "loss": loss / self.cfg.updates_per_iteration,  # mean over the mini-batches
            "kl": kl_sum / tokens if self.cfg.beta > 0 else None,
            "clip_fraction": clipped / tokens,
            "grad_norm": grad_norm / self.cfg.updates_per_iteration,
            "response_length": all_tokens / sum(len(total) for total, _ in ordered),
        }


# --- the loop ---
def held_out_reward(evaluation: Evaluation, iteration: int) -> float:
    """The evaluation's reward, if it is θ_k's (the version its weights read throughout, as for a group)."""
    if evaluation.policy_version != iteration:
        raise OffPolicyError(f"the held-out evaluation of iteration {iteration} ran on weights version "
                             f"{evaluation.policy_version}, not θ_{iteration} (-1: they changed while it ran)")
    return evaluation.reward


def build_tri_model(cfg, policy, pad_id: int) -> TriModel:
    """θ as trained, with θ_old and π_ref when the run needs them, scored by packing.py's shared-prompt rows."""
    logprobs = logprobs_fn(policy, "auto" if cfg.shared_prompt else "unpacked", cfg.temperature, pad_id)
    return TriModel(policy, logprobs, use_reference=cfg.beta > 0, use_old=cfg.updates_per_iteration > 1,
                    compute_dtype=getattr(torch, cfg.dtype))


def takes_turns(cfg) -> bool:
    """Whether the two sides must not compute at once: async on CPU with more threads than cores (the probe's
    "in turns", sync's schedule in two processes). Oversubscribed cores slow both sides, so the trainer then
    takes the inference side's whole iteration, held-out evaluation included, before it computes."""
    on_cpu = cfg.rollout_device.startswith("cpu") and cfg.train_device.startswith("cpu")
    rollout_threads = max(cfg.rollout_threads, cfg.inference_workers)  # each worker has at least one
    return on_cpu and rollout_threads + cfg.train_threads > (os.cpu_count() or 1)


def inference_side(cfg, load_kwargs: dict, train_examples, held_out, load: bool = True, ranks: Ranks = Ranks()):
    """A `with` block owning the inference process from spawn to stop (async mode; it loads its model at once
    unless load=False; it samples this rank's generate calls); in sync mode there is none (None)."""
    if cfg.mode != "async":
        return contextlib.nullcontext()
    load_kwargs = {**load_kwargs, "dtype": getattr(torch, cfg.dtype)}  # its weights: the compute dtype
    return AsyncRollouts(cfg.model, load_kwargs, train_examples, held_out, cfg.reward, load=load,
                         workers=cfg.inference_workers, share=ranks.share, reward_weights=cfg.reward_weights)


def record(timeline: Timeline, message) -> None:
    """Put the inference side's spans (a generate call, loading θ_k, an evaluation) on the trainer's timeline."""
    if isinstance(message, Span):
        timeline.add(message)
    elif isinstance(message, Evaluation):
        timeline.add(Span("evaluate", INFERENCE, message.start, message.end))


def train(cfg, policy, tokenizer, train_examples, held_out, rewards, load_kwargs: dict,
          rollouts: AsyncRollouts | None = None, resume_from: Path | None = None, on_sized=None,
          ranks: Ranks = Ranks()) -> Iterator[dict]:
    """Run cfg.iterations iterations and yield one metrics dict per iteration, then the final evaluation.

    `policy` is already on cfg.train_device, at θ_0. Async mode samples in `rollouts`, the inference
    process (`inference_side`; the caller owns it, and loads the rewards there); sync mode samples here, scored by
    `rewards` (reward.load_rewards; their names label the metrics in both modes), with a copy of the policy in
    the compute dtype if it differs (`load_kwargs` says how to load it). The last yielded dict has
    `"final": True` and only the evaluation of θ_final. `resume_from`: a checkpoint (checkpoint.py) whose
    θ_k and optimizer state replace θ_0's after the reference is taken; the run goes on at iteration k.
    `on_sized(cfg)`: told the config with its sizes once they are chosen, before iteration k (trainer.py records it).
    `ranks`: this process's trainer rank (distributed.py): it samples and trains only its generate calls.
    """
    if cfg.mode == "async" and rollouts is None:
        raise ValueError("async mode samples in the inference process: pass `rollouts` (see inference_side)")
    # the policy as trained (θ, with θ_old and π_ref when needed) and AdamW
    device = next(policy.parameters()).device
    if cfg.gradient_checkpointing:  # the policy's layers recompute activations in backward (training mode only)
        enable_activation_checkpointing(policy)
    tri = build_tri_model(cfg, policy, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # a long run's checkpoints: θ_k and AdamW's state, tied to θ_0 (the reference) by its fingerprint
    keeps_checkpoints = bool(cfg.save_every or cfg.save_on_stop or resume_from)
    theta_0 = checkpoint.fingerprint(policy) if keeps_checkpoints else ""
    first = checkpoint.restore(resume_from, policy, optimizer, theta_0) if resume_from else 0

    def save_checkpoint(iterations_done: int) -> None:
        with timeline.span(f"checkpoint {iterations_done}"):
            checkpoint.save(cfg.out, iterations_done, policy, tokenizer, optimizer, cfg, theta_0, cfg.keep_checkpoints)
    # sizes left open: measured (--sizes probe) or by rule (sizing.py)
    if rollouts is not None and not cfg.sized:
        rollouts.wait_until_loaded()  # the probe times this machine's cores, not the inference side's loading
    cfg, probed, _ = sizing.choose(cfg, tri, tokenizer, train_examples)  # sizes left open
    print(f"periodic-rl: sizes: --groups-per-chunk {cfg.groups_per_chunk} ({cfg.chunks_per_iteration} generate "
          f"call(s) per iteration) --micro-batch-tokens {cfg.micro_batch_tokens} --rollout-threads "
          f"{cfg.rollout_threads} --train-threads {cfg.train_threads} (pass these to fix them)"
          + (f"\nperiodic-rl: {probed}" if probed else ""), flush=True)
    if on_sized is not None:
        on_sized(cfg)
    # the sampling side: the inference process (async) or a sampler here (sync)
    torch.set_num_threads(cfg.train_threads)
    if rollouts is not None:
        rollouts.attach(policy, cfg, cfg.rollout_threads)  # θ's buffer, the config, its threads
        timeline = rollouts.timeline  # both processes' spans on one timeline
    else:
        sampler = None
        if tri.compute_dtype != policy.dtype:  # sample from weights in the compute dtype, as the async side does
            from models import load_model
            sampler, _ = load_model(cfg.model, **{**load_kwargs, "dtype": tri.compute_dtype, "device": str(device)})
        rollouts = SyncRollouts(policy, tokenizer, train_examples, held_out, rewards, cfg, sampler,
                                workers=cfg.inference_workers, share=ranks.share)  # the shares, one after another
        timeline = Timeline()
    learner = Learner(tri, optimizer, cfg, device, timeline, ranks, as_rewards(rewards).names)
    in_turns = cfg.mode == "async" and takes_turns(cfg)
    logged = first  # iterations whose row is out
    try:  # the iterations, as in the module docstring's figure
        for iteration in range(first, cfg.iterations):
            start, first_span = time.perf_counter(), len(timeline.spans)
            tri.start_iteration()                                 # θ_old := θ_k (when N > 1 updates)
            learner.start(iteration)
            rollouts.publish(policy, iteration)                   # θ_k -> the inference side
            rollouts.generate(iteration, final_iteration=cfg.iterations)  # sample iteration k with θ_k (async: returns at once)
            messages = rollouts.receive()                         # groups in completion order, then IterationDone
            if in_turns:  # the inference side's whole iteration first, then training: each side on every core
                messages = list(messages)
            evaluation = None
            for message in messages:
                record(timeline, message)
                if isinstance(message, Group):
                    learner.take(message)
                elif isinstance(message, Evaluation):             # held-out reward of θ_k (if due)
                    evaluation = held_out_reward(message, iteration)
                for micro_batch in learner.ready():               # (with ranks: [] if none is this rank's)
                    learner.accumulate(micro_batch)               # forward, backward: ∇ accumulates
                    if learner.minibatch_done():
                        learner.step()                            # optimizer step, one per mini-batch
            timing = timeline.summary(start, time.perf_counter(), first_span)
            row = {"iteration": iteration, "policy_version": iteration, "eval_reward": evaluation, **learner.metrics(),
                   **timing, "tokens_per_s": learner.all_tokens / timing["iteration_s"]}
            if not all(math.isfinite(v) for v in row.values() if isinstance(v, float)):
                raise PipelineError(f"iteration {iteration} produced a non-finite metric: {row}")
            logged = iteration + 1
            yield row
            if cfg.save_every and (iteration + 1) % cfg.save_every == 0:
                save_checkpoint(iteration + 1)                    # an exact resume point (after the row is out)
        if ranks.size > 1:
            distributed.check_same_weights(policy, ranks)         # every rank's θ_final: the same bits
        rollouts.publish(policy, cfg.iterations)                  # θ_final, for its evaluation only
        rollouts.generate(cfg.iterations, final_iteration=cfg.iterations, train_prompts=False)  # evaluation only
        evaluation = None
        for message in rollouts.receive():
            record(timeline, message)
            if isinstance(message, Evaluation):
                evaluation = held_out_reward(message, cfg.iterations)
        yield {"iteration": cfg.iterations, "policy_version": cfg.iterations, "final": True, "eval_reward": evaluation}
    except KeyboardInterrupt:  # a stop signal (trainer.py): keep the iterations done, if that state is exact
        done = learner.iterations_done()  # None half-way through an iteration's steps: not an exact state
        if (cfg.save_every or cfg.save_on_stop) and done == logged != first:  # and each iteration's row is out
            save_checkpoint(done)
        raise
    finally:
        if cfg.trace:
            with outputs.writing("the trace", cfg.trace):
                timeline.write_chrome_trace(cfg.trace)
