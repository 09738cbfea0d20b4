"""The offline `tiny` model: built once from a recipe, cached, and loaded like any Hugging Face directory.

    "tiny"        -> built once (20-40 s on 2 CPU cores) into $PERIODIC_RL_CACHE (~/.cache/periodic-rl); its
                     tokenizer gets TINY_CHAT_TEMPLATE on load (conversations as the plain text it knows)
    "tiny-chain"  -> the same model warmed up on the long-tailed `chain` task instead (a few minutes, once)

The tiny model is a 2-layer Qwen2 (hidden 128, 4 heads, 2 KV heads, 0.33 M parameters) with a
byte-level tokenizer (one token per character for ASCII). It is warmed up with supervised learning
on the arithmetic train split (infra/tasks.py) whose targets *hedge*: with probability
`commit_probability` (0.3) the target is the sum alone, "37+45=82<eos>", otherwise the sum followed
by a second, wrong guess, "37+45=82 83<eos>". The model learns the arithmetic, and learns to hedge
70% of the time. The reward reads the *final* number, so a hedge scores 0: sampled held-out reward
starts near 0.3 although the model knows the answer, and GRPO lifts it by learning to commit —
one consistent decision (EOS right after the sum), which RL picks up in a few dozen steps.
`tiny-chain` is warmed up on `tasks.chain_working` targets without hedges: its weak start is real
(one wrong step spoils a long chain), and its responses have the chain task's long tail of lengths.

The cache folder is named by the recipe's hash (`recipe_key`); a build happens in a temporary folder renamed into
place, one process at a time (`build_lock`), so a killed build leaves no half-written model.

Deliberate departure: the tiny model's weak start is manufactured (the hedging targets above), not the result of
a short pre-training; it is an honest stand-in for "knows the answer, formats it badly", the kind of habit RL on
an LLM fixes first. (Flattening a sharp tiny model with a logit temperature was tried first: GRPO with Adam could
not undo it at any learning rate that kept the model intact.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers import __version__ as transformers_version

from infra.data import load_task
from infra.outputs import cache_root, make_directory
from infra.tasks import chain_working, one_line

TINY = "tiny"


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that decides the cached tiny model; its hash names the cache folder."""
    hidden_size: int = 128
    intermediate_size: int = 256  # 2x hidden, not Qwen's ~5x: as accurate here and a third faster
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    warmup_steps: int = 600  # AdamW steps on the arithmetic train split: ~16 s on 2 idle CPU cores
    batch_size: int = 128
    lr: float = 2e-3  # 3e-3 sometimes never leaves the plateau; 2e-3 reached 0.87-0.97 greedy over 4 seeds
    commit_probability: float = 0.3  # share of warm-up targets that state the sum alone (no hedge)
    seed: int = 0
    version: int = 4  # bump when the code below changes what gets built
    task: str = "arithmetic"  # what it is warmed up on: 'arithmetic' (hedged targets) or 'chain' (worked sums)


TINY_RECIPE = TinyRecipe()
# ~100-token targets: 4x the steps of arithmetic at a quarter of the batch (~3 min once, 1 core)
TINY_CHAIN_RECIPE = TinyRecipe(task="chain", warmup_steps=2400, batch_size=32, commit_probability=1.0)
TINY_RECIPES = {TINY: None, "tiny-chain": TINY_CHAIN_RECIPE}  # name -> recipe (None: TINY_RECIPE, read at call time)
EOS, PAD = "<|endoftext|>", "<|pad|>"
# The tiny model's chat template: a conversation (TRL's conversational format) as the plain text the model was warmed
# up on: a system message and a newline, the user's text as it is, an assistant's text and EOS; the generation prompt
# adds nothing. So [{"role": "user", "content": "37+45="}] is "37+45=", the same tokens as the text prompt.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}\n"
                      "{% elif m.role == 'assistant' %}{{ m.content }}{% if not loop.last %}" + EOS + "{% endif %}"
                      "{% else %}{{ m.content }}{% endif %}{% endfor %}")


def recipe_key(recipe: TinyRecipe) -> str:
    """Names the cache folder: the recipe, and transformers' major version (its saved tokenizer files differ:
    5.x writes a tokenizer class 4.x cannot load)."""
    key = {**dataclasses.asdict(recipe), "transformers": transformers_version.split(".")[0]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte: ASCII text is character-level, any other text still tokenizes (as bytes).

    Built as a byte-level BPE with no merges, exactly the pipeline transformers' Qwen2Tokenizer
    rebuilds from a saved tokenizer.json: AutoTokenizer picks that class for every qwen2 model
    (transformers 5) and would otherwise replace a custom pre-tokenizer, e.g. drop the spaces.
    """
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab = {token: index for index, token in enumerate([EOS, PAD] + byte_symbols)}
    tokenizer = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD,
                                   model_input_names=["input_ids", "attention_mask"])  # 4.x: no token_type_ids


def tiny_model(tokenizer: PreTrainedTokenizerBase, recipe: TinyRecipe, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised small Qwen2 (the architecture of the paper's models)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads, num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=4096,  # GSM8K questions are up to ~1000 characters
        tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():  # seed the init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny_model(out_dir: Path, seed: int = 0) -> None:
    """Save an untrained tiny model + tokenizer to `out_dir` (safetensors), loadable by from_pretrained."""
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer, TINY_RECIPE, seed).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def warm_up_target(task: str, example, commit: bool, offset: int) -> str:
    """What the tiny model learns to answer: the hedged sum (arithmetic) or the worked chain."""
    return chain_working(example.prompt) if task == "chain" else hedged_target(example.answer, commit, offset)


def hedged_target(answer: str, commit: bool, offset: int) -> str:
    """The warm-up target: the answer alone, or the answer and a wrong second guess (answer + offset).

    >>> hedged_target("82", True, 1), hedged_target("82", False, -2)
    ('82', '82 80')
    """
    return answer if commit else f"{answer} {int(answer) + offset}"


def _answer_batch(tokenizer: PreTrainedTokenizerBase, examples, commit_probability: float,
                  generator: torch.Generator, task: str = "arithmetic") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded 'a+b=' + target + EOS ids and labels (-100 on the prompt and the padding).

    >>> # '7+5=12<eos><pad><pad><pad>' -> labels [-100, -100, -100, -100, '1', '2', <eos>, -100, -100, -100]
    """
    commits = torch.rand(len(examples), generator=generator) < commit_probability  # (B,)
    offsets = torch.tensor([-2, -1, 1, 2])[torch.randint(4, (len(examples),), generator=generator)]  # (B,)
    rows = []
    for example, commit, offset in zip(examples, commits.tolist(), offsets.tolist()):
        prompt = tokenizer.encode(example.prompt, add_special_tokens=False)
        target = warm_up_target(task, example, commit, offset)
        answer = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (length - len(ids)) for ids, _ in rows])  # (B, L)
    labels = torch.tensor([lab + [-100] * (length - len(lab)) for _, lab in rows])  # (B, L)
    return input_ids, labels


def warm_up_tiny(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, steps: int, batch_size: int,
                 lr: float, seed: int = 0, commit_probability: float = 0.3, task: str = "arithmetic") -> float:
    """Supervised next-token training on the task's warm-up targets; returns the last loss.

    Right padding needs no attention mask: causal attention never looks at the pads after a sequence.
    """
    examples = load_task(task)[0]  # the task's train split
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # 50 steps of linear warm-up, then cosine to 0
        optimizer, lambda step: min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps)))
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        batch = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
        input_ids, labels = _answer_batch(tokenizer, [examples[i] for i in batch], commit_probability, generator,
                                          task)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    return loss.item()


def sweep_stale_builds(root: Path) -> None:
    """Remove the `.building-HOST-PID-*` folders of this host whose builder is gone (SIGKILL runs no clean-up)."""
    for folder in root.glob(f".building-{socket.gethostname()}-*"):
        pid = folder.name.rsplit("-", 2)[1]
        try:
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, PermissionError):  # not our name, or alive under another user
            pass


def ensure_tiny_model(cache_dir: str | Path | None = None, recipe: TinyRecipe | None = None) -> Path:
    """The warmed-up tiny model's directory, building it first if it is not cached.

    Built in a temporary folder and renamed into place, so a killed build leaves no half-written
    model. One process builds at a time (`build_lock`: a lock file, released by the OS however its holder ends);
    a second one waits and loads the first one's model. The folder is removed however the build ends, and a killed
    build's by the next one.
    """
    recipe = recipe or TINY_RECIPE  # read at call time so tests can swap in a short recipe
    root = cache_root(cache_dir)
    final = root / f"tiny-{recipe_key(recipe)}"
    if is_cached(final):
        return final
    make_directory(root, "the tiny-model cache (--cache-dir, $PERIODIC_RL_CACHE)")
    with build_lock(root / f".{final.name}.lock", final):
        if not is_cached(final, say=True):  # another process may have built it while this one waited
            if final.exists():
                shutil.rmtree(final)  # a damaged copy, or one half removed
            build_tiny_model_into(root, final, recipe)
    return final


BUILD_WAIT_S = 900.0  # the longest wait for another process's build (tiny-chain: a few minutes on one core)


@contextlib.contextmanager
def build_lock(path: Path, final: Path):
    """Hold the lock file `path` for a build into `final`: at once, or after a line saying so, waiting up to
    BUILD_WAIT_S. Where the file system cannot lock, or the wait runs out, the build goes on unlocked (two builds
    then race, and the first rename wins: build_tiny_model_into)."""
    lock = FileLock(path, mode=0o666)  # a cache a group shares: anyone may take the lock
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"periodic-rl: waiting for another process building the tiny model into {final} ...",
                  file=sys.stderr, flush=True)
            lock.acquire(timeout=BUILD_WAIT_S)
        held = True
    except (Timeout, NotImplementedError, OSError) as error:  # NotImplementedError: no flock on this file system
        print(f"periodic-rl: building the tiny model without its lock ({one_line(error)})",
              file=sys.stderr, flush=True)
        held = False
    try:
        yield
    finally:
        if held:
            lock.release()


def is_cached(final: Path, say: bool = False) -> bool:
    """Whether the tiny model in `final` is there and readable (`say`: print why a damaged one is rebuilt)."""
    if not (final / "config.json").is_file():
        return False
    try:
        load_file(final / "model.safetensors")  # 1.3 MB: cheap enough to check on every run
        return True
    except (SafetensorError, OSError) as error:  # a truncated or damaged cache: build it again
        if say:
            print(f"periodic-rl: the cached tiny model in {final} cannot be read ({one_line(error)}); rebuilding it",
                  file=sys.stderr, flush=True)
        return False


def build_tiny_model_into(root: Path, final: Path, recipe: TinyRecipe) -> None:
    """Warm up the tiny model of `recipe` and save it as `final` (under the caller's lock)."""
    print(f"periodic-rl: building the tiny model (once, about a minute on 2 cores; later runs load it) into {final} "
          "...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    sweep_stale_builds(root)
    building = Path(tempfile.mkdtemp(prefix=f".building-{socket.gethostname()}-{os.getpid()}-", dir=root))
    threads = torch.get_num_threads()
    # One thread: the same model whatever the caller's thread count, and on busy shared cores 4x
    # faster than two threads spin-waiting on each other (53 s vs 213 s measured at load average 4.5).
    torch.set_num_threads(1)
    try:
        tokenizer = tiny_tokenizer()
        model = tiny_model(tokenizer, recipe, recipe.seed)
        loss = warm_up_tiny(model, tokenizer, recipe.warmup_steps, recipe.batch_size, recipe.lr, recipe.seed,
                            recipe.commit_probability, recipe.task)
        model.save_pretrained(building)
        tokenizer.save_pretrained(building)
        (building / "recipe.json").write_text(json.dumps(
            {**dataclasses.asdict(recipe), "final_loss": loss}, indent=1))
        try:
            building.rename(final)
        except OSError:  # built unlocked (build_lock), and another process finished first: the same recipe
            if not is_cached(final):
                raise
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(building, ignore_errors=True)
    print(f"periodic-rl: tiny model ready in {time.perf_counter() - start:.0f}s (warm-up loss {loss:.3f})",
          file=sys.stderr, flush=True)
