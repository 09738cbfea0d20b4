"""Sizes from measurements: generate calls per iteration and the CPU thread split, chosen per run.

The paper's pipeline is "demand-driven": each side gets what its measured work needs. Two sizes
decide how well the two sides overlap, and both depend on the model, the task and the machine:
how many `generate` calls sample an iteration (more calls: the trainer starts sooner, but every
call pays generate's fixed cost and its own longest response), and, on CPU, how the cores split
between the inference and the training process. `probe` measures, `predict_seconds` models an
iteration from the measurements, `choose` picks.

The probe (before iteration 0; it changes nothing: its own RNG state, no optimizer step,
gradients dropped) samples iteration 0's prompts, B = prompts x G rows, in one call and then the
first half of them in a second call, and times one forward/backward over the groups:

    τ(rows) = a + b·rows     seconds per decode step: a line through (B, T_1/S_1), (B/2, T_2/S_2)
                             (T: the call's seconds, S: its decode steps = its longest response)
    c = T_train / tokens     training seconds per token (prompt + response, plain rows)

An iteration with n calls (call j samples prompts [j·k, (j+1)·k), k = ceil(prompts/n), rows
r = k·G) is then simulated: group g of call j is ready (L_g + 1)·τ(r) after the call starts (L_g:
its longest response in the probe, since groups stream out of a call by completion), call j + 1
starts when call j ends; the trainer takes groups in the order they are ready, c·tokens_g each,
never before one is ready. The predicted iteration time is when the trainer finishes, and n is
the fastest (the fewest calls within 3% of it). On CPU, async mode then splits the cores in
proportion to the two sides' measured demand, T_gen : T_train (at least one core each).

Deliberate departures:
1. Probed on CPU only. On an accelerator a decode step costs about the same for 8 rows as for
   512 (memory-bound), so one call per iteration is the rule (config.GENERATE_CALLS), and the
   trainer's float32 policy on the training device would time the wrong sampler anyway.
2. The sizes change the rollouts (which prompts share a call, hence the random stream): a rerun on
   a busier machine may choose differently. The chosen sizes are printed as flags; passing them
   fixes them, and a size that is given is never probed.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

import torch

from rollout import iteration_prompts, prompt_seed, sample_responses, sampling_config, stop_token_ids
from tasks import prompt_token_ids

AS_FAST = 1.03  # fewer calls win unless more calls are predicted more than 3% faster


@dataclass(frozen=True)
class Probe:
    step_seconds: tuple[float, float]  # τ(rows) = a + b·rows: (a, b)
    train_seconds_per_token: float     # c
    lengths: list[int]                 # L_g: each group's longest response, in decode steps
    tokens: list[int]                  # each group's training tokens, G·P + ΣR
    group_size: int


def predict_seconds(probe: Probe, calls: int) -> tuple[float, float, float]:
    """(iteration, generation, training) seconds predicted for `calls` generate calls (async mode)."""
    a, b = probe.step_seconds
    prompts = len(probe.lengths)
    size = math.ceil(prompts / calls)
    ready, clock = [], 0.0
    for first in range(0, prompts, size):
        lengths = probe.lengths[first:first + size]
        step = a + b * len(lengths) * probe.group_size  # τ(r)
        ready += [(clock + (length + 1) * step, g) for g, length in enumerate(lengths, first)]
        clock += (max(lengths) + 1) * step
    trainer = 0.0
    for when, g in sorted(ready):
        trainer = max(trainer, when) + probe.train_seconds_per_token * probe.tokens[g]
    return trainer, clock, probe.train_seconds_per_token * sum(probe.tokens)


def best_calls(probe: Probe) -> int:
    """The fewest generate calls whose predicted iteration is within AS_FAST of the fastest."""
    candidates = sorted({math.ceil(len(probe.lengths) / math.ceil(len(probe.lengths) / n))
                         for n in range(1, len(probe.lengths) + 1)})
    seconds = {n: predict_seconds(probe, n)[0] for n in candidates}
    fastest = min(seconds.values())
    return min(n for n in candidates if seconds[n] <= AS_FAST * fastest)


def _timed_call(model, prompts, group_size, generation, seed) -> tuple[float, int, list[list[list[int]]]]:
    start = time.perf_counter()
    responses = sample_responses(model, prompts, group_size, generation, seed)
    steps = max(len(r) for group in responses for r in group)
    return time.perf_counter() - start, steps, responses


def probe(cfg, tri, tokenizer, train_examples, settings, threads: int) -> Probe:
    """Time iteration 0's generation (one call, then half of it) and training (forward/backward) at
    `threads` threads. Leaves the RNG, the weights and the gradients as they were."""
    policy = tri.policy
    generation = sampling_config(settings, stop_token_ids(policy, tokenizer), tokenizer.pad_token_id)
    examples = [train_examples[i] for i in iteration_prompts(len(train_examples), cfg.prompts_per_iteration,
                                                              cfg.seed, 0)]
    prompts = [prompt_token_ids(tokenizer, e.prompt) for e in examples]
    saved_threads, was_training = torch.get_num_threads(), policy.training
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            policy.eval()
            seed = prompt_seed(cfg.seed, 0, 0)
            _timed_call(policy, prompts[:1], cfg.group_size, generation, seed)  # warm-up: first-call costs
            full_s, full_steps, responses = _timed_call(policy, prompts, cfg.group_size, generation, seed)
            half = max(1, len(prompts) // 2)
            half_s, half_steps, _ = _timed_call(policy, prompts[:half], cfg.group_size, generation, seed)
            policy.train()
            device = next(policy.parameters()).device
            batch = [(torch.tensor(p, device=device), [torch.tensor(r, device=device) for r in group])
                     for p, group in zip(prompts, responses)]
            tri.start_iteration()
            start = time.perf_counter()
            logp, old_logp, ref_logp, mask = tri(batch)  # (B, T) each
            (logp * mask).sum().backward()
            train_s = time.perf_counter() - start
            policy.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(saved_threads)
        policy.train(was_training)
    tokens = [cfg.group_size * len(p) + sum(len(r) for r in group) for p, group in zip(prompts, responses)]
    rows_full, rows_half = len(prompts) * cfg.group_size, half * cfg.group_size
    tau_full, tau_half = full_s / full_steps, half_s / half_steps
    b = max(0.0, (tau_full - tau_half) / (rows_full - rows_half)) if rows_full > rows_half else 0.0
    return Probe((max(0.0, tau_full - b * rows_full), b), train_s / sum(tokens),
                 [max(len(r) for r in group) for group in responses], tokens, cfg.group_size)


def choose(cfg, tri, tokenizer, train_examples, settings) -> tuple[object, str]:
    """`cfg` with the sizes `config.derive` left open (None) filled from a probe, and a line saying
    what was measured ('' when nothing was open)."""
    if cfg.sized:
        return cfg, ""
    cores = os.cpu_count() or 1
    result = probe(cfg, tri, tokenizer, train_examples, settings, threads=max(1, cores // 2))
    calls = math.ceil(cfg.prompts_per_iteration / cfg.groups_per_chunk) if cfg.groups_per_chunk else best_calls(result)
    iteration_s, gen_s, train_s = predict_seconds(result, calls)
    overlaps = iteration_s < (gen_s + train_s) / AS_FAST  # else the sides take turns: all cores each
    rollout_threads = cfg.rollout_threads or (
        min(cores - 1, max(1, round(cores * gen_s / (gen_s + train_s)))) if overlaps and cores > 1 else cores)
    chosen = dataclasses.replace(
        cfg, groups_per_chunk=cfg.groups_per_chunk or math.ceil(cfg.prompts_per_iteration / calls),
        rollout_threads=rollout_threads,
        train_threads=cfg.train_threads or (cores - rollout_threads if overlaps and cores > 1 else cores))
    a, b = result.step_seconds
    note = (f"probe: decode step {a * 1e3:.2f} ms + {b * 1e6:.1f} us/row, training "
            f"{result.train_seconds_per_token * 1e6:.2f} us/token; {calls} call(s) per iteration predicted "
            f"{iteration_s:.3f} s (generate {gen_s:.3f} s, train {train_s:.3f} s"
            f"{', overlapped' if overlaps else ', in turns'})")
    return chosen, note
