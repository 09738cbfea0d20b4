"""Data through Hugging Face datasets (infra/data.py): every form of --data loads, with its columns, its held-out split and
TRL's conversational prompts, offline from the cache; bad data is one line naming the row or the columns there are."""
import json
import pickle
import re
import shutil
import time
from pathlib import Path

import datasets
import pytest
from faults import hang_bound
from conftest import GSM8K_DIR, QWEN_CHAT_TEMPLATE
from huggingface_hub import constants as hub_constants

from infra import console, data, tasks
from infra.tasks import Example, TaskError
import warm


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch) -> Path:
    """Each test its own datasets cache: nothing is written to, or read from, the user's."""
    cache = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows))
    return path


def gsm8k_rows(count: int, start: int = 0) -> list[dict]:
    return [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1:,}"}
            for i in range(start, start + count)]


def sum_rows(count: int, start: int = 0) -> list[dict]:
    """Rows with other column names than GSM8K's, and a number (not text) as the answer."""
    return [{"problem": f"{i}+{i}=", "solution": 2 * i, "level": i % 3} for i in range(start, start + count)]


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"What is {i}+1?"}]


# --- the forms of --data ---
@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "csv"])
def test_a_local_file_with_its_own_column_names(tmp_path, suffix):
    """Claim: a .jsonl, .parquet or .csv file loads through datasets with --prompt-column / --answer-column naming its
    columns; a number answer becomes its text, the other columns (the answer's too) ride along in `columns`, and the
    last eval_size rows are held out of training."""
    path = tmp_path / f"sums.{suffix}"
    getattr(datasets.Dataset.from_list(sum_rows(20)), f"to_{suffix if suffix != 'jsonl' else 'json'}")(str(path))
    train, held_out = data.load_task(str(path), eval_size=5, prompt_column="problem", answer_column="solution")
    assert [e.prompt for e in train] == [f"{i}+{i}=" for i in range(15)]
    assert [e.answer for e in held_out] == [str(2 * i) for i in range(15, 20)]
    assert train[3].columns == {"solution": 6, "level": 0}


def test_a_directory_holds_out_its_test_split(tmp_path):
    """Claim: a directory of train/test files loads with the splits datasets infers from their names: trained on
    every train row, evaluated on the test split's first eval_size rows."""
    datasets.Dataset.from_list(gsm8k_rows(20)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(gsm8k_rows(8, start=1000)).to_parquet(str(tmp_path / "test.parquet"))
    train, held_out = data.load_task(str(tmp_path), eval_size=5)
    assert len(train) == 20 and [e.answer for e in held_out] == ["1001", "1002", "1003", "1004", "1005"]
    assert train[0] == Example("What is 0 + 1?", "1") and train[0].columns == {"answer": "0 + 1 = 1\n#### 1"}


def test_a_folder_save_to_disk_wrote_loads(tmp_path):
    """Claim: a folder written by `Dataset.save_to_disk` (one split: train, the last rows held out) or by
    `DatasetDict.save_to_disk` (its test split held out) loads with datasets.load_from_disk, as a TRL script loads it."""
    datasets.Dataset.from_list(gsm8k_rows(20)).save_to_disk(str(tmp_path / "one"))
    train, held_out = data.load_task(str(tmp_path / "one"), eval_size=5)
    assert len(train) == 15 and len(held_out) == 5 and train[0] == Example("What is 0 + 1?", "1")
    datasets.DatasetDict(train=datasets.Dataset.from_list(gsm8k_rows(20)),
                         test=datasets.Dataset.from_list(gsm8k_rows(8, start=1000))).save_to_disk(str(tmp_path / "two"))
    train, held_out = data.load_task(str(tmp_path / "two"), eval_size=5)
    assert len(train) == 20 and [e.answer for e in held_out] == ["1001", "1002", "1003", "1004", "1005"]
    (tmp_path / "one" / "state.json").write_text("{")
    with pytest.raises(TaskError, match=r"a folder written by save_to_disk, with datasets.load_from_disk \("):
        data.load_task(str(tmp_path / "one"))


def test_a_train_file_uses_its_sibling_test_file(tmp_path):
    """Claim: --data .../train.jsonl trains on every line and evaluates on the sibling test.jsonl; a file with another
    name keeps its last eval_size lines out of training instead; data too small for that holds out its last fifth,
    said in the first line (TRL evaluates nothing by default: a small dataset should run), and data too small for
    even one held-out row is refused."""
    write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(20))
    write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(8, start=100))
    train, held_out = data.load_task(str(tmp_path / "train.jsonl"), eval_size=5)
    assert len(train) == 20 and [e.answer for e in held_out] == ["101", "102", "103", "104", "105"]
    mine = write_jsonl(tmp_path / "mine.jsonl", gsm8k_rows(20))
    train, held_out = data.load_task(str(mine), eval_size=5)
    assert len(train) == 15 and [e.answer for e in held_out] == ["16", "17", "18", "19", "20"]
    task = data.read_task(str(mine), eval_size=20)
    assert (len(task.train), len(task.held_out)) == (16, 4)
    assert "held out: the last 4 of 20 rows, a fifth (--eval-size 20 would leave too few to train" in task.notes[-1]
    tiny = write_jsonl(tmp_path / "tiny.jsonl", gsm8k_rows(4))
    with pytest.raises(TaskError, match="too few to hold out any"):
        data.load_task(str(tiny), eval_size=20)


def test_without_eval_size_most_of_a_small_dataset_trains(tmp_path):
    """Claim: with --eval-size not given (None) and no test split, at most a fifth of the rows is held out (the
    default 64 once kept 1 of 65 rows for training, silently but for the counts in the first line), said in the first
    line; with a test split, or 320 rows or more, the 64 of the default; trainer.prepare records what it took, so
    config.json reruns the same split."""
    import trainer
    from infra.command_line import parse_args

    for rows, expected in ((65, (52, 13)), (100, (80, 20)), (320, (256, 64)), (1000, (936, 64))):
        task = data.read_task(str(write_jsonl(tmp_path / f"{rows}.jsonl", gsm8k_rows(rows))))
        assert (len(task.train), len(task.held_out)) == expected
        assert (f"held out: the last {expected[1]} of {rows} rows, a fifth" in " ".join(task.notes)) == (rows < 320)
    (tmp_path / "split").mkdir()
    write_jsonl(tmp_path / "split" / "train.jsonl", gsm8k_rows(65))
    write_jsonl(tmp_path / "split" / "test.jsonl", gsm8k_rows(100, start=100))
    assert [len(part) for part in data.load_task(str(tmp_path / "split"))] == [65, 64]
    cfg = parse_args(["--model", "tiny", "--data", str(tmp_path / "65.jsonl"), "--reward", "math"])
    assert cfg.eval_size is None
    assert trainer.prepare(cfg)[0].eval_size == 13
    assert parse_args(["--model", "tiny", "--data", str(tmp_path / "65.jsonl"), "--eval-every", "0"]).eval_size == 0


def test_a_validation_split_is_held_out_when_there_is_no_test_split(tmp_path):
    """Claim: a directory of train and validation files (or a train.jsonl with a sibling validation.jsonl) holds
    out the validation split, as a test split would be, and trains on every train row; with both, the test split is held out; --eval-split (TRL's
    --dataset-test-split) picks one, or --split itself for its last rows; a split the data lacks is one line. The run's
    first line says which split is held out."""
    folder = tmp_path / "gsm"
    folder.mkdir()  # not tmp_path: the datasets cache is there, and a directory loads all its files
    write_jsonl(folder / "train.jsonl", gsm8k_rows(30))
    write_jsonl(folder / "validation.jsonl", gsm8k_rows(8, start=100))
    for given in (folder, folder / "train.jsonl"):
        train, held_out = data.load_task(str(given), eval_size=8)
        assert len(train) == 30 and [e.answer for e in held_out] == [str(i) for i in range(101, 109)], given
    assert data.read_task(str(folder), eval_size=8).notes == ("held out: the validation split",)
    assert data.read_task(str(folder), eval_size=20).notes == ("--eval-size 20: the validation split has 8",)
    write_jsonl(folder / "test.jsonl", gsm8k_rows(4, start=200))
    task = data.read_task(str(folder), eval_size=8)
    assert [e.answer for e in task.held_out][:1] == ["201"] and len(task.train) == 30
    assert task.notes == ("--eval-size 8: the test split has 4",)
    assert data.read_task(str(folder)).notes == ("held out: the whole test split",)  # --eval-size not given (64)
    task = data.read_task(str(folder), eval_size=8, eval_split="validation")
    assert [e.answer for e in task.held_out][:1] == ["101"] and task.notes == ("held out: the validation split",)
    task = data.read_task(str(folder), eval_size=8, eval_split="train")  # --split's own last rows
    assert (len(task.train), task.held_out[0].answer, task.notes) == (22, "23", ())
    with pytest.raises(TaskError, match=r"has the splits 'train', 'validation', 'test', not 'dev': pick the held-out "
                                        r"one with --eval-split") as error:
        data.read_task(str(folder), eval_size=8, eval_split="dev")
    assert "\n" not in str(error.value)
    assert len(data.read_task(str(folder), eval_size=0, eval_split="dev").train) == 30  # nothing held out: not read


def test_without_evaluation_no_prompt_is_held_out(tmp_path):
    """Claim: with --eval-every 0 (never evaluate) every prompt trains, held out none, whatever the data's size and
    --eval-size (50 rows train on 50, with the default --eval-size 64 too);
    TRL holds nothing out unless asked. With evaluation, --eval-size rows are held out. (--eval-size is
    what decides, derived 0 from --eval-every 0: a checkpoint keeps it, so a resumed run trains on the same prompts;
    tests/cli/test_checkpoint.py.)"""
    import trainer
    from infra.command_line import parse_args
    mine = write_jsonl(tmp_path / "mine.jsonl", gsm8k_rows(50))
    for data_name, rows in ((str(mine), 50), ("arithmetic", len(data.load_task("arithmetic", eval_size=0)[0]))):
        _, task, _, _ = trainer.prepare(parse_args(["--data", data_name, "--eval-every", "0"]))
        assert (len(task.train), task.held_out) == (rows, [])
    train, held_out = data.load_task(str(mine), eval_size=0)
    assert len(train) == 50 and held_out == []
    write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(20))  # a test split: none of it read
    write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(8, start=100))
    assert [len(examples) for examples in data.load_task(str(tmp_path / "train.jsonl"), eval_size=0)] == [20, 0]
    _, task, _, _ = trainer.prepare(parse_args(["--data", str(mine), "--eval-size", "10"]))
    assert (len(task.train), len(task.held_out)) == (40, 10)


def test_the_real_gsm8k_files():
    """Claim: the shared GSM8K copy loads as a directory or as its train.jsonl (7473 train, the test split held out),
    and the gold answer of every test line is the '#### N' of its solution, which earns reward 1."""
    if not (GSM8K_DIR / "train.jsonl").is_file():
        pytest.skip(f"GSM8K is not at {GSM8K_DIR}")
    train, held_out = data.load_task(str(GSM8K_DIR), eval_size=64)
    assert len(train) == 7473 and len(held_out) == 64 and held_out[0].answer == "18"
    assert data.load_task(str(GSM8K_DIR / "train.jsonl"), eval_size=64) == (train, held_out)
    test = data.dataset_examples(data.load_splits(str(GSM8K_DIR))["test"], "question", "answer", "test")
    solutions = [json.loads(line)["answer"] for line in (GSM8K_DIR / "test.jsonl").read_text().splitlines()]
    assert len(test) == len(solutions) == 1319
    for example, solution in zip(test, solutions):
        gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
        assert example.answer == tasks.canonical_number(gold) == tasks.extract_final_number(solution)
        assert tasks.math_reward(example.prompt, solution, example.answer) == 1.0


@pytest.mark.parametrize("value, gold", [("She has 5.\n#### 1,080", "1080"), ("#### 18.00", "18"),
                                         ("  Paris\n", "Paris"), ("#### yes", "yes"), (7, "7"), (2.5, "2.5"),
                                         ("", None), (" ", None), (None, None), ([1], None), (True, None)])
def test_gold_answer(value, gold):
    """Claim: GSM8K's '#### N' gives the canonical N, other text is kept as it is (stripped), a number becomes its
    text; nothing, blank text or a value that is not text has no gold answer."""
    assert data.gold_answer(value) == gold


# --- TRL's conversational prompts ---
def test_a_conversational_prompt_column_goes_through_the_chat_template(tmp_path):
    """Claim: TRL's 'prompt' column of chat messages is used when the data has no 'question' column; each prompt is
    rendered with the model's chat template (Qwen2.5-Instruct's) as it is: its own system message, no SYSTEM_PROMPT
    added, ending with the assistant's turn; a plain-text prompt gets no SYSTEM_PROMPT either:
    only the template's own default system message."""
    from infra.tiny import tiny_tokenizer
    rows = [{"prompt": conversation(i), "solution": str(i + 1)} for i in range(12)]
    train, held_out = data.load_task(str(write_jsonl(tmp_path / "chat.jsonl", rows)), eval_size=2,
                                      answer_column="solution")
    assert train[4].prompt == conversation(4) and train[4].answer == "5" and train[4].columns == {"solution": "5"}
    tokenizer = tiny_tokenizer()  # the tokenizer of conftest's Qwen-shaped model, without building the model
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    text = tokenizer.decode(tasks.prompt_token_ids(tokenizer, train[4].prompt))
    assert text == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 4+1?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    plain = tokenizer.decode(tasks.prompt_token_ids(tokenizer, "What is 4+1?"))
    assert plain == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
                     "\n<|im_start|>user\nWhat is 4+1?<|im_end|>\n<|im_start|>assistant\n")  # Qwen's template's own


def test_trls_prompt_column_wins_over_question(tmp_path):
    """Claim: data with both GSM8K's 'question' and TRL's 'prompt' column (what `dataset.map(make_conversation)` makes
    of GSM8K) trains on 'prompt' when --prompt-column is not given, as TRL reads it: its system message kept, the
    rewards given the messages and the 'question' as a column. The run's first line says which column, and the options config.json records name it;
    --prompt-column question still picks the other, and GSM8K-only data reads 'question' without a word."""
    import trainer
    from infra.command_line import parse_args
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}", "prompt": conversation(i)} for i in range(12)]
    path = write_jsonl(tmp_path / "mapped.jsonl", rows)
    train, held_out = data.load_task(str(path), eval_size=2)
    assert train[4].prompt == conversation(4) and held_out[0].prompt == conversation(10)
    assert train[4].answer == "5" and train[4].columns == {"question": "What is 4+1?", "answer": "#### 5"}
    task = data.read_task(str(path), eval_size=2)
    assert task.prompt_column == "prompt" and task.notes == ("prompts from column 'prompt' (TRL's), not 'question'",)
    cfg, task, _, _ = trainer.prepare(parse_args(["--data", str(path), "--eval-size", "2"]))
    assert cfg.prompt_column == "prompt" and parse_args([]).prompt_column is None  # recorded as used; auto
    line = console.start_line(cfg, len(task.train), len(task.held_out), task.notes)
    assert ("10 train / 2 held-out prompts (prompts from column 'prompt' (TRL's), not 'question'; 10 training "
            "prompt(s), fewer than the 16 an iteration takes: each iteration samples some of them more than once; "
            "evaluated every 10 iterations and at the end, 4 responses per prompt: 56 responses, 1% of the 7680 trained "
            "on) |"
            in line)
    chosen = data.read_task(str(path), eval_size=2, prompt_column="question")
    assert chosen.train[4].prompt == "What is 4+1?" and chosen.notes == ()
    gsm8k = data.read_task(str(write_jsonl(tmp_path / "gsm.jsonl", gsm8k_rows(6))), eval_size=2)
    assert (gsm8k.prompt_column, gsm8k.train[0].prompt, gsm8k.notes) == ("question", "What is 0 + 1?", ())


# --- prompt-only data, every column, --system-prompt ---
MATH = {"answer": "--reward math"}  # what Rewards.needed_columns gives for --reward math


@pytest.mark.parametrize("prompt", ["What is 4+1?", [{"role": "user", "content": "What is 4+1?"}]],
                         ids=["text", "conversation"])
def test_prompt_only_data_loads_when_no_reward_needs_an_answer(tmp_path, prompt):
    """Claim: TRL's prompt-only datasets (a 'prompt' column, text or conversational, and any other columns but no
    answer) load: gold answer None, every other column kept for the rewards; a reward that needs a gold answer
    (--reward math) is refused at load time in one line naming the reward, the column and the columns there are."""
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": prompt, "target_len": i} for i in range(12)])
    train, held_out = data.load_task(str(path), eval_size=2)
    assert len(train) == 10 and len(held_out) == 2
    assert train[3] == Example(prompt, None) and train[3].columns == {"target_len": 3}
    with pytest.raises(TaskError) as error:
        data.load_task(str(path), eval_size=2, needed=MATH)
    assert str(error.value) == (f"--reward math needs a gold answer, and {path} (train split) has no column 'answer' "
                                "to take it from; its columns are 'prompt', 'target_len'. Name the column of answers "
                                "with --answer-column, or use a reward that needs none (e.g. TRL's "
                                "f(completions, **kwargs)).")


def test_a_column_a_reward_takes_must_be_there(tmp_path):
    """Claim: a TRL-style reward's parameter without a default (trl.rewards.accuracy_reward's `solution`) is a column
    the data must have: without it the run is refused at load time in one line naming the reward and the column
    (TRL would fail at the first reward call); the prompt's column does not count (TRL does not pass it), and a
    built-in task has no other columns."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}+1=", "solution": str(i + 1)} for i in range(6)])
    assert data.load_task(str(path), eval_size=2, needed={"solution": "--reward r.py:acc"})[0][0].columns == {
        "solution": "1"}
    for needed in ({"answer_text": "--reward r.py:acc"}, {"prompt": "--reward r.py:acc"}):
        column = next(iter(needed))
        with pytest.raises(TaskError, match=f"^--reward r.py:acc takes a parameter '{column}' without a default, and "
                                            f".* has no column '{column}' to fill it"):
            data.load_task(str(path), eval_size=2, needed=needed)
    with pytest.raises(TaskError, match="^--reward r.py:acc takes a parameter 'solution' .* --data arithmetic has no "
                                        "column but the prompt and the answer"):
        data.load_task("arithmetic", needed={"solution": "--reward r.py:acc", **MATH})
    assert data.load_task("arithmetic", eval_size=4, needed=MATH)[1] == tasks.arithmetic_examples("eval")[:4]


def test_a_system_prompt_goes_in_front_of_every_prompt(tmp_path):
    """Claim: --system-prompt (a text, or 'math' for GSM8K's SYSTEM_PROMPT) puts a system message in front of every
    prompt, training and held-out, text or conversation; a conversation with its own system message is refused;
    without it the prompts are the data's, as they are."""
    (tmp_path / "gsm").mkdir()  # not tmp_path: the datasets cache is there, and a directory loads all its files
    write_jsonl(tmp_path / "gsm" / "train.jsonl", gsm8k_rows(6))
    write_jsonl(tmp_path / "gsm" / "test.jsonl", gsm8k_rows(3, start=100))
    plain = data.load_task(str(tmp_path / "gsm"), eval_size=2)
    assert plain[0][0].prompt == "What is 0 + 1?" and plain[1][0].prompt == "What is 100 + 1?"
    train, held_out = data.load_task(str(tmp_path / "gsm"), eval_size=2, system_prompt="math")
    assert train[0].prompt == [{"role": "system", "content": tasks.SYSTEM_PROMPT},
                               {"role": "user", "content": "What is 0 + 1?"}]
    assert held_out[1].prompt[0] == {"role": "system", "content": tasks.SYSTEM_PROMPT}
    assert (train[0].answer, train[0].columns) == (plain[0][0].answer, plain[0][0].columns)
    assert data.load_task("arithmetic", system_prompt="Add.")[0][0].prompt[0] == {"role": "system", "content": "Add."}
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"prompt": conversation(i), "answer": "1"} for i in range(4)])
    with pytest.raises(TaskError, match=r"^--system-prompt: a prompt of .*chats.jsonl \(train split\) has its own "
                                        r"system message \('Answer with a number.'\)"):
        data.load_task(str(chats), eval_size=1, system_prompt="Be brief.")


def test_examples_with_their_columns_survive_pickling(tmp_path):
    """Claim: an Example with every kind of column value datasets gives (text, numbers, None, lists, nested dicts)
    pickles whole, as it travels to the inference process (and columns, left out of ==, come back equal too)."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": f"#### {i}", "tags": ["a", "b"],
             "meta": {"level": i, "source": None}, "weight": 0.5} for i in range(3)]
    examples = data.load_task(str(write_jsonl(tmp_path / "rich.jsonl", rows)), eval_size=1)[0]
    copies = pickle.loads(pickle.dumps(examples))
    assert copies == examples and [c.columns for c in copies] == [e.columns for e in examples]
    assert copies[1].columns == {"answer": "#### 1", "tags": ["a", "b"], "meta": {"level": 1, "source": None},
                                 "weight": 0.5}


def test_conversations_need_a_chat_template_and_fit_the_context():
    """Claim: conversations with a model that has no chat template are refused at start-up in one line (even when the
    context is unknown); with a template, a conversation too long for the context is found and its length and row
    named; a
    --max-new-tokens that alone fills the context is named as the fault."""
    from infra.tiny import tiny_tokenizer
    tokenizer = tiny_tokenizer()  # one token per byte, no chat template
    chats = [Example(conversation(i), str(i + 1)) for i in range(3)]
    with pytest.raises(TaskError, match="no chat template") as error:
        tasks.check_prompt_lengths(tokenizer, chats, None, 8)
    assert "\n" not in str(error.value)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    rows = datasets.Dataset.from_list([{"prompt": chat.prompt, "answer": chat.answer} for chat in chats]
                                      + [{"prompt": [{"role": "user", "content": "1+" * 60 + "1?"}], "answer": "61"}])
    *_, long = data.dataset_examples(rows, "prompt", "answer", "chats.jsonl (train split)")
    assert long.source == "chats.jsonl (train split), row 4"
    tasks.check_prompt_lengths(tokenizer, chats + [long], 256, 8)
    length = len(tasks.prompt_token_ids(tokenizer, long.prompt))
    assert length == len("<user>" + "1+" * 60 + "1?\n<assistant>")  # byte-level: one token per character
    with pytest.raises(TaskError, match=rf"the longest prompt is {length} tokens \('.*'\.\.\., chats.jsonl \(train split\), "
                                        r"row 4\)"):  # where it is, to remove it
        tasks.check_prompt_lengths(tokenizer, chats + [long], length + 7, 8)
    most = 256 - max(len(tasks.prompt_token_ids(tokenizer, chat.prompt)) for chat in chats)
    with pytest.raises(TaskError, match=r"^--max-new-tokens 300 \(--max-completion-length\) leaves no room for a "
                                        rf"prompt in the model's context of 256 tokens .*: lower it to {most} or less"):
        tasks.check_prompt_lengths(tokenizer, chats, 256, 300)  # the option named, not the data, and what fits
    tasks.check_prompt_lengths(tokenizer, chats, 256, most)  # the number it names does fit


QWEN3_GENERATION = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
                    "<assistant>{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
                    "{% endif %}{% endif %}")  # Qwen3's switch, as its template reads it


def test_chat_template_kwargs_reach_the_template_and_a_misspelt_one_is_refused(tmp_path):
    """Claim (--chat-template-kwargs, TRL's chat_template_kwargs): the variables reach the chat template wherever a
    prompt is tokenized (enable_thinking false: Qwen3's empty think block after the generation prompt), a TRL config
    file may give the mapping itself, and bad values end in one line at start-up: not a JSON object,
    apply_chat_template's own arguments, a variable the template never reads (a misspelling would change nothing,
    silently; not checked in a template with transformers' own {% generation %} tag, which jinja2 alone cannot
    parse), a model without a chat template."""
    from infra import command_line, options
    from infra.tiny import tiny_tokenizer
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN3_GENERATION
    chats = [Example(conversation(i), str(i + 1)) for i in range(2)]
    off = tasks.template_kwargs('{"enable_thinking": false}')
    assert off == {"enable_thinking": False} and tasks.template_kwargs(None) == {}
    plain, thinking_off = (tokenizer.decode(tasks.prompt_token_ids(tokenizer, chats[0].prompt, t)) for t in (None, off))
    assert plain.endswith("<assistant>") and thinking_off == plain + "<think></think>"
    tasks.check_prompt_lengths(tokenizer, chats, 256, 8, off)
    with pytest.raises(TaskError, match=r"reads no enable_thinkin \(it reads enable_thinking\): check the spelling"):
        tasks.check_prompt_lengths(tokenizer, chats, 256, 8, {"enable_thinkin": False})
    for text, reason in [("{bad", "must be a JSON object"), ("[1]", "must be a JSON object"),
                         ('{"tokenize": true}', "tokenize is apply_chat_template's own")]:
        with pytest.raises(TaskError, match=re.escape(reason)) as error:
            tasks.template_kwargs(text)
        assert "\n" not in str(error.value)
        assert any(reason in line for line in options.validate(options.Config(chat_template_kwargs=text)))
    tokenizer.chat_template = QWEN3_GENERATION.replace("<{{ m.role }}>{{ m.content }}", "{% generation %}"
                                                       "<{{ m.role }}>{{ m.content }}{% endgeneration %}")
    tasks.check_prompt_lengths(tokenizer, chats, 256, 8, {"enable_thinkin": False})  # transformers' own tag: unread
    tokenizer.chat_template = None
    with pytest.raises(TaskError, match="has no chat template"):
        tasks.check_prompt_lengths(tokenizer, [Example("1+1?", "2")], 256, 8, off)
    config = tmp_path / "grpo.yaml"
    config.write_text("chat_template_kwargs:\n  enable_thinking: false\n")
    assert command_line.file_arguments(str(config)) == ['--chat-template-kwargs={"enable_thinking": false}']


# --- bad data: one line ---
@pytest.mark.parametrize("rows, said", [
    ([gsm8k_rows(1)[0], b"{not json"], "JSON parse error"),
    ([gsm8k_rows(1)[0], '{"question": "caf\xe9?", "answer": "#### 1"}'.encode("latin-1")], "UnicodeDecodeError"),
    ([gsm8k_rows(1)[0], {"question": "q"}], ("row 2: the 'answer' is None, so there is no gold answer for --reward "
                                              "math to reward")),
    ([gsm8k_rows(1)[0], {"question": "q", "answer": ""}], "row 2: the 'answer' is ''"),
    ([gsm8k_rows(1)[0], {"question": 5, "answer": "#### 5"}],  # datasets < 5 refuses the mixed column itself
     "row 2: the 'question' is 5, neither text nor|changed from string to number"),
    ([{"question": conversation(0), "answer": "1"}, {"question": [{"role": "user"}], "answer": "5"}],
     "row 2: the 'question' is \\["),
], ids=["json", "latin-1", "missing-answer", "empty-answer", "number-question", "message-without-content"])
def test_bad_rows_are_one_line(tmp_path, rows, said):
    """Claim: a line that is not JSON or not UTF-8, a row without an answer (for a reward that needs one), or with a
    prompt that is neither text nor chat messages, is one TaskError line naming the file (and the row, 1-based,
    where it is a row's fault)."""
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TaskError) as error:
        data.load_task(str(path), eval_size=1, needed=MATH)
    assert str(path) in str(error.value) and re.search(said, str(error.value)) and "\n" not in str(error.value)


def test_a_missing_column_lists_the_columns_there_are(tmp_path):
    """Claim: a prompt column, or an answer column a reward needs, that the data does not have is one line listing
    its columns and the option."""
    path = write_jsonl(tmp_path / "sums.jsonl", sum_rows(10))
    with pytest.raises(TaskError, match=r"has no column 'prompt' or 'question'; its columns are 'problem', 'solution', "
                                        r"'level'. Pick one with --prompt-column"):
        data.load_task(str(path), eval_size=2)
    with pytest.raises(TaskError, match=r"has no column 'answer' to take it from; its columns are 'problem', "
                                        r"'solution', 'level'. Name the column of answers with --answer-column"):
        data.load_task(str(path), eval_size=2, prompt_column="problem", needed=MATH)


@pytest.mark.parametrize("name, said", [("absent.jsonl", "nor an existing file or directory"),
                                        ("no/such/dir", "nor an existing file or directory"),
                                        ("notes.txt", "cannot tell the format"), ("empty.jsonl", "is empty")])
def test_paths_that_cannot_be_data(tmp_path, name, said):
    """Claim: a missing path, a file of an unknown format and an empty file are one line suggesting --data forms."""
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TaskError, match=said):
        data.load_task(str(tmp_path / name))


def test_a_missing_split_names_the_splits_there_are(tmp_path):
    """Claim: --split naming a split the data does not have is one line listing its splits."""
    path = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(10))
    write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(3))
    with pytest.raises(TaskError, match=r"has the splits 'train', 'test', not 'validation': pick one with --split"):
        data.load_task(str(path), split="validation")


# --- offline ---
def cache_as_if_downloaded(cache: Path, rows_dir: Path, repo_id: str, config: str) -> None:
    """Put local files in the datasets cache as a hub download of `repo_id` (config `config`) leaves them:
    <cache>/<owner>___<name>/<config>/<version>/<hash>/ with <name>-<split>.arrow and dataset_info.json."""
    from datasets.packaged_modules.json.json import Json
    owner, name = repo_id.split("/")
    builder = Json(cache_dir=str(cache / "build"), dataset_name=name, config_name=config, hash="0" * 16,
                   data_files={split: str(rows_dir / f"{split}.jsonl") for split in ("train", "test")})
    builder.download_and_prepare()
    built = Path(builder.cache_dir)  # <cache>/build/<name>/<config>-<kwargs hash>/<version>/<hash>
    shutil.copytree(built, cache / f"{owner}___{name}" / config / built.parent.name / built.name)


def test_offline_gsm8k_loads_from_the_datasets_cache(tmp_path, datasets_cache, monkeypatch):
    """Claim: with the hub unreachable, --data gsm8k loads openai/gsm8k (config main) from the datasets cache at once
    (no ~25 s of retries); without a cached copy it fails as fast, in one line telling to pass a local copy."""
    datasets_offline = datasets.config.HF_HUB_OFFLINE
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # what an unreachable hub looks like to the probe
    start = time.perf_counter()
    with pytest.raises(TaskError, match="cannot reach the Hugging Face hub for 'openai/gsm8k'") as error:
        data.load_task("gsm8k")
    assert "--data path/to/dir-or-file" in str(error.value) and "\n" not in str(error.value)
    write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(30))
    write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(10, start=500))
    cache_as_if_downloaded(datasets_cache, tmp_path, "openai/gsm8k", "main")
    train, held_out = data.load_task("gsm8k", eval_size=4)
    assert len(train) == 30 and [e.answer for e in held_out] == ["501", "502", "503", "504"]
    assert time.perf_counter() - start < hang_bound(10)
    assert hub_constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE == datasets_offline  # switched back


def test_the_command_line_takes_every_form_of_data(tmp_path):
    """Claim: --data with a hub id or an existing directory parses (a hub id is checked when loaded), a path that does
    not exist is refused at parse time in one line, and the column and split options reach the Config."""
    from config import Config
    from infra.options import validate
    from infra.command_line import parse_args
    for given in ("openai/gsm8k", "gsm8k", "chain", str(tmp_path)):
        assert validate(Config(data=given)) == []
    for missing in (str(tmp_path / "absent.jsonl"), "no/such/dir", "./nowhere"):
        assert [p for p in validate(Config(data=missing)) if "nor an existing file or directory" in p]
    cfg = parse_args(["--data", "openai/gsm8k", "--data-config", "socratic", "--split", "test", "--prompt-column", "q",
                      "--answer-column", "a", "--system-prompt", "math"])
    assert (cfg.data_config, cfg.split, cfg.prompt_column, cfg.answer_column) == ("socratic", "test", "q", "a")
    assert cfg.system_prompt == "math" and parse_args([]).system_prompt is None


def test_text_prompts_are_taken_as_trl_takes_them(qwen_shaped_dir, tmp_path, capsys):
    """Claim (--text-prompts): with a chat model, TRL's 'prompt' column of text is sampled from as it is, as TRL takes
    its standard format (a reviewer found it silently rendered in the chat template, with the template's default
    system message), the first line saying so; GSM8K's 'question' column, and --text-prompts chat, render the text
    as the user's message; conversations take the template either way. The prompt is read back from
    completions.jsonl, decoded from the ids the model sampled from (sync runs through trainer.main, in this
    process)."""
    import trainer

    def sampled_prompt(column: str, *extra: str) -> tuple[str, str]:
        rows = [{column: f"What is {i}+1?", "answer": str(i + 1)} for i in range(12)]
        path = write_jsonl(tmp_path / f"{column}{len(extra)}.jsonl", rows)
        out = tmp_path / f"run-{column}-{len(extra)}"
        capsys.readouterr()
        code = trainer.main(["--model", str(qwen_shaped_dir), "--data", str(path), "--mode", "sync", "--iterations",
                             "1", "--batch-size", "4", "--group-size", "2", "--max-new-tokens", "2", "--eval-every",
                             "0", "--groups-per-call", "2", "--micro-batch-tokens", "4096", "--rollout-threads", "1",
                             "--train-threads", "1", "--no-save", "--log-completions", "--out", str(out), *extra])
        stdout, stderr = capsys.readouterr()
        assert code == 0, stderr
        record = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
        return record["prompt"], stdout.splitlines()[0]

    prompt, first = sampled_prompt("prompt")
    assert re.fullmatch(r"What is \d+\+1\?", prompt) and "text prompts as they are, as TRL takes" in first, (prompt,
                                                                                                          first)
    for column, extra in (("question", ()), ("prompt", ("--text-prompts", "chat"))):
        prompt, first = sampled_prompt(column, *extra)
        assert re.fullmatch(r"<\|im_start\|>system\n.*<\|im_end\|>\n<\|im_start\|>user\nWhat is \d+\+1\?<\|im_end\|>\n"
                            r"<\|im_start\|>assistant\n", prompt, re.S), (column, prompt)
        assert "text prompts in the model's chat template" in first, first


def test_a_new_data_rederives_what_auto_held_out(tmp_path):
    """Claim: config.json records the held-out count auto took (13 of 65 rows); rerun with
    another --data (or --split, --eval-split), the count is auto again, not the small data's 13."""
    from infra.command_line import parse_args
    record = tmp_path / "config.json"
    small = write_jsonl(tmp_path / "a.jsonl", gsm8k_rows(65))
    record.write_text(json.dumps({"model": "tiny", "data": str(small), "eval_size": 13, "run_id": "r"}))
    big = write_jsonl(tmp_path / "big.jsonl", gsm8k_rows(400))
    assert parse_args(["--config", str(record)]).eval_size == 13
    assert parse_args(["--config", str(record), "--data", str(big)]).eval_size is None


def test_fewer_training_prompts_than_an_iteration_takes_are_said(tmp_path):
    """Claim: a training set smaller than an iteration's prompts (one row, two prompts per iteration) is said in the
    run's first line: each iteration then samples some prompts more than once."""
    import trainer
    from config import Config
    from infra.options import derive
    write_jsonl(tmp_path / "one.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    cfg = derive(Config(data=str(tmp_path / "one.jsonl"), batch_size=16, group_size=8, eval_every=0))
    _, task, _, _ = trainer.prepare(cfg)
    assert task.notes[-1] == ("1 training prompt(s), fewer than the 2 an iteration takes: each iteration samples "
                              "some of them more than once")
    cfg = derive(Config(data=str(tmp_path / "one.jsonl"), batch_size=8, group_size=8, eval_every=0))
    assert not any("fewer than" in note for note in trainer.prepare(cfg)[1].notes)


def test_the_tiny_model_takes_trls_conversational_data(tmp_path):
    """Claim: `--model tiny` has a chat template, so TRL's conversational `prompt` column (chat messages) trains on it
    offline: a user's message is the same tokens as its text (what the model was warmed up on), a system message comes
    before it on a line of its own, a prefilled assistant's message is continued; text prompts still go as they are,
    with no note about a template that changes nothing. The run exits 0."""
    import subprocess
    import sys
    from infra.console import text_prompts_note
    from infra.models import load_model
    from infra.tasks import prompt_token_ids
    _, tokenizer = load_model("tiny")
    user = [{"role": "user", "content": "37+45="}]
    assert prompt_token_ids(tokenizer, user) == tokenizer.encode("37+45=", add_special_tokens=False)
    assert tokenizer.decode(prompt_token_ids(tokenizer, [{"role": "system", "content": "Add."}, *user])) \
        == "Add.\n37+45="
    assert tokenizer.decode(prompt_token_ids(tokenizer, [*user, {"role": "assistant", "content": "8"}])) == "37+45=8"
    assert text_prompts_note(tokenizer, [Example("37+45=", "82")], raw=False) == ()
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)} for i in range(12)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    result = warm.run([sys.executable, "trainer.py", "--data", str(data), "--mode", "sync", "--iterations", "1",
                             "--batch-size", "4", "--group-size", "2", "--eval-every", "0", "--groups-per-call", "2",
                             "--micro-batch-tokens", "4096", "--rollout-threads", "1", "--train-threads", "1",
                             "--no-save", "--out", str(tmp_path / "run")],
                            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
