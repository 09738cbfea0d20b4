"""A group's rewards, called: each reward within --reward-timeout, its values checked, several added up (the
rewards themselves are loaded in infra/reward.py).

A plain reward is called once per completion (`score`); a batched one, TRL's form, once per group (`score_batch`),
with keywords only, as TRL does: `prompts` (the prompt, G times: text or a conversation), `completions` (text; for
a conversation `[{"role": "assistant", "content": text}]` each), `completion_ids` (token ids, EOS included when the
model stopped), every other column of the dataset row as a list of G values (`Example.columns`; `answer`, the
gold answer, when the row has no column of that name and the data has one), `trainer_state`: a
transformers.TrainerState whose global_step is the optimizer steps taken before this iteration's (iteration k x
--updates-per-iteration x --num-iterations: k itself at the defaults 1), max_steps all of the run's, epoch the
passes over the training prompts (`trainer_state`), and TRL's `log_metric` and `log_extra` (`RewardLogs`). It
returns one value per completion: a real number, or None where it does not apply (TRL's convention).

Either form may be `async def` (TRL 1.16 awaits async rewards concurrently): a group's synchronous rewards are
called first, in order, then its async calls (one per group batched, one per completion plain) are awaited
together on one event loop that lives as long as the process, in a daemon thread (TRL's
start_event_loop_in_daemon: a client an async reward made once keeps its loop). --reward-timeout bounds them
together: each call runs concurrently with the others from the same start.

Every way a user's function can fail is one `RewardError` line naming the function and the sample: it raised
(SystemExit included), it ran past `--reward-timeout` (per call: a batched call scores a whole group), it
returned something that is not one finite real number (a str, NaN; a bool counts 1 or 0), or, batched, not one
value per completion.

Several rewards add up, as TRL's do (`weighted_total`):

    r_j = Σ_i w_i r_ij          over the rewards i that scored completion j (TRL's nansum over None -> NaN)

and GRPO's advantages are taken from r (grpo.py). A completion that no reward scored (all None) has r_j =
NaN: it is left out of its group's mean and std and its advantage is 0 (TRL since #5902), and out of the
logged means. Each reward is logged alone as `rewards/<name>/mean` and `/std`; the held-out evaluation reports
the weighted total.

Departures from TRL, on purpose:
1. inf is refused in both forms, NaN in the plain one (a batched reward skips a completion with None or NaN, as
   TRL's nansum does; a plain reward returning None is refused, as a forgotten `return` would be).
2. No `environments` keyword: a reward that needs one fails with the TypeError it raises, in one line.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import os
import reprlib
import signal
import threading
import time
from collections.abc import Sized
from contextlib import contextmanager
from dataclasses import dataclass, field

from infra.reward import Reward, RewardError, Rewards, needed_columns, reward_name, user_frame


def raised_error(name: str, error: BaseException, where: str) -> RewardError:
    """The RewardError for a reward that raised `error`, naming the line that raised it (reward.user_frame)."""
    at = user_frame(error, ours=__file__)
    at = f" (at {at[0]}, line {at[1]}{': ' + at[2] if at[2] else ''})" if at else ""
    return RewardError(f"reward function {name!r} raised {type(error).__name__}: {error}{at} {where}")


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


FLOAT32_MAX = 3.4028234663852886e38


def not_a_reward(value, nan: bool = False) -> str | None:
    """What is wrong with a reward function's return value, or None if it is one finite real number (or NaN, with
    `nan`: a batched reward's way to skip a completion, as TRL's nansum reads it).

    Accepted: whatever `float()` converts, except text and anything with dimensions: int, float, a bool (1 or 0:
    TRL's float32 tensor of a list of bools), numpy.float32 / int64, Decimal, Fraction, a 0-d array or tensor.
    """
    name = type(value).__name__
    kind = f"{'an' if name[0] in 'aeio' else 'a'} {name}"  # an int, a uint8
    if isinstance(value, (str, bytes)):
        return f"{kind} ({reprlib.repr(value)})"
    if tuple(getattr(value, "shape", ())):
        return f"an array of shape {tuple(value.shape)} ({type(value).__name__})"
    try:
        number = float(value)
    except OverflowError:
        return f"{kind} too large for any float"
    except (TypeError, ValueError):
        return "None" if value is None else f"{kind} ({reprlib.repr(value)})"
    if not math.isfinite(number):
        return None if nan and math.isnan(number) else f"{number}, not a finite number"
    if abs(number) > FLOAT32_MAX:  # inf in the float32 advantages (as TRL's; rewards within the range whose
        # differences are not, ±2e38, overflow there too: the run then ends naming the metrics, periodic_rl.py)
        return f"{number:g}, beyond float32's range (±{FLOAT32_MAX:.3g}), in which advantages are computed"
    return None


def _timed_out(name: str, time_limit: float, where: str) -> RewardError:
    return RewardError(f"reward function {name!r} did not return within {time_limit:g} s (--reward-timeout: raise it, "
                       f"or 0 for no limit) {where}")


@contextmanager
def _reported(reward_fn: Reward, time_limit: float, where: str):
    """The call inside the block, within `time_limit` seconds; a failure becomes a RewardError that says where."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:
        with RewardClock.limit(time_limit):
            yield name
    except RewardTimeout:
        raise _timed_out(name, time_limit, where) from None
    except (Exception, SystemExit) as error:  # sys.exit() in a reward is a broken reward, not the end of the run
        raise raised_error(name, error, where) from error


def _where(prompt, completion: str, answer) -> str:
    return f"(prompt {prompt!r}, completion {completion!r}, answer {answer!r})"


def _plain_value(name: str, value, where: str) -> float:
    problem = not_a_reward(value)
    if problem is not None:
        raise RewardError(f"reward function {name!r} returned {problem}: return one real number {where}")
    return float(value)


def score(reward_fn: Reward, prompt, completion: str, answer: str, time_limit: float = 0.0) -> float:
    """reward_fn(prompt, completion, answer) as a float, within `time_limit` seconds (0: no limit); any failure
    becomes a RewardError that says where. (An async reward's coroutine is awaited: `score_group`.)"""
    where = _where(prompt, completion, answer)
    with _reported(reward_fn, time_limit, where) as name:
        value = reward_fn(prompt, completion, answer)
    if inspect.isawaitable(value):
        value = _await_all([(0, value)], time_limit, [(name, where)])[0]
    return _plain_value(name, value, where)


def trainer_state(cfg=None, iteration: int = 0, num_examples: int = 0):
    """What TRL passes a batched reward as `trainer_state`: a transformers.TrainerState of iteration k of a run
    (`cfg`, a Config; None: a fresh one, step 0). global_step: the optimizer steps taken before this iteration's
    rollouts, k x --updates-per-iteration x --num-iterations μ (TRL's global_step counts optimizer steps, μ per
    mini-batch; k itself at the defaults 1); max_steps: the run's, as the schedule counts them; epoch: the passes
    over the `num_examples` training prompts so far (a fraction, as TRL's); num_train_epochs: the passes the run
    makes, rounded up. (Imported here, when a batched reward is scored: transformers.trainer_callback imports
    transformers.trainer_utils, which imports peft, ~1 s.)"""
    from transformers import TrainerState
    if cfg is None:
        return TrainerState()
    prompts = cfg.prompts_per_iteration
    steps = cfg.updates_per_iteration * cfg.num_iterations  # optimizer steps per iteration
    return TrainerState(global_step=iteration * steps, max_steps=cfg.iterations * steps,
                        epoch=iteration * prompts / num_examples if num_examples else 0.0,
                        num_train_epochs=math.ceil(cfg.iterations * prompts / num_examples) if num_examples else 0,
                        train_batch_size=cfg.batch_size // cfg.updates_per_iteration)


@dataclass
class RewardLogs:
    """What TRL-style rewards log through TRL's `log_metric(name, value)` and `log_extra(column, values)` keywords,
    for one group: each metric's values (the trainer logs their mean over the iteration, as TRL over a logging step)
    and each extra column's values, one per completion (completions.jsonl gets them, as TRL's completions table),
    added up over the group's calls as TRL extends them (all at once, or one call per completion). A column that
    does not end the group with one value per completion is refused (`check`): its values could not be matched to
    the completions (TRL's table would shift them)."""
    metrics: dict = field(default_factory=dict)  # name -> [value, ...]
    columns: dict = field(default_factory=dict)  # column -> [value per completion]
    size: int | None = None  # completions in the group (set by trl_arguments)

    def log_metric(self, name: str, value: float) -> None:
        number = float(value)
        if not math.isfinite(number):  # raised in the reward's call: one line naming it, as any error of a reward
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a finite number")
        self.metrics.setdefault(str(name), []).append(number)

    def log_extra(self, column: str, values: list) -> None:
        self.columns.setdefault(str(column), []).extend(values)
        if self.size is not None and len(self.columns[str(column)]) > self.size:  # said in the reward's own line
            raise ValueError(f"log_extra({column!r}, ...): {len(self.columns[str(column)])} values for the group's "
                             f"{self.size} completions: give one value per completion")

    def check(self, where: str) -> None:
        """RewardError if a column logged for the group (`where`) has not one value per completion."""
        for column, values in self.columns.items():
            if len(values) != self.size:
                raise RewardError(f"log_extra({column!r}, ...) gave {len(values)} values for the {self.size} "
                                  f"completions {where}: give one value per completion")


def trl_arguments(prompt, answer: str | None, columns: dict, completions: list[str],
                  completion_ids: list[list[int]], state=None, logs: RewardLogs | None = None) -> dict:
    """The keywords TRL passes a batched reward for one prompt's G completions: prompts, completions (as messages
    when the prompt is a conversation), completion_ids, each dataset column as a list of G values (`answer`: the
    gold answer, unless the row has its own column of that name or there is none), trainer_state (`state`;
    None: a fresh TrainerState), and log_metric and log_extra (into `logs`; None: dropped)."""
    size = len(completions)
    if isinstance(prompt, list):  # a conversation: TRL hands each completion over as the assistant's message
        completions = [[{"role": "assistant", "content": text}] for text in completions]
    columns = {**({} if answer is None else {"answer": answer}), **columns}  # the row's own `answer` column, if it
    # has one, is passed as it is
    reserved = ("prompt", "completion", "completion_ids", "trainer_state", "log_metric", "log_extra")  # TRL's own
    logs = RewardLogs() if logs is None else logs
    logs.size = size
    return dict(prompts=[prompt] * size, completions=completions, completion_ids=completion_ids,
                **{key: [value] * size for key, value in columns.items() if key not in reserved},
                trainer_state=trainer_state() if state is None else state, log_metric=logs.log_metric,
                log_extra=logs.log_extra)


def _batch_where(arguments: dict) -> str:
    answers = arguments.get("answer")
    return (f"(prompt {arguments['prompts'][0]!r}, {len(arguments['completions'])} completions"
            + (f", answer {answers[0]!r})" if answers else ")"))


def _batch_values(name: str, values, size: int, where: str) -> list[float]:
    """A batched reward's result as one float per completion (None or NaN -> NaN: skipped, as TRL skips both), or the
    RewardError saying what is wrong with it."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sized) or getattr(values, "ndim", 1) != 1:
        got = not_a_reward(values) or f"a {type(values).__name__} ({reprlib.repr(values)})"
        raise RewardError(f"reward function {name!r} returned {got}: return a list of {size} numbers (None to skip "
                          f"a completion), one per completion {where}")
    if len(values) != size:
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {size} completions: return "
                          f"one per completion {where}")
    scores = []
    for position, value in enumerate(values):
        problem = None if value is None else not_a_reward(value, nan=True)  # NaN skips it too: TRL's nansum
        if problem is not None:
            raise RewardError(f"reward function {name!r} returned {problem} for completion {position}: return a "
                              f"real number, or None to skip it {where}")
        scores.append(math.nan if value is None else float(value))
    return scores


def score_batch(reward_fn: Reward, arguments: dict, time_limit: float = 0.0) -> list[float]:
    """reward_fn(**arguments) (`trl_arguments`) as one float per completion, None -> NaN, within `time_limit`
    seconds; a failure, a value that is not one real number or None, or not one per completion is a RewardError.
    (An async reward's coroutine is awaited: `score_group`.)"""
    where = _batch_where(arguments)
    with _reported(reward_fn, time_limit, where) as name:
        values = reward_fn(**arguments)
    if inspect.isawaitable(values):
        values = _await_all([(0, values)], time_limit, [(name, where)])[0]
    return _batch_values(name, values, len(arguments["completions"]), where)


class RewardLoop:
    """The event loop that async rewards run on: one per process, running in a daemon thread from the first async
    call on (TRL's GRPOTrainer keeps one the same way), so that what a reward binds to it (an AsyncOpenAI client, an
    aiohttp session) stays usable from one group to the next. A forked child makes its own."""
    _loop: asyncio.AbstractEventLoop | None = None
    _pid: int | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="reward-event-loop", daemon=True).start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop


def _await_all(awaitables: list[tuple[int, object]], time_limit: float, labels: list[tuple[str, str]]) -> dict:
    """{key: result} of every (key, awaitable), awaited together on the RewardLoop within `time_limit` seconds (0:
    none) from now. The first (in order) that raised, or did not finish in time, is a RewardError named by its
    (function name, where) in `labels`; the others are then cancelled."""
    results: dict[int, tuple[bool, object]] = {}

    async def one(key, awaitable) -> None:
        try:
            results[key] = (True, await awaitable)
        except asyncio.CancelledError:
            raise
        except (Exception, SystemExit) as error:  # SystemExit too: it must not end the loop's thread
            results[key] = (False, error)

    async def every() -> None:
        await asyncio.gather(*(one(key, awaitable) for key, awaitable in awaitables))

    future = asyncio.run_coroutine_threadsafe(every(), RewardLoop.get())
    try:
        future.result(timeout=time_limit if time_limit > 0 else None)
    except concurrent.futures.TimeoutError:
        future.cancel()
        late = next((i for i, (key, _) in enumerate(awaitables) if key not in results), 0)
        raise _timed_out(labels[late][0], time_limit, labels[late][1]) from None
    except BaseException:  # Ctrl-C while waiting: the calls are left cancelled
        future.cancel()
        raise
    for (key, _), (name, where) in zip(awaitables, labels):
        finished, value = results[key]
        if not finished:
            raise raised_error(name, value, where) from value
    return {key: value for key, (_, value) in results.items()}


def _close(awaitables: list[tuple[int, object]]) -> None:
    """Close coroutines that will not be awaited (a synchronous reward failed first): no 'never awaited' warning."""
    for _, awaitable in awaitables:
        if inspect.iscoroutine(awaitable):
            awaitable.close()


@dataclass
class _Pending:
    """An async reward's call, awaited later with the group's others: its key in `_await_all`, name and where."""
    key: int
    name: str
    where: str


def score_group(rewards: Rewards, prompt, answer: str | None, columns: dict, completions: list[str],
                completion_ids: list[list[int]], time_limit: float = 0.0, state=None,
                logs: RewardLogs | None = None) -> list[list[float]]:
    """Every reward's value of each of one prompt's completions, [reward i][completion j] (NaN: not scored).

    Synchronous rewards are called in order; the coroutines of async ones are then awaited together (`_await_all`).
    `state`: the batched rewards' trainer_state (`trainer_state`; None: a fresh one); `logs`: where their log_metric
    and log_extra calls go (None: nowhere). A reward that needs the gold
    answer (`needed_columns`) with `answer` None is a RewardError (data.load_task refuses such data first)."""
    arguments = None
    size = len(completions)
    per_reward: list = []  # [reward i]: a batched one's values or _Pending; a plain one's [value or _Pending]
    awaitables: list[tuple[int, object]] = []  # (key, the coroutine an async reward returned), in call order
    labels: list[tuple[str, str]] = []  # (function name, where) of each

    def called(function: Reward, where: str, key: int, /, *args, **kwargs):
        """function(*args, **kwargs), or a _Pending for the coroutine an async function returned."""
        with _reported(function, time_limit, where) as name:
            value = function(*args, **kwargs)
        if not inspect.isawaitable(value):
            return value, name
        awaitables.append((key, value))
        labels.append((name, where))
        return _Pending(key, name, where), name
    try:
        for i, (reward_fn, batched) in enumerate(zip(rewards.functions, rewards.batched)):
            if (answer is None and "answer" in needed_columns(reward_fn)
                    and not (batched and "answer" in columns)):  # batched: the row's own answer column would do
                raise RewardError(f"reward function {reward_name(reward_fn)!r} needs the gold answer, and the data "
                                  "has none: name its column with --answer-column, or use a reward that needs none")
            if batched:
                arguments = arguments or trl_arguments(prompt, answer, columns, completions, completion_ids, state,
                                                       logs)
                where = _batch_where(arguments)
                values, name = called(reward_fn, where, i * size, **arguments)
                per_reward.append(values if isinstance(values, _Pending) else _batch_values(name, values, size, where))
                continue
            scores = []
            for j, text in enumerate(completions):
                where = _where(prompt, text, answer)
                value, name = called(reward_fn, where, i * size + j, prompt, text, answer)
                scores.append(value if isinstance(value, _Pending) else _plain_value(name, value, where))
            per_reward.append(scores)
    except BaseException:
        _close(awaitables)
        raise
    if not awaitables:
        if logs is not None and arguments is not None:
            logs.check(_batch_where(arguments))
        return per_reward
    done = _await_all(awaitables, time_limit, labels)
    for i, values in enumerate(per_reward):
        if isinstance(values, _Pending):
            per_reward[i] = _batch_values(values.name, done[values.key], size, values.where)
        else:
            per_reward[i] = [_plain_value(v.name, done[v.key], v.where) if isinstance(v, _Pending) else v
                             for v in values]
    if logs is not None and arguments is not None:
        logs.check(_batch_where(arguments))
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
