"""The `generate` sampler: Hugging Face's `model.generate`, for --engine hf (the reference) and for models engine.py
is not checked on, streaming each prompt's group the step its last response stops, as the engine does.

    responses = sample_responses(model, prompts, G, sampling_config(cfg, stop_ids, pad_id), seed, on_done=...)

Prompts are left-padded to the longest; `CompletionOrder`, a `generate` streamer, sees every decode step's
tokens and calls on_done(j, responses[j]) the step prompt j's last response stops; once half the rows have
stopped, the call ends and `generate` goes on with the live rows alone, from their cache (`Compaction`). Each
call runs right after `torch.manual_seed(seed)` (rollout.prompt_seed of its first prompt), never of global RNG
history, so a separate process (or a rerun) draws the same tokens from the same weights; but a prompt's samples
depend on which prompts share the call (they share the RNG stream), so compare such runs at equal call sizes.

Sampling is the distribution the trainer scores, softmax(logits / T) truncated by top-k, top-p and min-p, and
nothing else. But `generate` fills every field its `GenerationConfig` leaves unset from
`model.generation_config`, and real models ship sampling settings there (Qwen2.5-Instruct: top_k 20, top_p 0.8,
temperature 0.7, repetition_penalty 1.05-1.1): silently honoured, they would sample another distribution than
the one trained on. `sample_responses` therefore runs `generate` with the model's own config swapped for a bare
one (`own_sampling_only`), and `sampling_config` states every field that shapes the distribution.

Departures, on purpose:
1. No continuous batching: finished rows keep their slot (generate feeds them padding) until half the call's
   rows have stopped; then they are dropped (`Compaction`), never refilled with new prompts (engine.py compacts
   and refills). Compaction changes which random numbers a live row draws after it (fewer rows share the
   stream): rollouts stay reproducible and equal in both modes, but differ from one uncompacted call's.
2. `repetition_penalty` and the rest of the model's shipped generation_config are ignored: only --temperature,
   --top-p, --top-k and --min-p shape sampling.
"""
from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from typing import Callable

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from config import Config

COMPACT_BELOW = 0.5  # a generate call restarts on its live rows once at most this share still decode
COMPACT_MIN_STEPS = 16  # ... and at least this many decode steps are left (a restart costs ~ a few steps)


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
            resumed = {} if cache is None else {cache_argument(model): cache}  # a compacted call's live rows
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


def cache_argument(model) -> str:
    """The keyword `generate` takes a cache by: 'cache' (transformers >= 5.x) or 'past_key_values'."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
