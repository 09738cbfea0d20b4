"""Data through Hugging Face `datasets`: `--data` as a list of `tasks.Example`.

--data is a hub id (`openai/gsm8k` with --data-config main), a local directory (datasets infers its splits
from the file names: train.jsonl, test.parquet, ...) or a local file (.jsonl, .json, .parquet, .csv), loaded
by `datasets.load_dataset`. Each row becomes

    Example(prompt=row[--prompt-column], answer=gold_answer(row[--answer-column]), columns=every other column)

--prompt-column not given: TRL's 'prompt' column (which TRL's GRPOTrainer always reads), else GSM8K's 'question'
(`PROMPT_COLUMNS`); with both, the run's first line says which (`Task.notes`). Held out: the --eval-split split (TRL's
dataset_test_split), else the 'test' split, else 'validation' (`HELD_OUT_SPLITS`), else the last --eval-size rows of
--split, kept out of training; the first line names the split.

The prompt is text or a conversation (TRL's format: a list of {"role", "content"} messages; tasks.prompt_token_ids
renders it with the model's chat template), with --system-prompt in front if one is given (tasks.with_system_prompt).
The gold answer follows GSM8K's "... #### 72" -> "72"; any other answer is kept as text. Data without one (TRL's
prompt-only datasets) loads with answer None, unless a reward needs one (`needed`: a plain reward, math,
math-verify): then it, and any other column a reward cannot be called without, is refused in one line at start-up.

Deliberate departures from a plain `load_dataset` call:
1. The hub is asked once without retries first (tasks.hub_error); when it cannot be reached, the dataset is
   loaded in datasets' offline mode, from its cache, instead of after ~25 s of retries.
2. A train.<ext> file with a sibling test.<ext> or validation.<ext> loads as a 'train' and a 'test' or
   'validation' split, as its directory would.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from infra.tasks import (
    GSM8K_HUB,
    Example,
    TaskError,
    arithmetic_examples,
    canonical_number,
    chain_examples,
    hub_error,
    one_line,
    system_prompt_text,
    with_system_prompt,
)

DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # datasets' builders
PROMPT_COLUMNS = ("prompt", "question")  # read without --prompt-column, the first the data has: TRL's, then GSM8K's
HELD_OUT_SPLITS = ("test", "validation")  # held out without --eval-split: the first the data has (but --split)
EVAL_SIZE = 64  # held-out prompts when --eval-size is not given (None); of the training rows, at most a fifth
BUILT_IN_TASKS = {"arithmetic": arithmetic_examples, "chain": chain_examples}  # name -> its examples (a split)


@dataclass(frozen=True)
class Task:
    """--data loaded: the examples, and what was read where the options left a choice."""
    train: list[Example]
    held_out: list[Example]
    prompt_column: str | None  # the column the prompts came from (config.json records it); a built-in task: as given
    notes: tuple[str, ...] = ()  # for the run's first line: which column, of two that could be the prompts; which
    # split is held out (and how few rows it has, if fewer than --eval-size)


def looks_like_path(data: str) -> bool:
    """'./d', '/abs/d', 'a/b/c' and 'x.jsonl' are local paths; 'openai/gsm8k' and 'gsm8k' may be hub ids."""
    return (data.startswith((".", "/", "~")) or "\\" in data or data.count("/") > 1
            or Path(data).suffix.lower() in DATA_FILE_BUILDERS)


@contextmanager
def _datasets_quietly(offline: bool = False):
    """datasets without progress bars or log lines (its errors become our one line), and in offline mode if asked:
    from its cache only, without the network and its ~25 s of retries."""
    import datasets
    import huggingface_hub.constants as hub_constants
    switches = [(module, name) for module in (datasets.config, hub_constants) if offline
                for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(module, name)]
    saved = [getattr(module, name) for module, name in switches]
    verbosity, bars_off = datasets.logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    for module, name in switches:
        setattr(module, name, True)
    try:
        yield datasets
    finally:
        for (module, name), value in zip(switches, saved):
            setattr(module, name, value)
        datasets.logging.set_verbosity(verbosity)
        if not bars_off:
            datasets.enable_progress_bars()


def _hub_unreachable_reason(repo_id: str) -> str | None:
    """Why the hub cannot be reached now (no network, offline mode), or None if it answered, even with a 404."""
    error = hub_error(repo_id, "README.md", "dataset")
    return None if error is None or getattr(error, "response", None) is not None else one_line(error)


def load_splits(data: str, data_config: str | None = None):
    """--data as a datasets.DatasetDict (split name -> rows).

    A file: its format's builder, split 'train', plus 'test' and 'validation' from a sibling test.<ext> and
    validation.<ext> when the file is train.<ext>. A directory: one save_to_disk wrote (load_from_disk), else
    datasets infers the splits from the file names (train.jsonl, test.parquet, ...). Anything else is a hub id; when
    the hub cannot be reached, the copy in the datasets cache is used.
    """
    path, files, unreachable = Path(data).expanduser(), None, None
    if path.is_file():
        source = DATA_FILE_BUILDERS.get(path.suffix.lower())
        if source is None:
            raise TaskError(f"--data {data!r}: cannot tell the format of a {path.suffix or 'suffix-less'} file. "
                            f"Name it {', '.join(DATA_FILE_BUILDERS)}, or pass its directory.")
        if path.stat().st_size == 0:
            raise TaskError(f"--data {data!r} is empty: pass a file with at least one row.")
        files = {"train": str(path)}
        for split in HELD_OUT_SPLITS:
            sibling = path.with_name(split + path.suffix)
            if path.stem == "train" and sibling.is_file():
                files[split] = str(sibling)
    elif path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        return _saved_to_disk(path, data)
    elif path.is_dir():
        source = str(path)
    elif looks_like_path(data):
        raise TaskError(f"--data {data!r} is neither 'arithmetic', 'chain', 'gsm8k', a hub dataset id nor an existing "
                        f"file or directory. Pass a local file ({', '.join(DATA_FILE_BUILDERS)}, e.g. "
                        "path/to/gsm8k/train.jsonl) or directory, a hub id (e.g. openai/gsm8k), or 'arithmetic' or "
                        "'chain'.")
    else:
        source, unreachable = data, _hub_unreachable_reason(data)
    try:
        with _datasets_quietly(offline=unreachable is not None) as datasets:
            return datasets.load_dataset(source, data_config, data_files=files)
    except Exception as error:
        if unreachable is not None:
            from datasets.config import HF_DATASETS_CACHE
            raise TaskError(f"cannot reach the Hugging Face hub for {data!r} ({unreachable}), and the datasets cache "
                            f"{HF_DATASETS_CACHE} has no copy ({one_line(error)}). Offline, pass a local copy with "
                            "--data path/to/dir-or-file (e.g. --data path/to/gsm8k/train.jsonl: a test.jsonl beside it "
                            "becomes the held-out set), or use --data arithmetic.") from None
        raise TaskError(f"cannot load --data {data!r} with datasets ({one_line(error)}). Fix the data, or pass "
                        "--data arithmetic for the built-in offline task.") from None


def _saved_to_disk(path: Path, data: str):
    """A directory `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote, as a DatasetDict (a Dataset alone:
    the 'train' split), read with datasets.load_from_disk, as a TRL script loads it."""
    try:
        with _datasets_quietly(offline=True) as datasets:
            loaded = datasets.load_from_disk(str(path))
            return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
    except Exception as error:
        raise TaskError(f"cannot load --data {data!r}, a folder written by save_to_disk, with datasets.load_from_disk "
                        f"({one_line(error)}). Fix the data, or save it again.") from None


def gold_answer(value) -> str | None:
    """The gold answer of a row: GSM8K's '... #### 1,080' -> '1080', other text as-is (stripped), a number as text;
    None when there is none (None, empty, not text)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return None
    if "####" in value:
        value = value.rsplit("####", 1)[1]
        return canonical_number(value) or value.strip() or None
    return value.strip() or None


def _is_conversation(prompt) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), (str, list))  # a list: multimodal parts
                    for message in prompt))


def prompt_column_of(wanted: str | None, columns: list[str], where: str) -> str:
    """The column of prompts: --prompt-column (`wanted`), or when it is None the first of PROMPT_COLUMNS the data has
    (TRL's 'prompt' before GSM8K's 'question'); TaskError with one line when the data has none of them."""
    # 'question' given, TRL's column there: a config.json or checkpoint from when 'question' was the default
    candidates = PROMPT_COLUMNS if wanted is None else (wanted, "prompt") if wanted == "question" else (wanted,)
    for name in candidates:
        if name in columns:
            return name
    named = " or ".join(map(repr, PROMPT_COLUMNS)) if wanted is None else repr(wanted)
    raise TaskError(f"{where} has no column {named}; its columns are {', '.join(map(repr, columns))}. Pick one with "
                    "--prompt-column.")


def _check_needed(needed: dict[str, str], columns: list[str], prompt_column: str, answer_column: str,
                  where: str) -> None:
    """Refuse data without a column some reward cannot be called without (`needed`: column -> the reward)."""
    listed = ", ".join(map(repr, columns))
    for column, reward in needed.items():
        if column == "answer" and answer_column not in columns:
            raise TaskError(f"{reward} needs a gold answer, and {where} has no column {answer_column!r} to take it "
                            f"from; its columns are {listed}. Name the column of answers with --answer-column, or use "
                            "a reward that needs none (e.g. TRL's f(completions, **kwargs)).")
        if column != "answer" and (column not in columns or column == prompt_column):
            raise TaskError(f"{reward} takes a parameter {column!r} without a default, and {where} has no column "
                            f"{column!r} to fill it (TRL passes every column but the prompt's by its name); its "
                            f"columns are {listed}. Rename a column to {column!r}, or give the parameter a default.")


def dataset_examples(rows, prompt_column: str, answer_column: str, where: str,
                     needed: dict[str, str] | None = None) -> list[Example]:
    """Each row of a datasets.Dataset as Example(prompt, gold answer, every column but the prompt's).

    The prompt is text or a conversation (TRL's format: a list of {"role", "content"} messages). The gold answer is
    None where the data has none (no `answer_column`, or an empty value), unless a reward needs it: `needed`
    (reward.Rewards.needed_columns: column -> the reward that cannot be called without it) is checked here.
    """
    columns = list(rows.column_names)
    prompt_column = prompt_column_of(prompt_column, columns, where)
    needed = needed or {}
    _check_needed(needed, columns, prompt_column, answer_column, where)
    try:
        table = rows.to_dict()  # column -> list of raw values
    except UnicodeDecodeError as error:  # pyarrow's JSON reader may keep bytes that are not UTF-8 until now
        raise TaskError(f"{where}: not UTF-8 text ({one_line(error)}). Save the data as UTF-8, or fix or remove the "
                        "row.") from None
    examples = []
    values = table.get(answer_column, [None] * len(table[prompt_column]))
    for index, (prompt, value) in enumerate(zip(table[prompt_column], values)):
        if not (isinstance(prompt, str) and prompt.strip() or _is_conversation(prompt)):
            raise TaskError(f"{where}, row {index + 1}: the {prompt_column!r} is {prompt!r:.60}, neither text nor a "
                            "list of chat messages ({'role', 'content'}). Fix or remove that row.")
        answer = gold_answer(value)
        if answer is None and "answer" in needed:
            raise TaskError(f"{where}, row {index + 1}: the {answer_column!r} is {value!r:.60}, so there is no gold "
                            f"answer for {needed['answer']} to reward. Fix or remove that row, or pick another column "
                            "with --answer-column.")
        others = {name: table[name][index] for name in columns if name != prompt_column}  # TRL passes all but 'prompt'
        examples.append(Example(prompt, answer, others, source=f"{where}, row {index + 1}"))
    if not examples:
        raise TaskError(f"{where} holds no rows. Pass data with at least one.")
    return examples


def held_out_note(split: str, rows: int, eval_size: int, auto: bool = False) -> str:
    """What the run's first line says of a held-out split of `rows` rows: its name, and that it has fewer than
    --eval-size asked, when it has (`auto`: --eval-size not given, then the whole split is the held-out set)."""
    if rows < eval_size and not auto:
        return f"--eval-size {eval_size}: the {split} split has {rows}"
    if rows < eval_size:
        return f"held out: the whole {split} split"
    return f"held out: the {split} split"


def held_out_split(splits: list[str], split: str, eval_split: str | None, data: str) -> str | None:
    """The split held out: --eval-split (`eval_split`) when given, else the first of HELD_OUT_SPLITS the data has
    but --split; None for the last rows of --split (--eval-split naming --split itself asks for those)."""
    if eval_split is None:
        return next((name for name in HELD_OUT_SPLITS if name in splits and name != split), None)
    if eval_split not in splits:
        raise TaskError(f"--data {data!r} has the splits {', '.join(map(repr, splits))}, not {eval_split!r}: pick the "
                        "held-out one with --eval-split (TRL's --dataset-test-split), or leave it out for 'test', "
                        "else 'validation', else the last --eval-size rows of --split.")
    return None if eval_split == split else eval_split


def load_data(data: str, data_config: str | None, split: str, prompt_column: str | None, answer_column: str,
              eval_size: int | None, system_prompt: str | None = None, needed: dict[str, str] | None = None,
              eval_split: str | None = None) -> Task:
    """The train and held-out examples of `split` of --data; held out: the first `eval_size` rows of the split
    `held_out_split` picks (`eval_split`: --eval-split) when there is one, else the last `eval_size` rows of `split`,
    kept out of training. `prompt_column`: None for TRL's 'prompt' column, else GSM8K's 'question'
    (`prompt_column_of`). `system_prompt`: a system message for each prompt to start with (a preset's name or its
    text: tasks.system_prompt_text, tasks.with_system_prompt); `needed`: as `dataset_examples`."""
    system = system_prompt_text(system_prompt)
    splits = load_splits(data, data_config)
    if split not in splits:
        raise TaskError(f"--data {data!r} has the splits {', '.join(map(repr, splits))}, not {split!r}: pick one "
                        "with --split.")
    where = f"{data} ({split} split)"
    columns = splits[split].column_names
    column = prompt_column_of(prompt_column, columns, where)
    notes = ()
    if prompt_column is None and set(PROMPT_COLUMNS) <= set(columns):
        notes = (f"prompts from column {column!r} (TRL's), not {PROMPT_COLUMNS[1]!r}",)

    def examples_of(rows, where: str) -> list[Example]:
        return [with_system_prompt(example, system, where)
                for example in dataset_examples(rows, column, answer_column, where, needed)]
    examples = examples_of(splits[split], where)
    auto, eval_size = eval_size is None, EVAL_SIZE if eval_size is None else eval_size
    held_out = held_out_split(list(splits), split, eval_split, data) if eval_size else None
    if held_out is not None:
        rows = splits[held_out]
        return Task(examples, examples_of(rows.select(range(min(eval_size, len(rows)))), f"{data} ({held_out} split)"),
                    column, (*notes, held_out_note(held_out, len(rows), eval_size, auto)))
    if auto and eval_size > len(examples) // 5 >= 1:  # --eval-size not given: most of the rows train (TRL trains on
        notes = (*notes, f"held out: the last {len(examples) // 5} of {len(examples)} rows, a fifth (no test "  # all)
                         f"split; --eval-size sets how many, 0: none)")
        eval_size = len(examples) // 5
    elif len(examples) <= eval_size:  # a small dataset: a fifth of it held out, said in the first line
        if len(examples) // 5 < 1:
            raise TaskError(f"--data {data!r} has {len(examples)} examples, too few to hold out any for evaluation "
                            "and still train. Use more data, --eval-size 0 (no evaluation), or a test or validation "
                            "split (e.g. a test.jsonl next to a train.jsonl).")
        notes = (*notes, f"held out: the last {len(examples) // 5} of {len(examples)} rows, a fifth (--eval-size "
                         f"{eval_size} would leave too few to train; 0: none)")
        eval_size = len(examples) // 5
    cut = len(examples) - eval_size  # (eval_size 0: all of them train)
    return Task(examples[:cut], examples[cut:], column, notes)


# --- choosing a task ---
def load_task(data: str | None, default: str = "gsm8k", eval_size: int | None = None, data_config: str | None = None,
              split: str = "train", prompt_column: str | None = None, answer_column: str = "answer",
              system_prompt: str | None = None,
              needed: dict[str, str] | None = None) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples for `--data` (`read_task`'s, for a caller that needs only the examples)."""
    task = read_task(data, default, eval_size, data_config, split, prompt_column, answer_column, system_prompt, needed)
    return task.train, task.held_out


def read_task(data: str | None, default: str = "gsm8k", eval_size: int | None = None, data_config: str | None = None,
              split: str = "train", prompt_column: str | None = None, answer_column: str = "answer",
              system_prompt: str | None = None, needed: dict[str, str] | None = None,
              eval_split: str | None = None) -> Task:
    """The train and held-out examples for `--data`, the held-out list of at most `eval_size` examples (None:
    EVAL_SIZE, and of the training rows at most a fifth), and the choices made (`Task`).

    None -> `default` (the task a tiny model was warmed up on) or GSM8K; 'arithmetic'; 'chain'; 'gsm8k' (the hub's
    openai/gsm8k, config main); anything else through Hugging Face datasets (`load_data`: a hub id, a directory or a
    file, its prompt and answer columns, held out: --eval-split, its 'test' or 'validation' split, or the last
    `eval_size` rows). A blank --data (`--data "$DATA"` with DATA unset) is refused: it names nothing, and the
    default would train on another task.
    `system_prompt`: --system-prompt (a preset's name or a text; None: none), put in front of every prompt;
    `needed`: the columns the rewards cannot be called without (reward.Rewards.needed_columns), checked.
    """
    if data is not None and not data.strip():
        raise TaskError(f"--data {data!r} names no data (an unset shell variable?): give 'arithmetic', 'chain', "
                        "'gsm8k', a hub dataset id, a file or a directory, or leave --data out for the model's default")
    data, system = data or default, system_prompt_text(system_prompt)
    builtin = BUILT_IN_TASKS.get(data)
    if builtin is not None:
        columns = [name for name in (needed or {}) if name != "answer"]  # a built-in task has its answers only
        if columns:
            raise TaskError(f"{needed[columns[0]]} takes a parameter {columns[0]!r} without a default, and --data "
                            f"{data} has no column but the prompt and the answer: give the parameter a default, or "
                            "pass data that has that column.")
        held_out, eval_size = builtin("eval"), EVAL_SIZE if eval_size is None else eval_size
        notes = (held_out_note("eval", len(held_out), eval_size),) if len(held_out) < eval_size else ()
        return Task([with_system_prompt(e, system, data) for e in builtin("train")],
                    [with_system_prompt(e, system, data) for e in held_out[:eval_size]], prompt_column, notes)
    if data == "gsm8k":
        data, data_config = GSM8K_HUB[0], data_config or GSM8K_HUB[1]
    return load_data(data, data_config, split, prompt_column, answer_column, eval_size, system_prompt, needed,
                     eval_split)
