"""One generate call's rollouts: each prompt prefilled once, a preallocated cache, a fixed-shape decode step, and
random draws decided by the seed alone.

    responses = sample_groups(model, prompts, group_size=G, max_new_tokens=M, temperature=T, top_p=p,
                              stop_ids=eos_ids, keys=[(seed, iteration, j) for j in prompt_indices])

returns responses[j][i], sample i of prompt j, cut after its first stop id (kept), and calls
on_done(j, responses[j]) the moment prompt j's G responses have all stopped: the completion order that
rollout.py's `generate` path streams groups in. Only torch and transformers are imported: copy it alone.

One call, on the Hugging Face model's own layers:
  1. Prefill: each prompt once, unpadded, its keys and values written straight into the cache rows of its
     G samples: the paper's shared-prompt idea on the sampling side (`generate` computes every prompt G
     times, padded to the longest). Short prompts are packed: one forward of shape (1, P_a + P_b + ...)
     with a block-diagonal causal mask and position ids restarting at 0 per prompt, so each prompt sees
     only itself. Each prompt's last logits give its samples' first tokens.
  2. Decode: one forward of shape (n, 1) per step over the first n cache rows. Row r feeds its last token at
     position P_r + t - 1 (explicit position ids), writes that token's keys and values at the cache slot of
     the same number and attends to slots 0 .. P_r + t - 1 (an additive (n, 1, 1, L) mask over the whole
     preallocated cache). Drawing, the stop test and the bookkeeping (tokens, lengths, the step at which
     each row stopped) stay on the device.
  3. Every `check_every` steps (1 on CPU, where reading the device costs nothing; else 8) the host reads
     which rows stopped and at which step. Groups whose G rows have all stopped go to on_done ordered by
     the step their last row stopped, then by prompt: the exact completion order, however late it looks.
  4. Stopped rows are compacted away (the live rows' cache moves to the front, n shrinks), and the room
     this frees is refilled with whole prompts not yet started, up to `max_rows` rows in flight.

The draw, and why chunk sizes never change a token. Row (j, i) at response step t, with logits z ∈ R^V:
    u     = U(key_j, i, t) ∈ [0, 1)   output t of a SplitMix64 stream seeded by a hash of (key_j..., i)
    p     = softmax(z / T)             what the trainer scores: its log-probs are log_softmax(z / T)
    S     = the tokens transformers' warpers keep, in generate's order: the top_k most likely (ties with
            the k-th kept; all when top_k = 0), of those the smallest top set holding top_p of their mass
            (TopPLogitsWarper), of those the ones with p >= min_p · max p (MinPLogitsWarper); never empty
    token = the s ∈ S with F(s⁻) <= u·F(S) < F(s), F the running sum of p over S
            (in vocabulary order when S is all of V, else in descending order: any fixed order draws p|S)
so P(token = s) = p_s / Σ_S p: the scored distribution truncated as asked, and nothing else. u is a
function of (key, sample, step) alone, so which prompts share a call, the batch size, compaction, refill,
workers and ranks never decide a token. (Logits can still differ in their last bits between batch shapes
where a BLAS kernel blocks by size; a token then flips only if u·F(S) falls within that rounding of a
boundary of F.) greedy=True takes argmax z instead; the tests compare it with `generate`.

Stopped rows: compaction, with the freed room refilled by whole new prompts. On CPU a decode step costs
a fixed overhead plus a share per row, so a stopped row left in the batch (refill in place, the fixed
shape a CUDA graph likes) pays for nothing until a new prompt takes its slot, and in the iteration's last
steps none will: with every row in flight at once (max_rows None, the default) there is nothing to refill
with at all. Compaction decodes only live rows; admitting whole prompts into the room it frees keeps the
batch full when max_rows bounds it, where compaction alone would wait for the whole batch (waves).

Departures, on purpose:
1. Another random stream than `generate`'s torch.multinomial: sampled tokens differ from the hf path's
   (greedy ones are equal), and are reproducible from the keys alone.
2. Only temperature, top-k, top-p and min-p shape the distribution (as in rollout.py): no repetition penalty.
3. The inverse CDF runs in two levels (which block of BLOCK tokens, then which token in it): a float32
   running sum over 151,936 tokens would blur the small probabilities (each step of it rounds to ~1e-7 of
   the whole), and a float64 pass over all of them costs as much as the rest of the draw on CPU.
4. On CPU the output layer is applied as W·hᵀ, (V, H)·(H, n): the same product as nn.Linear's h·Wᵀ, which
   MKL runs markedly slower for a few rows on this project's (AMD) CPU. Elsewhere it is h·Wᵀ: the draw's
   passes over (n, V) read it contiguously (the transposed view cost a 0.19 ms strided copy per H100 step).
5. The decode step attends over the whole preallocated cache, masked: its shape never depends on the step.
6. On CUDA the decode step is captured as a CUDA graph per row-count bucket (powers of two up to
   max_rows) and replayed; graphs read the parameters where they are, so weights copied into them in
   place (param.copy_) need no recapture. Captured once per call, not kept across calls;
   cuda_graphs=False turns it off, and a capture that fails falls back to eager steps with a line saying so.
7. Checked models: Qwen2, Qwen3, Llama and Mistral shapes with full causal attention (Mistral: sliding_window
   None, as v0.2 onwards), sdpa or eager attention
   (`unsupported_reason` says why not otherwise).
8. The decode step's attention is `decode_attention`, not the model's own: the query heads of each key
   head folded into one query (Hugging Face's sdpa path copies the cache once per query head when a
   mask is given; docs/benchmarks.md measures the difference). Prefill keeps the model's attention.
9. pad_to_multiple_of rounds the cache length and each packed prefill row up (the padding is masked and
   never cached), so the calls of a run share a few shapes: cuDNN's attention, the first choice of
   torch's SDPA on recent GPUs, builds a graph for every new shape.
10. compile_step (--engine compile) compiles the decoder layers, one compilation shared by all of them
   (compiled_layers), and the decode step's draw (compiled_draw); the cache writes, the mask and the rows'
   bookkeeping stay eager: the whole step compiled as one function recompiled as shapes changed and ran
   slower than eager on an H100, and so did the layers with their cache writes (docs/benchmarks.md). If
   compiling fails (no C++ compiler, no Triton), one line says so and the process decodes eagerly.
11. attention="flex" (not yet a trainer option: the GPU table measures it first) attends with torch's
   flex_attention over the cache blocks each row has written (flex_decode_attention), where decode_attention
   reads the whole preallocated cache of every row; the cache length is then a multiple of FLEX_BLOCK.
12. A model through fuse_projections (--engine compile off CPU: rollout.fuse_sampler) decodes with q|k|v and
   gate|up as one matrix product each, and writes a layer's new keys and values with one kernel (fused_attention,
   fused_mlp: the layer's own attention and MLP forwards otherwise; RowCache.update_both). A BLAS may
   sum a fused product in another order than the separate ones: last-bit differences, so a token can flip at a
   near-tie, as between batch shapes.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import types
from typing import Callable

import torch

CHECKED_TYPES = ("qwen2", "qwen3", "llama", "mistral")
RUNNING = 2**62  # the stop step of a row still decoding
BLOCK = 1024  # tokens per block of the two-level inverse CDF
PREFILL_TOKENS = 512  # most tokens in one packed prefill row on CPU (docs/benchmarks.md: the engine on short prompts)
PREFILL_TOKENS_ACCELERATOR = 8192  # elsewhere: a forward's launches cost more than its T^2 mask (docs/benchmarks.md)


def unsupported_reason(model) -> str | None:
    """Why the engine would not sample exactly what `model` scores (one line), or None when it would."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in CHECKED_TYPES:
        return f"model type {kind!r} is not one the engine is checked on ({', '.join(CHECKED_TYPES)})"
    layer_types = getattr(config, "layer_types", None) or []
    windowed = getattr(config, "use_sliding_window", False) or kind == "mistral" and config.sliding_window is not None
    if windowed or any(layer != "full_attention" for layer in layer_types):  # Mistral: a window unless it is None
        return "sliding-window attention is active (the engine's mask is full causal attention)"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            return f"{name} is set (the engine does not cap logits)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return f"rope scaling {rope.get('rope_type', rope.get('type'))!r} depends on which rows share a step"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} (the engine's 4-D mask needs 'sdpa' or 'eager')"
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return "the output layer is not a bias-free nn.Linear"
    return None


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

    int64 additions and products wrap like uint64 ones (two's complement), so these are the mod-2^64 formulas
    of `mix64` (tests/test_engine.py checks it against them)."""
    z = seeds + (steps + 1) * as_int64(GOLDEN)                   # (n,) the stream's state after step + 1 increments
    z = (z ^ shift_right(z, 30)) * as_int64(MIX1)
    z = (z ^ shift_right(z, 27)) * as_int64(MIX2)
    z = z ^ shift_right(z, 31)
    return shift_right(z, 32).double() * 2.0**-32                # (n,) multiples of 2^-32, at most 1 - 2^-32


# --- one token per row from its logits and its uniform ---
def truncated_order(probs: torch.Tensor, top_k: int, top_p: float, min_p: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities in descending order, zero outside the kept set; their token ids): the set transformers'
    TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper keep, in generate's order: the k most likely (ties
    with the k-th kept), then the smallest top set holding top_p of what is left, then those at least min_p
    times the most likely. The first token always stays."""
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

    Two levels: the block of BLOCK weights holding u·F(V), then the weight inside it; each block summed in
    float32 (vectorised; ~1e-7 of the block's mass, the rounding the probabilities carry anyway), the running
    sums over blocks and inside the chosen block in float64. The chosen weight is positive: u <= 1 - 2^-32
    keeps u·F(V) below F(V), and a rounding that would step past the block's last positive weight is clamped
    to it."""
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
    """Tokens drawn by inverse CDF from softmax(logits / T) truncated by top-k, top-p and min-p; logits (n, V),
    u (n,) -> (n,)."""
    if temperature == 1.0:  # softmax reads bf16 logits and computes in float32 (its cast is exact): one pass
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (n, V)
    else:
        probs = torch.softmax(logits.to(torch.float32, copy=True).div_(temperature), dim=-1)  # (n, V) a copy
    if top_p >= 1.0 and not top_k and min_p is None:
        return inverse_cdf(probs, u)
    probs, order = truncated_order(probs, top_k, top_p, min_p)     # (n, V), (n, V)
    return order.gather(-1, inverse_cdf(probs, u).unsqueeze(-1)).squeeze(-1)


def checked_draw(logits: torch.Tensor, seeds: torch.Tensor, lengths: torch.Tensor, greedy: bool, temperature: float,
                 top_p: float, top_k: int, min_p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's token: argmax if greedy, else draw_tokens with its uniform for step `lengths`; whether every
    logit was finite), logits (n, V), seeds and lengths (n,). One min/max pass checks finiteness: NaN propagates
    into both."""
    low, high = torch.aminmax(logits)
    finite = torch.isfinite(low) & torch.isfinite(high)                                   # () bool
    if greedy:
        return logits.argmax(dim=-1), finite
    return draw_tokens(logits, uniforms(seeds, lengths), temperature, top_p, top_k, min_p), finite


# --- the cache ---
class RowCache:
    """Every row's keys and values, preallocated: (layers, rows, kv_heads, L, head_dim) each, L = P_max + M
    (rounded up to a multiple of pad_to_multiple_of). With `joint` (fused projections) they are views of one tensor
    `both` (layers, rows, 2, kv_heads, L, head_dim), so that a row's new key and value are written by one indexing
    kernel (update_both); else each is contiguous, as attention kernels read best.

    Hugging Face's attention layers call update(key, value, layer) with the new tokens' keys and values and
    attend over what it returns. Set before each forward:
      prefill_slots:      (rows, slots, sources), (N,) each: key (1, kv, T, D) of a packed row of prompts,
                          its position sources[k] written at slot slots[k] of cache row rows[k] (each
                          prompt's tokens into slots 0..P-1 of its G rows), and returned as it is (the
                          packed prompts attend to themselves through the block-diagonal mask);
      positions (n,):     key (n, kv, 1, D), row r's written at slot positions[r]; the first n rows' whole
                          cache is returned (the mask hides the slots not yet written)."""

    def __init__(self, model, rows: int, length: int, joint: bool = False):
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = model.get_output_embeddings().weight
        shape = (config.num_hidden_layers, rows, 2, config.num_key_value_heads, length, head_dim)
        if joint:
            self.both = torch.zeros(shape, dtype=weight.dtype, device=weight.device)  # (layers, rows, 2, kv, L, D)
            self.keys, self.values = self.both[:, :, 0], self.both[:, :, 1]            # (layers, rows, kv, L, D)
        else:
            self.both = None
            self.keys = torch.zeros(shape[:2] + shape[3:], dtype=weight.dtype, device=weight.device)
            self.values = torch.zeros_like(self.keys)                                  # (layers, rows, kv, L, D)
        self.row_index = torch.arange(rows, device=weight.device)
        self.prefill_slots: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    @torch.compiler.disable  # under --engine compile: eager (compiled_layers says why)
    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args, **kwargs):
        if self.positions is None:
            rows, slots, sources = self.prefill_slots  # (N,) each: cache row, its slot, the packed position
            self.keys[layer, rows, :, slots] = key[0, :, sources].transpose(0, 1)  # (N, kv, D) <- (kv, N, D)
            self.values[layer, rows, :, slots] = value[0, :, sources].transpose(0, 1)
            return key, value
        n = self.positions.shape[0]
        keys, values = self.keys[layer, :n], self.values[layer, :n]  # (n, kv, L, D) views
        rows = self.row_index[:n]
        keys[rows, :, self.positions] = key[:, :, 0]  # (n, kv, D) one slot per row
        values[rows, :, self.positions] = value[:, :, 0]
        return keys, values

    @torch.compiler.disable
    def update_both(self, both: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's keys and values stacked, (n, 2, kv, D), written in one kernel (fused_attention stacks them
        inside the compiled layer); the first n rows' keys and values returned, (n, kv, L, D) each."""
        n = self.positions.shape[0]
        self.both[layer, :n][self.row_index[:n], :, :, self.positions] = both  # (n, 2, kv, D) one slot per row
        return self.keys[layer, :n], self.values[layer, :n]

    def get_seq_length(self, layer: int = 0) -> int:
        """transformers < 5 asks this to number the new tokens when no positions are given; ours are given."""
        return 0

    def compact(self, keep: torch.Tensor) -> None:
        """Move rows `keep` (m,) to the front, in order."""
        if self.both is not None:
            self.both[:, :len(keep)] = self.both[:, keep]
        else:
            self.keys[:, :len(keep)] = self.keys[:, keep]
            self.values[:, :len(keep)] = self.values[:, keep]


def cache_argument(module) -> str:
    """The keyword a Hugging Face model takes its cache by: 'cache' (transformers >= 5.x) or 'past_key_values'."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


# --- the decode step's attention: query heads folded onto their key head, the cache read once ---
DECODE_ATTENTION = "periodic_rl_decode"


def decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """One new token per row against its whole cache, for Hugging Face's attention layers (AttentionInterface):
    query (n, H, 1, D), key and value (n, K, L, D), mask (n, 1, 1, L) -> (n, 1, H, D).

    Query head h reads key head h // (H/K) (what repeat_kv builds), so the H/K query heads of a key head are
    folded into a query of H/K positions: softmax(q·kᵀ·scale + mask)·v over (n, K, H/K, D) x (n, K, L, D),
    with no copy of the cache per query head (Hugging Face's sdpa path repeats it whenever a mask is given:
    H/K copies of every layer's keys and values per step)."""
    n, heads, _, dim = query.shape
    groups = key.shape[1]
    folded = query.reshape(n, groups, heads // groups, dim)                                     # (n, K, H/K, D)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask,
                                                           scale=scaling)                       # (n, K, H/K, D)
    return out.reshape(n, 1, heads, dim), None                                                  # (n, 1, H, D)


FLEX_DECODE_ATTENTION = "periodic_rl_flex_decode"
FLEX_BLOCK = 128  # cache slots per block of flex_decode_attention's block mask
_COMPILED_FLEX: list[Callable] = []  # torch.compile of flex_attention, for the process
FLEX_FAILED: str | None = None  # why compiling flex_attention failed in this process, once it has
FLEX_EAGER_DEVICES = ("cpu",)  # device types where flex_decode_attention runs eagerly outside compiled layers


def flex_decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """decode_attention that reads only the cache blocks a row has written: query (n, H, 1, D), key and value
    (n, K, L, D), attention_mask a BlockMask (Rollouts.block_mask) listing row r's blocks 0 .. ⌊p_r / FLEX_BLOCK⌋
    and masking slots > p_r inside the last -> (n, 1, H, D); grouped query heads read their key head in place
    (enable_gqa). `decode_attention` reads all L slots of every row whatever its length: at 128 rows of prompts
    96-445 tokens, 53% of what it reads is written (docs/benchmarks.md).

    torch's flex_attention is compiled off CPU (its eager form is a slow reference): inside compiled layers
    (--engine compile) with them, else through its own torch.compile. On CPU it runs eagerly unless the layers
    are compiled (torch 2.13's Inductor failed to build its CPU kernel for some shapes). If compiling it fails,
    one line says so and the process attends with the eager form (FLEX_FAILED): the same output, slower."""
    global FLEX_FAILED
    from torch.nn.attention.flex_attention import flex_attention
    args = dict(block_mask=attention_mask, scale=scaling, enable_gqa=True)
    if query.device.type not in FLEX_EAGER_DEVICES and FLEX_FAILED is None and not torch.compiler.is_compiling():
        if not _COMPILED_FLEX:
            _COMPILED_FLEX.append(torch.compile(flex_attention))
        try:
            return _COMPILED_FLEX[0](query, key, value, **args).transpose(1, 2), None                  # (n, 1, H, D)
        except compile_errors() as error:
            FLEX_FAILED = failure_line(error)
            print(f"engine: compiling flex attention failed, attending with its eager form: {FLEX_FAILED}",
                  file=sys.stderr, flush=True)
    return flex_attention(query, key, value, **args).transpose(1, 2), None                          # (n, 1, H, D)


def register_decode_attention() -> None:
    """Make `decode_attention` and `flex_decode_attention` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionInterface.register(FLEX_DECODE_ATTENTION, flex_decode_attention)


# --- q|k|v and gate|up as one matrix product each (fuse_projections) ---
FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv"), ("mlp", ("gate_proj", "up_proj"), "gate_up"))


def fuse_projections(model) -> str | None:
    """Seat each decoder layer's q, k, v weights (and biases) as row blocks of one buffer, (H·D + 2·K·D, hidden),
    and gate, up as blocks of another, (2·I, hidden), so that the engine's decode steps compute
        [q | k | v] = x·[W_q; W_k; W_v]ᵀ + [b_q; b_k; b_v]        [gate | up] = x·[W_gate; W_up]ᵀ
    as 2 matrix products where the layer's own forward runs 5 (4 products a layer instead of 7; on an H100,
    24.8 against 34.5 us a layer at 128 rows, docs/benchmarks.md); a step's new keys and values, stacked inside
    the layer, go into the cache in one kernel (RowCache.update_both). The parameters become views of the buffers,
    their values unchanged, so copying into them in place (WeightBuffer.load_into's param.copy_, a sampler's publish)
    writes the buffers: no second copy of the weights, nothing to refresh. For a model that is only sampled
    from (the inference side's own copy): safetensors refuses tensors that share memory, and moving the model
    afterwards (.to) parts the buffers from the parameters, which sample_groups then refuses.

    Returns None, or why not (one line) with the model left alone: a projection that is not a plain nn.Linear
    (LoRA's wrappers, quantised layers), biases on some projections of a group and not others."""
    layers = list(model.get_decoder().layers)
    for layer in layers:
        for owner, names, _ in FUSED:
            linears = [getattr(getattr(layer, owner, None), name, None) for name in names]
            if any(type(linear) is not torch.nn.Linear for linear in linears):
                return f"{owner}.{'/'.join(names)} are not all plain nn.Linear"
            if len({linear.bias is None for linear in linears}) > 1:
                return f"{owner}.{'/'.join(names)}: biases on some and not others"
    with torch.no_grad():
        for layer in layers:
            for owner, names, fused in FUSED:
                module = getattr(layer, owner)
                linears = [getattr(module, name) for name in names]
                weight = torch.cat([linear.weight for linear in linears])                      # (Σ out, in)
                bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])  # (Σ out,)
                module.register_buffer(f"{fused}_weight", weight, persistent=False)
                module.register_buffer(f"{fused}_bias", bias, persistent=False)
                module.fused_sizes = tuple(linear.out_features for linear in linears)
                start = 0
                for linear in linears:
                    rows = slice(start, start + linear.out_features)
                    linear.weight = torch.nn.Parameter(weight[rows], requires_grad=linear.weight.requires_grad)
                    if bias is not None:
                        linear.bias = torch.nn.Parameter(bias[rows], requires_grad=linear.bias.requires_grad)
                    start += linear.out_features
            attention = layer.self_attn  # the model file's own rotary function (one per model type)
            attention.fused_rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    return None


def projections_fused(decoder) -> bool:
    """Whether fuse_projections seated this decoder's projections, and they still are its parameters' memory."""
    layers = list(decoder.layers)
    if not hasattr(layers[0].self_attn, "qkv_weight"):
        return False
    for layer in layers:
        for owner, names, fused in FUSED:
            module = getattr(layer, owner)
            weight, start = getattr(module, f"{fused}_weight"), 0
            for name in names:
                linear = getattr(module, name)
                if linear.weight.data_ptr() != weight[start:].data_ptr():
                    raise ValueError("engine: the fused projections no longer share memory with the parameters (the "
                                     "model was moved, or its parameters replaced, after fuse_projections)")
                start += linear.out_features
    return True


def fused_attention(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, *args, **kwargs
                    ) -> tuple[torch.Tensor, None]:
    """The forward of Qwen2's, Qwen3's, Llama's and Mistral's attention with q, k, v from one product
    (fuse_projections), in a decode step: hidden (n, 1, hidden) -> (n, 1, hidden)."""
    n, t, _ = hidden_states.shape
    qkv = torch.nn.functional.linear(hidden_states, self.qkv_weight, self.qkv_bias)       # (n, t, (H + 2K)·D)
    q, k, v = (x.view(n, t, -1, self.head_dim) for x in qkv.split(self.fused_sizes, dim=-1))  # (n, t, heads, D)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm of each head's q and k before rotating them
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)                   # (n, H, t, D), (n, K, t, D)
    cos, sin = position_embeddings
    q, k = self.fused_rotary(q, k, cos, sin)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    k, v = cache.update_both(torch.stack([k[:, :, 0], v[:, :, 0]], dim=1), self.layer_idx)  # (n, K, L, D) each
    attend = flex_decode_attention if self.config._attn_implementation == FLEX_DECODE_ATTENTION else decode_attention
    out, _ = attend(self, q, k, v, attention_mask, scaling=self.scaling)                  # (n, t, H, D)
    return self.o_proj(out.reshape(n, t, -1)), None                                       # (n, t, hidden)


def fused_mlp(self, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP, down(act(gate(x)) · up(x)), with gate and up from one product (fuse_projections)."""
    gate, up = torch.nn.functional.linear(x, self.gate_up_weight, self.gate_up_bias).split(self.fused_sizes, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)                                         # (n, t, hidden)


@contextlib.contextmanager
def fused_forwards(decoder):
    """Inside, each layer's attention and MLP run fused_attention and fused_mlp; their own forwards again after."""
    modules = [(layer.self_attn, fused_attention) for layer in decoder.layers] + [
        (layer.mlp, fused_mlp) for layer in decoder.layers]
    own = [vars(module).get("forward") for module, _ in modules]  # a forward set on the module itself, kept
    for module, forward in modules:
        module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        for (module, _), forward in zip(modules, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


# --- one call's rows: prefill, decode, compaction, on the device ---
class Rollouts:
    """The state of one call on the device. Rows are numbered j·G + i (sample i of prompt j); row C·G is a
    stand-in that is always stopped, for slots with no row (fixed shapes). Slots are cache rows: slot k holds
    row slot_rows[k], and only the first n slots are decoded."""

    def __init__(self, model, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float,
                 top_p: float, stop_ids: list[int], keys: list[tuple[int, ...]], slots: int, greedy: bool,
                 top_k: int = 0, min_p: float | None = None, pad_to_multiple_of: int = 1, compile_layers: bool = False,
                 attention: str = "sdpa"):
        register_decode_attention()  # the decode step's attention, known to transformers by name
        weight = model.get_output_embeddings().weight
        decoder = model.get_decoder()  # the layers below the head (`base_model` would be peft's LoraModel, --use-peft)
        self.decoder, self.head, self.cache_argument = decoder, weight, cache_argument(decoder)
        self.device, self.dtype = weight.device, weight.dtype
        self.prompts, self.group_size, self.max_new_tokens = prompts, group_size, max_new_tokens
        self.temperature, self.top_p, self.top_k, self.min_p, self.greedy = temperature, top_p, top_k, min_p, greedy
        self.pad_to_multiple_of = pad_to_multiple_of  # the cache length and each prefill row, rounded up (departure 9)
        self.compile_layers = compile_layers  # decode steps through compiled_layers (--engine compile)
        self.flex = attention == "flex"  # the decode step's attention: flex_decode_attention, else decode_attention
        longest = max(len(prompt) for prompt in prompts) + max_new_tokens  # a stopped row writes one slot more
        self.length = round_up(longest, pad_to_multiple_of)
        self.length = round_up(self.length, FLEX_BLOCK) if self.flex else self.length  # flex: whole blocks
        self.fused = projections_fused(decoder)  # decode steps through fused_forwards (fuse_projections was run)
        self.cache = RowCache(model, slots, self.length, joint=self.fused)
        rows = len(prompts) * group_size
        self.stand_in = rows

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=self.device)
        self.seeds = tensor([row_seed(keys[j], i) for j in range(len(prompts)) for i in range(group_size)] + [0])
        # the stand-in's one token sits at the cache's last slot, which no running row reads
        self.prompt_lengths = tensor([len(prompt) for prompt in prompts for _ in range(group_size)] + [self.length])
        self.tokens = torch.zeros(rows + 1, max_new_tokens, dtype=torch.long, device=self.device)  # (C·G + 1, M)
        self.lengths = torch.zeros(rows + 1, dtype=torch.long, device=self.device)  # tokens drawn so far
        self.stop_step = torch.full((rows + 1,), RUNNING, dtype=torch.long, device=self.device)
        self.stop_step[self.stand_in] = -1
        self.slot_rows = torch.full((slots,), self.stand_in, dtype=torch.long, device=self.device)
        self.last_token = torch.zeros(slots, dtype=torch.long, device=self.device)  # each slot's next input
        self.stop_ids = tensor(stop_ids)
        self.step = torch.zeros((), dtype=torch.long, device=self.device)  # decode steps so far (0-dim: graph-safe)
        self.cache_slots = torch.arange(self.length, device=self.device)
        self.min = torch.finfo(self.dtype).min
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)  # any logit NaN or inf so far
        self.last_slot = torch.zeros(slots, dtype=torch.long, device=self.device)  # flex: each slot's last cache slot
        self.block_masks: dict = {}  # flex: n -> its BlockMask (torch.nn.attention.flex_attention), updated in place

    def block_mask(self, n: int, positions: torch.Tensor):
        """flex: the BlockMask of the first n slots, row r attending to cache slots 0 .. positions[r]: blocks
        0 .. ⌊p_r / FLEX_BLOCK⌋, the last one masked past p_r. Built once per n; each step writes the row's
        block count and last slot into its tensors in place (no new object, no host sync: CUDA graphs and
        torch.compile's guards see the same mask)."""
        from torch.nn.attention.flex_attention import BlockMask
        self.last_slot[:n] = positions
        if n not in self.block_masks:
            last = self.last_slot

            def seen(b, h, q_idx, kv_idx):
                return kv_idx <= last[b]
            blocks = self.length // FLEX_BLOCK
            counts = torch.zeros(n, 1, 1, dtype=torch.int32, device=self.device)                      # (n, 1, 1)
            order = torch.arange(blocks, dtype=torch.int32, device=self.device).expand(n, 1, 1, blocks)  # (n, 1, 1, B)
            forward_only = ({"compute_q_blocks": False}  # the backward's q-side blocks: not needed, not kept current
                            if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {})
            self.block_masks[n] = BlockMask.from_kv_blocks(counts, order.contiguous(), BLOCK_SIZE=FLEX_BLOCK,
                                                           mask_mod=seen, seq_lengths=(1, self.length), **forward_only)
        mask = self.block_masks[n]
        mask.kv_num_blocks.copy_((positions // FLEX_BLOCK + 1).view(n, 1, 1))
        return mask

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               packed_ends: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each row's last position, (rows, V), of one forward of the model's layers on our cache and
        mask; a packed prefill row (1, T) gives those of the positions `packed_ends` (k,) instead, (k, V)."""
        config, decoding = self.decoder.config, packed_ends is None
        implementation = config._attn_implementation
        if decoding:  # the decode step's attention reads the cache once (decode_attention); prefill as the model does
            config._attn_implementation = FLEX_DECODE_ATTENTION if self.flex else DECODE_ATTENTION
        inputs = dict(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                      **{self.cache_argument: self.cache})
        try:
            with fused_forwards(self.decoder) if decoding and self.fused else contextlib.nullcontext():
                hidden = self.layers(inputs, compiled=decoding and self.compile_layers)  # (rows, T, H)
        finally:
            config._attn_implementation = implementation
        hidden = hidden[:, -1] if packed_ends is None else hidden[0, packed_ends]  # (rows, H) or (k, H)
        if self.device.type == "cpu":
            return torch.mm(self.head, hidden.t()).t()  # (rows, V) = ((V, H)·(H, rows))ᵀ, departure 4
        return torch.mm(hidden, self.head.t())  # (rows, V) rows first: the draw reads it contiguously (departure 4)

    def layers(self, inputs: dict, compiled: bool) -> torch.Tensor:
        """The decoder's last hidden states, through compiled_layers if `compiled` (and compiling has not failed
        in this process: compile_failed). Running a failed step again eagerly is exact: the cache writes it
        repeats put the same keys at the same slots."""
        if compiled and COMPILE_FAILED is None:
            try:
                with compiled_layers(self.decoder):
                    return self.decoder(**inputs).last_hidden_state
            except compile_errors() as error:
                compile_failed(error)
        return self.decoder(**inputs).last_hidden_state

    def draw(self, logits: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, compiled: bool = False
             ) -> torch.Tensor:
        """Each row's next token (checked_draw), through torch.compile if `compiled`: Inductor fuses the draw's
        passes over the (n, V) logits, ~0.4 ms of an H100 step eagerly at 128 rows (docs/benchmarks.md)."""
        args = (logits, self.seeds[rows], lengths, self.greedy, self.temperature, self.top_p, self.top_k, self.min_p)
        drawn = None
        if compiled and COMPILE_FAILED is None:
            try:
                with compile_settings():
                    drawn = compiled_draw()(*args)
            except compile_errors() as error:
                compile_failed(error)
        new, finite = drawn or checked_draw(*args)
        self.nonfinite.logical_or_(~finite)  # read by the host when it looks (no sync here)
        return new

    def record(self, rows: torch.Tensor, lengths: torch.Tensor, running: torch.Tensor, new: torch.Tensor) -> None:
        """Token `lengths[r]` of each running row is `new[r]`; a row stops at a stop id or at max_new_tokens."""
        column = lengths.clamp(max=self.max_new_tokens - 1)                            # (n,)
        self.tokens[rows, column] = torch.where(running, new, self.tokens[rows, column])
        stops = running & ((new.unsqueeze(-1) == self.stop_ids).any(-1) | (lengths + 1 == self.max_new_tokens))
        self.stop_step[rows] = torch.where(stops, self.step, self.stop_step[rows])
        self.lengths[rows] = lengths + running.long()

    def prefill(self, prompts: list[int], slots: list[torch.Tensor]) -> None:
        """Prompts `prompts`, packed in one row, each into the cache of its G rows at slots[q] (G,); their rows'
        first tokens. Prompt q sits at positions o_q .. o_q + P_q - 1 of the row, numbered 0 .. P_q - 1 (its
        own position ids), and attends causally to itself alone (a block-diagonal mask): what it would compute
        alone, in one forward for them all. The row is padded to a multiple of pad_to_multiple_of with tokens
        that see only one another and are never written to the cache."""
        lengths = [len(self.prompts[q]) for q in prompts]
        tokens = [token for q in prompts for token in self.prompts[q]]
        positions = torch.cat([self.cache_slots[:length] for length in lengths])                       # (T,)
        group = self.group_size
        sources = torch.arange(len(tokens), device=self.device)                                        # (T,)
        self.cache.prefill_slots = (torch.cat([slots[q].repeat(length) for q, length in enumerate(lengths)]),
                                    positions.repeat_interleave(group), sources.repeat_interleave(group))
        self.cache.positions = None
        padding = round_up(len(tokens), self.pad_to_multiple_of) - len(tokens)
        ids = torch.tensor([tokens + [0] * padding], device=self.device)                               # (1, T')
        positions = torch.cat([positions, positions.new_zeros(padding)])                               # (T',)
        owner = torch.repeat_interleave(torch.arange(len(prompts), device=self.device),
                                        torch.tensor(lengths, device=self.device))                     # (T,)
        owner = torch.cat([owner, owner.new_full((padding,), -1)])                                     # (T',)
        visible = (owner[:, None] == owner[None, :]) & (positions[:, None] >= positions[None, :])      # (T', T')
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, self.min)
        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1                                 # (k,)
        logits = self.logits(ids, positions[None], mask[None, None], ends)                             # (k, V)
        rows = torch.cat([q * group + torch.arange(group, device=self.device) for q in prompts])      # (k·G,)
        first = torch.zeros_like(rows)
        new = self.draw(logits.repeat_interleave(group, dim=0), rows, first)                          # (k·G,)
        self.record(rows, first, torch.ones_like(rows, dtype=torch.bool), new)
        every_slot = torch.cat(slots)
        self.slot_rows[every_slot], self.last_token[every_slot] = rows, new

    def decode(self, n: int) -> None:
        """One step of the first n slots: every running row draws one token (fixed shapes, no host sync)."""
        self.step += 1  # before recording: a prompt prefilled at step s and stopped at once ranks before step s + 1
        rows = self.slot_rows[:n]                                                          # (n,)
        lengths = self.lengths[rows]                                                       # (n,)
        running = self.stop_step[rows] == RUNNING                                          # (n,)
        positions = self.prompt_lengths[rows] + lengths - 1                                # (n,) last token's slot
        if self.flex:
            mask = self.block_mask(n, positions)                                           # BlockMask (n, 1, 1, L)
        else:
            unseen = self.cache_slots > positions.unsqueeze(-1)                            # (n, L)
            mask = torch.zeros(unseen.shape, dtype=self.dtype, device=self.device).masked_fill_(unseen, self.min)
            mask = mask[:, None, None, :]                                                  # (n, 1, 1, L)
        self.cache.positions = positions
        logits = self.logits(self.last_token[:n, None], positions[:, None], mask)         # (n, V)
        new = self.draw(logits, rows, lengths, compiled=self.compile_layers)                 # (n,)
        self.record(rows, lengths, running, new)
        self.last_token[:n] = new

    def compact(self, keep: list[int], n: int) -> None:
        """Slots `keep` (their rows still run) to the front, in order; slots len(keep)..n-1 get the stand-in."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.compact(index)
        self.slot_rows[:len(keep)], self.last_token[:len(keep)] = self.slot_rows[index], self.last_token[index]
        self.slot_rows[len(keep):n] = self.stand_in


class DecodeGraphs:
    """CUDA graphs of `Rollouts.decode`, one per row count, captured the first time it is needed.

    Warm-up and capture run with every slot pointing at the stand-in row (always stopped: nothing is
    recorded, its key/value go to the cache's last slot, which no running row reads), and the slots, last
    tokens and step counter are put back afterwards, also when capture fails: capturing never moves a real
    row. A capture that fails (a model whose forward synchronises with the host, say) is said in one line on
    stderr and the call decodes eagerly from there: the same steps, only slower."""

    def __init__(self, rollouts: Rollouts):
        self.rollouts, self.step, self.graphs, self.eager = rollouts, rollouts.decode, {}, False

    def decode(self, n: int) -> None:
        if not self.eager and n not in self.graphs:
            try:
                self.graphs[n] = self.capture(n)
            except RuntimeError as error:
                self.eager = True
                print(f"engine: CUDA graph capture failed, decoding without graphs: {str(error).splitlines()[0]}",
                      file=sys.stderr, flush=True)
        if self.eager:
            self.step(n)
        else:
            self.graphs[n].replay()

    def capture(self, n: int) -> torch.cuda.CUDAGraph:
        rollouts = self.rollouts
        saved = rollouts.slot_rows[:n].clone(), rollouts.last_token[:n].clone(), rollouts.step.clone()
        rollouts.slot_rows[:n] = rollouts.stand_in
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture (lazy initialisations, cuBLAS workspaces)
                for _ in range(2):
                    self.step(n)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step(n)
        finally:
            rollouts.slot_rows[:n].copy_(saved[0])  # in place: the graph reads these addresses
            rollouts.last_token[:n].copy_(saved[1])
            rollouts.step.copy_(saved[2])
        return graph


# --- --engine compile: the decoder layers through torch.compile, one compilation for all of them ---
_COMPILED_FORWARD: dict[type, Callable] = {}  # a layer class -> torch.compile of its forward, for the process
_COMPILED_DRAW: list[Callable] = []  # torch.compile of checked_draw, for the process
COMPILE_FAILED: str | None = None  # why torch.compile failed in this process (compile_failed), once it has
RECOMPILE_LIMIT = 32  # compilations of one compiled function before compile_failed (compile_settings)


def failure_line(error: Exception) -> str:
    """What a torch.compile failure was, in one line: the backend's own error, not Dynamo's wrapper."""
    cause = getattr(error, "inner_exception", None) or error.__cause__ or error
    return f"{type(cause).__name__}: {(str(cause).strip() or '?').splitlines()[0]}"[:300]


def compile_failed(error: Exception) -> None:
    """torch.compile failed (no C++ compiler for Inductor on CPU, no Triton on a GPU, an unsupported operation):
    one line on stderr, and the process decodes without it from then on (the same steps, only slower)."""
    global COMPILE_FAILED
    COMPILE_FAILED = failure_line(error)
    print(f"engine: torch.compile failed, decoding without it: {COMPILE_FAILED}", file=sys.stderr, flush=True)


def compile_errors() -> tuple[type, ...]:
    """What torch.compile raises when it cannot compile a step (or compile it once more: compile_settings)."""
    from torch._dynamo import exc
    return exc.TorchDynamoException, exc.FailOnRecompileLimitHit


def compile_settings():
    """Dynamo's settings for the engine's compiled code: the layer index update is given stays an input, not a
    constant (allow_unspec_int_on_nn_module: one compilation for all layers), up to RECOMPILE_LIMIT compilations
    of each function (row counts, cache lengths, thread counts on CPU, sampling settings each may add one), and
    past it an exception (compile_failed says so in one line), where Dynamo would quietly run that code eagerly
    from then on."""
    return torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=RECOMPILE_LIMIT,
                                      fail_on_recompile_limit_hit=True)


def compiled_draw() -> Callable:
    """torch.compile of checked_draw, made once per process: its passes over the logits fused (--engine compile)."""
    if not _COMPILED_DRAW:
        _COMPILED_DRAW.append(torch.compile(checked_draw))
    return _COMPILED_DRAW[0]


@contextlib.contextmanager
def compiled_layers(decoder):
    """Inside, every layer of `decoder` runs through one torch.compile of its class's forward (regional
    compilation): the layers share that code and differ only in their parameters, which the compiled code
    takes as inputs, so a 24-layer model compiles about what one layer needs, once per process. Inductor
    fuses each layer's elementwise chains (RMSNorm, rotary, SiLU·up, residual adds) around the matrix
    products. RowCache.update runs outside it (torch.compiler.disable): compiled on an H100, its writes into a
    view of the cache made Inductor copy the layer's whole cache slice back, +0.8 ms per step
    (docs/benchmarks.md). The layer index update is given is an input of the compiled code, not a constant
    (allow_unspec_int_on_nn_module), so the compilations do not grow with the depth. The model is left
    as it was on the way out: its layers' own forward again."""
    layers = list(decoder.layers)
    kind = type(layers[0])
    if kind not in _COMPILED_FORWARD:
        _COMPILED_FORWARD[kind] = torch.compile(kind.forward)
    compiled = _COMPILED_FORWARD[kind]
    own = [vars(layer).get("forward") for layer in layers]  # a forward set on the layer itself (a hook), kept
    for layer in layers:
        layer.forward = types.MethodType(compiled, layer)
    try:
        with compile_settings():
            yield
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def round_up(length: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `length`."""
    return -(-length // multiple) * multiple


def packs(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive prompts grouped into prefill rows of at most `budget` tokens (a longer prompt alone).

    >>> packs([8, 8, 8, 300, 8], 256)
    [[0, 1, 2], [3], [4]]
    """
    grouped: list[list[int]] = []
    total = budget + 1
    for index, length in enumerate(lengths):
        if total + length > budget:
            grouped.append([])
            total = 0
        grouped[-1].append(index)
        total += length
    return grouped


def bucket(rows: int, capacity: int, fixed_shapes: bool) -> int:
    """The row count a step runs at: `rows` itself, or with fixed shapes the next power of two (at most capacity).

    >>> bucket(5, 24, True), bucket(17, 24, True), bucket(5, 24, False)
    (8, 24, 5)
    """
    if not fixed_shapes or rows == 0:
        return rows
    return min(capacity, 1 << (rows - 1).bit_length())


@torch.no_grad()
def sample_groups(model, prompts: list[list[int]], group_size: int, *, max_new_tokens: int, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, min_p: float | None = None, stop_ids: list[int],
                  keys: list[tuple[int, ...]],
                  on_done: Callable[[int, list[list[int]]], None] | None = None, max_rows: int | None = None,
                  greedy: bool = False, check_every: int | None = None, fixed_shapes: bool | None = None,
                  cuda_graphs: bool = True, prefill_tokens: int | None = None, compile_step: bool = False,
                  pad_to_multiple_of: int = 1, attention: str = "sdpa") -> list[list[list[int]]]:
    """group_size responses to each prompt: responses[j][i], cut after its first stop id (kept).

    keys[j]: prompt j's key, e.g. (seed, iteration, prompt index): with the sample index and the step it
    alone decides the row's random draws (module docstring). on_done(j, responses[j]) runs the moment
    prompt j's responses have all stopped, in completion order. max_rows bounds the rows decoded at once
    (at least group_size; None: all); prompts start in index order as room frees. greedy: argmax instead
    of sampling. check_every: decode steps between the host's looks (default 1 on CPU, 8 elsewhere).
    fixed_shapes: run steps at power-of-two row counts (default: on CUDA), captured as CUDA graphs there
    unless cuda_graphs=False. prefill_tokens: prompts admitted together are prefilled packed in rows of at
    most this many tokens (one forward each instead of one per prompt; a pack's attention costs its length
    squared, so long prompts gain nothing from packing and go alone; default 512 on CPU, 8192 elsewhere).
    compile_step: the decode step's layers through torch.compile (compiled_layers: Inductor fuses their
    elementwise chains), then captured as before; the first steps of a process pay one layer's compilation (if it
    fails: one line on stderr, and eager layers for the rest of the process).
    pad_to_multiple_of: the cache length and every prefill row rounded up to a multiple of this (departure 9).
    attention: the decode step's attention, "sdpa" (decode_attention: every row reads the whole cache) or "flex"
    (flex_decode_attention: each row reads the blocks it has written; compiled; measured by bench.py gpu).
    A model through fuse_projections decodes with its fused products (departure 12).
    """
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"engine: {reason}")
    if len(keys) != len(prompts) or not all(prompts) or group_size < 1 or max_new_tokens < 1:
        raise ValueError("engine: one key per prompt, non-empty prompts, group_size and max_new_tokens >= 1")
    if attention not in ("sdpa", "flex"):
        raise ValueError(f"engine: attention must be 'sdpa' or 'flex', not {attention!r}")
    if not greedy and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0 and (min_p is None or 0 <= min_p <= 1)):
        raise ValueError(f"engine: temperature must be > 0, top_p in (0, 1], top_k >= 0 and min_p in [0, 1], not "
                         f"{temperature}, {top_p}, {top_k}, {min_p}")
    count = len(prompts)
    capacity = count * group_size if max_rows is None else max(group_size, min(max_rows, count * group_size))
    rollouts = Rollouts(model, prompts, group_size, max_new_tokens, temperature, top_p, stop_ids, keys, capacity,
                        greedy, top_k, min_p, pad_to_multiple_of, compile_step, attention)
    on_cuda = rollouts.device.type == "cuda"
    check_every = check_every or (8 if rollouts.device.type != "cpu" else 1)
    prefill_tokens = prefill_tokens or (PREFILL_TOKENS if rollouts.device.type == "cpu" else PREFILL_TOKENS_ACCELERATOR)
    fixed_shapes = on_cuda if fixed_shapes is None else fixed_shapes
    decode = DecodeGraphs(rollouts).decode if on_cuda and fixed_shapes and cuda_graphs else rollouts.decode
    responses: list[list[list[int]]] = [[] for _ in range(count)]
    started, reported, n = 0, 0, 0  # prompts prefilled, groups handed over, slots decoded per step
    keep: list[int] = []  # the slots whose rows still run
    while reported < count:
        refill = started < count and len(keep) + group_size <= capacity
        if refill or bucket(len(keep), capacity, fixed_shapes) < n:  # compact
            if keep != list(range(len(keep))):
                rollouts.compact(keep, n)
            keep, n = list(range(len(keep))), bucket(len(keep), capacity, fixed_shapes)
        admitted: list[tuple[int, torch.Tensor]] = []  # refill the room with whole prompts, prefilled in packs
        while started < count and len(keep) + group_size <= capacity:
            admitted.append((started, torch.arange(len(keep), len(keep) + group_size, device=rollouts.device)))
            started, keep = started + 1, keep + list(range(len(keep), len(keep) + group_size))
        for pack in packs([len(prompts[j]) for j, _ in admitted], prefill_tokens):
            rollouts.prefill([admitted[q][0] for q in pack], [admitted[q][1] for q in pack])
        n = max(n, bucket(len(keep), capacity, fixed_shapes))
        for _ in range(check_every if keep else 0):
            decode(n)
        # the host looks: the logits were finite; the groups now done, in completion order; the slots still running
        if rollouts.nonfinite.item():
            raise FloatingPointError("engine: the model's logits are not finite (NaN or inf): its weights have "
                                     "diverged")
        stop_step = rollouts.stop_step[:count * group_size].view(count, group_size).tolist()
        done = sorted((max(steps), j) for j, steps in enumerate(stop_step)
                      if not responses[j] and max(steps) != RUNNING)
        if done:
            lengths, tokens = rollouts.lengths.tolist(), rollouts.tokens.tolist()
            for _, j in done:
                responses[j] = [tokens[row][:lengths[row]] for row in range(j * group_size, (j + 1) * group_size)]
                if on_done is not None:
                    on_done(j, responses[j])
            reported += len(done)
        running = (rollouts.stop_step[rollouts.slot_rows[:n]] == RUNNING).tolist()
        keep = [slot for slot, runs in enumerate(running) if runs]
    return responses
