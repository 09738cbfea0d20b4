"""The training side: one iteration's groups in, micro-batches of forward/backward, an optimizer step per
mini-batch (the consumer of periodic_rl.py's pipeline).

    for each group as it arrives:    take(g)                       refused unless θ_k sampled it
        for each micro-batch ready:  accumulate(groups)            ∇ += Σ_g ∇S_g(θ_k)     (S_g: grpo.py, a sum)
        once a mini-batch is whole:  step()                        ∇ /= D, clip, AdamW    (D: its tokens or
                                                                                           sequences, all ranks')

Why the order of arrival does not change the update: mini-batch membership is fixed by prompt index
(`minibatch_of`), D is known only once the mini-batch is whole (so each partial sum is divided once, at the
step), and micro-batches are cut by arrival order, which is completion order, a function of the sampled
tokens alone (periodic_rl.py's docstring). With trainer ranks each rank takes only its own calls' groups and
`step` sums ∇ and D over the ranks first (infra/distributed.py).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from grpo import grpo_loss, loss_normalizer
from inference import PipelineError
from infra import distributed
from infra.distributed import Ranks
from infra.timeline import TRAIN, Timeline
from rollout import Group
from tri_model import TriModel
from weights import OffPolicyError


def minibatch_of(prompt_index: int, prompts_per_iteration: int, updates_per_iteration: int) -> int:
    """Mini-batch of a group: contiguous blocks of prompt indices, independent of arrival order."""
    return prompt_index * updates_per_iteration // prompts_per_iteration


def group_tokens(groups: list[Group]) -> int:
    """Tokens a micro-batch's forward processes, counted as plain rows: G·P + Σ R_i per group."""
    return sum(len(g.responses) * len(g.prompt_ids) + sum(len(r) for r in g.responses) for g in groups)


def micro_batch_size(tokens: list[int], max_tokens: int) -> int:
    """How many of the waiting groups (a prefix; their token counts) fit in `max_tokens`; at least one."""
    size, total = 1, tokens[0]
    while size < len(tokens) and total + tokens[size] <= max_tokens:
        total += tokens[size]
        size += 1
    return size


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample std of the values that are not NaN (a response no reward scored); None where undefined."""
    scored = torch.tensor([value for value in values if not math.isnan(value)])  # (n,)
    return scored.mean().item() if len(scored) else None, scored.std().item() if len(scored) > 1 else None


def forward_backward(tri: TriModel, batch: list, advantages: list[float], cfg) -> tuple[torch.Tensor, dict]:
    """One micro-batch: the tri-model's log-probs of `batch` [(prompt ids, [response ids] x G)], the GRPO loss
    with these advantages (one per response) as a partial sum (divided by D at the step), and its backward
    (∇ accumulates in .grad). What the learner runs per micro-batch, and what the probe times (launch/sizing.py)."""
    logp, old_logp, ref_logp, mask = tri(batch)  # (n·G, T) each, groups in order
    advantages = torch.tensor(advantages, device=logp.device, dtype=logp.dtype)  # (n·G,)
    loss, stats = grpo_loss(logp, old_logp, ref_logp, advantages, mask, beta=cfg.beta,
                            epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                            loss_type=cfg.loss_type, max_new_tokens=cfg.max_new_tokens,
                            kl_bias_correction=cfg.kl_bias_correction, normalizer=1.0)
    loss.backward()
    return loss, stats


class Learner:
    """Consumes one iteration's groups in arrival order: forward/backward in micro-batches, an optimizer
    step per mini-batch.

    A micro-batch is the waiting groups of the current mini-batch, in arrival order, up to
    `micro_batch_tokens`. Groups wait until that many tokens are there, or until nothing more will
    come soon: their generate call (chunk) has delivered every group, or the mini-batch is complete.
    Arrival order is completion order, which depends only on the sampled tokens, so the micro-batches
    (and hence the float rounding of the accumulated gradient) are the same in both modes and in
    every rerun. Statistics stay on the device until `metrics`: no host synchronisation per group.

    With trainer ranks (infra/distributed.py) it takes only its rank's groups, so a mini-batch may hold none
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
            size = micro_batch_size([group_tokens([g]) for g in waiting], self.cfg.micro_batch_tokens)
            micro_batch = waiting[:size]
            del waiting[:size]
            yield micro_batch

    def minibatch_done(self) -> bool:
        """Every group of the current mini-batch has arrived and been trained: time for its optimizer step."""
        return (self.minibatch < self.cfg.updates_per_iteration and self._all_arrived()
                and not self.waiting[self.minibatch])

    def all_taken(self) -> bool:
        """Every group of the iteration (this rank's) has arrived: the inference side is done sampling θ_k."""
        return sum(self.arrived) == sum(self.groups_per_minibatch)

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
        name = f"{TRAIN}group {groups[0].index}" if len(groups) == 1 else f"{TRAIN}{len(groups)} groups"
        with self.timeline.span(name):
            batch = [(torch.tensor(g.prompt_ids, device=self.device),                  # (P,)
                      [torch.tensor(r, device=self.device) for r in g.responses])      # G x (R_i,)
                     for g in groups]
            loss, stats = forward_backward(self.tri, batch, [a for g in groups for a in g.advantages], self.cfg)
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
        are first summed over the ranks (infra/distributed.py): the same step on every rank."""
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
