"""The run's configuration: one dataclass, a help line per field.

Every option of `python trainer.py` is a field of `Config` below, grouped as --help shows them: the
method (`CORE_FIELDS`, the knobs a reader of the method needs), the method's extras (TRL's options), model and
data, the run, scale. Fields left at `None` are derived right after parsing
(infra/options.py: `derive`), e.g. the learning rate and the response length depend on the model: the
offline `tiny` model wants a large step and 8 new tokens, a real LLM a small step and 512. The command
line's parser and every check (`validate`, one line naming the option, the value and the fix) live in
infra/options.py too; --config files and TRL's flags are read in infra/command_line.py.

Sizes: one iteration samples `batch_size` responses = `batch_size / group_size` prompts x
`group_size` responses each (GRPO's group), and takes `updates_per_iteration` x `num_iterations` optimizer steps
(mini-batches, times TRL's μ passes over them).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")  # grpo.LOSS_TYPES, repeated so that parsing options needs no torch
SCALE_REWARDS = ("group", "batch", "none")  # grpo.SCALE_REWARDS (tested, as LOSS_TYPES)
# transformers.get_scheduler's schedules over a known length (tests/cli/test_trl_options.py); the last three need
# --lr-scheduler-kwargs (min_lr or min_lr_rate; num_decay_steps), as they do in TRL
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
MODES = ("auto", "async", "sync")
TEXT_PROMPTS = ("auto", "chat", "raw")  # --text-prompts (infra/tasks.raw_text_prompts)
ENGINES = ("auto", "compile", "eager", "hf")
COMPILE_TRAIN = ("auto", "on", "off")
SIZES = ("probe", "rule")
TRACKERS = ("none", "tensorboard", "wandb", "trackio", "all")  # --report-to (infra/tracking.py; all: those installed)
DTYPES = ("auto", "float32", "bfloat16")
SAVE_DTYPES = ("model", "float32")  # --save-dtype
# The offline models (infra/tiny.py's TINY_RECIPES): name -> (the task it was warmed up on, its default --max-new-tokens)
TINY_MODELS = {"tiny": ("arithmetic", 8), "tiny-chain": ("chain", 128)}
# --model's short names for hub models (infra/models.resolve_model): qwen2.5-7b -> Qwen/Qwen2.5-7B-Instruct,
# qwen3-0.6b -> Qwen/Qwen3-0.6B (Qwen3 ships one model per size, chat-tuned, with thinking on by default)
MODEL_ALIASES = {**{f"qwen2.5-{size}": f"Qwen/Qwen2.5-{size.upper()}-Instruct"
                    for size in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")},
                 **{f"qwen3-{size}": f"Qwen/Qwen3-{size.upper()}"
                    for size in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")}}


def is_model_name(model: str) -> bool:
    """Whether --model is an offline model's name or an alias: a name, even where a folder has it."""
    return model in TINY_MODELS or model.lower() in MODEL_ALIASES


def engine_compiles(engine: str, device: str) -> bool:
    """Whether engine.py's decode step runs compiled (infra/compiled_step.py) for --engine on `device`: always with
    compile, on CUDA with auto (the fastest step measured there: docs/benchmarks.md), never with eager or hf."""
    return engine == "compile" or engine == "auto" and device.startswith("cuda")


def train_compiles(compile_train: str) -> bool:
    """Whether the training side's decoder layers run compiled (infra/compiled_training.py) for --compile-train: with
    on; auto is off everywhere until a GPU measurement shows that it pays (docs/benchmarks.md)."""
    return compile_train == "on"


# The sizes (fields below) that --sizes chooses when not given (`derive`, launch/sizing.py; distributed.share_sizes)
SIZE_FIELDS = ("groups_per_call", "micro_batch_tokens", "rollout_threads", "train_threads",
               "train_threads_after_sampling")


# The method's knobs: Config's first fields and --help's first group, each with its one help line; every other
# field is TRL's extras, data loading, run management or scale
CORE_FIELDS = ("model", "data", "reward", "mode", "iterations", "batch_size", "group_size", "updates_per_iteration",
               "num_iterations", "max_new_tokens", "temperature", "top_p", "lr", "beta", "epsilon_low", "epsilon_high",
               "loss_type", "scale_rewards", "max_grad_norm", "weight_decay", "shared_prompt")

# --help groups the options under these titles: (title, the section's first field), in field order
SECTIONS = (("the method", "model"), ("the method's extras (TRL's options)", "num_train_epochs"),
            ("model and data", "data_config"), ("the run", "out"), ("scale", "device"))


def _dtype_name(name: str) -> str:
    """--dtype's argparse type: float16 is refused with the reason (argparse's own message would only list the
    choices)."""
    if name == "float16":
        raise argparse.ArgumentTypeError(f"{name} is not supported: training in float16 needs loss scaling, which "
                                         "this trainer does not do; use bfloat16 (same memory, float32's range) or "
                                         "float32")
    return name


def _attention_name(name: str) -> str:
    """--attn-implementation's argparse type: flash attention (TRL recipes name it) is refused with the reason."""
    if name.startswith("flash"):
        raise argparse.ArgumentTypeError(f"{name} cannot take the masks this trainer needs (a packed group's responses "
                                         "see the prompt and themselves only; the engine's decode mask): use sdpa, "
                                         "which runs fused kernels where the mask allows, or eager")
    return name


def _scale_rewards_name(name: str) -> str:
    """--scale-rewards' argparse type: TRL's booleans as its names (True -> group, False -> none)."""
    return {"true": "group", "false": "none"}.get(name.lower(), name)


def _fraction(text: str) -> float:
    """--warmup-ratio's argparse type: a number from 0 to 1."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1 (got {text})")
    return value


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {text})")
    return value


def _pad_multiple(text: str) -> int | None:
    """--pad-to-multiple-of's argparse type, as TRL's: auto (None: derived), none or null (1: no padding), or N >= 1."""
    if text.lower() == "auto":
        return None
    if text.lower() in ("none", "null"):
        return 1
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be auto, none or a whole number of at least 1 (got {text})")
    return int(text)


def _resume(text: str) -> str | None:
    """--resume's argparse type: a checkpoint directory or auto; TRL's resume_from_checkpoint true reads as auto (the
    newest checkpoint in --out), false as no resume."""
    return {"true": "auto", "false": None}.get(text.lower(), text)


def _opt(default, help: str, **extra):
    """A dataclass field with a help line (and optional argparse `choices`); a list default is copied per Config."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class Config:
    # --- the method: GRPO with periodic asynchrony (CORE_FIELDS: what a reader of the method needs) ---
    model: str = _opt("tiny", "Hugging Face id, local model directory, or alias: tiny (offline, default), "
                              "tiny-chain (offline, long responses), qwen2.5-0.5b, qwen2.5-7b, qwen3-0.6b, ...")
    data: str | None = _opt(None, "training prompts: 'arithmetic' or 'chain' (built-in, offline), 'gsm8k' (the hub's "
                                  "openai/gsm8k), a hub dataset id, or a local directory or .jsonl/.json/.parquet/.csv "
                                  "file, loaded with Hugging Face datasets (infra/data.py); held out: --eval-split, "
                                  "else its 'test' split, else 'validation', else the last --eval-size rows; default: "
                                  "the tiny model's task, else gsm8k")
    reward: list[str] = _opt(["math"], "reward function(s), repeatable: 'math' (GSM8K final-number match: "
                                       "\\boxed{N}, else '#### N', 'the answer is N', the last number), "
                                       "'math-verify' (Hugging Face math-verify: \\boxed{}, fractions, LaTeX), or "
                                       "'module:function' (TRL's module.function too) / 'path/to/file.py:function': "
                                       "f(prompt, completion, answer) -> float, or TRL's f(prompts, completions, "
                                       "**kwargs) -> list, async def too, given every dataset column and "
                                       "trainer_state by keyword; TRL's CLI names (accuracy_reward, "
                                       "think_format_reward, ...) load trl.rewards' (infra/reward.py; default: math)")
    mode: str = _opt("auto", "async: periodic asynchrony (separate inference process); sync: generate, then train; "
                             "auto: async where the two sides can compute at once (separate devices, one GPU shared "
                             "through NVIDIA MPS, CPU core groups), sync where they would only take turns (one GPU "
                             "without MPS); the first line says which and why. Both are the same run bit for bit",
                     choices=MODES)
    iterations: int = _opt(60, "the run's length in iterations, each one weight version θ_k sampling one batch "
                               "(TRL's --max-steps N, counted in optimizer steps, is N / (--updates-per-iteration x "
                               "--num-iterations) iterations; not --num-iterations, TRL's μ)")
    batch_size: int = _opt(128, "responses sampled per iteration (a multiple of --group-size)")
    group_size: int = _opt(8, "responses per prompt (GRPO's G)")
    updates_per_iteration: int = _opt(1, "optimizer steps per iteration: the batch is split into this many "
                                         "mini-batches; >1 activates the PPO ratio against the old policy (with "
                                         "dapo or --scale-rewards batch the first step waits for the last group, so "
                                         "only mini-batch 0 trains while sampling goes on)")
    num_iterations: int = _opt(1, "passes over each iteration's batch (TRL's num_iterations, μ): the first trains "
                                  "the groups as they arrive, the others the stored batch again, mini-batch by "
                                  "mini-batch, with the ratio against θ_k; optimizer steps per iteration = "
                                  "updates-per-iteration x num-iterations", type=_at_least_one)
    max_new_tokens: int | None = _opt(None, "longest response in tokens (default: 8 for tiny, 128 for tiny-chain, "
                                            "512 otherwise)")
    temperature: float = _opt(1.0, "sampling temperature (log-probs are computed at the same temperature)")
    top_p: float = _opt(1.0, "nucleus sampling threshold (1.0 = sample from the full distribution)")
    lr: float | None = _opt(None, "AdamW learning rate (default: 1e-4 for tiny, 1e-6 otherwise)")
    beta: float = _opt(0.04, "weight of the k3 KL penalty to the reference model (0 = no reference forward)")
    epsilon_low: float = _opt(0.2, "PPO clip range below 1: ratio clipped at 1 - epsilon_low (TRL's --epsilon sets "
                                   "both ranges, unless --epsilon-high is given)")
    epsilon_high: float = _opt(0.2, "PPO clip range above 1: ratio clipped at 1 + epsilon_high (0.28 = DAPO)")
    loss_type: str = _opt("dapo", "loss normalisation: dapo (each step's token sum / (the batch's tokens / "
                                  "updates-per-iteration), as TRL), grpo (per-sequence mean, then mean), dr_grpo "
                                  "(sum / (sequences * max_new_tokens)), bnpo (token mean per micro-batch, then mean: "
                                  "depends on --micro-batch-tokens, as TRL's on per_device_train_batch_size; see "
                                  "grpo.py)", choices=LOSS_TYPES)
    scale_rewards: str = _opt("group", "divide advantages by the reward std of the group, of the whole batch (batch), "
                                       "or not at all (none = Dr. GRPO); TRL's scale_rewards (true = group, false = "
                                       "none)", choices=SCALE_REWARDS, type=_scale_rewards_name)
    max_grad_norm: float = _opt(1.0, "clip the gradient norm before each optimizer step (0 = off)")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    shared_prompt: bool = _opt(True, "pack each group as one row [prompt | r1 | ... | rG] with the shared-prompt "
                                     "mask where that pays (see packing.packing_pays); off: one padded row each")
    # --- the method's extras: TRL's sampling, schedule and loss options, the run's length in epochs ---
    num_train_epochs: float | None = _opt(None, "passes over the training prompts, instead of --iterations: the run "
                                                "takes ceil(E x train prompts / prompts per iteration) iterations, "
                                                "counted once the data is loaded (TRL's num_train_epochs; --iterations "
                                                "typed with a config file's num_train_epochs wins, as TRL's max_steps "
                                                "does)")
    top_k: int = _opt(0, "keep only the k most likely tokens when sampling (0 or -1 = off; TRL's top_k)")
    min_p: float | None = _opt(None, "drop tokens less likely than min_p times the most likely one (TRL's min_p; "
                                     "typical 0.01-0.2)")
    engine: str = _opt("auto", "how rollouts are sampled. auto: engine.py (each prompt prefilled once, a static KV "
                               "cache, one uniform per row and step from (seed, iteration, prompt, sample, step): the "
                               "tokens do not depend on the sizes, workers or ranks) wherever it is exact for the "
                               "model, else Hugging Face generate with a line saying why; on CUDA its decode step "
                               "compiled (torch.compile of one decoder layer and the draw, paid once per process "
                               "in the first call) and replayed as CUDA graphs; compile: compiled on every device; "
                               "eager: never compiled (CUDA graphs still on CUDA); hf: generate always (the "
                               "reference)", choices=ENGINES)
    lr_scheduler_type: str = _opt("linear", "learning-rate schedule over the run's optimizer steps (iterations x "
                                            "updates-per-iteration x num-iterations): transformers' get_scheduler, "
                                            "as TRL's lr_scheduler_type; linear decays to 0", choices=LR_SCHEDULERS)
    lr_scheduler_kwargs: str | None = _opt(None, "the schedule's own arguments, as a JSON object: e.g. "
                                                 "'{\"min_lr_rate\": 0.1}' for cosine_with_min_lr, "
                                                 "'{\"num_cycles\": 2}' for cosine_with_restarts (TRL's "
                                                 "lr_scheduler_kwargs; a config file may give the mapping itself)")
    warmup_ratio: float = _opt(0.0, "fraction of the optimizer steps over which the rate rises linearly from 0 "
                                    "(TRL's warmup_ratio; transformers 5's warmup_steps below 1)", type=_fraction)
    warmup_steps: float = _opt(0, "optimizer steps over which the rate rises linearly from 0, instead of "
                                  "--warmup-ratio (TRL's warmup_steps; below 1: a fraction of the steps, as "
                                  "transformers 5 reads it)")
    kl_bias_correction: bool = _opt(True, "multiply the per-token k3 KL by the importance ratio, so its gradient is "
                                          "that of KL(policy || reference) (TRL 1.16 default; see grpo.py)")
    mask_truncated_completions: bool = _opt(False, "leave responses that reached --max-new-tokens without EOS out of "
                                                   "the loss (TRL's option; DAPO)")
    disable_dropout: bool = _opt(True, "set the policy's dropout to 0, so that a forward is a function of the "
                                       "weights and the bitwise claims hold (TRL's option, which is off by default)")
    # --- model and data ---
    data_config: str | None = _opt(None, "the dataset's configuration (load_dataset's name), e.g. 'main' of "
                                         "openai/gsm8k (the default for --data gsm8k)")
    split: str = _opt("train", "the split of --data to train on")
    eval_split: str | None = _opt(None, "the split of --data whose first --eval-size rows are held out for evaluation "
                                        "(--split itself: its last rows, kept out of training); default: 'test', else "
                                        "'validation', else the last --eval-size rows of --split")
    prompt_column: str | None = _opt(None, "the column of prompts: text (as --text-prompts says), or a list of "
                                           "chat messages ([{'role', 'content'}], TRL's conversational format, "
                                           "rendered with the chat template as it is; a last message of the "
                                           "assistant's is continued); default: TRL's 'prompt' column, else "
                                           "'question' (GSM8K's)")
    text_prompts: str = _opt("auto", "how a text prompt becomes tokens: chat (the model's chat template, the text "
                                     "as the user's message), raw (the text as it is); auto: raw for TRL's 'prompt' "
                                     "column, as TRL uses its standard format, chat for any other column (GSM8K's "
                                     "'question'). Conversations, and text given a --system-prompt, always take the "
                                     "chat template; a model without one takes text raw", choices=TEXT_PROMPTS)
    answer_column: str = _opt("answer", "the column of gold answers: the number N of GSM8K's '... #### N', else the "
                                        "text as it is; data without it (prompt-only) loads when no reward needs "
                                        "an answer (math, math-verify and f(prompt, completion, answer) do)")
    system_prompt: str | None = _opt(None, "a system message put in front of every prompt (text prompts become "
                                           "[system, user] conversations; needs a chat template): its text, or "
                                           "'math' for GSM8K's (reason step by step, end with '#### <number>'); "
                                           "default: none")
    chat_template_kwargs: str | None = _opt(None, "extra arguments to the chat template, as a JSON object: e.g. "
                                                  "'{\"enable_thinking\": false}' turns Qwen3's thinking off (TRL's "
                                                  "chat_template_kwargs; a config file may give the mapping itself)")
    reward_weights: list[float] | None = _opt(None, "one weight per --reward; the reward trained on is the weighted "
                                                    "sum, each reward is also logged alone (default: all 1.0)")
    reward_timeout: float = _opt(300.0, "seconds one reward call may take (a TRL-style reward: one call per group); "
                                        "a call that runs longer stops the run with an error naming the function "
                                        "(0 = no limit). A bound on a hung reward, not on a slow one: an LLM judge "
                                        "or a sandbox may well take tens of seconds (TRL has no limit)")
    dtype: str = _opt("auto", "compute dtype. bfloat16: the trainer keeps float32 master weights and optimizer state "
                              "and computes in bf16 (autocast); the inference side holds bf16 weights (half the "
                              "bytes to publish). auto: bfloat16 on GPUs/NPUs that support it, float32 on CPU. "
                              "(float16 is not offered: it would need loss scaling)",
                      choices=DTYPES, type=_dtype_name)
    attn_implementation: str = _opt("sdpa", "attention kernel of the Hugging Face model (flash attention cannot take "
                                            "the shared-prompt mask)", choices=("sdpa", "eager"), type=_attention_name)
    gradient_checkpointing: bool = _opt(False, "recompute each layer's activations in backward (real models: trades "
                                               "~30%% more training compute for far less activation memory)")
    compile_train: str = _opt("auto", "on: the training side's decoder layers (policy, old policy, reference) through "
                                      "torch.compile, forward and backward, one compilation for every micro-batch "
                                      "length, paid in the first micro-batches (the first line says so); auto: off "
                                      "until a GPU measurement shows it pays (docs/benchmarks.md)",
                              choices=COMPILE_TRAIN)
    use_peft: bool = _opt(False, "train a LoRA adapter (peft, pip install peft) instead of every weight (TRL's "
                                 "use_peft): the reference is the base with the adapter off, no copy; only the adapter "
                                 "is published each iteration, checkpointed and saved in policy/ (peft's format)")
    lora_r: int = _opt(16, "LoRA rank r (TRL's lora_r)")
    lora_alpha: int = _opt(32, "LoRA alpha: the adapter's output is scaled by alpha / r (TRL's lora_alpha)")
    lora_dropout: float = _opt(0.0, "dropout on the adapter's input in training (TRL's lora_dropout, whose default is "
                                    "0.05): 0 keeps resume and async == sync bitwise, since a checkpoint does not "
                                    "hold the random state its masks come from")
    lora_target_modules: list[str] | None = _opt(None, "modules that get an adapter (TRL's lora_target_modules): "
                                                       "names (q_proj v_proj ...) or all-linear (every linear layer "
                                                       "but the output layer); default: peft's for the architecture "
                                                       "(q_proj v_proj for Qwen2 and Llama)")
    cache_dir: str | None = _opt(None, "where the warmed-up tiny model is cached "
                                       "(default: $PERIODIC_RL_CACHE or ~/.cache/periodic-rl)")
    # --- the run: outputs, evaluation, long runs ---
    out: str | None = _opt(None, "output directory: metrics.jsonl, config.json and the final policy/ model (one run "
                                 "at a time; default: a new runs/<model>-<date>-<time>, linked from runs/latest, or "
                                 "with --resume the run it continues: infra/outputs.py)")
    overwrite: bool = _opt(False, "replace the run in --out: delete what an earlier run of trainer.py wrote there "
                                  "(metrics.jsonl, policy/, checkpoint-<k>/, config.json, its TensorBoard events in "
                                  "<out>/runs and its wandb folders) and nothing else (other runs' folders below --out "
                                  "stay); without it a directory holding a run is refused")
    seed: int = _opt(0, "seed for prompt order and for each prompt's sampling (0 to 2**64 - 1)")
    eval_every: int = _opt(10, "evaluate held-out reward every N iterations (and at the start and end; 0 = never)")
    eval_size: int | None = _opt(None, "held-out prompts per evaluation (auto: 64 of a test or validation split, else "
                                       "the last rows, at most a fifth of them; with --eval-every 0, 0: no prompt is "
                                       "held out of training)")
    eval_every_epoch: bool = _opt(False, "evaluate after each pass over the training prompts (TRL's eval_strategy "
                                         "'epoch'), in place of --eval-every")
    eval_samples: int | None = _opt(None, "sampled responses per held-out prompt (default: 4 for tiny and tiny-chain, "
                                          "1 for other models, so that evaluating costs a small share of a run's "
                                          "sampling: the first line says how much)")
    trace: str | None = _opt(None, "write a Chrome trace-event JSON timeline of both processes to this path")
    save: bool = _opt(True, "save the final policy as a Hugging Face model directory in <out>/policy")
    save_dtype: str = _opt("model", "the dtype of <out>/policy's weights: model, the one the model was stored in "
                                    "(bfloat16 for Qwen2.5: half float32's size), or float32, the trainer's masters "
                                    "(checkpoints always keep them, so a resume is exact)", choices=SAVE_DTYPES)
    report_to: list[str] = _opt(["none"], "also send each metrics row to these trackers, named as TRL's (train/reward, "
                                          "eval/reward, ...; infra/tracking.py): tensorboard (<out>/runs), wandb, "
                                          "trackio; several may be given; all: each of these installed (TRL's "
                                          "all)", choices=TRACKERS, metavar="TRACKER")
    log_completions: bool = _opt(False, "write every sampled completion to <out>/completions.jsonl (its prompt, "
                                        "text, each reward, advantage) and send each iteration's as a table to the "
                                        "--report-to trackers (TRL's log_completions; infra/completions.py)")
    num_completions_to_print: int = _opt(0, "with --log-completions, also print the first N completions of each "
                                            "iteration (TRL's option, which prints N at random, all by default)")
    config: str | None = _opt(None, "read options from this JSON or YAML file, e.g. a run's <out>/config.json (keys: "
                                    "the option names, max_new_tokens for --max-new-tokens); options given on the "
                                    "command line override it; resume and overwrite are read from the command "
                                    "line only")
    save_every: int = _opt(0, "every N iterations write <out>/checkpoint-<k>: policy, optimizer state and config, "
                              "everything an exact resume needs, atomically (0 = never)")
    keep_checkpoints: int = _opt(2, "keep the newest K checkpoints, delete older ones (0 = keep all)")
    resume: str | None = _opt(None, "continue a run: a checkpoint directory, or 'auto' (the newest in --out). The "
                                    "checkpoint's options apply; only those that do not change the result may be "
                                    "given anew: evaluation, outputs, devices, threads, micro-batch (not with bnpo), "
                                    "and iterations where the learning rate does not depend on the run's length "
                                    "(constant, or constant_with_warmup and inverse_sqrt without warmup). TRL's "
                                    "--resume-from-checkpoint true is auto", type=_resume)
    save_on_stop: bool = _opt(False, "on SIGTERM, SIGINT or SIGHUP write a checkpoint of the iterations done before "
                                     "stopping (always done when --save-every is set)")
    # --- scale: devices, processes, sizes and threads ---
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
                                   "(async mode, one inference worker each; see launch/remote.py)")
    rollout_device: str | None = _opt(None, "device of the inference side (default: from --device); with several "
                                            "--inference-workers one for all or a comma-separated list, one per "
                                            "worker: cuda:0,cuda:1")
    train_device: str | None = _opt(None, "device of the training process (default: from --device)")
    groups_per_call: int | None = _opt(None, "prompts sampled per generate call (x group-size responses); each "
                                              "group is sent to the trainer the moment its last response stops "
                                              "(default: see --sizes)")
    micro_batch_tokens: int | None = _opt(None, "most tokens (prompt + response, as plain rows) per training "
                                                "forward/backward: finished groups wait until this many have arrived "
                                                "(or their generate call has ended), then train together; lower it if "
                                                "the trainer runs out of memory (default: see --sizes)")
    pad_to_multiple_of: int | None = _opt(None, "pad the training rows, the engine's prefill rows and its KV cache to "
                                                "a multiple of this many tokens (TRL's option; none = 1): a few "
                                                "shapes recur instead of a new one per micro-batch and call, which "
                                                "matters where kernels are planned per shape (cuDNN's attention on "
                                                "recent GPUs). auto: 128 on GPUs and NPUs, none on CPU (padding is "
                                                "compute there)", type=_pad_multiple)
    rollout_threads: int | None = _opt(None, "CPU threads of the inference side, split among --inference-workers "
                                             "(N workers: T // N each, the first T %% N one more, at least 1 each; "
                                             "default: see --sizes)")
    train_threads: int | None = _opt(None, "CPU threads of the training process (default: see --sizes)")
    train_threads_after_sampling: int | None = _opt(None, "CPU threads of the training process once the inference "
                                                          "side is done with the iteration, for the micro-batches "
                                                          "left and the step (async, one inference process; "
                                                          "default: every core when the probe splits them, else "
                                                          "--train-threads)")
    sizes: str = _opt("probe", "how the sizes not given are chosen. probe: on CPU, time iteration 0's generation "
                               "and training first and pick the generate calls, the micro-batch and the thread "
                               "split from a model of the pipeline (launch/sizing.py; printed as flags); on a GPU or "
                               "NPU trainer, the 16384-token micro-batch lowered to what its free memory holds "
                               "(launch/memory.py; not with bnpo); rule: one call per iteration on a GPU/NPU, two "
                               "on CPU, 16384-token micro-batches, cores in half",
                      choices=SIZES)
    collective_timeout: float = _opt(600.0, "seconds a trainer rank waits in a collective (gradient all-reduce, "
                                            "rendezvous) for the other ranks before it gives up with an error "
                                            "(torchrun launches only; see infra/distributed.py)")

    # --- derived (not options) ---
    @property
    def prompts_per_iteration(self) -> int:
        return self.batch_size // self.group_size

    @property
    def sized(self) -> bool:
        """Whether every size is known (after `derive`, and after `sizing.choose` when it probes)."""
        return all(getattr(self, name) for name in SIZE_FIELDS)

    @property
    def calls_per_iteration(self) -> int:
        """Units the pipeline overlaps: generate calls per iteration (after `derive`)."""
        return math.ceil(self.prompts_per_iteration / self.groups_per_call)

    @property
    def is_tiny(self) -> bool:
        return self.model in TINY_MODELS

    @property
    def default_data(self) -> str:
        return TINY_MODELS[self.model][0] if self.is_tiny else "gsm8k"

    @property
    def lora(self) -> dict | None:
        """The LoRA adapter's settings (infra/models.with_lora) with --use-peft, else None."""
        return dict(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                    target_modules=self.lora_target_modules, seed=self.seed) if self.use_peft else None
