"""The rewards: named by `--reward` (repeatable), loaded, called within a time limit, checked and weighted.

A reward is a plain Python function, in one of two forms, told apart by its parameter names (`is_batched`):

    plain    reward(prompt, completion, answer) -> float      one call per completion; e.g. tasks.math_reward
    batched  reward(prompts, completions, **kwargs) -> list    TRL's form: one call per group of G completions

The batched form is TRL GRPOTrainer's (`_calculate_rewards`): recognised by a parameter named `prompts` or
`completions`, or by **kwargs alone without one named `completion`. It is called with keywords only, as TRL
does: `prompts` (the prompt, G times: text or a conversation), `completions` (text; for a conversation
`[{"role": "assistant", "content": text}]` each), `completion_ids` (token ids, EOS included when the model
stopped) and every other column of the dataset row as a list of G values (`Example.columns`; `answer`, the
gold answer, when the row has no column of that name). It returns one value per completion: a real
number, or None where it does not apply (TRL's convention).

Several rewards (`--reward a.py:f --reward b.py:g --reward-weights 1 0.2`) add up, as TRL's do:

    r_j = Σ_i w_i r_ij          over the rewards i that scored completion j (TRL's nansum over None -> NaN)

and GRPO's advantages are taken from r (grpo.py). A completion that no reward scored (all None) has r_j =
NaN: it is left out of its group's mean and std and its advantage is 0 (TRL since #5902), and out of the
logged means. Each reward is logged alone as `rewards/<name>/mean` and `/std` (TRL's names; <name> the
function's __name__, numbered when two share it); the held-out evaluation reports the weighted total.

Built in: `math` (tasks.math_reward, GSM8K's final number) and `math-verify` (infra/math_verify_reward.py,
Hugging Face's math-verify: \\boxed{}, fractions, LaTeX). Others are named `package.module:function` or
`path/to/file.py:function`. Each call goes through `score` (plain) or `score_batch`, which turn every way a
user's function can fail into one `RewardError` line naming the function and the sample: it raised
(SystemExit included), it ran past `--reward-timeout` (per call: a batched call scores a whole group), it
returned something that is not one finite real number (a bool, a str, NaN), or, batched, not one value
per completion.

Departures from TRL, on purpose:
1. NaN and inf are refused, in both forms (a reward that skips a completion says so with None, batched only;
   a plain reward returning None is refused, as a forgotten `return` would be).
2. No `trainer_state`, `log_extra`, `log_metric` or `environments` keyword: a reward that needs one fails with
   the TypeError it raises, in one line.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import reprlib
import signal
import threading
import time
import traceback
from collections.abc import Sized
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infra import moved
from infra.errors import UserError
from infra.tasks import math_reward

Reward = Callable[..., object]  # plain: (prompt, completion, answer) -> float; batched: (prompts, completions, **kw)


class RewardError(UserError):
    """A reward function raised (or exited), ran past --reward-timeout, or returned something that is not one
    finite real number."""



def _failing_line(error: BaseException) -> str:
    """'path, line N: Type: message' for an error raised while importing a reward module (its innermost frame, or
    the offending line of a SyntaxError)."""
    if isinstance(error, SyntaxError):
        return f"{error.filename}, line {error.lineno}: {type(error).__name__}: {error.msg}"
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{frame.filename}, line {frame.lineno}: {type(error).__name__}: {error}"


def load_reward(spec: str) -> Reward:
    """'math' -> `math_reward`; 'math-verify' -> `math_verify_reward`; 'package.module:function' or
    'path/to/file.py:function' -> that function."""
    if spec == "math":
        return math_reward
    if spec == "math-verify":
        try:
            from infra.math_verify_reward import math_verify_reward
        except ImportError as error:
            raise RewardError(f"--reward math-verify needs Hugging Face's math-verify ({error}): "
                              "pip install 'math-verify[antlr4_13_2]'") from None
        return math_verify_reward
    module_name, sep, function_name = spec.rpartition(":")  # rpartition: Windows paths contain ':'
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
    moved.install()  # a reward file written before the re-layout may still `import tasks`
    try:
        if module_name.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
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
        raise RewardError(f"--reward {spec!r}: importing {module_name} failed: {_failing_line(error)}. "
                          "Fix it there.") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(f"--reward {spec!r}: {module_name} has no function {function_name!r}. Define "
                          f"{function_name}(prompt, completion, answer) -> float there, or name another function.")
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

    def __post_init__(self):
        self.batched = [is_batched(function) for function in self.functions]  # each one's form, read once

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
    return Rewards([load_reward(spec) for spec in specs], list(weights or [1.0] * len(specs)))


def as_rewards(rewards: Rewards | Reward) -> Rewards:
    """A single function is a set of one reward, weight 1."""
    return rewards if isinstance(rewards, Rewards) else Rewards([rewards], [1.0])


class RewardTimeout(BaseException):
    """Raised inside a reward call that ran past --reward-timeout (a BaseException: a reward's own
    `except Exception` must not swallow it)."""


class RewardClock:
    """The time limit on reward calls (`RewardClock.limit(seconds)` around each call, in the main thread).

    Two alarms raise RewardTimeout in the main thread once a call is overdue, through one signal handler, between
    two bytecodes or out of a blocking system call:
    - a watchdog thread sends SIGUSR1 while the call is overdue: for a call that waits (a sleep, a socket);
    - a kernel timer on the process's CPU time (setitimer ITIMER_PROF) sends SIGPROF once the call has used half
      its limit in CPU seconds, then every POLL_SECONDS of CPU: for C code that holds the GIL, which the watchdog
      then cannot run to send its signal (a catastrophically backtracking regex: the re module looks for signals
      as it backtracks). A short call gets no signal; one that burns a core is stopped within POLL_SECONDS of its
      limit as long as the process gets half a core or more.
    The reward itself stays in the main thread, where reward libraries may rely on signals (math-verify times its
    own calls with SIGALRM, the wall-clock timer, which is why the clock uses neither). A profiler that samples
    with SIGPROF loses its signal during reward calls. What it cannot stop: C code that holds the GIL and never
    looks for signals (then, in async mode, the inference process's heartbeat check reports it after 60 s).
    """
    POLL_SECONDS = 0.1
    SIGNAL = getattr(signal, "SIGUSR1", None)  # POSIX only: elsewhere, no limit
    TIMER = getattr(signal, "ITIMER_PROF", None)
    _clock: RewardClock | None = None  # one per process: the signal handlers are process-wide

    def __init__(self):
        self.deadline: float | None = None  # time.monotonic() by which the running call must return
        signal.signal(self.SIGNAL, self._interrupt)
        if self.TIMER is not None:
            signal.signal(signal.SIGPROF, self._interrupt)
        threading.Thread(target=self._watch, name="reward-clock", daemon=True).start()

    def _interrupt(self, signum, frame) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:  # not a call that has returned since
            raise RewardTimeout

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while True:  # sends again while the call is still overdue (it may have swallowed one RewardTimeout)
            deadline = self.deadline
            if deadline is not None and time.monotonic() >= deadline:
                signal.pthread_kill(main, self.SIGNAL)
            time.sleep(self.POLL_SECONDS)

    @classmethod
    @contextmanager
    def limit(cls, seconds: float):
        """Raise RewardTimeout in the block once it has run `seconds` (0: no limit; outside the main thread,
        where no signal handler can run, none either)."""
        if seconds <= 0 or cls.SIGNAL is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        if cls._clock is None:
            cls._clock = cls()
        cls._clock.deadline = time.monotonic() + seconds
        if cls.TIMER is not None:
            signal.setitimer(cls.TIMER, seconds / 2, cls.POLL_SECONDS)
        try:
            yield
        finally:
            if cls.TIMER is not None:
                signal.setitimer(cls.TIMER, 0)
            cls._clock.deadline = None


def not_a_reward(value) -> str | None:
    """What is wrong with a reward function's return value, or None if it is one finite real number.

    Accepted: whatever `float()` converts, except bools, text and anything with dimensions: int, float,
    numpy.float32 / int64, Decimal, Fraction, a 0-d array or tensor.
    """
    kind = f"a {type(value).__name__}"
    if isinstance(value, bool) or str(getattr(value, "dtype", "")).endswith("bool"):  # numpy.bool_, torch.bool too
        return f"a bool ({value!r})"
    if isinstance(value, (str, bytes)):
        return f"{kind} ({reprlib.repr(value)})"
    if tuple(getattr(value, "shape", ())):
        return f"an array of shape {tuple(value.shape)} ({type(value).__name__})"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "None" if value is None else f"{kind} ({reprlib.repr(value)})"
    return None if math.isfinite(number) else f"{number}, not a finite number"


@contextmanager
def _reported(reward_fn: Reward, time_limit: float, where: str):
    """The call inside the block, within `time_limit` seconds; a failure becomes a RewardError that says where."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:
        with RewardClock.limit(time_limit):
            yield name
    except RewardTimeout:
        raise RewardError(f"reward function {name!r} did not return within {time_limit:g} s (--reward-timeout: "
                          f"raise it, or 0 for no limit) {where}") from None
    except (Exception, SystemExit) as error:  # sys.exit() in a reward is a broken reward, not the end of the run
        raise RewardError(f"reward function {name!r} raised {type(error).__name__}: {error} {where}") from error


def score(reward_fn: Reward, prompt, completion: str, answer: str, time_limit: float = 0.0) -> float:
    """reward_fn(prompt, completion, answer) as a float, within `time_limit` seconds (0: no limit); any failure
    becomes a RewardError that says where."""
    where = f"(prompt {prompt!r}, completion {completion!r}, answer {answer!r})"
    with _reported(reward_fn, time_limit, where) as name:
        value = reward_fn(prompt, completion, answer)
    problem = not_a_reward(value)
    if problem is not None:
        raise RewardError(f"reward function {name!r} returned {problem}: return one real number {where}")
    return float(value)


def trl_arguments(prompt, answer: str, columns: dict, completions: list[str], completion_ids: list[list[int]]) -> dict:
    """The keywords TRL passes a batched reward for one prompt's G completions: prompts, completions (as messages
    when the prompt is a conversation), completion_ids, and each dataset column as a list of G values."""
    size = len(completions)
    if isinstance(prompt, list):  # a conversation: TRL hands each completion over as the assistant's message
        completions = [[{"role": "assistant", "content": text}] for text in completions]
    columns = {"answer": answer, **columns}  # the row's own `answer` column, if it has one, is passed as it is
    reserved = ("prompt", "completion", "completion_ids")  # TRL leaves these columns out
    return dict(prompts=[prompt] * size, completions=completions, completion_ids=completion_ids,
                **{key: [value] * size for key, value in columns.items() if key not in reserved})


def score_batch(reward_fn: Reward, arguments: dict, time_limit: float = 0.0) -> list[float]:
    """reward_fn(**arguments) (`trl_arguments`) as one float per completion, None -> NaN, within `time_limit`
    seconds; a failure, a value that is not one real number or None, or not one per completion is a RewardError."""
    prompt, size = arguments["prompts"][0], len(arguments["completions"])
    where = f"(prompt {prompt!r}, {size} completions, answer {arguments['answer'][0]!r})"
    with _reported(reward_fn, time_limit, where) as name:
        values = reward_fn(**arguments)
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sized) or getattr(values, "ndim", 1) != 1:
        got = not_a_reward(values) or f"a {type(values).__name__} ({reprlib.repr(values)})"
        raise RewardError(f"reward function {name!r} returned {got}: return a list of {size} numbers (None to skip "
                          f"a completion), one per completion {where}")
    if len(values) != size:
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {size} completions: return "
                          f"one per completion {where}")
    scores = []
    for position, value in enumerate(values):
        problem = None if value is None else not_a_reward(value)
        if problem is not None:
            raise RewardError(f"reward function {name!r} returned {problem} for completion {position}: return a "
                              f"real number, or None to skip it {where}")
        scores.append(math.nan if value is None else float(value))
    return scores


def score_group(rewards: Rewards, prompt, answer: str, columns: dict, completions: list[str],
                completion_ids: list[list[int]], time_limit: float = 0.0) -> list[list[float]]:
    """Every reward's value of each of one prompt's completions, [reward i][completion j] (NaN: not scored)."""
    arguments = None
    per_reward = []
    for reward_fn, batched in zip(rewards.functions, rewards.batched):
        if batched:
            arguments = arguments or trl_arguments(prompt, answer, columns, completions, completion_ids)
            per_reward.append(score_batch(reward_fn, arguments, time_limit))
        else:
            per_reward.append([score(reward_fn, prompt, text, answer, time_limit) for text in completions])
    return per_reward


def weighted_total(per_reward: list[list[float]], weights: list[float]) -> list[float]:
    """r_j = Σ_i w_i r_ij over the rewards that scored completion j; NaN if none did (TRL: nansum, then NaN).

    >>> nan = float("nan")
    >>> weighted_total([[1.0, 0.0, nan], [0.5, nan, nan]], weights=[1.0, 2.0])
    [2.0, 0.0, nan]
    """
    totals = []
    for values in zip(*per_reward):
        scored = [weight * value for weight, value in zip(weights, values) if not math.isnan(value)]
        totals.append(sum(scored) if scored else math.nan)
    return totals
