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

The trainer's column is `learner.Learner` (take, accumulate, step); this file is the loop around it.

Synchronous mode runs the same `rollout_iteration` in the trainer's process and only then trains:
same seeds, same groups, same gradients, no overlap.

Trainer ranks (`torchrun`, distributed.py): each rank runs this loop for its own generate calls, with its
own inference process; each step sums ∇ and D over the ranks, so it is the same step (docs/distributed.md).

Departures, on purpose:
1. The held-out evaluation runs in the inference process after the iteration's groups, so it
   overlaps the training tail instead of stalling the trainer; except when the sides take turns
   (`takes_turns`: more CPU threads than cores), where overlapping would only slow both.
2. θ_final (after the last iteration) is published once more, for the final evaluation only.
3. Elastic threads on CPU (`elastic_threads`): when the probe split the cores between the two sides, the
   trainer takes every core (--tail-threads) once the inference side is done with θ_k (every group in, the
   evaluation too if due), for the micro-batches still left and the step; back to its share at the next
   iteration. Which micro-batches train on all cores is fixed by arrival order: a rerun is the same run.
4. Colocated when taking turns (`colocated`): async on CPU whose sides would take turns (more threads than
   cores, one inference process: the toy's probe picks it on 2 cores) samples in the trainer's process, which is
   sync's schedule; a second process would overlap nothing and only add the hand-over.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Iterator

import torch

import checkpoint
import distributed
import outputs
import sizing
from config import available_cores
from distributed import Ranks
from inference import AsyncRollouts, PipelineError, SyncRollouts
from learner import Learner
from packing import enable_activation_checkpointing, logprobs_fn
from reward import as_rewards
from rollout import Evaluation, Group, is_eval_iteration
from timeline import INFERENCE, Span, Timeline
from tri_model import TriModel
from weights import OffPolicyError


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


def both_on_cpu(cfg) -> bool:
    """Whether sampling and training both run on CPU cores (the threads then compete)."""
    return cfg.rollout_device.startswith("cpu") and cfg.train_device.startswith("cpu")


def takes_turns(cfg) -> bool:
    """Whether the two sides must not compute at once: async on CPU with more threads than cores (the probe's
    "in turns", sync's schedule: in one process when `colocated`). Oversubscribed cores slow both sides, so the
    trainer then takes the inference side's whole iteration, held-out evaluation included, before it computes."""
    rollout_threads = max(cfg.rollout_threads, cfg.inference_workers)  # each worker has at least one
    return both_on_cpu(cfg) and rollout_threads + cfg.train_threads > available_cores()


def colocated(cfg, ranks: Ranks = Ranks()) -> bool:
    """Whether async mode samples in the trainer's own process: when the sides take turns (`takes_turns`) with
    one local inference process and one thread count for sampling, training and the tail, as the probe's "in
    turns" sets them (departure 4). Taking turns, the trainer waits for the inference side's whole iteration
    before it computes, so a second process overlaps nothing; it only adds the hand-over (publishing θ_k, a
    message per group through the pipe, one side's idle threads spinning into the other's turn), measured at
    0.97-1.01x sync's speed on the toy (docs/benchmarks.md). In one process the iteration is sync's schedule
    exactly: the same calls, groups, threads and bits. Needs the thread counts (after sizing)."""
    one_count = cfg.rollout_threads == cfg.train_threads == cfg.tail_threads  # else sampling would change threads
    return (cfg.mode == "async" and cfg.inference_workers == 1 and not ranks.inference and one_count
            and takes_turns(cfg))


def samples_elsewhere(cfg, ranks: Ranks = Ranks()) -> bool:
    """Whether the run needs an inference side outside this process: async mode, unless it is known (the sizes
    given) to take turns in one process (`colocated`); with sizes open, the probe decides after the start."""
    return cfg.mode == "async" and not (cfg.sized and colocated(cfg, ranks))


def elastic_threads(cfg, ranks: Ranks) -> int | None:
    """--tail-threads, when the trainer switches to it once sampling is done (departure 3), or None: async on
    CPU with one inference process, and more tail threads than its share (the probe sets every core when it
    splits them; given, as given; saved with the run, so a resumed run switches alike)."""
    single = ranks.size == 1 and not ranks.inference and cfg.inference_workers == 1
    switches = (cfg.mode == "async" and both_on_cpu(cfg) and single
                and cfg.tail_threads > cfg.train_threads)  # never fewer
    return cfg.tail_threads if switches else None


def inference_side(cfg, load_kwargs: dict, train_examples, held_out, load: bool = True, ranks: Ranks = Ranks()):
    """A `with` block owning the inference process from spawn to stop (async mode; it loads its model at once
    unless load=False; it samples this rank's generate calls), or, with inference ranks, the handle on them
    (remote.py); in sync mode there is none (None)."""
    if not samples_elsewhere(cfg, ranks):
        return contextlib.nullcontext()
    if ranks.inference:  # samplers of their own, over torch.distributed
        from remote import RemoteRollouts
        return RemoteRollouts(ranks, getattr(torch, cfg.dtype))
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
    if rollouts is None and samples_elsewhere(cfg, ranks):
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
    tail_threads = elastic_threads(cfg, ranks)  # the trainer's threads once sampling is done (departure 3), or None
    print(f"periodic-rl: sizes: --groups-per-chunk {cfg.groups_per_chunk} ({cfg.chunks_per_iteration} generate "
          f"call(s) per iteration) --micro-batch-tokens {cfg.micro_batch_tokens} --rollout-threads "
          f"{cfg.rollout_threads} --train-threads {cfg.train_threads} --tail-threads {cfg.tail_threads} (pass these "
          f"to fix them)"
          + (f"\nperiodic-rl: {probed}" if probed else ""), flush=True)
    if on_sized is not None:
        on_sized(cfg)
    # the sampling side: the inference process (async) or a sampler here (sync, and async taking turns)
    torch.set_num_threads(cfg.train_threads)
    if colocated(cfg, ranks):
        if rollouts is not None:  # started for the probe, which chose to take turns: nothing left for it to do
            rollouts.close()
        rollouts = None
        cores = available_cores()
        hint = (f" (--rollout-threads {cores // 2} --train-threads {cores - cores // 2} would run the two sides at "
                "once, in two processes)") if cores > 1 else ""
        print("periodic-rl: async at these sizes takes turns (more threads than cores): sampling in this process, "
              f"sync's schedule, no inference process{hint}", flush=True)
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
    in_turns = cfg.mode == "async" and takes_turns(cfg) and not ranks.inference  # N workers (inference ranks: hosts)
    logged = first  # iterations whose row is out
    try:  # the iterations, as in the module docstring's figure
        for iteration in range(first, cfg.iterations):
            start, first_span = time.perf_counter(), len(timeline.spans)
            evaluating = bool(held_out) and is_eval_iteration(iteration, cfg.eval_every, cfg.iterations)
            if tail_threads:
                torch.set_num_threads(cfg.train_threads)          # its share while the inference side samples
            tri.start_iteration()                                 # θ_old := θ_k (when N > 1 updates)
            learner.start(iteration)
            rollouts.publish(policy, iteration)                   # θ_k -> the inference side
            rollouts.generate(iteration, final_iteration=cfg.iterations)  # sample k with θ_k (async: returns at once)
            messages = rollouts.receive()                         # groups in completion order, then IterationDone
            if in_turns:  # the inference side's whole iteration first, then training: each side on every core
                messages = list(messages)
            evaluation = None
            for message in messages:
                record(timeline, message)
                if isinstance(message, Group):
                    learner.take(message)
                elif isinstance(message, Evaluation):             # held-out reward of θ_k (if due)
                    evaluation, evaluating = held_out_reward(message, iteration), False
                if tail_threads and learner.all_taken() and not evaluating:
                    torch.set_num_threads(tail_threads)           # sampling is done: every core trains the tail
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
