"""The options' machinery: the command line of `config.Config` (its parser), the defaults derived from the model and
the hardware, and the validation of every field. Reading argv into a Config (a --config file's options first, TRL's
flags made ours, then parse, validate, derive) is infra/command_line.py's.

TRL's names (infra/trl_names.py). An option of TRL 1.16's GRPOConfig (or of its CLI's script and model arguments)
that means what one of ours means is accepted under TRL's name too, on the command line and as a --config key
(`TRL_ALIASES`: e.g. --num-generations is --group-size, --learning-rate --lr, --epsilon both clip ranges unless
--epsilon-high is given, as TRL's); `--name_with_underscores` is read as `--name-with-underscores`, as TRL's parser
reads both. A TRL name whose meaning differs here (num_generations_eval) is refused with one line naming the
option to use and why (`TRL_DIFFERENT`); any other unknown option gets the name it misspells, if one is close
(`closest_name`; none for a name that merely shares words with one of ours).
Abbreviations are not expanded (argparse's allow_abbrev), so --epsilon is never "ambiguous".
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import math
import os
import textwrap
import typing

from config import MODEL_ALIASES, SECTIONS, SIZE_FIELDS, TINY_MODELS, Config, is_model_name
from infra import sharing
from infra.tracking import installed_trackers
from infra.trl_names import TRL_ALIASES, TRL_DIFFERENT, TRL_FIXED, TRL_UNUSED, epilog

GENERATE_CALLS = {"cpu": 2, "accelerator": 1}  # default generate calls per iteration (see derive)
# Default training micro-batch: 16 toy groups (~1.5 k tokens) in one forward; 2-3 groups of 8 x (256 + 512) tokens
# (Qwen2.5-0.5B with --gradient-checkpointing: 6.5 GiB for one such group in float32, docs/benchmarks.md).
MICRO_BATCH_TOKENS = 16384
# Default --pad-to-multiple-of on GPUs and NPUs: cuDNN's attention (first choice of torch's SDPA on recent GPUs with a
# recent cuDNN) builds a graph for each new shape, so rows of a new length each micro-batch and call pay a build
# each; with lengths rounded up to 128 a few shapes recur (docs/benchmarks.md, "Shapes on a GPU"). TRL pads to 128 on
# Neuron for the same reason (it compiles per shape).
PAD_MULTIPLE_ACCELERATOR = 128
MEMORY_FIT_DEVICES = ("cuda", "npu")  # trainers whose micro-batch --sizes probe fits to the free memory (launch/memory.py)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity: a container's or `taskset`'s share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def detect_accelerator() -> str:
    """'cuda' if torch sees a CUDA GPU, else 'npu' if torch_npu is installed and sees an NPU, else 'cpu'.

    torch_npu is imported only here, and only on machines without CUDA.
    """
    import torch
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401  (registers the 'npu' device with torch)
    except Exception:  # not installed, or installed without its runtime: no NPU
        return "cpu"
    return "npu" if torch.npu.is_available() else "cpu"


def accelerator_count(kind: str) -> int:
    import torch
    return 0 if kind == "cpu" else getattr(torch, kind).device_count()


def pick_devices(device: str, mode: str, workers: int = 1) -> tuple[str, str]:
    """(inference device(s), training device) for --device.

    auto: the accelerator this machine has (`detect_accelerator`); with N inference workers and at least N + 1
    devices, worker w on :w and training on :N (one worker, two devices: inference on :0, training on :1), else
    all on :0. Sync mode runs both sides in one process: both on the first device.
    """
    if device == "auto":
        kind = detect_accelerator()
        if kind == "cpu":
            return "cpu", "cpu"
        count = accelerator_count(kind)
        if count > workers:
            rollout, train = ",".join(f"{kind}:{w}" for w in range(workers)), f"{kind}:{workers}"
        else:
            rollout = train = f"{kind}:0"
    else:
        rollout = train = device
    return (rollout.split(",")[0],) * 2 if mode == "sync" else (rollout, train)


def pick_dtype(dtype: str, train_device: str) -> str:
    """auto -> bfloat16 where the training device computes in bf16 natively (recent GPUs, NPUs), else float32."""
    if dtype != "auto":
        return dtype
    kind = train_device.split(":")[0]
    if kind == "cuda":
        import torch
        if not torch.cuda.is_available():
            return "float32"  # launch/start.check_device reports the missing GPU in one line
        with torch.cuda.device(train_device):  # native bf16 (Ampere and newer), not the emulation on V100/T4
            return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float32"
    return "bfloat16" if kind == "npu" else "float32"


def derive(cfg: Config) -> Config:
    """Fill the model- and hardware-dependent defaults and the thread split; returns a new Config."""
    cores = available_cores()
    if cfg.mode == "auto":  # async where the sides can compute at once, else sync (infra/sharing.py)
        rollout_device, train_device = pick_devices(cfg.device, "async", cfg.inference_workers)
        cfg = dataclasses.replace(cfg, mode=sharing.auto_mode(
            cfg.rollout_device or rollout_device, cfg.train_device or train_device, cfg.inference_workers,
            cfg.inference_ranks)[0])
    rollout_device, train_device = pick_devices(cfg.device, cfg.mode, cfg.inference_workers)
    rollout_device = cfg.rollout_device or rollout_device
    train_device = cfg.train_device or train_device
    on_accelerator = rollout_device.split(":")[0] != "cpu"
    # Groups stream to the trainer in completion order from inside each generate call, so a big call no
    # longer delays the pipeline by its longest response. On an accelerator a decode step costs about the
    # same for 8 rows as for 512 (memory-bound: every step reads all weights once): one call per iteration.
    # On CPU a call has a fixed cost (~30 ms for the tiny model: 9 decode steps of generate's bookkeeping)
    # and responses of a toy task end together, so two calls: the second's decoding overlaps the first's
    # training (docs/benchmarks.md, `bench.py peer`). Same in both modes: a seed's rollouts do not depend
    # on --mode.
    # With --sizes probe on CPU, the sizes not given stay None here: `sizing.choose` measures and fills them.
    probed = cfg.sizes == "probe" and not on_accelerator
    calls = GENERATE_CALLS["accelerator" if on_accelerator else "cpu"]
    if cfg.inference_workers > 1:  # at least one call per worker, whatever the probe would pick (it models one)
        calls, probed_calls = max(calls, cfg.inference_workers), False
    else:
        probed_calls = probed
    groups_per_call = cfg.groups_per_call or (None if probed_calls else math.ceil(cfg.prompts_per_iteration / calls))
    generate_calls = math.ceil(cfg.prompts_per_iteration / (groups_per_call or 1))  # per iteration
    # Sync mode runs one side at a time: all cores. So does async when an iteration is a single generate call
    # (nothing to overlap: the two sides sample then train); otherwise they run at once and split the cores, since
    # oversubscribed cores slow both (docs/benchmarks.md, "Generate calls: batching against streaming").
    sample_then_train = cfg.mode == "sync" or generate_calls == 1
    rollout_threads = cfg.rollout_threads or (None if probed else cores if sample_then_train else max(1, cores // 2))
    train_threads = cfg.train_threads or (None if probed else cores if sample_then_train
                                          else max(1, cores - rollout_threads))
    if cfg.mode == "sync" and probed:  # one side at a time: all cores; the probe chooses calls and micro-batch
        rollout_threads, train_threads = rollout_threads or cores, train_threads or cores
    after_sampling = cfg.train_threads_after_sampling or train_threads  # (None while the probe is to choose the split)
    # On a GPU or NPU trainer the micro-batch is lowered to what its memory holds, once the model is there (memory.py);
    # not under bnpo, whose loss would then change with the free memory.
    fitted = (cfg.sizes == "probe" and not probed and train_device.split(":")[0] in MEMORY_FIT_DEVICES
              and cfg.loss_type != "bnpo")
    return dataclasses.replace(
        cfg,
        max_new_tokens=cfg.max_new_tokens or (TINY_MODELS[cfg.model][1] if cfg.is_tiny else 512),
        eval_size=cfg.eval_size if cfg.eval_size is not None or cfg.eval_every else 0,  # None: launch/start.prepare's
        lr=learning_rate(cfg),
        eval_samples=cfg.eval_samples if cfg.eval_samples is not None else (4 if cfg.is_tiny else 1),
        reward_weights=cfg.reward_weights or [1.0] * len(cfg.reward),
        report_to=installed_trackers() if cfg.report_to == ["all"] else cfg.report_to,
        top_k=max(cfg.top_k, 0),  # -1: vLLM's off, which TRL passes on; 0 here
        groups_per_call=groups_per_call,
        micro_batch_tokens=cfg.micro_batch_tokens or (None if probed or fitted else MICRO_BATCH_TOKENS),
        pad_to_multiple_of=cfg.pad_to_multiple_of or (PAD_MULTIPLE_ACCELERATOR if on_accelerator
                                                      or not train_device.startswith("cpu") else 1),
        rollout_device=rollout_device,
        train_device=train_device,
        dtype=pick_dtype(cfg.dtype, train_device),
        rollout_threads=rollout_threads,
        train_threads=train_threads,
        train_threads_after_sampling=after_sampling,
    )


def fits_memory(cfg: Config) -> bool:
    """Whether `derive` left the micro-batch, and it alone, to be fitted to the training device's memory
    (launch/memory.py: --sizes probe on a GPU or NPU trainer, --micro-batch-tokens not given, not bnpo)."""
    return (cfg.micro_batch_tokens is None and cfg.sizes == "probe" and cfg.loss_type != "bnpo"
            and cfg.train_device.split(":")[0] in MEMORY_FIT_DEVICES
            and all(getattr(cfg, name) for name in SIZE_FIELDS if name != "micro_batch_tokens"))


NEEDS_ARGUMENTS = ("cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")  # transformers' say so


def schedule_arguments(text: str | None) -> dict:
    """--lr-scheduler-kwargs as a mapping ({} when not given); ValueError when it is not a JSON object."""
    try:
        kwargs = {} if text is None else json.loads(text)
    except ValueError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--lr-scheduler-kwargs must be a JSON object, e.g. '{{\"min_lr_rate\": 0.1}}' (got {text!r})")
    return kwargs


def schedule_lengths(cfg: Config) -> tuple[int, int]:
    """(warm-up steps, optimizer steps) of the run's learning-rate schedule: iterations x updates-per-iteration x
    num-iterations optimizer steps, warmed up over the first ceil(warmup_ratio x steps) (transformers'
    `get_warmup_steps`), or warmup_steps of them (below 1: a fraction, as transformers 5 reads it)."""
    steps = cfg.iterations * cfg.updates_per_iteration * cfg.num_iterations
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 1 else math.ceil(steps * (cfg.warmup_steps or cfg.warmup_ratio))
    return int(warmup), steps


def schedule_problem(cfg: Config) -> str | None:
    """Why --lr-scheduler-type with --lr-scheduler-kwargs does not give a learning rate at every step, in one line
    (None: it does): the schedule is built on a one-parameter optimizer at the run's rate and evaluated at every
    step, 0 to the step after the last (the learner steps it after each optimizer step), so transformers' own
    refusal (a missing min_lr_rate, an argument the schedule does not take), an arithmetic error (a negative power
    at the last step, a timescale of 0) or a rate that is not a finite number >= 0 comes before any model loads. A
    non-finite argument (NaN, Infinity: JSON as Python reads them) is refused first: schedules clamp their rate
    with max(0, rate), which makes a NaN rate 0 at every step, a run that trains nothing. constant and
    constant_with_warmup take no arguments, and transformers would drop them silently: refused here."""
    import torch  # here: parsing options needs no torch unless a schedule takes arguments
    from transformers import get_scheduler

    option = f"--lr-scheduler-type {cfg.lr_scheduler_type}"
    given = f" with --lr-scheduler-kwargs {cfg.lr_scheduler_kwargs}" if cfg.lr_scheduler_kwargs else ""
    try:
        kwargs = schedule_arguments(cfg.lr_scheduler_kwargs)
        if kwargs and cfg.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return f"{option} takes no --lr-scheduler-kwargs (got {cfg.lr_scheduler_kwargs})"
        if bad := [k for k, v in kwargs.items() if isinstance(v, float) and not math.isfinite(v)]:
            return f"{option}{given}: {', '.join(bad)} must be a finite number"
        warmup, steps = schedule_lengths(cfg)
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=learning_rate(cfg))
        scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                  num_training_steps=max(steps, 1), scheduler_specific_kwargs=kwargs)
    except (ValueError, TypeError) as error:
        if str(error).startswith("--lr-scheduler-kwargs"):
            return str(error)
        hint = "" if given else " (--lr-scheduler-kwargs gives the schedule's arguments, as a JSON object)"
        return f"{option}{given} does not build: {str(error).splitlines()[0]}{hint}"
    except ArithmeticError as error:  # the rate at step 0, computed as the schedule is built
        return f"{option}{given} fails after 0 of its {steps} optimizer steps: {type(error).__name__}: {error}"
    for step in range(max(steps, 1) + 1):
        try:
            rate = scheduler.lr_lambdas[0](step)  # LambdaLR: the rate is lr x this, after `step` optimizer steps
        except (ArithmeticError, ValueError, TypeError) as error:  # 0.0 ** -1, x / 0, math.sqrt(-1)
            return f"{option}{given} fails after {step} of its {steps} optimizer steps: {type(error).__name__}: {error}"
        if not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:  # (a complex: (-1) ** 0.5)
            return (f"{option}{given} gives the learning rate {learning_rate(cfg) * rate:g} after {step} of its "
                    f"{steps} optimizer steps: a rate must be a finite number >= 0")
    return None


def learning_rate(cfg: Config) -> float:
    """--lr, or its default: 1e-4 for the tiny models, 1e-6 otherwise."""
    return cfg.lr if cfg.lr is not None else (1e-4 if cfg.is_tiny else 1e-6)


def _is_device_name(name: str) -> bool:
    kind, _, index = name.partition(":")
    return kind in ("cpu", "cuda", "npu") and (index == "" or index.isdigit() and kind != "cpu")


def validate(cfg: Config) -> list[str]:
    """Every problem with `cfg`, one line each (empty when valid)."""
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(bool(cfg.model.strip()), f"--model {cfg.model!r} names no model (an unset shell variable?): give 'tiny', an "
                                  "alias such as qwen2.5-0.5b, a hub id or a local directory")
    need(cfg.group_size >= 2, f"--group-size must be at least 2 (got {cfg.group_size}): "
                              "group-relative advantages need two responses to compare")
    whole_groups = cfg.batch_size > 0 and cfg.batch_size % max(cfg.group_size, 1) == 0
    need(whole_groups,
         f"--batch-size must be a positive multiple of --group-size (got {cfg.batch_size} and {cfg.group_size})")
    need(cfg.iterations >= 1, f"--iterations must be at least 1 (got {cfg.iterations})")
    need(cfg.num_train_epochs is None or cfg.num_train_epochs > 0,
         f"--num-train-epochs must be positive (got {cfg.num_train_epochs})")
    need(cfg.updates_per_iteration >= 1,
         f"--updates-per-iteration must be at least 1 (got {cfg.updates_per_iteration})")
    if whole_groups and cfg.group_size >= 1 and cfg.updates_per_iteration >= 1:
        need(cfg.prompts_per_iteration % cfg.updates_per_iteration == 0,
             f"--updates-per-iteration ({cfg.updates_per_iteration}) must divide the prompts per iteration "
             f"({cfg.prompts_per_iteration} = batch-size / group-size): mini-batches are whole groups")
    if guess := misspelt_model(cfg.model):
        problems.append(f"--model {cfg.model}: not a folder, nor a name this trainer knows: did you mean {guess}? (a "
                        "hub id is org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct)")
    need(cfg.groups_per_call is None or cfg.groups_per_call >= 1,
         f"--groups-per-call must be at least 1 (got {cfg.groups_per_call})")
    need(cfg.micro_batch_tokens is None or cfg.micro_batch_tokens >= 1,
         f"--micro-batch-tokens must be at least 1 (got {cfg.micro_batch_tokens})")
    if cfg.chat_template_kwargs is not None:
        from infra.tasks import TaskError, template_kwargs
        try:
            template_kwargs(cfg.chat_template_kwargs)
        except TaskError as error:
            problems.append(str(error))
    for f in dataclasses.fields(cfg):  # inf and nan parse as floats; no option means them
        value = getattr(cfg, f.name)
        need(not isinstance(value, float) or math.isfinite(value),
             f"--{f.name.replace('_', '-')} must be a finite number (got {value})")
    need(0 <= cfg.seed < 2**64, f"--seed must be from 0 to 2**64 - 1, a 64-bit seed (got {cfg.seed})")
    need(cfg.lr is None or cfg.lr > 0, f"--lr must be positive (got {cfg.lr})")
    need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0 (got {cfg.weight_decay})")
    weights = cfg.reward_weights
    need(weights is None or len(weights) == len(cfg.reward),
         f"--reward-weights has {len(weights or [])} number(s) but --reward names {len(cfg.reward)} function(s) "
         f"({' '.join(cfg.reward)}): give one weight per reward, in the same order")
    need(all(math.isfinite(w) for w in weights or []), f"--reward-weights must be finite numbers (got {weights})")
    need(cfg.reward_timeout >= 0, f"--reward-timeout must be >= 0 seconds, 0 for no limit (got {cfg.reward_timeout})")
    need(cfg.beta >= 0, f"--beta must be >= 0 (got {cfg.beta})")
    need(cfg.epsilon_low >= 0 and cfg.epsilon_high >= 0, "--epsilon-low and --epsilon-high must be >= 0")
    need(cfg.temperature > 0, f"--temperature must be positive (got {cfg.temperature})")
    need(0 < cfg.top_p <= 1, f"--top-p must be in (0, 1] (got {cfg.top_p})")
    need(cfg.warmup_steps >= 0 and (cfg.warmup_steps < 1 or cfg.warmup_steps == int(cfg.warmup_steps)),
         f"--warmup-steps must be a whole number of steps, or a fraction below 1 (got {cfg.warmup_steps})")
    need(not (cfg.warmup_steps and cfg.warmup_ratio), "--warmup-steps and --warmup-ratio both set the warm-up: give "
         "one")
    problem = (schedule_problem(cfg) if cfg.lr_scheduler_kwargs is not None or cfg.lr_scheduler_type in NEEDS_ARGUMENTS
               or cfg.lr_scheduler_type == "polynomial" else None)  # (its default lr_end must be below --lr)
    need(problem is None, problem)
    need(cfg.top_k >= -1, f"--top-k must be 0 or -1 (off: TRL's and vLLM's), or a positive number of tokens "
         f"(got {cfg.top_k})")
    need(cfg.min_p is None or 0 <= cfg.min_p <= 1, f"--min-p must be in [0, 1] (got {cfg.min_p})")
    need(cfg.max_new_tokens is None or cfg.max_new_tokens >= 1,
         f"--max-new-tokens must be at least 1 (got {cfg.max_new_tokens})")
    need(cfg.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (got {cfg.max_grad_norm})")
    need(not (cfg.compile_train == "on" and cfg.gradient_checkpointing), "--compile-train on (TRL: "
         "--torch-compile) and --gradient-checkpointing cannot be combined: the recomputation in backward runs the "
         "layers eagerly, whose saved tensors are not the compiled forward's; give one of them")
    if cfg.use_peft:  # (without it the --lora-* options are ignored, said in one line: command_line.parse_args)
        need(cfg.lora_r >= 1, f"--lora-r must be at least 1, the adapter's rank (got {cfg.lora_r})")
        need(cfg.lora_alpha > 0, f"--lora-alpha must be positive (got {cfg.lora_alpha})")
        need(0 <= cfg.lora_dropout < 1, f"--lora-dropout must be in [0, 1) (got {cfg.lora_dropout})")
    need(cfg.eval_every >= 0 and (cfg.eval_size is None or cfg.eval_size >= 0)
         and (cfg.eval_samples is None or cfg.eval_samples >= 1),
         "--eval-every and --eval-size must be >= 0, --eval-samples >= 1")
    need(not cfg.eval_every or cfg.eval_size != 0, f"--eval-every {cfg.eval_every} evaluates held-out prompts, and "
         "--eval-size is 0 (a run started with --eval-every 0 holds none out of training): give --eval-size N, or "
         "--eval-every 0")
    cores = available_cores()
    for name in ("rollout_threads", "train_threads", "train_threads_after_sampling"):
        value = getattr(cfg, name)
        need(value is None or 1 <= value <= cores, f"--{name.replace('_', '-')} must be from 1 to {cores}, the CPU "
                                                   f"cores this process may use (got {value})")
    for name in ("device", "rollout_device", "train_device"):
        value = getattr(cfg, name)
        names = value.split(",") if name == "rollout_device" and value else [value]
        need(value is None or value == "auto" and name == "device" or all(map(_is_device_name, names)),
             f"--{name.replace('_', '-')} must be {'auto, ' if name == 'device' else ''}cpu, cuda[:N] or npu[:N] "
             f"{'(or a comma-separated list, one per inference worker) ' if name == 'rollout_device' else ''}"
             f"(got {value!r})")
    need(cfg.inference_workers >= 1, f"--inference-workers must be at least 1 (got {cfg.inference_workers})")
    whole_prompts = whole_groups and cfg.group_size >= 1  # prompts per iteration is defined
    if whole_prompts:
        need(cfg.prompts_per_iteration >= cfg.inference_workers,
             f"--inference-workers {cfg.inference_workers} is more than the {cfg.prompts_per_iteration} prompts per "
             "iteration (batch-size / group-size): a worker would have no generate call to sample")
    if cfg.rollout_device and cfg.inference_workers >= 1:
        listed = len(cfg.rollout_device.split(","))
        need(listed in (1, cfg.inference_workers),
             f"--rollout-device lists {listed} devices for {cfg.inference_workers} --inference-workers: give one "
             "device for all of them or one per worker")
    if cfg.groups_per_call and cfg.groups_per_call >= 1 and whole_prompts and cfg.inference_workers >= 1:
        calls = math.ceil(cfg.prompts_per_iteration / cfg.groups_per_call)
        need(calls >= cfg.inference_workers,
             f"--inference-workers {cfg.inference_workers} needs at least as many generate calls per iteration, but "
             f"--groups-per-call {cfg.groups_per_call} makes {calls} of the {cfg.prompts_per_iteration} prompts: "
             "lower --groups-per-call")
    need(cfg.inference_ranks >= 0, f"--inference-ranks must be >= 0 (got {cfg.inference_ranks})")
    need(cfg.inference_ranks == 0 or cfg.mode != "sync" and cfg.inference_workers == 1,
         "--inference-ranks samples on ranks of their own: it needs --mode async (or auto) and one "
         "--inference-workers (the inference ranks are the workers)")
    need(cfg.collective_timeout > 0, f"--collective-timeout must be positive (got {cfg.collective_timeout})")
    need(cfg.save_every >= 0 and cfg.keep_checkpoints >= 0, "--save-every and --keep-checkpoints must be >= 0")
    need(cfg.num_completions_to_print >= 0,
         f"--num-completions-to-print must be >= 0 (got {cfg.num_completions_to_print})")
    need(cfg.resume is None or cfg.resume.strip() != "", "--resume must name a checkpoint directory or 'auto'")
    need(cfg.resume != "auto" or cfg.out is not None, "--resume auto needs --out DIR: the run to continue "
         "(runs/latest may be another run by the time a job is resubmitted)")
    need(cfg.out is None or cfg.out.strip() != "", f"--out must name a directory (got {cfg.out!r})")
    need(cfg.trace is None or cfg.trace.strip() != "", f"--trace must name a file (got {cfg.trace!r})")
    for alone in ("none", "all"):
        need(alone not in cfg.report_to or len(set(cfg.report_to)) == 1,
             f"--report-to {alone} cannot be combined with a tracker (got {' '.join(cfg.report_to)})")
    model_path = os.path.expanduser(cfg.model)  # a local path that is not there: said before the data is loaded
    need(not (cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") > 1) or os.path.isdir(model_path),
         f"--model {cfg.model!r} is not a directory (a local model is a folder with config.json; a hub id is "
         "'org/name'" + ("; a resumed run's source model must be where its run found it: put it back, or pass --model "
                         "with the folder it is in now)" if cfg.resume else ")"))
    if cfg.data is not None:
        from infra.data import looks_like_path  # a hub id is checked when loaded
        path = os.path.expanduser(cfg.data)
        need(not looks_like_path(cfg.data) or os.path.isfile(path) or os.path.isdir(path),
             f"--data {cfg.data!r} is neither 'arithmetic', 'chain', 'gsm8k', a hub dataset id nor an existing file or "
             "directory")
    return problems


# --- command line ---
class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2, an unknown option says which one was
    meant (`unknown_option`), and no abbreviation is expanded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        unknown = [extra for extra in extras if extra.startswith("-")]
        if unknown:
            self.error("; ".join(unknown_option(extra.split("=")[0], self) for extra in unknown))
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace


def unknown_option(option: str, parser: argparse.ArgumentParser | None = None) -> str:
    """Why `option` (e.g. '--max-steps') is refused, in one line: TRL's name for something else here (which of ours
    to use), else the option it misspells, if one is close (`closest_name`)."""
    name = option.lstrip("-").replace("-", "_")
    if name in TRL_DIFFERENT:
        return f"{option} is TRL's and means something else here; use {TRL_DIFFERENT[name]}"
    if name in TRL_UNUSED:
        return f"{option} is TRL's and has no use here: {TRL_UNUSED[name]}"
    if name in TRL_FIXED:
        _, does, instead = TRL_FIXED[name]
        return f"{option} is TRL's; here {does}" + (f": use {instead}" if instead else " (no option changes it)")
    known = [string[2:].replace("-", "_") for action in (parser or build_parser())._actions
             for string in action.option_strings if string.startswith("--") and string != "--help"]
    close = closest_name(name, known)
    return f"unrecognized option {option}" + (f": did you mean --{close.replace('_', '-')}?" if close else "")


def misspelt_model(model: str) -> str | None:
    """The offline model or alias `model` misspells ("tinyy" -> "tiny"), when it is neither a folder nor a hub id
    (org/name) nor one of them; else None. Checked with the options, before the data (--model tinyy read gsm8k, the
    default data of a model that is not tiny, and failed offline on the hub before the model was named)."""
    if "/" in model or os.path.exists(os.path.expanduser(model)) or is_model_name(model):
        return None
    found = difflib.get_close_matches(model.lower(), [*TINY_MODELS, *MODEL_ALIASES], n=1, cutoff=0.8)
    return found[0] if found else None


def closest_name(name: str, names: list[str]) -> str | None:
    """The one of `names` that `name` is a misspelling of, or None: difflib's closest at a ratio of 0.8 or more, and
    word for word (split at _) each word near its own (ratio 0.6), unless the names without their _ are nearly the
    same (0.9: maxnew_tokens). A name is not a misspelling of one that merely shares a word or an ending with it
    (reward_model_name_or_path is not model_name_or_path, ddp_timeout not reward_timeout).

    >>> closest_name("num_iterationz", ["num_iterations", "iterations"]), closest_name("logging_strategy", ["lr"])
    ('num_iterations', None)
    """
    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    def near(candidate: str) -> bool:
        words, theirs = name.split("_"), candidate.split("_")
        return (len(words) == len(theirs) and all(ratio(a, b) >= 0.6 for a, b in zip(words, theirs))
                or ratio(name.replace("_", ""), candidate.replace("_", "")) >= 0.9)
    return next((close for close in difflib.get_close_matches(name, names, n=3, cutoff=0.8) if near(close)), None)


class _Epsilon(argparse.Action):
    """TRL's --epsilon: both clip ranges, unless --epsilon-high is given (before or after it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.epsilon_low = values
        if not getattr(namespace, "_epsilon_high_given", False):
            namespace.epsilon_high = values


class _EpsilonHigh(argparse._StoreAction):
    """--epsilon-high, remembered as given (TRL's --epsilon then leaves it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace._epsilon_high_given = True


BOOL_WORDS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}


class _Switch(argparse.BooleanOptionalAction):
    """A yes/no option: --name and --no-name, or a value as TRL's parser takes it (--name true, --name False,
    --name=0: transformers' HfArgumentParser, string_to_bool)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"  # BooleanOptionalAction takes no value

    def __call__(self, parser, namespace, values, option_string=None):
        negated = option_string.startswith("--no-")
        if values is None:
            setattr(namespace, self.dest, not negated)
        elif negated:
            parser.error(f"{option_string} takes no value (got {values!r})")
        elif values.lower() in BOOL_WORDS:
            setattr(namespace, self.dest, BOOL_WORDS[values.lower()])
        else:
            parser.error(f"{option_string} takes true or false, or no value (got {values!r})")


def _argument_type(annotation: str):
    """The scalar type of a field annotation such as 'int | None' or 'list[float] | None' (annotations are strings
    here), and whether it is a list."""
    names = {"int": int, "float": float, "str": str, "bool": bool}
    part = [part.strip() for part in annotation.split("|") if part.strip() != "None"][0]
    is_list = part.startswith("list[")
    return names[part[5:-1] if is_list else part], is_list


# Options renamed to say what they are: the old name, typed or as a key of a --config file, a config.json or a
# checkpoint's state.json, is read as the new one (and not listed in --help)
RENAMED = {"groups_per_chunk": "groups_per_call", "tail_threads": "train_threads_after_sampling"}


def with_new_names(values: dict) -> dict:
    """`values` (option name -> value) with each old name (RENAMED) as its new one; the new one wins if both are there.

    >>> with_new_names({"groups_per_chunk": 4, "lr": 0.1})
    {'groups_per_call': 4, 'lr': 0.1}
    """
    return {RENAMED.get(key, key): value for key, value in values.items()
            if not (key in RENAMED and RENAMED[key] in values)}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help with each default once: appended only where the help line does not already state it; an option's
    TRL name (TRL_ALIASES) is said in its help line, not listed beside it, an old name (RENAMED) not at all; the
    epilog as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default" in (action.help or "") or action.default in (None, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:  # never inside an option's name (--num-generations)
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        aliases = {"--" + prefix + name.replace("_", "-") for name in [*TRL_ALIASES, *RENAMED] for prefix in ("", "no-")}
        shown = [string for string in action.option_strings if string not in aliases]
        if isinstance(action, _Switch):  # as BooleanOptionalAction shows itself: --name, --no-name
            return ", ".join(shown)
        listed = copy.copy(action)
        listed.option_strings = shown
        return super()._format_action_invocation(listed)


def build_parser(prog: str = "trainer.py", defaults: bool = True) -> argparse.ArgumentParser:
    """The command line of Config, its options grouped as config.SECTIONS; defaults=False leaves out every option
    not given (see infra/command_line.given_options)."""
    parser = OneLineParser(prog=prog, usage="%(prog)s [options]", description="GRPO with periodic asynchrony "
                            "(arXiv 2511.18871). Every option, by group:",
                            formatter_class=_HelpFormatter, epilog=epilog())
    starts, group = dict((first, title) for title, first in SECTIONS), parser
    trl_names = {ours: "--" + trl.replace("_", "-") for trl, ours in TRL_ALIASES.items()}
    for f in dataclasses.fields(Config):
        if f.name in starts:
            group = parser.add_argument_group(starts[f.name])
        flags = ["--" + f.name.replace("_", "-")] + ([trl_names[f.name]] if f.name in trl_names else []) + [
            "--" + old.replace("_", "-") for old, new in RENAMED.items() if new == f.name]
        kind, is_list = _argument_type(f.type)
        default = f.default if defaults else argparse.SUPPRESS
        help = f.metadata["help"] + (f" (TRL: {trl_names[f.name]})" if f.name in trl_names else "")
        if is_list:  # `--reward a --reward b` or `--reward a b`; not given: the field's default (argparse would
            # extend a default list instead of replacing it)
            group.add_argument(*flags, type=kind, nargs="+", action="extend", default=argparse.SUPPRESS,
                               help=help, choices=f.metadata.get("choices"),
                               metavar=f.metadata.get("metavar", f.name.upper().removesuffix("S")))
        elif kind is bool:
            group.add_argument(*flags, action=_Switch, default=default, help=help)
        else:
            group.add_argument(*flags, type=f.metadata.get("type", kind), default=default, help=help,
                               choices=f.metadata.get("choices"), dest=f.name,
                               action=_EpsilonHigh if f.name == "epsilon_high" else "store",
                               metavar=f.metadata.get("metavar", None if "choices" in f.metadata else f.name.upper()))
        if f.name == "epsilon_low":  # TRL's --epsilon: both ranges (said in the help of --epsilon-low)
            group.add_argument("--epsilon", type=float, action=_Epsilon, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
    return parser
