"""The rewards, loaded: named by `--reward` (repeatable), imported, their form read, weighted (infra/scoring.py calls
them: within a time limit, their values checked, several added up).

A reward is a plain Python function, in one of two forms, told apart by its parameter names (`is_batched`):

    plain    reward(prompt, completion, answer) -> float      one call per completion; e.g. tasks.math_reward
    batched  reward(prompts, completions, **kwargs) -> list    TRL's form: one call per group of G completions

The batched form is TRL GRPOTrainer's (`_calculate_rewards`): recognised by a parameter named `prompts` or
`completions`, or by **kwargs alone without one named `completion`; what it is called with is infra/scoring.py's.
Either form may be `async def`.

A reward needs the gold answer if it is plain (its third argument) or takes a parameter `answer` without a
default (math-verify), and, batched, each column named by a parameter without a default that TRL's keywords do
not fill (`needed_columns`): data without them is refused at start-up (data.load_task), naming the reward.
Several rewards (`--reward a.py:f --reward b.py:g --reward-weights 1 0.2`) are one `Rewards`: the functions, their
weights, and their names in the logs (`rewards/<name>/mean`, TRL's: the function's __name__, numbered when two share
it).

Built in: `math` (tasks.math_reward, GSM8K's final number) and `math-verify` (infra/math_verify_reward.py,
Hugging Face's math-verify: \\boxed{}, fractions, LaTeX). Others are named `package.module:function` or
`path/to/file.py:function`, and load as `import` would from the working directory or the file's folder
(`_importable`, `_load_file`). A file that fails to import is one `RewardError` line naming its failing line.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import keyword
import os
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from inspect import Parameter
from pathlib import Path
from typing import Callable

from infra.errors import UserError
from infra.tasks import math_reward

Reward = Callable[..., object]  # plain: (prompt, completion, answer) -> float; batched: (prompts, completions, **kw)


class RewardError(UserError):
    """A reward function raised (or exited), ran past --reward-timeout, or returned something that is not one
    finite real number."""


def user_frame(error: BaseException, ours: str = __file__) -> tuple[str, int, str] | None:
    """(path, line number, source line) of the innermost frame of the user's own code in `error`'s traceback (not
    the standard library's, an installed package's or `ours`, the file of ours that called the user's code; else the
    innermost frame), the path as the user named it (relative to the working directory when below it); the offending
    line of a SyntaxError; None without a traceback."""
    if isinstance(error, SyntaxError):
        return error.filename, error.lineno, (error.text or "").strip()
    libraries = {os.path.realpath(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if frame.filename != ours
           and not any(os.path.realpath(frame.filename).startswith(folder + os.sep) for folder in libraries)]
    frame = (own or frames or [None])[-1]
    if frame is None:
        return None
    path = os.path.relpath(frame.filename) if frame.filename.startswith(os.getcwd() + os.sep) else frame.filename
    return path, frame.lineno, frame.line or ""


def _failing_line(error: BaseException) -> str:
    """'path, line N: Type: message' for an error raised while importing a reward module (`user_frame`)."""
    at = user_frame(error)
    message = error.msg if isinstance(error, SyntaxError) else error
    return f"{at[0]}, line {at[1]}: {type(error).__name__}: {message}" if at else f"{type(error).__name__}: {message}"


def _importable(folder: Path) -> None:
    """Puts `folder` on sys.path, for good (a reward may import at call time), as running the file or `import module`
    from there would: a reward file's own folder (`from helper import score` beside it), or for 'module:function'
    the working directory (sys.path[0] is trainer.py's folder, not it). Appended: the trainer's own modules and
    installed packages still win over a same-named file there. Spawned processes inherit sys.path and the working
    directory, and load_rewards there does the same."""
    if str(folder) not in sys.path:
        sys.path.append(str(folder))


def _load_file(path: Path, function_name: str | None = None):
    """The module of a reward file, registered in sys.modules before it runs, as `import` does (dataclasses, and
    `from __future__ import annotations` with them, look the module up there): under its stem when `import stem`
    finds this very file, else under a name of its own that no package has. Loaded once per process, as import is."""
    resolved, stem = path.resolve(), path.stem

    def is_this_file(origin) -> bool:
        return bool(origin) and Path(origin).resolve() == resolved

    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]  # the same name in every process
    name = "_reward_" + re.sub(r"\W", "_", stem) + "_" + digest
    if stem.isidentifier() and not keyword.iskeyword(stem):
        if stem in sys.modules:
            free = is_this_file(getattr(sys.modules[stem], "__file__", None))
        else:
            try:
                found = importlib.util.find_spec(stem)
            except (ImportError, ValueError):
                found = None
            free = found is None or is_this_file(found.origin)
        name = stem if free else name
    loaded = sys.modules.get(name)
    if loaded is not None and is_this_file(getattr(loaded, "__file__", None)):
        return loaded
    script = sys.modules.get("__main__")  # the running script (trainer.train's caller; a spawned process's copy of it)
    if script is not None and is_this_file(getattr(script, "__file__", None)) and hasattr(script, function_name or ""):
        return script  # not run a second time (a function defined below its `if __name__` block is not there yet)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # as a failed import leaves nothing behind
        raise
    return module


# TRL's CLI names for trl.rewards' functions (trl/scripts/grpo.py, reward_funcs_registry): what each loads
TRL_REGISTRY = {"accuracy_reward": "trl.rewards.accuracy_reward",
                "reasoning_accuracy_reward": "trl.rewards.reasoning_accuracy_reward",
                "think_format_reward": "trl.rewards.think_format_reward",
                "get_soft_overlong_punishment": "trl.rewards.get_soft_overlong_punishment"}
TRL_FACTORY_ARGUMENTS = {"get_soft_overlong_punishment": {"max_completion_len": 1280, "soft_punish_cache": 256}}


def functions_in(path: Path) -> str:
    """', with NAME one of: f, g' for the functions `path` defines at its top level (read, not run), or why not."""
    import ast
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except OSError as error:
        return f" (and {path} cannot be read: {error.strerror or error})"
    except SyntaxError as error:
        return f" (and {path} does not parse: line {error.lineno}: {error.msg})"
    names = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return f", with NAME one of: {', '.join(names)}" if names else f" (and {path} defines no function)"


def load_reward(spec: str) -> Reward:
    """'math' -> `math_reward`; 'math-verify' -> `math_verify_reward`; 'package.module:function' (or TRL's
    'package.module.function', its CLI's reward_funcs) or 'path/to/file.py:function' -> that function; a name in
    TRL's CLI registry (accuracy_reward, think_format_reward, ...) -> trl.rewards' function, as TRL's CLI makes it."""
    if spec in TRL_REGISTRY:
        if importlib.util.find_spec("trl") is None:
            instead = " (or --reward math-verify: math-verify's check too)" if spec.endswith("accuracy_reward") else ""
            raise RewardError(f"--reward {spec!r} is TRL's {TRL_REGISTRY[spec]}, and trl is not installed: pip "
                              f"install trl{instead}")
        function = load_reward(TRL_REGISTRY[spec])
        return function(**TRL_FACTORY_ARGUMENTS[spec]) if spec in TRL_FACTORY_ARGUMENTS else function
    if spec == "math":
        return math_reward
    if spec == "math-verify":
        try:
            from infra.math_verify_reward import math_verify_reward
        except ImportError as error:
            raise RewardError(f"--reward math-verify needs Hugging Face's math-verify ({error}): "
                              "pip install 'math-verify>=0.9'") from None
        return math_verify_reward
    module_name, sep, function_name = spec.rpartition(":")  # rpartition: Windows paths contain ':'
    if not sep and "." in spec and not spec.endswith(".py") and "/" not in spec:  # TRL's CLI: package.module.function
        module_name, sep, function_name = spec.rpartition(".")
    if not sep and spec.endswith(".py"):  # a file without its function: name the functions it defines
        raise RewardError(f"--reward {spec!r} names a file, not the function in it: use '{spec}:NAME'"
                          + functions_in(Path(spec)))
    if not sep and spec.count("/") == 1 and not Path(spec).exists():  # TRL also takes a reward model's hub id
        raise RewardError(f"--reward {spec!r} looks like a model on the Hub: reward models are not supported here "
                          "(TRL's reward_funcs takes them); a reward is a Python function, 'module:function' or "
                          "'path/to/file.py:function', which may call such a model itself")
    if not sep or not module_name or not function_name:
        raise RewardError(f"--reward {spec!r} is not understood: use 'math' (built-in GSM8K/arithmetic "
                          "correctness), 'math-verify' (LaTeX answers), or 'module:function' / "
                          "'path/to/file.py:function' naming a function reward(prompt, completion, answer) -> float "
                          "or TRL's reward(prompts, completions, **kwargs) -> list[float].")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise RewardError(f"--reward {spec!r}: the file {path} does not exist (relative paths are resolved "
                              f"from {Path.cwd()}). Pass an existing .py file, or a module importable from here.")
    _importable(path.resolve().parent if module_name.endswith(".py") else Path.cwd())
    try:
        if module_name.endswith(".py"):
            module = _load_file(path, function_name)
        else:
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name and not module_name.startswith(f"{error.name}."):  # the module exists; what it
            # imports does not
            raise RewardError(f"--reward {spec!r}: {_failing_line(error)}. Install it, or fix the import.") from None
        raise RewardError(f"--reward {spec!r}: cannot import module {module_name!r} ({error}). Make it "
                          "importable (install it or run from its folder), or pass 'path/to/file.py:function'."
                        ) from None
    except (Exception, SystemExit) as error:  # a syntax error, or code that fails when the module is imported
        relative = isinstance(error, ImportError) and "relative import" in str(error) and module_name.endswith(".py")
        fix = (f"A file with relative imports is part of a package: name it as a module from the package's parent "
               f"folder, e.g. --reward {'.'.join(Path(module_name).with_suffix('').parts[-2:])}:{function_name}"
               if relative else "Fix it there.")
        raise RewardError(f"--reward {spec!r}: importing {module_name} failed: {_failing_line(error)}. {fix}"
                          ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(f"--reward {spec!r}: {module_name} has no function {function_name!r} at its top level. "
                          f"Define {function_name}(prompt, completion, answer) -> float there (or TRL's "
                          f"{function_name}(completions, **kwargs) -> list[float]), or name another function.")
    return function


def is_batched(function: Reward) -> bool:
    """TRL's form: a parameter named `prompts` or `completions`, or **kwargs without one named `completion`.

    >>> is_batched(lambda prompts, completions, **kwargs: [1.0]), is_batched(lambda prompt, completion, answer: 1.0)
    (True, False)
    """
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the plain form
        return False
    takes_keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return "prompts" in parameters or "completions" in parameters or takes_keywords and "completion" not in parameters


TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")  # every call


def needed_columns(function: Reward) -> list[str]:
    """The dataset columns `function` cannot be called without: ['answer'] for the plain form (the gold answer is
    its third argument, unless that has a default); for TRL's form, each parameter without a default that TRL's own
    keywords do not fill ('answer' for math-verify, 'solution' for trl.rewards.accuracy_reward; none for
    f(completions, **kwargs)).

    >>> needed_columns(lambda prompt, completion, answer: 1.0), needed_columns(lambda completions, solution, **kw: [])
    (['answer'], ['solution'])
    """
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the plain form, called with an answer
        return [] if is_batched(function) else ["answer"]
    if not is_batched(function):
        positional = [p for p in parameters if p.kind in (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD)]
        optional = (positional[2].default is not Parameter.empty if len(positional) > 2
                    else any(p.kind is Parameter.VAR_POSITIONAL for p in parameters))
        return [] if optional else ["answer"]
    return [p.name for p in parameters if p.kind in (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY)
            and p.default is Parameter.empty and p.name not in TRL_KEYWORDS]


def reward_name(function: Reward) -> str:
    """A reward's name in the logs, as TRL's `get_callable_name`: __name__ (through functools.partial), else the
    class name of a callable object."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


@dataclass
class Rewards:
    """The run's reward functions (either form) and their weights; `names` label their columns in the logs."""
    functions: list[Reward]
    weights: list[float]
    specs: list[str] | None = None  # how --reward named each (load_rewards), for messages

    def __post_init__(self):
        self.batched = [is_batched(function) for function in self.functions]  # each one's form, read once

    def needed_columns(self) -> dict[str, str]:
        """Each dataset column some reward cannot be called without -> the first such reward ('--reward math')."""
        labels = [f"--reward {spec}" for spec in self.specs] if self.specs else [f"reward {name!r}"
                                                                                  for name in self.names]
        needed: dict[str, str] = {}
        for function, label in zip(self.functions, labels):
            for column in needed_columns(function):
                needed.setdefault(column, label)
        return needed

    @property
    def names(self) -> list[str]:
        """Each function's name, numbered from the second one that shares it: ['f', 'g', 'f_2']."""
        names, seen = [], {}
        for function in self.functions:
            name = reward_name(function)
            seen[name] = seen.get(name, 0) + 1
            names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
        return names


def load_rewards(specs: list[str], weights: list[float] | None = None) -> Rewards:
    """Every --reward, with its --reward-weights (default 1.0 each)."""
    return Rewards([load_reward(spec) for spec in specs], list(weights or [1.0] * len(specs)), list(specs))


def as_rewards(rewards: Rewards | Reward) -> Rewards:
    """A single function is a set of one reward, weight 1."""
    return rewards if isinstance(rewards, Rewards) else Rewards([rewards], [1.0])
