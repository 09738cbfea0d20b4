"""packing.py: the structured kernel equals SDPA under the dense mask, packed = unpacked through `batch_logprobs`
(log-probs and gradients), auto picks per group, and models packing cannot express stay on plain rows."""
import copy

import pytest
import torch
from test_attention import ARCHS, VOCAB, random_group, tiny_model
from transformers import Qwen2Config, Qwen2ForCausalLM

import attention
import packing
from attention import pack, shared_prompt_mask
from packing import batch_logprobs, packed_rows, packing_pays, shared_prompt_attention

CASES = {  # name -> [(prompt_len, response_lens), ...], one entry per group in the micro-batch
    "one_response": [(7, [5])],
    "one_token_prompt": [(1, [3, 2])],
    "group_varied_lengths": [(9, [4, 1, 7, 3])],
    "several_groups_padded": [(5, [3, 6]), (11, [2, 2, 4]), (3, [1])],
}


def grpo_like_grads(model: torch.nn.Module, groups, advantages: torch.Tensor, mode: str, temperature: float):
    logp, mask = batch_logprobs(model, groups, mode=mode, temperature=temperature)  # (N, T)
    loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
    return logp, mask, torch.autograd.grad(loss, list(model.parameters()))


# --- structured kernel ---

def test_packed_rows_locate_segments():
    """packed_rows gives each row's prompt length, real length, response columns (clamped past a response's end)."""
    layout = pack([(torch.tensor([1, 2]), [torch.tensor([3]), torch.tensor([4, 5, 6])]),
                   (torch.tensor([7]), [torch.tensor([8])])])
    first, second = packed_rows(layout)
    assert (first.prompt_len, first.length, second.prompt_len, second.length) == (2, 6, 1, 2)
    assert first.response_columns.tolist() == [[2, 2, 2], [3, 4, 5]]
    assert first.response_kept.tolist() == [0, 3, 4, 5]
    assert second.response_columns.tolist() == [[1]] and second.response_kept.tolist() == [0]


def test_structured_kernel_equals_masked_sdpa():
    """shared_prompt_attention = SDPA under the dense shared-prompt mask, on every real token (GQA, padded rows)."""
    generator = torch.Generator().manual_seed(6)
    groups = [random_group(P, lens, generator) for P, lens in [(5, [3, 6, 1]), (2, [4]), (9, [2, 2])]]
    layout = pack(groups)
    B, L = layout.input_ids.shape
    H, H_kv, D = 4, 2, 8
    query = torch.randn(B, H, L, D, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(B, H_kv, L, D, generator=generator, dtype=torch.float64) for _ in range(2))
    got, _ = shared_prompt_attention(None, query, key, value, None, scaling=0.3, shared_prompt_rows=packed_rows(layout))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1),
        attn_mask=shared_prompt_mask(layout.segment_ids), scale=0.3).transpose(1, 2)  # (B, L, H, D)
    real = layout.segment_ids >= 0
    assert got.shape == (B, L, H, D)
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-12)
    assert (got[~real] == 0).all()


def test_sdpa_models_use_the_structured_kernel_and_get_their_own_back(monkeypatch):
    """Packing an sdpa model runs shared_prompt_attention in every layer, then restores the model's kernel."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["shared_prompt_rows"])
        return shared_prompt_attention(*args, **kwargs)

    monkeypatch.setattr(packing, "shared_prompt_attention", spy)
    model = tiny_model("llama", "sdpa")
    prompt, responses = random_group(4, [2, 3], torch.Generator().manual_seed(7))
    batch_logprobs(model, [(prompt, responses)], mode="packed")
    assert len(calls) == model.config.num_hidden_layers
    assert model.config._attn_implementation == "sdpa"
    batch_logprobs(model, [(prompt, responses)], mode="unpacked")
    assert len(calls) == model.config.num_hidden_layers  # plain rows keep the model's own kernel


def test_activation_checkpointing_falls_back_to_the_dense_mask(monkeypatch):
    """Checkpointing re-runs attention in backward, after the kernel switch: packing must then use the dense mask."""
    monkeypatch.setattr(packing, "shared_prompt_attention", None)  # would fail if called
    model = Qwen2ForCausalLM._from_config(tiny_model("qwen2", "sdpa").config, attn_implementation="sdpa")
    model.load_state_dict(tiny_model("qwen2", "sdpa").state_dict())
    packing.enable_activation_checkpointing(model)
    model.train()
    generator = torch.Generator().manual_seed(8)
    groups = [random_group(5, [3, 4], generator)]
    advantages = torch.randn(2, generator=generator)
    logp_p, _, grads_p = grpo_like_grads(model, groups, advantages, "packed", 1.0)
    logp_u, _, grads_u = grpo_like_grads(model, groups, advantages, "unpacked", 1.0)
    torch.testing.assert_close(logp_p, logp_u, rtol=0, atol=1e-5)
    for g_p, g_u in zip(grads_p, grads_u):
        assert (g_p - g_u).norm() <= 1e-5 * g_u.norm() + 1e-9


def test_dense_mask_switch_skips_the_structured_kernel_with_the_same_result(monkeypatch):
    """dense_mask=True (bench.py --mask dense) packs an sdpa model through the dense mask: same log-probs."""
    model = tiny_model("qwen2", "sdpa")
    groups = [random_group(6, [3, 5, 2], torch.Generator().manual_seed(9))]
    structured, mask = batch_logprobs(model, groups, mode="packed")
    monkeypatch.setattr(packing, "shared_prompt_attention", None)  # would fail if called
    dense, _ = batch_logprobs(model, groups, mode="packed", dense_mask=True)
    torch.testing.assert_close(dense[mask], structured[mask], rtol=0, atol=1e-5)


def test_structured_kernel_only_for_sdpa_models_on_cpu():
    """The structured kernel is a Python loop over rows: CPU sdpa models only; eager models, dense_mask=True and
    models on any other device (here `meta`, standing in for a GPU or NPU) take the dense mask (departure 5)."""
    model = tiny_model("qwen2", "sdpa")
    assert packing.structured_kernel(model)
    assert not packing.structured_kernel(model, dense_mask=True)
    assert not packing.structured_kernel(tiny_model("qwen2", "eager"))
    with torch.device("meta"):
        elsewhere = Qwen2ForCausalLM._from_config(model.config, attn_implementation="sdpa")
    assert not packing.structured_kernel(elsewhere)


# --- equivalence ---

@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_unpacked_logprobs_and_gradients(arch, attn_implementation, case):
    """Packed = unpacked: per-token log-probs (<= 1e-5 abs), GRPO-loss gradients of every parameter (<= 1e-5 rel).

    sdpa models pack through the structured kernel, eager ones through the dense mask.
    """
    model = tiny_model(arch, attn_implementation)
    generator = torch.Generator().manual_seed(len(case))
    groups = [random_group(P, lens, generator) for P, lens in CASES[case]]
    advantages = torch.randn(sum(len(lens) for _, lens in CASES[case]), generator=generator)  # (N,)
    temperature = 0.9
    logp_p, mask_p, grads_p = grpo_like_grads(model, groups, advantages, "packed", temperature)
    logp_u, mask_u, grads_u = grpo_like_grads(model, groups, advantages, "unpacked", temperature)
    assert mask_p.dtype == torch.bool and torch.equal(mask_p, mask_u)
    assert logp_p.shape == (len(advantages), max(max(lens) for _, lens in CASES[case]))
    assert (logp_p[~mask_p] == 0).all()
    torch.testing.assert_close(logp_p, logp_u, rtol=0, atol=1e-5)
    for (name, _), g_p, g_u in zip(model.named_parameters(), grads_p, grads_u):
        assert (g_p - g_u).norm() <= 1e-5 * g_u.norm() + 1e-9, name


@pytest.mark.parametrize("mode, dense_mask", [("packed", False), ("packed", True), ("unpacked", False)])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_rows_padded_to_a_multiple_give_the_unpadded_logprobs_and_gradients(mode, dense_mask, attn_implementation):
    """Claim (--pad-to-multiple-of, attention.py departure 5): rows padded to a multiple of 16 give the log-probs and
    the GRPO-loss gradients of rows padded only to the longest, in every layout (the structured kernel, the dense
    mask, plain rows), and their length is that multiple. Teeth: the padded rows are longer (packed 19 -> 32, plain 15 -> 16).

    In float64: padding keys are masked (weight exactly 0 under the boolean mask; exp(min - max) underflows to 0
    under the additive one), so a real token's sums hold the same nonzero terms and only the kernels' blocking
    over the longer rows may reorder them: relative error ~ 1e-16 per sum of at most 32 terms, below 1e-12 after
    the few layers here. Eager attention is the exception: transformers takes its softmax in float32
    (eager_attention_forward), whose sums over at most 32 keys, reordered, differ by up to 32 · 2^-24 ≈ 2e-6
    relative; 1e-5 there. (Right padding sits after every real token, so causality alone hides it; what the test
    guards is the padded layout itself: a token, position or segment moved would be off by far more.)"""
    model = copy.deepcopy(tiny_model("qwen2", attn_implementation)).double()
    generator = torch.Generator().manual_seed(3)
    groups = [random_group(P, lens, generator) for P, lens in [(5, [3, 6]), (11, [2, 2, 4]), (3, [1])]]
    advantages = torch.randn(6, generator=generator, dtype=torch.float64)  # (N,)

    def scored(multiple: int):
        logp, mask = batch_logprobs(model, groups, mode=mode, dense_mask=dense_mask, pad_to_multiple_of=multiple)
        loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
        return logp, torch.autograd.grad(loss, list(model.parameters()))
    layout = pack(groups, 0, 16) if mode == "packed" else attention.unpacked_layout(groups, 0, 16)
    plain = pack(groups) if mode == "packed" else attention.unpacked_layout(groups)
    assert layout.input_ids.shape[1] % 16 == 0 and layout.input_ids.shape[1] > plain.input_ids.shape[1]
    (logp_1, grads_1), (logp_16, grads_16) = scored(1), scored(16)
    tolerance = 1e-12 if attn_implementation == "sdpa" else 1e-5
    torch.testing.assert_close(logp_16, logp_1, rtol=0, atol=tolerance)
    for (name, _), g_16, g_1 in zip(model.named_parameters(), grads_16, grads_1):
        assert (g_16 - g_1).norm() <= tolerance * g_1.norm() + 1e-15, name


def test_auto_mixes_layouts_and_keeps_group_order():
    """auto packs only the groups where packing pays, and still returns every response in group order."""
    generator = torch.Generator().manual_seed(4)
    long_prompt = random_group(120, [3, 2, 3, 1], generator)   # packing pays
    long_responses = random_group(2, [90, 80, 90], generator)  # packing does not
    groups = [long_prompt, long_responses, long_prompt]
    assert [packing_pays(len(p), [len(r) for r in rs]) for p, rs in groups] == [True, False, True]
    model = tiny_model("qwen2", "sdpa")
    advantages = torch.randn(11, generator=generator)
    logp_a, mask_a, grads_a = grpo_like_grads(model, groups, advantages, "auto", 1.0)
    logp_u, mask_u, grads_u = grpo_like_grads(model, groups, advantages, "unpacked", 1.0)
    assert torch.equal(mask_a, mask_u)
    torch.testing.assert_close(logp_a, logp_u, rtol=0, atol=1e-5)
    for g_a, g_u in zip(grads_a, grads_u):
        assert (g_a - g_u).norm() <= 1e-5 * g_u.norm() + 1e-9


def test_batch_logprobs_rejects_unknown_mode():
    """A typo in mode fails loudly instead of silently picking a layout."""
    prompt, responses = random_group(3, [2], torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="mode"):
        batch_logprobs(tiny_model("qwen2", "sdpa"), [(prompt, responses)], mode="shared")


# --- when packing pays ---

def test_packing_pays_long_prompt_short_responses_only():
    """The rule packs long prompts with short responses and refuses short prompts with long responses."""
    assert packing_pays(512, [32] * 8)
    assert packing_pays(1024, [16] * 8)
    assert not packing_pays(32, [256] * 8)
    assert not packing_pays(16, [512] * 4)
    assert not packing_pays(100, [50])  # G = 1: nothing shared, nothing saved


def test_auto_prices_the_layout_the_model_will_take(monkeypatch):
    """batch_logprobs' auto rule uses the dense-mask price where packed rows would take the dense mask: a group that
    packs through the structured kernel (P=64, 8 x 64) goes to plain rows once the model is off CPU."""
    model = tiny_model("qwen2", "sdpa")
    group = random_group(64, [64] * 8, torch.Generator().manual_seed(10))
    packed_calls = []
    real = packing._packed_batch
    monkeypatch.setattr(packing, "_packed_batch",
                        lambda *args, **kwargs: packed_calls.append(1) or real(*args, **kwargs))
    batch_logprobs(model, [group], mode="auto")
    assert packed_calls == [1]  # on CPU: the structured kernel, and packing pays
    monkeypatch.setattr(packing, "structured_kernel", lambda model, dense_mask=False: False)  # as off CPU
    batch_logprobs(model, [group], mode="auto")
    assert packed_calls == [1]  # the dense mask's L^2 pairs: plain rows


def test_auto_takes_the_dense_mask_for_short_rows_on_cpu(monkeypatch):
    """On CPU, auto packs short rows (the toy's: P=8, 8 responses of 5, 16 groups) under the dense mask, where the
    structured kernel's per-row overhead costs more than the pairs it skips (`structured_pays`), with log-probs
    and gradients those of plain rows (<= 1e-5, as every packed layout above: the layouts sum the same float32
    terms in another order, rows of <= 48 tokens padded otherwise, so each value differs by about
    sqrt(48) x 1.2e-7 x its magnitude (<~ 5), ~4e-6; measured 9.5e-7); a long prompt (P=128, 8 x 16) keeps the
    structured kernel; mode "packed" keeps the model's kernel whatever the lengths."""
    model = tiny_model("qwen2", "sdpa")
    generator = torch.Generator().manual_seed(11)
    short = [random_group(8, [5, 4, 5, 3, 5, 5, 2, 5], generator) for _ in range(16)]
    assert not packing.structured_pays([(8, [5] * 8)] * 16) and packing.structured_pays([(128, [16] * 8)])
    calls = []
    monkeypatch.setattr(packing, "shared_prompt_attention",
                        lambda *args, **kwargs: calls.append(1) or shared_prompt_attention(*args, **kwargs))
    packed_calls, real = [], packing._packed_batch
    monkeypatch.setattr(packing, "_packed_batch",
                        lambda *args, **kwargs: packed_calls.append(args[4]) or real(*args, **kwargs))  # structured
    advantages = torch.randn(16 * 8, generator=generator)
    logp_a, _, grads_a = grpo_like_grads(model, short, advantages, "auto", 1.0)
    assert packed_calls == [False] and calls == []  # packed, under the dense mask
    logp_u, _, grads_u = grpo_like_grads(model, short, advantages, "unpacked", 1.0)
    torch.testing.assert_close(logp_a, logp_u, rtol=0, atol=1e-5)
    for g_a, g_u in zip(grads_a, grads_u):
        assert (g_a - g_u).norm() <= 1e-5 * g_u.norm() + 1e-9
    batch_logprobs(model, short, mode="packed")
    assert packed_calls == [False, True] and calls  # "packed": the structured kernel, as before
    calls.clear()
    batch_logprobs(model, [random_group(128, [16] * 8, generator)], mode="auto")
    assert packed_calls == [False, True, True] and calls  # a long prompt: the structured kernel pays


def test_packing_pays_under_the_dense_mask_prices_every_pair():
    """The dense mask's kernels visit all L^2 pairs, so it packs fewer groups than the structured kernel: a
    prompt of 64 with 8 responses of 64 packs structured but not dense; long prompts still pack either way."""
    assert packing_pays(64, [64] * 8) and not packing_pays(64, [64] * 8, dense=True)
    assert packing_pays(450, [128] * 8, dense=True)  # the GPU benchmark's groups (docs/benchmarks.md)
    assert packing_pays(512, [32] * 8, dense=True)
    assert not packing_pays(32, [256] * 8, dense=True)
    assert packing.ATTENTION_BREAK_EVEN_LEN > 0


# --- attention variants packing cannot express ---

def reference_logprobs(model, prompt, responses, temperature):
    """One plain forward of the model per [prompt | r], its own logits (soft-capping and all)."""
    out = []
    for r in responses:
        logits = model(torch.cat([prompt, r])[None]).logits[0, len(prompt) - 1:-1]  # (R, V)
        out.append((logits.float() / temperature).log_softmax(-1).gather(-1, r[:, None])[:, 0])
    return out


def test_attention_the_packed_layout_cannot_express_stays_on_plain_rows():
    """Claim: a model with sliding windows and logit soft-capping (a tiny Gemma 2) is never packed: auto uses plain
    rows and equals the model's own log-probs (including its final-logit soft-capping, taken from its own output
    layer), and mode='packed' refuses with one line that names the feature; the structured kernel itself refuses
    a sliding window; a plain Qwen2 with use_sliding_window is refused too."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    config = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, intermediate_size=64, vocab_size=VOCAB, sliding_window=4)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM._from_config(config, attn_implementation="eager").eval()
    assert packing.packing_unsupported(model) == "sliding-window attention"
    prompt, responses = random_group(6, [3, 5], torch.Generator().manual_seed(12))
    logp, _ = batch_logprobs(model, [(prompt, responses)], mode="auto", temperature=0.8)
    for row, expected in zip(logp, reference_logprobs(model, prompt, responses, 0.8)):
        torch.testing.assert_close(row[:len(expected)], expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="sliding-window attention"):
        batch_logprobs(model, [(prompt, responses)], mode="packed")
    with pytest.raises(ValueError, match="sliding_window"):
        shared_prompt_attention(None, torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), None,
                                shared_prompt_rows=[], sliding_window=4)
    windowed = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=VOCAB, use_sliding_window=True, sliding_window=8,
                           max_window_layers=0)
    assert packing.packing_unsupported(Qwen2ForCausalLM(windowed)) == "sliding-window attention"
    assert packing.packing_unsupported(tiny_model("qwen2", "sdpa")) is None


# --- the entropy measured on the way ---

def plain_entropies(model, prompt, responses, temperature):
    """One plain forward per [prompt | r]: each token's entropy of softmax(logits / T), from the model's own logits."""
    out = []
    for r in responses:
        logits = (model(torch.cat([prompt, r])[None]).logits[0, len(prompt) - 1:-1].float() / temperature)  # (R, V)
        out.append(-(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1))  # (R,)
    return out


@pytest.mark.parametrize("mode", ["packed", "unpacked", "auto"])
def test_entropy_comes_with_the_logprobs_in_every_layout(mode, monkeypatch):
    """Claim: batch_logprobs(entropy=True) returns each token's entropy H of softmax(logits / T) in the log-probs'
    (N, T) layout, 0 off the mask, in every mode, the mixed one (packed and plain groups apart, put back in group
    order) included, with the logits chunked and checkpointed (chunks of 3 rows); and asking for it changes neither
    the log-probs nor the gradients (torch.equal). Against one plain forward per response: <= 1e-5 abs, the
    packed = unpacked log-prob bound (H and log p are taken from the same float32 logits; |dH/dz| <= max z - min z,
    under 1 for this nearly flat random model, so H's error is no larger than the logits' own)."""
    model = tiny_model("qwen2", "sdpa")
    generator = torch.Generator().manual_seed(21)
    groups = [random_group(5, [3, 6, 1], generator), random_group(2, [4], generator), random_group(9, [2, 2], generator)]
    if mode == "auto":  # groups 0 and 2 packed, group 1 on plain rows
        monkeypatch.setattr(packing, "packing_pays", lambda P, lengths, dense=False: P != 2)
    monkeypatch.setattr("attention.LOGITS_CHUNK_BYTES", 3 * 16 * VOCAB)
    logp, mask, entropy = batch_logprobs(model, groups, mode=mode, temperature=0.8, entropy=True)  # (N, T) each
    assert not entropy.requires_grad and (entropy[~mask] == 0).all()
    expected = [h for prompt, responses in groups for h in plain_entropies(model, prompt, responses, 0.8)]
    for row, h in zip(entropy, expected):
        torch.testing.assert_close(row[:len(h)], h, rtol=0, atol=1e-5)
    plain_logp, plain_mask = batch_logprobs(model, groups, mode=mode, temperature=0.8)
    assert torch.equal(logp, plain_logp) and torch.equal(mask, plain_mask)
    with_entropy = torch.autograd.grad(logp.sum(), list(model.parameters()))
    without = torch.autograd.grad(plain_logp.sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(with_entropy, without))


def test_entropy_of_a_model_whose_logits_are_transformed():
    """Claim: a model whose logits are transformed after its output layer (a tiny Gemma 2: final-logit soft-capping)
    is measured from its own logits too (`layout_logprobs` takes them from the model's forward); same bound."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    config = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, intermediate_size=64, vocab_size=VOCAB, sliding_window=4)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM._from_config(config, attn_implementation="eager").eval()
    prompt, responses = random_group(6, [3, 5], torch.Generator().manual_seed(12))
    _, _, entropy = batch_logprobs(model, [(prompt, responses)], mode="auto", temperature=0.8, entropy=True)
    for row, h in zip(entropy, plain_entropies(model, prompt, responses, 0.8)):
        torch.testing.assert_close(row[:len(h)], h, rtol=0, atol=1e-5)
