"""The rollout engine (engine.py): greedy tokens equal `generate`'s, draws follow the distribution the trainer scores,
and a row's tokens depend on its key alone, never on which prompts share a call or how many rows run at once."""
import contextlib
import math

import pytest
import torch
from conftest import LOGIT_SCALE
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, MistralConfig,
                          Qwen2Config, Qwen3Config)
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import engine
from infra import compiled_step

@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one thread is as fast, and a process busy on the other core cannot stall it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_model(kind: str, vocab: int = 96, dtype: torch.dtype = torch.float32, logit_scale: float = 1.0,
                 seed: int = 0, attention: str = "sdpa", layers: int = 2):
    """A `layers`-layer (2) Qwen2 (tied embeddings), Qwen3 (its query and key norms, untied) or Llama (untied) with
    random weights; logit_scale sharpens its logits.

    Weights 10x the default scale (initializer_range 0.2): at 0.02 the residual stream is nearly the input
    embedding, so a tied model's greedy continuation repeats the last token forever."""
    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "mistral": MistralConfig}[kind]
    window = {"sliding_window": None} if kind == "mistral" else {}  # Mistral v0.2 onwards: full attention
    config = config_class(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, head_dim=16,
                          tie_word_embeddings=kind == "qwen2", initializer_range=0.2, attn_implementation=attention,
                          **window)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(logit_scale)
    return model


def random_prompts(lengths: list[int], vocab: int, low: int = 3, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (length,), generator=generator).tolist() for length in lengths]


def keys(count: int, first: int = 0) -> list[tuple[int, int, int]]:
    """(seed, iteration, prompt index) of prompts first .. first + count - 1, as rollout.py would pass them."""
    return [(7, 3, j) for j in range(first, first + count)]


def cut(tokens: list[int], stops: list[int]) -> list[int]:
    """A `generate` row cut after its first stop id."""
    ends = [position for position, token in enumerate(tokens) if token in stops]
    return tokens[:ends[0] + 1] if ends else tokens


def generate_greedy(model, prompts: list[list[int]], max_new_tokens: int, stops: list[int], pad: int,
                    batched: bool = True):
    """Hugging Face `generate(do_sample=False)` on one left-padded batch, as rollout.py calls it (or prompt by prompt).

    Prompt by prompt for eager attention: there, in float64, transformers' own left-padded batch gives NaN logits
    (finfo.min added to a score overflows to -inf, a pad position's fully masked row turns NaN, and the NaN reaches
    the real rows), so its padded tokens are not its unpadded ones."""
    if not batched:
        return [generate_greedy(model, [prompt], max_new_tokens, stops, pad)[0] for prompt in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])                   # (C, P_max)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])          # (C, P_max)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad)
    shipped, model.generation_config = model.generation_config, GenerationConfig()  # no shipped sampling defaults
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    finally:
        model.generation_config = shipped
    return [cut(row, stops) for row in out[:, width:].tolist()]


def varied_stops(rows: list[list[int]], stops: list[int], max_new_tokens: int) -> list[int]:
    """`stops` and the tokens (in id order) that, added as stop ids, cut `rows` at more distinct lengths while
    leaving some row uncut."""
    def lengths(ids):
        return [len(cut(row, ids)) for row in rows]
    for token in sorted({token for row in rows for token in row}):
        trial = lengths(stops + [token])
        if max(trial) == max_new_tokens and len(set(trial)) > len(set(lengths(stops))):
            stops = stops + [token]
    return stops


# --- the random numbers ---
def test_uniforms_are_splitmix64():
    """Claim: `uniforms` is SplitMix64 mod 2^64 on int64 tensors (wrapping products, logical shifts, negative seeds
    included): it equals the Python-int formula bit for bit, so a row's u is the same on any device and batch."""
    seeds = [engine.row_seed((seed, 2, j), i) for seed in (0, 1, 2**63 + 5, -3) for j in (0, 9) for i in range(3)]
    assert any(s < 0 for s in seeds) and any(s > 0 for s in seeds)
    steps = list(range(0, 200, 7))
    got = engine.uniforms(torch.tensor(seeds).repeat_interleave(len(steps)), torch.tensor(steps).repeat(len(seeds)))
    expected = [(engine.mix64((seed + (step + 1) * engine.GOLDEN) & engine.MASK64) >> 32) * 2.0**-32
                for seed in seeds for step in steps]
    assert got.tolist() == expected
    assert 0.0 <= min(expected) and max(expected) < 1.0


# --- greedy decoding equals generate ---
@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "mistral", "qwen2-eager", "qwen-shaped"])
def test_greedy_tokens_equal_generate(kind, request):
    """Claim: greedy decoding through the engine (each prompt prefilled once, unpadded, copied into its G rows; the
    fixed-shape decode step on the preallocated cache) gives `generate(do_sample=False)`'s tokens, token for token,
    on a random Qwen2 (sdpa and eager attention), a random Llama, a random Qwen3 (RMSNorm on each head's queries and
    keys, inside the attention layer the engine calls), a random Mistral (no sliding window) and the
    Qwen2.5-Instruct-shaped fixture (chat tokens, two EOS ids, Qwen's shipped sampling defaults, which neither side
    may apply), for prompts of mixed lengths, with rows that stop at varied steps: all rows at once (compaction as
    they stop), at most 2G rows (whole prompts refill the room), fixed power-of-two shapes (stand-in rows fill the
    bucket), and the prompts prefilled packed in one row (the default here: 75 tokens) or one by one
    (prefill_tokens=1), and with the cache and prefill rows padded to a multiple of 16 (masked padding, never
    cached: pad_to_multiple_of). Teeth: at least three distinct response lengths, some cut short by a stop id, some
    at max_new_tokens.

    Stop ids: the EOS ids and tokens picked from the engine's own unstopped greedy continuations (`varied_stops`: an
    untrained model's greedy continuation loops and never reaches its EOS ids), so rows stop at different steps.

    In float64: `generate` attends over left padding (masked) in batches of other shapes, so its logits differ
    from the engine's in the last bits; in float32 (~1e-7 relative) that could flip an argmax between two near-tied
    logits, in float64 (~1e-16) a flip would need two logits within ~1e-15, so equality is what both being exact
    predicts. (With eager attention the reference is `generate` prompt by prompt: see `generate_greedy`.)"""
    if kind == "qwen-shaped":
        path = request.getfixturevalue("qwen_shaped_dir")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # the untrained fixture repeats its last token: layers noisier, so continuations vary
            for weight in model.model.layers.parameters():
                weight.add_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * 0.2)
        tokenizer = AutoTokenizer.from_pretrained(path)
        texts = ["1+2=", "Natalia sold clips to 48 of her friends in April.", "31+45=", "7+7=", "How many?", "9"]
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        eos_ids, pad = list(model.generation_config.eos_token_id), tokenizer.pad_token_id
        assert len(eos_ids) == 2 and model.generation_config.do_sample  # the shipped defaults are there
    else:
        model = random_model(kind.split("-")[0], dtype=torch.float64, logit_scale=4.0,
                             attention="eager" if kind.endswith("eager") else "sdpa")
        prompts, eos_ids, pad = random_prompts([3, 17, 8, 30, 5, 12], 96), [1], 0
    group_size, max_new = 2, 24
    free = engine.sample_groups(model, prompts, 1, max_new_tokens=max_new, stop_ids=[], keys=keys(len(prompts)),
                                greedy=True)
    stops = varied_stops([group[0] for group in free], eos_ids, max_new)
    expected = generate_greedy(model, prompts, max_new, stops, pad, batched=not kind.endswith("eager"))
    lengths = [len(row) for row in expected]
    assert len(set(lengths)) >= 3 and min(lengths) < max_new == max(lengths), lengths
    for options in ({}, {"max_rows": 2 * group_size}, {"fixed_shapes": True}, {"prefill_tokens": 1},
                    {"pad_to_multiple_of": 16}, {"pad_to_multiple_of": 16, "prefill_tokens": 1, "max_rows": 2}):
        groups = engine.sample_groups(model, prompts, group_size, max_new_tokens=max_new, stop_ids=stops,
                                      keys=keys(len(prompts)), greedy=True, **options)
        assert groups == [[row] * group_size for row in expected], options


# --- sampling follows softmax(logits / T), truncated by top-p ---
def binomial_bound(expected_count: float, draws: int) -> float:
    """5 standard deviations plus 3 counts: for Binomial(N, q) with N = 4000 or 20000 and any q in [1e-7, 0.5]
    (computed exactly), the two-sided tail beyond N·q ± this is at most 1.2e-6; with at most 100 checks per test,
    a correct sampler fails with probability below 1.2e-4."""
    q = expected_count / draws
    return 5 * math.sqrt(draws * q * (1 - q)) + 3


def warped(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float | None = None) -> torch.Tensor:
    """transformers' warpers in generate's order (top-k, top-p, min-p) on logits (n, V); the tokens they drop -inf."""
    if top_k:
        logits = TopKLogitsWarper(top_k)(None, logits)
    if top_p < 1.0:
        logits = TopPLogitsWarper(top_p)(None, logits)
    return logits if min_p is None else MinPLogitsWarper(min_p)(None, logits)


def truncated_distribution(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0,
                           min_p: float | None = None) -> torch.Tensor:
    """softmax(logits / T) restricted to the set HF's warpers keep and renormalised; (V,) -> (V,) float64."""
    kept = torch.isfinite(warped(logits[None].float() / temperature, top_k, top_p, min_p))[0]
    probs = torch.softmax(logits.double() / temperature, dim=-1) * kept
    return probs / probs.sum()


@pytest.mark.parametrize("top_k, min_p", [(0, None), (7, None), (0, 0.05), (40, 0.02), (300, None)])
def test_truncation_keeps_what_transformers_keeps(top_k, min_p):
    """Claim: the engine's kept set is transformers' TopKLogitsWarper -> TopPLogitsWarper -> MinPLogitsWarper's (the
    order generate applies them: top-p's mass is that of what top-k left), on random logits over several top_p
    values, top-k with ties at the k-th (logits rounded to 0.25 with top_p = 1: top-k keeps every tie; which tied
    token a top-p cut keeps is arbitrary, HF's sort and ours break ties differently) and top_k = V. Compared exactly: the two sides sum
    the top-p mass in float32 in different orders, so a set could differ only where a running sum lies within
    ~1e-7 of top_p times the mass; for 320 rows of random logits per case the chance of one is ~1e-4."""
    generator = torch.Generator().manual_seed(0)
    distinct = torch.randn(64, 300, generator=generator) * 3                                 # (n, V)
    for top_p in (0.05, 0.5, 0.9, 0.99, 1.0):
        logits = distinct if top_p < 1.0 else (distinct * 4).round() / 4  # ties: where top-p cuts them is arbitrary
        probs, order = engine.truncated_order(torch.softmax(logits, dim=-1), top_k, top_p, min_p)
        ours = torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, probs > 0)       # (n, V) kept
        theirs = torch.isfinite(warped(logits.clone(), top_k, top_p, min_p))
        assert torch.equal(ours, theirs), top_p
        assert ours.any(dim=-1).all()


@pytest.mark.parametrize("top_p, top_k, min_p", [(1.0, 0, None), (0.8, 0, None), (0.9, 50, 0.01)])
def test_draws_follow_the_scored_distribution(top_p, top_k, min_p):
    """Claim: `draw_tokens` with the engine's uniforms draws from softmax(z / T) truncated by top-k, top-p and min-p
    (the third case all three at once): over 20,000 draws
    on fixed logits of 2,500 tokens (three blocks of the two-level inverse CDF, the last one partial), the count
    in each of 20 bins of ~equal probability (tokens in descending probability) is within `binomial_bound` of N·Q_b,
    the 10 likeliest tokens each too, and tokens outside the top-p set are never drawn."""
    vocab, draws, temperature = 2500, 20000, 0.8
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(vocab, generator=generator) * 2                                     # (V,)
    expected = truncated_distribution(logits, temperature, top_p, top_k, min_p)             # (V,)
    seeds = torch.tensor([engine.row_seed((11, 0, j), 0) for j in range(draws)])
    tokens = torch.cat([engine.draw_tokens(logits.expand(2000, vocab), engine.uniforms(chunk, torch.zeros_like(chunk)),
                                           temperature, top_p, top_k, min_p) for chunk in seeds.split(2000)])  # (N,)
    counts = torch.bincount(tokens, minlength=vocab).double()                               # (V,)
    assert counts[expected == 0].sum() == 0
    ranked = expected.argsort(descending=True)
    bins = (expected[ranked].cumsum(0) - expected[ranked]).mul(20).floor().clamp(max=19).long()  # (V,) bin by mass
    observed = torch.zeros(20, dtype=torch.float64).index_add(0, bins, counts[ranked])
    mass = torch.zeros(20, dtype=torch.float64).index_add(0, bins, expected[ranked])
    checks = [(observed[b], mass[b] * draws) for b in range(20) if mass[b] > 0]
    checks += [(counts[s], expected[s] * draws) for s in ranked[:10]]
    for seen, mean in checks:
        assert abs(seen - mean) <= binomial_bound(float(mean), draws), (float(seen), float(mean))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sample_groups_first_and_second_tokens_follow_the_model(top_p):
    """Claim: end to end (prefill, the copy into G rows, one decode step, per-row per-step uniforms), the first
    token of 4,000 samples of one prompt follows softmax(z_0 / T) truncated by top-p, z_0 the model's own logits
    after the prompt, and the second token of the samples whose first token was the likeliest one follows
    softmax(z_1 / T), z_1 its logits after prompt + that token. Each token's count is within `binomial_bound`;
    truncated tokens are never drawn. (The engine's logits differ from a plain forward's by float32 rounding,
    ~1e-7 in probability: nothing next to these bounds.)"""
    model = random_model("qwen2", vocab=12, logit_scale=6.0)
    prompt, draws, temperature = random_prompts([5], 12)[0], 4000, 0.7
    groups = engine.sample_groups(model, [prompt], draws, max_new_tokens=2, temperature=temperature, top_p=top_p,
                                  stop_ids=[], keys=keys(1))
    first = torch.tensor([row[0] for row in groups[0]])
    with torch.no_grad():
        z0 = model(torch.tensor([prompt])).logits[0, -1]
    expected = truncated_distribution(z0, temperature, top_p)
    likeliest = int(expected.argmax())
    with torch.no_grad():
        z1 = model(torch.tensor([prompt + [likeliest]])).logits[0, -1]
    second = torch.tensor([row[1] for row in groups[0] if row[0] == likeliest])
    for tokens, probs in ((first, expected), (second, truncated_distribution(z1, temperature, top_p))):
        assert len(tokens) > 500
        counts = torch.bincount(tokens, minlength=12).double()
        assert counts[probs == 0].sum() == 0
        for seen, q in zip(counts.tolist(), probs.tolist()):
            assert abs(seen - q * len(tokens)) <= binomial_bound(q * len(tokens), len(tokens)), (seen, q)
    if top_p < 1:
        assert (expected == 0).any(), "top-p truncated nothing: the check would be vacuous"


# --- a row's tokens depend on its key alone ---
def test_keys_and_stop_ids_default_to_prompt_indices_and_the_models_eos_ids():
    """Claim: sample_groups without keys or stop_ids samples what it does given keys (j,) for prompt j and the
    model's generation-config EOS ids; those ids stop a response (some rows end before max_new_tokens here)."""
    model = random_model("qwen2", vocab=64)
    model.generation_config.eos_token_id = [1, 2, 3]
    prompts = random_prompts([3, 17, 8], 64)
    default = engine.sample_groups(model, prompts, 4, max_new_tokens=16)
    assert default == engine.sample_groups(model, prompts, 4, max_new_tokens=16, stop_ids=[1, 2, 3],
                                           keys=[(0,), (1,), (2,)])
    assert any(len(r) < 16 and r[-1] in (1, 2, 3) for group in default for r in group), default


def test_rows_depend_only_on_their_keys():
    """Claim: the same 12 prompts sampled in one call, in calls of 4 and of 1 prompt (each with its own keys), with
    at most 4, 12 or 40 rows at once (refill), at fixed power-of-two shapes, with the host looking every 8 steps,
    with the cache and prefill rows padded to a multiple of 32, and at top_p 0.9 likewise, give identical tokens: a row's draws are a function of (key, sample, step) and
    nothing else. Teeth: responses stop at varied lengths (compaction and refill happen), and other keys give
    other tokens.

    Exact on CPU with one thread count: this small model's logits come out bitwise equal whichever rows share a
    step (checked here as the equality itself). Where a BLAS kernel blocks by batch size, logits can differ in
    the last bits and a token flip needs u·F(S) within that rounding (~1e-7) of a CDF boundary."""
    model = random_model("qwen2", vocab=64)
    prompts = random_prompts([3, 17, 8, 30, 5, 12, 9, 21, 4, 6, 14, 2], 64)
    common = dict(max_new_tokens=16, temperature=1.0, stop_ids=[1, 2])

    def chunked(size: int, top_p: float) -> list[list[list[int]]]:
        return [group for first in range(0, 12, size)
                for group in engine.sample_groups(model, prompts[first:first + size], 4, top_p=top_p,
                                                  keys=keys(len(prompts[first:first + size]), first), **common)]
    for top_p, sizes, options in (
            (1.0, (1, 4), ({"max_rows": 4}, {"max_rows": 12}, {"max_rows": 40}, {"fixed_shapes": True},
                           {"check_every": 8}, {"fixed_shapes": True, "max_rows": 12, "check_every": 8},
                           {"pad_to_multiple_of": 32, "max_rows": 12})),
            (0.9, (4,), ({"max_rows": 12},))):
        one_call = engine.sample_groups(model, prompts, 4, keys=keys(12), top_p=top_p, **common)
        lengths = {len(row) for group in one_call for row in group}
        assert len(lengths) >= 5 and min(lengths) < 16 == max(lengths), lengths
        for size in sizes:
            assert chunked(size, top_p) == one_call, size
        for option in options:
            assert engine.sample_groups(model, prompts, 4, keys=keys(12), top_p=top_p, **option, **common) \
                == one_call, option
    assert engine.sample_groups(model, prompts, 4, keys=keys(12, first=1), top_p=0.9, **common) != one_call


def test_groups_are_reported_in_completion_order():
    """Claim: on_done gets each group once, with the responses returned, the moment its last row stops: with all rows
    started together, in order of the group's longest response (ties: prompt order), whether the host looks every
    step or every 8 (the stop step is recorded on the device); with refill (at most 8 rows at once) every group is
    still reported once, with the same responses; and on_done runs outside the sampler's inference mode, without
    autograd (a reward's tensors are ordinary ones). Teeth: several distinct group lengths, not in prompt order."""
    model = random_model("qwen2", vocab=64)
    prompts = random_prompts([3, 17, 8, 30, 5, 12, 9, 21], 64)
    common = dict(max_new_tokens=24, temperature=1.0, stop_ids=[1, 2, 3], keys=keys(8))
    for check_every in (1, 8):
        reported = []
        groups = engine.sample_groups(model, prompts, 4, check_every=check_every,
                                      on_done=lambda j, responses: reported.append((j, responses)), **common)
        longest = [max(map(len, group)) for group in groups]
        assert [j for j, _ in reported] == sorted(range(8), key=lambda j: (longest[j], j))
        assert all(groups[j] == responses for j, responses in reported)
        assert len(set(longest)) >= 3 and [j for j, _ in reported] != list(range(8))
    reported = []
    refilled = engine.sample_groups(model, prompts, 4, max_rows=8, on_done=lambda j, r: reported.append(
        (j, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.ones(1).is_inference())), **common)
    assert refilled == groups and sorted(j for j, *_ in reported) == list(range(8))
    assert all(modes == [False, False, False] for _, *modes in reported)  # the caller's code makes ordinary tensors


def test_steps_on_the_stand_in_move_no_row():
    """Claim (what CUDA-graph capture relies on, checked on CPU): decode steps run with every slot pointing at the
    stand-in row record nothing (tokens, lengths, stop steps unchanged) and write the cache only at its last
    slot, which no running row reads; so warm-up and capture, with slots, last tokens and step put back, leave
    the rollouts exactly where they were, and the call then samples what it would have."""
    model = random_model("qwen2", vocab=64)
    prompts = random_prompts([3, 17, 8], 64)
    rollouts = engine.GenerateCall(model, prompts, 2, 8, 1.0, 1.0, [1], keys(3), 6, greedy=False)
    for j in range(3):
        rollouts.prefill([j], [torch.arange(2 * j, 2 * j + 2)])
    rollouts.decode(6)
    state = [t.clone() for t in (rollouts.tokens, rollouts.lengths, rollouts.stop_step, rollouts.slot_rows,
                                 rollouts.last_token, rollouts.step, rollouts.cache.keys[..., :-1, :],
                                 rollouts.cache.values[..., :-1, :])]
    rollouts.slot_rows[:] = rollouts.stand_in
    for _ in range(2):
        rollouts.decode(6)
    rollouts.slot_rows.copy_(state[3])
    rollouts.last_token.copy_(state[4])
    rollouts.step.copy_(state[5])
    after = (rollouts.tokens, rollouts.lengths, rollouts.stop_step, rollouts.slot_rows, rollouts.last_token,
             rollouts.step, rollouts.cache.keys[..., :-1, :], rollouts.cache.values[..., :-1, :])
    assert all(torch.equal(before, now) for before, now in zip(state, after))


def test_decode_attention_equals_hugging_faces_grouped_query_attention():
    """Claim: decode_attention (query heads folded onto their key head, the cache never repeated) computes what
    Hugging Face's sdpa path computes after repeat_kv, for one new token per row under an additive (n, 1, 1, L)
    mask, and slots the mask hides have no effect. In float64 both are sums of at most L = 40 products of
    numbers below 10 in magnitude, each rounded to 2^-53 relative: the two orders of summation differ by far
    less than 1e-12. Teeth: a fold that paired query heads with the wrong key head (h % K instead of
    h // (H/K)) differs by ~0.1."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    generator = torch.Generator().manual_seed(0)
    n, heads, groups, length, dim = 5, 6, 2, 40, 8
    query = torch.randn(n, heads, 1, dim, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(n, groups, length, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    seen = torch.tensor([3, 17, 40, 1, 25])
    mask = torch.zeros(n, 1, 1, length, dtype=torch.float64).masked_fill_(
        torch.arange(length) >= seen[:, None, None, None], torch.finfo(torch.float64).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = heads // groups, False, False
    ours, _ = engine.decode_attention(module, query, key, value, mask, scaling=dim ** -0.5)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    assert ours.shape == theirs.shape == (n, 1, heads, dim)
    assert (ours - theirs).abs().max() < 1e-12
    hidden = torch.arange(length) >= seen[:, None, None, None]                    # (n, 1, 1, L) slots not yet seen
    changed = engine.decode_attention(module, query, key.masked_fill(hidden.transpose(-1, -2), 1e3),
                                      value.masked_fill(hidden.transpose(-1, -2), 1e3), mask, scaling=dim ** -0.5)[0]
    assert torch.equal(changed, ours)
    wrong = query.view(n, heads // groups, groups, 1, dim).transpose(1, 2).reshape(n, heads, 1, dim)
    misfolded, _ = engine.decode_attention(module, wrong, key, value, mask, scaling=dim ** -0.5)
    assert (misfolded - theirs).abs().max() > 0.05


def test_a_failed_cuda_graph_capture_decodes_eagerly_from_where_it_was(monkeypatch, capsys):
    """Claim: when capturing the decode step fails after its warm-up steps ran (a forward that synchronises with
    the host, say), DecodeGraphs says so in one line and the call goes on eagerly with slots, last tokens and
    step put back: the tokens equal those of eager decoding throughout. On CPU the CUDA stream and graph are
    stand-ins: the stream runs on the current thread, and entering the capture raises as CUDA would."""
    class Stream:
        def wait_stream(self, other):
            pass

    class Capture:
        def __init__(self, graph):
            pass

        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    model = random_model("qwen2", vocab=64)
    prompts = random_prompts([3, 17, 8], 64)
    twins = [engine.GenerateCall(model, prompts, 2, 8, 1.0, 1.0, [1], keys(3), 6, greedy=False) for _ in range(2)]
    for rollouts in twins:
        for j in range(3):
            rollouts.prefill([j], [torch.arange(2 * j, 2 * j + 2)])
    graphs = compiled_step.DecodeGraphs(twins[0])
    for _ in range(5):
        graphs.decode(6)
        twins[1].decode(6)
    assert graphs.eager and not graphs.graphs
    assert capsys.readouterr().err.splitlines() == [
        "engine: CUDA graph capture failed, decoding without graphs: operation not permitted when stream is capturing"]
    for name in ("tokens", "lengths", "stop_step", "slot_rows", "last_token", "step"):
        assert torch.equal(getattr(twins[0], name), getattr(twins[1], name)), name
    assert twins[0].lengths[:6].tolist() == [6] * 6


def test_the_draw_leaves_the_logits_alone_and_flags_any_non_finite_one():
    """Claim: checked_draw neither changes the logits it is given (float32 logits at T != 1: a division in place
    would have divided the caller's tensor) nor misses a non-finite logit: one NaN, +inf or -inf anywhere in the
    (n, V) logits makes `finite` False (one min/max pass; NaN propagates into both), and finite logits give True."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    kept, seeds, lengths = logits.clone(), torch.arange(4), torch.zeros(4, dtype=torch.long)
    for greedy, temperature in [(False, 0.7), (False, 1.0), (True, 1.0)]:
        _, finite = engine.checked_draw(logits, seeds, lengths, greedy, temperature, 0.9, 0, None)
        assert torch.equal(logits, kept) and bool(finite)
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = logits.clone()
        spoiled[2, 117] = bad
        assert not bool(engine.checked_draw(spoiled, seeds, lengths, False, 0.7, 1.0, 0, None)[1]), bad


@pytest.mark.slow
def test_the_compiled_draw_draws_the_eager_draws_tokens():
    """Claim (--engine compile): compiled_draw, the draw through torch.compile, picks the tokens checked_draw picks:
    plain, at T 0.7 with top-p, with top-k and min-p, and greedy, 64 rows over 3,000 tokens (3 blocks). The
    uniforms are integer arithmetic (exact); Inductor may round the softmax and the block sums differently, ~1e-7
    of a row's mass, and a token flips only where u·F(S) lands that close to a boundary of the running sum: about
    1e-7 x 64 x 4 < 1e-4 for the whole test, and with fixed keys the outcome is the same on every run. Teeth: a
    compiled draw whose uniforms wrapped otherwise, or whose softmax skipped the temperature, differs in most rows."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 3000, generator=generator) * 3
    seeds = torch.tensor([engine.row_seed((5, 1, j), 0) for j in range(64)])
    lengths = torch.randint(0, 200, (64,), generator=generator)
    torch._dynamo.reset()
    try:
        for settings in [(False, 1.0, 1.0, 0, None), (False, 0.7, 0.9, 0, None), (False, 1.2, 1.0, 40, 0.05),
                         (True, 1.0, 1.0, 0, None)]:
            eager, finite = engine.checked_draw(logits, seeds, lengths, *settings)
            compiled, compiled_finite = compiled_step.compiled(engine.checked_draw)(logits, seeds, lengths, *settings)
            assert torch.equal(compiled, eager) and bool(finite) and bool(compiled_finite), settings
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_decode_step_samples_what_the_eager_one_does():
    """Claim (--engine compile): the decode step with its layers through torch.compile samples the tokens the eager
    step samples, in a call with compaction and refill (max_rows) and in a second call of other sizes (its
    recompilation), and leaves the model as it was (no layer keeps a compiled forward; one's own stays).
    Inductor may sum in another order: float32 logits of magnitude < 10 then differ by ~1e-6 at most, and a token
    flips only where u·F(S) lands that close to a boundary of the running sum, about 1e-5 per token over this
    64-token vocabulary, under 1% for the ~330 tokens here; the uniforms are fixed by the keys, so the outcome is
    the same on every run of a machine. (Slow: compilation takes 10-20 s on 2 cores.)"""
    model = random_model("qwen2", vocab=64)
    prompts = random_prompts([3, 17, 8, 12, 5], 64)
    common = dict(max_new_tokens=12, temperature=1.0, stop_ids=[1, 2], keys=keys(5))
    eager = engine.sample_groups(model, prompts, 4, max_rows=8, **common)
    compiled = engine.sample_groups(model, prompts, 4, max_rows=8, decode_step=compiled_step.decode_step, **common)
    assert compiled == eager
    assert len({len(r) for group in eager for r in group}) > 2, "every row ran to the limit: no compaction to check"
    assert not any("forward" in vars(layer) for layer in model.get_decoder().layers)
    first = model.get_decoder().layers[0]
    first.forward = hook = first.forward  # a forward set on the layer itself (as accelerate's hooks do): kept
    other = dict(common, max_new_tokens=7, keys=keys(2))
    assert (engine.sample_groups(model, prompts[:2], 3, decode_step=compiled_step.decode_step, **other)
            == engine.sample_groups(model, prompts[:2], 3, **other))
    assert vars(first)["forward"] is hook


@pytest.mark.slow
def test_the_compiled_layers_compile_once_whatever_the_depth():
    """Claim: --engine compile compiles one layer's code for all layers (regional compilation), so Qwen2.5-0.5B's 24
    layers cost about what 1 does. Measured as torch._dynamo's count of graphs compiled for a call from scratch:
    the same for a 2-layer and a 6-layer model. Teeth: the layer index reaching the compiled code (RowCache.update
    compiled with it) recompiles per layer, up to torch's limit of 8, and the 6-layer count grows."""
    from torch._dynamo.utils import counters

    def graphs_compiled(layers: int) -> int:
        torch._dynamo.reset()
        counters.clear()
        model = random_model("qwen2", vocab=64, layers=layers)
        args = (model, random_prompts([5, 9], 64), 2)
        common = dict(max_new_tokens=4, stop_ids=[64], keys=keys(2))  # stop id 64: no token of 0..63, every step
        compiled = engine.sample_groups(*args, decode_step=compiled_step.decode_step, **common)  # the same rows
        assert compiled == engine.sample_groups(*args, **common) and compiled_step.COMPILE_FAILED is None
        return counters["stats"]["unique_graphs"]

    shallow, deep = graphs_compiled(2), graphs_compiled(6)
    assert shallow >= 1 and deep == shallow, (shallow, deep)


def test_a_failed_compilation_decodes_without_it_and_says_so_once(monkeypatch, capsys):
    """Claim (--engine compile, reliability): where torch.compile cannot compile (here Inductor finds no C++ compiler,
    as on a machine without one; no Triton on a GPU fails the same way), the call still returns the eager engine's
    tokens exactly (the failed step is run again eagerly; here the failure comes before any cache write, and one
    after a write would be rewritten at the same slots), says so in
    one line on stderr, and later calls of the process do not try again. Teeth: without the fallback the call raises InductorError."""
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_step, "COMPILE_FAILED", None)
    monkeypatch.setattr(compiled_step, "_COMPILED", {})
    no_compiler = inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++"),
                                         "force_disable_caches": True})  # and no compiled code of an earlier test
    model = random_model("qwen2", vocab=64)
    prompts = random_prompts([3, 17, 8], 64)
    common = dict(max_new_tokens=6, temperature=1.0, stop_ids=[1, 2], keys=keys(3))
    try:
        with no_compiler:
            compiled = engine.sample_groups(model, prompts, 2, decode_step=compiled_step.decode_step, **common)
        assert compiled == engine.sample_groups(model, prompts, 2, **common)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("engine:")]
        assert len(lines) == 1 and lines[0].startswith("engine: torch.compile failed, decoding without it: "), lines
        assert "compiler" in lines[0].lower(), lines
        engine.sample_groups(model, prompts, 2, decode_step=compiled_step.decode_step, **common)  # the process has given up compiling
        assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("engine:")]
        assert not any("forward" in vars(layer) for layer in model.get_decoder().layers)
    finally:
        torch._dynamo.reset()


def test_compiling_past_the_recompile_limit_says_so_and_decodes_eagerly(monkeypatch, capsys):
    """Claim (--engine compile, reliability): a compiled function asked for more compilations than RECOMPILE_LIMIT
    (each new row count, cache length, CPU thread count or sampling setting may add one) makes the engine say so in
    one line and decode eagerly, the same tokens, for the rest of the process.
    Here the limit is 1 and a second call samples (the first is greedy: the draw is compiled again)."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_step, "COMPILE_FAILED", None)
    monkeypatch.setattr(compiled_step, "RECOMPILE_LIMIT", 1)
    model = random_model("qwen2", vocab=64)
    prompts = random_prompts([3, 9], 64)
    common = dict(max_new_tokens=5, temperature=1.0, stop_ids=[1, 2], keys=keys(2))
    try:
        for greedy in (True, False):
            assert (engine.sample_groups(model, prompts, 2, decode_step=compiled_step.decode_step, greedy=greedy, **common)
                    == engine.sample_groups(model, prompts, 2, greedy=greedy, **common))
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("engine:")]
        assert len(lines) == 1 and "recompile limit" in lines[0], lines
        assert compiled_step.COMPILE_FAILED is not None
    finally:
        torch._dynamo.reset()


def test_every_eos_id_stops_a_sampled_response(qwen_shaped_dir):
    """Claim: with the Qwen2.5-Instruct-shaped fixture's two EOS ids as stop ids, a sampled response ends at the first
    of either (kept) and nothing follows; a response without one runs to max_new_tokens. Teeth: with the fixture's
    logits flattened (nearly uniform over 260 ids) responses end at each of the two ids."""
    model = AutoModelForCausalLM.from_pretrained(qwen_shaped_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(qwen_shaped_dir)
    with torch.no_grad():
        model.model.norm.weight.div_(LOGIT_SCALE)
    stops = list(model.generation_config.eos_token_id)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("1+2=", "31+45=")]
    groups = engine.sample_groups(model, prompts, 32, max_new_tokens=64, stop_ids=stops, keys=keys(2))
    rows = [row for group in groups for row in group]
    assert all(not set(row[:-1]) & set(stops) and (row[-1] in stops or len(row) == 64) for row in rows)
    assert {row[-1] for row in rows} >= set(stops)


# --- where it is exact, and copied alone ---
def test_unsupported_reason():
    """Claim: Qwen2, Qwen3, Llama and Mistral with sdpa or eager attention are supported; a sliding window (Mistral's
    sliding_window set, Qwen2's use_sliding_window), logit soft-capping, rope scaling that depends on the sequence
    length, an attention implementation that ignores a 4-D mask or another model type each get a one-line reason,
    and sample_groups refuses them."""
    assert engine.unsupported_reason(random_model("qwen2")) is None
    assert engine.unsupported_reason(random_model("llama")) is None
    assert engine.unsupported_reason(random_model("qwen3")) is None
    eager = random_model("qwen2")
    eager.config._attn_implementation = "eager"
    assert engine.unsupported_reason(eager) is None
    sliding = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert "sliding" in engine.unsupported_reason(sliding)
    capped = random_model("qwen2")
    capped.config.final_logit_softcapping = 30.0
    assert "softcapping" in engine.unsupported_reason(capped)
    flex = random_model("llama")
    flex.config._attn_implementation = "flex_attention"
    assert "flex_attention" in engine.unsupported_reason(flex)
    dynamic = random_model("llama")
    name = "rope_parameters" if hasattr(dynamic.config, "rope_parameters") else "rope_scaling"  # before 5.x
    setattr(dynamic.config, name, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "dynamic" in engine.unsupported_reason(dynamic)
    assert engine.unsupported_reason(random_model("mistral")) is None
    windowed = random_model("mistral")
    windowed.config.sliding_window = 4096  # Mistral-7B-v0.1's: a window however long the rows
    assert "sliding" in engine.unsupported_reason(windowed)
    other = random_model("llama")
    other.config.model_type = "gemma"
    assert "gemma" in engine.unsupported_reason(other)
    with pytest.raises(ValueError, match="sliding"):
        engine.sample_groups(sliding, [[1, 2]], 2, max_new_tokens=2, stop_ids=[], keys=keys(1))


