"""Shared-prompt attention: score all G responses to one prompt in a single packed row.

GRPO samples G responses r_1..r_G to a prompt p (length P) and needs, for every response token,

    log π(r_i[t] | p, r_i[<t])

The plain way runs G rows [p | r_i] and computes the prompt G times. The paper's shared-prompt
attention mask (Periodic Asynchrony, arXiv 2511.18871, training side) runs one row

    [p | r_1 | r_2 | ... | r_G]          length L = P + Σ|r_i|

with segment ids s (0 on the prompt, i on response i) and

    mask[q, k] = (k ≤ q) and (s[k] = 0 or s[k] = s[q])     query q may attend key k
    position   = 0..P-1 on the prompt, P, P+1, ... again on every response

Every token then sees exactly the keys, at exactly the rotary positions, it would see in its own
row [p | r_i]; attention is the only place tokens mix, so per-token log-probs and gradients equal
the unpacked ones up to float summation order. Tokens drop from G(P+R) to P+GR (5.67x at P=512,
R=32, G=8). Attention shrinks less: the mask allows P^2/2 + Σ R_i(P + R_i/2) score pairs of the
(P+GR)^2, against G(P+R)^2/2 unpacked, so where prompts are short and responses long packing saves
little or loses; `packing_pays` decides.

Worked example, P=3, G=2, responses a (length 2) and b (length 1):

    ids        p0 p1 p2 a0 a1 b0
    positions   0  1  2  3  4  3
    segments    0  0  0  1  1  2

    mask       p0 p1 p2 a0 a1 b0      (row = query, column = key, 1 = attend)
      p0        1  .  .  .  .  .
      p1        1  1  .  .  .  .
      p2        1  1  1  .  .  .
      a0        1  1  1  1  .  .
      a1        1  1  1  1  1  .
      b0        1  1  1  .  .  1

    a0 and b0 are both predicted by the logits at p2 (the next-token shift at the boundary),
    a1 by the logits at a0. a1's logits predict nothing and are never computed.

Several groups in one micro-batch are several right-padded rows (segment id -1 on padding).

How a layout reaches a Hugging Face model: `input_ids` (B, L) and explicit `position_ids` (B, L)
always, so rotary embeddings (applied before attention) are already right; then one of two kernels:
- sdpa models: `shared_prompt_attention`, registered with `transformers.AttentionInterface` and
  switched in for the forward only (`model.set_attn_implementation`). It never builds the mask: per
  row it runs the prompt through causal SDPA, and all G responses at once against [prompt | own
  response] with a causal (R, R) block, i.e. only the blocks the mask allows. The layout travels as
  `shared_prompt_rows`, a model-call keyword that transformers forwards to the attention function
  (checked on 5.23), and `attention_mask=None`, which a kernel unknown to transformers' mask
  registry receives as is.
- the fallback, eager models or activation checkpointing: the dense mask, a 4D `attention_mask`
  (B, 1, L, L) that transformers passes to the kernel untouched
  (`masking_utils._preprocess_mask_arguments`); see departures 2 and 3.

Deliberate choices and departures:
1. The structured kernel replaces the model's own only during the forward; backward reuses the
   saved graph. Activation checkpointing re-runs attention in backward, after the switch is undone,
   so it gets the dense mask instead. On one CPU core at P=512, R=32, G=8 it cut a layer's attention
   (forward + backward) from ~22 to ~17 ms, not to the 45% its pair count suggests: CPU kernels skip
   little of a causal block. Tried and dropped: SDPA with a boolean (R, P+R) mask for the responses
   (slower backward), chunking the prompt into causal pieces (no faster). Responses are padded to
   the longest in the row; their (R, R) blocks are computed whole.
2. Dense mask (fallback) dtype follows the kernel (`to_model_mask`): boolean (True = attend) for
   `sdpa`; additive float (0 or the dtype's min) for `eager`, which *adds* the mask to the scores,
   so a boolean mask there would add 1 to allowed scores and 0 to forbidden ones, i.e. mask
   nothing. Other kernels (flash_attention_2, flex) take neither: error.
3. Padding never reaches a real token: the structured kernel gives padding zeros; under the dense
   mask a pad token attends only to itself, so no softmax row is empty (no NaN). Pad outputs are
   discarded.
4. Only the hidden states that predict a response token reach the output layer, gathered per
   token and pushed through it in checkpointed chunks (`token_logprobs`): no (tokens x vocab) tensor
   of a whole micro-batch ever exists. Models whose logits are not plain lm_head(h) (soft-capping,
   logit scales: `LOGIT_TRANSFORMS`) take the model's own logits instead (`logits_to_keep`).
5. Log-probs are of `logits / temperature` in float32 (as TRL), so they match the sampling
   distribution; the structured kernel's softmax is float32 too, whatever the compute dtype.
6. Attention variants the packed layout cannot express exactly (sliding windows as in Mistral or
   Qwen2 with use_sliding_window, logit soft-capping as in Gemma 2, attention sinks as in gpt-oss)
   are refused for packing (`packing_unsupported`): "auto" keeps such models on plain rows, and the
   structured kernel raises if it ever receives one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple, Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint

Group = tuple[Tensor, Sequence[Tensor]]  # (prompt_ids (P,), [response_ids (R_i,), ...])
MODES = ("packed", "unpacked", "auto")

# Attention score pairs (forward + backward) that cost as much as one token's per-token work
# (projections, MLP): least-squares fit of `packing_cost_ratio` to the `python bench.py shared-prompt`
# grid (6 layers, hidden 256, sdpa, one CPU core; fitted 373, the bench prints its own fit). Per-token
# work grows as hidden^2 and attention per pair as hidden, so bigger models have a larger value:
# this small-model one errs toward not packing, the safe side.
ATTENTION_BREAK_EVEN_LEN = 400
# Fixed cost of one packed row in the same units: the structured kernel loops over rows in Python (per layer,
# forward and backward). Measured on the tiny model, 2 CPU threads: a toy group (P=6, R=5, G=8) costs 5.3 ms
# packed against 4.1 ms as plain rows, i.e. ~115 units where the model above says ~47 (docs/benchmarks.md).
# Negligible for real groups (hundreds of tokens); it keeps tiny groups on plain rows.
PACKED_ROW_OVERHEAD_TOKENS = 64


class Layout(NamedTuple):
    """Rows the model reads, and where in them each response's log-probs are read back.

    N responses, T = the longest response, B rows of length L.
    """

    input_ids: Tensor     # (B, L) right-padded with pad_id
    position_ids: Tensor  # (B, L) rotary positions; 0 on padding
    segment_ids: Tensor   # (B, L) 0 prompt, i on the i-th response of the row (1-based), -1 padding
    row: Tensor           # (N,) the row holding response n
    source: Tensor        # (N, T) column whose logits predict token t of response n; 0 past its end
    target: Tensor        # (N, T) the response tokens; pad_id past the end
    mask: Tensor          # (N, T) bool, True on real response tokens


# --- layouts ---

def pack(groups: Sequence[Group], pad_id: int = 0) -> Layout:
    """One row per group: [prompt | r_1 | ... | r_G], positions restarting at P on each response.

    >>> p, a, b = torch.tensor([10, 11, 12]), torch.tensor([20, 21]), torch.tensor([30])
    >>> x = pack([(p, [a, b])])
    >>> x.input_ids, x.position_ids, x.segment_ids
    (tensor([[10, 11, 12, 20, 21, 30]]), tensor([[0, 1, 2, 3, 4, 3]]), tensor([[0, 0, 0, 1, 1, 2]]))
    >>> x.source  # a0 <- p2, a1 <- a0, b0 <- p2
    tensor([[2, 3],
            [2, 0]])
    """
    ids, positions, segments, sources = [], [], [], []
    row: list[int] = []
    for b, (prompt, responses) in enumerate(groups):
        _check_group(prompt, responses)
        P = len(prompt)
        ids.append(torch.cat([prompt, *responses]))
        positions.append(torch.cat([torch.arange(P)] + [torch.arange(P, P + len(r)) for r in responses]))
        segments.append(torch.cat([torch.zeros(P, dtype=torch.long)]
                                  + [torch.full((len(r),), i + 1) for i, r in enumerate(responses)]))
        start = P  # column of the current response's first token
        for r in responses:
            source = torch.arange(start - 1, start - 1 + len(r))  # r[t] is predicted at r[t-1] ...
            source[0] = P - 1                                     # ... and r[0] at the last prompt token
            sources.append(source)
            row.append(b)
            start += len(r)
    responses = [r for _, rs in groups for r in rs]
    device = ids[0].device
    return Layout(
        input_ids=pad_sequence(ids, batch_first=True, padding_value=pad_id),            # (B, L)
        position_ids=pad_sequence(positions, batch_first=True).to(device),              # (B, L)
        segment_ids=pad_sequence(segments, batch_first=True, padding_value=-1).to(device),  # (B, L)
        row=torch.tensor(row, device=device),                                           # (N,)
        source=pad_sequence(sources, batch_first=True).to(device),                      # (N, T)
        target=pad_sequence(responses, batch_first=True, padding_value=pad_id),         # (N, T)
        mask=_lengths_mask([len(r) for r in responses], device),                        # (N, T)
    )


def unpacked_layout(groups: Sequence[Group], pad_id: int = 0) -> Layout:
    """The plain layout: one row [prompt | r_i] per response, right-padded, ordinary positions.

    Built with whole-batch tensor ops (one concatenation, one scatter), not per response: a training
    micro-batch may hold hundreds of short responses.
    """
    for prompt, responses in groups:
        _check_group(prompt, responses)
    responses = [r for _, rs in groups for r in rs]
    device = responses[0].device
    P = torch.tensor([len(p) for p, rs in groups for _ in rs], device=device)  # (N,) prompt length of each row
    R = torch.tensor([len(r) for r in responses], device=device)                # (N,)
    tokens = torch.cat([x for p, rs in groups for r in rs for x in (p, r)])     # (Σ P_n + R_n,) rows back to back
    L, T = int((P + R).max()), int(R.max())
    row = torch.repeat_interleave(torch.arange(len(R), device=device), P + R)   # (Σ,) row of each token
    starts = torch.cumsum(P + R, 0) - (P + R)                                   # (N,) where each row starts
    column = torch.arange(len(tokens), device=device) - starts[row]             # (Σ,)
    input_ids = torch.full((len(R), L), pad_id, dtype=tokens.dtype, device=device)
    input_ids[row, column] = tokens                                             # (N, L)
    col = torch.arange(L, device=device)[None]                                  # (1, L)
    t = torch.arange(T, device=device)[None]                                    # (1, T)
    mask = t < R[:, None]                                                       # (N, T)
    return Layout(
        input_ids=input_ids,
        position_ids=col.expand(len(R), L),                                     # (N, L)
        segment_ids=torch.where(col < P[:, None], 0, torch.where(col < (P + R)[:, None], 1, -1)),  # (N, L)
        row=torch.arange(len(R), device=device),                                # (N,)
        source=torch.where(mask, P[:, None] - 1 + t, 0),                        # (N, T) r[t] <- column P-1+t
        target=input_ids.new_full((len(R), T), pad_id).masked_scatter(mask, torch.cat(responses)),  # (N, T)
        mask=mask,                                                              # (N, T)
    )


def _check_group(prompt: Tensor, responses: Sequence[Tensor]) -> None:
    if prompt.ndim != 1 or len(prompt) == 0:
        raise ValueError(f"prompt must be a non-empty 1-D tensor, got shape {tuple(prompt.shape)}")
    if len(responses) == 0:
        raise ValueError("a group needs at least one response")
    for r in responses:
        if r.ndim != 1 or len(r) == 0:
            raise ValueError(f"responses must be non-empty 1-D tensors, got shape {tuple(r.shape)}")


def _lengths_mask(lengths: list[int], device: torch.device) -> Tensor:
    lengths_t = torch.tensor(lengths, device=device)  # (N,)
    return torch.arange(max(lengths), device=device) < lengths_t[:, None]  # (N, T)


# --- mask ---

def shared_prompt_mask(segment_ids: Tensor) -> Tensor:
    """(B, L) segment ids -> (B, 1, L, L) bool mask, True where query q may attend key k.

    Causal, and a key is visible if it is prompt (segment 0) or in the query's own segment;
    padding (segment -1) sees only itself. For segments [0, 0, 0, 1, 1, 2] this is the matrix in
    the module docstring.
    """
    L = segment_ids.shape[1]
    index = torch.arange(L, device=segment_ids.device)
    causal = index[:, None] >= index[None, :]                    # (L, L)
    query_seg = segment_ids[:, :, None]                          # (B, L, 1)
    key_seg = segment_ids[:, None, :]                            # (B, 1, L)
    visible = (key_seg == query_seg) | (key_seg == 0)            # (B, L, L)
    allowed = causal & visible & (query_seg >= 0)                # (B, L, L) padding queries see nothing ...
    allowed |= index[:, None] == index[None, :]                  # ... but themselves, so softmax has a term
    return allowed[:, None]                                      # (B, 1, L, L)


def to_model_mask(allowed: Tensor, dtype: torch.dtype, attn_implementation: str) -> Tensor:
    """Boolean mask -> what the model's attention kernel expects (departure 2 in the docstring).

    sdpa: the boolean mask itself (True = attend). eager: additive, 0 where allowed and the dtype's
    most negative value elsewhere (not -inf, so a fully masked row could never make NaN).
    """
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)  # (B, 1, L, L)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"shared-prompt masks need attn_implementation 'sdpa' or 'eager', got {attn_implementation!r}")


# --- structured kernel (sdpa models) ---

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
            raise ValueError(f"shared_prompt_attention does not implement {name}={kwargs[name]!r} (departure 6); "
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


# --- hidden states -> log-probs ---

LOGITS_CHUNK_BYTES = 256 * 2**20  # logits alive at once, counting ~16 bytes per logit (see token_logprobs)
# Config fields of models whose logits are not plain `lm_head(last_hidden_state)` (Gemma 2/3 soft-capping,
# Cohere's and Granite's scales): those take their logits from the model's own forward (`_forward`).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_logprobs(hidden: Tensor, head: torch.nn.Module, targets: Tensor, temperature: float = 1.0,
                   chunk_bytes: int | None = None) -> Tensor:
    """log softmax(head(h) / temperature)[target] for each row h of `hidden`, in float32: (M, H) -> (M,).

    The (M, V) logits never exist at once: rows go through the head in chunks of about
    chunk_bytes / (16 V) rows (a chunk holds its logits in the compute dtype, a float32 copy and the
    exponentials of logsumexp: ~16 bytes a logit under bf16 autocast), and with gradients each
    chunk is checkpointed (its logits are recomputed in backward instead of kept), so the peak is
    one chunk, not M x V (8 x 512 tokens of Qwen2.5 are 2.5 GB in float32). Like TRL's
    `selective_log_softmax`, but from the hidden states. `head` may be `nn.Identity()` when
    `hidden` already holds logits.
    """
    vocab = getattr(head, "out_features", None) or hidden.shape[-1]
    rows = max(1, (chunk_bytes or LOGITS_CHUNK_BYTES) // (16 * vocab))
    chunked = len(hidden) > rows and torch.is_grad_enabled()
    pieces = []
    for start in range(0, len(hidden), rows):
        h, t = hidden[start:start + rows], targets[start:start + rows]  # (n, H), (n,)
        if chunked:
            pieces.append(checkpoint(_selected_logprobs, h, t, head, temperature, use_reentrant=False))
        else:
            pieces.append(_selected_logprobs(h, t, head, temperature))
    return torch.cat(pieces)  # (M,)


def _selected_logprobs(hidden: Tensor, targets: Tensor, head: torch.nn.Module, temperature: float) -> Tensor:
    logits = head(hidden)                                                          # (n, V) compute dtype
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))          # >= float32
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(dim=-1)   # (n,)


def _scatter(values: Tensor, mask: Tensor) -> Tensor:
    """(M,) values of the True entries of an (N, T) mask -> (N, T), 0 elsewhere (differentiable)."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def _forward(model: torch.nn.Module, layout: Layout, attention_mask: Tensor | None,
             temperature: float, **attention_kwargs) -> tuple[Tensor, Tensor]:
    """(logp, mask), (N, T): logp[n, t] = log_softmax(logits[row n, column source[n, t]] / T)[target[n, t]]."""
    inputs = dict(input_ids=layout.input_ids, attention_mask=attention_mask, position_ids=layout.position_ids,
                  use_cache=False, **attention_kwargs)
    targets = layout.target[layout.mask]  # (M,) the real response tokens
    rows = layout.row[:, None].expand_as(layout.source)[layout.mask]  # (M,) row of each
    if any(getattr(text_config(model), name, None) is not None for name in LOGIT_TRANSFORMS):
        kept = layout.source[layout.mask].unique()  # (K,) sorted columns whose logits are needed, any row
        logits = model(**inputs, logits_to_keep=kept).logits  # (B, K, V) the model's own output layer
        columns = torch.searchsorted(kept, layout.source[layout.mask])  # (M,) index into kept
        logp = token_logprobs(logits[rows, columns], torch.nn.Identity(), targets, temperature)  # (M,)
        return _scatter(logp, layout.mask), layout.mask
    hidden = model.get_decoder()(**inputs).last_hidden_state  # (B, L, H)
    states = hidden[rows, layout.source[layout.mask]]  # (M, H) the states that predict the tokens
    logp = token_logprobs(states, model.get_output_embeddings(), targets, temperature)  # (M,)
    return _scatter(logp, layout.mask), layout.mask


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
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False)) and model.training


def _packed_batch(model: torch.nn.Module, groups: Sequence[Group], temperature: float = 1.0,
                 pad_id: int = 0, dense_mask: bool = False) -> tuple[Tensor, Tensor]:
    """(logp, mask), (N, T), with one shared-prompt row per group, in one forward.

    The structured kernel on sdpa models, else (or with dense_mask=True) the dense (B, 1, L, L) mask.
    """
    layout = pack(groups, pad_id)
    structured = model.config._attn_implementation == "sdpa" and not dense_mask
    if structured and not recomputes_attention(model):
        with _attention_kernel(model):  # departure 1
            return _forward(model, layout, None, temperature, shared_prompt_rows=packed_rows(layout))
    allowed = shared_prompt_mask(layout.segment_ids)  # (B, 1, L, L)
    attention_mask = to_model_mask(allowed, model.dtype, model.config._attn_implementation)
    return _forward(model, layout, attention_mask, temperature)


def _unpacked_batch(model: torch.nn.Module, groups: Sequence[Group], temperature: float = 1.0,
                   pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """(logp, mask), (N, T), with one plain row per response and a 2D padding mask, in one forward."""
    layout = unpacked_layout(groups, pad_id)
    attention_mask = (layout.segment_ids >= 0).long()  # (N, L) 1 = real token
    return _forward(model, layout, attention_mask, temperature)


def shared_prompt_logprobs(model: torch.nn.Module, prompt_ids: Tensor, responses: list[Tensor],
                           temperature: float = 1.0) -> list[Tensor]:
    """Per-token log-probs of each response to one prompt, all G in one packed row.

    Returns one 1-D tensor per response, as long as the response; differentiable.
    """
    logp, _ = _packed_batch(model, [(prompt_ids, responses)], temperature)  # (G, T)
    return [logp[i, :len(r)] for i, r in enumerate(responses)]


def unpacked_logprobs(model: torch.nn.Module, prompt_ids: Tensor, responses: list[Tensor],
                      temperature: float = 1.0) -> list[Tensor]:
    """The reference: same result as `shared_prompt_logprobs`, one padded row [prompt | r_i] each."""
    logp, _ = _unpacked_batch(model, [(prompt_ids, responses)], temperature)  # (G, T)
    return [logp[i, :len(r)] for i, r in enumerate(responses)]


# --- when packing pays ---

def packing_cost_ratio(prompt_len: int, response_lens: list[int],
                       break_even_len: float = ATTENTION_BREAK_EVEN_LEN) -> float:
    """Predicted time of one packed row over that of G plain rows (forward + backward), sdpa models.

    Cost in units of one token's per-token work (projections, MLP), attention counted in score pairs
    at 1 / break_even_len each; L = P + Σ R_i, R = max R_i, L_u = P + R:

        packed   = L + (P^2 / 2 + G · R · (P + R)) / break_even_len   causal prompt; each response
                   + PACKED_ROW_OVERHEAD_TOKENS                    against the prompt and its own
                                                                   (R, R) block (`shared_prompt_attention`),
                                                                   plus the kernel's per-row overhead
        unpacked = G · (L_u + L_u^2 / (2 · break_even_len))           G causal rows, padded to R
    Packing saves (G-1)·P tokens and (G-1)·P^2/2 prompt pairs, but computes each own-response block
    whole (R^2, not R^2/2), so it wins unless the prompt is short next to long responses. The balance
    depends on the model and the kernel, so the one constant is fitted, not derived: `bench.py
    shared-prompt` prints the fit for the machine it runs on. Ties go to the simple path. Eager
    models take the dense mask (departure 1) and pay more attention than this predicts when packed.

    >>> round(packing_cost_ratio(512, [32] * 8), 2), round(packing_cost_ratio(32, [256] * 8), 2)
    (0.21, 1.16)
    """
    L = prompt_len + sum(response_lens)
    R = max(response_lens)
    L_u = prompt_len + R
    packed = (L + (prompt_len ** 2 / 2 + len(response_lens) * R * (prompt_len + R)) / break_even_len
              + PACKED_ROW_OVERHEAD_TOKENS)
    unpacked = len(response_lens) * (L_u + L_u * L_u / (2 * break_even_len))
    return packed / unpacked


def packing_pays(prompt_len: int, response_lens: list[int]) -> bool:
    """The auto rule: pack a group when `packing_cost_ratio` predicts it strictly faster."""
    return packing_cost_ratio(prompt_len, response_lens) < 1.0


def text_config(model: torch.nn.Module):
    """The language model's config (multimodal wrappers keep it in `text_config`)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """What in the model's attention the packed layout cannot express exactly (departure 6), or None.

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


def batch_logprobs(model: torch.nn.Module, groups: list[tuple[Tensor, list[Tensor]]], mode: str = "auto",
                   temperature: float = 1.0, pad_id: int = 0, dense_mask: bool = False) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of every response of every group, for the GRPO loss.

    mode: "packed" (one shared-prompt row per group), "unpacked" (one row per response) or "auto"
    (per group, `packing_pays`). Returns (logp, mask), both (N, T): N responses in group order
    (group 0's first), T the longest response; mask is bool, True on real response tokens, and
    logp is 0 where it is False. Differentiable w.r.t. the model's parameters. dense_mask=True sends
    packed rows through the dense mask even where the structured kernel applies (to compare the two).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    unsupported = packing_unsupported(model) if mode != "unpacked" else None
    if unsupported and mode == "packed":
        raise ValueError(f"cannot pack groups for this model: it uses {unsupported}, which the shared-prompt layout "
                         "does not express (departure 6); use mode='auto' or 'unpacked' (plain rows, exact)")
    packed = [not unsupported and (mode == "packed" or (mode == "auto" and packing_pays(len(p), [len(r) for r in rs])))
              for p, rs in groups]
    if all(packed):
        return _packed_batch(model, groups, temperature, pad_id, dense_mask)
    if not any(packed):
        return _unpacked_batch(model, groups, temperature, pad_id)
    # mixed (auto only): one forward per layout, then responses back in group order
    results = {True: _packed_batch(model, [g for g, p in zip(groups, packed) if p], temperature, pad_id, dense_mask),
               False: _unpacked_batch(model, [g for g, p in zip(groups, packed) if not p], temperature, pad_id)}
    T = max(len(r) for _, rs in groups for r in rs)
    taken = {True: 0, False: 0}  # responses consumed from each result so far
    logps, masks = [], []
    for (_, responses), p in zip(groups, packed):
        logp, mask = results[p]
        rows = slice(taken[p], taken[p] + len(responses))
        pad = T - logp.shape[1]
        logps.append(torch.nn.functional.pad(logp[rows], (0, pad)))  # (G, T)
        masks.append(torch.nn.functional.pad(mask[rows], (0, pad)))  # (G, T)
        taken[p] += len(responses)
    return torch.cat(logps), torch.cat(masks)
