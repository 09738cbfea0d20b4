"""The training micro-batch fitted to an accelerator's memory (--sizes probe on a CUDA or NPU trainer, no
--micro-batch-tokens given): the default 16,384 tokens, lowered to what the free memory holds (departure 4).

Once everything the training process keeps is on the device (the policy, the frozen copies, the sampler's copy in sync
mode; the inference process's weights on a shared GPU), the micro-batch's tokens n are chosen so that its peak fits:

    budget   = free + cached - still to come        free: the device's free bytes (mem_get_info; other processes'
                                                    use counted), cached: this process's allocator cache
                                                    (reserved - allocated), still to come: the gradients and AdamW's
                                                    two moments (the trainable bytes each) unless already held
    peak(n)  = fixed + per_token · n                one micro-batch's forward/backward (learner.forward_backward) of n
                                                    tokens, counted as the learner counts them (G·P + Σ R per group)
    n        = (budget · (1 - MARGIN) - fixed) / per_token, rounded down to a multiple of BUCKET  (`fit_tokens`)

peak(n) is measured, not computed from the model's shape: what a token keeps for backward depends on the attention
kernel, on autocast's saved copies, gradient checkpointing, LoRA and the model's own code, which a formula would have
to follow for each. The allocator's peak (max_memory_allocated) over two stand-in micro-batches of 1 and STAND_INS
rows, each the run's first prompt and one response of `max_new_tokens` random tokens (a plain row at full
length), gives per_token (their difference over their tokens) and fixed (what does not grow: the output
layer's weight gradient, the logit blocks). Rows of one response keep the measurement small (a few thousand tokens,
whatever the group size) while each is as long as the first prompt's full-length rows. Cost: four
forward/backward passes at the start of the run (the first two make the gradients and any compilation, as a run's
first micro-batches do); a measurement that runs out of memory leaves the default cap, and says so.

Departures and limits:
1. MARGIN (a fifth of the budget) is left for what the fit cannot see: the allocator's fragmentation, the engine's
   key-value cache and CUDA graph pools (allocated when sampling starts, in this process in sync mode, in the
   inference process on a shared GPU), a slope that grows with the micro-batch (docs/benchmarks.md), and packed
   rows, longer than plain ones, where attention holds a row's (L, L) scores (eager attention; sdpa's kernels on a
   GPU stream them).
2. Not with --loss-type bnpo: its loss averages each micro-batch's own tokens, so the size would change the run with
   the device's free memory; it keeps the default (infra/options.fits_memory).
3. Trainer ranks take the smallest rank's fit, so that every rank cuts its micro-batches alike.
4. At most the default cap (MICRO_BATCH_TOKENS), so the fit only lowers it where memory is short: in async mode a
   micro-batch trains once it holds that many tokens or its generate call has ended, so a bigger one would wait
   for the call's last group instead of training while the call samples (the overlap the method is for); and sync
   cuts as async does, so that the modes stay bitwise equal and --mode auto changes speed only (where memory is
   short the two modes leave different free memory and may fit differently: pass --micro-batch-tokens to compare
   them bit for bit). Whether bigger micro-batches would pay in sync is the GPU check's to say (`bench.py gpu
   --parts train --train-micro-groups 0`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from infra import distributed
from infra.distributed import Ranks
from infra.options import MICRO_BATCH_TOKENS
from infra.tasks import run_prompt_ids
from learner import forward_backward
from rollout import iteration_prompts

MARGIN = 0.2  # share of the budget left free (departure 1)
STAND_INS = 3  # rows of the bigger stand-in micro-batch
BUCKET = 1024  # micro-batch tokens are a multiple of this: a size that does not move with a few MB of free memory


def fit_tokens(free_bytes: float, per_token: float, fixed: float = 0.0, margin: float = MARGIN,
               bucket: int = BUCKET) -> int:
    """The most tokens n with fixed + per_token·n <= (1 - margin)·free_bytes, rounded down to a multiple of
    `bucket` (below one bucket: as computed, at least 1; the learner trains at least one group per micro-batch).

    >>> fit_tokens(100e9, 1e6, fixed=2e9)  # 100 GB, 1 MB a token, 2 GB fixed: 78,000 tokens, 76 buckets of 1024
    77824
    >>> fit_tokens(10e9, 1e6, fixed=9e9), fit_tokens(1e9, 0.0)  # not even one token: 1; nothing grows: 0, no limit
    (1, 0)
    """
    if per_token <= 0:
        return 0
    tokens = int(((1 - margin) * free_bytes - fixed) // per_token)
    return max(1, tokens if tokens < bucket else tokens // bucket * bucket)


def affine_peak(tokens: tuple[int, int], peaks: tuple[float, float]) -> tuple[float, float]:
    """(fixed, per_token) of peak(n) = fixed + per_token·n through two measured (tokens, peak) points.

    >>> affine_peak((4000, 8000), (6e9, 10e9))
    (2000000000.0, 1000000.0)
    """
    per_token = max(0.0, (peaks[1] - peaks[0]) / (tokens[1] - tokens[0]))
    return max(0.0, peaks[0] - per_token * tokens[0]), per_token


def device_memory(device: torch.device):
    """torch.cuda, or torch.npu (torch_npu mirrors its memory functions), or None where they are missing."""
    backend = getattr(torch, device.type, None)
    needed = ("mem_get_info", "memory_allocated", "memory_reserved", "reset_peak_memory_stats", "max_memory_allocated",
              "synchronize", "empty_cache")
    return backend if backend is not None and all(hasattr(backend, name) for name in needed) else None


def peak_above(backend, device: torch.device) -> Callable[[Callable[[], object]], int]:
    """peak_of(fn): the most bytes the allocator held above what it held before, while fn ran."""
    def peak_of(fn) -> int:
        backend.synchronize(device)
        before = backend.memory_allocated(device)
        backend.reset_peak_memory_stats(device)
        fn()
        backend.synchronize(device)
        return backend.max_memory_allocated(device) - before
    return peak_of


def stand_in_groups(cfg, tokenizer, train_examples, vocab: int, device: torch.device, count: int = STAND_INS):
    """`count` one-response groups: iteration 0's first prompt (as the run tokenizes it) and max_new_tokens random
    tokens, [(prompt ids (P,), [response ids (R,)])]."""
    first = iteration_prompts(len(train_examples), cfg.prompts_per_iteration, cfg.seed, 0)[0]
    prompt = torch.tensor(run_prompt_ids(tokenizer, [train_examples[first]], cfg)[0], device=device)  # (P,)
    draw = torch.Generator().manual_seed(cfg.seed)
    return [(prompt, [torch.randint(vocab, (cfg.max_new_tokens,), generator=draw).to(device)]) for _ in range(count)]


def measure_peaks(tri, groups, cfg, peak_of) -> tuple[tuple[int, int], tuple[float, float]]:
    """((tokens of the first group, of all), (the peaks of their micro-batches)) of learner.forward_backward, after
    an untimed pass at each size (the gradients; compilations). Ends with the gradients unset and the random state
    restored."""
    policy, was_training = tri.policy, tri.policy.training
    device = next(policy.parameters()).device
    sizes = (1, len(groups))
    tokens = tuple(sum(len(p) * len(rs) + sum(len(r) for r in rs) for p, rs in groups[:k]) for k in sizes)
    devices = [device] if device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            policy.train()
            passes = [lambda k=k: forward_backward(tri, groups[:k], [0.0] * k * len(groups[0][1]), cfg) for k in sizes]
            for run in passes:  # untimed: the gradients made, and each size's compilation (--compile-train) done
                run()
            peaks = tuple(peak_of(run) for run in passes)
    finally:
        policy.zero_grad(set_to_none=True)
        policy.train(was_training)
    return tokens, peaks


def still_to_come(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes training keeps once it has stepped that are not allocated yet: each trainable parameter's gradient
    and AdamW's two moments (in the parameter's dtype), unless the optimizer holds its state (a resumed run)."""
    trainable = [p for p in policy.parameters() if p.requires_grad]
    gradients = sum(p.numel() * p.element_size() for p in trainable if p.grad is None)
    moments = 0 if optimizer.state else 2 * sum(p.numel() * p.element_size() for p in trainable)
    return gradients + moments


def fit_rows(tri, optimizer, rows, cfg) -> tuple[int | None, str]:
    """(micro-batch tokens, the line saying from what) fitted to the memory of the policy's device from the peaks of
    `rows` (one-response groups, `stand_in_groups`), or (None, why) where the device reports no memory or the rows
    themselves do not fit. `cfg`: the loss's options (learner.forward_backward)."""
    policy = tri.policy
    device = next(policy.parameters()).device
    backend = device_memory(device)
    if backend is None:
        return None, f"micro-batch: {device.type} reports no free memory"
    try:
        tokens, peaks = measure_peaks(tri, rows, cfg, peak_above(backend, device))
    except RuntimeError as error:  # CUDA's torch.OutOfMemoryError; an NPU's "out of memory" RuntimeError
        if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error).lower():
            raise
        tokens = None  # (the cache is emptied below, once the error's traceback no longer holds the pass's tensors)
    if tokens is None:
        backend.empty_cache()
        return None, (f"micro-batch: {len(rows)} rows of {len(rows[0][0]) + len(rows[0][1][0])} tokens ran out of "
                      f"memory on {device} (lower --micro-batch-tokens, or --gradient-checkpointing, if training does "
                      "too)")
    fixed, per_token = affine_peak(tokens, peaks)
    free, _ = backend.mem_get_info(device)
    budget = free + backend.memory_reserved(device) - backend.memory_allocated(device) - still_to_come(policy, optimizer)
    fitted = fit_tokens(budget, per_token, fixed) or None
    if fitted is None:
        return None, f"micro-batch: the stand-in rows' peaks on {device} did not grow with their tokens: nothing to fit"
    return fitted, (f"micro-batch: {fitted} tokens from {budget / 1e9:.3g} GB free for training on {device} "
                    f"({per_token / 2**20:.3g} MiB a token + {fixed / 2**30:.3g} GiB, measured; {MARGIN:.0%} kept "
                    "free)")


def fit_micro_batch(cfg, training, tokenizer, train_examples, ranks: Ranks = Ranks()) -> tuple[object, str]:
    """`cfg` with --micro-batch-tokens fitted to the training device's memory (`training`: launch.setup.Training),
    at most the default cap (departure 4), and the line that says from what; the default cap where no fit came out
    (`fit_rows`)."""
    policy = training.tri.policy
    device = next(policy.parameters()).device
    rows = stand_in_groups(cfg, tokenizer, train_examples, policy.get_input_embeddings().num_embeddings, device)
    fitted, note = fit_rows(training.tri, training.optimizer, rows, cfg)
    if ranks.size > 1:  # every rank cuts alike: the smallest fit (departure 3)
        fitted = int(-distributed.max_values([-(fitted or MICRO_BATCH_TOKENS)], ranks, device)[0])
        note += f"; {fitted} on every rank (the smallest)"
    if fitted is None:
        return dataclasses.replace(cfg, micro_batch_tokens=MICRO_BATCH_TOKENS), f"{note}: the default {MICRO_BATCH_TOKENS}"
    if fitted > MICRO_BATCH_TOKENS:
        fitted, note = MICRO_BATCH_TOKENS, f"{note}; the cap, {MICRO_BATCH_TOKENS} (fits)"
    if fitted < cfg.group_size * (len(rows[0][0]) + cfg.max_new_tokens):
        note += ("; less than one group of the first prompt's full-length rows: such a group trains alone, and may not "
                 "fit")
    return dataclasses.replace(cfg, micro_batch_tokens=fitted), note
