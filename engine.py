"""One generate call's rollouts: each prompt prefilled once, a preallocated cache, a fixed-shape decode step, and
random draws decided by the seed alone. Only torch and transformers are imported: copy it alone.

    >>> import transformers
    >>> model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    >>> responses = sample_groups(model, [[1, 2, 3], [4]], group_size=2, max_new_tokens=3)
    >>> [len(group) for group in responses], all(1 <= len(r) <= 3 for group in responses for r in group)
    ([2, 2], True)

responses[j][i] is sample i of prompt j, cut after its first stop id (kept); on_done(j, responses[j]) runs the
moment prompt j's G responses have all stopped (the completion order rollout.py streams groups in). One call:
  1. Prefill: each prompt once, unpadded, its keys and values written straight into its G rows' cache; short
     prompts packed in one forward, (1, P_a + P_b + ...), under a block-diagonal causal mask.
  2. Decode: one (n, 1) forward per step over the first n cache rows: row r feeds its last token at position
     P_r + t - 1, writes its keys and values at that slot and attends to slots 0 .. P_r + t - 1 (an additive
     (n, 1, 1, L) mask over the whole cache: a fixed shape). Draws and bookkeeping stay on the device.
  3. Every `check_every` steps the host reads which rows stopped; groups whose G rows all have go to on_done,
     ordered by the step their last row stopped, then by prompt. Stopped rows are compacted away (n shrinks)
     and the room refilled with whole prompts not yet started, up to `max_rows` rows in flight.

The draw. Row (j, i) at response step t, with logits z ∈ R^V:
    u     = U(key_j, i, t) ∈ [0, 1)   output t of a SplitMix64 stream seeded by a hash of (key_j..., i)
    p     = softmax(z / T)             what the trainer scores: its log-probs are log_softmax(z / T)
    S     = the tokens transformers' warpers keep, in generate's order: top_k, then top_p, then min_p
    token = the s ∈ S with F(s⁻) <= u·F(S) < F(s), F the running sum of p over S
so P(token = s) = p_s / Σ_S p, and u depends on (key, sample, step) alone: which prompts share a call, batch
sizes, compaction, workers and ranks never decide a token (logits may still differ in their last bits between
batch shapes: a token flips only if u·F(S) falls that close to a boundary). greedy=True takes argmax z.

Departures, on purpose:
1. Another random stream than `generate`'s torch.multinomial: reproducible from the keys alone (greedy tokens
   equal generate's). No repetition penalty.
2. The inverse CDF runs in two levels (the block of BLOCK tokens, then the token in it): float32 running sums over
   a large vocabulary would blur small probabilities, float64 ones over all of it cost a second draw.
3. The output layer runs as W·hᵀ on CPU (faster for a few rows there), elsewhere as h·Wᵀ (rows first); the
   decode step's attention reads the cache once (`decode_attention`), not once per query head.
4. Checked models (`unsupported_reason`): Qwen2, Qwen3, Llama and Mistral, full causal sdpa or eager attention.
"""
from __future__ import annotations

from inspect import signature
from itertools import accumulate
from typing import Callable

import torch
from transformers import AttentionInterface


CHECKED_TYPES = ("qwen2", "qwen3", "llama", "mistral")
RUNNING = 2**62  # the stop step of a row still decoding
BLOCK = 1024  # tokens per block of the two-level inverse CDF
PREFILL_TOKENS = 512  # most tokens in one packed prefill row on CPU
PREFILL_TOKENS_ACCELERATOR = 8192  # elsewhere: a forward's launches cost more than its T^2 mask


def unsupported_reason(model) -> str | None:
    """Why the engine would not sample exactly what `model` scores (one line), or None when it would."""
    config, kind = model.config, getattr(model.config, "model_type", None)
    if kind not in CHECKED_TYPES:
        return f"model type {kind!r} is not one the engine is checked on ({', '.join(CHECKED_TYPES)})"
    windowed = getattr(config, "use_sliding_window", False) or kind == "mistral" and config.sliding_window is not None
    if windowed or any(layer != "full_attention" for layer in getattr(config, "layer_types", None) or []):
        return "sliding-window attention is active (the engine's mask is full causal attention)"
    if capped := [name for name in ("attn_logit_softcapping", "final_logit_softcapping") if getattr(config, name, 0)]:
        return f"{capped[0]} is set (the engine does not cap logits)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if (rope_type := rope.get("rope_type", rope.get("type"))) in ("dynamic", "longrope"):
        return f"rope scaling {rope_type!r} depends on which rows share a step"
    if (implementation := getattr(config, "_attn_implementation", None)) not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} (the engine's 4-D mask needs 'sdpa' or 'eager')"
    head = model.get_output_embeddings()
    return None if isinstance(head, torch.nn.Linear) and head.bias is None else "the output layer is not bias-free"


# --- the random draws: SplitMix64, on Python ints (the seeds) and on int64 tensors (the steps) ---
MASK64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(z: int) -> int:
    """SplitMix64's output function, mod 2^64."""
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def as_int64(x: int) -> int:
    """The int64 with the same 64 bits as x in [0, 2^64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def row_seed(key: tuple[int, ...], sample: int) -> int:
    """The seed of one row's stream: each of (key..., sample) folded in by one SplitMix64 step, as int64.
    >>> row_seed((0, 0, 0), 0) != row_seed((0, 0, 0), 1) != row_seed((0, 0, 1), 0)
    True
    """
    state = 0
    for part in (*key, sample):
        state = mix64(((state ^ (part & MASK64)) + GOLDEN) & MASK64)
    return as_int64(state)


def shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits: torch's >> is arithmetic (a negative z would shift in ones)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """u ∈ [0, 1): output `step` of the SplitMix64 stream `seed`, its top 32 bits; (n,), (n,) int64 -> (n,) float64.
    int64 additions and products wrap like uint64 ones (two's complement): these are mix64's mod-2^64 formulas."""
    z = seeds + (steps + 1) * as_int64(GOLDEN)                   # (n,) the stream's state after step + 1 increments
    z = (z ^ shift_right(z, 30)) * as_int64(MIX1)
    z = (z ^ shift_right(z, 27)) * as_int64(MIX2)
    z = z ^ shift_right(z, 31)
    return shift_right(z, 32).double() * 2.0**-32                # (n,) multiples of 2^-32, at most 1 - 2^-32


# --- one token per row from its logits and its uniform ---
def truncated_order(probs: torch.Tensor, top_k: int, top_p: float, min_p: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities in descending order, zero outside the kept set; their token ids): the set transformers'
    top-k, top-p and min-p warpers keep, in generate's order: the k most likely (ties with the k-th kept), the
    smallest top set holding top_p of what is left, those at least min_p times the most likely. The first stays."""
    probs, order = probs.sort(dim=-1, descending=True, stable=True)   # (n, V) ties: lower id first
    if top_k:
        probs = probs.masked_fill(probs < probs[:, min(top_k, probs.shape[-1]) - 1:][:, :1], 0.0)
    if top_p < 1.0:
        kept = probs.sum(dim=-1, keepdim=True) if top_k else 1.0      # top-p's mass is of what top-k left
        above = probs.cumsum(dim=-1) - probs                          # (n, V) mass ranked above each token
        probs = probs.masked_fill(above >= top_p * kept, 0.0)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    return probs, order


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index s with F(s⁻) <= u·F(V) < F(s), F the running sum of `weights` (n, V) >= 0; u (n,) in [0, 1).

    Two levels: the block of BLOCK weights holding u·F(V), then the weight inside it; blocks summed in float32
    (the rounding the probabilities carry anyway), running sums in float64. The chosen weight is positive: u·F(V)
    < F(V), and a rounding past the block's last positive weight is clamped to it."""
    vocab = weights.shape[-1]
    whole = vocab - vocab % BLOCK
    block_sums = weights[:, :whole].unflatten(1, (-1, BLOCK)).sum(dim=-1)    # (n, B) the last block may be partial
    if whole < vocab:
        block_sums = torch.cat([block_sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=-1)
    block_cdf = block_sums.double().cumsum(dim=-1)                            # (n, B)
    target = u.unsqueeze(-1) * block_cdf[:, -1:]                             # (n, 1) in [0, F(V))
    block = torch.searchsorted(block_cdf, target, right=True)                # (n, 1) first block ending above it
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)  # (n, 1) F before it
    ids = block * BLOCK + torch.arange(BLOCK, device=weights.device)          # (n, BLOCK) its token ids
    inside = weights.gather(-1, ids.clamp(max=vocab - 1)).masked_fill(ids >= vocab, 0.0)  # (n, BLOCK)
    offset = torch.searchsorted(inside.cumsum(dim=-1, dtype=torch.float64), target - before, right=True)  # (n, 1)
    last_positive = BLOCK - 1 - (inside > 0).flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)  # (n, 1)
    token = block * BLOCK + torch.minimum(offset, last_positive)             # (n, 1)
    return token.clamp(0, vocab - 1).squeeze(-1)  # (n,) (non-finite weights: any id, and `nonfinite` says so)


def draw_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                min_p: float | None = None) -> torch.Tensor:
    """Tokens drawn by inverse CDF from softmax(logits / T) truncated by top-k, top-p, min-p; (n, V), (n,) -> (n,)."""
    if temperature != 1.0:  # else softmax reads bf16 logits as they are and computes in float32: one pass
        logits = logits.to(torch.float32, copy=True).div_(temperature)  # (n, V) a copy: the caller's stay
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (n, V)
    if top_p >= 1.0 and not top_k and min_p is None:
        return inverse_cdf(probs, u)
    probs, order = truncated_order(probs, top_k, top_p, min_p)     # (n, V), (n, V)
    return order.gather(-1, inverse_cdf(probs, u).unsqueeze(-1)).squeeze(-1)


def checked_draw(logits: torch.Tensor, seeds: torch.Tensor, lengths: torch.Tensor, greedy: bool, temperature: float,
                 top_p: float, top_k: int, min_p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's token: argmax if greedy, else draw_tokens with its uniform for step `lengths`; whether every
    logit was finite: one min/max pass, NaN propagates into both), logits (n, V), seeds and lengths (n,)."""
    low, high = torch.aminmax(logits)
    finite = torch.isfinite(low) & torch.isfinite(high)                                   # () bool
    if greedy:
        return logits.argmax(dim=-1), finite
    return draw_tokens(logits, uniforms(seeds, lengths), temperature, top_p, top_k, min_p), finite


# --- the cache ---
class RowCache:
    """Every row's keys and values, preallocated: (layers, rows, kv_heads, L, head_dim) each, L = P_max + M rounded
    up. Hugging Face's attention layers call update(key, value, layer) and attend over what it returns; set first:
      prefill_slots (rows, slots, sources), (N,) each: position sources[k] of a packed prompt row's key
        (1, kv, T, D) goes to slot slots[k] of cache row rows[k]; the key is returned as it is;
      positions (n,): row r's new key (n, kv, 1, D) goes to slot positions[r]; the first n rows' cache is returned."""

    def __init__(self, model, rows: int, length: int):
        config, weight = model.config, model.get_output_embeddings().weight
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_hidden_layers, rows, config.num_key_value_heads, length, head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)      # (layers, rows, kv, L, D)
        self.values = torch.zeros_like(self.keys)                                      # (layers, rows, kv, L, D)
        self.row_index = torch.arange(rows, device=weight.device)
        self.prefill_slots, self.positions = None, None  # set before each forward (above)

    @torch.compiler.disable  # eager inside compiled layers: compiled, a write into a view copies the whole slice
    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args, **kwargs):
        if self.positions is None:
            rows, slots, sources = self.prefill_slots  # (N,) each: cache row, its slot, the packed position
            self.keys[layer, rows, :, slots] = key[0, :, sources].transpose(0, 1)  # (N, kv, D) <- (kv, N, D)
            self.values[layer, rows, :, slots] = value[0, :, sources].transpose(0, 1)
            return key, value
        n = self.positions.shape[0]
        keys, values, rows = self.keys[layer, :n], self.values[layer, :n], self.row_index[:n]  # (n, kv, L, D) views
        keys[rows, :, self.positions] = key[:, :, 0]  # (n, kv, D) one slot per row
        values[rows, :, self.positions] = value[:, :, 0]
        return keys, values

    def get_seq_length(self, layer: int = 0) -> int:  # transformers < 5 asks it; our positions are given
        return 0


# --- the decode step's attention: query heads folded onto their key head, the cache read once ---
DECODE_ATTENTION = "periodic_rl_decode"


def decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """One new token per row against its whole cache, for Hugging Face's attention layers (AttentionInterface):
    query (n, H, 1, D), key and value (n, K, L, D), mask (n, 1, 1, L) -> (n, 1, H, D). Query head h reads key
    head h // (H/K) (what repeat_kv builds), so a key head's H/K query heads are folded into a query of H/K
    positions: softmax(q·kᵀ·scale + mask)·v over (n, K, H/K, D) x (n, K, L, D), no copy of the cache per head."""
    (n, heads, _, dim), groups = query.shape, key.shape[1]
    folded = query.reshape(n, groups, heads // groups, dim)                                     # (n, K, H/K, D)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask,
                                                           scale=scaling)                       # (n, K, H/K, D)
    return out.reshape(n, 1, heads, dim), None                                                  # (n, 1, H, D)


# --- one call's rows: prefill, decode, compaction, on the device ---
class GenerateCall:
    """The state of one call on the device. Rows are numbered j·G + i (sample i of prompt j); row C·G is a
    stand-in that is always stopped, for slots with no row (fixed shapes). Slots are cache rows: slot k holds
    row slot_rows[k], and only the first n slots are decoded. `decode_layers` and `decode_draw` are the decode
    step's forward and draw (infra/compiled_step.py swaps in compiled ones)."""

    def __init__(self, model, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float,
                 top_p: float, stop_ids: list[int], keys: list[tuple[int, ...]], slots: int, greedy: bool,
                 top_k: int = 0, min_p: float | None = None, pad_to_multiple_of: int = 1):
        AttentionInterface.register(DECODE_ATTENTION, decode_attention)  # known to transformers by name
        weight = model.get_output_embeddings().weight
        decoder = model.get_decoder()  # the layers below the head (`base_model` would be peft's LoraModel, --use-peft)
        self.decoder, self.head, self.device, self.dtype = decoder, weight, weight.device, weight.dtype
        self.cache_argument = "cache" if "cache" in signature(decoder.forward).parameters else "past_key_values"
        self.prompts, self.group_size, self.max_new_tokens = prompts, group_size, max_new_tokens
        self.temperature, self.top_p, self.top_k, self.min_p, self.greedy = temperature, top_p, top_k, min_p, greedy
        self.pad_to_multiple_of = pad_to_multiple_of  # the cache length and each prefill row, rounded up
        longest = max(len(prompt) for prompt in prompts) + max_new_tokens  # a stopped row writes one slot more
        self.length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of  # rounded up
        self.cache = RowCache(model, slots, self.length)
        self.decode_layers: Callable[[dict], torch.Tensor] = lambda inputs: decoder(**inputs).last_hidden_state
        self.decode_draw: Callable = checked_draw
        self.stand_in = rows = len(prompts) * group_size
        long = dict(dtype=torch.long, device=self.device)
        self.seeds = torch.tensor([row_seed(key, i) for key in keys for i in range(group_size)] + [0], **long)
        ends = [len(prompt) - 1 for prompt in prompts for _ in range(group_size)] + [self.length - 1]  # (C·G + 1,)
        self.prompt_ends = torch.tensor(ends, **long)  # last prompt slots; the stand-in's, the cache's last, is unread
        self.tokens = torch.zeros(rows + 1, max_new_tokens, **long)  # (C·G + 1, M)
        self.lengths = torch.zeros(rows + 1, **long)  # tokens drawn so far
        self.stop_step = torch.tensor([RUNNING] * rows + [-1], **long)  # (C·G + 1,) the stand-in: stopped
        self.slot_rows = torch.full((slots,), self.stand_in, **long)
        self.last_token = torch.zeros(slots, **long)  # each slot's next input
        self.stop_ids = torch.tensor(stop_ids, **long)
        self.step = torch.zeros((), **long)  # decode steps so far (0-dim: graph-safe)
        self.cache_slots = torch.arange(self.length, device=self.device)
        self.min = torch.finfo(self.dtype).min
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)  # any logit NaN or inf so far

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               packed_ends: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each row's last position, (rows, V), of one forward of the model's layers on our cache and
        mask; a packed prefill row (1, T) gives those of the positions `packed_ends` (k,) instead, (k, V)."""
        inputs = dict(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                      **{self.cache_argument: self.cache})
        if packed_ends is not None:  # prefill attends as the model does
            hidden = self.decoder(**inputs).last_hidden_state[0, packed_ends]                  # (k, H)
        else:  # the cache read once (decode_attention)
            config = self.decoder.config
            implementation, config._attn_implementation = config._attn_implementation, DECODE_ATTENTION
            try:
                hidden = self.decode_layers(inputs)[:, -1]                                     # (rows, H)
            finally:
                config._attn_implementation = implementation
        if self.device.type == "cpu":
            return torch.mm(self.head, hidden.t()).t()  # (rows, V) = ((V, H)·(H, rows))ᵀ, departure 3
        return torch.mm(hidden, self.head.t())  # (rows, V) rows first: the draw reads it contiguously (departure 3)

    def draw(self, logits: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, decoding: bool = False
             ) -> torch.Tensor:
        """Each row's next token (checked_draw, or in a decode step `decode_draw`); a non-finite logit is flagged."""
        new, finite = (self.decode_draw if decoding else checked_draw)(
            logits, self.seeds[rows], lengths, self.greedy, self.temperature, self.top_p, self.top_k, self.min_p)
        self.nonfinite.logical_or_(~finite)  # read by the host when it looks (no sync here)
        return new

    def record(self, rows: torch.Tensor, lengths: torch.Tensor, running: torch.Tensor, new: torch.Tensor) -> None:
        """Token `lengths[r]` of each running row is `new[r]`; a row stops at a stop id or at max_new_tokens."""
        column = lengths.clamp(max=self.max_new_tokens - 1)                            # (n,)
        self.tokens[rows, column] = torch.where(running, new, self.tokens[rows, column])
        stops = running & ((new.unsqueeze(-1) == self.stop_ids).any(-1) | (lengths == self.max_new_tokens - 1))
        self.stop_step[rows] = torch.where(stops, self.step, self.stop_step[rows])
        self.lengths[rows] = lengths + running  # (n,) long + bool

    def prefill(self, prompts: list[int], slots: list[torch.Tensor]) -> None:
        """Prompts `prompts`, packed in one row, each into the cache of its G rows at slots[q] (G,); their rows'
        first tokens. Prompt q has its own positions 0 .. P_q - 1 and attends causally to itself alone: what it
        would compute alone. Padding (to pad_to_multiple_of) sees only itself and is never cached."""
        group, lengths = self.group_size, [len(self.prompts[q]) for q in prompts]
        tokens = [token for q in prompts for token in self.prompts[q]]
        padding = -len(tokens) % self.pad_to_multiple_of
        long = dict(dtype=torch.long, device=self.device)
        ids = torch.tensor([tokens + [0] * padding], **long)  # (1, T'); then each token's position and prompt
        positions = torch.tensor([p for length in lengths for p in range(length)] + [0] * padding, **long)  # (T',)
        owner = torch.tensor([q for q, size in enumerate(lengths) for _ in range(size)] + [-1] * padding, **long)
        every_slot = torch.cat(slots)                                                                     # (k·G,)
        cache_rows = every_slot.view(len(prompts), group).repeat_interleave(torch.tensor(lengths, **long), dim=0,
                                                                            output_size=len(tokens))     # (T, G)
        self.cache.prefill_slots = (cache_rows.flatten(), positions[:len(tokens)].repeat_interleave(group),
                                    torch.arange(len(tokens), **long).repeat_interleave(group))           # (T·G,)
        self.cache.positions = None
        visible = (owner[:, None] == owner[None, :]) & (positions[:, None] >= positions[None, :])         # (T', T')
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, self.min)
        ends = torch.tensor([end - 1 for end in accumulate(lengths)], **long)                             # (k,)
        logits = self.logits(ids, positions[None], mask[None, None], ends)                                # (k, V)
        rows = torch.tensor([q * group + i for q in prompts for i in range(group)], **long)               # (k·G,)
        new = self.draw(logits.repeat_interleave(group, dim=0), rows, torch.zeros_like(rows))             # (k·G,)
        self.record(rows, torch.zeros_like(rows), torch.ones_like(rows, dtype=torch.bool), new)
        self.slot_rows[every_slot], self.last_token[every_slot] = rows, new

    def decode(self, n: int) -> None:
        """One step of the first n slots: every running row draws one token (fixed shapes, no host sync)."""
        self.step += 1  # before recording: a prompt prefilled at step s and stopped at once ranks before step s + 1
        rows = self.slot_rows[:n]                                                          # (n,)
        lengths = self.lengths[rows]                                                       # (n,)
        running = self.stop_step[rows] == RUNNING                                          # (n,)
        positions = self.prompt_ends[rows] + lengths                                       # (n,) last token's slot
        unseen = self.cache_slots > positions.unsqueeze(-1)                                # (n, L)
        mask = torch.zeros(unseen.shape, dtype=self.dtype, device=self.device).masked_fill_(unseen, self.min)
        self.cache.positions = positions
        logits = self.logits(self.last_token[:n, None], positions[:, None], mask[:, None, None, :])  # (n, V)
        new = self.draw(logits, rows, lengths, decoding=True)                              # (n,)
        self.record(rows, lengths, running, new)
        self.last_token[:n] = new

    def compact(self, keep: list[int], n: int) -> None:
        """Slots `keep` (their rows still run) to the front, in order; slots len(keep)..n-1 get the stand-in."""
        index, cache = torch.tensor(keep, dtype=torch.long, device=self.device), self.cache  # (m,)
        cache.keys[:, :len(keep)], cache.values[:, :len(keep)] = cache.keys[:, index], cache.values[:, index]
        self.slot_rows[:len(keep)], self.last_token[:len(keep)] = self.slot_rows[index], self.last_token[index]
        self.slot_rows[len(keep):n] = self.stand_in


def packs(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive prompts grouped into prefill rows of at most `budget` tokens (a longer prompt alone).
    >>> packs([8, 8, 8, 300, 8], 256)
    [[0, 1, 2], [3], [4]]
    """
    grouped: list[list[int]] = []
    total = budget + 1  # tokens in the last row: the first prompt opens one
    for index, length in enumerate(lengths):
        if total + length > budget:
            grouped, total = grouped + [[]], 0
        grouped[-1].append(index)
        total += length
    return grouped


def bucket(rows: int, capacity: int, fixed_shapes: bool) -> int:
    """The row count a step runs at: `rows` itself, or with fixed shapes the next power of two (at most capacity).
    >>> bucket(5, 24, True), bucket(17, 24, True), bucket(5, 24, False)
    (8, 24, 5)
    """
    return rows if not fixed_shapes or rows == 0 else min(capacity, 1 << (rows - 1).bit_length())


def eos_ids(model) -> list[int]:
    """The EOS ids of the model's generation config (it holds one id, a list, or None)."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if listed is None else [listed] if isinstance(listed, int) else list(listed)


@torch.inference_mode()  # no autograd bookkeeping per operation; the results are lists
def sample_groups(model, prompts: list[list[int]], group_size: int, *, max_new_tokens: int, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, min_p: float | None = None, stop_ids: list[int] | None = None,
                  keys: list[tuple[int, ...]] | None = None, on_done: Callable[[int, list], None] | None = None,
                  max_rows: int | None = None, greedy: bool = False, check_every: int | None = None,
                  fixed_shapes: bool | None = None, prefill_tokens: int | None = None, pad_to_multiple_of: int = 1,
                  decode_step: Callable[[GenerateCall], Callable[[int], None]] | None = None) -> list[list[list[int]]]:
    """group_size responses to each prompt: responses[j][i], cut after its first stop id (kept).

    stop_ids: default the model's EOS ids. keys[j]: prompt j's key, e.g. (seed, iteration, prompt index), which
    with the sample index and the step alone decides the row's draws (default (j,)). on_done(j, responses[j]):
    as each group completes. max_rows: rows decoded at once (None: all). check_every: decode steps between the
    host's looks (default 1 on CPU, 8 elsewhere). fixed_shapes: power-of-two row counts (default: on CUDA).
    prefill_tokens: the most tokens of a packed prefill row. pad_to_multiple_of: the cache length and each prefill
    row rounded up (masked), so a run's calls share a few shapes. decode_step(call): the call's step, n -> None
    (default GenerateCall.decode; infra/compiled_step.py's compiles it and replays it as CUDA graphs)."""
    if (reason := unsupported_reason(model)) is not None:
        raise ValueError(f"engine: {reason}")
    stop_ids = eos_ids(model) if stop_ids is None else stop_ids
    keys = [(j,) for j in range(len(prompts))] if keys is None else keys
    if len(keys) != len(prompts) or not all(prompts) or group_size < 1 or max_new_tokens < 1:
        raise ValueError("engine: one key per prompt, non-empty prompts, group_size and max_new_tokens >= 1")
    if not greedy and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0 and (min_p is None or 0 <= min_p <= 1)):
        raise ValueError(f"engine: temperature must be > 0, top_p in (0, 1], top_k >= 0 and min_p in [0, 1], not "
                         f"{temperature}, {top_p}, {top_k}, {min_p}")
    count = len(prompts)
    capacity = count * group_size if max_rows is None else max(group_size, min(max_rows, count * group_size))
    call = GenerateCall(model, prompts, group_size, max_new_tokens, temperature, top_p, stop_ids, keys, capacity,
                        greedy, top_k, min_p, pad_to_multiple_of)
    on_cpu = call.device.type == "cpu"
    check_every = check_every or (1 if on_cpu else 8)
    prefill_tokens = prefill_tokens or (PREFILL_TOKENS if on_cpu else PREFILL_TOKENS_ACCELERATOR)
    fixed_shapes = call.device.type == "cuda" if fixed_shapes is None else fixed_shapes
    decode = call.decode if decode_step is None else decode_step(call)
    responses: list[list[list[int]]] = [[] for _ in range(count)]
    started, reported, n = 0, 0, 0  # prompts prefilled, groups handed over, slots decoded per step
    keep: list[int] = []  # the slots whose rows still run
    while reported < count:
        admitted = range(started, min(count, started + (capacity - len(keep)) // group_size))  # prompts that fit
        if admitted or bucket(len(keep), capacity, fixed_shapes) < n:  # compact
            if keep != list(range(len(keep))):
                call.compact(keep, n)
            keep, n = list(range(len(keep))), bucket(len(keep), capacity, fixed_shapes)
        for pack in packs([len(prompts[j]) for j in admitted], prefill_tokens):  # the room refilled, in packs
            call.prefill([admitted[q] for q in pack], [torch.arange(len(keep) + q * group_size, len(keep) + (q + 1)
                                                                    * group_size, device=call.device) for q in pack])
        started, keep = admitted.stop, keep + list(range(len(keep), len(keep) + len(admitted) * group_size))
        n = max(n, bucket(len(keep), capacity, fixed_shapes))
        for _ in range(check_every if keep else 0):
            decode(n)
        if call.nonfinite.item():  # the host looks: the logits were finite; the groups done; the slots still running
            raise FloatingPointError("engine: the model's logits are not finite (NaN or inf): the weights diverged")
        stop_step, slot_rows = call.stop_step.tolist(), call.slot_rows[:n].tolist()
        last = [max(stop_step[j * group_size:(j + 1) * group_size]) for j in range(count)]  # each group's last stop
        for _, j in sorted((last[j], j) for j in range(count) if not responses[j] and last[j] != RUNNING):
            rows = slice(j * group_size, (j + 1) * group_size)
            responses[j] = [tokens[:length] for tokens, length in zip(call.tokens[rows].tolist(),
                                                                       call.lengths[rows].tolist())]
            reported += 1
            if on_done is not None:
                with torch.inference_mode(False), torch.no_grad():  # the caller's code (rewards): no inference tensors
                    on_done(j, responses[j])
        keep = [slot for slot, row in enumerate(slot_rows) if stop_step[row] == RUNNING]
    return responses
