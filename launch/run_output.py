"""What a run writes in --out, on rank 0: the folder claimed (infra/outputs.py: checked, locked, no previous run
mixed in), the trackers --report-to names (infra/tracking.py), the options in config.json (infra/records.py), a
line and a metrics.jsonl row per iteration (infra/console.py; under TRL's keys, to the trackers too), the
completions (--log-completions), and θ_final as a Hugging Face model directory <out>/policy, saved as soon as the
last optimizer step is done. Every other rank writes nothing."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from config import Config
from infra import console, outputs
from infra.console import eval_summary, format_row, progress_line, say, unscored_line
from infra.errors import UserError
from infra.stopping import Interrupted, stops_deferred

LAST_RUN: list[str | None] = []  # the --out of main's last run in this process (`train` returns it; None: a rank
# that writes none)


def own_folder(cfg: Config, ranks) -> tuple[Config, bool]:
    """(the options, whether --out is a folder of its own): without --out, rank 0 makes one under runs/, which
    becomes runs/latest (infra/outputs.py, rule 5). `LAST_RUN` keeps --out for `train`, a caller in Python (None on
    a rank but 0, which writes nothing)."""
    fresh = ranks.is_main and cfg.out is None
    if fresh:
        cfg = dataclasses.replace(cfg, out=str(outputs.run_folder(cfg.model)))
    LAST_RUN[:] = [cfg.out if ranks.is_main else None]
    return cfg, fresh


@dataclasses.dataclass
class RunOutput:
    """The run's writer, as `opened` makes it. Without a folder (`out` None: a rank but 0, or a caller that
    only iterates) it writes nothing."""
    cfg: Config
    out: Path | None = None
    record: object = None
    trackers: object = None
    samples: object = None
    resumed_at: int = 0
    history: Path | None = None
    ranks: object = None
    logging: bool = False  # log_and_save has the rows: it says itself what became of the policy
    link_latest: bool = False  # a folder of its own (`own_folder`): runs/latest once the run has started

    def prepared(self, cfg: Config) -> None:
        """The options once the data is read (--num-train-epochs counts the iterations there)."""
        self.cfg = cfg

    def sized(self, cfg: Config) -> None:
        """The options are final, the run starts: recorded with the sizes, sent to the trackers; a folder of its own
        becomes runs/latest here, so that a start refused for its data, rewards or model leaves runs/latest alone."""
        if self.out is not None:
            self.trackers.start(self.out, self.record.write(cfg), self.record.run_id, self.resumed_at)
            if self.link_latest and (note := outputs.link_latest(self.out)):
                print(f"periodic-rl: {note}", flush=True)
            self.link_latest = False

    def completions(self, records) -> None:
        """An iteration's completions (--log-completions), every rank's."""
        if self.out is not None:
            self.samples.write(records)

    def log_and_save(self, rows, policy, tokenizer) -> dict:
        """The rows logged and written, the policy saved (`log_and_save`); the final row."""
        if self.out is None:
            return list(rows)[-1]
        self.logging = True
        return log_and_save(self.cfg, rows, policy, tokenizer, self.resumed_at, self.trackers.log, self.ranks,
                            self.history)


@contextmanager
def opened(cfg: Config, resume_from: Path | None = None, command: list[str] | None = None, ranks=None,
           link_latest: bool = False):
    """The run's writer for the block: --out checked and locked, the trackers' packages imported, the options
    recorded, all before a model loads. `command`: the command line, as config.json records it. A trainer rank other
    than 0 (`ranks`) takes part in every step but neither claims --out nor writes there (nor reports to trackers).
    --out with `link_latest` (`own_folder`) becomes runs/latest once the run starts (infra/outputs.py, rule 5), and is
    removed if it never does."""
    from infra import checkpoint
    from infra.completions import COMPLETIONS, CompletionsLog
    from infra.records import RunRecord
    from infra.tracking import Trackers
    resumed_at = checkpoint.read_state(resume_from)["iterations_done"] if resume_from else 0
    if ranks is not None and not ranks.is_main:
        yield RunOutput(cfg)
        return
    with outputs.claimed(cfg) as out, Trackers(cfg.report_to) as trackers:
        record = RunRecord(out, command or ["trainer.py"], resumed=resume_from is not None)
        record.write(cfg)
        history = resume_from.parent / "metrics.jsonl" if resume_from else None  # the run it continues
        samples = CompletionsLog(out, resumed_at, resume_from and resume_from.parent / COMPLETIONS,
                                 trackers.log_completions, cfg.num_completions_to_print, say)  # --log-completions
        output = RunOutput(cfg, out, record, trackers, samples, resumed_at, history, ranks, link_latest=link_latest)
        try:
            yield output
        except UserError as error:  # the training side failed to start (a damaged checkpoint, the sizes): the
            if not output.logging and resume_from and cfg.save and Interrupted.received is None:  # policy is kept
                say_stopped_early(error, out / 'policy')
            raise
        finally:
            if output.link_latest:  # a folder of its own, and the run never started: nothing of it is kept
                outputs.remove_unstarted(out)


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


def say_stopped_early(error: UserError, policy_path: Path) -> None:
    """`error`'s line, ended with what a run that stopped before its training ended leaves of the policy."""
    kept = f"{policy_path} is still the policy saved before" if policy_path.exists() else "no policy was saved"
    error.args = (f"{error} (the run stopped before training ended: {kept})",)


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
            say_stopped_early(error, policy_path)
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
