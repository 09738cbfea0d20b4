"""Entry point: `python trainer.py [--model qwen2.5-0.5b] [--mode async|sync] ...` (see --help).

Reads the config, claims the output directory (infra/outputs.py: checked, locked, no previous run mixed in),
imports the trackers --report-to names (infra/tracking.py), records the options in <out>/config.json
(infra/records.py), loads the policy and the task, runs the schedule of periodic_rl.py, prints one line per
iteration (infra/console.py; it goes as JSON to <out>/metrics.jsonl too, under TRL's keys, and to the trackers),
and saves θ_final, as soon as the last optimizer step is done, as a Hugging Face model directory <out>/policy that
`AutoModelForCausalLM.from_pretrained` loads.

Any problem a user can fix (bad option, missing model or data, failing reward function, dead
inference process) ends with one `error:` paragraph on stderr and a non-zero exit, no traceback.
A stop signal (Ctrl-C, SIGTERM, SIGHUP; infra/stopping.py), at any moment, ends with one `interrupted by SIG...` line
and exit code 128 + signal, after both processes have stopped.

Launched by torchrun, each process is one trainer rank (infra/distributed.py, docs/distributed.md): rank 0
logs and writes --out; the others print nothing on stdout and never touch --out.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from contextlib import closing, contextmanager, nullcontext, redirect_stdout, suppress
from pathlib import Path

from config import Config
from infra import outputs
from infra.errors import UserError
from infra.command_line import given_values, named_as_typed, parse_args
from infra import console
from infra.console import (STDOUT_CLOSED, eval_summary, format_row, progress_line, say, start_line, text_prompts_note,
                           unscored_line)
from infra.processes import children_end_with_their_parent
from infra.stopping import Interrupted, exit_without_lingering, stopped_by_signals, stops_deferred

# A reward's process pool ends with the run. A spawned process imports its parent's main module as __mp_main__:
# trainer.py itself, or the script that called `train` (which imports this module).
children_end_with_their_parent(spawned="__mp_main__" in sys.modules)


class DeviceError(UserError):
    pass


def check_device(device: str, option: str = "--device") -> None:
    """Fail early, in one line, when a named device does not exist (imports torch_npu only for npu)."""
    import torch
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the 'npu' device with torch)
        except ImportError as error:
            raise DeviceError(f"{option} {device} needs the Ascend adapter torch_npu, which is not installed "
                              f"({error}); install the torch_npu build matching torch {torch.__version__}") from None
        if not torch.npu.is_available():
            raise DeviceError(f"{option} {device}: torch_npu is installed but no NPU is visible")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"{option} {device}: this torch build sees no CUDA GPU "
                          f"(torch {torch.__version__}); use --device cpu or --device auto")
    count = getattr(torch, kind).device_count()
    if index and int(index) >= count:
        raise DeviceError(f"{option} {device}: this machine has {count} {kind} device(s), {kind}:0 to "
                          f"{kind}:{count - 1} (check CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES)")


def prepare(cfg: Config) -> tuple[Config, object, object, dict]:
    """Check the devices, load the task and the rewards (a typo there fails in a second): (the options with the
    prompt column read (config.json records it), the task (data.Task: train and held-out examples, what the first
    line says of them), reward functions and weights, how a model is loaded)."""
    import torch

    from infra.data import read_task
    from infra.reward import load_rewards
    for option in ("rollout_device", "train_device"):
        for device in getattr(cfg, option).split(","):  # --rollout-device: one per inference worker
            check_device(device, "--device" if device == cfg.device else "--" + option.replace("_", "-"))
    torch.manual_seed(cfg.seed)
    load_kwargs = dict(device=cfg.rollout_device, dtype=getattr(torch, cfg.dtype),
                       attn_implementation=cfg.attn_implementation, cache_dir=cfg.cache_dir, lora=cfg.lora)
    rewards = load_rewards(cfg.reward, cfg.reward_weights)  # first: the data must hold what they need
    task = read_task(cfg.data, cfg.default_data, cfg.eval_size, cfg.data_config, cfg.split, cfg.prompt_column,
                     cfg.answer_column, cfg.system_prompt, rewards.needed_columns(), cfg.eval_split)
    if cfg.num_train_epochs is not None:  # the run's length in passes over the training prompts (TRL's)
        iterations = epoch_iterations(cfg.num_train_epochs, len(task.train), cfg.prompts_per_iteration)
        cfg = dataclasses.replace(cfg, iterations=iterations)
        task = dataclasses.replace(task, notes=(*task.notes, f"--num-train-epochs {cfg.num_train_epochs:g}: "
                                                             f"{iterations} iterations"))
    if cfg.eval_every_epoch:  # TRL's eval_strategy 'epoch': every pass over the training prompts
        eval_every = epoch_iterations(1, len(task.train), cfg.prompts_per_iteration)
        cfg = dataclasses.replace(cfg, eval_every=eval_every)
        task = dataclasses.replace(task, notes=(*task.notes, f"--eval-every-epoch: every {eval_every} iterations"))
    if len(task.train) < cfg.prompts_per_iteration:  # an iteration spans epochs (rollout.iteration_prompts)
        task = dataclasses.replace(task, notes=(*task.notes, f"{len(task.train)} training prompt(s), fewer than the "
                                                             f"{cfg.prompts_per_iteration} an iteration takes: each "
                                                             "iteration samples some of them more than once"))
    eval_size = len(task.held_out) if cfg.eval_size is None else cfg.eval_size  # what auto took (config.json says)
    return dataclasses.replace(cfg, prompt_column=task.prompt_column, eval_size=eval_size), task, rewards, load_kwargs


def epoch_iterations(epochs: float, train_prompts: int, prompts_per_iteration: int) -> int:
    """The iterations of `epochs` passes over the training prompts, the last one completed (TRL rounds a run's
    steps up too), at least one.

    >>> epoch_iterations(1, 7473, 16), epoch_iterations(0.5, 100, 16), epoch_iterations(3, 2255, 16)
    (468, 4, 423)
    """
    return max(1, math.ceil(epochs * train_prompts / prompts_per_iteration))


def load_policy(cfg: Config, load_kwargs: dict, rollouts=None):
    """The trainable policy (float32 masters, on cfg.train_device) and its tokenizer. The tiny model is built
    first if it is not cached yet, and only then may the inference process (`rollouts`) load it."""
    import torch
    import transformers

    from infra.models import TINY_RECIPES, ensure_tiny_model, load_model
    transformers.utils.logging.disable_progress_bar()  # our own progress bar and log lines only
    if rollouts is not None:
        if cfg.is_tiny:  # load_model would build it too, but the inference process must not race the build
            ensure_tiny_model(cfg.cache_dir, TINY_RECIPES[cfg.model])
        rollouts.load()
    return load_model(cfg.model, **{**load_kwargs, "device": cfg.train_device, "dtype": torch.float32})


@contextmanager
def started(cfg: Config, resume_from: Path | None = None, on_sized=None, ranks=None,
            on_completions=lambda records: None, on_prepared=lambda cfg: None):
    """The run as configured, ready to iterate: (rows, policy, tokenizer), rows being `periodic_rl.train`'s
    (from the checkpoint `resume_from`, if given; `on_prepared(cfg)` once the data is read: the options with
    what it decides, such as --num-train-epochs' iterations; `on_sized(cfg)` once its sizes are known; as trainer
    rank `ranks`, if given: infra/distributed.py; `on_completions(records)` per iteration with --log-completions).

    The inference process (async mode) is spawned before the trainer imports transformers' models and
    loads its own copy, so the two processes' imports and loads overlap; the `with` block owns it until
    it is stopped, however the block is left.
    """
    from infra.tasks import check_prompt_lengths, raw_text_prompts, template_kwargs
    from launch import setup, sizing
    cfg, task, rewards, load_kwargs = prepare(cfg)
    on_prepared(cfg)
    train_examples, held_out = task.train, task.held_out
    Interrupted.check()  # a Ctrl-C that a C extension swallowed while torch was imported stops the run here
    from infra.distributed import Ranks
    ranks = ranks or Ranks()
    with setup.inference_side(cfg, load_kwargs, train_examples, held_out, load=not cfg.is_tiny,
                                    ranks=ranks) as rollouts:
        policy, tokenizer = load_policy(cfg, load_kwargs, rollouts)
        Interrupted.check()  # and one swallowed while transformers' models were imported
        raw = raw_text_prompts(cfg.text_prompts, cfg.prompt_column)
        check_prompt_lengths(tokenizer, train_examples + held_out, getattr(policy.config, "max_position_embeddings",
                                                                           None), cfg.max_new_tokens,
                             template_kwargs(cfg.chat_template_kwargs), raw)
        notes = task.notes + text_prompts_note(tokenizer, train_examples, raw)
        memory = sizing.memory_estimate(cfg, sum(p.numel() for p in policy.parameters()),
                                        sum(p.numel() for p in policy.parameters() if p.requires_grad))
        print(start_line(cfg, len(train_examples), len(held_out), notes, ranks.size, ranks.inference, memory),
              flush=True)
        rows = setup.train(cfg, policy, tokenizer, train_examples, held_out, rewards, load_kwargs, rollouts,
                                 resume_from, on_sized, ranks, on_completions)
        with closing(rows):  # however the block ends, the schedule's own clean-up (the trace) runs here
            yield rows, policy, tokenizer


def run(cfg: Config, resume_from: Path | None = None, command: list[str] | None = None, ranks=None,
        link_latest: bool = False) -> dict:
    """Train as configured (on from a checkpoint); returns the final row (with the start and end held-out rewards).
    `command`: the command line, as config.json records it. A trainer rank other than 0 (`ranks`) takes part in
    every step but neither claims --out nor writes there (nor reports to trackers). --out with `link_latest` (a
    folder of its own, made by `main` when --out was not given) becomes runs/latest (infra/outputs.py, rule 5)."""
    from infra import checkpoint
    from infra.completions import COMPLETIONS, CompletionsLog
    from infra.records import RunRecord
    from infra.tracking import Trackers
    resumed_at = checkpoint.read_state(resume_from)["iterations_done"] if resume_from else 0
    if ranks is not None and not ranks.is_main:
        with started(cfg, resume_from, ranks=ranks) as (rows, policy, tokenizer):
            return list(rows)[-1]
    # --out checked and locked, the trackers' packages imported, the options recorded: all before a model loads
    with outputs.claimed(cfg) as out, Trackers(cfg.report_to) as trackers:
        note = outputs.link_latest(out) if link_latest else ""
        if note:
            print(f"periodic-rl: {note}", flush=True)
        record = RunRecord(out, command or ["trainer.py"], resumed=resume_from is not None)
        record.write(cfg)

        def on_sized(sized: Config) -> None:  # the options are final: recorded with the sizes, sent to the trackers
            trackers.start(out, record.write(sized), record.run_id, resumed_at)
        history = resume_from.parent / "metrics.jsonl" if resume_from else None  # the run it continues
        samples = CompletionsLog(out, resumed_at, resume_from and resume_from.parent / COMPLETIONS,
                                 trackers.log_completions, cfg.num_completions_to_print, say)  # --log-completions
        prepared = [cfg]  # the options once the data is read (--num-train-epochs counts the iterations there)
        with started(cfg, resume_from, on_sized, ranks, samples.write, prepared.append) as (rows, policy, tokenizer):
            return log_and_save(prepared[-1], rows, policy, tokenizer, resumed_at, trackers.log, ranks, history)


def save_policy(policy, tokenizer, path: Path, dtype=None) -> None:
    """A Hugging Face model directory that `from_pretrained` loads, written atomically (outputs.save_atomically), with
    the model's own config (its dropout rates as loaded: launch/setup.config_as_loaded); its weights in `dtype`
    (--save-dtype model: the dtype it was stored in, infra/models.weights_in), else as trained (float32)."""
    from infra.models import mark_dtype, weights_in
    from launch.setup import config_as_loaded

    def write(folder: Path) -> None:
        weights = weights_in(policy, dtype)  # None: as trained
        with config_as_loaded(policy):
            policy.save_pretrained(folder, safe_serialization=True, state_dict=weights)
        if weights is not None:
            mark_dtype(folder / "config.json", dtype)
        tokenizer.save_pretrained(folder)
    with outputs.writing("the trained policy to", path):
        outputs.save_atomically(path, write)


def earlier_rows(metrics_path: Path, before: int) -> list[dict]:
    """A resumed run's metrics so far: the rows of iterations before `before`, each once (a row torn by a kill is
    dropped; one written again by a stop in the instant after it was written counts once)."""
    rows = {row["iteration"]: row for row in outputs.read_metrics(metrics_path)
            if isinstance(row, dict) and not row.get("final") and isinstance(row.get("iteration"), int)
            and row["iteration"] < before}
    return [rows[k] for k in sorted(rows)]


PROCESS_STARTED = time.time()  # what a stop line compares --out's policy/ with: written by this run or before it


def log_and_save(cfg: Config, rows, policy, tokenizer, resumed_at: int = 0, report=lambda row: None,
                 ranks=None, history: Path | None = None) -> dict:
    """A log line and a metrics.jsonl row per iteration (a resumed run's continue the rows before `resumed_at` of
    `history`, the metrics.jsonl of the run it continues), then `report(row)` (the trackers); the policy is saved as
    soon as the last optimizer step is done, before the final evaluation and the trace, which can still fail
    without losing it.

    Nothing is lost on the way: metrics.jsonl is rewritten (atomically) only when the first row is in hand, so a
    resume that fails before leaves it as it was; a row in hand when a stop or a failure comes is written first, so
    a stop checkpoint (launch/setup.py) never holds an iteration whose row is missing."""
    from tqdm import tqdm

    from infra.tracking import trl_keys

    out = Path(cfg.out)
    metrics_path, policy_path = out / "metrics.jsonl", out / "policy"
    kept = [trl_keys(row) for row in earlier_rows(history, resumed_at)] if history and resumed_at else []
    first_eval = next((row["eval_reward"] for row in kept if row.get("eval_reward") is not None), None)
    start, trained, saved, phases, unscored_said = time.perf_counter(), False, False, [], False
    pending, continued = None, not resumed_at  # the row in hand, not yet written; whether the file is this run's
    tokens_seen = (kept[-1].get("num_tokens") if kept and kept[-1]["iteration"] == resumed_at - 1  # None: not known
                   else None if resumed_at else 0)  # (rows written before num_tokens, or missing)

    def write(row: dict) -> None:
        nonlocal continued
        with outputs.writing("metrics to", metrics_path):
            if not continued:  # the rows this run continues first, in place of the file's (atomically)
                outputs.write_atomically(metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
                continued = True
            with metrics_path.open("a") as f:
                f.write(json.dumps(trl_keys(row)) + "\n")  # TRL's keys, as the trackers name them

    def keep_pending() -> None:  # an iteration's row in hand when the run stops or fails: written if it can be
        if pending is not None and not pending.get("final"):
            with suppress(UserError):
                write(pending)

    on_terminal = sys.stderr.isatty()  # a progress bar there; elsewhere (nohup, CI) a progress line now and then
    progress = tqdm(total=cfg.iterations, initial=resumed_at, desc="iterations", disable=not on_terminal, leave=False)
    noted, paced_from = start, None  # when the last progress line was written; (time, iterations) of the first row
    try:
        for row in rows:
            with stops_deferred():  # the row in hand and the count of tokens change together
                pending = row
                if "input_tokens" in row:  # TRL's num_tokens: the prompt and response tokens trained on so far
                    tokens = row.pop("input_tokens")
                    tokens_seen = row["num_tokens"] = None if tokens_seen is None else tokens_seen + tokens
            Interrupted.check()
            if first_eval is None and row.get("eval_reward") is not None:
                first_eval = row["eval_reward"]
            row["elapsed_s"] = time.perf_counter() - start
            if line := format_row(row):
                say(line)
            if row.get("frac_reward_unscored") and not unscored_said:
                say(unscored_line(row["iteration"], row["frac_reward_unscored"]))
                unscored_said = True
            progress.update(0 if row.get("final") else 1)
            if not on_terminal and not row.get("final"):
                now, done = time.perf_counter(), row["iteration"] + 1
                if paced_from is None:  # the pace counts from the first row (iteration 0 also waited for the probe)
                    paced_from = (now, done)
                elif now - noted >= console.PROGRESS_EVERY_S:
                    noted, pace = now, (now - paced_from[0]) / (done - paced_from[1])
                    sys.stderr.write(progress_line(done, cfg.iterations, now - start, pace) + "\n")
                    sys.stderr.flush()
            trained = trained or row["iteration"] >= cfg.iterations - 1  # the last step is done (maybe before a resume)
            if "generate_device_s" in row:  # an iteration's row (not the final evaluation's): both sides' busy time
                phases.append((row["generate_device_s"], row["train_s"]))
            if cfg.save and trained and not saved:  # before anything else can fail: the evaluation, the trace
                save_policy(policy, tokenizer, policy_path,
                            getattr(policy, "stored_dtype", None) if cfg.save_dtype == "model" else None)
                saved = True
            write(row)
            pending = None
            report(row)
    except KeyboardInterrupt as stop:  # a stop signal while a row is handled here: the schedule may still keep
        keep_pending()                 # a checkpoint of the iterations done (launch/setup.py), then stops
        rows.throw(stop)
    except UserError as error:  # say what became of the trained policy (a failed save says so itself)
        keep_pending()
        if Interrupted.received is not None:  # the stop checkpoint failed (trainer.main says so)
            raise
        if saved:
            error.args = (f"{error} (the trained policy was saved in {policy_path} first)",)
        elif cfg.save and not trained:
            kept_policy = f"{policy_path} is still the policy saved before" if policy_path.exists() else None
            error.args = (f"{error} (the run stopped before training ended: {kept_policy or 'no policy was saved'})",)
        raise
    except Exception as error:  # any other failure once the policy is saved (a bug, a library's): one line too
        keep_pending()
        if not saved or Interrupted.received is not None or isinstance(error, BrokenPipeError) or sys.stdout.closed:
            raise
        raise UserError(f"the run failed after its last optimizer step: {type(error).__name__}: {error} (the trained "
                        f"policy was saved in {policy_path} first)") from error
    progress.close()
    final = {**row, "start_eval_reward": first_eval}
    evaluated = eval_summary(first_eval, row["eval_reward"], bool(cfg.eval_every and cfg.eval_size))
    say(f"done in {row['elapsed_s']:.1f}s: {evaluated}; metrics in {metrics_path}"
        + (f", policy in {policy_path}" if saved else ""))
    if phases and on_accelerator(cfg):  # (on CPU cores there is no device to move from one side to the other)
        say(f"periodic-rl: {device_split(cfg, phases, ranks)}")
    return final


def on_accelerator(cfg: Config) -> bool:
    """Whether a side runs on a GPU or NPU (cuda, npu), where the split of devices between the sides is a choice."""
    return any(not device.startswith("cpu") for device in f"{cfg.rollout_device},{cfg.train_device}".split(","))


def device_split(cfg: Config, phases: list[tuple[float, float]], ranks=None) -> str:
    """The split of devices that would balance the two sides (sizing.split_report), from the iterations' busy
    device-seconds (the first dropped when there are more: it warms up); `ranks`: torchrun's (distributed.Ranks)."""
    from launch import sizing
    timed = phases[1:] or phases
    generate_s, train_s = (sum(side) / len(timed) for side in zip(*timed))
    from infra.distributed import Ranks
    ranks = ranks or Ranks()
    inference = ranks.inference or cfg.inference_workers * ranks.size  # inference ranks, or the workers of each
    return sizing.split_report(generate_s, train_s, inference, ranks.size,
                               cfg.calls_per_iteration if cfg.groups_per_call else 1)


def serve(cfg: Config, ranks) -> None:
    """An inference rank (--inference-ranks): the task and rewards as a trainer loads them, then remote.serve."""
    from launch import remote
    cfg, task, rewards, load_kwargs = prepare(cfg)
    remote.serve(cfg, ranks, task.train, task.held_out, rewards, load_kwargs)


def rank_prefix(ranks=None) -> str:
    """'trainer rank r of M: ' (or 'inference rank j of K (rank r): ', once `ranks` knows the roles) under torchrun
    (every rank reports for itself), else ''."""
    if ranks is not None and ranks.world > 1:
        return ranks.name() + ": "
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
    return f"trainer rank {rank} of {size}: " if rank is not None and size != "1" else ""


def shorten_openmp_spinning(environ=os.environ) -> None:
    """Idle OpenMP threads spin 300,000 times before they sleep (libgomp's default; libgomp is the OpenMP runtime of
    torch's wheels), milliseconds of a core. When the trainer and inference processes take turns on the same
    cores, the side that has just finished spins through the other's first milliseconds (docs/benchmarks.md).
    30,000 spins still outlast the gap between two ops of one process (sync mode runs as fast). Call before torch
    is imported (libgomp reads it once, when torch loads it); the inference processes inherit it. A user's own
    GOMP_SPINCOUNT or OMP_WAIT_POLICY wins."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = "30000"


LAST_RUN: list[str | None] = []  # the --out of main's last run in this process (`train` returns it; None: a rank
# that writes none)


def main(argv: list[str] | None = None) -> int:
    Interrupted.received = Interrupted.held = None
    launcher = os.getppid()  # torchrun's agent, for a rank (distributed.die_with_launcher), read before anything loads
    ranks = None  # this process's ranks (distributed.Ranks) once the options are read: error lines name it
    cfg, failed_save = None, None  # the options once read; an output a stop could not write (its checkpoint)
    with stopped_by_signals():
        try:
            shorten_openmp_spinning()  # before torch is imported
            import numpy  # noqa: F401  before torch, whose C extension imports numpy and clears any error: a Ctrl-C
            # there was swallowed and left numpy half-imported (the run went on, then crashed at save)
            argv = sys.argv[1:] if argv is None else argv
            cfg = parse_args(argv)
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # two processes, each with its own threads
            from infra import checkpoint, distributed, records
            typed = given_values(argv)  # the options named, as typed (--model before a link is followed)
            given, ranks = set(typed), distributed.from_environment()  # torchrun's ranks; else one
            distributed.die_with_launcher(launcher)
            with open(os.devnull, "w") as devnull, redirect_stdout(devnull) if not ranks.is_main else nullcontext():
                if line := records.finished(cfg, given, typed.get("model")):  # the same command resubmitted
                    print(f"periodic-rl: {line}", flush=True)
                    return 0
                cfg = outputs.resume_or_start(cfg)  # --resume auto where --out holds no run: a new one
                try:
                    cfg, resume_from = checkpoint.resumption(cfg, given, typed.get("model"))  # --resume's options
                except UserError as error:  # its options named as typed (--max-steps, --learning-rate)
                    error.args = (named_as_typed(str(error), argv, cfg.iterations),)
                    raise
                ranks = distributed.split_roles(ranks, cfg.inference_ranks)  # trainer ranks, then inference ranks
                cfg = distributed.place(cfg, ranks, given)  # (rank 0 alone logs, above, and writes --out)
                distributed.check(cfg, ranks)
                if ranks.world > 1:  # before the process group, whose backend needs it (torch_npu registers hccl)
                    device = "rollout_device" if ranks.is_inference else "train_device"
                    check_device(getattr(cfg, device), "--" + device.replace("_", "-"))
                with distributed.process_group(cfg, ranks):
                    if ranks.is_inference:
                        serve(cfg, ranks)
                    else:
                        fresh = ranks.is_main and cfg.out is None  # a folder of its own, linked from runs/latest
                        if fresh:
                            cfg = dataclasses.replace(cfg, out=str(outputs.run_folder(cfg.model)))
                        LAST_RUN[:] = [cfg.out if ranks.is_main else None]  # for `train`, a caller in Python
                        # (None on a rank but 0, which writes nothing)
                        run(cfg, resume_from, ["trainer.py", *argv], ranks, link_latest=fresh)
            Interrupted.check()
            return 0
        except UserError as error:
            if Interrupted.received is None:
                sys.stderr.write(f"error: {rank_prefix(ranks)}{error}\n")
                return 1
            failed_save = failed_output(error)  # not the signal's doing
        except ValueError:  # "I/O operation on closed file": something in the run closed sys.stdout
            if Interrupted.received is None:
                if not sys.stdout.closed:
                    raise
                sys.stderr.write(f"error: {rank_prefix(ranks)}{STDOUT_CLOSED}\n")
                return 1
        except BrokenPipeError:  # stdout's reader exited (`| head`): stop, as Unix tools do, and say so on stderr
            if Interrupted.received is None:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit cannot fail again
                with suppress(BrokenPipeError):  # stderr may be the same closed pipe (2>&1)
                    sys.stderr.write("error: standard output was closed (its reader exited, e.g. `| head`): the run "
                                     "stopped and the inference process with it; to keep the log, use `> log.txt` or "
                                     "`| tee log.txt`\n")
                return 1
        except BaseException as error:  # a stop signal, or the error of something it cut short (an import)
            if Interrupted.received is None and not isinstance(error, KeyboardInterrupt):
                raise
            failed_save = failed_output(error)  # a full disk that the stop cut short, or came to as it went up
    signum = Interrupted.received or signal.SIGINT
    with suppress(OSError):  # SIGHUP: the terminal may be gone
        by_torchrun = rank_prefix(ranks) and signum == signal.SIGTERM  # how torchrun stops the others when a rank fails
        liveness = sys.modules.get("infra.liveness")  # imported with infra/distributed.py once the run has started
        gone = liveness.gone_neighbours() if by_torchrun and liveness else []
        if gone:  # a rank on this host ended first: that is why torchrun stopped this one
            sys.stderr.write(f"error: {rank_prefix(ranks)}{liveness.ended_first(gone)}, so torchrun stopped this rank "
                             "(torchrun's report names its exit code or signal); nothing is left running\n")
        else:
            sys.stderr.write(f"{rank_prefix(ranks)}interrupted by {signal.Signals(signum).name}: the run was stopped, "
                             "nothing is left running" + (" (torchrun stops every rank once one fails: its report "
                                                          "names the rank and why)" if by_torchrun else "")
                             + kept_on_stop(cfg, ranks, failed_save) + "\n")
    return 128 + signum


def raised_while(error: BaseException | None):
    """`error`, then the exception it was raised while handling, and so on (each one's __context__)."""
    while error is not None:
        yield error
        error = error.__context__


def failed_output(error: BaseException) -> outputs.OutputError | None:
    """The output a stopping run could not write: `error` itself, or one it was raised while handling (a stop signal
    raised while a full disk's error went up, or a second one while the inference process was awaited)."""
    return next((e for e in raised_while(error) if isinstance(e, outputs.OutputError)), None)


def kept_on_stop(cfg: Config | None, ranks, failed_save: Exception | None) -> str:
    """What a stop kept, for the end of its line. With --save-every or --save-on-stop: the checkpoint --resume auto
    continues from against the iterations done (metrics.jsonl's rows), or why the stop checkpoint is missing;
    without them, that the iterations done were not saved and which option keeps them. '' on the ranks that do
    not write --out, and before the options are read."""
    checkpoint = sys.modules.get("infra.checkpoint")  # imported once the options are read
    if cfg is None or cfg.out is None or checkpoint is None or ranks and not ranks.is_main:
        return ""
    iterations = cfg.iterations
    if cfg.num_train_epochs is not None:  # counted once the data was read: config.json records the count
        with suppress(OSError, ValueError, KeyError, TypeError):
            iterations = int(json.loads((Path(cfg.out) / "config.json").read_text())["iterations"])
    done = len(earlier_rows(Path(cfg.out) / "metrics.jsonl", iterations))
    if not (cfg.save_every or cfg.save_on_stop):
        policy = Path(cfg.out) / "policy"  # written atomically once training ended: by this process, if lately
        if policy.is_dir() and policy.stat().st_mtime >= PROCESS_STARTED:
            return f"; training had ended: the policy is in {policy}"
        return (f"; the {done} iteration{'s' * (done > 1)} done {'were' if done > 1 else 'was'} not saved "
                "(--save-on-stop keeps them when a run is stopped, --save-every N as it goes)") if done else ""
    found = checkpoint.checkpoints(cfg.out)
    newest = found[-1] if found else None
    k = checkpoint.read_state(newest)["iterations_done"] if newest else 0
    if failed_save is not None:
        by_stop = any(isinstance(e, KeyboardInterrupt) for e in raised_while(failed_save.__context__))
        lost = (f"the stop checkpoint could not be written ({failed_save})" if by_stop  # (the stop's own save)
                else f"as the stop came, {failed_save}")
    elif k < done:
        lost = f"no checkpoint holds iterations {k} to {done - 1}"  # a stop half-way through an iteration's steps
    elif newest is None:
        return "; no iteration was done, so no checkpoint was written"
    else:
        return f"; {newest} holds the {k} iterations done: --resume auto --out {cfg.out} continues from there"
    return f"; {lost}: " + (f"--resume auto --out {cfg.out} continues from {newest} ({k} of the {done} iterations "
                            "done)" if newest
                            else "there is no checkpoint to resume from")


# --- from Python: TRL's GRPOTrainer(...).train(), as one call ---
def train(model: str | None = None, reward_funcs=None, train_dataset=None, eval_dataset=None, args=None,
          **options):
    """Run the trainer from Python, as TRL's `GRPOTrainer(model, reward_funcs, args, train_dataset).train()` runs:
    the run `python trainer.py` makes with these options (infra/python_args.train_argv); returns its --out folder, a
    Path with TRL's `log_history`, `policy_path` and `save_model(dir)` (python_args.TrainedRun; under torchrun, on rank
    0; a rank that writes no run returns None).
    `model`: a hub id, a folder or an alias (not a model object: each process loads its own copy);
    `reward_funcs`: a function (defined at the top level of a module or of the script) or a --reward spec, or a list
    of them; `peft_config`: peft's LoraConfig, as --use-peft and its --lora-* options; `train_dataset`: a
    datasets.Dataset or DatasetDict, or a --data value; `args`: TRL's GRPOConfig (or a mapping), read as a --config
    file is; `options`: any option of `python trainer.py --help` with _ for -, ours or TRL's (learning_rate=1e-6,
    num_generations=8, max_steps=100, per_device_train_batch_size=8, ...). A script that calls it needs
    `if __name__ == "__main__":` around the call, as any script that starts processes with multiprocessing does
    (its reward functions above that block). RuntimeError with the exit code where the run
    fails (its `error:` line is on stderr, as on the command line); KeyboardInterrupt where Ctrl-C stopped it,
    SystemExit(128 + signal) where SIGTERM or SIGHUP did.

    Example: train("qwen2.5-0.5b", reward_funcs=[accuracy], train_dataset=load_dataset("openai/gsm8k", "main",
             split="train"), learning_rate=1e-6, max_steps=100)
    """
    try:
        from infra.python_args import TrainedRun, train_argv
        argv = train_argv(model, reward_funcs, train_dataset, eval_dataset, args, **options)
    except ValueError as error:  # a reward or dataset no other process can find: the caller's mistake, said so
        raise ValueError(f"train: {error}") from None
    LAST_RUN.clear()
    script = sys.modules.get("__main__")
    unreadable = getattr(script, "__file__", None) and not Path(script.__file__).is_file()  # `python < script.py`
    if unreadable:  # multiprocessing's spawn would run the script's path again: like `python -c`, it imports nothing
        saved = script.__file__
        del script.__file__
    try:
        code = main(argv)
    except SystemExit as stop:  # a bad option: argparse's one line is on stderr
        code = stop.code
    finally:
        if unreadable:
            script.__file__ = saved
    if code == 128 + signal.SIGINT:  # Ctrl-C: the run stopped (its line is above), as a script expects of Ctrl-C
        raise KeyboardInterrupt
    if code and code > 128:  # SIGTERM, SIGHUP: the process was asked to stop
        raise SystemExit(code)
    if code:
        raise RuntimeError(f"the run ended with exit code {code} (its error line is above; the options it names are "
                           "train's keywords, with _ for -: --resume auto is resume='auto'): python trainer.py "
                           + " ".join(argv))
    return TrainedRun(LAST_RUN[0]) if LAST_RUN and LAST_RUN[0] else None  # another rank than 0 (torchrun) writes none


if __name__ == "__main__":
    exit_without_lingering(main())
