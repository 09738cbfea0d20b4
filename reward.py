"""The reward: named by `--reward`, loaded, called within a time limit, and checked.

A reward is a plain function, TRL's reward-function shape,

    reward(prompt, completion, answer) -> float        e.g. tasks.math_reward: 1.0 correct, 0.0 wrong

named `math` (the built-in), `package.module:function` or `path/to/file.py:function`. Each call goes
through `score`, which turns every way a user's function can fail into one `RewardError` line naming the
function and the sample: it raised (SystemExit included), it ran past `--reward-timeout`, or it
returned something that is not one finite real number (a bool, a str, a list, NaN).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import reprlib
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from config import UserError
from tasks import math_reward

Reward = Callable[[str, str, str], float]


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
    """'math' -> `math_reward`; 'package.module:function' or 'path/to/file.py:function' -> that function."""
    if spec == "math":
        return math_reward
    module_name, sep, function_name = spec.rpartition(":")  # rpartition: Windows paths contain ':'
    if not sep or not module_name or not function_name:
        raise RewardError(f"--reward {spec!r} is not understood: use 'math' (built-in GSM8K/arithmetic "
                          "correctness) or 'module:function' / 'path/to/file.py:function' naming a function "
                          "reward(prompt, completion, answer) -> float.")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise RewardError(f"--reward {spec!r}: the file {path} does not exist (relative paths are resolved "
                              f"from {Path.cwd()}). Pass an existing .py file, or a module importable from here.")
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


class RewardTimeout(BaseException):
    """Raised inside a reward call that ran past --reward-timeout (a BaseException: a reward's own
    `except Exception` must not swallow it)."""


class RewardClock:
    """The time limit on reward calls (`RewardClock.limit(seconds)` around each call, in the main thread).

    A watchdog thread sends the main thread SIGUSR1 while a call is overdue, and the handler raises
    RewardTimeout there: between two bytecodes, or out of a blocking system call (a sleep, a socket).
    The reward itself stays in the main thread, where reward libraries may rely on signals (math-verify
    times its own calls with SIGALRM, which is why the clock does not use that signal). One limit it
    cannot enforce: C code that holds the GIL (a catastrophically backtracking regex) runs on until it returns.
    """
    POLL_SECONDS = 0.1
    SIGNAL = getattr(signal, "SIGUSR1", None)  # POSIX only: elsewhere, no limit
    _clock: RewardClock | None = None  # one per process: the signal handler is process-wide

    def __init__(self):
        self.deadline: float | None = None  # time.monotonic() by which the running call must return
        signal.signal(self.SIGNAL, self._interrupt)
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
        try:
            yield
        finally:
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


def score(reward_fn: RewardFn, prompt: str, completion: str, answer: str, time_limit: float = 0.0) -> float:
    """reward_fn(prompt, completion, answer) as a float, within `time_limit` seconds (0: no limit); any failure
    becomes a RewardError that says where."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    where = f"(prompt {prompt!r}, completion {completion!r}, answer {answer!r})"
    try:
        with RewardClock.limit(time_limit):
            value = reward_fn(prompt, completion, answer)
    except RewardTimeout:
        raise RewardError(f"reward function {name!r} did not return within {time_limit:g} s (--reward-timeout: "
                          f"raise it, or 0 for no limit) {where}") from None
    except (Exception, SystemExit) as error:  # sys.exit() in a reward is a broken reward, not the end of the run
        raise RewardError(f"reward function {name!r} raised {type(error).__name__}: {error} {where}") from error
    problem = not_a_reward(value)
    if problem is not None:
        raise RewardError(f"reward function {name!r} returned {problem}: return one real number {where}")
    return float(value)
