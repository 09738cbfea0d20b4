"""Send each metrics row to the experiment trackers `--report-to` names: TensorBoard, Weights & Biases, Trackio.

metrics.jsonl stays the run's record (trainer.py writes it first, under TRL's keys: `trl_keys`); a tracker gets the
same numbers, named as TRL 1.16's GRPOTrainer logs them through transformers' integrations (its keys, with `train/`
or `eval/` put in front by `rewrite_logs`), so dashboards of the two trainers line up. `tracker_names` maps a row:

    learner's row key        tracker name                      TRL's key (GRPOTrainer._metrics), metrics.jsonl's
    reward_mean              train/reward                      reward
    reward_std               train/reward_std                  reward_std
    kl                       train/kl                          kl
    loss                     train/loss                        loss (transformers' Trainer)
    clip_fraction            train/clip_ratio/region_mean      clip_ratio/region_mean: tokens where the clip is
                                                               the active branch of the min (grpo.py counts alike)
    clip_fraction_low, _high train/clip_ratio/low_mean, ...    clip_ratio/low_mean, clip_ratio/high_mean
    grad_norm                train/grad_norm                   grad_norm (transformers' Trainer)
    response_length          train/completions/mean_length     completions/mean_length
    response_length_min,     train/completions/min_length,     completions/min_length, completions/max_length
    response_length_max      train/completions/max_length
    terminated_length        .../mean_terminated_length        completions/mean_terminated_length
    terminated_length_min,   .../min_terminated_length, ...    completions/min_terminated_length, ..._max_...
    terminated_length_max
    clip_fraction_low_min,   train/clip_ratio/low_min, ...     clip_ratio/low_min, clip_ratio/high_max: the
    clip_fraction_high_max                                     extremes over responses of their clipped fraction
                                                               (ours over the iteration; TRL's the mean of each
                                                               micro-batch's, which depends on its micro-batches)
    num_tokens               train/num_tokens                  num_tokens: prompt (once per response) and
                                                               response tokens trained on, the run's so far
    epoch                    train/epoch                       epoch: passes over the training prompts so far
    truncated_fraction       train/completions/clipped_ratio   completions/clipped_ratio (no EOS in the length)
    learning_rate, entropy,  train/<key>                       the same keys (learning_rate: transformers')
    frac_reward_zero_std     (frac_reward_unscored: ours)
    eval_reward              eval/reward                       eval_reward -> eval/reward
    <name>_s, tokens_per_s,  time/<name>                       (TRL logs no pipeline timing)
    overlap
    any other number         train/<key>  (eval_<x>: eval/<x>) e.g. rewards/<f>/mean -> train/rewards/<f>/mean,
                                                               TRL's own name for a reward function's mean
    iteration                the step (x axis); with policy_version and final: not logged

The step is the iteration k, the version of the weights that sampled the row; the final row (the held-out
reward of θ_N after the last iteration) is logged at step N. A value that is None (kl with --beta 0, an
iteration without evaluation) is left out, as TRL leaves out a metric it did not compute.

Life of the trackers (launch/run_output.py): `with Trackers(cfg.report_to)` imports their packages at start-up, before a
model loads (a missing one fails in one line naming the pip command); `start` opens them once the run's options
are final (they get config.json's content); `log` sends a row; leaving the block closes them, however the run
ends (an error, Ctrl-C). Only the trainer process logs. A resumed run (infra/checkpoint.py) logs from its iteration k
on: TensorBoard writes into the same <out>/runs with `purge_step=k`, so its reader drops the stopped run's
events from step k on; wandb and trackio resume the run named by config.json's run_id (wandb keeps the
values it already has for a step: those the stopped run logged after its last checkpoint stay, not the resumed
run's).

With --log-completions each iteration's completions (infra/completions.py) also go to the trackers as one table at
the iteration's step, named "completions" as TRL names it, with TRL's columns (step, prompt, completion, each reward
by its name, advantage) and ours (group, sample, the summed reward): a wandb.Table and a trackio.Table (if that
trackio has one), and for TensorBoard, which has no table, a markdown table as text (its Text tab).
"""
from __future__ import annotations

import contextlib
import html
import importlib
import importlib.util
import json
import os
from pathlib import Path

from infra.errors import UserError

TENSORBOARD_DIR = "runs"  # <out>/runs: `tensorboard --logdir <out>/runs`
PROJECT = os.environ.get("WANDB_PROJECT", "periodic-rl")  # the wandb / trackio project
NOT_LOGGED = {"iteration", "policy_version", "final"}
# metrics.jsonl's keys for what TRL names otherwise: our name in the learner's rows -> TRL's key (the rest are TRL's)
TRL_KEYS = {"reward_mean": "reward", "clip_fraction": "clip_ratio/region_mean",
            "response_length": "completions/mean_length", "clip_fraction_low": "clip_ratio/low_mean",
            "clip_fraction_high": "clip_ratio/high_mean", "response_length_min": "completions/min_length",
            "response_length_max": "completions/max_length", "terminated_length": "completions/mean_terminated_length",
            "terminated_length_min": "completions/min_terminated_length",
            "terminated_length_max": "completions/max_terminated_length",
            "clip_fraction_low_min": "clip_ratio/low_min", "clip_fraction_high_max": "clip_ratio/high_max",
            "truncated_fraction": "completions/clipped_ratio"}


def trl_keys(row: dict) -> dict:
    """A row under TRL's keys, as metrics.jsonl holds it (TRL_KEYS; a row already so, or an older run's, is read too).

    >>> trl_keys({"iteration": 3, "reward_mean": 0.5, "kl": 0.1, "response_length": 4.0})
    {'iteration': 3, 'reward': 0.5, 'kl': 0.1, 'completions/mean_length': 4.0}
    """
    return {TRL_KEYS.get(key, key): value for key, value in row.items()}


class TrackingError(UserError):
    """A tracker --report-to names cannot be used (its package is not installed)."""


def tracker_name(key: str) -> str:
    """A row's key's name on a tracker (the module docstring's table): TRL's key under train/, eval/ or time/."""
    key = TRL_KEYS.get(key, key)
    if key.endswith("_s") or key == "overlap":
        return f"time/{key}"
    return f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"


def tracker_names(row: dict) -> dict[str, float]:
    """The numbers of one metrics row under their tracker names (None, text and flags left out).

    Example: {"iteration": 3, "reward_mean": 0.5, "kl": None, "train_s": 0.1, "rewards/math/mean": 0.5}
             -> {"train/reward": 0.5, "time/train_s": 0.1, "train/rewards/math/mean": 0.5}
    """
    return {tracker_name(key): float(value) for key, value in row.items()
            if key not in NOT_LOGGED and isinstance(value, (int, float)) and not isinstance(value, bool)}


def completions_table(records: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, rows) of an iteration's completions (infra/completions.py's records), TRL's table: a reward's
    column is its name, or rewards/<name> where the name is one of the other columns'; then the columns rewards
    added with TRL's log_extra (extra/<column> where the name is taken).

    Example: [{"iteration": 2, "group": 0, "sample": 1, "prompt": "1+1=", "completion": "2", "rewards": {"math": 1.0},
               "reward": 1.0, "advantage": 0.7}]
             -> (["step", "group", "sample", "prompt", "completion", "math", "reward", "advantage"],
                 [[2, 0, 1, "1+1=", "2", 1.0, 1.0, 0.7]])
    """
    fixed = ("step", "group", "sample", "prompt", "completion", "reward", "advantage")
    names = list(records[0]["rewards"]) if records else []
    extra = list(dict.fromkeys(column for r in records for column in r.get("extra", {})))  # TRL's log_extra columns
    columns = [*fixed[:5], *(f"rewards/{name}" if name in fixed else name for name in names), *fixed[5:],
               *(f"extra/{column}" if column in fixed or column in names else column for column in extra)]
    rows = [[r["iteration"], r["group"], r["sample"], r["prompt"], r["completion"],
             *(r["rewards"][name] for name in names), r["reward"], r["advantage"],
             *(r.get("extra", {}).get(column) for column in extra)] for r in records]
    return columns, rows


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table of `rows`, for TensorBoard's Text tab: text escaped (`|`, HTML), line breaks as <br>."""
    def cell(value) -> str:
        return html.escape(str(value)).replace("|", "\\|").replace("\n", "<br>")
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(map(cell, line)) + " |" for line in lines)


# --- the trackers: one class each, opened with the run's directory, options and first step ---
class TensorBoard:
    package, module = "tensorboard", "torch.utils.tensorboard"

    def __init__(self, module, out: Path, config: dict, run_id: str, first_step: int):
        self.writer = module.SummaryWriter(log_dir=str(out / TENSORBOARD_DIR), purge_step=first_step or None)
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```", first_step)  # shown as code

    def log(self, names: dict[str, float], step: int) -> None:
        for name, value in names.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a dashboard open on <out>/runs sees each iteration as it ends

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandB:
    package = module = "wandb"

    def __init__(self, module, out: Path, config: dict, run_id: str, first_step: int):
        self.wandb = module
        self.run = module.init(project=PROJECT, id=run_id, name=run_id, config=config, dir=str(out), resume="allow")

    def log(self, names: dict[str, float], step: int) -> None:
        self.run.log(names, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackio:
    package = module = "trackio"

    def __init__(self, module, out: Path, config: dict, run_id: str, first_step: int):
        self.trackio = module
        module.init(project=PROJECT, name=run_id, config=config, resume="allow")

    def log(self, names: dict[str, float], step: int) -> None:
        self.trackio.log(names, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        if hasattr(self.trackio, "Table"):  # (trackio 0.3.1 added it)
            self.trackio.log({name: self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self, failed: bool) -> None:
        self.trackio.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}


def import_tracker(name: str):
    """The module a tracker writes with, or one line naming the package to install."""
    kind = TRACKERS[name]
    try:
        return importlib.import_module(kind.module)
    except ImportError:
        raise TrackingError(f"--report-to {name} needs the {kind.package} package: pip install {kind.package}") \
            from None


def installed_trackers() -> list[str]:
    """--report-to all: each tracker whose package is installed (TRL's `all`: the installed integrations); ["none"] if
    there is none."""
    found = [name for name, kind in TRACKERS.items() if importlib.util.find_spec(kind.package) is not None]
    return found or ["none"]


class Trackers:
    """The trackers of one run, as a `with` block: imported on entry, opened by `start`, closed on exit."""

    def __init__(self, names: list[str]):
        self.modules = {name: import_tracker(name) for name in dict.fromkeys(names) if name != "none"}
        self.opened: list = []

    def start(self, out: Path, config: dict, run_id: str, first_step: int = 0) -> None:
        """Open every tracker (once; the run's options are final, `first_step` is the iteration it starts at)."""
        if self.opened:
            return
        for name, module in self.modules.items():
            try:
                self.opened.append(TRACKERS[name](module, Path(out), config, run_id, first_step))
            except Exception as error:  # not logged in, no network, a folder it cannot write: say which tracker
                raise TrackingError(f"--report-to {name} could not start its run ({type(error).__name__}: "
                                    f"{error})".replace("\n", " ")) from None

    def log(self, row: dict) -> None:
        names = tracker_names(row)
        for tracker in self.opened:
            tracker.log(names, row["iteration"])

    def log_completions(self, records: list[dict], step: int) -> None:
        """An iteration's completions (infra/completions.py) as each tracker's table "completions", at `step`."""
        columns, rows = completions_table(records) if self.opened else ([], [])
        for tracker in self.opened:
            tracker.log_table("completions", columns, rows, step)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        with contextlib.ExitStack() as closing:  # each one closed, even if closing another failed
            for tracker in self.opened:
                closing.callback(tracker.close, failed=kind is not None)
            self.opened = []
