"""The inference side: sample G responses per prompt, score them, and stream finished groups.

One iteration k of rollouts, with the policy weights θ_k:

    for each prompt x_j of iteration k, in index order:
        o_1..o_G ~ π_θk(· | x_j)                 Hugging Face `generate`, KV cache, seeded per prompt
        r_i = reward(x_j, o_i, answer_j)          a plain Python function, checked for errors / NaN
        A_i = group_advantages(r)                 grpo.py
        yield Group(...)                          -> the trainer, at once
    every `eval_every` iterations: held-out reward of θ_k

`rollout_iteration` is that loop as a generator. Synchronous mode consumes it in the trainer's own
process; asynchronous mode runs the very same generator in `inference_process`, which puts each
message on a queue as soon as it exists. Same code, same seeds, so the same rollouts.

Reproducible sampling: each group is sampled right after `torch.manual_seed(prompt_seed(seed, k, j))`,
a function of (seed, iteration, prompt index) only, never of global RNG history, so a separate
process (or a rerun) draws exactly the same tokens from the same weights.

Departures, on purpose:
1. One `generate` call per group (G copies of one prompt, no padding). Batching several prompts
   per call is faster on a GPU but ties each prompt's samples to its neighbours' RNG draws.
2. `top_k`, `repetition_penalty` and the model's own generation_config are ignored: the trainer's
   log-probs assume sampling from softmax(logits / temperature), truncated only by `top_p`.
"""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import GenerationConfig

import grpo
from tasks import Example, prompt_token_ids
from timeline import INFERENCE, Span

RewardFn = Callable[[str, str, str], float]


class RewardError(RuntimeError):
    """A reward function raised, or returned something that is not a finite number."""


@dataclass
class Group:
    """One prompt's G scored responses, as plain Python data (cheap and safe to pickle)."""
    iteration: int
    index: int  # prompt position within the iteration
    policy_version: int  # the weights that sampled it; must equal `iteration`
    prompt_ids: list[int]
    responses: list[list[int]]  # token ids, EOS included when the model stopped
    rewards: list[float]
    advantages: list[float]
    start: float = 0.0  # generation span, time.perf_counter() (a system-wide clock on Linux)
    end: float = 0.0


@dataclass
class Evaluation:
    iteration: int
    policy_version: int
    reward: float  # mean held-out reward
    start: float = 0.0
    end: float = 0.0


@dataclass
class IterationDone:
    """Last message of an iteration: the inference side no longer reads θ_k."""
    iteration: int


@dataclass
class Settings:
    """What the inference side needs from the config (picklable, no torch objects)."""
    seed: int
    group_size: int
    prompts_per_iteration: int
    max_new_tokens: int
    temperature: float
    top_p: float
    eval_every: int
    eval_samples: int
    scale_rewards: bool


# --- which prompts, which seeds ---
def iteration_prompts(num_examples: int, prompts_per_iteration: int, seed: int, iteration: int) -> list[int]:
    """Indices of iteration k's prompts: consecutive slices of a per-epoch seeded permutation."""
    indices = []
    for position in range(iteration * prompts_per_iteration, (iteration + 1) * prompts_per_iteration):
        epoch, offset = divmod(position, num_examples)
        permutation = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        indices.append(int(permutation[offset]))
    return indices


def prompt_seed(seed: int, iteration: int, index: int) -> int:
    """A sampling seed that depends only on (seed, iteration, prompt index)."""
    return (seed * 1_000_003 + iteration) * 1_000_003 + index + 1


def is_eval_iteration(iteration: int, eval_every: int, final_iteration: int) -> bool:
    return eval_every > 0 and (iteration % eval_every == 0 or iteration == final_iteration)


# --- sampling and scoring ---
def sampling_config(settings: Settings, eos_id: int, pad_id: int) -> GenerationConfig:
    return GenerationConfig(do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=0,
                            max_new_tokens=settings.max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id)


def trim_response(tokens: list[int], eos_id: int) -> list[int]:
    """Cut after the first EOS (kept: stopping is an action the policy is trained on)."""
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


@torch.no_grad()
def sample_responses(model, prompt_ids: list[int], num_samples: int, generation: GenerationConfig,
                     seed: int) -> list[list[int]]:
    """num_samples responses to one prompt, reproducible from `seed`."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids] * num_samples, device=device)  # (G, P)
    torch.manual_seed(seed)
    output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            generation_config=generation)  # (G, P + R_max)
    new_tokens = output[:, len(prompt_ids):].tolist()
    return [trim_response(tokens, generation.eos_token_id) for tokens in new_tokens]


def score(reward_fn: RewardFn, prompt: str, completion: str, answer: str) -> float:
    """reward_fn(prompt, completion, answer) as a float; any failure becomes a RewardError that says where."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:
        value = reward_fn(prompt, completion, answer)
    except Exception as error:
        raise RewardError(f"reward function {name!r} raised {type(error).__name__}: {error} "
                          f"(prompt {prompt!r}, completion {completion!r}, answer {answer!r})") from error
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"reward function {name!r} returned {value!r}, not a finite number "
                          f"(prompt {prompt!r}, completion {completion!r}, answer {answer!r})")
    return float(value)


def evaluate(model, tokenizer, examples: list[Example], reward_fn: RewardFn, settings: Settings) -> float:
    """Mean reward of `eval_samples` sampled responses per held-out prompt (fixed seeds)."""
    generation = sampling_config(settings, tokenizer.eos_token_id, tokenizer.pad_token_id)
    rewards = []
    for index, example in enumerate(examples):
        prompt_ids = prompt_token_ids(tokenizer, example.prompt)
        responses = sample_responses(model, prompt_ids, settings.eval_samples, generation,
                                     prompt_seed(settings.seed, -1, index))
        for response in responses:
            completion = tokenizer.decode(response, skip_special_tokens=True)
            rewards.append(score(reward_fn, example.prompt, completion, example.answer))
    return sum(rewards) / len(rewards)


# --- one iteration, as a stream of messages ---
def rollout_iteration(model, tokenizer, train: list[Example], held_out: list[Example], reward_fn: RewardFn,
                      settings: Settings, iteration: int, policy_version: int, final_iteration: int,
                      train_prompts: bool = True) -> Iterator[Group | Evaluation | IterationDone]:
    """Yield iteration k's groups in prompt order, then its evaluation (if due), then IterationDone."""
    generation = sampling_config(settings, tokenizer.eos_token_id, tokenizer.pad_token_id)
    if train_prompts:
        prompt_indices = iteration_prompts(len(train), settings.prompts_per_iteration, settings.seed, iteration)
        for index, example_index in enumerate(prompt_indices):
            example = train[example_index]
            start = time.perf_counter()
            prompt_ids = prompt_token_ids(tokenizer, example.prompt)
            responses = sample_responses(model, prompt_ids, settings.group_size, generation,
                                         prompt_seed(settings.seed, iteration, index))
            completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
            rewards = [score(reward_fn, example.prompt, completion, example.answer) for completion in completions]
            advantages = grpo.group_advantages(torch.tensor(rewards), settings.group_size, settings.scale_rewards)
            yield Group(iteration, index, policy_version, prompt_ids, responses, rewards, advantages.tolist(),
                        start, time.perf_counter())
    if held_out and is_eval_iteration(iteration, settings.eval_every, final_iteration):
        start = time.perf_counter()
        reward = evaluate(model, tokenizer, held_out, reward_fn, settings)
        yield Evaluation(iteration, policy_version, reward, start, time.perf_counter())
    yield IterationDone(iteration)


# --- the inference process (asynchronous mode) ---
def inference_process(model_name: str, load_kwargs: dict, weights, commands, results, train: list[Example],
                      held_out: list[Example], reward_spec: str, settings: Settings, threads: int) -> None:
    """Entry point of the spawned inference process.

    Protocol: wait for ("generate", k) on `commands` (sent after θ_k is in `weights`), run
    `rollout_iteration` and put every message on `results`; ("evaluate", k) runs only the held-out
    evaluation; ("stop",) ends. Any exception is sent as ("error", summary) before exiting non-zero.
    """
    import sys
    import transformers
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    try:
        from models import load_model
        from tasks import load_reward
        model, tokenizer = load_model(model_name, **load_kwargs)
        model.eval()
        weights.attach(model)  # parameters now read θ from shared memory
        reward_fn = load_reward(reward_spec)
        results.put(("ready", None))
        while True:
            command = commands.get()
            if command[0] == "stop":
                break
            kind, iteration, final_iteration = command
            start = time.perf_counter()
            weights.load_into(model, expected_version=iteration)
            results.put(("message", Span(f"load θ_{iteration}", INFERENCE, start, time.perf_counter())))
            for message in rollout_iteration(model, tokenizer, train, held_out, reward_fn, settings, iteration,
                                             weights.version(), final_iteration, train_prompts=kind == "generate"):
                results.put(("message", message))
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException as error:  # report, then die: the trainer turns this into a clear message
        summary = f"{type(error).__name__}: {error}" if isinstance(error, RewardError) else traceback.format_exc()
        results.put(("error", summary))
        results.close()
        results.join_thread()  # make sure the error reaches the pipe before the process exits
        sys.exit(1)
