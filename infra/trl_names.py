"""TRL's names for our options, TRL's defaults where ours differ, and the log's columns, as tables: what a TRL user
reads in --help's epilog (`epilog`) and what the parser (infra/options.py) accepts or refuses, and the command line
(infra/command_line.py, through infra/trl_config.py) ignores or translates, under TRL's names.

Read from TRL 1.16: trl/trainer/grpo_config.py (GRPOConfig), transformers' TrainingArguments under it, and TRL's CLI
(ScriptArguments, ModelConfig), and open-r1's recipes (GRPOScriptArguments, its GRPOConfig).

1. `TRL_ALIASES`: the same meaning under another name, accepted as an alias on the command line and as a --config key.
   Same names need none (beta, temperature, top_p, top_k, min_p, loss_type, scale_rewards, max_grad_norm,
   weight_decay, seed, report_to, reward_weights, epsilon_high, gradient_checkpointing, attn_implementation, dtype,
   num_completions_to_print, ...). TRL's `epsilon` (both clip ranges) is infra/options.py's `--epsilon`.
2. `TRL_DIFFERENT`: a TRL name that means something else here: refused in one line naming the option to use, and why.
   Those of them that TRL derives when null (`DERIVED_AT_NULL`: generation_batch_size, ...) are ignored at null in a
   --config file, as ours are derived too: a GRPOConfig written out with its defaults runs as it is. TRL's batch keys
   (`TRL_BATCH_KEYS`: per_device_train_batch_size, gradient_accumulation_steps, ...), in a --config file or typed,
   are translated as TRL derives its generation batch (trl_config.trl_batch), unless --batch-size is given. TRL's
   step counts (`TRL_STEPS`: max_steps, save_steps, eval_steps, with `STEP_STRATEGIES`), typed or in a file, count
   optimizer steps: they become --iterations, --save-every and --eval-every (trl_config.trl_steps).
3. `TRL_UNUSED`: a TRL name for something this trainer has no use for (it logs every iteration, never cuts prompts):
   a --config key, or a flag typed as for TRL (--bf16, --logging-steps 10), is ignored with one line saying why, so
   that a TRL config file or command line runs as it is.
   `TRL_FIXED`: a TRL name for what this trainer does one way only (AdamW's betas, no vLLM, no float16): a --config
   key at a value that is that way is ignored in the same line, any other value is refused in one line naming what
   to use instead, typed or in a file.
4. `DEPARTURES`: our defaults that are not TRL's, each with its reason.
infra/trl_config.py applies these tables: to a --config file's keys, TRL's typed flags and a GRPOConfig object.
"""
from __future__ import annotations

import textwrap

TRL_ALIASES = {"num_generations": "group_size", "learning_rate": "lr", "max_completion_length": "max_new_tokens",
               "use_bias_correction_kl": "kl_bias_correction", "output_dir": "out", "save_total_limit":
               "keep_checkpoints", "resume_from_checkpoint": "resume", "model_name_or_path": "model",
               "dataset_name": "data", "dataset_config": "data_config", "dataset_train_split": "split",
               "dataset_test_split": "eval_split",
               "dataset_prompt_column": "prompt_column",  # open-r1's recipes (GRPOScriptArguments)
               "reward_funcs": "reward",  # TRL's CLI: names or module.function paths, as --reward (infra/reward.py)
               "torch_dtype": "dtype",  # transformers' and TRL's name for dtype before they renamed it
               "activation_checkpointing": "gradient_checkpointing"}  # transformers 5's name (the other its alias)


# TRL names that mean something else here: the option to use instead, and why (one line each, after "use")
TRL_DIFFERENT = {
    "num_generations_eval": "--eval-samples: responses per held-out prompt",
}
# TRL's (transformers') step counts: optimizer steps, read as whole iterations (trl_config.trl_steps), typed or in
# a file
TRL_STEPS = {"max_steps": "iterations", "save_steps": "save_every", "eval_steps": "eval_every"}
STEP_STRATEGIES = {"save_steps": "save_strategy", "eval_steps": "eval_strategy"}  # a count is read under its strategy
TRL_STEP_KEYS = (*TRL_STEPS, *STEP_STRATEGIES.values(), "do_eval")  # do_eval false: no evaluation, as in TRL
# GRPOConfig's vLLM settings (TRL 1.16): unused with use_vllm false, as here, where use_vllm true is refused
VLLM_KEYS = ("vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host",
             "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
             "vllm_tensor_parallel_size", "vllm_max_model_length", "vllm_structured_outputs_regex",
             "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
             "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")


# open-r1's parameters of its reward functions (cosine, repetition, code execution, soft overlong punishment)
OPEN_R1_REWARD_KEYS = ("cosine_min_value_wrong", "cosine_max_value_wrong", "cosine_min_value_correct",
                       "cosine_max_value_correct", "cosine_max_len", "repetition_n_grams", "repetition_max_penalty",
                       "code_language", "code_eval_test_batch_size", "code_eval_scoring_mode", "code_provider",
                       "ioi_provider", "parallel_code_exec_per_proc", "e2b_router_url", "morph_router_url",
                       "max_completion_len", "soft_punish_cache")


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
    "torch_compile": "compiling the training side is --compile-train; torch_compile true is --compile-train on",
    **dict.fromkeys(("dataloader_pin_memory", "dataloader_num_workers", "dataloader_drop_last",
                     "dataloader_persistent_workers", "dataloader_prefetch_factor"),
                    "this trainer has no DataLoader: it draws and batches its own prompts"),
    **dict.fromkeys(("do_train", "do_predict"), "transformers' example scripts' switches, which its Trainer does not "
                    "read"),
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
    # open-r1's recipes (its GRPOScriptArguments and GRPOConfig): settings of its own rewards, sandboxes and hub
    **dict.fromkeys(OPEN_R1_REWARD_KEYS, "a setting of open-r1's reward functions: a reward here is --reward's "
                                         "function, which takes its own arguments"),
    **dict.fromkeys(("benchmarks", "callbacks"), "open-r1's evaluation and callbacks: evaluation here is the "
                                                 "held-out reward (--eval-every)"),
    **dict.fromkeys(("hub_model_revision", "overwrite_hub_revision", "push_to_hub_revision"),
                    "nothing is pushed (push_to_hub); upload <out>/policy with `hf upload`"),
    **dict.fromkeys(("wandb_entity", "wandb_project", "wandb_run_group"),
                    "--report-to wandb reads WANDB_ENTITY and WANDB_PROJECT from the environment"),
}
# TRL's switches that at one value are one of our options, typed or in a file, unless that option (or TRL's name for
# it) is given: (the value, our option, its value, why). Not overwrite_output_dir: --overwrite deletes the run in --out,
# which transformers' flag never did.
TRL_SWITCHES = {"bf16": (False, "dtype", "float32", " (TRL computes in float32 then)"),
                "use_cpu": (True, "device", "cpu", ""),
                "torch_compile": (True, "compile_train", "on", " (the training side's decoder layers, forward and "
                                  "backward)")}


# TRL names that mean something else here but at null mean "derive it", as ours do: ignored at null with a line
DERIVED_AT_NULL = {"generation_batch_size": "--batch-size", "steps_per_generation": "--updates-per-iteration",
                   "num_generations_eval": "--eval-samples"}  # TRL's key -> ours, which it is derived from here


# TRL names for what this trainer does one way only: (the values that are that way, what it does, what to use for
# another value or None where no option changes it). At one of those values a --config key is ignored with a line;
# another is refused with one line (trl_config.fixed_refusal); typed, it is refused.
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
    # open-r1's recipes at their defaults
    "dataset_mixture": ((None,), "the data is one dataset (--data)", "--data"),
    "chat_template": ((None,), "prompts go through the tokenizer's own chat template", "a model folder whose "
                               "tokenizer_config.json holds the template, as --model"),
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
    ("--eval-samples", "4 for tiny, tiny-chain; 1 for other models", "num_generations (num_generations_eval)",
     "evaluating costs a small share of the sampling (the first line says it)"),
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
    ("(+ eval)", "seconds the inference side spent on the held-out evaluation, apart from gen (eval_s)"),
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


TRL_BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                  "generation_batch_size")
