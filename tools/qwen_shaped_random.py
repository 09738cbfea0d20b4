"""A model directory shaped like Qwen2.5-0.5B-Instruct with random weights, for GPU runs where the hub is out of reach.

    python tools/qwen_shaped_random.py OUT_DIR [--seed 0]

What is Qwen's and what is not:
- the model: Qwen2.5-0.5B-Instruct's config.json (24 layers, hidden 896, 14 query / 2 key-value heads, MLP 4864,
  vocabulary 151,936 rows, tied embeddings, rope theta 1e6), 494 M parameters, randomly initialised
  (`initializer_range` 0.02), saved in bfloat16 as the hub ships it;
- generation_config.json: two EOS ids (<|im_end|>, <|endoftext|>) and the sampling defaults Qwen ships
  (`QWEN_SAMPLING`; periodic-rl and TRL both override them with their own settings);
- the tokenizer: NOT Qwen's (151,643 BPE merges, unreachable offline) but the tiny model's byte-level one with
  Qwen's chat tokens and chat template (`QWEN_CHAT_TEMPLATE`). A prompt is about one token per byte, so a
  GSM8K question in the chat template is ~450 tokens (~130 with Qwen's tokenizer). Sampled ids above the
  tokenizer's 260 decode to nothing, on both sides alike.

Random weights put ~1/151,936 of the probability on each EOS id, so nearly every response runs to the token
limit: uniform response lengths, where streaming by completion has no early groups to hand over.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Qwen2.5-Instruct's chat template without its tool-calling branch (the shape of the real one).
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# The sampling defaults Qwen2.5-0.5B-Instruct ships in generation_config.json.
QWEN_SAMPLING = dict(do_sample=True, repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20)
# Qwen2.5-0.5B-Instruct's config.json (architecture fields)
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", initializer_range=0.02)


def qwen_chat_tokenizer(tokenizer):
    """Add Qwen's chat tokens and template to a tokenizer; EOS <|im_end|>, pad <|endoftext|>, as Qwen's."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def qwen_generation_config(tokenizer):
    """Qwen2.5-Instruct's generation_config: two EOS ids and its sampling defaults."""
    from transformers import GenerationConfig
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return GenerationConfig(bos_token_id=endoftext, pad_token_id=endoftext, eos_token_id=[im_end, endoftext],
                            **QWEN_SAMPLING)


def build(out: Path, seed: int = 0) -> Path:
    """Write the directory (config, bf16 safetensors, tokenizer, generation_config) and return it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infra.tiny import tiny_tokenizer
    tokenizer = qwen_chat_tokenizer(tiny_tokenizer())
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(**QWEN_05B, bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = qwen_generation_config(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build(args.out, args.seed)
    print(f"wrote {path} (Qwen2.5-0.5B-Instruct-shaped, random weights)")


if __name__ == "__main__":
    main()
