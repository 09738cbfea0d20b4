"""TRL 1.16.0's real `trl.GRPOTrainer` on the same work as `python trainer.py`, timed per step.

A yardstick for samples/s: what a TRL user gets on this machine for periodic-rl's default tiny
configuration, so that a benchmark can put the two side by side. Not a test and not a dependency
(CI does not install TRL); it runs in its own virtualenv:

    python3 -m venv .venv-trl && . .venv-trl/bin/activate && pip install torch==2.13.0 \\
        && pip install -r requirements.txt trl==1.16.0        # torch pinned first: the CPU wheel
    python tools/trl_grpo_run.py --steps 10                   # 11 steps run, the first one dropped

The work (periodic-rl's defaults for `--model tiny`, sync mode): the cached tiny model
(`tiny.ensure_tiny_model`, float32, sdpa) as policy, and a second copy loaded by TRL from the same
directory as the reference; 16 raw-text prompts "a+b=" per step from `tasks.arithmetic_examples("train")`
(`--model tiny-chain`: the chain-warmed tiny model and `tasks.chain_examples("train")`, "3+8+1+5=")
(a `datasets.Dataset` in TRL's standard format, columns "prompt" and "answer"; TRL tokenizes them to
exactly `tasks.prompt_token_ids`, no BOS or other special token: checked at start-up). With `--model DIR
--data GSM8K --device cuda` (the GPU comparison, e.g. tools/qwen_shaped_random.py's directory): GSM8K
questions after tasks.SYSTEM_PROMPT in TRL's conversational format (the same token ids as periodic-rl's with
--system-prompt math, checked), the model on the GPU with bf16 autocast over float32 weights (bf16=True). G = 8 samples
each = 128 completions of at most 8 tokens from HF `generate` (temperature 1, top-p 1, top-k 0 = off,
no repetition penalty), `tasks.math_reward` as the reward, std-scaled group advantages, the dapo
loss with beta 0.04 (k3 KL with TRL 1.16's default bias correction), clip 0.2 both sides, one
optimizer step per generation (num_iterations 1: no old-policy forward), AdamW (torch, not fused)
lr 1e-4, weight decay 0, grad-norm clip 1.0, constant LR, float32 on CPU, no gradient checkpointing
(TRL's config turns it on by default), no evaluation, no saving, no logging backend.

What is timed. In transformers 5.23 the Trainer fetches the step's 128 dataset rows, calls
`on_step_begin`, then `training_step`, whose `GRPOTrainer._prepare_inputs` generates and scores
(`_generate_and_score_completions`), then clips, steps the optimizer and calls `on_step_end`. So
[on_step_begin, on_step_end] covers generation + scoring + reference forward + forward/backward +
optimizer step. The script does not take that on trust: it wraps `_generate`,
`_generate_and_score_completions`, `_calculate_rewards` and `_get_per_token_logps_and_entropies` on
the trainer instance (timestamps only) and checks that each step's generation lies inside that step's
interval; if one did not, it would time from one `on_step_end` to the next instead. Both intervals
are reported (`loop_seconds_per_step` adds the row fetch and the Trainer's between-step checks).

What TRL does per step beyond a bare GRPO step (read in TRL 1.16.0's grpo_trainer.py, trainer/utils.py,
kernels/chunked_logprob.py and transformers 5.23's trainer.py; single process, use_vllm=False):
1. Data: a DataLoader over the `datasets.Dataset` with TRL's RepeatSampler yields 128 row dicts
   (each prompt's row repeated G times); the prompts are tokenized again every step, 128 strings
   (not 16), padded into tensors twice (for `generate`, then for the forwards).
2. Generation: one `generate` call over all 128 rows; afterwards the EOS masking, a `.tolist()`
   per row and a batch decode of the 128 completions.
3. Log-probs: TRL patches both models' forward with its fused LM head (`add_fused_lm_head`, a
   chunked log-softmax that never stores the logits). Off CUDA/XPU (no Triton) it projects and scores
   *every* position of the padded prompt+completion rows, prompt positions included, then keeps the
   last `logits_to_keep`; its backward recomputes the LM-head product. For the policy it also
   computes the per-token entropy (kept only for the `entropy` metric here: no entropy bonus, no
   entropy mask at the defaults).
4. Rewards: the reward function is called once with 128 prompts and completions plus keyword
   columns (`answer`, repeated per row, `completion_ids`, `trainer_state`, `log_extra`,
   `log_metric`); rewards go through NaN checks and nan-aware group mean/std.
5. The generated batch is shuffled (a random permutation of the 128 rows, `shuffle_sequence_dict`)
   and split into `steps_per_generation` pieces (1; `--micro-batch M`: samples / M, accumulated).
6. Metrics, computed every step whatever the logging settings, each read back with `.item()`:
   completion length mean/min/max, truncated ratio, terminated-length mean/min/max, tokens seen;
   reward mean/std (overall and per function), fraction of zero-std groups; the KL mean, the entropy
   mean, clip ratios low/high/region and per-sequence low-min/high-max; the training_step time. The
   prompts, completions, rewards and advantages are also copied into the completions-log deques.
7. Trainer bookkeeping: the gradient norm is returned by the clip (as in periodic-rl), a NaN/Inf
   check of the loss, a constant-LR scheduler step, callback dispatch, the log/save/eval checks.
What periodic-rl does differently (its defaults on CPU): two `generate` calls of 64 rows per
iteration with a streamer that reads every decode step's tokens back (`.tolist()`) and hands each group
to the trainer the moment its last response stops; one reward call per completion; training in
micro-batches of whatever has arrived (here one forward/backward per call), shared-prompt packing only
where `packing.packing_pays` (not for these tiny groups). `python bench.py peer` runs both side by side.

Fairness: the two see the same prompts distribution, not the same prompts (TRL's seeded sampler vs
periodic-rl's permutation) and sample different tokens, so response lengths differ a little: both
are printed (`mean_completion_length`). On the 2-core machine, one other busy process made this run
about 20x slower (24 instead of ~490 samples/s: two threads spin-waiting on one free core), so time
only on an idle machine and compare runs taken back to back.

Prints one line per timed step, then one JSON object on the last line of stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: no hub probes
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TRL_VERSION = "1.16.0"
TIMED = ("_generate", "_generate_and_score_completions", "_calculate_rewards", "_get_per_token_logps_and_entropies")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (one more runs first and is dropped)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--model", default="tiny",
                        help="tiny: arithmetic prompts; tiny-chain: chain prompts (long-tailed response lengths); "
                             "or a local model directory with a chat template (e.g. tools/qwen_shaped_random.py's), "
                             "with --data")
    parser.add_argument("--data", default=None,
                        help="with a model directory: GSM8K-style prompts (a directory of train.jsonl/test.jsonl or "
                             "a file, read by periodic-rl's data.load_data), in the chat template after "
                             "tasks.SYSTEM_PROMPT as periodic-rl's --system-prompt math puts them")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the model on the GPU and bf16 autocast with float32 master weights (TRL's "
                             "bf16=True), as periodic-rl's --dtype auto trains there (it samples from a bf16 copy)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="completions per forward/backward (per_device_train_batch_size), the step's others "
                             "accumulated (gradient_accumulation_steps = steps_per_generation = samples / this: "
                             "still one generate call and one optimizer step per step); default: all in one. "
                             "A 0.5B model's 128 x ~580 tokens at once do not fit an 80 GB GPU")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: the cores this process may use, as periodic-rl's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None,
                        help="tiny-model cache (default: $PERIODIC_RL_CACHE or ~/.cache/periodic-rl)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.steps < 1 or args.prompts_per_step < 1 or args.group_size < 2 or args.max_new_tokens < 1:
        parser.error("need --steps >= 1, --prompts-per-step >= 1, --group-size >= 2, --max-new-tokens >= 1")
    if (args.model in ("tiny", "tiny-chain")) == (args.data is not None):
        parser.error("--data goes with a model directory, and a model directory needs --data")
    if args.micro_batch is not None and (args.micro_batch < 1 or
                                         (args.prompts_per_step * args.group_size) % args.micro_batch):
        parser.error("--micro-batch must divide --prompts-per-step x --group-size")
    return args


def math_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """tasks.math_reward in TRL's reward-function shape (one call per batch, columns as keyword lists); a
    conversational completion is [{"role": "assistant", "content": text}]."""
    from infra import tasks
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [tasks.math_reward(str(p), c, a) for p, c, a in zip(prompts, texts, answer, strict=True)]


def record_calls(trainer, names, spans: list) -> None:
    """Wrap these methods on the instance to append (name, start, end, first positional arg) per call."""
    for name in names:
        original = getattr(trainer, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spans.append((_name, start, time.perf_counter(), args[0] if args else None))
        setattr(trainer, name, timed)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from infra.options import available_cores
    args.threads = args.threads if args.threads is not None else available_cores()
    torch.set_num_threads(args.threads)

    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from config import TINY_MODELS
    from infra import tasks
    from infra.tiny import TINY_RECIPES, ensure_tiny_model

    if trl.__version__ != TRL_VERSION:
        print(f"warning: this script was written against TRL {TRL_VERSION}, found {trl.__version__}",
              file=sys.stderr)
    tiny = args.model in TINY_RECIPES
    path = str(ensure_tiny_model(args.cache_dir, TINY_RECIPES[args.model])) if tiny else args.model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    if tiny:  # the train split of the task it was warmed up on, raw text
        from infra.data import load_task
        examples = load_task(TINY_MODELS[args.model][0])[0]
        prompts = [e.prompt for e in examples]
        # TRL tokenizes standard-format prompts with `processing_class(text=prompts)` (GRPOTrainer._tokenize_prompts)
        trl_ids = tokenizer(text=prompts)["input_ids"]
    else:  # as periodic-rl prompts a chat model with --system-prompt math: [system, question], TRL's conversations
        from infra.data import load_data
        if not getattr(tokenizer, "chat_template", None):
            raise SystemExit(f"error: {args.model} has no chat template; the GSM8K prompts are chat messages")
        examples = load_data(args.data, None, "train", "question", "answer", 64, system_prompt="math").train
        prompts = [e.prompt for e in examples]
        # TRL tokenizes conversations with one apply_chat_template(tokenize=True) call (_tokenize_prompts)
        trl_ids = tokenizer.apply_chat_template(prompts[:64], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    ours = [tasks.prompt_token_ids(tokenizer, e.prompt) for e in examples[:len(trl_ids)]]
    if trl_ids != ours:
        raise SystemExit("error: TRL's prompt tokenization differs from tasks.prompt_token_ids "
                         f"(e.g. {trl_ids[0]} vs {ours[0]}): the runs would not do the same work")

    samples_per_step = args.prompts_per_step * args.group_size
    micro = args.micro_batch or samples_per_step  # rows per forward/backward; one generate call of all of them
    accumulation = samples_per_step // micro
    output_dir = tempfile.mkdtemp(prefix="trl-grpo-run-")
    try:
        # Through a JSON Lines file, not Dataset.from_dict: on Python 3.12, from_dict's fingerprint (a dill pickle of
        # the Arrow table) fails with datasets 5.2 and pyarrow 26 ("Can't pickle <class 'MonthDayNano'>")
        rows_path = os.path.join(output_dir, "prompts.jsonl")
        with open(rows_path, "w") as f:
            for prompt, example in zip(prompts, examples, strict=True):
                f.write(json.dumps({"prompt": prompt, "answer": example.answer}) + "\n")
        train_dataset = datasets.load_dataset("json", data_files=rows_path, split="train", keep_in_memory=True)
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=args.device == "cpu", bf16=args.device == "cuda", fp16=False,
            seed=args.seed,
            max_steps=args.steps + 1, per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation, steps_per_generation=accumulation, num_iterations=1,
            num_generations=args.group_size, max_completion_length=args.max_new_tokens,
            temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, use_vllm=False,
            beta=args.beta, loss_type="dapo", scale_rewards="group", epsilon=0.2, epsilon_high=0.2,
            importance_sampling_level="token", mask_truncated_completions=False,
            learning_rate=args.lr, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
            warmup_steps=0, optim="adamw_torch", gradient_checkpointing=False,
            eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none",
            disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        )
        # What the defaults left in place: checked, not assumed
        assert config.generation_batch_size == samples_per_step and config.steps_per_generation == accumulation
        assert config.use_bias_correction_kl and config.top_entropy_quantile == 1.0 and config.entropy_coef == 0.0
        assert config.delta is None and config.off_policy_mask_threshold is None
        assert not config.cast_lm_head_to_fp32 and not config.gradient_checkpointing
        assert config.bf16 == (args.device == "cuda")

        class StepTimes(TrainerCallback):
            def __init__(self):
                self.begins, self.ends, self.rewards, self.lengths, self.lrs, self.threads = [], [], [], [], [], []
                self.trainer = None

            def on_step_begin(self, args_, state, control, **kwargs):
                self.begins.append(time.perf_counter())

            def on_step_end(self, args_, state, control, **kwargs):
                self.ends.append(time.perf_counter())
                metrics = self.trainer._metrics["train"]  # appended to every step, averaged and cleared at a log
                self.rewards.append(metrics["reward"][-1])
                self.lengths.append(metrics["completions/mean_length"][-1])
                self.lrs.append(self.trainer.optimizer.param_groups[0]["lr"])
                self.threads.append(torch.get_num_threads())

        timer = StepTimes()
        trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=config, train_dataset=train_dataset,
                              processing_class=tokenizer, callbacks=[timer])
        timer.trainer = trainer
        gen = trainer.generation_config
        assert (gen.do_sample, gen.temperature, gen.top_p, gen.top_k, gen.min_p, gen.repetition_penalty) == \
            (True, 1.0, 1.0, 0, None, 1.0), gen
        assert gen.max_new_tokens == args.max_new_tokens and trainer.ref_model is not None
        spans: list = []
        record_calls(trainer, TIMED, spans)
        processors: list[list[str]] = []  # what `generate` actually applies to the logits, per call
        get_logits_processor = model._get_logits_processor

        def logits_processor(*a, **k):
            result = get_logits_processor(*a, **k)
            processors.append([type(p).__name__ for p in result])
            return result
        model._get_logits_processor = logits_processor
        trainer.train()
        assert type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
                    ) is torch.optim.AdamW
        assert not any(group.get("fused") for group in trainer.optimizer.param_groups)
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)

    steps = len(timer.ends)
    if steps != args.steps + 1 or len(timer.begins) != steps:
        raise SystemExit(f"error: expected {args.steps + 1} steps, the callback saw {steps}")

    def inside(name: str, step: int) -> list[tuple]:
        return [s for s in spans if s[0] == name and timer.begins[step] <= s[1] and s[2] <= timer.ends[step]]

    generation_inside = all(len(inside("_generate", i)) == 1 for i in range(steps)) and \
        sum(s[0] == "_generate" for s in spans) == steps
    if generation_inside:
        interval = "on_step_begin..on_step_end"
        seconds = [timer.ends[i] - timer.begins[i] for i in range(1, steps)]
    else:  # generation outside the step: time whole loop turns
        interval = "on_step_end..next on_step_end"
        seconds = [timer.ends[i] - timer.ends[i - 1] for i in range(1, steps)]
    loop_seconds = [timer.ends[i] - timer.ends[i - 1] for i in range(1, steps)]

    def phase(step: int, name: str, first_arg=None) -> float:
        return sum(s[2] - s[1] for s in inside(name, step) if first_arg is None or s[3] is first_arg)

    rows = []
    for i in range(1, steps):
        generate_and_score = phase(i, "_generate_and_score_completions")
        rows.append({"generate_s": phase(i, "_generate"), "reward_s": phase(i, "_calculate_rewards"),
                     "ref_forward_s": phase(i, "_get_per_token_logps_and_entropies", trainer.ref_model),
                     "generate_and_score_s": generate_and_score,
                     "rest_of_step_s": (timer.ends[i] - timer.begins[i]) - generate_and_score})
    for i, (s, row) in enumerate(zip(seconds, rows), start=1):
        print(f"step {i:3d}  {s:.3f}s  ({samples_per_step / s:.0f} samples/s)  generate {row['generate_s']:.3f}s  "
              f"ref fwd {row['ref_forward_s']:.3f}s  reward fn {row['reward_s']:.4f}s  "
              f"policy fwd/bwd + step {row['rest_of_step_s']:.3f}s  reward {timer.rewards[i]:.3f}  "
              f"len {timer.lengths[i]:.2f}", flush=True)
    assert all(lr == args.lr for lr in timer.lrs), timer.lrs
    shaping = {"TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TemperatureLogitsWarper",
               "RepetitionPenaltyLogitsProcessor", "TypicalLogitsWarper"}
    assert len(processors) == steps and not shaping & {name for call in processors for name in call}, processors

    result = {
        "seconds_per_step": seconds,
        "samples_per_step": samples_per_step,
        "samples_per_s": samples_per_step * len(seconds) / sum(seconds),  # = samples / mean seconds per step
        "interval": interval,
        "generation_inside_step": generation_inside,
        "loop_seconds_per_step": loop_seconds,
        "loop_samples_per_s": samples_per_step * len(loop_seconds) / sum(loop_seconds),
        "phases_mean_s": {key: statistics.mean(row[key] for row in rows) for key in rows[0]},
        "logits_processors": processors[-1],
        "reward_mean_per_step": timer.rewards[1:],
        "mean_completion_length": statistics.mean(timer.lengths[1:]),
        "warmup_step_s": timer.ends[0] - timer.begins[0],
        "trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": args.threads, "threads_seen": sorted(set(timer.threads)),
        "steps": args.steps, "seed": args.seed, "beta": args.beta, "lr": args.lr,
        "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
