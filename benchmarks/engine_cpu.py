"""Sampling seconds per iteration on CPU: the rollout engine (engine.py) against today's Hugging Face `generate` path
(hf_generate.sample_responses with hf_generate.sampling_config), side by side in one process, interleaved.

    python benchmarks/engine_cpu.py [--layers 2] [--prompts 4] [--group-size 8] [--max-new-tokens 48] [--rounds 3]
                                    [--compile]

Model: Qwen2.5-0.5B's width (hidden 896, 14 query / 2 key-value heads, MLP 4864, vocabulary 151,936, tied
embeddings) with --layers layers, random weights, float32. Prompts: the first --prompts GSM8K questions, one token
per UTF-8 byte (the length the project's offline tokenizer gives; with random weights which ids does not matter).
Random weights almost never draw an EOS id, so every response runs to --max-new-tokens on both sides.

Each round samples one iteration with each side (which goes first alternates) and prints both times; then the
median per side and the ratio hf / engine (target: 1.6x or more). --compile adds a third side, the engine with
its layers compiled (--engine compile), after an untimed first call whose seconds (the compilation) are printed.
A last, untimed iteration of each side splits the time: the engine's prefill, decode forwards and draws;
`generate`'s prefill and decode forwards (the rest: its sampling and bookkeeping).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import engine  # noqa: E402
from benchmarks.common import count  # noqa: E402
from infra import compiled_step, hf_generate  # noqa: E402



def eos_ids(vocab: int) -> list[int]:
    """Qwen2.5-Instruct's <|im_end|> and <|endoftext|> (also the pad id); the last two ids of a smaller vocabulary."""
    return [151645, 151643] if vocab > 151645 else [vocab - 1, vocab - 2]


def qwen_wide_model(layers: int, vocab: int, seed: int = 0) -> Qwen2ForCausalLM:
    stops = eos_ids(vocab)
    config = Qwen2Config(vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=stops[0],
                         pad_token_id=stops[1])
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def gsm8k_prompts(path: Path, count: int) -> list[list[int]]:
    """The first `count` questions, one id per UTF-8 byte (shifted past 0..2)."""
    with open(path) as lines:
        questions = [json.loads(line)["question"] for line, _ in zip(lines, range(count))]
    return [[byte + 3 for byte in question.encode()] for question in questions]


def flips(a: list[list[list[int]]], b: list[list[list[int]]]) -> tuple[list[int], list[int]]:
    """Two calls' responses compared row by row: (the step of each row's first differing token, sorted; the tokens
    each row drew from prefixes equal on both sides, up to and including its first difference).

    >>> flips([[[1, 2, 3], [4, 5]]], [[[1, 9, 3], [4, 5]]])
    ([1], [2, 2])
    """
    firsts, drawn = [], []
    for x, y in ((x, y) for group_a, group_b in zip(a, b) for x, y in zip(group_a, group_b)):
        first = next((t for t, (p, q) in enumerate(zip(x, y)) if p != q), None)
        firsts += [] if first is None else [first]
        drawn.append(min(len(x), len(y)) if first is None else first + 1)
    return sorted(firsts), drawn


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Stopwatch:
    """Seconds spent in chosen functions, by label: wraps them while active."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)  # keeps the signature: generate passes logits_to_keep only to a forward naming it
        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            key = label(*args, **kwargs) if callable(label) else label
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
            return result
        setattr(owner, name, timed_call)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl",
                        help="GSM8K train.jsonl (the questions are the prompts)")
    parser.add_argument("--layers", type=count(), default=2, help="decoder layers of the Qwen2.5-0.5B-wide model")
    parser.add_argument("--vocab", type=count(3), default=151936, help="vocabulary size (Qwen2.5's by default)")
    parser.add_argument("--prompts", type=count(), default=4, help="prompts per iteration")
    parser.add_argument("--group-size", type=count(), default=8, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=count(), default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--rounds", type=count(), default=3, help="timed iterations per side")
    parser.add_argument("--threads", type=count(0), default=None, help="torch threads (default, or 0: torch's)")
    parser.add_argument("--no-split", action="store_true", help="skip the untimed iteration that splits the time")
    parser.add_argument("--compile", action="store_true", help="add the engine with its layers compiled (a third side)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = qwen_wide_model(args.layers, args.vocab)
    prompts = gsm8k_prompts(args.data, args.prompts)
    settings = SimpleNamespace(temperature=args.temperature, top_p=args.top_p, top_k=0, min_p=None,
                               max_new_tokens=args.max_new_tokens)
    stops = eos_ids(args.vocab)
    generation = hf_generate.sampling_config(settings, stops, stops[1])

    def run_engine(compile_step: bool = False):
        return engine.sample_groups(model, prompts, args.group_size, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, top_p=args.top_p, stop_ids=stops,
                                    keys=[(0, 0, j) for j in range(len(prompts))],
                                    decode_step=compiled_step.decode_step if compile_step else None)

    def run_hf():
        return hf_generate.sample_responses(model, prompts, args.group_size, generation, seed=0)

    print(f"engine_cpu: Qwen2.5-0.5B-wide, {args.layers} layers, vocabulary {args.vocab}, float32, "
          f"{torch.get_num_threads()} threads | {len(prompts)} GSM8K prompts ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens) x {args.group_size} samples x {args.max_new_tokens} new tokens")
    sides = {"engine": run_engine, "hf": run_hf}
    if args.compile:
        sides["compiled"] = functools.partial(run_engine, compile_step=True)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    with torch.no_grad():
        run_engine()  # warm-up: first-call allocations, lazy imports
        if args.compile:
            start = time.perf_counter()
            tokens = sides["compiled"]()
            first = time.perf_counter() - start
            differ, drawn = flips(run_engine(), tokens)
            print(f"compiled side: first call {first:.1f} s (its compilation); rows that differ from the eager "
                  f"engine's: {len(differ)} of {len(drawn)} (first at steps {differ}: {len(differ)} flips in "
                  f"{sum(drawn)} tokens drawn from equal prefixes); a second compiled call samples the first's: "
                  f"{sides['compiled']() == tokens}", flush=True)
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            for side in order:
                seconds[side].append(timed(sides[side]))
            print(f"round {round_}: " + "  ".join(f"{side} {seconds[side][-1]:.2f} s" for side in sides), flush=True)
    engine_s, hf_s = statistics.median(seconds["engine"]), statistics.median(seconds["hf"])
    print(f"sampling seconds per iteration (median of {args.rounds}): engine {engine_s:.2f}  hf {hf_s:.2f}  "
          f"ratio hf/engine {hf_s / engine_s:.2f}x (target >= 1.6x)")
    if args.compile:
        compiled_s = statistics.median(seconds["compiled"])
        print(f"compiled {compiled_s:.2f} s: engine/compiled {engine_s / compiled_s:.2f}x")
    if not args.no_split:
        split(model, run_engine, run_hf)


def split(model, run_engine, run_hf) -> None:
    """Where each side's time goes, from one more (untimed) iteration each."""
    watch = Stopwatch()
    watch.wrap(engine.GenerateCall, "prefill", "engine prefill")
    watch.wrap(engine.GenerateCall, "decode", "engine decode")
    watch.wrap(engine.GenerateCall, "draw", lambda *args, **kwargs: "engine draws")
    total = timed(run_engine)
    s = watch.seconds
    print(f"engine split: total {total:.2f} s = prefill {s['engine prefill']:.2f} (draw of the first tokens "
          f"included) + decode steps {s['engine decode']:.2f} (of which draws {s['engine draws']:.2f}, all steps) + "
          f"host {total - s['engine prefill'] - s['engine decode']:.2f}")
    watch = Stopwatch()
    watch.wrap(model, "forward",
               lambda *args, **kwargs: "hf prefill" if kwargs["input_ids"].shape[1] > 1 else "hf decode")
    total = timed(run_hf)
    del model.forward  # back to the class's
    s = watch.seconds
    print(f"hf split: total {total:.2f} s = prefill forwards {s.get('hf prefill', 0):.2f} + decode forwards "
          f"{s.get('hf decode', 0):.2f} + sampling and generate's bookkeeping "
          f"{total - s.get('hf prefill', 0) - s.get('hf decode', 0):.2f}")


if __name__ == "__main__":
    main()
