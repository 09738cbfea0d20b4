"""Draw a run: `python plot.py RUN_DIR [-o file.png]` reads RUN_DIR/metrics.jsonl, writes RUN_DIR/metrics.png.

Four panels, one x axis (the iteration k, the version of the weights that sampled it):
1. reward: the training reward's mean over the iteration's samples, with a band of ± its std, and the
   held-out reward of θ_k where it was evaluated (the last point is θ_final, the row marked "final");
2. KL to the reference (mean k3 per token; absent with --beta 0);
3. response length (mean tokens per sampled response);
4. each process's seconds per iteration, busy and idle: a bar per side, busy at the bottom (inference:
   generate_s, training: train_s), idle stacked on it (idle_inference_s, idle_training_s); both bars are
   the iteration's wall time, so the idle part is what the other side made it wait (infra/timeline.py).

Drawn on matplotlib's Figure directly (no pyplot, no display: the PNG is written by the Agg canvas). A metrics
file that is not one (not UTF-8, not JSON objects, no iteration, text where a number is drawn) and an output format
matplotlib cannot write are one `error:` line and exit 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

TITLES = ("reward", "KL to the reference", "response length (tokens)", "seconds per iteration: busy and idle")
DRAWN = ("reward_mean", "reward_std", "eval_reward", "kl", "response_length", "generate_s", "idle_inference_s",
         "train_s", "idle_training_s")  # the keys `figure` draws: numbers, or null where not measured
JSON_TYPES = {list: "an array", str: "a string", bool: "true or false", type(None): "null", int: "a number",
              float: "a number"}


class PlotError(Exception):
    """What plot.py cannot draw (metrics.jsonl is not what trainer.py writes) or write: one line, naming it."""


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows, checked: each line a JSON object with an integer "iteration" and a number or null under
    each key the figure draws. A last line torn by a kill is skipped; a row written twice (a stop in the instant
    after it was written: trainer.log_and_save) is drawn once."""
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
        for key in DRAWN:
            if row.get(key) is not None and not is_number(row[key]):
                raise PlotError(f"{where} has {JSON_TYPES.get(type(row[key]), type(row[key]).__name__)} "
                                   f"{json.dumps(row[key])[:40]} under {key!r}, not a number")
        rows[row["iteration"], bool(row.get("final"))] = row
    return list(rows.values())


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


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of the rows that have a value for `key`."""
    points = [(row["iteration"], row[key]) for row in rows if row.get(key) is not None]
    return [k for k, _ in points], [v for _, v in points]


def figure(rows: list[dict], title: str = "") -> Figure:
    """The run's four panels (TITLES, top to bottom) from its metrics rows."""
    steps = [row for row in rows if not row.get("final")]
    fig = Figure(figsize=(9, 10), layout="constrained")
    reward, kl, length, seconds = fig.subplots(4, 1, sharex=True)
    for axes, text in zip((reward, kl, length, seconds), TITLES):
        axes.set_title(text, loc="left", fontsize=10)
        axes.grid(alpha=0.3)
    fig.suptitle(title)

    k, mean = series(steps, "reward_mean")
    _, std = series(steps, "reward_std")
    reward.plot(k, mean, label="train (mean over samples)", color="C0")
    if len(std) == len(mean):
        reward.fill_between(k, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color="C0", alpha=0.15, label="± std")
    reward.plot(*series(rows, "eval_reward"), "o-", color="C1", label="held-out (θ_k)")
    reward.legend(loc="best", fontsize=8)

    k_kl, values = series(steps, "kl")
    kl.plot(k_kl, values, color="C2")
    if not values:
        kl.text(0.5, 0.5, "no reference model (--beta 0)", ha="center", va="center", transform=kl.transAxes)
    length.plot(*series(steps, "response_length"), color="C3")

    k = [row["iteration"] for row in steps]
    width = 0.4
    for offset, busy, idle, side, color in ((-width / 2, "generate_s", "idle_inference_s", "inference", "C0"),
                                            (width / 2, "train_s", "idle_training_s", "training", "C1")):
        busy_s = [row.get(busy) or 0.0 for row in steps]
        idle_s = [row.get(idle) or 0.0 for row in steps]
        x = [i + offset for i in k]
        seconds.bar(x, busy_s, width, color=color, label=f"{side} busy")
        seconds.bar(x, idle_s, width, bottom=busy_s, color=color, alpha=0.3, label=f"{side} idle")
    seconds.legend(loc="upper right", fontsize=8, ncols=2)
    seconds.set_xlabel("iteration k")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plot.py", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's --out directory (it holds metrics.jsonl)")
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
            figure(rows, title=str(args.run_dir)).savefig(output, dpi=100)
        except OSError as error:
            raise PlotError(f"could not write {output}: {error.strerror or error}") from None
    except PlotError as error:
        sys.stderr.write(f"error: {error}\n")
        return 1
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
