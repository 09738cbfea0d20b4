"""Packing made fast, and chosen per group: the structured kernel, the cost model, `batch_logprobs`.

attention.py holds the idea: the packed row [p | r_1 | ... | r_G], its shared-prompt mask and
positions, and log-probs through the model under the dense (B, 1, L, L) mask. This file adds:

- `shared_prompt_attention`, a structured kernel for sdpa models on CPU that computes only the blocks
  the mask allows and never builds it. Per row: the prompt through causal SDPA, then all G
  responses at once, each against [prompt | own response] with a causal (R, R) block,

      out_prompt = SDPA_causal(q_p, k_p, v_p)                              (P, D) per head
      out_i = softmax(scale · [q_i k_p^T | causal(q_i k_i^T)]) [v_p; v_i]   (R_i, D), i = 1..G

  It is registered with `transformers.AttentionInterface` and switched in for the forward only
  (`model.set_attn_implementation`). The layout travels as `shared_prompt_rows`, a model-call
  keyword that transformers forwards to the attention function (checked on 5.23), and
  `attention_mask=None`, which a kernel unknown to transformers' mask registry receives as is.
- `packing_cost_ratio` / `packing_pays`: a cost model in tokens plus attention score pairs that
  predicts where one packed row beats G plain rows (long prompts, short responses).
- `batch_logprobs`, what the trainer calls: mode "packed", "unpacked", or "auto" (per group,
  `packing_pays`); sdpa models on CPU pack through the kernel (in "auto" where it is predicted cheaper,
  `structured_pays`), eager ones, activation checkpointing and any model off CPU through attention.py's
  dense mask (`structured_kernel`).

Deliberate choices and departures:
1. The structured kernel replaces the model's own only during the forward; backward reuses the
   saved graph. Activation checkpointing re-runs attention in backward, after the switch is undone,
   so it gets the dense mask instead. It saves less than its pair count suggests (CPU kernels skip
   little of a causal block; docs/benchmarks.md). Responses are padded to the longest in the row; their (R, R)
   blocks are computed whole.
2. The kernel's softmax is float32 whatever the compute dtype, as SDPA's; it gives padding zeros
   (attention.py departure 2 covers padding under the dense mask).
3. Attention variants the packed layout cannot express exactly (sliding windows as in Mistral or
   Qwen2 with use_sliding_window, logit soft-capping as in Gemma 2, attention sinks as in gpt-oss)
   are refused for packing (`packing_unsupported`): "auto" keeps such models on plain rows, and the
   structured kernel raises if it ever receives one.
4. The cost model's one constant (`ATTENTION_BREAK_EVEN_LEN`) is fitted, not derived, on a small
   model on one CPU core; `python bench.py shared-prompt` prints the fit for the machine it runs on.
5. The structured kernel runs on CPU only. On an accelerator packed rows take the dense mask through
   the model's own SDPA: its fused kernel visits all L^2 pairs, but the structured kernel's Python
   loop over rows (~25 small ops per row and layer, forward and backward) costs more in launches than
   the pairs it skips (measured on one H100: docs/benchmarks.md). `packing_cost_ratio(..., dense=True)`
   prices the dense mask.
   On CPU "auto" prices both and takes the cheaper (`structured_pays`): short rows take the dense mask.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Sequence

import torch
from torch import Tensor

from attention import Group, Layout, layout_logprobs, pack, packed_batch_logprobs, text_config, unpacked_batch_logprobs

MODES = ("packed", "unpacked", "auto")


# --- structured kernel (sdpa models on CPU) ---

# Arguments transformers passes to attention functions that change the result and that the structured
# kernel does not implement: sliding windows (Mistral, Gemma), logit soft-capping (Gemma 2), sinks (gpt-oss).
UNSUPPORTED_ATTENTION_ARGUMENTS = ("sliding_window", "softcap", "s_aux")


class PackedRow(NamedTuple):
    """Where one packed row's segments lie, for `shared_prompt_attention`. G responses, R the longest."""

    prompt_len: int           # P
    length: int               # P + Σ R_i real tokens; the rest of the row is padding
    response_columns: Tensor  # (G, R) column of token t of response i; past a response's end, its last token
    response_kept: Tensor     # (Σ R_i,) indices into the flattened (G·R) of the real response tokens, in row order


def packed_rows(layout: Layout) -> list[PackedRow]:
    """The `PackedRow` of every row of a `pack`ed layout (one host sync per forward, not per layer).

    >>> row, = packed_rows(pack([(torch.tensor([10, 11, 12]), [torch.tensor([20, 21]), torch.tensor([30])])]))
    >>> row.prompt_len, row.length, row.response_columns, row.response_kept
    (3, 6, tensor([[3, 4],
            [5, 5]]), tensor([0, 1, 2]))
    """
    rows = []
    device = layout.segment_ids.device
    for segments in layout.segment_ids.tolist():
        P = segments.count(0)
        lengths = torch.tensor([segments.count(i) for i in range(1, max(segments) + 1)])  # (G,)
        starts = P + lengths.cumsum(0) - lengths                                        # (G,)
        t = torch.arange(int(lengths.max()))                                            # (R,)
        columns = starts[:, None] + torch.minimum(t, lengths[:, None] - 1)             # (G, R)
        kept = (t < lengths[:, None]).flatten().nonzero()[:, 0]                         # (Σ R_i,)
        rows.append(PackedRow(P, P + int(lengths.sum()), columns.to(device), kept.to(device)))
    return rows


def shared_prompt_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            shared_prompt_rows: Sequence[PackedRow] | None = None, **kwargs) -> tuple[Tensor, None]:
    """Attention of packed rows that computes only the blocks `shared_prompt_mask` allows.

    query (B, H, L, D), key and value (B, H_kv, L, D), rotary positions already applied -> (B, L, H, D),
    the signature of a Hugging Face attention function (`transformers.AttentionInterface`). Per row:
    the prompt attends causally to itself; every response attends to the whole prompt and causally to
    itself; padding outputs zeros. `attention_mask` is unused: the layout comes in `shared_prompt_rows`.
    """
    if shared_prompt_rows is None:
        raise ValueError("shared_prompt_attention needs shared_prompt_rows (see batch_logprobs)")
    for name in UNSUPPORTED_ATTENTION_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise ValueError(f"shared_prompt_attention does not implement {name}={kwargs[name]!r} (departure 3); "
                             "train this model with plain rows (mode='unpacked')")
    H, L, D = query.shape[1:]
    scale = D ** -0.5 if scaling is None else scaling
    outputs = []
    for q, k, v, row in zip(query, key, value, shared_prompt_rows):  # (H, L, D), (H_kv, L, D), (H_kv, L, D)
        P = row.prompt_len
        prompt = torch.nn.functional.scaled_dot_product_attention(  # 4-D: CPU's flash kernel wants a batch dim
            q[None, :, :P], k[None, :, :P], v[None, :, :P], dropout_p=dropout, is_causal=True, scale=scale,
            enable_gqa=True)[0]                                                   # (H, P, D)
        responses = _responses_attention(q, k, v, row, scale, dropout)            # (H, Σ R_i, D)
        padding = q.new_zeros(H, L - row.length, D)
        outputs.append(torch.cat([prompt, responses, padding], dim=1).transpose(0, 1))  # (L, H, D)
    return torch.stack(outputs), None  # (B, L, H, D)


def _responses_attention(q: Tensor, k: Tensor, v: Tensor, row: PackedRow, scale: float, dropout: float) -> Tensor:
    """All G responses of one row at once: keys [prompt | own response], causal on the own part.

    Scores against the prompt are one (G·R, P) product, not G copies of the prompt's keys; the small
    (R, R) own-response blocks are batched over G; one softmax over both. Query heads sharing a KV head
    (GQA, n per KV head) are stacked as extra query rows instead of copying keys. Computed in at
    least float32 with autocast off, as SDPA keeps scores in float32: bf16 scores (spacing 0.125 at
    |s| = 20) would shift the attention weights by up to ~6% against the prompt's SDPA.
    """
    dtype = q.dtype
    wide = torch.promote_types(dtype, torch.float32)                               # bf16 -> float32, float64 stays
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
        P = row.prompt_len
        G, R = row.response_columns.shape
        H, _, D = q.shape
        H_kv = k.shape[0]
        n = H // H_kv
        columns = row.response_columns.flatten()                                  # (G·R,)
        q_r = (q[:, columns] * scale).reshape(H_kv, n, G, R, D)                   # query head = kv head · n + j
        k_r, v_r = (x[:, columns].reshape(H_kv, 1, G, R, D) for x in (k, v))     # (H_kv, 1, G, R, D)
        t = torch.arange(R, device=q.device)
        causal = t[:, None] >= t[None, :]                                         # (R, R)
        to_prompt = (q_r.reshape(H_kv, n * G * R, D) @ k[:, :P].transpose(1, 2)).reshape(H_kv, n, G, R, P)
        to_own = (q_r @ k_r.transpose(3, 4)).masked_fill(~causal, float("-inf"))   # (H_kv, n, G, R, R)
        weights = torch.cat([to_prompt, to_own], dim=-1).softmax(dim=-1)           # (H_kv, n, G, R, P+R)
        if dropout:
            weights = torch.nn.functional.dropout(weights, dropout)
        w_prompt, w_own = weights.split([P, R], dim=-1)
        out = (w_prompt.reshape(H_kv, n * G * R, P) @ v[:, :P]).reshape(H_kv, n, G, R, D) + w_own @ v_r
    return out.reshape(H, G * R, D)[:, row.response_kept].to(dtype)               # (H, Σ R_i, D)


@contextmanager
def _attention_kernel(model: torch.nn.Module, name: str = "shared_prompt") -> Iterator[None]:
    """Run the model with `shared_prompt_attention` as its attention kernel, then restore its own.

    transformers is imported here, not at the top, so this file can be copied with torch alone.
    """
    from transformers import AttentionInterface
    AttentionInterface.register(name, shared_prompt_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


# --- activation checkpointing ---

def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing: transformers 5 `activation_checkpointing_enable`, 4.x `gradient_...`."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def recomputes_attention(model: torch.nn.Module) -> bool:
    """Activation checkpointing is on and will re-run attention in backward (departure 1).

    transformers 5 calls the flag `is_activation_checkpointing` (with a deprecated alias), 4.x
    `is_gradient_checkpointing`; it acts only in training mode.
    """
    name = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") \
        else "is_gradient_checkpointing"  # the instance: a peft wrapper forwards the attribute, its class has none
    return bool(getattr(model, name, False)) and model.training


# --- when packing pays ---

# Attention score pairs (forward + backward) that cost as much as one token's per-token work
# (projections, MLP): least-squares fit of `packing_cost_ratio` to the `python bench.py shared-prompt`
# grid (6 layers, hidden 256, sdpa, one CPU core; docs/benchmarks.md; the bench prints its own fit). Per-token work
# grows as hidden^2 and attention per pair as hidden, so bigger models have a larger value: this small-model one
# errs toward not packing, the safe side.
ATTENTION_BREAK_EVEN_LEN = 400
# Fixed cost of one packed row in the same units: the structured kernel loops over rows in Python (per layer,
# forward and backward), fitted on the tiny model's toy groups (docs/benchmarks.md).
# Negligible for real groups (hundreds of tokens); tiny groups take the dense mask instead (`structured_pays`).
PACKED_ROW_OVERHEAD_TOKENS = 64


def packing_cost_ratio(prompt_len: int, response_lens: list[int],
                       break_even_len: float = ATTENTION_BREAK_EVEN_LEN, dense: bool = False) -> float:
    """Predicted time of one packed row over that of G plain rows (forward + backward).

    Cost in units of one token's per-token work (projections, MLP), attention counted in score pairs
    at 1 / break_even_len each; L = P + Σ R_i, R = max R_i, L_u = P + R:

        packed   = L + (P^2 / 2 + G · R · (P + R)) / break_even_len   causal prompt; each response
                   + PACKED_ROW_OVERHEAD_TOKENS                    against the prompt and its own
                                                                   (R, R) block (`shared_prompt_attention`),
                                                                   plus the kernel's per-row overhead
        packed   = L + L^2 / break_even_len                        dense=True: the dense mask (eager
                                                                   models, activation checkpointing,
                                                                   accelerators: departures 1, 5), whose
                                                                   kernels visit every pair
        unpacked = G · (L_u + L_u^2 / (2 · break_even_len))           G causal rows, padded to R
    Packing saves (G-1)·P tokens and (G-1)·P^2/2 prompt pairs, but computes each own-response block
    whole (R^2, not R^2/2), so it wins unless the prompt is short next to long responses. The balance
    depends on the model and the kernel, so the one constant is fitted, not derived: `bench.py
    shared-prompt` prints the fit for the machine it runs on. Ties go to the simple path. The CPU fit
    prices attention high for an accelerator, so there the rule errs toward plain rows, the safe side.

    >>> round(packing_cost_ratio(512, [32] * 8), 2), round(packing_cost_ratio(32, [256] * 8), 2)
    (0.21, 1.16)
    >>> round(packing_cost_ratio(450, [128] * 8, dense=True), 2), round(packing_cost_ratio(64, [64] * 8, dense=True), 2)
    (0.87, 1.18)
    """
    packed, unpacked = packing_costs(prompt_len, response_lens, break_even_len, dense)
    return packed / unpacked


def packing_costs(prompt_len: int, response_lens: list[int], break_even_len: float = ATTENTION_BREAK_EVEN_LEN,
                  dense: bool = False) -> tuple[float, float]:
    """(packed, unpacked): `packing_cost_ratio`'s two costs of one group, in token units."""
    L = prompt_len + sum(response_lens)
    R = max(response_lens)
    L_u = prompt_len + R
    if dense:
        packed = L + L * L / break_even_len
    else:
        packed = (L + (prompt_len ** 2 / 2 + len(response_lens) * R * (prompt_len + R)) / break_even_len
                  + PACKED_ROW_OVERHEAD_TOKENS)
    unpacked = len(response_lens) * (L_u + L_u * L_u / (2 * break_even_len))
    return packed, unpacked


def structured_pays(lengths: list[tuple[int, list[int]]]) -> bool:
    """Auto's kernel for packed rows where both apply (sdpa models on CPU): the structured kernel when
    `packing_costs` prices it below the dense mask over these groups ((prompt length, response lengths) each;
    the dense mask's rows padded to the longest), else the dense mask. On short rows the kernel's per-row
    overhead outweighs the L^2 pairs the dense mask visits (the toy's groups, P ~ 8, R ~ 5, G = 8); long
    prompts keep the kernel (docs/benchmarks.md).

    >>> structured_pays([(8, [5] * 8)] * 16), structured_pays([(512, [32] * 8)])
    (False, True)
    """
    structured = sum(packing_costs(prompt, responses)[0] for prompt, responses in lengths)
    longest = max(prompt + sum(responses) for prompt, responses in lengths)  # the dense mask pads every row to it
    return structured < len(lengths) * (longest + longest * longest / ATTENTION_BREAK_EVEN_LEN)


def packing_pays(prompt_len: int, response_lens: list[int], dense: bool = False) -> bool:
    """The auto rule: pack a group when `packing_cost_ratio` predicts it strictly faster."""
    return packing_cost_ratio(prompt_len, response_lens, dense=dense) < 1.0


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """What in the model's attention the packed layout cannot express exactly (departure 3), or None.

    Sliding windows: per-layer `layer_types` (Gemma, transformers 5), or a `sliding_window` that is
    on unless `use_sliding_window` says otherwise (Mistral has no switch; Qwen2 has one, off).
    """
    config = text_config(model)
    if any("sliding" in kind for kind in getattr(config, "layer_types", None) or []) or (
            getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)):
        return "sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        return "attention sinks"
    return None


# --- per group: packed or plain rows ---

def structured_kernel(model: torch.nn.Module, dense_mask: bool = False) -> bool:
    """Whether packed rows of this model go through `shared_prompt_attention`: sdpa models on CPU that do not
    recompute attention in backward (departures 1 and 5), unless dense_mask asks for the dense mask."""
    return (model.config._attn_implementation == "sdpa" and not dense_mask and not recomputes_attention(model)
            and next(model.parameters()).device.type == "cpu")


def _packed_batch(model: torch.nn.Module, groups: Sequence[Group], temperature: float, pad_id: int,
                  structured: bool, entropy: bool = False, pad_to_multiple_of: int = 1) -> tuple[Tensor, ...]:
    """(logp, mask), (N, T), with one shared-prompt row per group, in one forward: through the structured kernel
    (`structured`, what `structured_kernel` says), else under the dense (B, 1, L, L) mask."""
    if structured:
        return structured_batch_logprobs(model, groups, temperature, pad_id, entropy, pad_to_multiple_of)
    return packed_batch_logprobs(model, groups, temperature, pad_id, entropy, pad_to_multiple_of)


def structured_batch_logprobs(model: torch.nn.Module, groups: Sequence[Group], temperature: float = 1.0,
                              pad_id: int = 0, entropy: bool = False, pad_to_multiple_of: int = 1
                              ) -> tuple[Tensor, ...]:
    """`packed_batch_logprobs` through `shared_prompt_attention` (an sdpa model, on any device), no dense mask."""
    layout = pack(groups, pad_id, pad_to_multiple_of)
    with _attention_kernel(model):  # departure 1
        return layout_logprobs(model, layout, None, temperature, entropy, shared_prompt_rows=packed_rows(layout))


def batch_logprobs(model: torch.nn.Module, groups: list[tuple[Tensor, list[Tensor]]], mode: str = "auto",
                   temperature: float = 1.0, pad_id: int = 0, dense_mask: bool = False,
                   entropy: bool = False, pad_to_multiple_of: int = 1) -> tuple[Tensor, ...]:
    """Per-token log-probs of every response of every group, for the GRPO loss.

    mode: "packed" (one shared-prompt row per group), "unpacked" (one row per response) or "auto"
    (per group, `packing_pays`; on CPU the packed rows' kernel too, `structured_pays`). Returns (logp, mask),
    both (N, T): N responses in group order (group 0's first), T the longest response; mask is bool, True on
    real response tokens, and logp is 0 where it is False. Differentiable w.r.t. the model's parameters.
    dense_mask=True sends packed rows through the dense mask even where the structured kernel applies (to
    compare the two). entropy=True: (logp, mask, H), H (N, T) each token's entropy (`attention.layout_logprobs`).
    pad_to_multiple_of: rows padded to a multiple of this length (attention.py, departure 5)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    unsupported = packing_unsupported(model) if mode != "unpacked" else None
    if unsupported and mode == "packed":
        raise ValueError(f"cannot pack groups for this model: it uses {unsupported}, which the shared-prompt layout "
                         "does not express (departure 3); use mode='auto' or 'unpacked' (plain rows, exact)")
    structured = structured_kernel(model, dense_mask)
    if structured and mode == "auto":  # and where it pays (short rows: the dense mask)
        structured = structured_pays([(len(p), [len(r) for r in rs]) for p, rs in groups])
    packed = [not unsupported and (mode == "packed" or (mode == "auto" and packing_pays(
                  len(p), [len(r) for r in rs], dense=not structured)))
              for p, rs in groups]
    multiple = pad_to_multiple_of
    if all(packed):
        return _packed_batch(model, groups, temperature, pad_id, structured, entropy, multiple)
    if not any(packed):
        return unpacked_batch_logprobs(model, groups, temperature, pad_id, entropy, multiple)
    # mixed (auto only): one forward per layout, then responses back in group order
    results = {True: _packed_batch(model, [g for g, p in zip(groups, packed) if p], temperature, pad_id, structured,
                                   entropy, multiple),
               False: unpacked_batch_logprobs(model, [g for g, p in zip(groups, packed) if not p], temperature, pad_id,
                                              entropy, multiple)}
    T = max(len(r) for _, rs in groups for r in rs)
    taken = {True: 0, False: 0}  # responses consumed from each result so far
    pieces = []  # per group: its (G, T) logp, mask (and H)
    for (_, responses), p in zip(groups, packed):
        rows = slice(taken[p], taken[p] + len(responses))
        pieces.append([torch.nn.functional.pad(x[rows], (0, T - x.shape[1])) for x in results[p]])  # (G, T) each
        taken[p] += len(responses)
    return tuple(torch.cat(parts) for parts in zip(*pieces))


def logprobs_fn(policy: torch.nn.Module, mode: str = "auto", temperature: float = 1.0,
                pad_id: int = 0, pad_to_multiple_of: int = 1, dense_mask: bool = False
                ) -> Callable[..., tuple[Tensor, ...]]:
    """The tri-model's scorer (tri_model.TriModel's `logprobs_fn`): `batch_logprobs` with the run's settings, the
    same kernels for all three copies: the policy's `structured_kernel` decides for the frozen copies too (they
    run in eval mode, where checkpointing does not recompute: departure 1), so that at θ = θ_0 policy and
    reference agree exactly. dense_mask=True: packed rows always take the dense mask (compiled layers)."""
    def logprobs(model: torch.nn.Module, groups: Sequence[Group], entropy: bool = False) -> tuple[Tensor, ...]:
        dense = dense_mask or not structured_kernel(policy)
        return batch_logprobs(model, groups, mode, temperature, pad_id, dense_mask=dense,
                              entropy=entropy, pad_to_multiple_of=pad_to_multiple_of)
    return logprobs
