"""--log-completions (infra/completions.py): every sampled completion in <out>/completions.jsonl and on the trackers.

Tolerances, from the arithmetic:
- an iteration's reward_mean (learner.mean_std) is the float32 mean of the same rewards the file holds as float64:
  n ≤ 32 values in [0, 1] summed in float32 err by at most n·2^-24 of their sum, so the two means agree to 1e-5
  relative (absolute 1e-7 for a mean near 0).
- a group's advantages A_i = (r_i − mean) / (std + 1e-4) (grpo.group_advantages) are float32: each (r_i − mean) is
  rounded by 2^-24 of |r_i| ≤ 1, so their sum is within G·2^-24 of 0 before the division by std + 1e-4 ≥ 1e-4, i.e.
  |Σ_i A_i| ≤ 4·2^-24 / 1e-4 < 3e-3 for G = 4 (measured: 4e-7).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import once_per_session

from config import Config
from infra import outputs
from infra.completions import COMPLETIONS, CompletionsLog, records
from infra.tracking import Trackers, completions_table, markdown_table
import warm

ROOT = Path(__file__).resolve().parents[2]
REWARDS = ["--reward", "math", "tests/rewards.py:digit_fraction", "--reward-weights", "1", "0.5"]
RUN = ["--data", "arithmetic", *REWARDS, "--mode", "sync", "--iterations", "3", "--batch-size", "8", "--group-size",
       "4", "--max-new-tokens", "4", "--eval-every", "0", "--sizes", "rule", "--save-every", "1", "--keep-checkpoints",
       "0", "--no-save", "--log-completions", "--num-completions-to-print", "2", "--report-to", "tensorboard"]
FIELDS = {"iteration", "group", "sample", "prompt", "completion", "rewards", "reward", "advantage"}


def train(model_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    done = warm.run([sys.executable, "trainer.py", "--model", str(model_dir), *RUN, "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def logged(tiny_model_dir, tmp_path_factory) -> tuple[Path, str]:
    """One 3-iteration run with --log-completions, two rewards and TensorBoard, run once for the session: (its
    --out, its stdout)."""
    def make(folder: Path) -> None:
        (folder / "stdout.txt").write_text(train(tiny_model_dir, folder / "run").stdout)
    folder = once_per_session(tmp_path_factory, "completions", make)
    return folder / "run", (folder / "stdout.txt").read_text()


def test_every_completion_is_a_line_whose_rewards_are_the_metrics(logged):
    """Claim: --log-completions writes one line per sampled completion, iteration by iteration in prompt
    and sample order, with the prompt as the model saw it, the decoded completion, each reward by name, the weighted
    sum and the advantage; an iteration's rewards average to its metrics row's reward_mean and rewards/<name>/mean,
    and each group's advantages sum to 0 (tolerances: module docstring)."""
    out, _ = logged
    lines = read(out / COMPLETIONS)
    rows = [row for row in outputs.read_metrics(out / "metrics.jsonl") if not row.get("final")]
    assert len(lines) == 3 * 8 and all(set(line) == FIELDS for line in lines)
    assert [(line["iteration"], line["group"], line["sample"]) for line in lines] == \
        [(k, j, i) for k in range(3) for j in range(2) for i in range(4)]
    for row in rows:
        mine = [line for line in lines if line["iteration"] == row["iteration"]]
        assert sum(line["reward"] for line in mine) / len(mine) == pytest.approx(row["reward"], rel=1e-5, abs=1e-7)
        for name in ("math_reward", "digit_fraction"):
            assert sum(line["rewards"][name] for line in mine) / len(mine) == \
                pytest.approx(row[f"rewards/{name}/mean"], rel=1e-5, abs=1e-7)
        for line in mine:
            weighted = line["rewards"]["math_reward"] + 0.5 * line["rewards"]["digit_fraction"]
            assert line["reward"] == pytest.approx(weighted, rel=1e-6)
        for j in range(2):
            assert abs(sum(line["advantage"] for line in mine if line["group"] == j)) < 3e-3
    prompt = lines[0]["prompt"]
    assert prompt.endswith("=") and "+" in prompt  # the arithmetic prompt "a+b=" as the tiny model reads it


def test_the_first_completions_are_printed_and_tensorboard_gets_a_table(logged):
    """Claim: --num-completions-to-print N prints the first N completions of each iteration; TensorBoard
    gets each iteration's completions as a markdown table (its Text tab) at the iteration's step, read back here by
    TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, stdout = logged
    lines = read(out / COMPLETIONS)
    printed = [line for line in stdout.splitlines() if line.startswith("  iter ")]
    assert [line.split("  ")[1] for line in printed] == [f"iter {k} group 0 sample {i}" for k in range(3)
                                                         for i in range(2)]
    assert json.dumps(lines[0]["completion"], ensure_ascii=False) in printed[0]
    reader = EventAccumulator(str(out / "runs"), size_guidance={"tensors": 0})
    reader.Reload()
    events = reader.Tensors("completions/text_summary")
    assert [event.step for event in events] == [0, 1, 2]
    text = events[1].tensor_proto.string_val[0].decode()
    assert text == markdown_table(*completions_table([line for line in lines if line["iteration"] == 1]))
    assert text.count("\n") == 1 + 8
    assert text.startswith("| step | group | sample | prompt | completion | math_reward | digit_fraction | reward |")


def test_a_resumed_run_drops_the_completions_after_its_checkpoint(logged, tiny_model_dir, tmp_path):
    """Claim: resumed from checkpoint-1, a run keeps iteration 0's completions and writes iterations 1
    and 2 anew, each once (as metrics.jsonl's rows); the lines it drops are the stopped run's after its checkpoint.
    Each is the stopped run's line again, as the resumed run is the same run."""
    out, _ = logged
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    before = read(copy / COMPLETIONS)
    for newer in copy.glob("checkpoint-*"):  # as a run stopped after checkpoint-1 (in place, a resume from a
        if newer.name != "checkpoint-1":     # checkpoint the run went past is refused: test_failures_outputs.py)
            shutil.rmtree(newer)
    with (copy / COMPLETIONS).open("a") as f:
        f.write('{"iteration": 2, "gro')  # a line torn by a kill
    train(tiny_model_dir, copy, "--resume", str(copy / "checkpoint-1"), "--num-completions-to-print", "0")
    assert read(copy / COMPLETIONS) == before


def test_completions_log_keeps_the_lines_before_the_checkpoint_and_appends(tmp_path):
    """Claim: CompletionsLog resumed at k rewrites the file with the history's lines of iterations before k (a torn
    last line dropped) only once its first iteration is in hand (a resume that fails before leaves the file as it
    was), then appends; a new run (k = 0) starts the file afresh; each iteration goes to the trackers at its step."""
    history = tmp_path / "before.jsonl"
    history.write_text("".join(json.dumps({"iteration": k, "completion": str(k)}) + "\n" for k in range(4))
                       + '{"iteration": 1, "compl')
    out = tmp_path / "out"
    out.mkdir()
    (out / COMPLETIONS).write_text("left as it was\n")
    reported = []
    log = CompletionsLog(out, resumed_at=2, history=history, report=lambda found, step: reported.append(step))
    assert (out / COMPLETIONS).read_text() == "left as it was\n"
    log.write([{"iteration": 2, "completion": "new"}])
    log.write([{"iteration": 3, "completion": "newer"}])
    assert [(line["iteration"], line["completion"]) for line in read(out / COMPLETIONS)] == \
        [(0, "0"), (1, "1"), (2, "new"), (3, "newer")]
    assert reported == [2, 3]
    CompletionsLog(out).write([{"iteration": 0, "completion": "fresh"}])
    assert read(out / COMPLETIONS) == [{"iteration": 0, "completion": "fresh"}]


def test_overwrite_deletes_completions_and_refuses_anothers(tmp_path):
    """Claim: completions.jsonl is one of the run's files: with rows it makes --out a previous run, --overwrite deletes
    it, and a completions.jsonl this trainer did not write is refused, with or without --overwrite."""
    (tmp_path / COMPLETIONS).write_text('{"iteration": 0, "completion": "4"}\n')
    with pytest.raises(outputs.OutputError, match="holds a previous run \\(completions.jsonl\\)"):
        with outputs.claimed(Config(out=str(tmp_path))):
            pass
    with outputs.claimed(Config(out=str(tmp_path), overwrite=True)):
        assert not (tmp_path / COMPLETIONS).exists()
    (tmp_path / COMPLETIONS).write_text('{"text": "another tool\'s"}\n')
    for overwrite in (False, True):
        with pytest.raises(outputs.OutputError, match="holds completions.jsonl, not written by this trainer"):
            with outputs.claimed(Config(out=str(tmp_path), overwrite=overwrite)):
                pass


class Tokenizer:
    """Decodes ids as characters (chr), special tokens (id 0) kept only when asked, as a Hugging Face tokenizer."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) if i else ("" if skip_special_tokens else "<eos>") for i in ids)

    def batch_decode(self, batch, skip_special_tokens=False):
        return [self.decode(ids, skip_special_tokens) for ids in batch]


def test_records_decode_each_group_in_index_order_and_write_nan_as_null():
    """Claim: a completion's record holds its prompt with special tokens (as the model read it), its text without
    (as the rewards read it), each reward under its name, a reward that scored nothing as null (JSON has no NaN),
    and the columns a reward added with TRL's log_extra (one value per completion), under "extra"; the table has
    them after TRL's columns."""
    group = types.SimpleNamespace(prompt_ids=[ord("1"), ord("="), 0], responses=[[ord("2"), 0], [ord("3")]],
                                  rewards=[1.0, float("nan")], advantages=[0.5, -0.5],
                                  rewards_per_function=[[1.0, float("nan")]], extra={})
    later = types.SimpleNamespace(**{**vars(group), "prompt_ids": [ord("x")], "extra": {"judge": ["yes", "no"]}})
    found = records(4, {7: later, 2: group}, Tokenizer(), ["math"])
    assert found[:2] == [
        {"iteration": 4, "group": 2, "sample": 0, "prompt": "1=<eos>", "completion": "2", "rewards": {"math": 1.0},
         "reward": 1.0, "advantage": 0.5},
        {"iteration": 4, "group": 2, "sample": 1, "prompt": "1=<eos>", "completion": "3", "rewards": {"math": None},
         "reward": None, "advantage": -0.5}]
    assert [(r["group"], r["prompt"], r["extra"]) for r in found[2:]] == [(7, "x", {"judge": "yes"}),
                                                                         (7, "x", {"judge": "no"})]
    assert "NaN" not in json.dumps(found)
    columns, rows = completions_table(found)
    assert columns[-1] == "judge" and [row[-1] for row in rows] == [None, None, "yes", "no"]


RECORDS = [{"iteration": 5, "group": 0, "sample": i, "prompt": "1+1=", "completion": f"{i} | <b>\nx",
            "rewards": {"reward": 1.0, "f": 0.5}, "reward": 1.5, "advantage": 0.1} for i in range(2)]


def test_the_table_has_trls_columns_and_markdown_escapes_text():
    """Claim: the trackers' table has TRL's columns (step, prompt, completion, each reward by name, advantage) with
    the group, the sample and the summed reward; a reward named like another column gets rewards/<name>; in
    TensorBoard's markdown a `|`, HTML and a line break inside a completion do not break the table."""
    columns, rows = completions_table(RECORDS)
    assert columns == ["step", "group", "sample", "prompt", "completion", "rewards/reward", "f", "reward", "advantage"]
    assert rows[1] == [5, 0, 1, "1+1=", "1 | <b>\nx", 1.0, 0.5, 1.5, 0.1]
    table = markdown_table(columns, rows).splitlines()
    assert len(table) == 4 and table[3] == "| 5 | 0 | 1 | 1+1= | 1 \\| &lt;b&gt;<br>x | 1.0 | 0.5 | 1.5 | 0.1 |"


class Recorder(types.ModuleType):
    """A tracker package (wandb, trackio: not installed here) whose calls are recorded; `Table` as theirs."""

    def __init__(self, name: str, has_table: bool = True):
        super().__init__(name)
        self.calls = []
        if has_table:
            self.Table = lambda columns, data: ("Table", columns, data)

    def init(self, **kwargs):
        return self

    def log(self, values, step):
        self.calls.append((step, values))

    def finish(self, **kwargs):
        pass


@pytest.mark.parametrize("tracker", ["wandb", "trackio", "trackio without Table"])
def test_wandb_and_trackio_get_the_completions_table_at_its_step(tracker, tmp_path, monkeypatch):
    """Claim: with --report-to wandb or trackio an iteration's completions are logged as a table named
    "completions" (TRL's name), wandb.Table / trackio.Table of completions_table's columns and rows, at the
    iteration's step; a trackio without Table gets no table and no error."""
    name = tracker.split()[0]
    module = Recorder(name, has_table=tracker != "trackio without Table")
    monkeypatch.setitem(sys.modules, name, module)
    with Trackers([name]) as trackers:
        trackers.start(tmp_path, {}, "run-1")
        trackers.log_completions(RECORDS, 5)
    expected = [(5, {"completions": ("Table", *completions_table(RECORDS))})] if hasattr(module, "Table") else []
    assert module.calls == expected


@pytest.mark.slow  # process-level: torchrun
def test_two_ranks_write_every_ranks_completions_once(tiny_model_dir, tmp_path, capsys):
    """Claim: under torchrun with 2 trainer ranks, rank 0 writes every rank's completions (each rank
    samples and trains only its own generate calls), the same lines as the single process's run (rollouts are
    equal exactly: tests/method/test_distributed.py; the single process's is trainer.main in this process), and no
    other rank writes."""
    import trainer
    extra = ["--groups-per-call", "1", "--batch-size", "20", "--rollout-threads", "1", "--train-threads", "1",
             "--micro-batch-tokens", "60", "--num-completions-to-print", "0"]
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    assert trainer.main(["--model", str(tiny_model_dir), *RUN, "--out", str(single), *extra]) == 0, \
        capsys.readouterr().err[-3000:]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "trainer.py", "--model", str(tiny_model_dir), *RUN, "--out", str(ranks), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = read(ranks / COMPLETIONS)
    assert len(lines) == 3 * 20 and lines == read(single / COMPLETIONS)


def test_a_negative_number_to_print_is_one_line(capsys):
    """Claim: --num-completions-to-print below 0 is refused in one line, exit 2, as any bad option."""
    from infra.command_line import parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--num-completions-to-print", "-1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--num-completions-to-print must be >= 0 (got -1)" in err
    assert err.count("\n") == 1
