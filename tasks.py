"""Tasks: the prompts the policy is trained on, and the built-in reward that scores its answers.

A task is a list of `Example(prompt, answer)`: the question as plain text (before any chat template)
and the gold final answer as a canonical number string. The reward is a plain function

    reward(prompt, completion, answer) -> float        # 1.0 correct, 0.0 wrong for `math_reward`

so a user can swap in their own with `--reward my_rewards.py:score` (reward.py loads and calls it).
Three tasks are built in:

- `arithmetic` (offline): `"37+45="` -> `"82"` with operands in [0, 50). A fixed CRC32 of the operand
  pair puts ~10% of the pairs in a held-out `eval` split, so held-out accuracy measures addition, not
  memorisation. It is what the offline `tiny` model is warmed up on (models.py).
- `chain` (offline): `"3+8+1+5="` -> `"17"`, k single-digit terms, worked step by step
  (`"3+8=11 11+1=12 12+5=17"`, what `tiny-chain` is warmed up on). k follows a power law,
  P(k) ∝ k^-1.5 on 2..13, so responses run from 5 to ~100 tokens with a long tail, as an LLM's
  reasoning does: most groups finish in a few decode steps, one in ten runs ten times longer. The
  workload where streaming groups by completion pays (bench.py peer --task chain).
- GSM8K (Cobbe et al., 2021): the paper's benchmark (arXiv 2511.18871, Sec. 5). The gold answer is the
  number after `####`. Read from a local JSONL file, or fetched once from the hub into the HF cache.

Deliberate departures:
1. Answers are compared as numbers (`18.00` == `18`, `1,080` == `1080`), not as strings, and the
   completion's answer is the first of: `#### N`, `\\boxed{N}`, "the answer is N", the last number.
   Format is not rewarded separately: one binary correctness reward, as in the paper.
2. Fetching GSM8K first looks in the HF cache, then asks the hub once *without retries*: offline,
   huggingface_hub would otherwise retry with back-off for ~25 s before failing.
"""
from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from config import UserError

ARITHMETIC_OPERANDS = range(50)  # two-digit sums: learnable by a 2-layer model in well under a minute
ARITHMETIC_EVAL_BUCKETS = 10  # 1 in 10 operand pairs is held out
GSM8K_REPO = "openai/gsm8k"
SYSTEM_PROMPT = ("You are a careful math tutor. Reason step by step, then give the final answer as a "
                 "number on the last line, in the form '#### <number>'.")


@dataclass(frozen=True)
class Example:
    prompt: str | list[dict]  # the question before any chat template, or a conversation (TRL's chat format)
    answer: str  # the gold final answer, a canonical number string ("82", "-3", "2.5") for the math reward
    columns: dict = field(default_factory=dict, compare=False)  # the dataset row's other columns (TRL-style
    # rewards receive them as keyword lists)


class TaskError(UserError):
    """A dataset or reward could not be loaded; the message says what to do instead."""


# --- answers ---
_NUMBER = re.compile(r"(?<![\d.])-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def canonical_number(text: str) -> str | None:
    """'$1,080.00' -> '1080', '-2.50' -> '-2.5'; None if `text` is not a number."""
    try:
        value = Decimal(text.replace("$", "").replace(",", "").strip().rstrip("."))
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    text = format(value.normalize(), "f")  # 'f' avoids normalize()'s exponent form: 1E+2 -> 100
    return "0" if text == "-0" else text


def _first_number(text: str) -> str | None:
    match = _NUMBER.search(text)
    return canonical_number(match.group()) if match else None


def extract_final_number(text: str) -> str | None:
    """The completion's final answer as a canonical number string, or None.

    >>> extract_final_number("So 3 + 4 = 7 eggs.\\n#### 7")
    '7'
    >>> extract_final_number("The answer is $1,250.00.")
    '1250'
    """
    if "####" in text:
        return _first_number(text.rsplit("####", 1)[1])
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return _first_number(boxed[-1])
    stated = re.findall(r"answer is[:\s]*(.*)", text, flags=re.IGNORECASE)
    if stated and _first_number(stated[-1]) is not None:
        return _first_number(stated[-1])
    numbers = _NUMBER.findall(text)
    return canonical_number(numbers[-1]) if numbers else None


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final number equals the gold answer numerically, else 0.0."""
    predicted = extract_final_number(completion)
    return float(predicted is not None and predicted == canonical_number(answer))


# --- arithmetic (offline) ---
def arithmetic_examples(split: str) -> list[Example]:
    """All 'a+b=' prompts of `split` ('train' or 'eval'), in a fixed shuffled order.

    The split is a CRC32 of 'a+b' (stable across runs and machines, unlike `hash`), so the
    held-out pairs never appear in training.
    """
    if split not in ("train", "eval"):
        raise TaskError(f"arithmetic has the splits 'train' and 'eval', not {split!r}.")
    examples = [Example(f"{a}+{b}=", str(a + b)) for a in ARITHMETIC_OPERANDS for b in ARITHMETIC_OPERANDS
                if (zlib.crc32(f"{a}+{b}".encode()) % ARITHMETIC_EVAL_BUCKETS == 0) == (split == "eval")]
    random.Random(0).shuffle(examples)  # so a truncated eval list is not all '0+b='
    return examples


# --- chain sums (offline, long-tailed response lengths) ---
CHAIN_TERMS = range(2, 14)  # 2..13 single-digit terms: 1 to 12 steps of working, 5 to ~100 characters
CHAIN_TAIL = 1.5  # P(k terms) ∝ k^-CHAIN_TAIL: a third of the chains have 2 terms, one in ten has 10 or more
CHAIN_SIZE = {"train": 20000, "eval": 512}


def chain_working(prompt: str) -> str:
    """The step-by-step target for a chain prompt; its last number is the answer.

    >>> chain_working("3+8+1+5=")
    '3+8=11 11+1=12 12+5=17'
    """
    terms = [int(t) for t in prompt.rstrip("=").split("+")]
    steps, total = [], terms[0]
    for term in terms[1:]:
        steps.append(f"{total}+{term}={total + term}")
        total += term
    return " ".join(steps)


def chain_examples(split: str) -> list[Example]:
    """`CHAIN_SIZE[split]` chain prompts, drawn with a fixed seed; a CRC32 of the prompt keeps the
    splits apart (1 in 10 prompts can only be drawn for 'eval')."""
    if split not in CHAIN_SIZE:
        raise TaskError(f"chain has the splits 'train' and 'eval', not {split!r}.")
    rng = random.Random(f"chain-{split}")
    lengths, weights = list(CHAIN_TERMS), [k ** -CHAIN_TAIL for k in CHAIN_TERMS]
    examples: list[Example] = []
    while len(examples) < CHAIN_SIZE[split]:
        terms = [rng.randrange(10) for _ in range(rng.choices(lengths, weights)[0])]
        prompt = "+".join(map(str, terms)) + "="
        if (zlib.crc32(prompt.encode()) % ARITHMETIC_EVAL_BUCKETS == 0) == (split == "eval"):
            examples.append(Example(prompt, str(sum(terms))))
    return examples


# --- GSM8K ---
def _gsm8k_example(question: str, solution: str) -> Example | None:
    """GSM8K's solution ends with '#### N'; None when it does not."""
    if "####" not in solution:
        return None
    answer = canonical_number(solution.rsplit("####", 1)[1])
    return Example(question, answer) if answer is not None else None


def load_gsm8k_jsonl(path: str | Path) -> list[Example]:
    """One {"question": ..., "answer": "... #### N"} object per line (GSM8K's release format)."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as error:
        raise TaskError(f"cannot read the GSM8K file {path} ({error.strerror or error}). Pass --data with an "
                        "existing JSONL file (one {\"question\", \"answer\"} object per line, the answer ending "
                        "in '#### N'), or --data arithmetic for the built-in offline task.") from error
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))  # decoded per line, so that an error can name its line
            question, solution = row["question"], row["answer"]
        except UnicodeDecodeError as error:
            raise TaskError(f"{path}, line {number}: not UTF-8 text (byte {line[error.start]:#04x} at column "
                            f"{error.start + 1}). Save the file as UTF-8, or fix or remove that line.") from None
        except (json.JSONDecodeError, TypeError, KeyError) as error:
            raise TaskError(f"{path}, line {number}: expected a JSON object with 'question' and 'answer' "
                            f"({type(error).__name__}: {error}). Fix or remove that line.") from error
        for key, value in (("question", question), ("answer", solution)):
            if not isinstance(value, str):
                raise TaskError(f"{path}, line {number}: the {key!r} is {type(value).__name__} {value!r:.40}, not "
                                "text. Fix or remove that line.")
        example = _gsm8k_example(question, solution)
        if example is None:
            raise TaskError(f"{path}, line {number}: the answer does not end in '#### <number>', so there is "
                            "no gold answer to reward. Fix or remove that line.")
        examples.append(example)
    if not examples:
        raise TaskError(f"{path} holds no examples. Pass a GSM8K-format JSONL file with at least one line.")
    return examples


def hub_unreachable_reason(repo_id: str, filename: str, repo_type: str = "model") -> str | None:
    """Ask the hub once, without retries, for one file's metadata; None if it answered, else why not.

    `hf_hub_download` and `from_pretrained` retry network errors with back-off (~25 s offline);
    this probe fails in well under a second on a machine with no network (a black-holed network
    waits for HF_HUB_ETAG_TIMEOUT, 10 s by default), and honours HF_ENDPOINT, proxies and tokens.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename, repo_type=repo_type))
    except Exception as error:  # network, offline mode, 401/404: all mean "cannot download it now"
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    return None


def fetch_gsm8k(split: str) -> list[Example]:
    """GSM8K `split` ('train' or 'test') from the hub's parquet file, cached in the HF cache."""
    from huggingface_hub import hf_hub_download
    filename = f"main/{split}-00000-of-00001.parquet"
    download = dict(repo_id=GSM8K_REPO, filename=filename, repo_type="dataset")
    try:
        path = hf_hub_download(**download, local_files_only=True)
    except Exception:  # not cached yet (or a cache error): ask the hub once before downloading
        reason = hub_unreachable_reason(GSM8K_REPO, filename, repo_type="dataset")
        if reason is not None:
            raise TaskError(f"cannot fetch GSM8K {split!r} from the Hugging Face hub ({GSM8K_REPO}, {filename}: "
                            f"{reason}), and it is not in the local HF cache. Offline, pass a local copy with "
                            "--data path/to/gsm8k.jsonl (e.g. --data ../shared/data/gsm8k/train.jsonl; a sibling "
                            "test.jsonl becomes the held-out set), or use --data arithmetic.") from None
        path = hf_hub_download(**download)
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise TaskError("reading GSM8K's parquet file needs pyarrow: pip install pyarrow "
                        "(or pass a JSONL copy with --data path/to/gsm8k.jsonl).") from error
    table = pq.read_table(path, columns=["question", "answer"]).to_pydict()
    examples = [_gsm8k_example(q, a) for q, a in zip(table["question"], table["answer"])]
    return [example for example in examples if example is not None]


# --- choosing a task ---
def load_task(data: str | None, default: str = "gsm8k", eval_size: int = 64) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples for `--data`; the held-out list has at most `eval_size` examples.

    None -> `default` (the task a tiny model was warmed up on) or GSM8K from the hub; 'arithmetic'; 'chain'; 'gsm8k';
    or a GSM8K-format JSONL path: a `train.jsonl` with a sibling `test.jsonl` is evaluated on that,
    any other file keeps its last `eval_size` lines out of training.
    """
    data = data or default
    if data == "arithmetic":
        return arithmetic_examples("train"), arithmetic_examples("eval")[:eval_size]
    if data == "chain":
        return chain_examples("train"), chain_examples("eval")[:eval_size]
    if data == "gsm8k":
        return fetch_gsm8k("train"), fetch_gsm8k("test")[:eval_size]
    path = Path(data)
    if not path.is_file():
        raise TaskError(f"--data {data!r} is neither 'arithmetic', 'chain', 'gsm8k' nor an existing file. Pass a "
                        "GSM8K-format JSONL path (e.g. ../shared/data/gsm8k/train.jsonl), 'gsm8k' to fetch it "
                        "from the hub, or 'arithmetic' or 'chain' for a built-in offline task.")
    examples = load_gsm8k_jsonl(path)
    sibling = path.with_name("test.jsonl")
    if path.name == "train.jsonl" and sibling.is_file():
        return examples, load_gsm8k_jsonl(sibling)[:eval_size]
    if len(examples) <= eval_size:
        raise TaskError(f"{path} has {len(examples)} examples, too few to hold out {eval_size} for evaluation "
                        "and still train. Use a larger file, a smaller --eval-size, or put a test.jsonl next to "
                        "a train.jsonl.")
    return examples[:-eval_size], examples[-eval_size:]


def prompt_token_ids(tokenizer, question: str) -> list[int]:
    """The prompt's token ids: chat template (instruct models) or the raw text (the tiny model)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        # tokenize=False then encode: the template's return type differs across transformers versions
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(question, add_special_tokens=False)


def check_prompt_lengths(tokenizer, examples: list[Example], context: int | None, max_new_tokens: int) -> None:
    """Refuse, at start-up, prompts that leave no room for `max_new_tokens` in the model's context (its
    max_position_embeddings; None: unknown, nothing to check).

    Only prompts that might be too long are tokenized (GSM8K's 7.5 k take seconds): a token covers at least one
    byte of text (byte-level BPE, SentencePiece with byte fallback), so a prompt has at most the chat template's
    own tokens plus one per UTF-8 byte of its question.
    """
    if context is None:
        return
    limit = context - max_new_tokens
    template = len(prompt_token_ids(tokenizer, ""))
    candidates = [e for e in examples if template + len(e.prompt.encode()) > limit]
    length, longest = max(((len(prompt_token_ids(tokenizer, e.prompt)), e) for e in candidates),
                          key=lambda pair: pair[0], default=(0, None))
    if length > limit:
        raise TaskError(f"the longest prompt is {length} tokens ({longest.prompt[:50]!r}...): with --max-new-tokens "
                        f"{max_new_tokens} that exceeds the model's context of {context} tokens "
                        f"(max_position_embeddings). Remove the prompts longer than {max(limit, 0)} tokens from the "
                        "data" + (f", or lower --max-new-tokens to {context - length} or less." if length < context
                                  else "."))
