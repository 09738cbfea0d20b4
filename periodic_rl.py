"""The iteration schedule: periodic asynchrony (async) and its synchronous baseline (sync).

Periodic asynchrony (arXiv 2511.18871, Fig. 2), iteration k (`train`, line for line):

    trainer                                   inference process (inference.py)
    ------------------------------------      ------------------------------------------
    publish θ_k -> shared-memory buffer  ->   load θ_k (CPU: its parameters *are* views
    generate(k): send ("generate", k)           of the buffer, so nothing is copied)
                                              for each generate call of C prompts:
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
membership is fixed by prompt index (`learner.minibatch_of`), never by arrival order. Micro-batches
(which groups share a forward) are cut by arrival order, but arrival order is completion order, a
function of the sampled tokens alone: the two modes, and any rerun, batch the same groups together,
so with equal thread counts they are bitwise the same run (tests/method/test_pipeline.py). With μ passes over the
batch (TRL's num_iterations), passes 2..μ replay the first pass's micro-batches once all groups are in.

The trainer's column is `learner.Learner` (take, accumulate, step), the inference side's a `Rollouts` (publish,
generate, receive); sync mode runs the same `rollout.rollout_iteration` in this process, then trains
(`inference.SyncRollouts`). What the loop stands on is set up in launch/setup.py; trainer ranks (`torchrun`)
each run it for their own generate calls and sum ∇ at each step (docs/distributed.md).

Departures, on purpose:
1. The held-out evaluation runs on the inference side after the iteration's groups, so it overlaps
   the training after sampling instead of stalling the trainer (except where the sides sample then train on CPU).
2. θ_final (after the last iteration) is published once more, for the final evaluation only.
3. On CPU with the cores split between the sides, the trainer takes every core (`train_threads_after_sampling`)
   once the inference side is done with θ_k, for the micro-batches left and the step (fixed by arrival order: a
   rerun is the same run).
"""
from __future__ import annotations

import math
import time
from typing import Iterator, Protocol

import torch

from infra.distributed import Ranks, check_same_weights
from infra.errors import PipelineError
from infra.timeline import EVALUATE, INFERENCE, Span, Timeline
from learner import Learner
from rollout import Evaluation, Message, ScoredGroup, is_eval_iteration
from weights import OffPolicyError


class Rollouts(Protocol):
    """The inference side as the loop sees it: inference.SyncRollouts (sampling in this process, sync mode),
    inference.AsyncRollouts (inference processes on this host) and launch.remote.RemoteRollouts (inference ranks)."""

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        """Make the policy's weights now θ_version, the weights the next `generate` samples with."""

    def generate(self, iteration: int, train_prompts: bool = True) -> None:
        """Start sampling iteration k's prompts with θ_k (async: returns at once); train_prompts=False: only the
        held-out evaluation, if due (θ_final's)."""

    def receive(self) -> Iterator[Message]:
        """Iteration k's messages as they come: its ScoredGroups (in one sampler's call order, each call's in
        completion order), the generate calls' spans, the evaluation if due, and IterationDone(k) last."""


def held_out_reward(evaluation: Evaluation, iteration: int) -> float:
    """The evaluation's reward, if it is θ_k's (the version its weights read throughout, as for a group)."""
    if evaluation.policy_version != iteration:
        raise OffPolicyError(f"the held-out evaluation of iteration {iteration} ran on weights version "
                             f"{evaluation.policy_version}, not θ_{iteration} (-1: they changed while it ran)")
    return evaluation.reward


def record(timeline: Timeline, message) -> None:
    """Put the inference side's spans (a generate call, loading θ_k, an evaluation) on the trainer's timeline."""
    if isinstance(message, Span):
        timeline.add(message)
    elif isinstance(message, Evaluation):
        timeline.add(Span(EVALUATE, INFERENCE, message.start, message.end))


def iteration_row(iteration: int, evaluation: float | None, learner: Learner, timeline: Timeline, start: float,
                  first_span: int) -> dict:
    """Iteration k's metrics: the held-out reward of θ_k (None if not due or not come), the learner's, the timings."""
    timing = timeline.summary(start, time.perf_counter(), first_span)
    metrics = learner.metrics()
    tokens = metrics.pop("response_tokens")                   # sampled and trained on, every rank's
    row = {"iteration": iteration, "policy_version": iteration, "eval_reward": evaluation, **metrics, **timing,
           "tokens_per_s": tokens / timing["iteration_s"]}
    bad = [f"{name} {value}" for name, value in row.items() if isinstance(value, float) and not math.isfinite(value)]
    if bad:
        raise PipelineError(f"iteration {iteration}: {', '.join(bad)}: the update overflowed or diverged (lower --lr; "
                            "--beta, --temperature and the rewards' scale enter the loss too)")
    return row


def train(cfg, policy: torch.nn.Module, rollouts: Rollouts, learner: Learner, timeline: Timeline, first: int = 0,
          held_out: bool = True, train_threads_after_sampling: int | None = None,
          sample_then_train: bool = False, ranks: Ranks = Ranks()) -> Iterator[dict]:
    """Run iterations first..cfg.iterations-1 and yield one metrics dict per iteration, then the final evaluation's.

    `rollouts`: the inference side (`Rollouts`: publish, generate, receive). `learner`: the training side, holding
    the tri-model and AdamW. `first`: the iteration to start at (a resumed run's). `held_out`: whether
    there are held-out prompts to evaluate on. `train_threads_after_sampling`: the trainer's threads once
    sampling is done (departure 3), or None.
    `sample_then_train`: receive the inference side's whole iteration before training (its threads and ours would
    oversubscribe too few cores). The last yielded dict has `"final": True` and only the evaluation of θ_final.
    A stop (KeyboardInterrupt) after an iteration's last step still yields that iteration's row, then is raised
    again: launch/setup.py keeps the iterations done in a checkpoint only once their rows are out (one rank only:
    the row's metrics are a collective with ranks). So does a failure there: the last iteration's row is what
    trainer.py saves the trained policy on.
    """
    for iteration in range(first, cfg.iterations):
        start, first_span = time.perf_counter(), len(timeline.spans)
        evaluation_pending = held_out and is_eval_iteration(iteration, cfg.eval_every, cfg.iterations)
        if train_threads_after_sampling:
            torch.set_num_threads(cfg.train_threads)          # its share while the inference side samples
        learner.tri.start_iteration()                         # θ_old := θ_k (when N·μ > 1 steps)
        learner.start(iteration)
        rollouts.publish(policy, iteration)                   # θ_k -> the inference side
        rollouts.generate(iteration)                          # sample k with θ_k (async: returns at once)
        messages = rollouts.receive()                         # groups in completion order, then IterationDone
        if sample_then_train:  # the inference side's whole iteration first, then training: each on every core
            messages = list(messages)
        evaluation = None
        try:
            for message in messages:
                record(timeline, message)
                if isinstance(message, ScoredGroup):
                    learner.take(message)
                elif isinstance(message, Evaluation):         # held-out reward of θ_k (if due)
                    evaluation, evaluation_pending = held_out_reward(message, iteration), False
                if train_threads_after_sampling and learner.all_taken() and not evaluation_pending:
                    torch.set_num_threads(train_threads_after_sampling)  # sampling is done: every core trains
                for micro_batch in learner.ready():           # (then passes 2..μ over the stored batch)
                    learner.accumulate(micro_batch)           # forward, backward: ∇ accumulates (STEP_DUE: none)
                    if learner.minibatch_done():
                        learner.step()                        # optimizer step, one per mini-batch and pass
            row = iteration_row(iteration, evaluation, learner, timeline, start, first_span)
        except KeyboardInterrupt:  # a stop once the steps are done (awaiting the iteration's end or its evaluation)
            if ranks.size > 1 or learner.iterations_done() != iteration + 1:
                raise
            yield iteration_row(iteration, evaluation, learner, timeline, start, first_span)  # its row first, without
            raise                                             # what had not come: a stop checkpoint then holds θ_{k+1}
        except Exception:  # a failure once θ holds the steps (the schedule's next rate, the iteration's evaluation)
            if ranks.size > 1 or not learner.all_stepped():
                raise
            yield iteration_row(iteration, evaluation, learner, timeline, start, first_span)  # its row first: after
            raise                                             # the last iteration, trainer.py saves θ_final with it
        yield row
    if ranks.size > 1:
        check_same_weights(policy, ranks)                     # every rank's θ_final: the same bits
    rollouts.publish(policy, cfg.iterations)                  # θ_final, for its evaluation only
    rollouts.generate(cfg.iterations, train_prompts=False)    # evaluation only
    evaluation = None
    for message in rollouts.receive():
        record(timeline, message)
        if isinstance(message, Evaluation):
            evaluation = held_out_reward(message, cfg.iterations)
    yield {"iteration": cfg.iterations, "policy_version": cfg.iterations, "final": True, "eval_reward": evaluation}
