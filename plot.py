"""Draw a run: `python plot.py [RUN_DIR] [-o file.png]` reads RUN_DIR/metrics.jsonl (default runs/latest), writes
RUN_DIR/metrics.png.

Panels, one x axis (the iteration k, the version of the weights that sampled it), top to bottom:
1. reward: the training reward's mean over the iteration's samples, with a band of ± its std, and the
   held-out reward of θ_k where it was evaluated (the last point is θ_final, the row marked "final");
2. with several --reward functions, each one alone (rewards/<name>/mean ± its std, unweighted);
3. KL to the reference (TRL's term: mean ρ·k3 per loss token, k3 without the bias correction; absent with --beta 0);
4. response length (mean tokens per sampled response, and of those that ended with EOS);
5. what else the rows hold, each panel only where some row has a value (`CURVES`): the loss, the gradient norm
   (before clipping), the learning rate, the entropy, the fraction of clipped tokens (TRL's clip ratios).

6. each process's seconds per iteration, busy and idle: a bar per side, busy at the bottom (inference:
   generate_s and its held-out evaluation's eval_s, training: train_s), idle stacked on it (idle_inference_s,
   idle_training_s); both bars are the iteration's wall time, so the idle part is what the other side made it wait
   (infra/timeline.py).

The rows' keys are TRL's, as trainer.py writes them (an older run's, reward_mean, response_length, ..., are read
as TRL's: infra/tracking.trl_keys).

Drawn on matplotlib's Figure directly (no pyplot, no display: the PNG is written by the Agg canvas). A metrics
file that is not one (not UTF-8, not JSON objects, no iteration, text where a number is drawn) and an output format
matplotlib cannot write are one `error:` line and exit 1.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from pathlib import Path

from matplotlib.figure import Figure

from infra.tracking import TRL_KEYS, trl_keys

REWARD, SECONDS = "reward", "seconds per iteration: busy and idle"
REWARD_OF = re.compile(r"^rewards/(.+)/(mean|std)$")  # one reward's statistics (learner.py: TRL's names)
# (title, the keys drawn, a name or an fnmatch pattern; whether the panel is drawn when no row has a value)
CURVES = (("KL to the reference", ("kl",), True),
          ("response length (tokens)", ("completions/mean_length", "completions/mean_terminated_length"), True),
          ("loss", ("loss",), False),
          ("grad norm (before clipping)", ("grad_norm",), False),
          ("learning rate", ("learning_rate", "lr"), False),
          ("entropy (mean per token)", ("entropy",), False),
          ("clipped tokens (fraction)", ("clip_ratio/*_mean",), False))
DRAWN = ("reward", "reward_std", "eval_reward", "generate_s", "idle_inference_s", "train_s",
         "idle_training_s")  # with CURVES' and REWARD_OF's, the keys `figure` draws: numbers, or null if not measured
JSON_TYPES = {list: "an array", str: "a string", bool: "true or false", type(None): "null", int: "a number",
              float: "a number"}


class PlotError(Exception):
    """What plot.py cannot draw (metrics.jsonl is not what trainer.py writes) or write: one line, naming it."""


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows, checked: each line a JSON object with an integer "iteration" and a number or null under
    each key the figure draws. A last line torn by a kill is skipped; a row written twice (a stop in the instant
    after it was written: launch/run_output.log_and_save) is drawn once."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as error:
        raise PlotError(f"cannot read {path}: {error.strerror or error}") from None
    rows = {}
    for number, line in enumerate(lines, 1):
        where = f"{path}, line {number},"
        try:
            text = line.decode()
        except UnicodeDecodeError as error:
            raise PlotError(f"{where} is not UTF-8 text (byte {line[error.start]:#04x} at column {error.start + 1}): "
                               "name the --out directory of a trainer.py run") from None
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError as error:
            if number == len(lines):  # the row a kill tore
                continue
            raise PlotError(f"{where} is not JSON ({error})") from None
        if not isinstance(row, dict):
            raise PlotError(f"{where} is {JSON_TYPES.get(type(row), type(row).__name__)}, not a row of metrics "
                               "(a JSON object)")
        if not isinstance(row.get("iteration"), int) or isinstance(row["iteration"], bool):
            raise PlotError(f"{where} has no iteration number (\"iteration\": {json.dumps(row.get('iteration'))})")
        for key, value in row.items():
            if value is not None and not is_number(value) and is_drawn(TRL_KEYS.get(key, key)):
                raise PlotError(f"{where} has {JSON_TYPES.get(type(value), type(value).__name__)} "
                                   f"{json.dumps(value)[:40]} under {key!r}, not a number")
        rows[row["iteration"], bool(row.get("final"))] = row
    return list(rows.values())


def matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def is_drawn(key: str) -> bool:
    """Whether `figure` draws `key` (its value must then be a number or null)."""
    return key in DRAWN or bool(REWARD_OF.match(key)) or any(matches(key, keys) for _, keys, _ in CURVES)


def output_path(output: str) -> Path:
    """The file `-o` names, as matplotlib writes it (its format from the suffix; none: .png, appended)."""
    path = Path(output)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise PlotError(f"-o {output}: matplotlib cannot write {path.suffix} files; name a file ending in "
                           + ", ".join(f".{suffix}" for suffix in sorted(formats)))
    return path


DRAWABLE = 1e300  # beyond it an axis's range overflows (matplotlib computes ticks from max - min)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of the rows that have a value for `key`; a value no axis can hold (a diverged run's inf
    or 1e308) is a gap, as NaN is."""
    points = [(row["iteration"], row[key]) for row in rows if row.get(key) is not None]
    return [k for k, _ in points], [float("nan") if is_number(v) and not abs(v) <= DRAWABLE else v for _, v in points]


def with_band(axes, steps: list[dict], mean_key: str, std_key: str, label: str, color: str) -> None:
    """The curve of `mean_key` and a band of ± `std_key` around it (where every point has its std)."""
    k, mean = series(steps, mean_key)
    _, std = series(steps, std_key)
    axes.plot(k, mean, label=label, color=color)
    if std and len(std) == len(mean):
        low, high = ([m + sign * s if abs(m) + abs(s) <= DRAWABLE else float("nan") for m, s in zip(mean, std)]
                     for sign in (-1, 1))
        axes.fill_between(k, low, high, color=color, alpha=0.15, label="± std")


def figure(rows: list[dict], title: str = "") -> Figure:
    """The run's panels (the module docstring's list, top to bottom) from its metrics rows."""
    rows = [trl_keys(row) for row in rows]  # an older run's names read as TRL's
    steps = [row for row in rows if not row.get("final")]
    keys = list(dict.fromkeys(key for row in steps for key, value in row.items() if value is not None))
    rewards = list(dict.fromkeys(REWARD_OF.match(key)[1] for key in keys if REWARD_OF.match(key)))
    rewards = rewards if len(rewards) > 1 else []  # one reward alone is the reward panel's curve
    curves = [(text, [key for key in keys if matches(key, patterns)], always) for text, patterns, always in CURVES]
    curves = [(text, drawn) for text, drawn, always in curves if drawn or always]  # (title, the keys it draws)
    titles = [REWARD, *(f"reward {name} (unweighted)" for name in rewards), *(text for text, _ in curves), SECONDS]
    fig = Figure(figsize=(9, 1.2 + 2.2 * len(titles)), layout="constrained")
    panels = fig.subplots(len(titles), 1, sharex=True, squeeze=False)[:, 0]
    for axes, text in zip(panels, titles):
        axes.set_title(text, loc="left", fontsize=10)
        axes.grid(alpha=0.3)
    fig.suptitle(title)
    reward, seconds = panels[0], panels[-1]

    with_band(reward, steps, "reward", "reward_std", "train (mean over samples)", "C0")
    reward.plot(*series(rows, "eval_reward"), "o-", color="C1", label="held-out (θ_k)")
    reward.legend(loc="best", fontsize=8)
    for axes, name in zip(panels[1:], rewards):
        with_band(axes, steps, f"rewards/{name}/mean", f"rewards/{name}/std", "mean over samples", "C0")
    for axes, (text, drawn) in zip(panels[1 + len(rewards):-1], curves):
        for index, key in enumerate(drawn):
            axes.plot(*series(steps, key), color=f"C{(index + 2) % 10}", label=key)
        if len(drawn) > 1:
            axes.legend(loc="best", fontsize=8)
        if not drawn:
            axes.text(0.5, 0.5, "no reference model (--beta 0)" if text.startswith("KL") else "not in the rows",
                      ha="center", va="center", transform=axes.transAxes)

    k = [row["iteration"] for row in steps]
    width = 0.4
    for offset, busy, idle, side, color in ((-width / 2, "generate_s", "idle_inference_s", "inference", "C0"),
                                            (width / 2, "train_s", "idle_training_s", "training", "C1")):
        busy_s = [(row.get(busy) or 0.0) + (side == "inference" and row.get("eval_s") or 0.0) for row in steps]
        idle_s = [row.get(idle) or 0.0 for row in steps]
        x = [i + offset for i in k]
        seconds.bar(x, busy_s, width, color=color, label=f"{side} busy")
        seconds.bar(x, idle_s, width, bottom=busy_s, color=color, alpha=0.3, label=f"{side} idle")
    seconds.legend(loc="upper right", fontsize=8, ncols=2)
    seconds.set_xlabel("iteration k")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plot.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default="runs/latest",
                        help="a run's --out directory (it holds metrics.jsonl; default: runs/latest, the newest run "
                             "started without --out)")
    parser.add_argument("-o", "--output", help="PNG file to write (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    metrics = Path(args.run_dir) / "metrics.jsonl"
    try:
        output = output_path(args.output or str(Path(args.run_dir) / "metrics.png"))
        rows = read_rows(metrics) if metrics.is_file() else []
        if not rows:
            raise PlotError(f"{metrics} {'has no rows' if metrics.is_file() else 'does not exist'}: nothing to "
                               "draw; name the --out directory of a run that has done an iteration")
        try:
            run_dir = Path(args.run_dir)  # through runs/latest: the run's own name in the title
            title = f"{run_dir} ({run_dir.resolve().name})" if run_dir.is_symlink() else str(run_dir)
            figure(rows, title=title).savefig(output, dpi=100)
        except OSError as error:
            raise PlotError(f"could not write {output}: {error.strerror or error}") from None
    except PlotError as error:
        sys.stderr.write(f"error: {error}\n")
        return 1
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
