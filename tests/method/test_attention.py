"""Shared-prompt attention (attention.py): packed rows must give the same log-probs as plain rows."""
from functools import lru_cache

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import attention
from attention import (
    pack,
    shared_prompt_logprobs,
    shared_prompt_mask,
    to_model_mask,
    unpacked_layout,
    unpacked_logprobs,
)

VOCAB, EOS = 100, 2
ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


@lru_cache(maxsize=None)
def tiny_model(arch: str, attn_implementation: str) -> torch.nn.Module:
    config_class, model_class = ARCHS[arch]
    config = config_class(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256)
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    assert model.config._attn_implementation == attn_implementation
    return model.eval()


def random_group(prompt_len: int, response_lens: list[int], generator: torch.Generator):
    """A prompt and responses of the given lengths; every response but the last ends in EOS."""
    prompt = torch.randint(3, VOCAB, (prompt_len,), generator=generator)
    responses = [torch.randint(3, VOCAB, (n,), generator=generator) for n in response_lens]
    for r in responses[:-1]:
        r[-1] = EOS
    return prompt, responses


# --- layout and mask ---

def test_worked_example_ids_positions_mask():
    """pack + shared_prompt_mask produce exactly the P=3, G=2 (lengths 2, 1) example of the docstring."""
    prompt, a, b = torch.tensor([10, 11, 12]), torch.tensor([20, 21]), torch.tensor([30])
    layout = pack([(prompt, [a, b])])
    assert layout.input_ids.tolist() == [[10, 11, 12, 20, 21, 30]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    assert layout.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2]]
    expected = [[1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [1, 1, 1, 1, 0, 0],
                [1, 1, 1, 1, 1, 0],
                [1, 1, 1, 0, 0, 1]]
    assert shared_prompt_mask(layout.segment_ids).int().tolist() == [[expected]]
    assert layout.source.tolist() == [[2, 3], [2, 0]]  # a0 <- p2, a1 <- a0, b0 <- p2
    assert layout.target.tolist() == [[20, 21], [30, 0]]
    assert layout.mask.tolist() == [[True, True], [True, False]]


def test_padding_sees_only_itself_and_is_never_seen():
    """In a padded row, pad queries attend only to themselves (no empty softmax row) and no real token attends a pad."""
    layout = pack([(torch.tensor([5, 6]), [torch.tensor([7, 8, 9])]), (torch.tensor([5]), [torch.tensor([7])])])
    assert layout.segment_ids.tolist() == [[0, 0, 1, 1, 1], [0, 1, -1, -1, -1]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 0, 0]]
    second_row = [[1, 0, 0, 0, 0],
                  [1, 1, 0, 0, 0],
                  [0, 0, 1, 0, 0],
                  [0, 0, 0, 1, 0],
                  [0, 0, 0, 0, 1]]
    assert shared_prompt_mask(layout.segment_ids)[1, 0].int().tolist() == second_row


def test_unpacked_layout_is_plain_rows():
    """The reference layout is one [prompt | r_i] row per response with ordinary positions (0 on padding: a model
    with a table of absolute positions never reads past it, padded to a multiple) and the shift at P-1."""
    layout = unpacked_layout([(torch.tensor([10, 11]), [torch.tensor([20, 21, 22]), torch.tensor([30])])], pad_id=0)
    assert layout.input_ids.tolist() == [[10, 11, 20, 21, 22], [10, 11, 30, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]  # 0 on padding, as pack()
    assert layout.source.tolist() == [[1, 2, 3], [1, 0, 0]]


def test_to_model_mask_per_kernel():
    """sdpa gets the boolean mask (True = attend); eager gets 0 / dtype-min added to scores; other kernels refuse."""
    allowed = shared_prompt_mask(torch.tensor([[0, 0, 1, 2]]))  # (1, 1, 4, 4)
    assert to_model_mask(allowed, torch.float32, "sdpa") is allowed
    additive = to_model_mask(allowed, torch.bfloat16, "eager")
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive == 0, allowed)
    assert (additive[~allowed] == torch.finfo(torch.bfloat16).min).all()
    with pytest.raises(ValueError, match="sdpa"):
        to_model_mask(allowed, torch.float32, "flash_attention_2")


def test_boolean_mask_under_eager_masks_nothing():
    """Why to_model_mask exists: eager adds the mask to the scores, so a boolean mask lets responses see each other."""
    model = tiny_model("qwen2", "eager")
    prompt, responses = random_group(6, [4, 4], torch.Generator().manual_seed(1))
    layout = pack([(prompt, responses)])
    allowed = shared_prompt_mask(layout.segment_ids)
    with torch.no_grad():
        right = model(input_ids=layout.input_ids, attention_mask=to_model_mask(allowed, torch.float32, "eager"),
                      position_ids=layout.position_ids).logits
        naive = model(input_ids=layout.input_ids, attention_mask=allowed, position_ids=layout.position_ids).logits
    assert (right - naive).abs().max() > 1e-3


# --- equivalence ---

def test_unpacked_reference_matches_one_forward_per_response():
    """The reference itself is right: unpacked_logprobs = log_softmax(logits / τ) of [prompt | r_i] alone, shifted."""
    model = tiny_model("qwen2", "sdpa")
    prompt, responses = random_group(5, [3, 6, 1], torch.Generator().manual_seed(2))
    temperature = 0.7
    with torch.no_grad():
        got = unpacked_logprobs(model, prompt, responses, temperature)
        for r, logp in zip(responses, got):
            logits = model(torch.cat([prompt, r])[None]).logits[0]  # (P+R, V)
            expected = (logits[len(prompt) - 1:-1] / temperature).log_softmax(-1).gather(-1, r[:, None])[:, 0]
            torch.testing.assert_close(logp, expected, rtol=0, atol=1e-5)


def test_shared_prompt_logprobs_list_api():
    """shared_prompt_logprobs returns one 1-D tensor per response, as long as it, equal to unpacked_logprobs."""
    model = tiny_model("llama", "sdpa")
    prompt, responses = random_group(8, [2, 5, 3], torch.Generator().manual_seed(3))
    packed = shared_prompt_logprobs(model, prompt, responses, temperature=1.3)
    plain = unpacked_logprobs(model, prompt, responses, temperature=1.3)
    assert [p.shape for p in packed] == [r.shape for r in responses]
    for p, u in zip(packed, plain):
        torch.testing.assert_close(p, u, rtol=0, atol=1e-5)


# --- memory of the output layer ---
@pytest.mark.parametrize("case", ["float32", "float32 bias", "float32 logits", "float32 wrapped head",
                                  "bfloat16 autocast", "bfloat16 autocast bias"])
def test_head_logprobs_equal_the_full_softmax_and_never_keep_all_logits(case, monkeypatch):
    """Claim: attention.token_logprobs (blocks of 7 rows by 64 of the 300 columns, an online logsumexp, the hand-written
    backward) gives log softmax(z)[t] and the entropy of z = (h Wᵀ + b) / T, T = 0.7, and the gradients of h, W and
    b, of the plain whole-logits computation (log_softmax, gather, autograd), with or without a bias, for a Linear
    head, for logits given as they are (nn.Identity) and for another module around the head (its logits per rows'
    chunk, checkpointed), in float32 and under bf16 autocast; and saves no tensor
    of M x V elements for backward.

    Tolerances, derived (u: unit roundoff of the products' dtype, 2^-24 for float32, 2^-8 for bf16; u32 = 2^-24;
    k = 5 column blocks): each logit is the same H-term dot product in another grouping, rounded once to the product
    dtype in each path, so |Δz| ≤ 2u·max|z| + 2H·u32·max Σ|h W|/T = dz; logsumexp sums V + k terms in (0, 1] in
    float32 (≥ 1 in all), |Δ lse| ≤ dz + 2(V + k + 2)·u32·max(1, |lse|); |Δ log p| ≤ dz + |Δ lse| = dl. The entropy
    Σp·z: |Δ| ≤ |Δ lse| + 2·dl·max|z| + dz + 2V·u32·max|z|. Gradients are sums of (g/T)(1[j=t] - p_j)·x with p's
    relative error ≤ 2·dl, each coefficient and each block's product rounded to the product dtype and summed over at
    most V or M float32 terms: elementwise |Δ| ≤ Σ |g/T|(1[j=t] + p_j)|x| · (4·dl + 4(k + 2)·u + 2·max(V, M)·u32)."""
    M, H, V, T, k = 50, 16, 300, 0.7, 5
    monkeypatch.setattr(attention, "VOCAB_CHUNK", 64)
    generator = torch.Generator().manual_seed(11)
    head = torch.nn.Linear(H, V, bias="bias" in case)
    with torch.no_grad():
        head.weight.normal_(0, 0.5, generator=generator)
    linear = head
    if "wrapped" in case:
        head = torch.nn.Sequential(linear)
    if "logits" in case:
        hidden, head, weight = (3 * torch.randn(M, V, generator=generator)).requires_grad_(), torch.nn.Identity(), None
    else:
        hidden, weight = torch.randn(M, H, generator=generator, requires_grad=True), linear.weight
    targets = torch.randint(V, (M,), generator=generator)
    weights = torch.randn(M, generator=generator)  # dL/dlog p
    leaves = [hidden] + [p for p in head.parameters()]
    bf16 = "bfloat16" in case
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        z = head(hidden).float() / T  # (M, V) the plain path
        full = z.log_softmax(-1).gather(-1, targets[:, None])[:, 0]  # (M,)
        full_entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            chunked, entropy = attention.token_logprobs(hidden, head, targets, T, chunk_bytes=16 * 64 * 7, entropy=True)
    grads = [torch.autograd.grad((weights * x).sum(), leaves) for x in (chunked, full)]

    u, u32 = (2.0 ** -8 if bf16 else 2.0 ** -24), 2.0 ** -24
    z64, lse = z.detach().double(), z.detach().double().logsumexp(-1)
    products = 0 if weight is None else (hidden.detach().abs() @ weight.detach().abs().T).max().item() / T
    dz = 2 * u * z64.abs().max().item() + 2 * H * u32 * products
    d_lse = dz + 2 * (V + k + 2) * u32 * max(1.0, lse.abs().max().item())
    dl = dz + d_lse
    d_entropy = d_lse + 2 * dl * z64.abs().max().item() + dz + 2 * V * u32 * z64.abs().max().item()
    assert (chunked - full).abs().max() <= dl and (entropy - full_entropy).abs().max() <= d_entropy
    # Σ |g/T|(1[j=t] + p_j)|x|, x = W_j (∂h), h (∂W), 1 (∂b): the magnitudes each gradient sums
    size = torch.nn.functional.one_hot(targets, V).double() + (z64 - lse[:, None]).exp()  # (M, V)
    size = size * (weights.double().abs()[:, None] / T)
    relative = 4 * dl + 4 * (k + 2) * u + 2 * max(V, M) * u32
    if weight is None:
        bounds = [size * relative]
    else:
        bounds = [size @ weight.detach().double().abs() * relative, size.T @ hidden.detach().double().abs() * relative]
        bounds += [size.sum(0) * relative] if "bias" in case else []
    for ours, plain, bound in zip(*grads, bounds):
        assert ((ours.double() - plain.double()).abs() <= bound).all(), ((ours - plain).abs() - bound).max()
    if weight is not None:
        assert max(saved) <= max(M * H, V * H) < M * V  # h, W, the targets, logsumexp: never (M, V) logits


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_head_weight_gradient_is_its_only_full_size_tensor(weight_dtype, monkeypatch):
    """Claim: the output layer's backward allocates one (V, H) tensor, its weight's gradient in the weight's dtype:
    the live bytes it adds at its peak are the gradient's, plus the float32 sums and the float32 copy of one block of
    columns (bf16 weights only), plus row-block temporaries; never a float32 (V, H) buffer besides (1.5x the weight
    for bf16 weights). And with bf16 weights the gradient is exactly the float32 weights' (the same values) rounded
    once: the sums are the same float32 operations, cast at the end of each block."""
    from benchmarks.memory import LiveTensorBytes
    M, H, V, columns, rows = 40, 64, 4096, 256, 8
    monkeypatch.setattr(attention, "VOCAB_CHUNK", columns)
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(V, H, generator=generator).to(weight_dtype)  # (V, H)
    hidden = torch.randn(M, H, generator=generator)  # (M, H)
    targets = torch.randint(V, (M,), generator=generator)
    grads, peaks = {}, {}
    for dtype in {torch.float32, weight_dtype}:
        head = torch.nn.Linear(H, V, bias=False)
        head.weight = torch.nn.Parameter(values.to(dtype))
        h = hidden.clone().requires_grad_()
        logp = attention.token_logprobs(h, head, targets, 0.7, chunk_bytes=16 * columns * rows)  # (M,)
        with LiveTensorBytes(existing=[h, head.weight, logp]) as live:
            before = live.live
            logp.sum().backward()
            peaks[dtype] = live.peak - before
        grads[dtype] = head.weight.grad
    weight_bytes = V * H * values.element_size()
    block = 2 * columns * H * 4 if weight_dtype != torch.float32 else 0  # its float32 sums and the cast weight block
    assert peaks[weight_dtype] <= weight_bytes + block + 3 * M * H * 4 + 16 * rows * columns * 4
    assert weight_dtype == torch.float32 or peaks[weight_dtype] < V * H * 4 + weight_bytes
    assert grads[weight_dtype].dtype == weight_dtype
    assert torch.equal(grads[weight_dtype], grads[torch.float32].to(weight_dtype))
