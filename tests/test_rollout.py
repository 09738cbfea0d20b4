"""Sampling on a Qwen2.5-Instruct-shaped model: exactly the distribution the trainer scores, stopped by every EOS."""
import torch
from transformers import GenerationConfig

from conftest import LOGIT_SCALE
from models import load_model
from rollout import (Settings, rollout_iteration, sample_responses, sampling_config, stop_token_ids,
                     trim_response)
from tasks import Example, prompt_token_ids

SETTINGS = Settings(seed=0, group_size=4, prompts_per_iteration=3, max_new_tokens=24, temperature=1.0, top_p=1.0,
                    eval_every=0, eval_samples=2, scale_rewards=True)
EXAMPLES = [Example("12+7=", "19"), Example("3+30=", "33"), Example("48+1=", "49")]


def length_reward(prompt: str, completion: str, answer: str) -> float:
    return float(len(completion))


def rollouts(model_dir) -> list[list[list[int]]]:
    model, tokenizer = load_model(str(model_dir))
    groups = rollout_iteration(model, tokenizer, EXAMPLES, [], length_reward, SETTINGS, iteration=0,
                               policy_version=0, final_iteration=1)
    return [group.responses for group in groups if hasattr(group, "responses")]


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
    settings = Settings(0, 16, 2, 64, 1.0, 1.0, 0, 1, True)
    both = sample_responses(model, prompts, 16, sampling_config(settings, stops, endoftext), seed=3)
    alone = sample_responses(model, prompts, 16, sampling_config(settings, [im_end], endoftext), seed=3)
    responses, unstopped = [r for g in both for r in g], [r for g in alone for r in g]
    stopped = [r for r in responses if r[-1] == endoftext]
    assert stopped, "no response reached <|endoftext|>: the check would be vacuous"
    assert all(len(r) < 64 and endoftext not in r[:-1] for r in stopped)
    assert any(endoftext in r[:-1] for r in unstopped), "with one EOS id the same samples should run past it"


def test_trim_response_cuts_at_the_first_of_any_eos():
    """Claim: trimming keeps the first stop token and drops everything after it, whichever EOS it is."""
    assert trim_response([5, 7, 2, 0, 0], [3, 2]) == [5, 7, 2]
    assert trim_response([5, 3, 2], [3, 2]) == [5, 3]
    assert trim_response([5, 6], [3, 2]) == [5, 6]
