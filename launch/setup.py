"""Everything between the options and the loop: what `periodic_rl.train` stands on, and what runs around it.

    options, policy (θ_0), tokenizer, task, rewards       (trainer.py)
      -> the tri-model, AdamW and its learning-rate schedule `build_tri_model`, `build_optimizer`, `disable_dropout`
      -> θ_k and AdamW's state from a checkpoint           (infra/checkpoint.py, --resume)
      -> the sizes left open, measured on this machine     (launch/sizing.py, --sizes probe; on a GPU the
                                                           micro-batch from its free memory, launch/memory.py)
      -> where sampling runs and on which threads          `async_runs_as_sync`, `inference_side`,
                                                           `train_threads_after_sampling`
      -> periodic_rl.train, one metrics row per iteration  checkpoints every --save-every, the trace at the end

The thread policy on CPU, where the two sides share the cores:
- `oversubscribed`: more threads than cores. Oversubscribed cores slow both sides, so the sides sample then
  train (`sample_then_train`): the trainer takes the inference side's whole iteration, held-out evaluation
  included, before it computes.
- `async_runs_as_sync`: async that samples then trains with one inference process and one thread count samples
  in the trainer's own process, which is sync's schedule exactly (the same calls, groups, threads and bits): a
  second process would overlap nothing and only add the hand-over (publishing θ_k, a message per group,
  one side's idle threads spinning into the other's time; docs/benchmarks.md).
- `train_threads_after_sampling`: when the probe split the cores, the trainer takes every core
  (--train-threads-after-sampling) once the inference side is done with θ_k (periodic_rl.py, departure 3).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from pathlib import Path
from typing import Iterator

import torch

import periodic_rl
from config import train_compiles
from inference import AsyncRollouts, SyncRollouts
from infra import checkpoint, compiled_training, completions, outputs, sharing
from infra.distributed import Ranks
from infra.options import available_cores, fits_memory, schedule_arguments, schedule_lengths
from infra.reward import as_rewards
from infra.timeline import Timeline
from launch import memory, sizing
from learner import Learner
from packing import enable_activation_checkpointing, logprobs_fn
from rollout import engine_reason, stop_token_ids
from tri_model import TriModel


# --- the training side's pieces ---
def build_tri_model(cfg, policy, pad_id: int) -> TriModel:
    """θ as trained, with θ_old and π_ref when the run needs them, scored by packing.py's shared-prompt rows (with
    --compile-train on, through compiled decoder layers: infra/compiled_training.py)."""
    compiles = train_compiles(cfg.compile_train)
    logprobs = logprobs_fn(policy, "auto" if cfg.shared_prompt else "unpacked", cfg.temperature, pad_id,
                           cfg.pad_to_multiple_of or 1, dense_mask=compiles)
    if compiles:
        logprobs = compiled_training.compiled_scorer(logprobs)
    steps = cfg.updates_per_iteration * cfg.num_iterations  # optimizer steps per iteration: > 1 moves θ off θ_k
    return TriModel(policy, logprobs, use_reference=cfg.beta > 0, use_old=steps > 1,
                    compute_dtype=getattr(torch, cfg.dtype),
                    adapter_off=policy.disable_adapter if cfg.use_peft else None)  # LoRA: π_ref = the base


def build_optimizer(cfg, policy) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters and its learning-rate schedule, as TRL builds them: transformers'
    `get_scheduler` over the run's optimizer steps, warmed up as `options.schedule_lengths` says, with the
    schedule's own arguments (--lr-scheduler-kwargs); the learner steps it after each optimizer step, and
    checkpoints keep its state."""
    from transformers import get_scheduler  # here: transformers.trainer_utils imports peft (~10 s) when installed

    optimizer = adamw([p for p in policy.parameters() if p.requires_grad],  # LoRA: the adapter's
                      lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup, steps = schedule_lengths(cfg)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=steps,
                              scheduler_specific_kwargs=schedule_arguments(cfg.lr_scheduler_kwargs))
    return optimizer, scheduler


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW, one fused kernel per step where every parameter is on CUDA, else its multi-tensor (foreach)
    form: the same update, element by element, with fewer launches (docs/benchmarks.md has the measurement)."""
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None, foreach=not fused)


LOADED_RATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [(config part, attribute, rate)]


def disable_dropout(model: torch.nn.Module) -> None:
    """TRL's `disable_dropout_in_model` (every nn.Dropout's p = 0), and the rates that models read at forward time
    instead: every float attribute whose name holds "drop" set to 0, of each module (Qwen2's and Llama's
    `attention_dropout`, LayerDrop, drop-path: copied from the config when the module was built) and of the config
    (Persimmon reads `config.attention_dropout` in forward; Falcon and GPT-Neo on their flash-attention path). Then
    a forward in training mode is a function of the weights and the inputs, as the bitwise claims need. The
    config's rates as loaded are kept (`LOADED_RATES`): a save puts them back (`config_as_loaded`), so the saved
    config.json is the model's own. A LoRA adapter's dropout is --lora-dropout's to decide."""
    for name, module in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attribute, value in list(vars(module).items()):
            if "drop" in attribute and isinstance(value, float):
                setattr(module, attribute, 0.0)
    config = getattr(model, "config", None)
    loaded = LOADED_RATES.setdefault(model, [])
    for part in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: None)()) if c}.values():
        for attribute, value in list(vars(part).items()):
            if "drop" in attribute and isinstance(value, float) and value:  # (a second call finds zeros)
                loaded.append((part, attribute, value))
                setattr(part, attribute, 0.0)


@contextlib.contextmanager
def config_as_loaded(model: torch.nn.Module) -> Iterator[None]:
    """The model's config with the dropout rates it was loaded with, for the block (a save: the saved config.json is
    the model's own, not `disable_dropout`'s zeros); the zeros again afterwards."""
    loaded = LOADED_RATES.get(model, [])
    for part, attribute, value in loaded:
        setattr(part, attribute, value)
    try:
        yield
    finally:
        for part, attribute, _ in loaded:
            setattr(part, attribute, 0.0)


# --- where sampling runs, on which threads ---
def both_on_cpu(cfg) -> bool:
    """Whether sampling and training both run on CPU cores (the threads then compete)."""
    return cfg.rollout_device.startswith("cpu") and cfg.train_device.startswith("cpu")


def oversubscribed(cfg) -> bool:
    """Whether the two sides must not compute at once: on CPU, more threads than cores (then async samples then
    trains, sync's schedule: in one process when `async_runs_as_sync`)."""
    rollout_threads = max(cfg.rollout_threads, cfg.inference_workers)  # each worker has at least one
    return both_on_cpu(cfg) and rollout_threads + cfg.train_threads > available_cores()


def async_runs_as_sync(cfg, ranks: Ranks = Ranks()) -> bool:
    """Whether async mode samples in the trainer's own process: when the cores are `oversubscribed`, with one
    local inference process and one thread count for sampling, training and training after sampling, as the
    probe sets them when it chooses to sample then train (else sampling would change threads). Needs the thread
    counts (after sizing)."""
    one_count = cfg.rollout_threads == cfg.train_threads == cfg.train_threads_after_sampling
    return (cfg.mode == "async" and cfg.inference_workers == 1 and not ranks.inference and one_count
            and oversubscribed(cfg))


def samples_elsewhere(cfg, ranks: Ranks = Ranks()) -> bool:
    """Whether the run needs an inference side outside this process: async mode, unless it is known (the sizes
    given) to sample then train in one process (`async_runs_as_sync`); with sizes open, the probe decides after the
    start."""
    return cfg.mode == "async" and not (cfg.sized and async_runs_as_sync(cfg, ranks))


def train_threads_after_sampling(cfg, ranks: Ranks) -> int | None:
    """--train-threads-after-sampling, when the trainer switches to it once sampling is done, or None: async on CPU
    with one inference process, and more threads than --train-threads (the probe sets every core when it splits
    them; given, as given; saved with the run, so a resumed run switches alike)."""
    single = ranks.size == 1 and not ranks.inference and cfg.inference_workers == 1
    switches = (cfg.mode == "async" and both_on_cpu(cfg) and single
                and cfg.train_threads_after_sampling > cfg.train_threads)  # never fewer
    return cfg.train_threads_after_sampling if switches else None


def inference_side(cfg, load_kwargs: dict, train_examples, held_out, load: bool = True, ranks: Ranks = Ranks()):
    """A `with` block owning the inference process from spawn to stop (async mode; it loads its model at once
    unless load=False; it samples this rank's generate calls), or, with inference ranks, the handle on them
    (launch/remote.py); in sync mode there is none (None)."""
    if not samples_elsewhere(cfg, ranks):
        return contextlib.nullcontext()
    if ranks.inference:  # samplers of their own, over torch.distributed
        from launch.remote import RemoteRollouts
        return RemoteRollouts(ranks, getattr(torch, cfg.dtype))
    load_kwargs = {**load_kwargs, "dtype": getattr(torch, cfg.dtype)}  # its weights: the compute dtype
    with sharing.mps_share(cfg):  # one GPU through MPS: the inference process's share of the SMs, set at its spawn
        return AsyncRollouts(cfg.model, load_kwargs, train_examples, held_out, cfg.reward, load=load,
                             workers=cfg.inference_workers, call_slice=ranks.call_slice,
                             reward_weights=cfg.reward_weights)


def sampler_here(cfg, policy, tokenizer, train_examples, held_out, rewards, load_kwargs: dict, compute_dtype,
                 ranks: Ranks) -> SyncRollouts:
    """Sampling in the trainer's process (sync, and async that samples then trains): from the policy itself, or
    from a copy in the compute dtype if it differs (as the inference process samples from bf16 weights)."""
    sampler = None
    if compute_dtype != policy.dtype:
        from infra.models import load_model
        device = str(next(policy.parameters()).device)
        sampler, _ = load_model(cfg.model, **{**load_kwargs, "dtype": compute_dtype, "device": device})
    return SyncRollouts(policy, tokenizer, train_examples, held_out, rewards, cfg, sampler,
                        workers=cfg.inference_workers, call_slice=ranks.call_slice)  # the slices, one after another


# --- the run's pieces, as trainer.started builds them ---
@dataclasses.dataclass
class Training:
    """The training side before the loop: the tri-model, AdamW and its schedule, θ_0's fingerprint (what a checkpoint
    is tied to; '' when the run keeps none) and the iteration to start at (a resumed run's)."""
    tri: TriModel
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LRScheduler
    theta_0: str
    first: int


def training_side(cfg, policy, tokenizer, resume_from: Path | None = None) -> Training:
    """The policy as trained (θ, with θ_old and π_ref when needed), AdamW, and θ_k from `resume_from` if given."""
    if cfg.disable_dropout:  # before the frozen copies are taken (they run in eval mode anyway)
        disable_dropout(policy)
    if cfg.gradient_checkpointing:  # the policy's layers recompute activations in backward (training mode only)
        enable_activation_checkpointing(policy)
    tri = build_tri_model(cfg, policy, tokenizer.pad_token_id)
    optimizer, scheduler = build_optimizer(cfg, policy)
    # a long run's checkpoints: θ_k, AdamW's state and the schedule's, tied to θ_0 (the reference) by its fingerprint
    keeps_checkpoints = bool(cfg.save_every or cfg.save_on_stop or resume_from)
    theta_0 = checkpoint.fingerprint(policy) if keeps_checkpoints else ""
    first = checkpoint.restore(resume_from, policy, optimizer, theta_0, scheduler) if resume_from else 0
    reason = engine_reason(policy, cfg)
    if reason and cfg.engine != "hf":  # (--engine hf asked for it)
        print(f"periodic-rl: sampling with Hugging Face generate, not engine.py: {reason}", flush=True)
    if cfg.use_peft and cfg.lora_dropout:
        print(f"periodic-rl: --lora-dropout {cfg.lora_dropout}: its masks come from a random state that checkpoints do "
              "not keep and sync mode's sampling reseeds, so resume and async == sync hold in distribution, not "
              "bitwise (0 keeps them bitwise)", flush=True)
    return Training(tri, optimizer, scheduler, theta_0, first)


def sampling_side(cfg, training: Training, policy, tokenizer, train_examples, held_out, rewards, load_kwargs: dict,
                  rollouts: AsyncRollouts | None = None, ranks: Ranks = Ranks()):
    """(the config with its sizes, where sampling runs, the learner): the sizes left open measured (--sizes probe)
    or set by rule (launch/sizing.py), then the inference process (async) or a sampler here (sync, and async that
    samples then trains), on a GPU the micro-batch fitted to the memory they leave (launch/memory.py), and the learner on the same
    timeline."""
    if rollouts is None and samples_elsewhere(cfg, ranks):
        raise ValueError("async mode samples in the inference process: pass `rollouts` (see inference_side)")
    if rollouts is not None and not cfg.sized:
        rollouts.wait_until_loaded()  # the probe times this machine's cores, not the inference side's loading; the
        # memory fit counts the inference side's weights on a shared GPU
    fit_memory = fits_memory(cfg)  # the micro-batch from the device's free memory, once all resident weights are there
    if not fit_memory:
        cfg, probed = sizing.choose_for_ranks(cfg, training.tri, tokenizer, train_examples, ranks,
                                              rollouts.check_alive if rollouts is not None else lambda: None)
        say_sizes(cfg, probed)
    torch.set_num_threads(cfg.train_threads)
    if async_runs_as_sync(cfg, ranks):
        if rollouts is not None:  # started for the probe, which chose to sample then train: nothing left to do
            rollouts.close()
        rollouts = None
        cores = available_cores()
        hint = (f" (--rollout-threads {cores // 2} --train-threads {cores - cores // 2} would run the two sides at "
                "once, in two processes)") if cores > 1 else ""
        print("periodic-rl: async -> sync: at these sizes the two sides would sample then train (more threads than "
              "cores): sampling in this process, "
              f"sync's schedule, no inference process{hint}", flush=True)
    if rollouts is not None:
        rollouts.attach(policy, cfg, cfg.rollout_threads)  # θ's buffer, the config, its threads
        timeline = rollouts.timeline  # both processes' spans on one timeline
    else:
        rollouts = sampler_here(cfg, policy, tokenizer, train_examples, held_out, rewards, load_kwargs,
                                training.tri.compute_dtype, ranks)
        timeline = Timeline()
    if fit_memory:
        cfg, fitted = memory.fit_micro_batch(cfg, training, tokenizer, train_examples, ranks)
        say_sizes(cfg, fitted)
    learner = Learner(training.tri, training.optimizer, cfg, next(policy.parameters()).device, timeline, ranks,
                      as_rewards(rewards).names, training.scheduler, stop_token_ids(policy, tokenizer))
    return cfg, rollouts, learner


def say_sizes(cfg, how: str) -> None:
    """The sizes line, as flags that fix them, and how they were chosen (the probe's or the memory fit's line)."""
    print(f"periodic-rl: sizes: --groups-per-call {cfg.groups_per_call} ({cfg.calls_per_iteration} generate "
          f"call(s) per iteration) --micro-batch-tokens {cfg.micro_batch_tokens} --rollout-threads "
          f"{cfg.rollout_threads} --train-threads {cfg.train_threads} --train-threads-after-sampling "
          f"{cfg.train_threads_after_sampling} (pass these to fix them)"
          + (f"\nperiodic-rl: {how}" if how else ""), flush=True)


def sample_then_train(cfg, ranks: Ranks = Ranks()) -> bool:
    """Whether the trainer takes the inference side's whole iteration before computing (N workers; inference
    ranks are hosts of their own)."""
    return cfg.mode == "async" and oversubscribed(cfg) and not ranks.inference


def checkpointed(rows: Iterator[dict], cfg, training: Training, learner: Learner, tokenizer, train_prompts: int,
                 ranks: Ranks = Ranks(), on_completions=lambda records: None) -> Iterator[dict]:
    """`periodic_rl.train`'s rows, each with TRL's epoch (and its completions told, with --log-completions), a
    checkpoint every --save-every iterations, and the trace written at the end.

    A stop signal (KeyboardInterrupt) at any moment keeps a checkpoint of the iterations done when --save-every or
    --save-on-stop asks for one: the last completed iteration (its optimizer step done, its row out first; a stop
    inside the step waits for its end, learner.py), never a half-done one (with N·μ > 1 steps per iteration, a stop
    after its first step keeps none: θ_k and AdamW's state at k are gone).
    """
    policy, timeline, first = training.tri.policy, learner.timeline, training.first

    def save_checkpoint(iterations_done: int) -> None:
        with timeline.span(f"checkpoint {iterations_done}"), config_as_loaded(policy):
            checkpoint.save(cfg.out, iterations_done, policy, tokenizer, training.optimizer, cfg, training.theta_0,
                            cfg.keep_checkpoints, training.scheduler)
    logged, in_hand = first, None  # iterations whose row is out; a row not yet out
    try:
        for row in rows:
            in_hand = row
            if not row.get("final"):  # TRL's epoch: passes over the training prompts so far (--num-train-epochs')
                row["epoch"] = (row["iteration"] + 1) * cfg.prompts_per_iteration / train_prompts
            if cfg.log_completions and not row.get("final"):  # every rank's samples (under torchrun, a collective)
                on_completions(completions.gathered(row["iteration"], learner.taken, tokenizer, learner.reward_names,
                                                    ranks))
            if not row.get("final"):
                logged = row["iteration"] + 1
            in_hand = None
            yield row
            if not row.get("final") and cfg.save_every and logged % cfg.save_every == 0:
                save_checkpoint(logged)  # an exact resume point (after the row is out)
    except KeyboardInterrupt:  # a stop signal (trainer.py): keep the iterations done, if that state is exact
        done = learner.iterations_done()  # None half-way through an iteration's steps: not an exact state
        if in_hand is not None and not in_hand.get("final") and done == in_hand["iteration"] + 1:
            with contextlib.suppress(KeyboardInterrupt):  # the row of the iteration done goes out first (the caller
                yield in_hand                             # writes it, then throws the stop back in)
            logged = done
        if (cfg.save_every or cfg.save_on_stop) and done == logged != first:  # and each iteration's row is out
            with contextlib.suppress(OSError, ValueError):  # (stdout closed: the stop's line says the rest)
                print(f"periodic-rl: stopping: writing the checkpoint of the {done} iterations done first",
                      flush=True)  # (seconds for a big model: said at once)
            save_checkpoint(done)
        raise
    finally:
        rows.close()
        if cfg.trace:
            with outputs.writing("the trace", cfg.trace):
                timeline.write_chrome_trace(cfg.trace)
