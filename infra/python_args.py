"""`trainer.train`'s Python arguments as trainer.py's command line: what TRL's `GRPOTrainer(model, reward_funcs,
args, train_dataset).train()` takes, turned into the options every process of the run can read.

- A reward function (or callable object) becomes the --reward spec another process imports it by (`reward_spec`):
  'module:name', or 'path/to/script.py:name' for the running script's own.
- A datasets.Dataset becomes a --data folder (`data_folder`), saved once under $PERIODIC_RL_CACHE/datasets by its
  fingerprint; TRL's GRPOConfig becomes a --config file (`args_file`), written once under $PERIODIC_RL_CACHE/configs.
- TRL's `peft_config` (peft's LoraConfig) becomes --use-peft and TRL's --lora-* options (`peft_options`); a model
  object or a `processing_class` is refused in one line, unless it names what --model loads (`model_name`): every
  process of the run loads its own copy from a hub id or a folder.
- The other keywords are options, ours or TRL's, with _ for - (`train_argv`).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

from infra import outputs


def reward_spec(function) -> str:
    """The --reward spec every process finds `function` by: 'module:name' for a function at the top level of an
    importable module, 'path/to/script.py:name' for one of the running script (spawned processes import it under
    its own name, where `if __name__ == "__main__":` keeps its run from starting again); a callable object (or a
    lambda, a partial) by the name it has at the top level of the script or of its module; a str is one already.
    ValueError for what no other process can find by name (a nested function, an object bound nowhere there).

    >>> reward_spec("math"), reward_spec(json.dumps)
    ('math', 'json:dumps')
    """
    if isinstance(function, str):
        return function
    name, module = getattr(function, "__qualname__", None), getattr(function, "__module__", None)
    found = getattr(sys.modules.get(module), name, None) if name and module else None
    if not (name and name.isidentifier() and found is function) and callable(function):  # an object (a callable
        # class's instance) at the top level of the script or of its class's module: found by that name
        wrapped = getattr(getattr(function, "func", None), "__module__", None)  # a partial: its function's module
        homes = [m for m in ("__main__", "__mp_main__", module, wrapped, type(function).__module__) if m in sys.modules]
        name, module = next(((attribute, home) for home in homes for attribute, value in vars(sys.modules[home]).items()
                             if value is function and attribute.isidentifier()), (None, None))
    if not (callable(function) and name):
        raise ValueError(f"reward {function!r}: give a function (or a callable object) defined at the top level of a "
                         "module or of the script, which the inference process imports by name (for a lambda or a "
                         "partial: `def reward(completions, **kwargs): return ...` at the top level), or its "
                         "--reward spec")
    if module not in ("__main__", "__mp_main__"):  # __mp_main__: the script, imported again in a spawned process
        return f"{module}:{name}"
    path = getattr(sys.modules[module], "__file__", None)
    if path is None or not Path(path).is_file():  # a notebook, `python -c`, a script read from stdin
        raise ValueError(f"reward {name!r} is defined in an interactive session, which the inference process cannot "
                         "import: put it in a .py file and give the function from there (or its 'file.py:name')")
    if name in main_only_names(Path(path)):
        raise ValueError(f"reward {name!r} is defined under `if __name__ == \"__main__\":` in {path}, which the "
                         "inference process imports without running that block: define it at the top level, "
                         "above the block")
    return f"{path}:{name}"


def main_only_names(script: Path) -> set[str]:
    """The names `script` binds only under `if __name__ == "__main__":` (or the else of `!=`), which a process that
    imports it, not runs it, never has; empty when it cannot tell (a star import, a file it cannot parse).

    >>> import tempfile; script = Path(tempfile.mkdtemp()) / "s.py"
    >>> _ = script.write_text("def f(): pass\\nif __name__ == '__main__':\\n    def g(): pass\\n    f = 1")
    >>> main_only_names(script)
    {'g'}
    """
    import ast

    def bound(statements: list) -> set[str]:  # names a statement binds in the module's scope (not in functions)
        names, todo = set(), list(statements)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)  # (its body is another scope)
                todo += node.decorator_list
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
                names.add(node.name)
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo += list(ast.iter_child_nodes(node))
        return names

    def guard(node) -> str | None:  # "Eq" for `if __name__ == "__main__":`, "NotEq" for `!=`, else None
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            sides = (test.left, test.comparators[0])
            if any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides) and any(
                    isinstance(side, ast.Constant) and side.value == "__main__" for side in sides):
                return type(test.ops[0]).__name__
        return None

    try:
        body = ast.parse(script.read_bytes()).body
    except (OSError, SyntaxError, ValueError):
        return set()
    outside, guarded = [], []
    for node in body:
        kind = guard(node)
        if kind in ("Eq", "NotEq"):
            guarded += node.body if kind == "Eq" else node.orelse
            outside += node.orelse if kind == "Eq" else node.body
        else:
            outside.append(node)
    if any(isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names)
           for statement in outside for node in ast.walk(statement)):
        return set()  # `from helpers import *` may bind any name
    return bound(guarded) - bound(outside)


def partial_copy(folder: Path) -> Path:
    """Where this process writes `folder` before renaming it there: NAME.HOST.PID.partial (the host: a cache may be
    shared by the nodes of a run, each writing the same data at once)."""
    return folder.with_name(f"{folder.name}.{socket.gethostname()}.{os.getpid()}.partial")


def remove_abandoned_copies(cache: Path) -> None:
    """Delete the half-written copies in `cache` (`partial_copy`) whose writer, a process of this host, is gone
    (SIGKILL, a power cut): a writer that ends otherwise removes its own; another host's copy is left alone."""
    from infra.processes import running
    for partial in cache.glob("*.partial") if cache.is_dir() else []:
        host, _, pid = partial.name.removesuffix(".partial").partition(".")[2].rpartition(".")
        if host == socket.gethostname() and pid.isdigit() and not running(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def data_folder(dataset, eval_dataset=None) -> str:
    """A --data folder holding a datasets.Dataset (or DatasetDict) given in Python, with `eval_dataset` as its test
    split: written once by datasets' save_to_disk under $PERIODIC_RL_CACHE/datasets, named by the data's
    fingerprints (datasets' hash of its contents and history), so that every process, a resume and a rerun of
    config.json read the same rows. A str or path is a --data value already."""
    import hashlib

    import datasets

    from infra.outputs import cache_root
    if isinstance(dataset, (str, os.PathLike)) and eval_dataset is None:
        return str(dataset)
    if eval_dataset is not None:
        if not isinstance(dataset, datasets.Dataset) or not isinstance(eval_dataset, datasets.Dataset):
            raise ValueError("eval_dataset goes with a train_dataset that is a datasets.Dataset: give both as "
                             "Datasets, or one DatasetDict with a 'test' split")
        dataset = datasets.DatasetDict({"train": dataset, "test": eval_dataset})
    if isinstance(dataset, datasets.Dataset):
        parts, prints = {"train_dataset": dataset}, [dataset._fingerprint]
    elif isinstance(dataset, datasets.DatasetDict):
        parts = {"eval_dataset" if split == "test" and eval_dataset is not None else f"train_dataset's {split!r} split":
                 part for split, part in dataset.items()}
        prints = [f"{split}={part._fingerprint}" for split, part in sorted(dataset.items())]
    else:
        raise ValueError(f"train_dataset is a {type(dataset).__name__}: give a datasets.Dataset or DatasetDict, or "
                         "a --data value (a hub id, a folder, a file)")
    empty = [name for name, part in parts.items() if len(part) == 0]
    if empty:  # (save_to_disk writes one, and load_from_disk fails on it with an IndexError)
        raise ValueError(f"{empty[0]} has no rows: give data with at least one")
    folder = cache_root() / "datasets" / hashlib.sha1(" ".join(prints).encode()).hexdigest()[:16]
    if not folder.exists():  # written beside, then renamed: a folder there is whole (not outputs.save_atomically,
        # which moves a folder there aside: another torchrun rank may be reading it)
        remove_abandoned_copies(folder.parent)
        partial = partial_copy(folder)
        shown = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # a copy into the cache: no bar of its own in the run's log
        try:
            dataset.save_to_disk(str(partial))
            outputs.fsync_tree(partial)  # whole on disk before the rename makes it the cache's
        except BaseException:  # a full disk, Ctrl-C: no half copy left behind
            shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:
            if shown:
                datasets.enable_progress_bars()
        try:
            partial.rename(folder)
            outputs.fsync(folder.parent)  # the rename itself
        except OSError:  # another process's (a torchrun rank's) rename won: the same rows
            shutil.rmtree(partial, ignore_errors=True)
    return str(folder)


def model_name(model, processing_class=None) -> str | None:
    """--model for `train`'s `model` (a hub id, a folder, an alias), checking TRL's `processing_class` against it: a
    tokenizer loaded from the same place is the one each process loads anyway. ValueError for a model object, or a
    tokenizer from elsewhere: the inference process cannot receive either, it loads its own from --model.

    >>> model_name("qwen2.5-0.5b")
    'qwen2.5-0.5b'
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
        raise ValueError(f"model is a {type(model).__name__} object; give its hub id or a folder (for a model changed "
                         "in Python: model.save_pretrained(folder) and tokenizer.save_pretrained(folder), then "
                         "model=folder): each process of the run loads its own copy"
                         + (f" (this one was loaded from {name!r})" if name else ""))
    if processing_class is not None:
        from config import MODEL_ALIASES

        def place(name) -> str:  # a folder by its path, an alias by its hub id
            return str(Path(name).resolve()) if Path(name).exists() else MODEL_ALIASES.get(name, name)
        source = processing_class if isinstance(processing_class, str) else getattr(processing_class,
                                                                                       "name_or_path", None)
        if model is None or source is None or place(str(source)) != place(str(model)):
            raise ValueError(f"processing_class loaded from {source!r}: the tokenizer is loaded from --model's folder "
                             f"({str(model)!r}); save yours there (tokenizer.save_pretrained(folder)) and give model="
                             "folder")
        if not isinstance(processing_class, str):
            print("periodic-rl: processing_class: each process loads the tokenizer from --model's place, so changes "
                  "made to this one in Python (its chat template, pad token) are not seen; to keep them, save it with "
                  "the model (save_pretrained(folder)) and give model=folder", flush=True)
    return None if model is None else str(model)


LORA_OPTIONS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",  # LoraConfig -> TRL's
                "target_modules": "lora_target_modules", "use_rslora": "use_rslora", "use_dora": "use_dora",
                "task_type": "lora_task_type", "modules_to_save": "lora_modules_to_save",
                "target_parameters": "lora_target_parameters"}
ALWAYS = ("r", "lora_alpha", "lora_dropout", "target_modules")
LORA_BOOKKEEPING = ("peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                    "inference_mode", "runtime_config")  # set by peft as it saves or loads, not a choice


def peft_options(peft_config) -> dict:
    """TRL's options for `peft_config` (peft's LoraConfig, as GRPOTrainer takes it): --use-peft and its --lora-*
    (whose own checks then refuse what LoRA here does not do: DoRA, rsLoRA, modules to save). ValueError for another
    adapter type, or a LoraConfig field set to what no option here expresses (bias, init_lora_weights, ...)."""
    import dataclasses
    if not dataclasses.is_dataclass(peft_config) or type(peft_config).__name__ != "LoraConfig":
        raise ValueError(f"peft_config is a {type(peft_config).__name__}: the adapter trained here is LoRA (give "
                         "peft's LoraConfig, or use_peft=True with lora_r, lora_alpha, ...)")
    default, options = type(peft_config)(), {"use_peft": True}
    for field in dataclasses.fields(peft_config):
        value = getattr(peft_config, field.name)
        if field.name in LORA_OPTIONS:  # r, alpha, dropout, modules always (TRL's defaults are not peft's); the rest
            if value is not None and (field.name in ALWAYS or value != getattr(default, field.name)) \
                    and value != "CAUSAL_LM":  # when set (a task type other than a causal LM's is refused)
                value = getattr(value, "value", value)  # peft's TaskType is an enum of str
                options[LORA_OPTIONS[field.name]] = sorted(value) if isinstance(value, (set, frozenset)) else value
        elif field.name not in LORA_BOOKKEEPING and value != getattr(default, field.name):
            raise ValueError(f"peft_config: LoraConfig's {field.name}={value!r} has no option here (LoRA here takes r, "
                             "lora_alpha, lora_dropout and target_modules; leave the rest at peft's defaults)")
    return options


def args_values(args) -> dict:
    """The options in `args`: TRL's GRPOConfig (what its to_dict() writes, less the keys of no use here that are at
    the class's defaults: trl_config.unset_keys_dropped) or a mapping of options."""
    import dataclasses
    values = args.to_dict() if hasattr(args, "to_dict") else args
    if not isinstance(values, dict):
        raise ValueError(f"args is a {type(args).__name__}: give TRL's GRPOConfig or a mapping of options")
    if dataclasses.is_dataclass(args):
        from infra.command_line import known_keys
        from infra.trl_config import unset_keys_dropped
        defaults = {field.name: field.default if field.default is not dataclasses.MISSING else field.default_factory()
                    for field in dataclasses.fields(args)
                    if field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING}
        values = unset_keys_dropped(values, defaults, known_keys())
    return values


def args_file(values: dict) -> str:
    """A --config file holding `values` (`args_values`): written once under $PERIODIC_RL_CACHE/configs
    (outputs.write_atomically), named by its contents, so that a rerun of the run's command finds it."""
    import hashlib

    from infra.outputs import cache_root
    text = json.dumps(values, sort_keys=True, default=str)
    path = cache_root() / "configs" / f"{hashlib.sha1(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        outputs.make_directory(path.parent, "the config cache ($PERIODIC_RL_CACHE)")
        outputs.write_atomically(path, text)
    return str(path)


def train_argv(model: str | None = None, reward_funcs=None, train_dataset=None, eval_dataset=None, args=None,
                 **options) -> list[str]:
    """`train`'s arguments as trainer.py's command line: reward functions as their --reward specs (`reward_spec`),
    a dataset as its --data folder (`data_folder`), `args` as a --config file (`args_file`), each option as
    --name=value (True/False as true/false, a list as its values, a mapping as JSON), which wins over args' as a
    typed option over a file's; None leaves an option at its default.

    >>> train_argv("tiny", "math", learning_rate=1e-5, log_completions=True, report_to=["none"])
    ['--model=tiny', '--reward', 'math', '--learning-rate=1e-05', '--log-completions=true', '--report-to', 'none']
    """
    model = model_name(model, options.pop("processing_class", None))
    if options.get("peft_config") is not None:
        options = {**peft_options(options.pop("peft_config")), **options}  # a keyword given too wins
    options.pop("peft_config", None)
    rewards = None if reward_funcs is None else [
        reward_spec(f) for f in (reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])]
    data = None if train_dataset is None else data_folder(train_dataset, eval_dataset)
    values = {} if args is None else args_values(args)
    argv = [] if args is None else ["--config", args_file(values)]
    if rewards is not None and values.get("reward_weights") is not None:  # the args' weights go with these rewards
        options.setdefault("reward_weights", values["reward_weights"])  # (a typed --reward re-derives a file's)
    if values.get("resume_from_checkpoint") not in (None, False) and "resume" not in options:  # TRL's scripts pass
        options.setdefault("resume_from_checkpoint", values["resume_from_checkpoint"])  # it to trainer.train(): a file
        # alone never resumes; a resume= keyword wins
    for key, value in {"model": model, "reward": rewards, "data": data, **options}.items():
        flag = "--" + key.replace("_", "-")
        if value == [] and key == "report_to":  # TRL's report_to [] (or "none"): no tracker
            value = ["none"]
        if value is None or value == []:
            continue
        if value is True or value is False:  # --flag=true: TRL's flags of no use here are read so too (--bf16=false)
            argv.append(f"{flag}={str(value).lower()}")
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv.append(f"{flag}={json.dumps(value) if isinstance(value, dict) else value}")
    return argv


class TrainedRun(type(Path())):  # PosixPath or WindowsPath: a subclass of Path itself needs Python 3.12
    """What `trainer.train` returns: the run's folder (--out), a Path as before (str(), /, ==, open), with what TRL's
    trainer offers once trained: `log_history` (metrics.jsonl's rows, one dict per iteration, TRL's keys),
    `policy_path` (<out>/policy, None with --no-save) and `save_model(output_dir)` (a copy of the policy there)."""

    @property
    def log_history(self) -> list[dict]:
        return outputs.read_metrics(Path(self) / "metrics.jsonl")

    @property
    def policy_path(self) -> Path | None:
        return Path(self) / "policy" if outputs.has_policy(Path(self)) else None

    def save_model(self, output_dir: str | os.PathLike) -> Path:
        """Copy the trained policy (a Hugging Face model directory, or peft's adapter) to `output_dir`, written
        atomically; returns it. ValueError where the run saved none (--no-save)."""
        if self.policy_path is None:
            raise ValueError(f"save_model: the run in {self} saved no policy (save=False); run it with saving on")
        target = Path(output_dir)
        with outputs.writing("the trained policy to", target):
            outputs.save_atomically(target, lambda folder: shutil.copytree(self.policy_path, folder,
                                                                          dirs_exist_ok=True))
        return target
