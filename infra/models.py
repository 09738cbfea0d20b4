"""Models: load a policy and its tokenizer by name.

Every model, the offline tiny one included (infra/tiny.py), is a Hugging Face directory loaded through
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`, so the training code has one
path. A name is resolved in this order:

    "tiny", "tiny-chain" -> built once into $PERIODIC_RL_CACHE (~/.cache/periodic-rl): infra/tiny.py
    alias             -> hub id, e.g. qwen2.5-0.5b -> Qwen/Qwen2.5-0.5B-Instruct (the paper's Qwen2.5 family)
    local directory   -> that directory
    hub id            -> the HF cache first, then the hub

With `lora` (--use-peft) the loaded model comes wrapped by peft with a LoRA adapter (`with_lora`): the base
frozen, only the adapter trainable, published and saved (save_pretrained writes adapter_config.json and
adapter_model.safetensors, which `PeftModel.from_pretrained(base, path)` loads). peft is imported only then.

Deliberate departure: a hub id is looked up in the HF cache first (`local_files_only=True`) and the hub is then
asked once without retries (tasks.hub_unreachable_reason): offline, transformers would retry each file with
back-off for ~25 s before failing. A cached model is therefore never re-validated online. It is loaded from its
folder in the cache, as a local directory: given the hub id, transformers looks for an adapter_config.json on the
hub whenever peft is installed, even when told local_files_only.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from pathlib import Path

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from config import MODEL_ALIASES
from infra.errors import UserError
from infra.tasks import hub_unreachable_reason, one_line
from infra.tiny import TINY, TINY_CHAT_TEMPLATE, TINY_RECIPES, ensure_tiny_model

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
        raise ModelError(f"the weights of model {source} cannot be read ({one_line(error)}): the file is "
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
            raise ModelNotFoundError(_fix_message(name, tried + [f"local directory {source} ({one_line(error)})"],
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
        raise ModelNotFoundError(_fix_message(name, tried + [f"downloading from the hub ({one_line(error)})"],
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
                         f"({one_line(error)}); check --lora-target-modules") from None
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
