"""TRL's names for our options, TRL's defaults where ours differ, and the log's columns: what a TRL user reads in
--help's epilog (`epilog`) and what the parser (infra/options.py) accepts or refuses, and the command line
(infra/command_line.py) ignores or translates, under TRL's names.

Read from TRL 1.16: trl/trainer/grpo_config.py (GRPOConfig), transformers' TrainingArguments under it, and TRL's CLI
(ScriptArguments, ModelConfig).

1. `TRL_ALIASES`: the same meaning under another name, accepted as an alias on the command line and as a --config key.
   Same names need none (beta, temperature, top_p, top_k, min_p, loss_type, scale_rewards, max_grad_norm,
   weight_decay, seed, report_to, reward_weights, epsilon_high, gradient_checkpointing, attn_implementation, dtype,
   num_completions_to_print, ...). TRL's `epsilon` (both clip ranges) is infra/options.py's `--epsilon`.
2. `TRL_DIFFERENT`: a TRL name that means something else here: refused in one line naming the option to use, and why.
   Those of them that TRL derives when null (`DERIVED_AT_NULL`: generation_batch_size, ...) are ignored at null in a
   --config file, as ours are derived too: a GRPOConfig written out with its defaults runs as it is. TRL's batch keys
   (`TRL_BATCH_KEYS`: per_device_train_batch_size, gradient_accumulation_steps, ...), in a --config file or typed,
   are translated as TRL derives its generation batch (`trl_batch`), unless --batch-size is given. TRL's step counts
   (`TRL_STEPS`: max_steps, save_steps, eval_steps, with `STEP_STRATEGIES`), typed or in a file, count optimizer
   steps: they become --iterations, --save-every and --eval-every (`trl_steps`).
3. `TRL_UNUSED`: a TRL name for something this trainer has no use for (it logs every iteration, never cuts prompts):
   a --config key, or a flag typed as for TRL (--bf16, --logging-steps 10), is ignored with one line saying why, so
   that a TRL config file or command line runs as it is.
   `TRL_FIXED`: a TRL name for what this trainer does one way only (AdamW's betas, no vLLM, no float16): a --config
   key at a value that is that way is ignored in the same line, any other value is refused in one line naming what
   to use instead, typed or in a file.
4. `DEPARTURES`: our defaults that are not TRL's, each with its reason.
5. `trl_keys`: 1-3 applied to a --config file's keys, with transformers' TrainingArguments keys (`trainer_settings`)
   skipped at their defaults (infra/command_line.file_arguments calls it).
"""
from __future__ import annotations

import dataclasses
import math
import os
import textwrap

TRL_ALIASES = {"num_generations": "group_size", "learning_rate": "lr", "max_completion_length": "max_new_tokens",
               "use_bias_correction_kl": "kl_bias_correction", "output_dir": "out", "save_total_limit":
               "keep_checkpoints", "resume_from_checkpoint": "resume", "model_name_or_path": "model",
               "dataset_name": "data", "dataset_config": "data_config", "dataset_train_split": "split",
               "dataset_test_split": "eval_split",
               "reward_funcs": "reward",  # TRL's CLI: names or module.function paths, as --reward (infra/reward.py)
               "torch_dtype": "dtype",  # transformers' and TRL's name for dtype before they renamed it
               "activation_checkpointing": "gradient_checkpointing"}  # transformers 5's name (the other its alias)
# TRL names that mean something else here: the option to use instead, and why (one line each, after "use")
TRL_DIFFERENT = {
    "num_generations_eval": "--eval-samples: responses per held-out prompt",
}
# TRL's (transformers') step counts: optimizer steps, read as whole iterations (`trl_steps`), typed or in a file
TRL_STEPS = {"max_steps": "iterations", "save_steps": "save_every", "eval_steps": "eval_every"}
STEP_STRATEGIES = {"save_steps": "save_strategy", "eval_steps": "eval_strategy"}  # a count is read under its strategy
TRL_STEP_KEYS = (*TRL_STEPS, *STEP_STRATEGIES.values())
# GRPOConfig's vLLM settings (TRL 1.16): unused with use_vllm false, as here, where use_vllm true is refused
VLLM_KEYS = ("vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host",
             "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
             "vllm_tensor_parallel_size", "vllm_max_model_length", "vllm_structured_outputs_regex",
             "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
             "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
# TRL names for what this trainer has no use for, and why: ignored in a --config file or typed, with a line
TRL_UNUSED = {
    "logging_steps": "every iteration is logged (a line and a metrics.jsonl row, sent to --report-to)",
    "push_to_hub": "<out>/policy is a Hugging Face model directory; upload it with `hf upload`",
    "bf16": "--dtype auto computes in bfloat16 where the device does so natively (--dtype bfloat16 forces it; "
            "bf16 false is --dtype float32)",
    "max_prompt_length": "prompts are never cut; one too long for the model is refused at start-up",
    "logging_strategy": "every iteration is logged (a line and a metrics.jsonl row, sent to --report-to)",
    "logging_first_step": "every iteration is logged, the first one too",
    "log_level": "the log is one line per iteration; warnings and errors are always shown",
    "log_level_replica": "only rank 0 logs",
    "log_on_each_node": "only rank 0 logs",
    "disable_tqdm": "there is no progress bar: a line per iteration",
    "run_name": "a tracker's run is named by config.json's run_id; the run's folder is --out",
    "logging_dir": "--report-to tensorboard writes to <out>/runs",
    "remove_unused_columns": "every dataset column is kept and passed to a TRL-style reward by keyword",
    "overwrite_output_dir": "a run in --out is refused, not written over; --overwrite, typed, replaces it (deleting "
                            "its checkpoints and policy, which transformers' flag never did)",
    "use_cpu": "the device is --device (auto: a GPU or NPU where there is one); use_cpu true is --device cpu",
    **dict.fromkeys(("dataloader_pin_memory", "dataloader_num_workers", "dataloader_drop_last",
                     "dataloader_persistent_workers", "dataloader_prefetch_factor"),
                    "this trainer has no DataLoader: it draws and batches its own prompts"),
    **dict.fromkeys(("do_train", "do_eval", "do_predict"), "transformers' example scripts' switches, which its "
                    "Trainer does not read (TrainingArguments sets do_eval under eval_strategy): evaluation here "
                    "is --eval-every"),
    **dict.fromkeys(("hub_model_id", "hub_strategy", "hub_private_repo", "hub_token", "push_to_hub_token",
                     "push_to_hub_model_id", "push_to_hub_organization"),
                    "nothing is pushed (push_to_hub); upload <out>/policy with `hf upload`"),
    # what TrainingArguments.to_dict() writes at their defaults once __post_init__ has run (a GRPOConfig's dump)
    "local_rank": "each rank's place comes from torchrun's environment (RANK, LOCAL_RANK: docs/distributed.md)",
    "accelerator_config": "accelerate's DataLoader settings: this trainer draws and batches its own prompts",
    "fsdp_config": "TRL reads it only with fsdp, which this trainer does not use",
    "average_tokens_across_devices": "under torchrun the loss's normaliser is all-reduced: the update of one "
                                     "process (docs/distributed.md)",
    **dict.fromkeys(VLLM_KEYS, "TRL reads vLLM's settings only with use_vllm true; this trainer samples with its own "
                               "engine (--engine), its processes set by --inference-workers or --inference-ranks"),
    "ds3_gather_for_generation": "TRL reads it only under DeepSpeed ZeRO-3, which this trainer does not use",
    **dict.fromkeys(("sapo_temperature_neg", "sapo_temperature_pos"), "TRL reads it only with loss_type 'sapo', "
                                                                      "which this trainer does not have"),
    **dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                    "TRL reads it only with loss_type 'vespo', which this trainer does not have"),
    **dict.fromkeys(("ref_model_mixup_alpha", "ref_model_sync_steps"),
                    "TRL reads it only with sync_ref_model true; the reference here stays θ_0"),
    **dict.fromkeys(("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"),
                    "TRL reads it only with use_adaptive_entropy true; this trainer adds no entropy bonus"),
    "log_multimodal": "prompts here are text (or chat messages of text)",
    **dict.fromkeys(("bnb_4bit_quant_type", "bnb_4bit_quant_storage", "use_bnb_nested_quant"),
                    "TRL reads it only with load_in_4bit true"),
    "gradient_checkpointing_use_reentrant": "--gradient-checkpointing uses transformers' default",
    "gradient_checkpointing_kwargs": "--gradient-checkpointing uses transformers' default (same gradients either way)",
    "activation_checkpointing_kwargs": "--gradient-checkpointing uses transformers' default (same gradients either "
                                       "way)",
    "per_device_eval_batch_size": "a held-out evaluation samples --eval-size prompts x --eval-samples in the "
                                  "sampler's own calls: no batch size of its own",
    **dict.fromkeys(("ignore_bias_buffers", "ddp_find_unused_parameters", "ddp_broadcast_buffers",
                     "ddp_bucket_cap_mb"), "read only under DistributedDataParallel, which this trainer does not use"),
}
# TRL's switches that at one value are one of our options, typed or in a file, unless that option (or TRL's name for
# it) is given: (the value, our option, its value, why). Not overwrite_output_dir: --overwrite deletes the run in --out,
# which transformers' flag never did.
TRL_SWITCHES = {"bf16": (False, "dtype", "float32", " (TRL computes in float32 then)"),
                "use_cpu": (True, "device", "cpu", "")}


def switch_taken(key: str, given: set[str]) -> bool:
    """Whether TRL's switch `key` may set its option (TRL_SWITCHES): neither that option, under our name or TRL's,
    nor the switch itself is in `given`."""
    option = TRL_SWITCHES[key][1]
    return not ({option, key} | {trl for trl, ours in TRL_ALIASES.items() if ours == option}) & given


def switch_line(key: str, typed: bool) -> str:
    """The line a TRL switch taken as our option gets: "took TRL's bf16 false as --dtype float32 (...)", typed
    "--bf16 false" ("--use-cpu" for a switch taken when true)."""
    when, option, value, why = TRL_SWITCHES[key]
    name = f"--{key.replace('_', '-')}" + ("" if when else " false") if typed else f"{key} {str(when).lower()}"
    return f"took TRL's {name} as --{option} {value}{why}"
# TRL names that mean something else here but at null mean "derive it", as ours do: ignored at null with a line
DERIVED_AT_NULL = {"generation_batch_size": "--batch-size", "steps_per_generation": "--updates-per-iteration",
                   "num_generations_eval": "--eval-samples"}  # TRL's key -> ours, which it is derived from here
# TRL names for what this trainer does one way only: (the values that are that way, what it does, what to use for
# another value or None where no option changes it). At one of those values a --config key is ignored with a line;
# another is refused with one line (`fixed_refusal`); typed, it is refused.
TRL_FIXED = {
    "use_vllm": ((False,), "sampling runs in this trainer's own engine and processes",
                 "--engine, --inference-workers or --inference-ranks"),
    "fp16": ((False,), "no float16 training: it would need loss scaling, which this trainer does not do",
             "--dtype bfloat16"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "the optimizer is torch.optim.AdamW (launch/setup.py; fused is "
                                                    "the same update in one kernel)", None),
    "adam_beta1": ((0.9,), "AdamW's betas are (0.9, 0.999), torch's and TrainingArguments' defaults", None),
    "adam_beta2": ((0.999,), "AdamW's betas are (0.9, 0.999), torch's and TrainingArguments' defaults", None),
    "adam_epsilon": ((1e-8,), "AdamW's eps is 1e-8, torch's and TrainingArguments' default", None),
    # GRPOConfig's switches at their defaults: what this trainer does; another value asks for what it does not do
    "trust_remote_code": ((False,), "a model's own code is not run: models load with transformers' own classes",
                          None),
    "model_init_kwargs": ((None,), "models load with --dtype and --attn-implementation",
                          "--dtype, --attn-implementation"),
    "router_aux_loss_coef": ((None,), "no mixture-of-experts auxiliary loss", None),
    "cast_lm_head_to_fp32": ((False,), "the output layer runs in the model's dtype (autocast)", "--dtype float32"),
    "shuffle_dataset": ((True,), "prompts are drawn in a seeded random order, a new one each pass (--seed)", None),
    "generation_kwargs": ((None,), "sampling takes --temperature, --top-p, --top-k and --min-p only",
                          "--temperature, --top-p, --top-k, --min-p"),
    "repetition_penalty": ((1.0,), "no repetition penalty: the trainer scores the distribution that was sampled",
                           None),
    "cache_implementation": ((None,), "the rollout engine keeps its own preallocated cache (--engine)", "--engine"),
    "delta": ((None,), "the ratio is clipped to [1 - epsilon, 1 + epsilon_high] only (no two-sided delta bound)",
              "--epsilon, --epsilon-high"),
    "importance_sampling_level": (("token",), "token-level importance ratios (GRPO's; 'sequence' would be GSPO)",
                                  None),
    "multi_objective_aggregation": (("sum_then_normalize",), "rewards are weighted and summed, then normalised per "
                                                             "group (--reward-weights, --scale-rewards)", None),
    "sync_ref_model": ((False,), "the reference stays θ_0 (the tri-model's third copy)", "--beta 0 for none"),
    "top_entropy_quantile": ((1.0,), "every response token enters the loss", None),
    "entropy_coef": ((0.0,), "no entropy bonus in the loss", None),
    "use_adaptive_entropy": ((False,), "no entropy bonus in the loss", None),
    "max_tool_calling_iterations": ((None,), "no tool calls: one response per sample", None),
    "off_policy_mask_threshold": ((None,), "every sample is on-policy (periodic asynchrony): nothing to mask", None),
    "log_unique_prompts": ((False,), "completions.jsonl (--log-completions) holds every prompt", "--log-completions"),
    "log_completions_hub_repo": ((None,), "completions stay in <out>/completions.jsonl (nothing is pushed)",
                                 "--log-completions"),
    **dict.fromkeys(("use_transformers_continuous_batching", "use_transformers_paged"),
                    ((False,), "sampling runs in this trainer's own engine", "--engine")),
    "transformers_continuous_batching_config": ((None,), "sampling runs in this trainer's own engine", "--engine"),
    # TRL's ModelConfig and ScriptArguments (its CLI) at their defaults
    "model_revision": (("main",), "the model loads at its default revision",
                       "a folder: `hf download MODEL --revision R --local-dir DIR`, then --model DIR"),
    **dict.fromkeys(("load_in_8bit", "load_in_4bit"), ((False,), "no quantised loading (bitsandbytes)", None)),
    **dict.fromkeys(("use_rslora", "use_dora"), ((False,), "LoRA is peft's plain LoRA (--use-peft)", None)),
    "lora_task_type": (("CAUSAL_LM",), "LoRA adapts a causal language model", None),
    "lora_modules_to_save": ((None,), "only the adapter is trained, published and saved", None),
    "lora_target_parameters": ((None,), "LoRA adapts the modules of --lora-target-modules", "--lora-target-modules"),
    "dataset_streaming": ((False,), "the data is loaded whole (datasets' load_dataset)", None),
}
# Our defaults that are not TRL 1.16's: (option, ours, TRL's, why), in --help's epilog and the README
DEPARTURES = (
    ("--iterations", "60", "3 epochs (num_train_epochs)", "a run's length here is a number of iterations, each "
                                                           "θ_k's batch; --num-train-epochs 3 is TRL's"),
    ("--beta", "0.04", "0.0", "the reference θ_0 is one of the paper's three ideas (the tri-model); --beta 0 is TRL's "
                              "and makes no reference copy"),
    ("--lr", "1e-4 for tiny, tiny-chain", "1e-6", "a 0.33 M-parameter toy needs big steps; other models: 1e-6"),
    ("--max-new-tokens", "8 for tiny, 128 for tiny-chain", "512", "the toy tasks' answers are that short; other "
                                                                  "models: 512"),
    ("--batch-size", "128 (16 prompts x 8)", "8 per device", "the pipeline overlaps generating with training inside "
                                                             "an iteration: it needs several groups"),
    ("--eval-every", "10", "no evaluation", "the held-out reward shows what the run learnt; 0 turns it off"),
    ("log", "every iteration", "every 10 steps", "each line is the pipeline's measurement (busy and idle seconds)"),
    ("--gradient-checkpointing", "off", "on", "~30% more training compute, which small models need not pay; the "
                                              "README's real-model command turns it on"),
    ("--dtype", "auto: bf16 where native, else float32", "bf16", "CPUs emulate bf16 slowly"),
    ("--save-every", "0 (never)", "every 500 steps", "a checkpoint holds θ and AdamW's state (5.9 GB for "
                                                     "Qwen2.5-0.5B): on request"),
    ("--keep-checkpoints", "2", "all", "a checkpoint's size (above)"),
    ("--out", "runs/<model>-<time>, linked from runs/latest", "trainer_output", "every run a folder of its own: a "
                                                                                "command can be run again"),
    ("--pad-to-multiple-of", "auto: 128 on GPUs and NPUs", "auto: 128 on Neuron only", "cuDNN's attention, torch's "
     "first choice on recent GPUs, builds a graph for every new shape: rounded lengths recur (docs/benchmarks.md)"),
    ("--seed", "0", "42", "the figures in the README and docs/benchmarks.md were measured with it"),
    ("--disable-dropout", "on", "off", "dropout's random masks would break async == sync and exact resume"),
    ("--lora-dropout", "0.0", "0.05", "the same: a checkpoint does not hold the masks' random state"),
    ("--num-completions-to-print", "0", "all", "--log-completions keeps every completion in completions.jsonl; "
                                               "printed, they would bury the log's lines"),
)
# The log's columns, one line per iteration (console.format_row); in --help's epilog
LOG_COLUMNS = (
    ("iter k", "the iteration: sampled with θ_k"),
    ("reward m±s", "training reward (the weighted sum of --reward): mean ± std over the iteration's responses"),
    ("eval", "held-out reward of θ_k (every --eval-every iterations, else -)"),
    ("kl", "mean KL term to the reference θ_0 per response token, as TRL logs it: ρ·k3 with the importance ratio ρ "
           "(plain k3 with --no-kl-bias-correction; - with --beta 0)"),
    ("clip", "fraction of response tokens whose probability ratio was clipped (PPO's clip)"),
    ("len", "mean response length in tokens"),
    ("gen, train", "seconds each side was busy: the inference side sampling and scoring, the trainer training"),
    ("idle gen/train", "seconds each side waited for the other, out of the iteration's wall time"),
    ("overlap", "share of the less busy side's time that ran while the other side was busy (100% = hidden)"),
    ("tok/s", "response tokens per second of the iteration's wall time"),
)


def epilog() -> str:
    """--help's last part: the log's columns and our departures from TRL's defaults."""
    width = max(len(name) for name, _ in LOG_COLUMNS)
    lines = ["the log, one line per iteration:"] + [f"  {name:<{width}}  {meaning}" for name, meaning in LOG_COLUMNS]
    lines += ["", "defaults that are not TRL 1.16's (GRPOConfig), and why:"]
    lines += [f"  {option} {ours} (TRL: {theirs}): {why}" for option, ours, theirs, why in DEPARTURES]
    lines += ["", "TRL's option names are accepted where they mean the same: " + ", ".join(
        f"--{trl.replace('_', '-')}" for trl in [*TRL_ALIASES, "epsilon"]) + "; and TRL's batch keys, "
        + ", ".join(f"--{key.replace('_', '-')}" for key in TRL_BATCH_KEYS) + ", which become --batch-size and "
        "--updates-per-iteration as TRL derives its generation batch; and TRL's counts of optimizer steps, "
        "--max-steps, --save-steps and --eval-steps (with --save-strategy and --eval-strategy), which become "
        "--iterations, --save-every and --eval-every: divided by an iteration's optimizer steps "
        "(--updates-per-iteration x --num-iterations)."]
    lines += ["In a --config file, TRL's keys for what this trainer has no use for are ignored, with a line: "
              + ", ".join([key for key in TRL_UNUSED if key not in VLLM_KEYS] + ["GRPOConfig's vllm_* settings"])
              + "; so are these at what this trainer does (another value is refused): "
              + ", ".join(f"{key} {' or '.join(map(repr, TRL_FIXED[key][0][:2 if key == 'optim' else 1]))}"
                          for key in TRL_FIXED) + "."]
    return "\n".join(textwrap.fill(line, 118, subsequent_indent=" " * 4, break_on_hyphens=False) or line
                     for line in lines)


RESOLVED_AT_INIT = ("disable_tqdm", "accelerator_config", "bf16")  # None in the class, set by __post_init__ if unset


def unset_keys_dropped(values: dict, defaults: dict, known: set[str]) -> dict:
    """A GRPOConfig object's `values` (its to_dict()) less the keys `trl_keys` would only ignore that are at the
    class's `defaults`: TRL_UNUSED ones, TRL_FIXED ones, DERIVED_AT_NULL ones at null, transformers' TrainingArguments
    settings not `known` as options. What the user did not set then says nothing (a GRPOConfig holds ~150 keys);
    what they set is still taken, ignored with a line, or refused.

    >>> unset_keys_dropped({"logging_strategy": "steps", "push_to_hub": True, "beta": 0.0},
    ...                    {"logging_strategy": "steps", "push_to_hub": False, "beta": 0.0}, {"beta"})
    {'push_to_hub': True, 'beta': 0.0}
    """
    trainer_only = trainer_settings([key for key in values if key not in known and key not in TRL_DIFFERENT
                                     and key not in TRL_STEP_KEYS and key not in TRL_BATCH_KEYS])

    def only_ignored(key: str, value) -> bool:
        return (key in TRL_UNUSED or key in TRL_FIXED and is_fixed_value(key, value)
                or key in DERIVED_AT_NULL and value is None or key in trainer_only)

    def unset(key: str, value) -> bool:  # to_dict() writes some None as [], resolves some, and hides tokens
        default = defaults.get(key, ...)
        return key in defaults and (value == default and isinstance(value, bool) == isinstance(default, bool)
                                    and (value is None) == (default is None)  # (0 == False == 0.0; None is none)
                                    or default in (None, "") and value in ([], {})
                                    or default is None and key in RESOLVED_AT_INIT
                                    or key.endswith("_token") and value == f"<{key.upper()}>")
    kept = {key for key, (when, *_) in TRL_SWITCHES.items() if values.get(key) is when}  # taken as our options
    if values.get("eval_strategy") == "steps" and values.get("eval_steps") is None:  # eval_steps unset: every
        kept.add("logging_steps")                                                     # logging_steps
    return {key: value for key, value in values.items()
            if key in kept or not (unset(key, value) and only_ignored(key, value))}


MODEL_INIT_OPTIONS = {"torch_dtype": "dtype", "dtype": "dtype", "attn_implementation": "attn_implementation"}


def model_init_options(kwargs: dict, given: set[str], note) -> dict:
    """TRL's model_init_kwargs (from_pretrained's keywords) as our options: dtype (torch_dtype) and
    attn_implementation, unless given; ValueError naming any other keyword (no option loads models otherwise).

    >>> model_init_options({"torch_dtype": "bfloat16"}, set(), print)
    took TRL's model_init_kwargs torch_dtype 'bfloat16' as --dtype bfloat16
    {'dtype': 'bfloat16'}
    """
    other = [key for key in kwargs if key not in MODEL_INIT_OPTIONS]
    if other:
        raise ValueError(f"model_init_kwargs: {', '.join(other)}: models load with --dtype and --attn-implementation "
                         "only (no option passes other keywords to from_pretrained)")
    options = {}
    for key, value in kwargs.items():
        option = MODEL_INIT_OPTIONS[key]
        if option not in given and option not in options and value is not None:
            options[option] = str(value).removeprefix("torch.")  # torch.bfloat16 written as a string too
            note(f"took TRL's model_init_kwargs {key} {value!r} as --{option.replace('_', '-')} {options[option]}")
    return options


def is_fixed_value(key: str, value) -> bool:
    """Whether a --config file's `value` for TRL's `key` is what this trainer does (`TRL_FIXED`): numbers compared as
    numbers (YAML reads 1e-8 as a string), booleans as booleans.

    >>> is_fixed_value("adam_epsilon", "1e-8"), is_fixed_value("adam_beta1", False), is_fixed_value("fp16", 0)
    (True, False, False)
    """
    def number(x):
        if isinstance(x, bool) or not isinstance(x, (int, float, str)):
            return None
        try:
            return float(x)
        except ValueError:
            return None
    return any(type(value) is type(fixed) and value == fixed or isinstance(fixed, (int, float))
               and not isinstance(fixed, bool) and number(value) is not None and number(value) == fixed
               for fixed in TRL_FIXED[key][0])


TRL_BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                  "generation_batch_size")


def trl_batch(values: dict, processes: int) -> tuple[int, int, str, str]:
    """(--batch-size, --updates-per-iteration, and TRL's products that give each, in words) for TRL's batch keys
    in `values` (TRL_BATCH_KEYS; TRL's defaults for those missing: 8 per device, 1 accumulation step, the two others
    derived) on `processes` training processes, as GRPOConfig.__post_init__ derives them: a generation batch of
    B = per_device x processes x steps_per_generation completions (steps_per_generation defaults to
    gradient_accumulation_steps), of which each optimizer step takes per_device x processes x
    gradient_accumulation_steps: steps_per_generation / gradient_accumulation_steps steps per batch. ValueError
    where TRL refuses too, or the steps do not divide.

    >>> trl_batch({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8}, 1)[:2]
    (32, 1)
    >>> trl_batch({"per_device_train_batch_size": 8, "steps_per_generation": 4}, 2)[:2]
    (64, 4)
    """
    per_device = values.get("per_device_train_batch_size", 8)
    accumulation = values.get("gradient_accumulation_steps", 1)
    steps, batch = values.get("steps_per_generation"), values.get("generation_batch_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in (per_device, accumulation, *(v for v in (steps, batch) if v is not None))):
        raise ValueError(f"TRL's {', '.join(key for key in TRL_BATCH_KEYS if key in values)} must be positive whole "
                         "numbers")
    per_step = per_device * processes  # completions per micro-step, all processes
    if steps is not None and batch is not None:  # GRPOConfig.to_dict() writes both, as its __post_init__ derived them
        if batch != per_step * steps:
            raise ValueError(f"steps_per_generation {steps} and generation_batch_size {batch} are both set and "
                             f"disagree (per_device_train_batch_size {per_device} x {processes} process(es) x "
                             f"{steps} = {per_step * steps}; TRL refuses both set): keep one")
        batch = None
    if batch is not None and batch % per_step:
        raise ValueError(f"generation_batch_size {batch} is not a multiple of per_device_train_batch_size {per_device} "
                         f"x {processes} process(es) (TRL refuses it too)")
    steps = steps or (batch // per_step if batch is not None else accumulation)
    if steps % accumulation:
        raise ValueError(f"steps_per_generation {steps} is not a multiple of gradient_accumulation_steps "
                         f"{accumulation}: each optimizer step here takes a whole share of the batch; give "
                         "--batch-size and --updates-per-iteration")
    batch, updates = per_device * processes * steps, steps // accumulation
    return (batch, updates,
            f"TRL's per_device_train_batch_size {per_device} x {processes} process(es) x steps_per_generation {steps}",
            f"{steps} / gradient_accumulation_steps {accumulation}")


def trl_batch_options(trl_batch_keys: dict, values: dict, skip: set[str], note, group_size: int) -> dict:
    """{batch_size, updates_per_iteration} from TRL's batch keys (`trl_batch`, on WORLD_SIZE processes), where a
    --config file or the command line gives them: none when --batch-size is given (`values` or `skip`, the typed
    options), no updates_per_iteration when that is given; said in one `note` line. ValueError with the reason
    where TRL refuses, with --inference-ranks, or where the batch does not split into whole groups."""
    if "batch_size" in values or "batch_size" in skip:
        note(f"ignored TRL's {', '.join(trl_batch_keys)}: --batch-size is given")
        return {}
    if values.get("inference_ranks") or "inference_ranks" in skip:
        raise ValueError(f"{', '.join(trl_batch_keys)}: with --inference-ranks give --batch-size (the responses "
                         "sampled per iteration, all trainer ranks together) instead")
    batch, updates, batch_from, updates_from = trl_batch(trl_batch_keys, int(os.environ.get("WORLD_SIZE", "1")))
    group = values.get("num_generations", values.get("group_size", group_size))
    checked = "group_size" not in skip and isinstance(group, int)  # a typed --group-size is checked later
    if checked and batch % group:
        raise ValueError(f"{batch_from} = {batch} completions per batch, not a multiple of num_generations {group} "
                         "(TRL refuses it too)")
    line, options = f"took {batch_from} as --batch-size {batch} (TRL's generation batch)", {"batch_size": batch}
    if "updates_per_iteration" in values or "updates_per_iteration" in skip:
        line += " (--updates-per-iteration is given)"
    elif checked and (batch // group) % updates:
        raise ValueError(f"{batch_from} = {batch} completions = {batch // group} groups of num_generations "
                         f"{group}, which {updates} optimizer steps cannot share as whole groups: give "
                         "--batch-size and --updates-per-iteration")
    else:
        line += (f" and {updates_from} as --updates-per-iteration {updates}; the size of a forward is "
                 "--micro-batch-tokens")
        options["updates_per_iteration"] = updates
    note(line)
    return options


def trainer_settings(keys: list[str]) -> dict:
    """{key: its default} for those of `keys` that are fields of transformers' TrainingArguments (the settings of its
    Trainer, under GRPOConfig), read from the installed transformers; {} if none (transformers is then not imported).

    >>> trainer_settings(["do_eval", "max_new_tokens"])
    {'do_eval': False}
    """
    if not keys:
        return {}
    from transformers import TrainingArguments
    fields = {field.name: field for field in dataclasses.fields(TrainingArguments)}
    return {key: (fields[key].default if fields[key].default is not dataclasses.MISSING
                  else fields[key].default_factory() if fields[key].default_factory is not dataclasses.MISSING
                  else None) for key in keys if key in fields}


def trl_keys(values: dict, skip: set[str], note, known: set[str], group_size: int, typed_batch: dict | None = None,
             refusals: list[str] | None = None, steps: dict | None = None) -> dict:
    """A --config file's `values` (keys spelled with _) with TRL's and transformers' keys dealt with, the rest returned
    (our options, TRL's aliases for them, and whatever is unknown, which the caller refuses). In order:
    TRL_FIXED keys at another value are refused; TRL_UNUSED keys, TRL_FIXED ones at their value and DERIVED_AT_NULL
    ones at null are dropped, named in one `note` line; TRL's batch keys become
    --batch-size and --updates-per-iteration (`trl_batch`, on WORLD_SIZE processes), with those typed on the
    command line (`typed_batch`; each wins over the file's), unless --batch-size is given (`skip`: the options
    typed); transformers' TrainingArguments keys not `known` here, and TRL_DIFFERENT ones, are dropped at their
    defaults with a line and refused at another value. Each refusal's reason is appended to `refusals` (all of a
    file's at once, not one per run), or, without that list, raised as ValueError. TRL's step counts and their
    strategies (TRL_STEP_KEYS) go to `steps`, for `trl_steps` once the run's optimizer steps per iteration are known."""
    pending: list[str] = [] if refusals is None else refusals
    trls = [key for key in values if key not in known or key in TRL_ALIASES]  # the file is TRL's if it has these
    steps = {} if steps is None else steps  # TRL's step counts, read once the optimizer steps per iteration are known
    steps.update({key: values[key] for key in TRL_STEP_KEYS if key in values})
    if ("eval_steps" in steps or "eval_strategy" in steps) and "logging_steps" in values:  # eval_steps unset: every
        # logging_steps, as transformers reads it
        steps["logging_steps"] = values["logging_steps"]
    values = {key: value for key, value in values.items() if key not in TRL_STEP_KEYS}
    if isinstance(values.get("model_init_kwargs"), dict):  # TRL's from_pretrained keywords: those that are options
        values = {**model_init_options(values["model_init_kwargs"], set(values) | set(skip), note), **{
            key: value for key, value in values.items() if key != "model_init_kwargs"}}
    fixed = [key for key, value in values.items() if key in TRL_FIXED and not is_fixed_value(key, value)]
    pending += [fixed_refusal(key, values[key]) for key in fixed]
    values = {key: value for key, value in values.items() if key not in fixed}
    for key, (when, option, value, _) in TRL_SWITCHES.items():  # use_cpu true, bf16 false: our options
        if values.get(key) is when and switch_taken(key, set(values) - {key} | set(skip)):
            values = {option: value, **{name: v for name, v in values.items() if name != key}}
            note(switch_line(key, typed=False))
    unused = {key: value for key, value in values.items()
              if key in TRL_UNUSED or key in TRL_FIXED or key in DERIVED_AT_NULL and value is None}
    if unused:
        note(unused_line(unused))
    values = {key: value for key, value in values.items() if key not in unused}
    trl_batch_keys = {**{key: values.pop(key) for key in TRL_BATCH_KEYS if key in values}, **(typed_batch or {})}
    if trl_batch_keys:
        values = {**trl_batch_options(trl_batch_keys, values, skip, note, group_size), **values}
    trainer_only = trainer_settings([key for key in values if key not in known])
    if trainer_only:  # transformers' TrainingArguments, for its Trainer: at their defaults they change nothing here
        at_default = [key for key in trainer_only if trainer_only[key] == values[key]
                      or values[key] in (None, "", [], {}) and trainer_only[key] in (None, "", [], {})]
        changed = [key for key in trainer_only if key not in at_default and key not in TRL_DIFFERENT]
        pending += [f"{key}: {values[key]!r} is a setting of transformers' Trainer, which this trainer does not use "
                    "(no equivalent here)" for key in changed]  # a TRL_DIFFERENT one: refused by the caller
        if at_default:  # a whole TrainingArguments written out: ~90 keys, counted rather than named
            named = ", ".join(at_default) if len(at_default) <= SAY_WHY_UP_TO else f"{len(at_default)} keys"
            note(f"ignored transformers' TrainingArguments {named}: at their defaults, which change nothing here (this "
                 "trainer does not use transformers' Trainer)")
        values = {key: value for key, value in values.items() if key not in at_default and key not in changed}
    if pending and refusals is None:
        raise ValueError("; ".join(pending))
    if trls and not pending:  # a file that runs: what it runs with
        line = departures_line({TRL_ALIASES.get(key, key) for key in values} | set(skip)
                               | ({"batch_size"} if trl_batch_keys else set()) | steps_set(steps))
        if line:
            note(line)
    return values


def number_of_steps(key: str, value) -> int | float:
    """A TRL step count given as a number or typed as text (`--max-steps 100`); ValueError if it is neither.

    >>> number_of_steps("save_steps", "0.25"), number_of_steps("max_steps", 100)
    (0.25, 100)
    """
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    if value is True:  # typed alone: --max-steps
        raise ValueError(f"--{key.replace('_', '-')} needs a number of optimizer steps")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} takes a number of optimizer steps (got {value!r})")
    return int(value) if isinstance(value, float) and value >= 1 and value == int(value) else value


def steps_set(steps: dict) -> set[str]:
    """Our options that TRL's step keys in `steps` (TRL_STEP_KEYS) set, for `departures_line`.

    >>> sorted(steps_set({"max_steps": -1, "save_steps": 50, "eval_strategy": "no"}))
    ['eval_every', 'save_every']
    """
    return ({"iterations"} if steps.get("max_steps") not in (None, -1) else set()) | {
        ours for key, ours in TRL_STEPS.items() if key in STEP_STRATEGIES and (
            key in steps or STEP_STRATEGIES[key] in steps)}


def trl_steps(steps: dict, updates: int, passes: int, note) -> dict:
    """Our {iterations, save_every, eval_every} from TRL's step counts in `steps` (TRL_STEP_KEYS, and logging_steps),
    which count optimizer steps: an iteration here takes updates x passes of them (--updates-per-iteration x
    --num-iterations, as TRL's generation batch takes steps_per_generation / gradient_accumulation_steps x
    num_iterations). Each translation is said in one `note` line; ValueError with the reason where there is none.

    - max_steps above 0 (transformers' -1: unset) is --iterations max_steps / (updates x passes); a count that is not
      whole is refused, naming the two nearest that are: the run, and its learning-rate schedule, would not be TRL's.
    - save_strategy 'steps' (transformers' default, where only save_steps is given) with save_steps (default 500),
      and eval_strategy 'steps' with eval_steps (default: logging_steps, TRL's 10), are --save-every and --eval-every,
      rounded up to whole iterations: a checkpoint or an evaluation comes at an iteration's end. Strategy 'no' is 0;
      'epoch' and 'best', and a fraction of the run's steps, are refused.

    >>> trl_steps({"max_steps": 100, "save_steps": 30, "eval_strategy": "no"}, 2, 2, lambda line: None)
    {'iterations': 25, 'save_every': 8, 'eval_every': 0}
    """
    per_iteration, options = updates * passes, {}
    each = (f"{per_iteration} optimizer steps each (--updates-per-iteration {updates} x --num-iterations {passes})"
            if per_iteration > 1 else "1 optimizer step each")
    total = number_of_steps("max_steps", steps.get("max_steps", -1))
    if total != -1 and (not isinstance(total, int) or total < 1):
        raise ValueError(f"max_steps must be a whole number of optimizer steps above 0, or -1 (got {total!r})")
    if total != -1 and total % per_iteration:
        below, above = total // per_iteration * per_iteration, -(-total // per_iteration) * per_iteration
        raise ValueError(f"max_steps {total} is not a whole number of iterations of {each}: give max_steps "
                         + (f"{below} or {above}" if below else f"{above}") + ", or --iterations")
    if total != -1:
        options["iterations"] = total // per_iteration
        note(f"took TRL's max_steps {total} as --iterations {total // per_iteration}, of {each}")
    for key, strategy_key in STEP_STRATEGIES.items():
        ours = TRL_STEPS[key]
        default_strategy = "steps" if key == "save_steps" and key in steps else None  # transformers' default
        strategy = steps.get(strategy_key, default_strategy)
        if strategy is None:
            if steps.get(key) is not None:
                note(f"ignored TRL's {key}: TRL reads it only with {strategy_key} 'steps'")
            continue
        option = f"--{ours.replace('_', '-')}"
        if strategy in ("no", False):  # False: YAML 1.1 reads an unquoted no as false
            options[ours] = 0
            note(f"took TRL's {strategy_key} 'no' as {option} 0")
            continue
        if strategy != "steps":
            raise ValueError(f"{strategy_key} {strategy!r} is not what this trainer does ({option} N: every N "
                             f"iterations, each θ_k's batch): use {option} N, or {strategy_key} 'steps' with {key}")
        count, default = steps.get(key), ""
        if count is None:  # transformers' defaults: save_steps 500; eval_steps those of logging_steps (TRL's 10)
            count = 500 if key == "save_steps" else steps.get("logging_steps", 10)
            default = " (TRL's default" + (")" if key == "save_steps" else ": logging_steps)")
        count = number_of_steps(key, count)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"{key} {count} " + ("(a fraction of the run's steps) has no equivalent here: give "
                                                 if 0 < count < 1 else "is not a number of optimizer steps: give ")
                             + f"{option} N, every N iterations")
        options[ours] = -(-count // per_iteration)
        note(f"took TRL's {strategy_key} 'steps', {key} {count}{default} as {option} {options[ours]}, of {each}"
             + (f" ({key} {count} falls inside an iteration: rounded up to its end)" if count % per_iteration
                else ""))
    return options


# DEPARTURES that change what a run learns or what it costs: said when a TRL config file leaves them at ours
RESULT_DEPARTURES = ("--iterations", "--beta", "--seed", "--disable-dropout", "--gradient-checkpointing",
                     "--eval-every", "--save-every", "--batch-size")


def departures_line(given: set[str]) -> str | None:
    """For a TRL config file: which of this trainer's defaults that differ from TRL's (RESULT_DEPARTURES) apply,
    because neither the file nor the command line sets them (`given`: option names, with _); None if none do.

    >>> departures_line({"beta", "seed", "disable_dropout", "gradient_checkpointing", "eval_every", "batch_size",
    ...                  "num_train_epochs"})
    "defaults of this trainer that are not TRL's and that the file leaves to it: --save-every 0 (never) (TRL: ...)..."
    """
    given = set(given) | ({"iterations"} if "num_train_epochs" in given else set())  # either sets the run's length
    left = [(option, ours, theirs) for option, ours, theirs, _ in DEPARTURES
            if option in RESULT_DEPARTURES and option[2:].replace("-", "_") not in given]
    if not left:
        return None
    return ("defaults of this trainer that are not TRL's and that the file leaves to it: "
            + ", ".join(f"{option} {ours} (TRL: {theirs})" for option, ours, theirs in left)
            + "; give them in the file to have TRL's (--help's end says why each differs)")


def fixed_refusal(key: str, value) -> str:
    """The line a --config file's TRL `key` at a `value` this trainer does not do gets (`TRL_FIXED`)."""
    _, does, instead = TRL_FIXED[key]
    return f"{key}: {value!r} is not what this trainer does ({does}): " + (f"use {instead}" if instead else
                                                                            "no option changes it")


SAY_WHY_UP_TO = 8  # unused_line gives each key's reason for at most this many keys
ALWAYS_SAID = ("overwrite_output_dir",)  # its reason is given among any number of keys (true: the run may stop there)


def unused_line(values: dict) -> str:
    """The line a --config file with TRL's keys for what has no use here (`TRL_UNUSED`) or at what this trainer does
    (`TRL_FIXED`) gets, from those keys and their values.

    >>> unused_line({"logging_steps": 5})
    "ignored TRL's logging_steps: every iteration is logged (a line and a metrics.jsonl row, sent to --report-to)"
    >>> unused_line({"use_vllm": False})
    "ignored TRL's use_vllm False: sampling runs in this trainer's own engine and processes"
    >>> unused_line({"hub_strategy": "end", "hub_private_repo": True})[:70]
    "ignored TRL's hub_strategy, hub_private_repo: nothing is pushed (push_"

    More than SAY_WHY_UP_TO keys (a whole GRPOConfig file: ~50) are named without their reasons, vLLM's as vllm_*:
    the line stays readable, and each reason is in TRL_UNUSED, TRL_FIXED and DERIVED_AT_NULL here.
    """
    if len(values) > SAY_WHY_UP_TO:  # ALWAYS_SAID keys matter (true: the run may stop there): said as one
        read_as = {key: value for key, value in values.items() if key in ALWAYS_SAID and value}
        vllm = [key for key in values if key in VLLM_KEYS]
        names = [key for key in values if key not in VLLM_KEYS and key not in read_as]
        names += [f"vllm_* ({len(vllm)} key{'s' if len(vllm) > 1 else ''})"] if vllm else []
        return (f"ignored {len(values) - len(read_as)} of TRL's keys, each at a value that changes nothing here or "
                f"for what this trainer has no use: {', '.join(names)} (why, for each: infra/trl_names.py; a file "
                f"with {SAY_WHY_UP_TO} or fewer of them says it)"
                + (f"; {unused_line(read_as)[len('ignored '):]}" if read_as else ""))
    reasons: dict[str, list[str]] = {}  # a reason -> the keys it answers (keys that share one are named together)
    for key, value in values.items():
        if key in DERIVED_AT_NULL and value is None:
            reasons.setdefault(f"null, derived here too, from {DERIVED_AT_NULL[key]}", []).append(key)
        elif key in TRL_UNUSED:
            reasons.setdefault(TRL_UNUSED[key], []).append(key)
        else:
            reasons.setdefault(TRL_FIXED[key][1], []).append(f"{key} {value!r}")
    return "ignored TRL's " + "; ".join(f"{', '.join(keys)}: {reason}" for reason, keys in reasons.items())
