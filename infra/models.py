"""Models: load a policy and its tokenizer by name, and build the offline `tiny` model.

Every model, the tiny one included, is a Hugging Face directory loaded through
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`, so the training code has one
path. A name is resolved in this order:

    "tiny"            -> built once (20-40 s on 2 CPU cores) into $PERIODIC_RL_CACHE (~/.cache/periodic-rl); its
                         tokenizer gets TINY_CHAT_TEMPLATE on load (conversations as the plain text it knows)
    "tiny-chain"      -> the same model warmed up on the long-tailed `chain` task instead (a few minutes, once)
    alias             -> hub id, e.g. qwen2.5-0.5b -> Qwen/Qwen2.5-0.5B-Instruct (the paper's Qwen2.5 family)
    local directory   -> that directory
    hub id            -> the HF cache first, then the hub

With `lora` (--use-peft) the loaded model comes wrapped by peft with a LoRA adapter (`with_lora`): the base
frozen, only the adapter trainable, published and saved (save_pretrained writes adapter_config.json and
adapter_model.safetensors, which `PeftModel.from_pretrained(base, path)` loads). peft is imported only then.

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

Deliberate departures:
1. The tiny model's weak start is manufactured (the hedging targets above), not the result of a short
   pre-training; it is an honest stand-in for "knows the answer, formats it badly", the kind of
   habit RL on an LLM fixes first. (Flattening a sharp tiny model with a logit temperature was tried
   first: GRPO with Adam could not undo it at any learning rate that kept the model intact.)
2. A hub id is looked up in the HF cache first (`local_files_only=True`) and the hub is then asked
   once without retries (tasks.hub_unreachable_reason): offline, transformers would retry each file
   with back-off for ~25 s before failing. A cached model is therefore never re-validated online. It is
   loaded from its folder in the cache, as a local directory: given the hub id, transformers looks for an
   adapter_config.json on the hub whenever peft is installed, even when told local_files_only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from huggingface_hub import constants as hub_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers import __version__ as transformers_version

from config import MODEL_ALIASES
from infra.data import load_task
from infra.errors import UserError
from infra.outputs import cache_root, make_directory
from infra.tasks import chain_working, hub_unreachable_reason

TINY = "tiny"
_LOAD_ERRORS = (OSError, ValueError, HfHubHTTPError)  # what from_pretrained raises for "not loadable"


class ModelNotFoundError(UserError):
    """A model name could not be loaded; the message lists what was tried and how to fix it."""


class ModelError(UserError):
    """A model was found but cannot be trained: unreadable weights, no tokenizer, not a causal language model."""


class PeftMissingError(UserError):
    """--use-peft without peft installed."""


# --- resolving names ---
def resolve_model(name: str) -> str:
    """Alias -> hub id ('qwen2.5-7b' -> 'Qwen/Qwen2.5-7B-Instruct'); anything else unchanged ('~' expanded)."""
    return MODEL_ALIASES.get(name.lower(), os.path.expanduser(name))


def _looks_like_path(name: str) -> bool:
    """'./m', '/abs/m', 'a/b/c' are paths; 'org/name' and 'gpt2' are hub ids."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1


def _fix_message(name: str, tried: list[str], hub_id: str | None) -> str:
    download = (f"pre-download it where the hub is reachable with `hf download {hub_id}` (`huggingface-cli "
                f"download` on older huggingface_hub) and point HF_HOME at that cache, " if hub_id else "")
    return (f"could not load model {name!r}. Tried: {'; '.join(tried)}. To fix: pass a local Hugging Face model "
            f"directory (--model path/to/model, with config.json, weights and tokenizer files), {download}"
            f"or use --model tiny (built in, offline). Aliases: {', '.join(MODEL_ALIASES)}.")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# --- loading ---
def _from_pretrained(source: str, device: str, dtype: torch.dtype, attn_implementation: str,
                     local_files_only: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        if is_adapter_directory(source):  # a --use-peft run's policy/: its base with the adapter merged in
            model = merged_adapter(source, dtype=dtype, attn_implementation=attn_implementation,
                                   local_files_only=local_files_only)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation,
                                                         local_files_only=local_files_only)  # first: clearest error
    except SafetensorError as error:
        raise ModelError(f"the weights of model {source} cannot be read ({_one_line(error)}): the file is "
                         "truncated or corrupt; download or save the model again") from None
    fix = ("put the model's tokenizer files there (tokenizer.json, tokenizer_config.json, ...: "
           "tokenizer.save_pretrained)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    except (TypeError, ImportError) as error:  # transformers 4.x without tokenizer files: a slow tokenizer's missing
        # vocabulary path, or the protobuf its fallback wants
        raise ModelError(f"model {source} has no usable tokenizer ({type(error).__name__}): {fix}") from None
    if not tokenizer.encode("1 + 1 = 2", add_special_tokens=False):  # transformers 5 makes an empty one when
        # the directory has no tokenizer files
        raise ModelError(f"model {source} has no usable tokenizer (it turns text into no tokens): {fix}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # generation pads finished rows; they are masked out anyway
    model = model.to(device)
    model.stored_dtype = stored_dtype(source, local_files_only)  # what --save-dtype model saves policy/ in
    if not is_causal(model):
        raise ModelError(f"model {source} ({type(model).__name__}) is not a causal language model: its prediction "
                         "at a position depends on the tokens after it. GRPO samples left to right: use a "
                         "decoder-only model (Qwen2, Llama, ...)")
    return model, tokenizer


def stored_dtype(source: str, local_files_only: bool) -> torch.dtype | None:
    """The dtype the model at `source` was stored in (its config.json's dtype; None where it names none, or
    `source` is an adapter, whose base says it)."""
    try:
        dtype = AutoConfig.from_pretrained(source, local_files_only=local_files_only).dtype
    except (OSError, ValueError):
        return None
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def weights_in(model: PreTrainedModel, dtype: torch.dtype | None) -> dict[str, torch.Tensor] | None:
    """The model's state_dict with its floating-point tensors in `dtype` (tied ones stay one tensor: the embeddings
    and the output layer), for save_pretrained; None to save as trained: no `dtype`, float32 (the masters' own), or
    a peft model (its adapter is saved as trained)."""
    if dtype is None or dtype == torch.float32 or hasattr(model, "peft_config"):
        return None
    cast: dict[int, torch.Tensor] = {}  # one copy per storage
    return {name: cast.setdefault(tensor.data_ptr(), tensor.to(dtype)) if tensor.is_floating_point() else tensor
            for name, tensor in model.state_dict().items()}


def mark_dtype(config_json: Path, dtype: torch.dtype) -> None:
    """config.json's dtype set to that of the weights saved beside it (save_pretrained writes the model's own)."""
    config = json.loads(config_json.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def is_causal(model: PreTrainedModel) -> bool:
    """Whether the logits at a position ignore later tokens, probed on two inputs that differ in their second token
    only (BERT loads as BertLMHeadModel, a 'causal LM' class, yet attends both ways unless is_decoder is set)."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([[1, 2], [1, 3]], device=device)).logits[:, 0].float()  # (2, V)
    return torch.allclose(logits[0], logits[1], rtol=1e-3, atol=1e-3 * logits.abs().max().item())


def load_model(name: str = TINY, device: str = "cpu", dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", cache_dir: str | None = None, lora: dict | None = None,
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) for `name`: 'tiny', an alias, a local directory or a hub id.

    `cache_dir` is where the tiny model is cached (default $PERIODIC_RL_CACHE or ~/.cache/periodic-rl);
    hub models use the usual HF cache (HF_HOME). Raises ModelNotFoundError with what was tried.
    `lora`: `with_lora`'s settings (Config.lora, --use-peft): the model comes wrapped in a peft PeftModel.
    """
    if lora and is_adapter_directory(resolve_model(name)):
        raise ModelError(f"--use-peft with model {name}, a LoRA adapter (a --use-peft run's policy/): a new adapter "
                         "on it would be saved against its base alone, without this one; leave out --use-peft to "
                         "train every weight of it merged into its base")
    model, tokenizer = _load(name, device, dtype, attn_implementation, cache_dir)
    return (with_lora(model, **lora) if lora else model), tokenizer


def _load(name: str, device: str, dtype: torch.dtype, attn_implementation: str, cache_dir: str | None
          ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    args = (device, dtype, attn_implementation)
    if name in TINY_RECIPES:
        model, tokenizer = _from_pretrained(str(ensure_tiny_model(cache_dir, TINY_RECIPES[name])), *args,
                                            local_files_only=True)
        tokenizer.chat_template = TINY_CHAT_TEMPLATE  # set on load: the cached builds stay valid
        return model, tokenizer
    source = resolve_model(name)
    tried = [f"alias {name!r} -> hub id {source!r}"] if name.lower() in MODEL_ALIASES else []
    if os.path.isdir(source):
        try:
            return _from_pretrained(source, *args, local_files_only=True)
        except _LOAD_ERRORS as error:
            raise ModelNotFoundError(_fix_message(name, tried + [f"local directory {source} ({_one_line(error)})"],
                                                  None)) from error
    tried.append(f"no local directory {os.path.abspath(source)}")
    if _looks_like_path(source):
        raise ModelNotFoundError(_fix_message(name, tried, None))
    try:  # the cache's folder of the hub id, loaded as a local directory (`snapshot_download` finds it on disk)
        return _from_pretrained(snapshot_download(source, local_files_only=True), *args, local_files_only=True)
    except _LOAD_ERRORS:
        tried.append(f"the HF cache {hub_constants.HF_HUB_CACHE} (not there, or incomplete)")
    reason = hub_unreachable_reason(source, "config.json")
    if reason is not None:
        raise ModelNotFoundError(_fix_message(name, tried + [f"the hub {hub_constants.ENDPOINT} ({reason})"], source))
    try:
        return _from_pretrained(source, *args, local_files_only=False)
    except _LOAD_ERRORS as error:
        raise ModelNotFoundError(_fix_message(name, tried + [f"downloading from the hub ({_one_line(error)})"],
                                              source)) from error


# --- LoRA through peft (--use-peft) ---
def import_peft():
    """peft, imported only when LoRA is asked for; one line naming the fix when it is not installed."""
    try:
        import peft
    except ImportError:
        raise PeftMissingError("--use-peft trains a LoRA adapter with peft, which is not installed: pip install peft"
                               ) from None
    return peft


def is_adapter_directory(source: str) -> bool:
    """A LoRA adapter's folder (peft's adapter_config.json, no config.json of a model): a --use-peft run's policy/."""
    folder = Path(source)
    return (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()


def merged_adapter(source: str, **load_kwargs) -> PreTrainedModel:
    """The model a LoRA adapter's folder makes: its base (adapter_config.json's base_model_name_or_path, loaded with
    `load_kwargs`) with the adapter merged in, W = W_0 + (alpha / r)·B A, as a plain model. A run started from a
    --use-peft run's policy then starts from what that run learned, every weight trained (with --use-peft it is
    refused: `load_model`); transformers alone would load the adapter unmerged and frozen (nothing to train)."""
    try:
        import peft
    except ImportError:
        raise PeftMissingError(f"model {source} is a LoRA adapter (adapter_config.json): loading it on its base "
                               "needs peft, which is not installed: pip install peft") from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # (with_lora's)
        merged = peft.AutoPeftModelForCausalLM.from_pretrained(source, **load_kwargs).merge_and_unload()
    return merged.requires_grad_(True)  # peft loaded it for inference: every weight frozen


def with_lora(model: PreTrainedModel, r: int, alpha: float, dropout: float, target_modules: list[str] | None,
              seed: int):
    """`model` wrapped by peft's `get_peft_model` with one LoRA adapter: each target layer computes
    W_0 x + (alpha / r)·B A x, with W_0 frozen, A drawn from `seed` (the same on every process) and B = 0, so the
    wrapped model starts at the base's exact outputs. `target_modules` as TRL's --lora-target-modules: None for
    peft's default of the architecture (q_proj and v_proj for Qwen2 and Llama), one name such as 'all-linear'
    (every linear layer but the output layer), or several module names."""
    peft = import_peft()
    targets = "all-linear" if target_modules == ["all-linear"] else target_modules  # peft's one special string
    if unmatched := unmatched_targets(model, targets):  # peft refuses only names that all match nothing
        linear = sorted({name.rpartition(".")[2] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ModelError(f"--lora-target-modules {' '.join(unmatched)}: no module of {type(model).__name__} is named "
                         f"so (its linear layers: {' '.join(linear)}; or all-linear)")
    try:
        config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                                 task_type="CAUSAL_LM")
        # A's draw leaves the caller's RNG alone; peft's warnings are kept, and said in one line each below
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings(record=True) as raised:
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft's
            # question to transformers 5, by the old name
            torch.manual_seed(seed)
            # the adapter in the model's dtype (peft would keep a bf16 model's in float32): a bf16 inference side then
            # holds exactly what the trainer publishes, in sync mode as in async
            wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as error:  # e.g. "Target modules {'x'} not found in the base model"
        raise ModelError(f"--use-peft: peft cannot add a LoRA adapter to {type(model).__name__} "
                         f"({_one_line(error)}); check --lora-target-modules") from None
    say_peft_warnings(raised)
    # peft saying, at each save, that it saves the embedding layers an adapter targets: what policy/ needs
    warnings.filterwarnings("ignore", "Setting `save_embedding_layers` to `True`", UserWarning)
    return wrapped


def say_peft_warnings(raised: list[warnings.WarningMessage]) -> None:
    """peft's warnings (a tied layer in the adapter) as one `periodic-rl: peft:` line each, without peft's file and
    line, once per run: by the trainer, not again by the inference process that loads the same; others as usual."""
    for w in raised:
        if "peft" not in Path(w.filename).parts:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        elif multiprocessing.parent_process() is None:
            print(f"periodic-rl: peft: {' '.join(str(w.message).split())}", flush=True)


def unmatched_targets(model: torch.nn.Module, targets: list[str] | str | None) -> list[str]:
    """The names in --lora-target-modules that match no module of `model`, as peft matches a list: a module's full
    name, or its last dotted parts (q_proj matches model.layers.0.self_attn.q_proj)."""
    if not isinstance(targets, list):  # None (peft's default for the architecture), all-linear
        return []
    names = [name for name, _ in model.named_modules()]
    return [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]


def load_adapter_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """A saved adapter's tensors (adapter_model.safetensors: peft's names, without the adapter's) into `model`'s
    adapter (infra/checkpoint.py's resume); ValueError naming what does not match."""
    result = import_peft().set_peft_model_state_dict(model, weights)
    adapter = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(adapter & set(result.missing_keys))
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter: missing {missing[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}")


# --- the tiny model ---
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
        print(f"periodic-rl: building the tiny model without its lock ({_one_line(error)})",
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
            print(f"periodic-rl: the cached tiny model in {final} cannot be read ({_one_line(error)}); rebuilding it",
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
