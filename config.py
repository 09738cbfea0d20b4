"""The run's configuration: one dataclass, its command line, and its validation.

Every option of `python trainer.py` is a field of `Config` below; its help line is the field's
`help` metadata and `--help` prints it with the default. Fields left at `None` are derived right
after parsing (`derive`), e.g. the learning rate and the response length depend on the model:
the offline `tiny` model wants a large step and 8 new tokens, a real LLM a small step and 512.
All checks live in `validate`, which names the option, the value and the fix in one line; the
command line turns a failed check into that line on stderr and exit code 2.

Sizes: one iteration samples `batch_size` responses = `batch_size / group_size` prompts x
`group_size` responses each (GRPO's group), and takes `updates_per_iteration` optimizer steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import typing
from dataclasses import dataclass, field

class UserError(RuntimeError):
    """A problem the user can fix (an option, a path, a model, the data, a reward function, a dead inference
    process): trainer.py reports it as one `error:` paragraph and exit code 1, no traceback."""


LOSS_TYPES = ("dapo", "grpo", "dr_grpo")  # grpo.LOSS_TYPES, repeated so that parsing options needs no torch (tested)
MODES = ("async", "sync")
SIZES = ("probe", "rule")
TRACKERS = ("none", "tensorboard", "wandb", "trackio")  # --report-to (tracking.py)
DTYPES = ("auto", "float32", "bfloat16")
# The offline models (models.TINY_RECIPES): name -> (the task it was warmed up on, its default --max-new-tokens)
TINY_MODELS = {"tiny": ("arithmetic", 8), "tiny-chain": ("chain", 128)}
GENERATE_CALLS = {"cpu": 2, "accelerator": 1}  # default generate calls per iteration (see derive)
# Default training micro-batch: 16 toy groups (~1.5 k tokens) in one forward; 2-3 groups of 8 x (256 + 512) tokens
# (Qwen2.5-0.5B with --gradient-checkpointing: 6.5 GiB for one such group in float32, docs/benchmarks.md).
MICRO_BATCH_TOKENS = 16384


def _dtype_name(name: str) -> str:
    """--dtype's argparse type: float16 is refused with the reason (argparse's own message would only list the
    choices)."""
    if name == "float16":
        raise argparse.ArgumentTypeError(f"{name} is not supported: training in float16 needs loss scaling, which "
                                         "this trainer does not do; use bfloat16 (same memory, float32's range) or "
                                         "float32")
    return name


def available_cores() -> int:
    """CPU cores this process may run on (its affinity: a container's or `taskset`'s share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _opt(default, help: str, **extra):
    """A dataclass field with a help line (and optional argparse `choices`); a list default is copied per Config."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class Config:
    # --- what to train ---
    model: str = _opt("tiny", "Hugging Face id, local model directory, or alias: tiny (offline, default), "
                              "tiny-chain (offline, long responses), qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, ...")
    data: str | None = _opt(None, "training prompts: 'arithmetic' or 'chain' (built-in, offline), 'gsm8k' (the hub's "
                                  "openai/gsm8k), a hub dataset id, or a local directory or .jsonl/.json/.parquet/.csv "
                                  "file, loaded with Hugging Face datasets (data.py); held out: its 'test' split, else "
                                  "the last --eval-size rows; default: the tiny model's task, else gsm8k")
    data_config: str | None = _opt(None, "the dataset's configuration (load_dataset's name), e.g. 'main' of "
                                         "openai/gsm8k (the default for --data gsm8k)")
    split: str = _opt("train", "the split of --data to train on")
    prompt_column: str = _opt("question", "the column of prompts: text, or a list of chat messages "
                                          "([{'role', 'content'}], TRL's conversational format, rendered with the "
                                          "model's chat template as it is); data without a 'question' column but with "
                                          "TRL's 'prompt' column uses that")
    answer_column: str = _opt("answer", "the column of gold answers: the number N of GSM8K's '... #### N', else the "
                                        "text as it is")
    reward: list[str] = _opt(["math"], "reward function(s), repeatable: 'math' (GSM8K final-number match), "
                                       "'math-verify' (Hugging Face math-verify: \\boxed{}, fractions, LaTeX), or "
                                       "'module:function' / 'path/to/file.py:function': f(prompt, completion, "
                                       "answer) -> float, or TRL's f(prompts, completions, **kwargs) -> list "
                                       "(reward.py; default: math)")
    reward_weights: list[float] | None = _opt(None, "one weight per --reward; the reward trained on is the weighted "
                                                    "sum, each reward is also logged alone (default: all 1.0)")
    reward_timeout: float = _opt(10.0, "seconds one reward call may take (a TRL-style reward: one call per group); a "
                                       "call that runs longer stops the run with an error naming the function "
                                       "(0 = no limit)")
    out: str = _opt("runs/latest", "output directory: metrics.jsonl and the final policy/ model (one run at a time)")
    overwrite: bool = _opt(False, "replace the previous run in --out (its metrics.jsonl and policy/ are deleted "
                                  "first); without it a directory holding a run is refused")
    seed: int = _opt(0, "seed for prompt order and for each prompt's sampling (0 to 2**64 - 1)")
    # --- schedule ---
    mode: str = _opt("async", "async: periodic asynchrony (separate inference process); sync: generate, then train",
                     choices=MODES)
    iterations: int = _opt(60, "number of iterations (one weight version each)")
    batch_size: int = _opt(128, "responses sampled per iteration (a multiple of --group-size)")
    group_size: int = _opt(8, "responses per prompt (GRPO's G)")
    updates_per_iteration: int = _opt(1, "optimizer steps per iteration: the batch is split into this many "
                                         "mini-batches; >1 activates the PPO ratio against the old policy")
    # --- sampling ---
    max_new_tokens: int | None = _opt(None, "longest response in tokens (default: 8 for tiny, 128 for tiny-chain, "
                                            "512 otherwise)")
    temperature: float = _opt(1.0, "sampling temperature (log-probs are computed at the same temperature)")
    top_p: float = _opt(1.0, "nucleus sampling threshold (1.0 = sample from the full distribution)")
    groups_per_chunk: int | None = _opt(None, "prompts sampled per generate call (x group-size responses); each "
                                              "group is sent to the trainer the moment its last response stops "
                                              "(default: see --sizes)")
    micro_batch_tokens: int | None = _opt(None, "most tokens (prompt + response, as plain rows) per training "
                                                "forward/backward: finished groups wait until this many have arrived "
                                                "(or their generate call has ended), then train together; lower it if "
                                                "the trainer runs out of memory (default: see --sizes; at most 16384)")
    # --- loss and optimizer ---
    lr: float | None = _opt(None, "AdamW learning rate (default: 1e-4 for tiny, 1e-6 otherwise)")
    beta: float = _opt(0.04, "weight of the k3 KL penalty to the reference model (0 = no reference forward)")
    kl_bias_correction: bool = _opt(True, "multiply the per-token k3 KL by the importance ratio, so its gradient is "
                                          "that of KL(policy || reference) (TRL 1.16 default; see grpo.py)")
    epsilon_low: float = _opt(0.2, "PPO clip range below 1: ratio clipped at 1 - epsilon_low")
    epsilon_high: float = _opt(0.2, "PPO clip range above 1: ratio clipped at 1 + epsilon_high (0.28 = DAPO)")
    loss_type: str = _opt("dapo", "loss normalisation: dapo (token mean over the iteration), grpo (per-sequence "
                                  "mean, then mean), dr_grpo (sum / (sequences * max_new_tokens))",
                          choices=LOSS_TYPES)
    scale_rewards: bool = _opt(True, "divide advantages by the group's reward std (off = Dr. GRPO)")
    max_grad_norm: float = _opt(1.0, "clip the gradient norm before each optimizer step (0 = off)")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    shared_prompt: bool = _opt(True, "pack each group as one row [prompt | r1 | ... | rG] with the shared-prompt "
                                     "mask where that pays (see packing.packing_pays); off: one padded row each")
    # --- evaluation and output ---
    eval_every: int = _opt(10, "evaluate held-out reward every N iterations (and at the start and end; 0 = never)")
    eval_size: int = _opt(64, "held-out prompts per evaluation")
    eval_samples: int = _opt(4, "sampled responses per held-out prompt")
    trace: str | None = _opt(None, "write a Chrome trace-event JSON timeline of both processes to this path")
    save: bool = _opt(True, "save the final policy as a Hugging Face model directory in <out>/policy")
    report_to: list[str] = _opt(["none"], "also send each metrics row to these trackers, named as TRL's (train/reward, "
                                          "eval/reward, ...; tracking.py): tensorboard (<out>/runs), wandb, trackio; "
                                          "several may be given", choices=TRACKERS, metavar="TRACKER")
    config: str | None = _opt(None, "read options from this JSON or YAML file, e.g. a run's <out>/config.json (keys: "
                                    "the option names, max_new_tokens for --max-new-tokens); options given on the "
                                    "command line override it; resume and overwrite are read from the command "
                                    "line only")
    # --- long runs (checkpoint.py) ---
    save_every: int = _opt(0, "every N iterations write <out>/checkpoint-<k>: policy, optimizer state and config, "
                              "everything an exact resume needs, atomically (0 = never)")
    keep_checkpoints: int = _opt(2, "keep the newest K checkpoints, delete older ones (0 = keep all)")
    resume: str | None = _opt(None, "continue a run: a checkpoint directory, or 'auto' (the newest in --out). The "
                                    "checkpoint's options apply; only those that do not change the result (iterations, "
                                    "evaluation, outputs, devices, threads, micro-batch) may be given anew")
    save_on_stop: bool = _opt(False, "on SIGTERM, SIGINT or SIGHUP write a checkpoint of the iterations done before "
                                     "stopping (always done when --save-every is set)")
    gradient_checkpointing: bool = _opt(False, "recompute each layer's activations in backward (real models: trades "
                                               "~30%% more training compute for far less activation memory)")
    # --- devices ---
    device: str = _opt("auto", "default device for both sides: auto (CUDA, else NPU, else CPU), cpu, cuda, cuda:N, "
                               "npu, npu:N; auto with two or more GPUs samples on :0 and trains on :1")
    inference_workers: int = _opt(1, "inference processes per trainer (async mode); each samples a share of every "
                                     "iteration's generate calls (worker w of trainer rank r of M: the calls c with "
                                     "c %% (M·N) == r + M·w), so the "
                                     "rollouts and the update do not depend on N (see inference.py); give each a "
                                     "device with --rollout-device, or on CPU a share of --rollout-threads")
    inference_ranks: int = _opt(0, "under torchrun: the last K ranks sample instead of training (inference ranks, "
                                   "e.g. whole inference-only nodes); trainer rank 0 broadcasts θ_k to them and each "
                                   "sends its groups to the trainer rank that owns them, over torch.distributed "
                                   "(async mode, one inference worker each; see remote.py)")
    rollout_device: str | None = _opt(None, "device of the inference side (default: from --device); with several "
                                            "--inference-workers one for all or a comma-separated list, one per "
                                            "worker: cuda:0,cuda:1")
    train_device: str | None = _opt(None, "device of the training process (default: from --device)")
    rollout_threads: int | None = _opt(None, "CPU threads of the inference side, split among --inference-workers "
                                             "(N workers: T // N each, the first T %% N one more, at least 1 each; "
                                             "default: see --sizes)")
    train_threads: int | None = _opt(None, "CPU threads of the training process (default: see --sizes)")
    tail_threads: int | None = _opt(None, "CPU threads of the training process once the inference side is done with "
                                          "the iteration, for the micro-batches left and the step (async, one "
                                          "inference process; default: every core when the probe splits them, "
                                          "else --train-threads)")
    sizes: str = _opt("probe", "how the sizes not given are chosen. probe: on CPU, time iteration 0's generation "
                               "and training first and pick the generate calls, the micro-batch and the thread "
                               "split from a model of the pipeline (sizing.py; printed as flags); rule: one call "
                               "per iteration on a GPU/NPU, two on CPU, 16384-token micro-batches, cores in half",
                      choices=SIZES)
    dtype: str = _opt("auto", "compute dtype. bfloat16: the trainer keeps float32 master weights and optimizer state "
                              "and computes in bf16 (autocast); the inference side holds bf16 weights (half the "
                              "bytes to publish). auto: bfloat16 on GPUs/NPUs that support it, float32 on CPU. "
                              "(float16 is not offered: it would need loss scaling)",
                      choices=DTYPES, type=_dtype_name)
    attn_implementation: str = _opt("sdpa", "attention kernel of the Hugging Face model", choices=("sdpa", "eager"))
    collective_timeout: float = _opt(600.0, "seconds a trainer rank waits in a collective (gradient all-reduce, "
                                            "rendezvous) for the other ranks before it gives up with an error "
                                            "(torchrun launches only; see distributed.py)")
    cache_dir: str | None = _opt(None, "where the warmed-up tiny model is cached "
                                       "(default: $PERIODIC_RL_CACHE or ~/.cache/periodic-rl)")

    # --- derived (not options) ---
    @property
    def prompts_per_iteration(self) -> int:
        return self.batch_size // self.group_size

    @property
    def sized(self) -> bool:
        """Whether every size is known (after `derive`, and after `sizing.choose` when it probes)."""
        return bool(self.groups_per_chunk and self.micro_batch_tokens and self.rollout_threads and self.train_threads
                    and self.tail_threads)

    @property
    def chunks_per_iteration(self) -> int:
        """Units the pipeline overlaps: generate calls per iteration (after `derive`)."""
        return math.ceil(self.prompts_per_iteration / self.groups_per_chunk)

    @property
    def is_tiny(self) -> bool:
        return self.model in TINY_MODELS

    @property
    def default_data(self) -> str:
        return TINY_MODELS[self.model][0] if self.is_tiny else "gsm8k"


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
            return "float32"  # trainer.check_device reports the missing GPU in one line
        with torch.cuda.device(train_device):  # native bf16 (Ampere and newer), not the emulation on V100/T4
            return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float32"
    return "bfloat16" if kind == "npu" else "float32"


def derive(cfg: Config) -> Config:
    """Fill the model- and hardware-dependent defaults and the thread split; returns a new Config."""
    cores = available_cores()
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
    groups_per_chunk = cfg.groups_per_chunk or (None if probed_calls else math.ceil(cfg.prompts_per_iteration / calls))
    chunks = math.ceil(cfg.prompts_per_iteration / (groups_per_chunk or 1))  # generate calls per iteration
    # Sync mode runs one side at a time: all cores. So does async when an iteration is a single chunk
    # (nothing to overlap: the two sides take turns); otherwise they run at once and split the cores,
    # since oversubscribed cores slow both (2 + 2 threads on 2 cores, 2 chunks: async 0.72x of sync, against
    # 1.0x split; `bench.py async --quick --trainer-args "--groups-per-chunk 8 --rollout-threads 2 --train-threads 2"`).
    take_turns = cfg.mode == "sync" or chunks == 1
    rollout_threads = cfg.rollout_threads or (None if probed else cores if take_turns else max(1, cores // 2))
    train_threads = cfg.train_threads or (None if probed else cores if take_turns else max(1, cores - rollout_threads))
    if cfg.mode == "sync" and probed:  # one side at a time: all cores; the probe chooses calls and micro-batch
        rollout_threads, train_threads = rollout_threads or cores, train_threads or cores
    tail_threads = cfg.tail_threads or train_threads  # (None while the probe is to choose the split)
    return dataclasses.replace(
        cfg,
        max_new_tokens=cfg.max_new_tokens or (TINY_MODELS[cfg.model][1] if cfg.is_tiny else 512),
        lr=cfg.lr if cfg.lr is not None else (1e-4 if cfg.is_tiny else 1e-6),
        reward_weights=cfg.reward_weights or [1.0] * len(cfg.reward),
        groups_per_chunk=groups_per_chunk,
        micro_batch_tokens=cfg.micro_batch_tokens or (None if probed else MICRO_BATCH_TOKENS),
        rollout_device=rollout_device,
        train_device=train_device,
        dtype=pick_dtype(cfg.dtype, train_device),
        rollout_threads=rollout_threads,
        train_threads=train_threads,
        tail_threads=tail_threads,
    )


def _is_device_name(name: str) -> bool:
    kind, _, index = name.partition(":")
    return kind in ("cpu", "cuda", "npu") and (index == "" or index.isdigit() and kind != "cpu")


def validate(cfg: Config) -> list[str]:
    """Every problem with `cfg`, one line each (empty when valid)."""
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(cfg.group_size >= 2, f"--group-size must be at least 2 (got {cfg.group_size}): "
                              "group-relative advantages need two responses to compare")
    whole_groups = cfg.batch_size > 0 and cfg.batch_size % max(cfg.group_size, 1) == 0
    need(whole_groups,
         f"--batch-size must be a positive multiple of --group-size (got {cfg.batch_size} and {cfg.group_size})")
    need(cfg.iterations >= 1, f"--iterations must be at least 1 (got {cfg.iterations})")
    need(cfg.updates_per_iteration >= 1,
         f"--updates-per-iteration must be at least 1 (got {cfg.updates_per_iteration})")
    if whole_groups and cfg.group_size >= 1 and cfg.updates_per_iteration >= 1:
        need(cfg.prompts_per_iteration % cfg.updates_per_iteration == 0,
             f"--updates-per-iteration ({cfg.updates_per_iteration}) must divide the prompts per iteration "
             f"({cfg.prompts_per_iteration} = batch-size / group-size): mini-batches are whole groups")
    need(cfg.groups_per_chunk is None or cfg.groups_per_chunk >= 1,
         f"--groups-per-chunk must be at least 1 (got {cfg.groups_per_chunk})")
    need(cfg.micro_batch_tokens is None or cfg.micro_batch_tokens >= 1,
         f"--micro-batch-tokens must be at least 1 (got {cfg.micro_batch_tokens})")
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
    need(cfg.max_new_tokens is None or cfg.max_new_tokens >= 1,
         f"--max-new-tokens must be at least 1 (got {cfg.max_new_tokens})")
    need(cfg.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (got {cfg.max_grad_norm})")
    need(cfg.eval_every >= 0 and cfg.eval_size >= 1 and cfg.eval_samples >= 1,
         "--eval-every must be >= 0, --eval-size and --eval-samples >= 1")
    cores = available_cores()
    for name in ("rollout_threads", "train_threads", "tail_threads"):
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
    if cfg.groups_per_chunk and cfg.groups_per_chunk >= 1 and whole_prompts and cfg.inference_workers >= 1:
        calls = math.ceil(cfg.prompts_per_iteration / cfg.groups_per_chunk)
        need(calls >= cfg.inference_workers,
             f"--inference-workers {cfg.inference_workers} needs at least as many generate calls per iteration, but "
             f"--groups-per-chunk {cfg.groups_per_chunk} makes {calls} of the {cfg.prompts_per_iteration} prompts: "
             "lower --groups-per-chunk")
    need(cfg.inference_ranks >= 0, f"--inference-ranks must be >= 0 (got {cfg.inference_ranks})")
    need(cfg.inference_ranks == 0 or cfg.mode == "async" and cfg.inference_workers == 1,
         "--inference-ranks samples on ranks of their own: it needs --mode async and one --inference-workers (the "
         "inference ranks are the workers)")
    need(cfg.collective_timeout > 0, f"--collective-timeout must be positive (got {cfg.collective_timeout})")
    need(cfg.save_every >= 0 and cfg.keep_checkpoints >= 0, "--save-every and --keep-checkpoints must be >= 0")
    need(cfg.resume is None or cfg.resume.strip() != "", "--resume must name a checkpoint directory or 'auto'")
    need(cfg.out.strip() != "", f"--out must name a directory (got {cfg.out!r})")
    need(cfg.trace is None or cfg.trace.strip() != "", f"--trace must name a file (got {cfg.trace!r})")
    need("none" not in cfg.report_to or len(set(cfg.report_to)) == 1,
         f"--report-to none cannot be combined with a tracker (got {' '.join(cfg.report_to)})")
    if cfg.data is not None:
        from data import looks_like_path  # a hub id is checked when loaded
        path = os.path.expanduser(cfg.data)
        need(not looks_like_path(cfg.data) or os.path.isfile(path) or os.path.isdir(path),
             f"--data {cfg.data!r} is neither 'arithmetic', 'chain', 'gsm8k', a hub dataset id nor an existing file or "
             "directory")
    return problems


# --- command line ---
class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _argument_type(annotation: str):
    """The scalar type of a field annotation such as 'int | None' or 'list[float] | None' (annotations are strings
    here), and whether it is a list."""
    names = {"int": int, "float": float, "str": str, "bool": bool}
    part = [part.strip() for part in annotation.split("|") if part.strip() != "None"][0]
    is_list = part.startswith("list[")
    return names[part[5:-1] if is_list else part], is_list


def build_parser(prog: str = "trainer.py", defaults: bool = True) -> argparse.ArgumentParser:
    """The command line of Config; defaults=False leaves out every option not given (see `given_options`)."""
    parser = _OneLineParser(prog=prog, description="GRPO with periodic asynchrony (arXiv 2511.18871).",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kind, is_list = _argument_type(f.type)
        default = f.default if defaults else argparse.SUPPRESS
        if is_list:  # `--reward a --reward b` or `--reward a b`; not given: the field's default (argparse would
            # extend a default list instead of replacing it)
            parser.add_argument(flag, type=kind, nargs="+", action="extend", default=argparse.SUPPRESS,
                                help=f.metadata["help"], choices=f.metadata.get("choices"),
                                metavar=f.metadata.get("metavar", f.name.upper().removesuffix("S")))
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=f.metadata.get("type", kind), default=default, help=f.metadata["help"],
                                choices=f.metadata.get("choices"),
                                metavar=f.metadata.get("metavar", None if "choices" in f.metadata else f.name.upper()))
    return parser


def given_options(argv: list[str] | None = None) -> set[str]:
    """The fields named on the command line, not left at their defaults (a resumed run tells them apart); the
    options of a --config file count as named."""
    from run_config import with_config_file
    return set(vars(build_parser(defaults=False).parse_args(with_config_file(argv))))


def parse_args(argv: list[str] | None = None, prog: str = "trainer.py") -> Config:
    """Parse (a --config file's options first, the command line's after them), validate and derive; on invalid
    input print one line and exit with code 2."""
    from run_config import with_config_file
    args = build_parser(prog).parse_args(with_config_file(argv, prog))
    cfg = Config(**vars(args))
    problems = validate(cfg)
    if problems:
        sys.stderr.write(f"{prog}: error: {problems[0]}\n")
        raise SystemExit(2)
    return derive(cfg)

