"""The inference side: sample G responses per prompt, score them, and stream finished groups.

One iteration k of rollouts, with the policy weights θ_k:

    for each call of C prompts x_j of iteration k, in index order:
        o_j1..o_jG ~ π_θk(· | x_j), the C prompts at once (`sample_prompts`: engine.py, else `generate`)
        as soon as all G responses of a prompt x_j have stopped (inside the call):
            r_i = Σ_m w_m reward_m(x_j, o_ji, answer_j)   the --reward functions, checked (infra/scoring.py)
            A_i = group_advantages(r)             grpo.py
            send(ScoredGroup(...))                -> the trainer, at once
    every `eval_every` iterations: held-out reward of θ_k

`rollout_iteration` is that loop, handing each message to `send`. Synchronous mode collects them in
the trainer's own process; asynchronous mode runs the very same function in `inference.inference_process`,
whose `send` writes each message to a pipe. Same code, same seeds, so the same rollouts, in the same
order.

Calls (`--groups-per-call C`; default: chosen by the probe, see --sizes): one call samples C prompts x G
responses, and its groups leave in completion order, a prompt's group the step its last response stops,
while the other rows go on decoding. With long-tailed response lengths the trainer works on the short
groups while the long ones are still being sampled, without giving up the batched call.

The sampler is engine.py wherever `engine.unsupported_reason` finds nothing: each prompt prefilled once, a
preallocated cache, stopped rows compacted away, and row i of prompt j drawing its token at step t from
(seed, k, j, i, t) alone, so C, compaction, workers and ranks never change a token: --seed decides the run.
On CUDA its decode step is compiled and replayed as CUDA graphs (infra/compiled_step.py; --engine). With
`--engine hf`, or a model the engine is not checked on (one line says why), it is Hugging Face `generate`
(infra/hf_generate.py), seeded per call. Either samples softmax(logits / T), truncated by --top-k, --top-p and
--min-p and nothing else. The trainer scores softmax(logits / T) untruncated, as TRL does: the ratio is against the
sampling policy exactly when the three are off (their defaults; a model's shipped generation_config does not
turn them on). A response stops at *any* of the model's EOS ids
(Qwen lists two: <|im_end|> and <|endoftext|>): the union of the generation config's and the tokenizer's
(`stop_token_ids`). (With --dtype bfloat16 the sampler's bf16 weights and the trainer's float32 masters under
autocast give logits that differ by rounding; see tri_model.py.)
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Union

import torch
from transformers import GenerationConfig

import engine
import grpo
from config import Config, engine_compiles
from infra import compiled_step
from infra.errors import UserError
from infra.hf_generate import sample_responses, sampling_config, stop_ids_of
from infra.reward import Reward, Rewards, as_rewards
from infra.scoring import RewardLogs, score_group, trainer_state, weighted_total
from infra.tasks import Example, run_prompt_ids
from infra.timeline import INFERENCE, Span

@dataclass
class ScoredGroup:
    """One prompt's G sampled responses with their rewards and advantages, tagged with the weights that sampled
    them: the message the trainer takes (attention.Group is its (prompt, responses) tokens as tensors). Plain Python
    data, cheap and safe to pickle."""
    iteration: int
    index: int  # prompt position within the iteration
    policy_version: int  # the weights that sampled it (-1: they changed meanwhile); must equal `iteration`
    prompt_ids: list[int]
    responses: list[list[int]]  # token ids, EOS included when the model stopped
    rewards: list[float]
    advantages: list[float]
    start: float = 0.0  # its generate call's start, time.perf_counter() (a system-wide clock on Linux)
    end: float = 0.0  # when its last response stopped
    call: tuple[int, int] = (0, 1)  # (first prompt index, prompts) of the generate call that sampled it
    rewards_per_function: list[list[float]] = field(default_factory=list)  # [reward k][response i], unweighted
    # (`rewards` is their weighted sum; NaN: a batched reward returned None)
    logged: dict = field(default_factory=dict)  # TRL's log_metric: name -> the values a reward logged scoring it
    extra: dict = field(default_factory=dict)  # TRL's log_extra: column -> a value per response


@dataclass
class Evaluation:
    iteration: int
    policy_version: int
    reward: float | None  # mean held-out reward (weighted sum; None: no response could be scored)
    start: float = 0.0
    end: float = 0.0


@dataclass
class IterationDone:
    """Last message of an iteration: the inference side no longer reads θ_k."""
    iteration: int


# --- which prompts, which seeds ---
def iteration_prompts(num_examples: int, prompts_per_iteration: int, seed: int, iteration: int) -> list[int]:
    """Indices of iteration k's prompts: consecutive slices of a per-epoch seeded permutation."""
    permutations = {}  # epoch -> its permutation, drawn once: an iteration spans one epoch, or a few
    indices = []
    for position in range(iteration * prompts_per_iteration, (iteration + 1) * prompts_per_iteration):
        epoch, offset = divmod(position, num_examples)
        if epoch not in permutations:
            generator = torch.Generator().manual_seed((seed * 7919 + epoch) % 2**64)  # any 64-bit --seed
            permutations[epoch] = torch.randperm(num_examples, generator=generator)  # (num_examples,)
        indices.append(int(permutations[epoch][offset]))
    return indices


def prompt_seed(seed: int, iteration: int, index: int) -> int:
    """A sampling seed that depends only on (seed, iteration, prompt index), folded into torch's 64 bits (torch
    seeds a negative number n as n + 2**64, so the fold changes no seed that torch accepted unfolded)."""
    return ((seed * 1_000_003 + iteration) * 1_000_003 + index + 1) % 2**64


def is_eval_iteration(iteration: int, eval_every: int, iterations: int) -> bool:
    """Whether θ_k is evaluated: every `eval_every` iterations, and θ_final (k = iterations) always.

    >>> [k for k in range(6) if is_eval_iteration(k, eval_every=3, iterations=5)]
    [0, 3, 5]
    """
    return eval_every > 0 and (iteration % eval_every == 0 or iteration == iterations)


# --- sampling and scoring ---
def stop_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response: the model's generation config's EOS ids and the tokenizer's (Qwen2.5-Instruct:
    generation_config [151645, 151643], tokenizer 151645 -> [151645, 151643])."""
    listed = engine.eos_ids(model)
    return list(dict.fromkeys(listed + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])))


class DivergedError(UserError):
    """The policy samples from non-finite logits: training diverged."""


@contextmanager
def diverged_is_one_line(iteration: int, cfg: Config):
    """Non-finite logits as one line naming the likely fix: engine.py's FloatingPointError, or the RuntimeError
    torch.multinomial raises inside `generate` (its probabilities are NaN then)."""
    try:
        yield
    except (FloatingPointError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and "probability tensor contains" not in str(error):
            raise
        what = "the held-out evaluation" if iteration < 0 else f"iteration {iteration}"
        cause = error if isinstance(error, FloatingPointError) else "the model's logits are not finite (NaN or inf)"
        raise DivergedError(f"sampling {what}: {cause}; lower --lr (got {cfg.lr}) or --max-grad-norm") from None


def engine_reason(model, cfg: Config) -> str | None:
    """Why rollouts are not sampled by engine.py for this model and config (None: they are)."""
    return "--engine hf" if cfg.engine == "hf" else engine.unsupported_reason(model)


def sample_prompts(model, prompts: list[list[int]], num_samples: int, generation: GenerationConfig, cfg: Config,
                   iteration: int, first: int, on_done: Callable[[int, list[list[int]]], None] | None = None
                   ) -> list[list[list[int]]]:
    """num_samples responses to each of `prompts`, the prompts first, first + 1, ... of iteration k (-1: the held-out
    evaluation): engine.py where it is exact for the model (row i of prompt j draws from (seed, k, j, i, step)
    alone), else `generate` seeded per call (`sample_responses`). responses[prompt][sample]; `on_done` as there."""
    if engine_reason(model, cfg) is None:
        eos_ids = stop_ids_of(generation)
        with diverged_is_one_line(iteration, cfg):
            return engine.sample_groups(model, prompts, num_samples, max_new_tokens=generation.max_new_tokens,
                                        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                        min_p=cfg.min_p, stop_ids=eos_ids,
                                        keys=[(cfg.seed, iteration, first + j) for j in range(len(prompts))],
                                        on_done=on_done, pad_to_multiple_of=cfg.pad_to_multiple_of or 1,
                                        decode_step=partial(compiled_step.decode_step, compiled=engine_compiles(
                                            cfg.engine, str(next(model.parameters()).device))))
    with diverged_is_one_line(iteration, cfg):
        return sample_responses(model, prompts, num_samples, generation, prompt_seed(cfg.seed, iteration, first),
                                on_done=on_done)


def generate_calls(examples: list[Example], size: int) -> list[tuple[int, list[Example]]]:
    """(first prompt index, prompts) of each generate call: consecutive slices of `size`."""
    return [(first, examples[first:first + size]) for first in range(0, len(examples), size)]


def score_responses(rewards: Rewards, tokenizer, example: Example, responses: list[list[int]], cfg: Config,
                    state=None, logs: RewardLogs | None = None) -> tuple[list[float], list[list[float]]]:
    """(the weighted reward of each response, each reward's values [k][i]) for one prompt's responses; `state`: the
    trainer_state TRL-style rewards get (scoring.trainer_state); `logs`: what they log (None: dropped)."""
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    per_function = score_group(rewards, example.prompt, example.answer, example.columns, texts, responses,
                               cfg.reward_timeout, state, logs)
    return weighted_total(per_function, rewards.weights), per_function


def evaluate(model, tokenizer, examples: list[Example], rewards: Rewards | Reward, cfg: Config,
             state=None) -> float | None:
    """Mean (weighted) reward of `eval_samples` sampled responses per held-out prompt (fixed seeds), over the
    responses some reward scored (None if none); `state`: as score_responses'."""
    rewards = as_rewards(rewards)
    generation = sampling_config(cfg, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    totals = []
    for first, call_examples in generate_calls(examples, cfg.groups_per_call):
        prompts = run_prompt_ids(tokenizer, call_examples, cfg)
        responses = sample_prompts(model, prompts, cfg.eval_samples, generation, cfg, -1, first)
        for example, samples in zip(call_examples, responses):
            totals += score_responses(rewards, tokenizer, example, samples, cfg, state)[0]
    scored = [total for total in totals if not math.isnan(total)]
    return sum(scored) / len(scored) if scored else None


# --- one iteration, as a stream of messages ---
Message = Union["ScoredGroup", "Evaluation", "IterationDone", Span]


def rollout_iteration(model, tokenizer, train: list[Example], held_out: list[Example], rewards: Rewards | Reward,
                      cfg: Config, iteration: int, weights_version: Callable[[], int], send: Callable[[Message], None],
                      train_prompts: bool = True,
                      call_slice: tuple[int, int] = (0, 1)) -> None:
    """Send iteration k's groups in completion order, each generate call's span, then the evaluation
    (if due), then IterationDone. Completion order depends only on the sampled tokens: it is the same
    in both modes, and in every rerun.

    `weights_version()` reads the version in the weight buffer (on CPU `model`'s parameters are views of it;
    on a GPU/NPU it is the version that was copied into `model`). A group is tagged with
    the version read when its generate call started if it still reads so when the group is sent, else
    -1: its tokens came from weights that changed while it was sampled. The trainer refuses both.

    `call_slice` = (s, S): this sampler is one of S that split the iteration, and samples the generate calls c with
    c % S == s, calls[s::S] (their seeds are the calls', so the rollouts do not depend on S); slice 0 also evaluates.
    `rewards`: the --reward functions and weights (reward.load_rewards), or one reward function."""
    rewards = as_rewards(rewards)
    generation = sampling_config(cfg, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    state = trainer_state(cfg, iteration, len(train)) if any(rewards.batched) else None  # TRL-style rewards get it
    if train_prompts:
        examples = [train[i] for i in iteration_prompts(len(train), cfg.prompts_per_iteration, cfg.seed,
                                                         iteration)]
        for call, (first, call_examples) in enumerate(generate_calls(examples, cfg.groups_per_call)):
            if call % call_slice[1] != call_slice[0]:
                continue  # another sampler's generate call
            start, version = time.perf_counter(), weights_version()
            prompts = run_prompt_ids(tokenizer, call_examples, cfg)

            def score_and_send(offset: int, responses: list[list[int]]) -> None:  # called inside generate
                logs = RewardLogs()
                totals, per_function = score_responses(rewards, tokenizer, call_examples[offset], responses, cfg,
                                                       state, logs)
                advantages = grpo.group_advantages(torch.tensor(totals), cfg.group_size, cfg.scale_rewards)
                tag = version if weights_version() == version else -1  # -1: the weights changed while it sampled
                send(ScoredGroup(iteration, first + offset, tag, prompts[offset], responses, totals,
                                 advantages.tolist(), start, time.perf_counter(), call=(first, len(call_examples)),
                                 rewards_per_function=per_function, logged=logs.metrics, extra=logs.columns))

            sample_prompts(model, prompts, cfg.group_size, generation, cfg, iteration, first, on_done=score_and_send)
            last = first + len(call_examples) - 1
            send(Span(f"generate group {first}" if last == first else f"generate groups {first}-{last}", INFERENCE,
                      start, time.perf_counter()))
    if held_out and call_slice[0] == 0 and is_eval_iteration(iteration, cfg.eval_every, cfg.iterations):
        start, version = time.perf_counter(), weights_version()
        reward = evaluate(model, tokenizer, held_out, rewards, cfg, state)
        tag = version if weights_version() == version else -1  # as a group's: the weights that were evaluated
        send(Evaluation(iteration, tag, reward, start, time.perf_counter()))
    send(IterationDone(iteration))
