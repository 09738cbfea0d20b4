"""The training side: one iteration's groups in, micro-batches of forward/backward, an optimizer step per
mini-batch (the consumer of periodic_rl.py's pipeline).

    for each group as it arrives:    take(g)                       refused unless θ_k sampled it
        for each micro-batch ready:  accumulate(groups)            ∇ += Σ_g ∇S_g(θ)       (S_g: grpo.py, a sum)
        once a mini-batch is whole:  step()                        ∇ /= D, clip, AdamW at the rate's schedule
    passes 2..μ (num_iterations):    the first pass's micro-batches again, mini-batch by mini-batch, each step
                                     with the ratio against θ_k (the tri-model's old copy)

D, summed over the ranks, by loss type: dapo, the batch's tokens / N steps; grpo and dr_grpo, the mini-batch's
sequences; bnpo, each micro-batch its own tokens, then the step its micro-batches (grpo.py has the formulas).

Why the order of arrival does not change the update: mini-batch membership is fixed by prompt index
(`minibatch_of`), D is known only once the mini-batch (dapo: the batch) is whole (so each partial sum is
divided once, at the step), and micro-batches are cut by arrival order, which is completion order, a function of
the sampled tokens alone (periodic_rl.py's docstring). Later passes replay the first pass's micro-batches, so they
sum in the same order too. With trainer ranks each rank takes only its own calls' groups and `step` sums ∇ and D over
the ranks first (infra/distributed.py).

What waits for the whole batch: with dapo (D) or scale_rewards="batch" (the reward std) the first step waits for
the last group, so with N > 1 updates only mini-batch 0 overlaps the sampling; with scale_rewards="batch" every
rank gathers the rewards before it trains or steps more (docs/design.md, "GRPO as implemented", says why).

Metrics, per iteration, as TRL 1.16 logs them (infra/tracking.py has the names): the clipped fractions (low,
high, region) and the KL term (ρ·k3 with the bias correction) over every pass's loss tokens, and the extremes over
responses of their clipped fraction (least low, most high); the mean per-token entropy of the policy over the loss
tokens (a truncated response left out under mask_truncated_completions, as TRL), from the logits its log-probs are
taken from (attention.token_logprobs); the learning rate of the last step; frac_reward_zero_std; the response
lengths (mean, min, max; the same of the terminated ones) and the truncated fraction; the iteration's prompt
(once per response) and response tokens, which trainer.py sums into TRL's num_tokens.

Departures from TRL 1.16, on purpose:
1. With N > 1 updates per iteration a mini-batch is a block of whole groups by prompt index (`minibatch_of`);
   TRL shuffles the batch's rows before it splits them into steps, so its mini-batches split groups. Prompts are
   already in a seeded random order, and membership must not depend on arrival order (above): the same update in
   expectation, not for the same samples.
2. The metrics are one iteration's, weighted by tokens over every micro-batch and pass (the extremes over all of
   them); TRL logs a value per micro-step and averages those. With one micro-batch and one step they agree.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

import torch

from grpo import ADVANTAGE_EPS, batch_std, grpo_loss, loss_normalizer, micro_batch_normalizer
from infra import distributed
from infra.distributed import Ranks
from infra.errors import PipelineError
from infra.stopping import stops_deferred
from infra.timeline import TRAIN, Timeline
from rollout import ScoredGroup
from tri_model import TriModel
from weights import OffPolicyError

STEP_DUE: Sequence[ScoredGroup] = ()  # what `ready` yields when a step is due with no group left to train: the loop
# accumulates nothing, then steps
SUMS = ("loss", "clipped_low", "clipped_high", "kl", "entropy", "grad_norm")  # kept on the device until `metrics`


def minibatch_of(prompt_index: int, prompts_per_iteration: int, updates_per_iteration: int) -> int:
    """Mini-batch of a group: contiguous blocks of prompt indices, independent of arrival order."""
    return prompt_index * updates_per_iteration // prompts_per_iteration


def group_tokens(groups: list[ScoredGroup]) -> int:
    """Tokens a micro-batch's forward processes, counted as plain rows: G·P + Σ R_i per group."""
    return sum(len(g.responses) * len(g.prompt_ids) + sum(len(r) for r in g.responses) for g in groups)


def micro_batch_size(tokens: list[int], max_tokens: int) -> int:
    """How many of the waiting groups (a prefix; their token counts) fit in `max_tokens`; at least one."""
    size, total = 1, tokens[0]
    while size < len(tokens) and total + tokens[size] <= max_tokens:
        total += tokens[size]
        size += 1
    return size


def is_truncated(response: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """A response cut at max_new_tokens, not ended by a stop id (TRL: its last token is no EOS)."""
    return len(response) >= max_new_tokens and response[-1] not in stop_ids


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample std of the values that are not NaN (a response no reward scored); None where undefined."""
    scored = torch.tensor([value for value in values if not math.isnan(value)])  # (n,)
    return scored.mean().item() if len(scored) else None, scored.std().item() if len(scored) > 1 else None


def zero_std_fraction(groups: list[list[float]], scale_rewards: str) -> float:
    """TRL's frac_reward_zero_std: the fraction of responses whose reward std (their group's; with
    scale_rewards="batch" the batch's) is 0 (TRL's isclose: <= 1e-8; NaN, fewer than two scored, is not)."""
    if scale_rewards == "batch":
        return float(batch_std(torch.tensor([r for rewards in groups for r in rewards])) <= 1e-8)  # (B,) -> 0-d
    zero = sum(len(rewards) for rewards in groups if batch_std(torch.tensor(rewards)) <= 1e-8)  # (G,) -> 0-d
    return zero / sum(len(rewards) for rewards in groups)


def forward_backward(tri: TriModel, batch: list, advantages: list[float], cfg,
                     kept: list[bool] | None = None) -> tuple[torch.Tensor, dict]:
    """One micro-batch: the tri-model's log-probs of `batch` [(prompt ids, [response ids] x G)], the GRPO loss
    with these advantages (one per response) as a partial sum (divided by D at the step; bnpo: by its own tokens
    first), and its backward (∇ accumulates in .grad). `kept`: per response, whether it enters the loss (False: a
    truncated one under --mask-truncated-completions). Stats: grpo_loss's, with the policy's entropy summed over
    the loss tokens. What the learner runs per micro-batch, and what the probe times (launch/sizing.py)."""
    logp, old_logp, ref_logp, mask, entropy = tri(batch, entropy=True)  # (n·G, T) each, groups in order
    lengths = [len(r) for _, responses in batch for r in responses]
    tokens = sum(lengths)
    if kept is not None:
        mask = mask & torch.tensor(kept, device=mask.device)[:, None]  # (n·G, T) a left-out response: no token
        tokens = sum(n for n, keep in zip(lengths, kept) if keep)
    advantages = torch.tensor(advantages, device=logp.device, dtype=logp.dtype)  # (n·G,)
    loss, stats = grpo_loss(logp, old_logp, ref_logp, advantages, mask, beta=cfg.beta,
                            epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                            loss_type=cfg.loss_type, max_new_tokens=cfg.max_new_tokens,
                            kl_bias_correction=cfg.kl_bias_correction,
                            normalizer=micro_batch_normalizer(cfg.loss_type, tokens))
    loss.backward()
    return loss, {**stats, "entropy_sum": (entropy * mask).sum()}  # over the loss tokens (a product: no sync)


@dataclasses.dataclass
class Iteration:
    """What the learner holds for one iteration, made new by `Learner.start`: the groups as they arrive, the
    micro-batches and steps done, and the sums its metrics come from (on the device until `Learner.metrics`)."""
    index: int  # k: only groups that θ_k sampled are taken
    waiting: list[list[ScoredGroup]]  # per mini-batch, the groups not trained yet, in arrival order
    trained: list[list[list[ScoredGroup]]]  # per mini-batch, the first pass's micro-batches (passes 2..μ replay them)
    arrived: list[int]  # per mini-batch, the groups received
    sums: dict[str, torch.Tensor]  # SUMS, over every micro-batch and pass
    low_min: torch.Tensor  # the least low-clipped fraction of a response
    high_max: torch.Tensor  # the most high-clipped one
    minibatch_loss: torch.Tensor  # the current mini-batch's partial sum, divided by its D at the step
    call_arrivals: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # groups received, per call
    arrivals: dict[int, ScoredGroup] = dataclasses.field(default_factory=dict)  # this rank's groups, by index
    kept: dict[int, list[bool]] = dataclasses.field(default_factory=dict)  # by group index, per response: in the loss?
    rewards: dict[int, tuple] = dataclasses.field(default_factory=dict)  # by group index: (weighted sums,
    # [reward k][response], lengths, truncated); metrics in index order, whatever the arrival
    logged: dict[int, dict] = dataclasses.field(default_factory=dict)  # by group index: what its rewards logged
    steps_done: int = 0
    replayed: int = 0  # micro-batches of the current mini-batch trained again in this pass (passes 2..μ)
    minibatch_sequences: int = 0
    minibatch_micro_batches: int = 0
    tokens: int = 0  # response tokens (host counts)
    loss_tokens: int = 0  # of those, the ones in the loss
    prompt_tokens: int = 0  # the prompt's tokens once per response, as TRL counts its num_tokens
    metric_tokens: int = 0  # loss tokens the statistics are summed over, every pass
    divisor: torch.Tensor | None = None  # std(r_batch) + eps (scale_rewards="batch"), once every group is in
    learning_rate: float | None = None  # the last step's

    @classmethod
    def new(cls, index: int, updates: int, device: torch.device) -> Iteration:
        """Iteration `index` before its first group, for `updates` mini-batches."""
        return cls(index, waiting=[[] for _ in range(updates)], trained=[[] for _ in range(updates)],
                   arrived=[0] * updates, sums={name: torch.zeros((), device=device) for name in SUMS},
                   low_min=torch.full((), torch.inf, device=device), high_max=torch.full((), -torch.inf, device=device),
                   minibatch_loss=torch.zeros((), device=device))


class Learner:
    """Consumes one iteration's groups in arrival order: forward/backward in micro-batches, an optimizer
    step per mini-batch, μ passes.

    A micro-batch is the waiting groups of the current mini-batch, in arrival order, up to
    `micro_batch_tokens`. Groups wait until that many tokens are there, or until nothing more will
    come soon: their generate call has delivered every group, or the mini-batch is complete.
    Arrival order is completion order, which depends only on the sampled tokens, so the micro-batches
    (and hence the float rounding of the accumulated gradient) are the same in both modes and in
    every rerun. Statistics stay on the device until `metrics`: no host synchronisation per group.

    With trainer ranks (infra/distributed.py) it takes only its rank's groups, so a mini-batch may hold none
    of them: `ready` then yields STEP_DUE, and the rank still joins the step's all-reduce.
    `reward_names` label each reward's own statistics (`rewards/<name>/mean`, TRL's names). `scheduler`: the
    learning-rate schedule (launch/setup.py), stepped after each optimizer step. `stop_ids`: the ids that end a
    response (a response without one at max_new_tokens is truncated).
    """

    def __init__(self, tri_model: TriModel, optimizer: torch.optim.Optimizer, cfg, device: torch.device,
                 timeline: Timeline, ranks: Ranks = Ranks(), reward_names: list[str] = (), scheduler=None,
                 stop_ids: list[int] = ()):
        self.tri, self.optimizer, self.cfg, self.device, self.timeline = tri_model, optimizer, cfg, device, timeline
        self.ranks, self.reward_names = ranks, list(reward_names)
        self.scheduler, self.stop_ids = scheduler, set(stop_ids)
        prompts, updates = cfg.prompts_per_iteration, cfg.updates_per_iteration
        self.groups_per_minibatch = [0] * updates  # this rank's groups in each mini-batch
        for index in range(prompts):
            if distributed.owner(index // cfg.groups_per_call, ranks.size) == ranks.rank:
                self.groups_per_minibatch[minibatch_of(index, prompts, updates)] += 1
        self.steps = updates * cfg.num_iterations  # optimizer steps per iteration
        self.first_step_waits = cfg.scale_rewards == "batch" or cfg.loss_type == "dapo"  # its D or std needs the batch
        self.passes_wait = cfg.scale_rewards == "batch" and cfg.beta != 0  # A / std before any forward
        self.current: Iteration | None = None  # the iteration in progress (`start`)
        self.stepping = False

    def start(self, iteration: int) -> None:
        """Begin iteration k: a new `Iteration`, nothing taken, trained or summed yet."""
        self.current = Iteration.new(iteration, self.cfg.updates_per_iteration, self.device)

    @property
    def iteration(self) -> int | None:
        """k, the iteration in progress (None before the first `start`)."""
        return self.current.index if self.current is not None else None

    def take(self, group: ScoredGroup) -> None:
        """Take one group, refused unless θ_k sampled it (nothing is trained here: see `ready`)."""
        now = self.current
        if group.policy_version != self.iteration:
            changed = " (weights that changed while it was sampled)" if group.policy_version == -1 else ""
            raise OffPolicyError(f"group {group.index} was sampled by weights version {group.policy_version}"
                                 f"{changed} but this is iteration {self.iteration}: refusing an off-policy sample")
        if (owner := distributed.owner(group.index // self.cfg.groups_per_call, self.ranks.size)) != self.ranks.rank:
            raise PipelineError(f"group {group.index} belongs to trainer rank {owner}, not rank {self.ranks.rank}")
        block = minibatch_of(group.index, self.cfg.prompts_per_iteration, self.cfg.updates_per_iteration)
        now.waiting[block].append(group)
        now.arrived[block] += 1
        now.call_arrivals[group.call] = now.call_arrivals.get(group.call, 0) + 1
        now.arrivals[group.index] = group
        lengths = [len(r) for r in group.responses]
        truncated = [is_truncated(r, self.cfg.max_new_tokens, self.stop_ids) for r in group.responses]
        kept = [not (self.cfg.mask_truncated_completions and cut) for cut in truncated]  # --mask-truncated-completions
        now.kept[group.index] = kept
        now.tokens += sum(lengths)
        now.prompt_tokens += len(group.prompt_ids) * len(group.responses)
        now.loss_tokens += sum(n for n, keep in zip(lengths, kept) if keep)
        now.rewards[group.index] = (group.rewards, group.rewards_per_function, lengths, truncated)
        now.logged[group.index] = group.logged

    def advantages_of(self, group: ScoredGroup) -> list[float]:
        """The advantages `group` is trained on: its own, or with scale_rewards="batch" its centred rewards /
        (std(r_batch) + eps), TRL's, 0 where that std is undefined (known once every group is in: `ready`). With
        β = 0 the learner trains on the centred ones and divides ∇ instead, the same update (grpo.py)."""
        if self.cfg.scale_rewards != "batch":
            return group.advantages
        return (torch.tensor(group.advantages) / self._batch_divisor()).nan_to_num(0.0).tolist()  # (G,)

    @property
    def taken(self) -> dict[int, ScoredGroup]:
        """This rank's groups of the iteration by index, each with the advantages it is trained on (`advantages_of`):
        what --log-completions writes, once the iteration is done."""
        return {index: dataclasses.replace(group, advantages=self.advantages_of(group))
                for index, group in self.current.arrivals.items()}

    def ready(self) -> Iterator[Sequence[ScoredGroup]]:
        """The micro-batches that can train now. First pass: the current mini-batch's waiting groups, in arrival
        order, once they reach `micro_batch_tokens` or nothing more will come soon (their generate calls have
        ended, or the mini-batch is complete). Passes 2..μ: the first pass's micro-batches of the current
        mini-batch, in its order. Call `step` inside the loop as soon as `minibatch_done()`: the next mini-batch
        follows only after it. A mini-batch with nothing left to train whose step is due (none of its groups
        are this rank's, or the step waited for the whole batch) yields STEP_DUE, a micro-batch of no group."""
        now = self.current
        if self.cfg.scale_rewards == "batch" and self.all_taken():
            self._batch_divisor()  # with ranks a collective: every rank's first of the iteration, before any step
        if self.passes_wait and not self.all_taken():
            return  # scale_rewards="batch" with β > 0: A / std(r_batch) before any forward (grpo.py)
        while now.steps_done < self.steps:
            if self._step_due():
                before = now.steps_done
                yield STEP_DUE
                if now.steps_done == before:  # the caller did not step: nothing else can train
                    return
                continue
            block = now.steps_done % self.cfg.updates_per_iteration
            if now.steps_done >= self.cfg.updates_per_iteration:  # a later pass over the stored batch
                now.replayed += 1
                yield now.trained[block][now.replayed - 1]
                continue
            waiting = now.waiting[block]
            if not waiting or not (self._all_arrived(block) or self._calls_done(waiting)
                                   or group_tokens(waiting) >= self.cfg.micro_batch_tokens):
                return
            size = micro_batch_size([group_tokens([g]) for g in waiting], self.cfg.micro_batch_tokens)
            micro_batch = waiting[:size]
            del waiting[:size]
            now.trained[block].append(micro_batch)
            yield micro_batch

    def minibatch_done(self) -> bool:
        """The current mini-batch is trained (every group arrived, in this pass) and its step may be taken."""
        return self.current.steps_done < self.steps and self._step_due()

    def _step_due(self) -> bool:
        now = self.current
        block = now.steps_done % self.cfg.updates_per_iteration
        if now.steps_done >= self.cfg.updates_per_iteration:
            return now.replayed == len(now.trained[block])
        return (self._all_arrived(block) and not now.waiting[block]
                and (not self.first_step_waits or self.all_taken()))

    def all_taken(self) -> bool:
        """Every group of the iteration (this rank's) has arrived: the inference side is done sampling θ_k."""
        return sum(self.current.arrived) == sum(self.groups_per_minibatch)

    def _all_arrived(self, block: int) -> bool:
        return self.current.arrived[block] == self.groups_per_minibatch[block]

    def _calls_done(self, groups: list[ScoredGroup]) -> bool:
        """Whether the generate calls that sampled `groups` have sent all their groups (none is coming soon)."""
        return all(self.current.call_arrivals[g.call] == g.call[1] for g in groups)  # call: (first prompt, prompts)

    def _batch_divisor(self) -> torch.Tensor:
        """std(r_batch) + eps over every rank's rewards, in group order (scale_rewards="batch"), 0-d; computed once,
        by `ready` as soon as every group is in. With ranks it is a collective, so every rank computes it there,
        before it yields anything more: a rank with none of mini-batch 0's groups would otherwise go on to its
        step's all-reduce while the others wait in this gather (a deadlock)."""
        now = self.current
        if now.divisor is None:
            by_group = now.rewards if self.ranks.size == 1 else distributed.gather_dicts(now.rewards, self.ranks)
            rewards = torch.tensor([r for index in sorted(by_group) for r in by_group[index][0]])  # (B,) float32
            now.divisor = batch_std(rewards) + ADVANTAGE_EPS
        return now.divisor

    def accumulate(self, groups: Sequence[ScoredGroup]) -> None:
        """One forward/backward over a micro-batch of the current mini-batch: ∇ += Σ_g ∇S_g (divided by D
        at the step). STEP_DUE (the step is due with nothing of this rank's left to train) computes nothing."""
        now = self.current
        if not groups:
            return
        self.tri.policy.train()
        if self.passes_wait:  # the centred advantages / (std(r_batch) + eps), TRL's; 0 where the std is undefined
            advantages = [a for g in groups for a in self.advantages_of(g)]
        else:  # (scale_rewards="batch" with β = 0: the centred ones, ∇ / (std(r_batch) + eps) at the step)
            advantages = [a for g in groups for a in g.advantages]
        kept = [keep for g in groups for keep in now.kept[g.index]]
        name = f"{TRAIN}group {groups[0].index}" if len(groups) == 1 else f"{TRAIN}{len(groups)} groups"
        with self.timeline.span(name):
            batch = [(torch.tensor(g.prompt_ids, device=self.device),                  # (P,)
                      [torch.tensor(r, device=self.device) for r in g.responses])      # G x (R_i,)
                     for g in groups]
            loss, stats = forward_backward(self.tri, batch, advantages, self.cfg,
                                           kept if self.cfg.mask_truncated_completions else None)
        now.minibatch_loss += loss.detach()
        for total, key in (("clipped_low", "clipped_low"), ("clipped_high", "clipped_high"), ("kl", "kl_sum"),
                           ("entropy", "entropy_sum")):
            now.sums[total] += stats[key]
        now.low_min = torch.minimum(now.low_min, stats["clipped_low_min"])
        now.high_max = torch.maximum(now.high_max, stats["clipped_high_max"])
        responses = [r for g in groups for r in g.responses]
        now.metric_tokens += sum(len(r) for r, keep in zip(responses, kept) if keep)
        now.minibatch_sequences += len(responses)
        now.minibatch_micro_batches += 1

    def step(self) -> None:
        """The current mini-batch's optimizer step: ∇ /= D, clip, AdamW, then the schedule's next rate. With ranks,
        ∇, D's counts and the loss are first summed over the ranks (infra/distributed.py): the same step on every
        rank. A stop signal inside the update itself waits for its end (milliseconds): θ, AdamW's state, the schedule
        and the step count move together, so a stop checkpoint can hold them (`iterations_done`)."""
        now = self.current
        with self.timeline.span(f"optimizer step {now.steps_done}"):
            counts = [now.minibatch_sequences, now.loss_tokens, now.minibatch_micro_batches]
            minibatch_loss = now.minibatch_loss
            if self.ranks.size > 1:
                params = distributed.sum_gradients(  # ∇ = Σ_r ∇_r
                    [p for p in self.tri.policy.parameters() if p.requires_grad], self.ranks)
                *counts, minibatch_loss = distributed.sum_values([*counts, minibatch_loss], self.ranks, self.device)
            else:
                params = [p for p in self.tri.policy.parameters() if p.grad is not None]
            sequences, tokens, micro_batches = counts  # tokens: the batch's, in the loss (dapo: / steps, grpo.py)
            normalizer = loss_normalizer(self.cfg.loss_type, int(sequences),
                                         tokens / self.cfg.updates_per_iteration, int(micro_batches))
            for p in params:
                p.grad.div_(normalizer)  # = each micro-batch's loss / D (nanoGPT: loss / accumulation steps), but D
                # (dapo: the batch's tokens / N; grpo, dr_grpo: the mini-batch's sequences) is known only once the
                # groups it counts have all arrived
            if self.cfg.scale_rewards == "batch" and not self.passes_wait:  # β = 0: trained on the centred A, so
                divisor = self._batch_divisor()                              # ∇ / (std(r_batch) + eps) (grpo.py)
                if not divisor.isfinite():  # fewer than two scored rewards: every advantage is 0 (TRL)
                    divisor = torch.tensor(math.inf)
                for p in params:
                    p.grad.div_(divisor)
                minibatch_loss = minibatch_loss / divisor
            if self.cfg.max_grad_norm > 0:
                now.sums["grad_norm"] += torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            now.learning_rate = self.optimizer.param_groups[0]["lr"]  # this step's (what transformers logs)
            with stops_deferred():  # θ moves from here: whole or not at all
                self.stepping = True
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                now.sums["loss"] += minibatch_loss / normalizer  # this mini-batch's loss, as optimised
                now.steps_done += 1  # θ holds the step, even if the schedule's next rate fails (`all_stepped`)
                now.replayed = now.minibatch_sequences = now.minibatch_micro_batches = 0
                now.minibatch_loss = torch.zeros((), device=self.device)
                if self.scheduler is not None:
                    self.scheduler.step()
                self.stepping = False

    def all_stepped(self) -> bool:
        """Whether θ holds every optimizer step of the current iteration (what its row and a saved policy need),
        even where something after the last one failed (the schedule's next rate, the iteration's end)."""
        return self.iteration is not None and self.current.steps_done == self.steps

    def iterations_done(self) -> int | None:
        """How many iterations the weights and AdamW's state hold exactly, or None half-way through an
        iteration's steps (or inside one, cut by a KeyboardInterrupt that no stop handler deferred): what a
        checkpoint written now can claim."""
        if self.iteration is None or self.stepping:
            return None
        if self.current.steps_done == 0:
            return self.iteration
        return self.iteration + 1 if self.current.steps_done == self.steps else None

    def metrics(self) -> dict[str, float]:
        now = self.current
        if now.steps_done != self.steps:
            raise PipelineError(f"iteration {self.iteration} ended after {now.steps_done} of "
                                f"{self.steps} optimizer steps: groups are missing")
        loss, low, high, kl_sum, entropy, grad_norm, low_min, high_max = torch.stack(  # the one host synchronisation
            [*(now.sums[name] for name in SUMS), now.low_min.to(now.sums["loss"].dtype),
             now.high_max.to(now.sums["loss"].dtype)]).tolist()
        counted, all_tokens, prompt_tokens = now.metric_tokens, now.tokens, now.prompt_tokens
        by_group, logged = now.rewards, now.logged
        if self.ranks.size > 1:  # the whole iteration's (loss and grad_norm are already every rank's, from `step`)
            low, high, kl_sum, entropy, counted, all_tokens, prompt_tokens = distributed.sum_values(
                [low, high, kl_sum, entropy, counted, all_tokens, prompt_tokens], self.ranks, self.device)
            low_min, high_max = distributed.max_values([-low_min, high_max], self.ranks, self.device)
            low_min = -low_min
            both = distributed.gather_dicts({i: (now.rewards[i], now.logged[i]) for i in now.rewards}, self.ranks)
            by_group, logged = ({i: pair[0] for i, pair in both.items()}, {i: pair[1] for i, pair in both.items()})
        ordered = [by_group[index] for index in sorted(by_group)]  # (weighted sums, per reward, lengths, truncated)
        totals = [r for total, *_ in ordered for r in total]
        reward_mean, reward_std = mean_std(totals)
        per_function = {}
        for k, name in enumerate(self.reward_names):
            per_function[f"rewards/{name}/mean"], per_function[f"rewards/{name}/std"] = mean_std(
                [r for _, parts, *_ in ordered for r in parts[k]])
        lengths = [n for *_, group_lengths, _ in ordered for n in group_lengths]
        truncated = [t for *_, flags in ordered for t in flags]
        terminated = [n for n, cut in zip(lengths, truncated) if not cut]
        tokens = max(counted, 1)
        user = {}  # TRL's log_metric: each name's mean over the iteration's calls, in the groups' order
        for index in sorted(logged):
            for name, values in logged[index].items():
                user.setdefault(name, []).extend(values)
        return {**{name: sum(values) / len(values) for name, values in user.items()}, **{
            "reward_mean": reward_mean,  # of the weighted sum
            "reward_std": reward_std,
            **per_function,
            "frac_reward_zero_std": zero_std_fraction([total for total, *_ in ordered], self.cfg.scale_rewards),
            "frac_reward_unscored": sum(math.isnan(r) for r in totals) / len(totals),  # every reward returned None
            "loss": loss / self.steps,  # mean over the optimizer steps
            "kl": kl_sum / tokens if self.cfg.beta > 0 else None,  # TRL's term: ρ·k3 (with the bias correction)
            "entropy": entropy / tokens,  # over the loss tokens, as TRL
            "clip_fraction": (low + high) / tokens,  # TRL's clip_ratio/region_mean
            "clip_fraction_low": low / tokens,
            "clip_fraction_high": high / tokens,
            "clip_fraction_low_min": low_min if math.isfinite(low_min) else None,  # TRL's clip_ratio/low_min
            "clip_fraction_high_max": high_max if math.isfinite(high_max) else None,  # TRL's clip_ratio/high_max
            "grad_norm": grad_norm / self.steps if self.cfg.max_grad_norm > 0 else None,  # before clipping
            "learning_rate": now.learning_rate,  # the last step's
            "response_length": all_tokens / len(lengths),
            "response_length_min": min(lengths),
            "response_length_max": max(lengths),
            "terminated_length": sum(terminated) / len(terminated) if terminated else 0.0,  # TRL: 0 if none
            "terminated_length_min": min(terminated, default=0),
            "terminated_length_max": max(terminated, default=0),
            "truncated_fraction": sum(truncated) / len(truncated),
            "input_tokens": int(prompt_tokens + all_tokens),  # prompt (once per response) and response tokens
            "response_tokens": int(all_tokens),  # every rank's (the row's tokens_per_s: periodic_rl.iteration_row)
        }}  # (a name a reward logs that is one of ours gives way to ours)
