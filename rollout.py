"""The inference side: sample G responses per prompt, score them, and stream finished groups.

One iteration k of rollouts, with the policy weights θ_k:

    for each call of C prompts x_j of iteration k, in index order:
        o_j1..o_jG ~ π_θk(· | x_j), the C prompts at once (`sample_prompts`: engine.py, else `generate`)
        as soon as all G responses of a prompt x_j have stopped (inside the call):
            r_i = Σ_k w_k reward_k(x_j, o_ji, answer_j)   the --reward functions, checked (infra/scoring.py)
            A_i = group_advantages(r)             grpo.py
            send(Group(...))                      -> the trainer, at once
    every `eval_every` iterations: held-out reward of θ_k

`rollout_iteration` is that loop, handing each message to `send`. Synchronous mode collects them in
the trainer's own process; asynchronous mode runs the very same function in `inference.inference_process`,
whose `send` writes each message to a pipe. Same code, same seeds, so the same rollouts, in the same
order.

Calls (`--groups-per-chunk C`; default: chosen by the probe, see --sizes): one call samples C prompts x G
responses, and its groups leave in completion order, a prompt's group the step its last response stops,
while the other rows go on decoding. With long-tailed response lengths the trainer works on the short
groups while the long ones are still being sampled, without giving up the batched call. Two samplers:

- engine.py (`--engine auto`, the default, wherever `engine.unsupported_reason` finds nothing): each
  prompt prefilled once, a preallocated cache, stopped rows compacted away. Row i of prompt j draws its
  token at step t from (seed, k, j, i, t) alone, so C, compaction, workers and ranks never change a token:
  --seed decides the run.
- Hugging Face `generate` (`--engine hf`, or a model the engine is not checked on: one line says why):
  prompts left-padded to the longest; `CompletionOrder`, a `generate` streamer, sees every decode step's
  tokens and sends a group the step its last response stops; once half the rows have stopped, the call
  ends and `generate` goes on with the live rows alone, from their cache (`Compaction`). Each call runs
  right after `torch.manual_seed(prompt_seed(seed, k, j))`, j its first prompt, never of global RNG
  history, so a separate process (or a rerun) draws the same tokens from the same weights; but a prompt's
  samples depend on C (its neighbours share the RNG stream), so compare such runs at equal C.

Sampling is the distribution the trainer scores. The trainer's log-probs are those of
softmax(logits / T) (top-k, top-p and min-p only truncate what can be drawn, as in TRL), so `generate`
must apply nothing else.
But `generate` fills every field its `GenerationConfig` leaves unset from `model.generation_config`,
and real models ship sampling settings there (Qwen2.5-Instruct: top_k 20, top_p 0.8, temperature 0.7,
repetition_penalty 1.05-1.1): silently honoured, they would sample another distribution than the
one trained on. `sample_responses` therefore runs `generate` with the model's own config swapped
for a bare one (`own_sampling_only`), and states every field that shapes the distribution. A
response stops at *any* of the model's EOS ids (Qwen lists two: <|im_end|> and <|endoftext|>):
the union of the generation config's and the tokenizer's (`stop_token_ids`). (With --dtype bfloat16
the sampler's bf16 weights and the trainer's float32 masters under autocast give logits that differ
by rounding; see tri_model.py.)

Departures, on purpose:
1. No continuous batching on the `generate` path: finished rows keep their slot (generate feeds them
   padding) until half the call's rows have stopped; then they are dropped (`Compaction`), never
   refilled with new prompts (engine.py compacts, and can refill: its docstring says when each pays).
   Compaction changes which random numbers a live row draws after it (fewer rows share the stream):
   rollouts stay reproducible and equal in both modes, but differ from one uncompacted call's.
2. `repetition_penalty` and the rest of the model's shipped generation_config are ignored (see
   above): only --temperature, --top-p, --top-k and --min-p shape sampling.
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Union

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import (
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

import engine
import grpo
from config import Config, engine_compiles
from infra import compiled_step
from infra.errors import UserError
from infra.reward import Reward, Rewards, as_rewards
from infra.scoring import RewardLogs, score_group, trainer_state, weighted_total
from infra.tasks import Example, run_prompt_ids
from infra.timeline import INFERENCE, Span

COMPACT_BELOW = 0.5  # a generate call restarts on its live rows once at most this share still decode
COMPACT_MIN_STEPS = 16  # ... and at least this many decode steps are left (a restart costs ~ a few steps)


@dataclass
class Group:
    """One prompt's G scored responses, as plain Python data (cheap and safe to pickle)."""
    iteration: int
    index: int  # prompt position within the iteration
    policy_version: int  # the weights that sampled it (-1: they changed meanwhile); must equal `iteration`
    prompt_ids: list[int]
    responses: list[list[int]]  # token ids, EOS included when the model stopped
    rewards: list[float]
    advantages: list[float]
    start: float = 0.0  # its generate call's start, time.perf_counter() (a system-wide clock on Linux)
    end: float = 0.0  # when its last response stopped
    chunk: tuple[int, int] = (0, 1)  # (first prompt index, prompts) of the generate call that sampled it
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
    indices = []
    for position in range(iteration * prompts_per_iteration, (iteration + 1) * prompts_per_iteration):
        epoch, offset = divmod(position, num_examples)
        generator = torch.Generator().manual_seed((seed * 7919 + epoch) % 2**64)  # any 64-bit --seed
        permutation = torch.randperm(num_examples, generator=generator)
        indices.append(int(permutation[offset]))
    return indices


def prompt_seed(seed: int, iteration: int, index: int) -> int:
    """A sampling seed that depends only on (seed, iteration, prompt index), folded into torch's 64 bits (torch
    seeds a negative number n as n + 2**64, so the fold changes no seed that torch accepted unfolded)."""
    return ((seed * 1_000_003 + iteration) * 1_000_003 + index + 1) % 2**64


def is_eval_iteration(iteration: int, eval_every: int, iterations: int) -> bool:
    """Whether θ_k is evaluated: every `eval_every` iterations, and θ_final (k = iterations) always."""
    return eval_every > 0 and (iteration % eval_every == 0 or iteration == iterations)


# --- sampling and scoring ---
def stop_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response: the model's generation config's EOS ids and the tokenizer's.

    >>> # Qwen2.5-Instruct: generation_config [151645, 151643], tokenizer 151645 -> [151645, 151643]
    """
    listed = engine.eos_ids(model)
    return list(dict.fromkeys(listed + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])))


def sampling_config(cfg: Config, eos_ids: list[int], pad_id: int) -> GenerationConfig:
    """Sampling from softmax(logits / T), truncated by top-k, top-p and min-p as asked and by nothing else."""
    return GenerationConfig(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            min_p=cfg.min_p, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
                            no_repeat_ngram_size=0, min_length=0, bad_words_ids=None,
                            suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None,
                            forced_eos_token_id=None, max_new_tokens=cfg.max_new_tokens, eos_token_id=eos_ids,
                            pad_token_id=pad_id)


def stop_ids_of(generation: GenerationConfig) -> list[int]:
    """The config's EOS ids as a list (it holds one id or a list)."""
    eos = generation.eos_token_id
    return eos if isinstance(eos, list) else [eos]


@contextmanager
def own_sampling_only(model):
    """Run `generate` with a bare `model.generation_config`, so no shipped default fills our config's gaps."""
    shipped = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=shipped.eos_token_id, pad_token_id=shipped.pad_token_id)
    try:
        yield
    finally:
        model.generation_config = shipped


def trim_response(tokens: list[int], eos_ids: list[int]) -> list[int]:
    """Cut after the first stop id (kept: stopping is an action the policy is trained on).

    >>> trim_response([5, 7, 2, 0, 0], eos_ids=[3, 2])
    [5, 7, 2]
    """
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: position + 1]
    return tokens


class CompletionOrder(BaseStreamer):
    """Watches a batched `generate` step by step and reports each prompt's responses as soon as they are all done.

    `generate` hands a streamer the prompt batch once, then each step's new token of every row of the call
    (`self.rows`, their positions among the C·G rows). A row is done at its first stop id (kept) or at
    max_new_tokens; a prompt is done when its G rows are. on_done(prompt position, responses) runs right then,
    inside `generate`, while the other rows go on decoding: short groups reach the trainer while long ones are
    still being sampled.
    """

    def __init__(self, num_prompts: int, num_samples: int, eos_ids: list[int], max_new_tokens: int,
                 on_done: Callable[[int, list[list[int]]], None] | None = None):
        self.num_samples, self.eos_ids, self.max_new_tokens = num_samples, set(eos_ids), max_new_tokens
        self.on_done = on_done or (lambda position, responses: None)
        self.responses = [[[] for _ in range(num_samples)] for _ in range(num_prompts)]  # [prompt][sample]
        self.running = [num_samples] * num_prompts  # rows of each prompt still decoding
        self.done = [False] * (num_prompts * num_samples)
        self.live = num_prompts * num_samples  # rows still decoding, over all calls
        self.steps = 0  # decode steps so far, over all calls (every live row has this many tokens)
        self.start_call(list(range(num_prompts * num_samples)))

    def start_call(self, rows: list[int]) -> None:
        """A `generate` call on `rows` (positions among the C·G rows) begins: its first put is its prompt batch."""
        self.rows, self.prompt_seen = rows, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt batch (rows, P), not new tokens
            self.prompt_seen = True
            return
        self.steps += 1
        finished = []
        for row, token in zip(self.rows, value.tolist()):  # (rows,) this step's token of every row of the call
            if self.done[row]:
                continue  # a stopped row: generate feeds it padding
            prompt, sample = divmod(row, self.num_samples)
            response = self.responses[prompt][sample]
            response.append(token)
            if token in self.eos_ids or len(response) == self.max_new_tokens:
                self.done[row] = True
                self.live -= 1
                self.running[prompt] -= 1
                if self.running[prompt] == 0:
                    finished.append(prompt)
        for prompt in finished:
            self.on_done(prompt, self.responses[prompt])

    def end(self) -> None:
        pass  # a call may end with rows still live (`Compaction`): sample_responses calls generate again


class Compaction(StoppingCriteria):
    """Ends a `generate` call once at most `share` of its rows still decode, so that it goes on with those alone.

    `generate` keeps computing a stopped row (fed padding) until the call's longest response ends, and on CPU
    a decode step's cost grows with the rows: with a long tail, a few live rows pay for all. The next call gets
    the live rows' keys and values (the cache, rows selected), so it costs no prefill, only generate's set-up (a
    few decode steps' worth): not worth it with fewer than COMPACT_MIN_STEPS steps left (the toy task's 8 new
    tokens never compact)."""

    def __init__(self, stream: CompletionOrder, share: float):
        self.stream, self.share = stream, share

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        stream = self.stream
        stop = (stream.live <= self.share * len(stream.rows)
                and stream.max_new_tokens - stream.steps >= COMPACT_MIN_STEPS)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def sample_responses(model, prompts: list[list[int]], num_samples: int, generation: GenerationConfig,
                     seed: int, on_done: Callable[[int, list[list[int]]], None] | None = None,
                     compact_below: float = COMPACT_BELOW) -> list[list[list[int]]]:
    """num_samples responses to each prompt, from one batched `generate`, reproducible from `seed`.

    Prompts are left-padded to the longest, with an attention mask, so every response continues
    its own prompt (generate derives position ids from the mask). Returns responses[prompt][sample],
    each cut after its first stop id; `on_done` gets each prompt's responses the moment they are
    complete (`CompletionOrder`). Once at most `compact_below` of the rows still decode, `generate`
    returns (`Compaction`) and is called again on the live rows alone, with their cache: the same
    tokens under greedy decoding; sampled, the RNG stream goes on (fewer rows draw from it), so the
    tokens are reproducible but not those of one uncompacted call. 0: one call, never compacted.
    """
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    padded = [[generation.pad_token_id] * (width - len(p)) + p for p in prompts for _ in range(num_samples)]
    real = [[0] * (width - len(p)) + [1] * len(p) for p in prompts for _ in range(num_samples)]
    input_ids = torch.tensor(padded, device=device)               # (C·G, P_max)
    attention_mask = torch.tensor(real, device=device)            # (C·G, P_max)
    eos_ids = stop_ids_of(generation)
    stream = CompletionOrder(len(prompts), num_samples, eos_ids, generation.max_new_tokens, on_done)
    stopping = StoppingCriteriaList([Compaction(stream, compact_below)])
    budget = copy.copy(generation)
    budget.return_dict_in_generate = True  # the cache comes back, for the next call
    rows, cache = list(range(len(prompts) * num_samples)), None  # the rows of the call, among the C·G
    torch.manual_seed(seed)
    with own_sampling_only(model):
        while rows:
            stream.start_call(rows)
            resumed = {} if cache is None else {engine.cache_argument(model): cache}  # a compacted call's live rows
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=budget,
                                 streamer=stream, stopping_criteria=stopping, **resumed)
            live = [i for i, row in enumerate(rows) if not stream.done[row]]
            if not live:
                break
            keep, new = torch.tensor(live, device=device), out.sequences.shape[1] - input_ids.shape[1]
            input_ids = out.sequences[keep]                      # (live, P_max + R so far)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), new)], dim=1)[keep]
            cache = out.past_key_values
            cache.batch_select_indices(keep)  # the live rows' keys and values: no second prefill
            rows, budget.max_new_tokens = [rows[i] for i in live], budget.max_new_tokens - new
    return stream.responses


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


def chunks(examples: list[Example], size: int) -> list[tuple[int, list[Example]]]:
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
    for first, chunk in chunks(examples, cfg.groups_per_chunk):
        prompts = run_prompt_ids(tokenizer, chunk, cfg)
        responses = sample_prompts(model, prompts, cfg.eval_samples, generation, cfg, -1, first)
        for example, samples in zip(chunk, responses):
            totals += score_responses(rewards, tokenizer, example, samples, cfg, state)[0]
    scored = [total for total in totals if not math.isnan(total)]
    return sum(scored) / len(scored) if scored else None


# --- one iteration, as a stream of messages ---
Message = Union["Group", "Evaluation", "IterationDone", Span]


def rollout_iteration(model, tokenizer, train: list[Example], held_out: list[Example], rewards: Rewards | Reward,
                      cfg: Config, iteration: int, weights_version: Callable[[], int], send: Callable[[Message], None],
                      train_prompts: bool = True,
                      share: tuple[int, int] = (0, 1)) -> None:
    """Send iteration k's groups in completion order, each generate call's span, then the evaluation
    (if due), then IterationDone. Completion order depends only on the sampled tokens: it is the same
    in both modes, and in every rerun.

    `weights_version()` reads the version in the weight buffer (on CPU `model`'s parameters are views of it;
    on a GPU/NPU it is the version that was copied into `model`). A group is tagged with
    the version read when its generate call started if it still reads so when the group is sent, else
    -1: its tokens came from weights that changed while it was sampled. The trainer refuses both.

    `share` = (s, S): this sampler is one of S that split the iteration, and samples the generate calls c with
    c % S == s (their seeds are the calls', so the rollouts do not depend on S); share 0 also evaluates.
    `rewards`: the --reward functions and weights (reward.load_rewards), or one reward function."""
    rewards = as_rewards(rewards)
    generation = sampling_config(cfg, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    state = trainer_state(cfg, iteration, len(train)) if any(rewards.batched) else None  # TRL-style rewards get it
    if train_prompts:
        examples = [train[i] for i in iteration_prompts(len(train), cfg.prompts_per_iteration, cfg.seed,
                                                         iteration)]
        for call, (first, chunk) in enumerate(chunks(examples, cfg.groups_per_chunk)):
            if call % share[1] != share[0]:
                continue  # another sampler's generate call
            start, version = time.perf_counter(), weights_version()
            prompts = run_prompt_ids(tokenizer, chunk, cfg)

            def score_and_send(offset: int, responses: list[list[int]]) -> None:  # called inside generate
                logs = RewardLogs()
                totals, per_function = score_responses(rewards, tokenizer, chunk[offset], responses, cfg, state, logs)
                advantages = grpo.group_advantages(torch.tensor(totals), cfg.group_size, cfg.scale_rewards)
                tag = version if weights_version() == version else -1  # -1: the weights changed while it sampled
                send(Group(iteration, first + offset, tag, prompts[offset], responses, totals, advantages.tolist(),
                           start, time.perf_counter(), chunk=(first, len(chunk)), rewards_per_function=per_function,
                           logged=logs.metrics, extra=logs.columns))

            sample_prompts(model, prompts, cfg.group_size, generation, cfg, iteration, first, on_done=score_and_send)
            last = first + len(chunk) - 1
            send(Span(f"generate group {first}" if last == first else f"generate groups {first}-{last}", INFERENCE,
                      start, time.perf_counter()))
    if held_out and share[0] == 0 and is_eval_iteration(iteration, cfg.eval_every, cfg.iterations):
        start, version = time.perf_counter(), weights_version()
        reward = evaluate(model, tokenizer, held_out, rewards, cfg, state)
        tag = version if weights_version() == version else -1  # as a group's: the weights that were evaluated
        send(Evaluation(iteration, tag, reward, start, time.perf_counter()))
    send(IterationDone(iteration))
