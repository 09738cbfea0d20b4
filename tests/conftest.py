"""Shared fixtures: the repository on sys.path, where GSM8K lies, a small random Qwen2 model saved like a real one."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# GSM8K (train.jsonl, test.jsonl) is read from a path, never copied into the repository; tests that need it skip
# when it is absent. Default: the checkout's sibling shared/data/gsm8k; PERIODIC_RL_GSM8K overrides.
GSM8K_DIR = Path(os.environ.get("PERIODIC_RL_GSM8K", ROOT.parent / "shared" / "data" / "gsm8k"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny Qwen2 model + tokenizer in a directory, loaded through from_pretrained like any model."""
    from models import build_tiny_model
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path, seed=0)
    return path


# Qwen2.5-Instruct's chat template without its tool-calling branch (the shape of the real one).
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# The sampling defaults Qwen2.5-0.5B-Instruct ships in generation_config.json.
LOGIT_SCALE = 8.0
QWEN_SAMPLING = dict(do_sample=True, repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20)


def save_qwen_shaped(source: Path, out: Path) -> Path:
    """The tiny model re-shaped like Qwen2.5-Instruct: <|im_start|>/<|im_end|> added, the tokenizer's EOS is
    <|im_end|>, its pad <|endoftext|>; generation_config lists both as EOS ([<|im_end|>, <|endoftext|>]) with
    the sampling defaults Qwen ships."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(source)
    torch.manual_seed(0)  # the two new embedding rows
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # peaked next-token distributions, as a trained LLM has (random init is nearly flat)
        model.model.norm.weight.mul_(LOGIT_SCALE)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id = im_end, endoftext, endoftext
    model.generation_config = GenerationConfig(bos_token_id=endoftext, pad_token_id=endoftext,
                                               eos_token_id=[im_end, endoftext],
                                               **QWEN_SAMPLING)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def qwen_shaped_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A model directory shaped like Qwen2.5-Instruct: chat template, two EOS ids, Qwen's shipped sampling."""
    return save_qwen_shaped(tiny_model_dir, tmp_path_factory.mktemp("qwen-shaped"))


@pytest.fixture(scope="session")
def qwen_shaped_bare_dir(qwen_shaped_dir, tmp_path_factory) -> Path:
    """The same weights and tokenizer (copied) with a generation_config that ships no sampling defaults."""
    import json
    import shutil
    out = tmp_path_factory.mktemp("qwen-bare") / "model"
    shutil.copytree(qwen_shaped_dir, out)
    config = json.loads((out / "generation_config.json").read_text())
    for key in QWEN_SAMPLING:
        config.pop(key)
    (out / "generation_config.json").write_text(json.dumps(config))
    return out
