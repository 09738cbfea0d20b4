"""Tasks: the prompts the policy is trained on, and the built-in reward that scores its answers.

A task is a list of `Example(prompt, answer, columns)`: the question as plain text (before any chat
template) or a conversation (TRL's format: a list of {"role", "content"} messages), the gold final answer
(a canonical number string for the math reward; None when the data has none), and the row's other columns.
The reward is a plain function

    reward(prompt, completion, answer) -> float        # 1.0 correct, 0.0 wrong for `math_reward`

so a user can swap in their own with `--reward my_rewards.py:score` (infra/reward.py loads it, infra/scoring.py
calls it).
Two tasks are built in, and anything `datasets` loads can be used (infra/data.py):

- `arithmetic` (offline): `"37+45="` -> `"82"` with operands in [0, 50). A fixed CRC32 of the operand
  pair puts ~10% of the pairs in a held-out `eval` split, so held-out accuracy measures addition, not
  memorisation. It is what the offline `tiny` model is warmed up on (infra/tiny.py).
- `chain` (offline): `"3+8+1+5="` -> `"17"`, k single-digit terms, worked step by step
  (`"3+8=11 11+1=12 12+5=17"`, what `tiny-chain` is warmed up on). k follows a power law,
  P(k) ∝ k^-1.5 on 2..13, so responses run from 5 to ~100 tokens with a long tail, as an LLM's
  reasoning does: most groups finish in a few decode steps, one in ten runs ten times longer. The
  workload where streaming groups by completion pays (bench.py peer --task chain).
- GSM8K (Cobbe et al., 2021): the paper's benchmark (arXiv 2511.18871, Sec. 5), `--data gsm8k` for the hub's
  openai/gsm8k (config main) or a local copy (`--data path/to/gsm8k/train.jsonl`). The gold answer is the number
  after `####`.

A plain-text prompt is fed raw to a model without a chat template (the tiny models), or as the user's message in
the model's chat template; a conversation goes through the chat template as it is, a last message of the
assistant's continued as TRL does (`prompt_text`). No system prompt is added unless asked for: `--system-prompt` (a
text, or 'math' for SYSTEM_PROMPT, GSM8K's format) makes each prompt a conversation that starts with it
(`with_system_prompt`), as a TRL user would map the dataset.

Deliberate departures:
1. Answers are compared as numbers (`18.00` == `18`, `1,080` == `1080`), not as strings, and the
   completion's answer is the first found of (`extract_final_number`): the last `\\boxed{N}`; the last `#### N`
   (a number right after the marker: "#### Step 2: ..." is a heading, not an answer); the last "the answer is N" /
   "answer: N"; the last number. Format is not rewarded separately: one binary correctness reward, as in the paper.
2. Before a model or dataset is fetched, the hub is asked once *without retries* (`hub_error`): offline,
   huggingface_hub would otherwise retry with back-off for ~25 s before failing.
"""
from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation

from infra.errors import UserError

ARITHMETIC_OPERANDS = range(50)  # two-digit sums: learnable by a 2-layer model in well under a minute
ARITHMETIC_EVAL_BUCKETS = 10  # 1 in 10 operand pairs is held out
GSM8K_HUB = ("openai/gsm8k", "main")  # what --data gsm8k means: the hub id and its config
SYSTEM_PROMPT = ("You are a careful math tutor. Reason step by step, then give the final answer as a "
                 "number on the last line, in the form '#### <number>'.")
SYSTEM_PROMPTS = {"math": SYSTEM_PROMPT}  # --system-prompt's named presets


@dataclass(frozen=True)
class Example:
    prompt: str | list[dict]  # the question before any chat template, or a conversation (TRL's chat format)
    answer: str | None  # the gold final answer, a canonical number string ("82", "-3", "2.5") for the math reward;
    # None: the data has none (a reward that needs one is refused at start-up: data.load_task)
    columns: dict = field(default_factory=dict, compare=False)  # the dataset row's other columns (TRL-style
    # rewards receive them as keyword lists)
    source: str = field(default="", compare=False)  # where the row is, for an error line: "gsm8k (train split), row 7"


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


_MARKED = re.compile(r"####[ \t*]*([^\n]*)")  # GSM8K's answer marker and the rest of its line
_HEADING_NUMBER = re.compile(r"\d+[.):][ \t]*[^\s\d]")  # "2. Add them", "1) First", "3: Total": a step's number
_ANSWER_IS = re.compile(r"\banswer(?:\s+is\b|\s*:)[:\s]*", re.IGNORECASE)  # "the answer is", "Final Answer:"
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")  # \text{ dollars} -> " dollars"
_LATEX_SPACING = re.compile(r"\\[$%,;:! ]|\\q?quad\b|\\(?:left|right)\b")  # \$ \% \, \; \! \quad \left


def boxed_contents(text: str) -> list[str]:
    """The contents of every \\boxed{...} in `text`, nested braces included, in order.

    >>> boxed_contents("\\\\boxed{72} then \\\\boxed{\\\\frac{1}{2}}")
    ['72', '\\\\frac{1}{2}']
    """
    contents, start = [], text.find("\\boxed{")
    while start != -1:
        depth, position = 1, start + len("\\boxed{")
        while position < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            position += 1
        if depth:  # unclosed: the completion was cut off inside it
            break
        contents.append(text[start + len("\\boxed{"):position - 1])
        start = text.find("\\boxed{", position)
    return contents


def boxed_number(content: str) -> str | None:
    """The number a \\boxed{} holds: its last number once \\text{}, \\$ and LaTeX spacing are dropped
    ('\\$1{,}080' -> '1080', '18 \\text{ eggs}' -> '18', 'x = 5' -> '5'); None when it holds other LaTeX
    (\\frac{1}{2}, \\sqrt{8}: not a plain number, whose digits would read as another one)."""
    content = _LATEX_SPACING.sub("", _LATEX_TEXT.sub(r"\1", content)).replace("{,}", ",").replace("$", "")
    if "\\" in content or "^" in content or "/" in content:
        return None
    numbers = _NUMBER.findall(content)
    return canonical_number(numbers[-1]) if numbers else None


def marked_answer(text: str) -> str | None:
    """The answer after the last GSM8K '####' marker that gives one: the rest of its line, when that starts with a
    number, a sign or LaTeX ('#### 72', '#### $1,080.', '#### \\frac{1}{2}'). Not an answer: an empty marker
    ('#### ' at the end) and a Markdown heading ('#### Step 2: ...', '#### 2. Add them').

    >>> marked_answer("#### 72\\n#### Check"), marked_answer("#### Step 2: total"), marked_answer("#### ")
    ('72', None, None)
    """
    for line in reversed(_MARKED.findall(text)):
        line = line.strip().strip("*").strip()
        if line[:1] and (line[0].isdigit() or line[0] in "-$\\") and not _HEADING_NUMBER.match(line):
            return line
    return None


def extract_final_number(text: str) -> str | None:
    """The completion's final answer as a canonical number string, or None: the first found of

    1. the last \\boxed{...} (TRL's and open-r1's accuracy_reward read a boxed answer first; math-verify's
       boxed_match_priority=0): its number, or None when it holds other LaTeX;
    2. the number after the last '####' that is followed by one (verl's gsm8k reward, 'strict': the last
       '#### N'; `marked_answer`);
    3. the number after the last "the answer is" / "answer:" (with a number after it on its line);
    4. the last number in the text (verl's 'flexible', lm-evaluation-harness's gsm8k 'flexible-extract').

    >>> extract_final_number("So 3 + 4 = 7 eggs.\\n#### 7")
    '7'
    >>> extract_final_number("The answer is $1,250.00.")
    '1250'
    >>> extract_final_number("#### Step 2: Total\\n24 + 48 = 72, so $\\\\boxed{72}$")
    '72'
    """
    boxed = boxed_contents(text)
    if boxed:
        return boxed_number(boxed[-1])
    marked = marked_answer(text)
    if marked is not None and _first_number(marked) is not None:
        return _first_number(marked)
    for stated in reversed(list(_ANSWER_IS.finditer(text))):  # the rest of its line
        number = _first_number(text[stated.end():].split("\n", 1)[0])
        if number is not None:
            return number
    numbers = _NUMBER.findall(text)
    return canonical_number(numbers[-1]) if numbers else None


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final number (`extract_final_number`) equals the gold answer numerically, else 0.0."""
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


# --- the Hugging Face hub ---
def one_line(error: BaseException) -> str:
    """'ArrowInvalid: JSON parse error: ...': the error's type and first line (datasets' own wrapper is skipped)."""
    if type(error).__name__ == "DatasetGenerationError" and error.__cause__ is not None:
        error = error.__cause__  # "An error occurred while generating the dataset" says less than its cause
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def hub_error(repo_id: str, filename: str, repo_type: str) -> Exception | None:
    """Ask the hub once, without retries, for one file: None if it answered with the file, else the error (one with
    a `.response` when the hub answered, e.g. 404; none when it could not be reached or offline mode is on).

    `hf_hub_download`, `from_pretrained`, `load_dataset` and, before huggingface_hub 1.0, `get_hf_file_metadata`
    retry network errors with back-off (~25 s offline); one HEAD request on the hub's own session fails in well
    under a second on a machine with no network (a black-holed network waits for HF_HUB_ETAG_TIMEOUT, 10 s by
    default), and honours HF_ENDPOINT, proxies and tokens.
    """
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
    if constants.HF_HUB_OFFLINE:  # checked here too: before 1.0 the session keeps the mode it was created in
        return OfflineModeIsEnabled("offline mode is on (HF_HUB_OFFLINE)")
    try:
        response = get_session().head(hf_hub_url(repo_id, filename, repo_type=repo_type), headers=build_hf_headers(),
                                      timeout=constants.HF_HUB_ETAG_TIMEOUT)
        hf_raise_for_status(response)  # 401/404 -> an error with its response
    except Exception as error:  # network, proxy, 401/404
        return error
    return None


def hub_unreachable_reason(repo_id: str, filename: str, repo_type: str = "model") -> str | None:
    """None if the hub has the file now, else why it cannot be downloaded (no network, offline mode, 401/404)."""
    error = hub_error(repo_id, filename, repo_type)
    return None if error is None else one_line(error)


# --- prompts ---
def system_prompt_text(system_prompt: str | None) -> str | None:
    """--system-prompt as the text of a system message: a preset's (SYSTEM_PROMPTS: 'math' is GSM8K's
    SYSTEM_PROMPT), else the text as given; None (or blank text) for none."""
    if system_prompt is None or not system_prompt.strip():
        return None
    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def with_system_prompt(example: Example, system: str | None, where: str = "the data") -> Example:
    """The example with `system` as the system message its prompt starts with (None: the example as it is): a text
    prompt becomes [system, user] (TRL's conversational format, as a TRL user would map the dataset), a
    conversation gets it in front. A conversation that has its own system message is refused: which one would hold
    is a guess."""
    if system is None:
        return example
    if isinstance(example.prompt, str):
        messages = [{"role": "user", "content": example.prompt}]
    elif example.prompt[0]["role"] == "system":
        raise TaskError(f"--system-prompt: a prompt of {where} has its own system message "
                        f"({str(example.prompt[0]['content'])[:50]!r}): drop --system-prompt, or the data's system "
                        "messages.")
    else:
        messages = list(example.prompt)
    return replace(example, prompt=[{"role": "system", "content": system}, *messages])


TEMPLATE_OWN = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
                "return_tensors", "padding", "truncation", "max_length", "chat_template", "tokenizer_kwargs")


def template_kwargs(text: str | None) -> dict:
    """--chat-template-kwargs as a mapping ({} when not given); TaskError with one line when it is not a JSON
    object, or names an argument of apply_chat_template itself (those decide what it returns, not what the
    template renders)."""
    if text is None:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise TaskError(f"--chat-template-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}' "
                        f"(got {text!r})")
    own = [key for key in kwargs if key in TEMPLATE_OWN]
    if own:
        raise TaskError(f"--chat-template-kwargs: {', '.join(own)} {'is' if len(own) == 1 else 'are'} "
                        "apply_chat_template's own, not the template's: leave them out")
    return kwargs


def check_template_variables(tokenizer, template: dict) -> None:
    """Refuse chat-template variables (--chat-template-kwargs) that the model's chat template never reads (a
    misspelt enable_thinking would change nothing, silently), or a model without a chat template."""
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        raise TaskError("--chat-template-kwargs is given, but the model's tokenizer has no chat template to pass "
                        "them to: leave it out, or use a chat model")
    import jinja2
    from jinja2 import meta
    sources = source.values() if isinstance(source, dict) else [source]  # named templates: any of them
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # as transformers renders them
    try:
        read = set().union(*(meta.find_undeclared_variables(environment.parse(text)) for text in sources))
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): not checked, rendered as is
        return
    unread = [key for key in template if key not in read]
    if unread:
        raise TaskError(f"--chat-template-kwargs: the model's chat template reads no {', '.join(unread)} (it reads "
                        f"{', '.join(sorted(read - {'messages', 'add_generation_prompt'}))}): check the spelling")


def raw_text_prompts(text_prompts: str, prompt_column: str | None) -> bool:
    """Whether text prompts are used as they are (--text-prompts): raw, or auto for TRL's 'prompt' column (TRL's
    standard format, which TRL never renders with the chat template); chat, or auto for another column (GSM8K's
    'question'), renders them as the user's message.

    >>> raw_text_prompts("auto", "prompt"), raw_text_prompts("auto", "question"), raw_text_prompts("raw", "question")
    (True, False, True)
    """
    return text_prompts == "raw" or text_prompts == "auto" and prompt_column == "prompt"


def prompt_text(tokenizer, prompt: str | list[dict], template: dict | None = None, raw: bool = False) -> str:
    """The text whose tokens are the prompt's (`prompt_token_ids`): a text prompt as it is (`raw`, or a model without
    a chat template), or rendered by the chat template (a text prompt as the user's message, with no system message
    but the template's own) given the variables `template` (--chat-template-kwargs). A conversation ends with the
    assistant's generation prompt, or, when its last message is the assistant's (a prefilled "The answer is",
    "<think>"), with that message left open for the model to continue, as TRL's maybe_apply_chat_template renders it
    (continue_final_message, no generation prompt)."""
    if isinstance(prompt, str):
        if raw or not getattr(tokenizer, "chat_template", None):
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    elif not getattr(tokenizer, "chat_template", None):
        raise TaskError("the prompts are conversations (lists of chat messages, or text given a --system-prompt), but "
                        "the model's tokenizer has no chat template to turn them into text: use a chat model, or "
                        "plain-text prompts (--prompt-column) without --system-prompt.")
    continued = prompt[-1]["role"] == "assistant"
    try:  # tokenize=False then encode: the template's return type differs across transformers versions
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=not continued,
                                             continue_final_message=continued, **(template or {}))
    except ValueError as error:  # transformers: the template does not render the final message's text as it is
        if not continued:
            raise
        raise TaskError(f"the model's chat template cannot continue the assistant's message "
                        f"{str(prompt[-1]['content'])[:50]!r} that a prompt ends with ({one_line(error)}): end the "
                        "prompts with the user's message, or use a template that renders the assistant's text as it "
                        "is.") from None


def prompt_token_ids(tokenizer, prompt: str | list[dict], template: dict | None = None, raw: bool = False
                     ) -> list[int]:
    """The prompt's token ids. Text: in the chat template as the user's message (instruct models), or as it is
    (`raw`: TRL's standard format; the tiny model). A conversation (TRL's format): the chat template as-is, ending
    with the assistant's generation prompt, or in the assistant's own last message (`prompt_text`). `template`: the
    chat template's extra variables (--chat-template-kwargs)."""
    return tokenizer.encode(prompt_text(tokenizer, prompt, template, raw), add_special_tokens=False)


def run_prompt_ids(tokenizer, examples: list[Example], cfg) -> list[list[int]]:
    """The examples' prompt ids as a run (`cfg`, a Config) samples them: --chat-template-kwargs' variables, text as
    it is or in the chat template (--text-prompts). The sampler, its evaluation and the sizing probe all call this."""
    template, raw = template_kwargs(cfg.chat_template_kwargs), raw_text_prompts(cfg.text_prompts, cfg.prompt_column)
    return [prompt_token_ids(tokenizer, example.prompt, template, raw) for example in examples]


def count_tokens(tokenizer, prompt: str | list[dict], limit: int, template: dict | None = None, raw: bool = False
                 ) -> tuple[int, int | None]:
    """(the prompt's tokens, None), or, for a text so long that its start alone has more than `limit` tokens, (the
    tokens of that start, its characters): a 10 MB prompt is refused after encoding kilobytes, not gigabytes of
    tokenizer state for all of it. The start is read in pieces of 4 (limit + 1), 16 (limit + 1), ... characters; a
    text has at least the tokens of its start (but for the few of the word cut in two)."""
    text = prompt_text(tokenizer, prompt, template, raw)
    size = 4 * (max(limit, 0) + 1)
    while size < len(text):
        tokens = len(tokenizer.encode(text[:size], add_special_tokens=False))
        if tokens > limit:
            return tokens, size
        size *= 4
    return len(tokenizer.encode(text, add_special_tokens=False)), None


def _roles(prompt: str | list[dict]) -> tuple[str, ...] | None:
    return None if isinstance(prompt, str) else tuple(message["role"] for message in prompt)


def _text_bytes(prompt: str | list[dict]) -> int:
    if isinstance(prompt, str):
        return len(prompt.encode())
    return sum(len(str(message["content"] or "").encode()) for message in prompt)


def _preview(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else str(prompt[-1]["content"])


def check_prompt_lengths(tokenizer, examples: list[Example], context: int | None, max_new_tokens: int,
                         template: dict | None = None, raw: bool = False) -> None:
    """Refuse, at start-up, prompts that leave no room for `max_new_tokens` in the model's context (its
    max_position_embeddings; None: unknown, nothing to check), conversations a model without a chat template
    cannot read, and chat-template variables (`template`, --chat-template-kwargs) for a model without one.

    Only prompts that might be too long are tokenized (GSM8K's 7.5 k take seconds): a token covers at least one
    byte of text (byte-level BPE, SentencePiece with byte fallback), so a prompt has at most the chat template's
    own tokens (those of the same messages emptied) plus one per UTF-8 byte of its text.
    """
    if template:
        check_template_variables(tokenizer, template)
    wrapper = {}  # roles of the messages (None: plain text) -> the chat template's own tokens
    for example in examples:
        roles = _roles(example.prompt)
        if roles not in wrapper:
            empty = "" if roles is None else [{"role": role, "content": ""} for role in roles]
            wrapper[roles] = len(prompt_token_ids(tokenizer, empty, template, raw))
    if context is None:
        return
    if max_new_tokens >= context:  # no prompt fits: the option is the fault, not the data
        longest = max(count_tokens(tokenizer, example.prompt, context, template, raw)[0] for example in examples)
        lower = (f"lower it to {context - longest} or less (the longest prompt has {longest} tokens)"
                 if longest < context else f"lower it, and drop the prompts of {context} tokens or more from the data")
        raise TaskError(f"--max-new-tokens {max_new_tokens} (--max-completion-length) leaves no room for a prompt in "
                        f"the model's context of {context} tokens (max_position_embeddings): {lower}")
    limit = context - max_new_tokens
    candidates = [e for e in examples if wrapper[_roles(e.prompt)] + _text_bytes(e.prompt) > limit]
    length, longest, start = 0, None, None
    for example in candidates:
        tokens, start = count_tokens(tokenizer, example.prompt, limit, template, raw)
        if tokens > length or start is not None:
            length, longest = tokens, example
        if start is not None:  # too long, how much longer is not counted
            break
    if length > limit:
        preview = f"({_preview(longest.prompt)[:50]!r}..." + (f", {longest.source})" if longest.source else ")")
        found = (f"the longest prompt is {length} tokens {preview}" if start is None else
                 f"a prompt of {_text_bytes(longest.prompt)} bytes {preview} has {length} tokens in its first {start} "
                 "characters alone")
        lower = f", or lower --max-new-tokens to {context - length} or less." if length < context else "."
        raise TaskError(f"{found}: with --max-new-tokens {max_new_tokens} that exceeds the model's context of "
                        f"{context} tokens (max_position_embeddings). Remove the prompts longer than {max(limit, 0)} "
                        f"tokens from the data{lower}")
