"""Sampling on a Qwen2.5-Instruct-shaped model: exactly the distribution the trainer scores, stopped by every EOS."""
import pytest
import torch
from conftest import LOGIT_SCALE
from transformers import GenerationConfig

from config import Config
from infra.models import load_model
from infra.tasks import Example, prompt_token_ids
from infra.hf_generate import own_sampling_only, sample_responses, sampling_config
from rollout import ScoredGroup, rollout_iteration, stop_token_ids

SETTINGS = Config(seed=0, group_size=4, batch_size=12, max_new_tokens=24, temperature=1.0, top_p=1.0, eval_every=0,
                  eval_samples=2, scale_rewards=True, groups_per_call=1)
EXAMPLES = [Example("12+7=", "19"), Example("3+30=", "33"), Example("48+1=", "49")]


def length_reward(prompt: str, completion: str, answer: str) -> float:
    return float(len(completion))


def trim_response(tokens: list[int], eos_ids: list[int]) -> list[int]:
    """Cut after the first stop id, as a reader of `generate`'s padded output would."""
    stops = [i for i, token in enumerate(tokens) if token in eos_ids]
    return tokens[:stops[0] + 1] if stops else tokens


def rollouts(model_dir) -> list[list[list[int]]]:
    model, tokenizer = load_model(str(model_dir))
    messages = []
    rollout_iteration(model, tokenizer, EXAMPLES, [], length_reward, SETTINGS, iteration=0, weights_version=lambda: 0,
                      send=messages.append)
    return [m.responses for m in sorted((m for m in messages if isinstance(m, ScoredGroup)), key=lambda g: g.index)]


def test_shipped_generation_config_does_not_change_sampling(qwen_shaped_dir, qwen_shaped_bare_dir):
    """Claim: sampling depends only on --temperature/--top-p and the EOS ids. The same weights with Qwen's shipped
    generation_config (top_k 20, top_p 0.8, temperature 0.7, repetition_penalty 1.1) or with a bare one give
    identical rollouts; and the fixture has teeth: a `generate` that lets the shipped config fill the gaps of a
    config naming only temperature/top-p/top-k samples differently."""
    shipped, bare = rollouts(qwen_shaped_dir), rollouts(qwen_shaped_bare_dir)
    assert len(shipped) == 3 and shipped == bare
    model, tokenizer = load_model(str(qwen_shaped_dir))
    assert model.generation_config.repetition_penalty == 1.1  # the shipped value is there, and ignored above
    prompts = [prompt_token_ids(tokenizer, e.prompt) for e in EXAMPLES]
    naive = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_token_ids(model, tokenizer))
    torch.manual_seed(0)
    with torch.no_grad():
        width = max(map(len, prompts))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts for _ in range(4)])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts for _ in range(4)])[:, None])
        honoured = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=naive)[:, width:]
    ours = sample_responses(model, prompts, 4, sampling_config(SETTINGS, stop_token_ids(model, tokenizer),
                                                               tokenizer.pad_token_id), seed=0)
    assert [trim_response(row, stop_token_ids(model, tokenizer)) for row in honoured.tolist()] != \
        [r for group in ours for r in group]


def test_every_eos_id_stops_a_response(qwen_shaped_dir):
    """Claim: a response ends at the first of *any* EOS id: the tokenizer's (<|im_end|>) and the generation config's
    second one (<|endoftext|>, which this untrained model, its logits flattened, emits by chance): generation stops
    there and nothing follows it; with the tokenizer's EOS alone those responses would have run on (teeth)."""
    model, tokenizer = load_model(str(qwen_shaped_dir))
    with torch.no_grad():
        model.model.norm.weight.div_(LOGIT_SCALE)  # nearly uniform over the 260 ids: EOS ids come up by chance
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    stops = stop_token_ids(model, tokenizer)
    assert tokenizer.eos_token_id == im_end and stops == [im_end, endoftext]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("1+2=", "31+45=")]
    sampling = Config(max_new_tokens=64, temperature=1.0, top_p=1.0)
    both = sample_responses(model, prompts, 16, sampling_config(sampling, stops, endoftext), seed=3)
    alone = sample_responses(model, prompts, 16, sampling_config(sampling, [im_end], endoftext), seed=3)
    responses, unstopped = [r for g in both for r in g], [r for g in alone for r in g]
    stopped = [r for r in responses if r[-1] == endoftext]
    assert stopped, "no response reached <|endoftext|>: the check would be vacuous"
    assert all(len(r) < 64 and endoftext not in r[:-1] for r in stopped)
    assert any(endoftext in r[:-1] for r in unstopped), "with one EOS id the same samples should run past it"


def test_groups_stream_in_completion_order_and_match_generate(qwen_shaped_dir):
    """Claim: `sample_responses` reports each prompt's group inside the `generate` call, at the step its last
    response stops, so groups arrive in order of their longest response (ties: prompt order); and what it streams is
    exactly what `generate` returns, cut after the first stop id. Teeth: the flattened model's responses stop at
    different lengths (several distinct group lengths, not in prompt order)."""
    model, tokenizer = load_model(str(qwen_shaped_dir))
    with torch.no_grad():
        model.model.norm.weight.div_(LOGIT_SCALE)  # nearly uniform: EOS ids come up by chance, at varied steps
    stops = stop_token_ids(model, tokenizer)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("1+2=", "31+45=", "7+7=", "40+2=")]
    generation = sampling_config(Config(max_new_tokens=160, temperature=1.0, top_p=1.0), stops, tokenizer.pad_token_id)
    reported = []  # P(a response stops within 160 steps) = 1 - (1 - 2/260)^160 = 0.71: group lengths vary
    responses = sample_responses(model, prompts, 2, generation, seed=5, compact_below=0,  # one call, as below
                                 on_done=lambda position, group: reported.append((position, [list(r) for r in group])))
    longest = {position: max(map(len, group)) for position, group in reported}
    assert sorted(position for position, _ in reported) == [0, 1, 2, 3]
    assert [position for position, _ in reported] == sorted(longest, key=lambda p: (longest[p], p))
    assert len(set(longest.values())) >= 3 and [p for p, _ in reported] != [0, 1, 2, 3], "too uniform to tell"
    assert all(responses[position] == group for position, group in reported)
    torch.manual_seed(5)
    with torch.no_grad():
        width = max(map(len, prompts))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts for _ in range(2)])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts for _ in range(2)])[:, None])
        with own_sampling_only(model):
            output = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=generation)
    assert [trim_response(row, stops) for row in output[:, width:].tolist()] == [r for g in responses for r in g]


def test_compaction_continues_each_row_exactly(qwen_shaped_dir):
    """Claim: ending `generate` once half the rows have stopped and going on with the live rows alone, from their
    cache (`Compaction`), continues every row exactly as one call does: greedy decoding (deterministic; no token
    repeated within a row, so rows stop at an EOS id at varied steps) gives the same responses, and each group is
    still reported the step its last row stops, in order of its longest response. Teeth: the rows stop at varied
    steps and `generate` was called more than once.

    In float64: a row's logits may differ in the last bits between a batch of 8 rows and one of 3 (CPU BLAS picks
    kernels by shape), which in float32 (~1e-7 relative) could flip a greedy near-tie; in float64 (~1e-16) a flip
    would need two logits within ~1e-15 of each other, so equal tokens are what exact continuation predicts."""
    model, tokenizer = load_model(str(qwen_shaped_dir))
    model = model.to(torch.float64)
    calls, generate = [], model.generate
    model.generate = lambda *args, **kwargs: calls.append(1) or generate(*args, **kwargs)
    prompts = [tokenizer.encode(text, add_special_tokens=False)
               for text in ("1+2=", "31+45=", "7+7=", "40+2=", "9+9=", "12+30=", "5+55=", "8+1=")]
    greedy = GenerationConfig(do_sample=False, max_new_tokens=200, no_repeat_ngram_size=1,
                              eos_token_id=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
    one_call = sample_responses(model, prompts, 1, greedy, seed=0, compact_below=0)
    assert len(calls) == 1
    reported = []
    compacted = sample_responses(model, prompts, 1, greedy, seed=0, compact_below=0.5,
                                 on_done=lambda position, group: reported.append(position))
    lengths = [len(group[0]) for group in one_call]
    assert len(set(lengths)) >= 4, "too uniform to tell"
    assert len(calls) > 2 and compacted == one_call
    assert reported == sorted(range(len(prompts)), key=lambda p: (lengths[p], p))


@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_rollouts_do_not_depend_on_the_call_sizes_with_the_engine(qwen_shaped_dir, engine):
    """Claim: with the engine (--engine auto), the rollouts of an iteration are decided by --seed alone:
    --groups-per-call 1, 4 and 16 sample exactly the same tokens for every prompt (each row's draws are a function of
    (seed, iteration, prompt, sample, step); the same thread count, so the logits are computed alike). And the test
    has teeth: with --engine hf (`generate`, seeded per call), the same call sizes sample other tokens."""
    import dataclasses

    model, tokenizer = load_model(str(qwen_shaped_dir))
    examples = [Example(f"{a}+{b}=", str(a + b)) for a, b in zip(range(16), range(5, 21))]
    sampled = {}
    for per_call in (1, 4, 16):
        cfg = dataclasses.replace(SETTINGS, batch_size=16 * 4, groups_per_call=per_call, engine=engine)
        messages = []
        rollout_iteration(model, tokenizer, examples, [], length_reward, cfg, iteration=3, weights_version=lambda: 0,
                          send=messages.append)
        groups = sorted((m for m in messages if isinstance(m, ScoredGroup)), key=lambda g: g.index)
        assert [g.index for g in groups] == list(range(16))
        sampled[per_call] = [g.responses for g in groups]
    if engine == "auto":
        assert sampled[1] == sampled[4] == sampled[16]
    else:
        assert sampled[1] != sampled[16]


@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_a_diverged_policy_is_one_line(qwen_shaped_dir, engine):
    """Claim: sampling from a policy whose weights diverged (NaN logits, as after --lr 1e10) ends
    in a UserError naming the fix, the one line trainer.py prints, instead of an index error from deep inside (the
    engine) or torch.multinomial's RuntimeError (`generate`, --engine hf)."""
    import dataclasses

    from rollout import DivergedError

    model, tokenizer = load_model(str(qwen_shaped_dir))
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    cfg = dataclasses.replace(SETTINGS, lr=1e10, engine=engine)
    with pytest.raises(DivergedError, match="iteration 0: (engine: )?the model's logits are not finite.*lower --lr"):
        rollout_iteration(model, tokenizer, EXAMPLES, [], length_reward, cfg, iteration=0, weights_version=lambda: 0,
                          send=lambda message: None)


def test_top_k_reaches_both_samplers(qwen_shaped_dir):
    """Claim: --top-k (and --min-p) shape what both samplers draw: with top_k = 1 only the likeliest token may be
    drawn, so the engine and `generate` (--engine hf), two different random streams, give the same tokens, the
    greedy ones (float64 model: no near-ties between the two sides' logits, see tests/method/test_engine.py); with
    min_p = 1 the same (only tokens as likely as the likeliest survive). Teeth: without truncation they differ."""
    import dataclasses

    model, tokenizer = load_model(str(qwen_shaped_dir), dtype=torch.float64)
    examples = [Example(f"{a}+{b}=", str(a + b)) for a, b in ((12, 7), (3, 30), (48, 1), (5, 5))]

    def sampled(**options) -> list[list[list[int]]]:
        messages = []
        cfg = dataclasses.replace(SETTINGS, batch_size=4 * 4, groups_per_call=4, **options)
        rollout_iteration(model, tokenizer, examples, [], length_reward, cfg, iteration=0, weights_version=lambda: 0,
                          send=messages.append)
        return [g.responses for g in sorted((m for m in messages if isinstance(m, ScoredGroup)), key=lambda g: g.index)]

    assert sampled(engine="auto") != sampled(engine="hf")
    greedy = sampled(engine="auto", top_k=1)
    assert greedy == sampled(engine="hf", top_k=1) == sampled(engine="auto", min_p=1.0)
    assert all(len(set(map(tuple, group))) == 1 for group in greedy)  # one answer per prompt: no randomness left


def test_engine_compile_compiles_the_engines_decode_step(qwen_shaped_dir, monkeypatch):
    """Claim: --engine compile samples with engine.py (the same keys, sizes and settings as --engine auto) and asks it
    for the compiled decode step (infra/compiled_step.py); auto on CPU and eager do not (auto on CUDA does:
    config.engine_compiles, tests/cli/test_config.py; the compiled step itself: tests/method/test_engine.py, slow tier)."""
    import dataclasses

    import engine
    import rollout

    model, tokenizer = load_model(str(qwen_shaped_dir))
    calls = []
    sample_groups = engine.sample_groups
    monkeypatch.setattr(engine, "sample_groups", lambda *args, **kwargs: (calls.append(kwargs), sample_groups(
        *args, **dict(kwargs, decode_step=None)))[1])
    prompts = [prompt_token_ids(tokenizer, e.prompt) for e in EXAMPLES]
    generation = sampling_config(SETTINGS, stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    for name in ("auto", "compile", "eager"):
        rollout.sample_prompts(model, prompts, 2, generation, dataclasses.replace(SETTINGS, engine=name), 0, 0)
    assert [call["decode_step"].keywords["compiled"] for call in calls] == [False, True, False]
    assert {key: value for key, value in calls[0].items() if key != "decode_step"} == \
        {key: value for key, value in calls[1].items() if key != "decode_step"}
