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
R=32, G=8); dense attention grows from G(P+R)^2 to (P+GR)^2, which is why `packing_pays` exists.

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

How a layout reaches a Hugging Face model: `input_ids` (B, L), explicit `position_ids` (B, L) and
a 4D `attention_mask` (B, 1, L, L), which transformers passes to the attention kernel untouched
(`masking_utils._preprocess_mask_arguments`; checked on transformers 5.23). The kernels read it
differently, see departure 2.

Deliberate choices and departures:
1. Dense (B, 1, L, L) mask, built vectorised from segment ids; no block-sparse kernel. Attention
   still spends work on the response x response blocks it then masks out, so packing loses when
   responses are long relative to the prompt: `packing_pays` decides per group, and
   `batch_logprobs(mode="auto")` falls back to plain rows there. The mask itself is small next to
   the activations (bool, B·L^2 bytes: 0.6 MiB at L=768, 9 MiB at L=3072), so it is not cached.
   Tried and dropped: running the prompt as a first, plain causal, KV-cached chunk and the
   responses as a second chunk under rows P.. of the mask. Exact, and it skips the masked blocks
   of the prompt, but it measured no faster on CPU, where the causal kernel saves far less than half.
2. Mask dtype follows the kernel (`to_model_mask`): boolean (True = attend) for `sdpa`, which
   takes it directly; additive float (0 or the dtype's min) for `eager`, which *adds* the mask to
   the scores, so a boolean mask there would add 1 to allowed scores and 0 to forbidden ones,
   i.e. mask nothing. Other kernels (flash_attention_2, flex) do not take a dense 4D mask: error.
3. Padding tokens attend to themselves only, so no softmax row is empty (no NaN) and no real
   token ever sees them; their outputs are discarded.
4. Only the positions that predict a response token get logits, through `logits_to_keep` as a
   1-D index (the form older transformers take too; newer ones also take 2-D). One index serves
   all rows, so with several rows it is the union of their positions: exact for one group, some
   wasted logits when rows' layouts differ.
5. Log-probs are of `logits / temperature` in float32 (as TRL), so they match the sampling
   distribution. Sliding-window layers (e.g. Mistral) would get this full mask and ignore their
   window: keep L within the window for such models.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

Group = tuple[Tensor, Sequence[Tensor]]  # (prompt_ids (P,), [response_ids (R_i,), ...])
MODES = ("packed", "unpacked", "auto")

# Row length at which a dense-masked row's attention costs as much as all its per-token work
# (projections, MLP), forward + backward: least-squares fit of `packing_pays`'s cost model to the
# `python bench.py shared-prompt` grid (6 layers, hidden 256, CPU; the bench prints its own fit).
# Per-token work grows as hidden^2 and attention per pair as hidden, so bigger models have a larger
# break-even length: this small-model value errs toward not packing, the safe side.
ATTENTION_BREAK_EVEN_LEN = 1600


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
    """The plain layout: one row [prompt | r_i] per response, right-padded, ordinary positions."""
    ids, segments, sources = [], [], []
    for prompt, responses in groups:
        _check_group(prompt, responses)
        P = len(prompt)
        for r in responses:
            ids.append(torch.cat([prompt, r]))
            segments.append(torch.cat([torch.zeros(P, dtype=torch.long), torch.ones(len(r), dtype=torch.long)]))
            sources.append(torch.arange(P - 1, P - 1 + len(r)))  # r[t] is predicted at column P-1+t
    responses = [r for _, rs in groups for r in rs]
    device = ids[0].device
    input_ids = pad_sequence(ids, batch_first=True, padding_value=pad_id)  # (N, L)
    return Layout(
        input_ids=input_ids,
        position_ids=torch.arange(input_ids.shape[1], device=device).expand_as(input_ids),  # (N, L)
        segment_ids=pad_sequence(segments, batch_first=True, padding_value=-1).to(device),  # (N, L)
        row=torch.arange(len(responses), device=device),                                    # (N,)
        source=pad_sequence(sources, batch_first=True).to(device),                          # (N, T)
        target=pad_sequence(responses, batch_first=True, padding_value=pad_id),             # (N, T)
        mask=_lengths_mask([len(r) for r in responses], device),                            # (N, T)
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


# --- logits -> log-probs ---

def unpack(logits: Tensor, kept: Tensor, layout: Layout, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Logits at the `kept` columns -> (logp, mask), both (N, T); logp is 0 where mask is False.

    logp[n, t] = log_softmax(logits[row n, column source[n, t]] / temperature)[target[n, t]]
    """
    column = torch.searchsorted(kept, layout.source).clamp(max=len(kept) - 1)  # (N, T) index into kept
    logp_all = (logits.float() / temperature).log_softmax(dim=-1)             # (B, K, V) float32
    logp = logp_all[layout.row[:, None], column, layout.target]                # (N, T)
    return logp.masked_fill(~layout.mask, 0.0), layout.mask


def _forward(model: torch.nn.Module, layout: Layout, attention_mask: Tensor,
             temperature: float) -> tuple[Tensor, Tensor]:
    kept = layout.source[layout.mask].unique()  # (K,) sorted columns whose logits are needed, any row
    logits = model(input_ids=layout.input_ids, attention_mask=attention_mask,
                   position_ids=layout.position_ids, logits_to_keep=kept).logits  # (B, K, V)
    return unpack(logits, kept, layout, temperature)


def _packed_batch(model: torch.nn.Module, groups: Sequence[Group], temperature: float = 1.0,
                 pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """(logp, mask), (N, T), with one shared-prompt row per group, in one forward."""
    layout = pack(groups, pad_id)
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
    """Predicted time of one packed row over that of G plain rows (forward + backward).

    Cost in units of one token's per-token work, for L = P + Σ R_i and L_u = P + max R_i:

        packed   = L + L^2 / break_even_len                 dense mask: all L^2 pairs computed
        unpacked = G · (L_u + L_u^2 / (2 · break_even_len))  plain rows are padded to the longest
                                                            response; causal kernels skip the
                                                            upper triangle a dense mask cannot
    Packing saves (G-1)·P tokens of prompt work but pays attention over every response x response
    block, so it wins for long prompts and short responses and loses for short prompts and long
    responses (P=32, R=256, G=8: predicted 1.9x slower, measured 1.6-2.4x on CPU). The balance of
    the two terms depends on the model and the kernel, so the one constant is fitted, not derived:
    `bench.py shared-prompt` prints the fit for the machine it runs on. Plain rows of unequal
    length carry a padding mask and lose the causal skip, so the model then underrates unpacked
    cost, which errs toward the simple path; so do ties.

    >>> round(packing_cost_ratio(512, [32] * 8), 2), round(packing_cost_ratio(32, [256] * 8), 2)
    (0.22, 1.9)
    """
    L = prompt_len + sum(response_lens)
    L_u = prompt_len + max(response_lens)
    packed = L + L * L / break_even_len
    unpacked = len(response_lens) * (L_u + L_u * L_u / (2 * break_even_len))
    return packed / unpacked


def packing_pays(prompt_len: int, response_lens: list[int]) -> bool:
    """The auto rule: pack a group when `packing_cost_ratio` predicts it strictly faster."""
    return packing_cost_ratio(prompt_len, response_lens) < 1.0


def batch_logprobs(model: torch.nn.Module, groups: list[tuple[Tensor, list[Tensor]]], mode: str = "auto",
                   temperature: float = 1.0, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of every response of every group, for the GRPO loss.

    mode: "packed" (one shared-prompt row per group), "unpacked" (one row per response) or "auto"
    (per group, `packing_pays`). Returns (logp, mask), both (N, T): N responses in group order
    (group 0's first), T the longest response; mask is bool, True on real response tokens, and
    logp is 0 where it is False. Differentiable w.r.t. the model's parameters.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    packed = [mode == "packed" or (mode == "auto" and packing_pays(len(p), [len(r) for r in rs]))
              for p, rs in groups]
    if all(packed):
        return _packed_batch(model, groups, temperature, pad_id)
    if not any(packed):
        return _unpacked_batch(model, groups, temperature, pad_id)
    # mixed (auto only): one forward per layout, then responses back in group order
    results = {True: _packed_batch(model, [g for g, p in zip(groups, packed) if p], temperature, pad_id),
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
