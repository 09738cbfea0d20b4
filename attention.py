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
R=32, G=8); attention less: P^2/2 + Σ R_i(P + R_i/2) allowed pairs of the (P+GR)^2, against G(P+R)^2/2
unpacked, so short prompts with long responses gain little or lose (packing.py decides per group).
The worked example (P=3, responses of 2 and 1 tokens) is in `pack` and `shared_prompt_mask`. Several
groups are several right-padded rows (segment id -1 on padding).

A Hugging Face model reads a layout as `input_ids` (B, L), explicit `position_ids` (B, L), so rotary
embeddings are right, and the dense mask as a 4D `attention_mask` (B, 1, L, L), which transformers
passes to the kernel untouched (`packed_batch_logprobs`; this file imports only torch). packing.py
adds a CPU kernel that never builds the mask, and the choice per group (`packing.batch_logprobs`).

Deliberate choices and departures:
1. The dense mask's dtype follows the kernel (`to_model_mask`): boolean (True = attend) for `sdpa`;
   additive float (0 or the dtype's min) for `eager`, which adds the mask to the scores, so a boolean
   one would mask nothing. Other kernels (flash_attention_2, flex) take neither: error.
2. Padding never reaches a real token: under the dense mask a pad token attends only to itself,
   so no softmax row is empty (no NaN). Pad outputs are discarded.
3. Only the hidden states that predict a response token reach the output layer, gathered per
   token, and their log-probs are taken block by block (rows x vocabulary columns) with an online
   logsumexp and a hand-written backward that recomputes each block (`token_logprobs`, `HeadLogprobs`):
   no (tokens x vocab) tensor ever exists, and backward keeps only h, the targets and logsumexp.
   Models whose logits are not plain lm_head(h) (soft-capping, logit scales: `LOGIT_TRANSFORMS`)
   take the model's own logits instead (`logits_to_keep`).
4. Log-probs are of `logits / temperature` in float32 (as TRL), so they match the sampling distribution.
5. `pad_to_multiple_of` (TRL's) rounds L up: padding is masked as above, so the log-probs are the unpadded
   rows' up to rounding, and a run sends few distinct shapes (cuDNN plans attention per shape).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
import torch.utils.checkpoint

Group = tuple[Tensor, Sequence[Tensor]]  # (prompt_ids (P,), [response_ids (R_i,), ...])


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

def pack(groups: Sequence[Group], pad_id: int = 0, pad_to_multiple_of: int = 1) -> Layout:
    """One row per group: [prompt | r_1 | ... | r_G], positions restarting at P on each response; rows padded to
    the longest, rounded up to a multiple of `pad_to_multiple_of` (departure 5).

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
        input_ids=padded_rows(ids, pad_id, pad_to_multiple_of),                         # (B, L)
        position_ids=padded_rows(positions, 0, pad_to_multiple_of).to(device),          # (B, L)
        segment_ids=padded_rows(segments, -1, pad_to_multiple_of).to(device),           # (B, L)
        row=torch.tensor(row, device=device),                                           # (N,)
        source=pad_sequence(sources, batch_first=True).to(device),                      # (N, T)
        target=pad_sequence(responses, batch_first=True, padding_value=pad_id),         # (N, T)
        mask=_lengths_mask([len(r) for r in responses], device),                        # (N, T)
    )


def unpacked_layout(groups: Sequence[Group], pad_id: int = 0, pad_to_multiple_of: int = 1) -> Layout:
    """The plain layout: one row [prompt | r_i] per response, right-padded (to a multiple of `pad_to_multiple_of`,
    departure 5), ordinary positions.

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
    L, T = round_up(int((P + R).max()), pad_to_multiple_of), int(R.max())
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
        position_ids=torch.where(col < (P + R)[:, None], col, 0),               # (N, L) 0 on padding
        segment_ids=torch.where(col < P[:, None], 0, torch.where(col < (P + R)[:, None], 1, -1)),  # (N, L)
        row=torch.arange(len(R), device=device),                                # (N,)
        source=torch.where(mask, P[:, None] - 1 + t, 0),                        # (N, T) r[t] <- column P-1+t
        target=input_ids.new_full((len(R), T), pad_id).masked_scatter(mask, torch.cat(responses)),  # (N, T)
        mask=mask,                                                              # (N, T)
    )


def round_up(length: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `length`."""
    return -(-length // multiple) * multiple


def padded_rows(rows: Sequence[Tensor], value: int, pad_to_multiple_of: int = 1) -> Tensor:
    """(B, L): the rows right-padded with `value` to the longest, rounded up to a multiple of pad_to_multiple_of."""
    padded = pad_sequence(list(rows), batch_first=True, padding_value=value)                     # (B, L_0)
    extra = round_up(padded.shape[1], pad_to_multiple_of) - padded.shape[1]
    return torch.nn.functional.pad(padded, (0, extra), value=value)                              # (B, L)


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
    padding (segment -1) sees only itself. The row [p0 p1 p2 | a0 a1 | b0] (`pack`'s example):

    >>> shared_prompt_mask(torch.tensor([[0, 0, 0, 1, 1, 2]]))[0, 0].int()  # row = query, column = key
    tensor([[1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 0, 0, 1]], dtype=torch.int32)

    a0 and b0 are both predicted by the logits at p2 (the next-token shift at the boundary), a1 by those
    at a0; a1's logits predict nothing and are never computed.
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
    """Boolean mask -> what the model's attention kernel expects (departure 1 in the docstring).

    sdpa: the boolean mask itself (True = attend). eager: additive, 0 where allowed and the dtype's
    most negative value elsewhere (not -inf, so a fully masked row could never make NaN).
    """
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)  # (B, 1, L, L)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"shared-prompt masks need attn_implementation 'sdpa' or 'eager', got {attn_implementation!r}")


# --- hidden states -> log-probs ---

LOGITS_CHUNK_BYTES = 256 * 2**20  # logits alive at once on CPU, counting ~16 bytes per logit (see token_logprobs)
DEVICE_MEMORY_SHARE = 64  # on an accelerator: 1/64 of its memory, between 1 and 8 times the CPU's (`chunk_bytes_for`)
VOCAB_CHUNK = 32768  # vocabulary columns per chunk (Qwen's 151,936 in five)
# Config fields of models whose logits are not plain `lm_head(last_hidden_state)` (Gemma 2/3 soft-capping,
# Cohere's and Granite's scales): those take their logits from the model's own forward (`layout_logprobs`).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_logprobs(hidden: Tensor, head: torch.nn.Module, targets: Tensor, temperature: float = 1.0,
                   chunk_bytes: int | None = None, entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(head(h) / temperature)[target] for each row h of `hidden`, in float32: (M, H) -> (M,).

    `head` is the model's output layer, an nn.Linear (z = h Wᵀ + b, bias optional; W may be tied to the
    embeddings: its gradient adds to theirs), or nn.Identity() when `hidden` already holds logits. The (M, V)
    logits never exist: `HeadLogprobs` takes them in blocks of VOCAB_CHUNK columns by chunk_bytes / (16 · columns)
    rows (~16 bytes a logit: the compute dtype's, a float32 copy, its exponentials), with an online logsumexp, and
    recomputes them block by block in backward. The products run in the autocast dtype when autocast is on (as
    head(h) would), everything after them in float32.

    entropy=True also returns each row's entropy H = logsumexp(z) - Σ softmax(z)·z of z = logits / T, (M,),
    float32, without gradient (the metric TRL logs), summed in the same pass as the logsumexp.
    """
    if isinstance(head, torch.nn.Identity):
        weight, bias = None, None
    elif isinstance(head, torch.nn.Linear):
        weight, bias = head.weight, head.bias
    else:  # another output layer (an adapter's wrapper): its logits per chunk of rows, recomputed in backward
        vocab = getattr(head, "out_features", None)
        if vocab is None:
            with torch.no_grad():
                vocab = head(hidden[:1]).shape[-1]  # one row's logits: V
        rows = max(1, (chunk_bytes or logits_chunk_bytes(hidden.device)) // (16 * vocab))
        pieces = [torch.utils.checkpoint.checkpoint(lambda h, t: token_logprobs(head(h), torch.nn.Identity(), t,
                                                                                temperature, chunk_bytes, entropy),
                                                    hidden[i:i + rows], targets[i:i + rows], use_reentrant=False)
                  for i in range(0, len(hidden), rows)]
        return tuple(torch.cat(p) for p in zip(*pieces)) if entropy else torch.cat(pieces)
    vocab = hidden.shape[-1] if weight is None else weight.shape[0]
    columns = min(vocab, VOCAB_CHUNK)
    rows = max(1, (chunk_bytes or logits_chunk_bytes(hidden.device)) // (16 * columns))
    device = hidden.device.type
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else hidden.dtype if weight is None else torch.promote_types(hidden.dtype, weight.dtype))
    logp, measured = HeadLogprobs.apply(hidden, weight, bias, targets, temperature, dtype, rows, columns, entropy)
    return (logp, measured) if entropy else logp  # (M,), (M,)


def chunk_bytes_for(device_memory: int | None) -> int:
    """Bytes of logits alive at once, from the device's whole memory (None: a CPU, LOGITS_CHUNK_BYTES): 1/64 of it,
    at least LOGITS_CHUNK_BYTES and at most 8 times that. Bigger blocks mean fewer, bigger kernels, which a GPU
    needs to be busy; they stay a small share of the memory the activations need.

    >>> [chunk_bytes_for(m) // 2**20 for m in (None, 16 * 2**30, 80 * 2**30, 141 * 10**9)]  # CPU, 16 GB, A100, H200
    [256, 256, 1280, 2048]
    """
    if device_memory is None:
        return LOGITS_CHUNK_BYTES
    return min(max(device_memory // DEVICE_MEMORY_SHARE, LOGITS_CHUNK_BYTES), 8 * LOGITS_CHUNK_BYTES)


def logits_chunk_bytes(device: torch.device) -> int:
    """`chunk_bytes_for` the device's total memory (CUDA, an NPU, XPU: their get_device_properties), not its free
    memory: the blocks change the order of float sums, so every forward of a run (the policy's, the reference's at
    θ_0, where KL must be 0 exactly) must block alike whatever else the device holds at that moment."""
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    properties = getattr(backend, "get_device_properties", None)
    return chunk_bytes_for(getattr(properties(device), "total_memory", None) if properties else None)


def _logits(h: Tensor, weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype, temperature: float) -> Tensor:
    """z = (h Wᵀ + b) / T in float32 (at least), the product in `dtype`; h itself when there is no W: (n, V')."""
    z = h if weight is None else torch.nn.functional.linear(
        h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))  # (n, V')
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z / temperature if temperature != 1.0 else z


class HeadLogprobs(torch.autograd.Function):
    """log p_t = z_t - logsumexp(z) of z = (h Wᵀ + b) / T, block by block; saves h, the targets and logsumexp(z).

    Forward: per block of columns, m' = max(m, max z), s' = s·e^(m-m') + Σ e^(z-m') (and for the entropy
    u' = u·e^(m-m') + Σ e^(z-m')·z), so logsumexp z = m + log s and H = logsumexp z - u/s.
    Backward, with g = ∂L/∂log p_t and p = softmax(z) recomputed per block as e^(z - logsumexp z):
        ∂L/∂z_j = g·(1[j = t] - p_j),   z = (h Wᵀ + b)/T   =>
        ∂L/∂h = (g/T)·(W_t - Σ_j p_j W_j),   ∂L/∂W_j = Σ_rows (g/T)·(1[j = t] - p_j)·h,   ∂L/∂b_j = Σ_rows the same
    (without W, z = h/T: ∂L/∂h_j = (g/T)·(1[j = t] - p_j)). The products again in the forward's dtype, the sums
    over blocks in float32 (in place, addmm_, where the product's dtype is the sum's). ∂L/∂W, the one (V, H) tensor,
    is allocated once, in the weight's dtype, and each block of its columns summed over all rows before the next:
    straight into it for float32 weights, or in a float32 (V', H) block cast into it once for bf16 ones.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, dtype, rows, columns, entropy):
        M, V = len(hidden), hidden.shape[-1] if weight is None else weight.shape[0]
        sums = dict(device=hidden.device, dtype=torch.promote_types(dtype, torch.float32))  # float32, or float64
        peak = torch.full((M,), -torch.inf, **sums)   # (M,) m, the running max
        total = torch.zeros(M, **sums)                # (M,) s = Σ e^(z - m)
        moment = torch.zeros(M, **sums)               # (M,) u = Σ e^(z - m)·z
        picked = torch.zeros(M, **sums)               # (M,) z_t
        for v in range(0, V, columns):
            w = None if weight is None else weight[v:v + columns].to(dtype)   # (V', H) cast once per block
            b = None if bias is None else bias[v:v + columns]
            for r in range(0, M, rows):
                h = hidden[r:r + rows] if weight is not None else hidden[r:r + rows, v:v + columns]
                z = _logits(h, w, b, dtype, temperature)                       # (n, V')
                t = targets[r:r + rows] - v                                    # (n,) target's column in the block
                inside = (t >= 0) & (t < z.shape[1])
                picked[r:r + rows] += torch.where(inside, z.gather(1, t.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0)
                new_peak = torch.maximum(peak[r:r + rows], z.amax(dim=1))     # (n,)
                decay = (peak[r:r + rows] - new_peak).exp()                    # (n,) e^(m - m'); e^-inf = 0
                e = (z - new_peak[:, None]).exp_()                             # (n, V')
                total[r:r + rows] = total[r:r + rows] * decay + e.sum(dim=1)
                if entropy:
                    moment[r:r + rows] = moment[r:r + rows] * decay + torch.linalg.vecdot(e, z)
                peak[r:r + rows] = new_peak
        log_normalizer = peak + total.log()                                    # (M,) logsumexp z
        ctx.save_for_backward(hidden, weight, bias, targets, log_normalizer)
        ctx.options = temperature, dtype, rows, columns
        measured = log_normalizer - moment / total if entropy else None        # (M,) H
        if measured is not None:
            ctx.mark_non_differentiable(measured)
        return picked - log_normalizer, measured                               # (M,), (M,)

    @staticmethod
    def backward(ctx, grad, _):
        hidden, weight, bias, targets, log_normalizer = ctx.saved_tensors
        temperature, dtype, rows, columns = ctx.options
        M, V = len(hidden), hidden.shape[-1] if weight is None else weight.shape[0]
        sums = dict(device=hidden.device, dtype=log_normalizer.dtype)          # float32, or float64
        scaled = grad.to(sums["dtype"]) / temperature                          # (M,) g/T
        grad_h = torch.zeros(hidden.shape, **sums) if ctx.needs_input_grad[0] else None  # (M, H)
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None           # (V, H) the weight's dtype
        in_place = grad_w is not None and grad_w.dtype == sums["dtype"]  # float32 weights: sums straight into grad_w
        grad_b = torch.zeros(bias.shape, **sums) if ctx.needs_input_grad[2] else None    # (V,)
        for v in range(0, V, columns):
            w = None if weight is None else weight[v:v + columns].to(dtype)   # (V', H)
            b = None if bias is None else bias[v:v + columns]
            block_w = None if grad_w is None else grad_w[v:v + columns].zero_() if in_place else torch.zeros(
                grad_w[v:v + columns].shape, **sums)                           # (V', H) float32 sums over all rows
            for r in range(0, M, rows):
                h = hidden[r:r + rows] if weight is not None else hidden[r:r + rows, v:v + columns]
                z = _logits(h, w, b, dtype, temperature)                       # (n, V')
                g = scaled[r:r + rows]                                         # (n,)
                dz = (z - log_normalizer[r:r + rows, None]).exp_().mul_(-g[:, None])  # (n, V') -(g/T)·p
                t = targets[r:r + rows] - v                                    # (n,) target's column in the block
                inside = (t >= 0) & (t < z.shape[1])                           # (no host sync: no nonzero())
                hit = torch.where(inside, g, 0)[:, None]                       # (n, 1) + (g/T)·1[j = t]
                dz.scatter_add_(1, t.clamp(0, z.shape[1] - 1)[:, None], hit)
                if weight is None:
                    if grad_h is not None:
                        grad_h[r:r + rows, v:v + columns] = dz
                    continue
                if grad_h is not None:
                    _add_product(grad_h[r:r + rows], dz.to(dtype), w)          # (n, H)
                if block_w is not None:
                    _add_product(block_w, dz.to(dtype).T, h.to(dtype))        # (V', H)
                if grad_b is not None:
                    grad_b[v:v + columns] += dz.sum(dim=0)                     # (V',)
            if block_w is not None and not in_place:
                grad_w[v:v + columns] = block_w                                # (V', H) rounded once
        return (None if grad_h is None else grad_h.to(hidden.dtype), grad_w,
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None)


def _add_product(total: Tensor, a: Tensor, b: Tensor) -> None:
    """total += a @ b, in place (addmm_: no product tensor) when the product's dtype is the sum's, else through it."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total += a @ b


def _scatter(values: Tensor, mask: Tensor) -> Tensor:
    """(M,) values of the True entries of an (N, T) mask -> (N, T), 0 elsewhere (differentiable)."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def layout_logprobs(model: torch.nn.Module, layout: Layout, attention_mask: Tensor | None,
                    temperature: float, entropy: bool = False, **attention_kwargs) -> tuple[Tensor, ...]:
    """(logp, mask), (N, T): logp[n, t] = log_softmax(logits[row n, column source[n, t]] / T)[target[n, t]];
    entropy=True: (logp, mask, H), H (N, T) the entropy of that distribution, without gradient (0 off the mask)."""
    inputs = dict(input_ids=layout.input_ids, attention_mask=attention_mask, position_ids=layout.position_ids,
                  use_cache=False, **attention_kwargs)
    targets = layout.target[layout.mask]  # (M,) the real response tokens
    rows = layout.row[:, None].expand_as(layout.source)[layout.mask]  # (M,) row of each
    if any(getattr(text_config(model), name, None) is not None for name in LOGIT_TRANSFORMS):
        kept = layout.source[layout.mask].unique()  # (K,) sorted columns whose logits are needed, any row
        logits = model(**inputs, logits_to_keep=kept).logits  # (B, K, V) the model's own output layer
        columns = torch.searchsorted(kept, layout.source[layout.mask])  # (M,) index into kept
        scored = token_logprobs(logits[rows, columns], torch.nn.Identity(), targets, temperature, entropy=entropy)
    else:
        hidden = model.get_decoder()(**inputs).last_hidden_state  # (B, L, H)
        states = hidden[rows, layout.source[layout.mask]]  # (M, H) the states that predict the tokens
        scored = token_logprobs(states, model.get_output_embeddings(), targets, temperature, entropy=entropy)
    if entropy:
        logp, h = scored  # (M,), (M,)
        return _scatter(logp, layout.mask), layout.mask, _scatter(h, layout.mask)
    return _scatter(scored, layout.mask), layout.mask


def text_config(model: torch.nn.Module):
    """The language model's config (multimodal wrappers keep it in `text_config`)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# --- entry points ---

def packed_batch_logprobs(model: torch.nn.Module, groups: Sequence[Group], temperature: float = 1.0,
                          pad_id: int = 0, entropy: bool = False, pad_to_multiple_of: int = 1) -> tuple[Tensor, ...]:
    """(logp, mask), (N, T), with one shared-prompt row per group, in one forward, under the dense mask.

    Any sdpa or eager model; `packing.batch_logprobs` sends sdpa models on CPU through its structured kernel instead,
    unless their rows are short (`packing.structured_pays`).
    """
    layout = pack(groups, pad_id, pad_to_multiple_of)
    allowed = shared_prompt_mask(layout.segment_ids)  # (B, 1, L, L)
    attention_mask = to_model_mask(allowed, model.dtype, model.config._attn_implementation)
    return layout_logprobs(model, layout, attention_mask, temperature, entropy)


def unpacked_batch_logprobs(model: torch.nn.Module, groups: Sequence[Group], temperature: float = 1.0,
                            pad_id: int = 0, entropy: bool = False, pad_to_multiple_of: int = 1
                            ) -> tuple[Tensor, ...]:
    """(logp, mask), (N, T), with one plain row per response and a 2D padding mask, in one forward (entropy=True:
    and H, as `layout_logprobs`)."""
    layout = unpacked_layout(groups, pad_id, pad_to_multiple_of)
    attention_mask = (layout.segment_ids >= 0).long()  # (N, L) 1 = real token
    return layout_logprobs(model, layout, attention_mask, temperature, entropy)


def shared_prompt_logprobs(model: torch.nn.Module, prompt_ids: Tensor, responses: list[Tensor],
                           temperature: float = 1.0) -> list[Tensor]:
    """Per-token log-probs of each response to one prompt, all G in one packed row (dense mask).

    Returns one 1-D tensor per response, as long as the response; differentiable.
    """
    logp, _ = packed_batch_logprobs(model, [(prompt_ids, responses)], temperature)  # (G, T)
    return [logp[i, :len(r)] for i, r in enumerate(responses)]


def unpacked_logprobs(model: torch.nn.Module, prompt_ids: Tensor, responses: list[Tensor],
                      temperature: float = 1.0) -> list[Tensor]:
    """The reference: same result as `shared_prompt_logprobs`, one padded row [prompt | r_i] each."""
    logp, _ = unpacked_batch_logprobs(model, [(prompt_ids, responses)], temperature)  # (G, T)
    return [logp[i, :len(r)] for i, r in enumerate(responses)]

