"""Tasks (infra/tasks.py): answers are extracted and rewarded robustly; the built-in tasks; prompts in the chat template.

Loading --data through Hugging Face datasets: tests/cli/test_data.py."""
import pytest

from infra import data, tasks
from infra.tasks import Example, TaskError


# --- answers ---
@pytest.mark.parametrize("completion, expected", [
    ("She has 16 - 3 = 13 eggs.\n#### 13", "13"),
    ("#### $1,080.", "1080"),
    ("so the total is \\boxed{18.00} dollars", "18"),
    ("First 2 then 3, so \\boxed{-4}.", "-4"),
    ("The answer is 42. (It was 7 * 6.)", "42"),
    ("the answer is: $2.50", "2.5"),
    ("She pays 3 dollars, then 12.", "12"),
    ("Temperature drops to -7.", "-7"),
    ("12-5", "5"),  # a minus sign after a digit is subtraction, not a negative number
    ("82", "82"),
    ("18.0", "18"),
    ("It costs 1,234,567 in total", "1234567"),
    ("no digits here", None),
    ("", None),
    # as instruct models write GSM8K answers: a '####' that gives no number is not the answer
    ("#### Step 1: Eggs\n16 - 3 - 4 = 9\n#### Step 2: Total $2 * 9 = 18$, so $\\boxed{18}$", "18"),
    ("#### Step 2: Total 24 + 48 = 72 $\\boxed{72}$", "72"),
    ("The answer is 72.\n#### ", "72"),
    ("#### 1. Add\n24 + 48 = 72\n#### 2. Check\n72 - 48 = 24, and 24 + 48 = 72.", "72"),  # headings' numbers
    ("So she earns 72 dollars.\n#### 72\n#### Verification\n72 / 3 = 24", "72"),  # the last '#### N'
    ("#### **72**", "72"),
    ("Final Answer: $72", "72"),
    ("The answer is:\n\n**18**", "18"),
    ("\\boxed{\\$1{,}080}", "1080"),
    ("\\boxed{18 \\text{ eggs}}", "18"),
    ("\\boxed{\\textbf{-3}} with 5 left", "-3"),
    ("\\boxed{25\\%}", "25"),
    ("\\boxed{x = 5}", "5"),
    ("so \\boxed{\\frac{1}{2}} of 4", None),  # LaTeX other than a number: not read as its digits
    ("3 apples, then \\boxed{4", "4"),  # cut off inside the box: no box, the last number
])
def test_extract_final_number(completion, expected):
    """Claim: \\boxed{N}, '#### N', 'the answer is N' / 'answer: N' and the last number are recognised, with '$',
    thousands commas and a trailing '.' stripped and the number canonicalised (18.00 -> 18, -4 and 2.5 kept); a
    '####' that gives no number (an empty one at the end, a Markdown heading) is not taken for the answer, nor is a
    heading's step number; a box's LaTeX around the number (\\text{}, \\$, {,}, \\%) is dropped."""
    assert tasks.extract_final_number(completion) == expected


def test_format_priority():
    """Claim: the documented order: \\boxed first, then the last '#### N' (which wins over numbers written after
    it), then the last 'the answer is N', then the last number."""
    assert tasks.extract_final_number("\\boxed{5}\n#### 7") == "5"
    assert tasks.extract_final_number("#### 7\nCheck: 3 + 4 = 7, and 10 more") == "7"
    assert tasks.extract_final_number("\\boxed{5} since 2 + 3") == "5"
    assert tasks.extract_final_number("The answer is 6. #### 8 Then 9") == "8"
    assert tasks.extract_final_number("The answer is 6, not 7. Then 9") == "6"
    assert tasks.extract_final_number("The answer is 6. The answer is 7 and 8.\nSo 9") == "7"


@pytest.mark.parametrize("completion, answer, reward", [
    ("#### 18", "18", 1.0),
    ("#### 18.00", "18", 1.0),
    ("$1,080", "1080", 1.0),
    ("#### 17", "18", 0.0),
    ("I don't know", "18", 0.0),
    ("2.5", "2.50", 1.0),
    ("-3", "3", 0.0),
    ("#### Step 2: Total of 24 + 48\n$\\boxed{72}$", "72", 1.0),  # a '####' heading the working, not the answer
    ("The answer is 72.\n#### ", "72", 1.0),  # an empty '####': the answer before it
])
def test_math_reward(completion, answer, reward):
    """Claim: the reward is 1.0 exactly when the final number equals the answer numerically."""
    assert tasks.math_reward("q", completion, answer) == reward


# --- arithmetic ---
def test_arithmetic_splits_are_disjoint_complete_and_deterministic():
    """Claim: train and eval never share a prompt, together cover every operand pair once, answers are the
    sums, and two calls give the same lists in the same order."""
    train, held_out = tasks.arithmetic_examples("train"), tasks.arithmetic_examples("eval")
    assert train == tasks.arithmetic_examples("train") and held_out == tasks.arithmetic_examples("eval")
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    operands = len(tasks.ARITHMETIC_OPERANDS)
    assert len(train) + len(held_out) == len({e.prompt for e in train + held_out}) == operands ** 2
    assert 0.05 < len(held_out) / operands ** 2 < 0.15
    for example in train + held_out:
        a, b = example.prompt.rstrip("=").split("+")
        assert example.answer == str(int(a) + int(b))
    with pytest.raises(TaskError):
        tasks.arithmetic_examples("test")


# --- choosing a task ---
def test_load_task_builtin_arithmetic():
    """Claim: the tiny model's default task is arithmetic, with the held-out split cut to eval_size."""
    train, held_out = data.load_task(None, default="arithmetic", eval_size=10)
    assert train == tasks.arithmetic_examples("train") and held_out == tasks.arithmetic_examples("eval")[:10]
    assert data.load_task("arithmetic", eval_size=10) == (train, held_out)


# --- prompts ---
def test_prompt_token_ids_raw_text_or_chat_template():
    """Claim: a tokenizer without a chat template gets the raw question; with one, the template wraps the question
    as the user's message, with no system message added, and ends with the assistant's
    generation prompt."""
    from infra.tiny import tiny_tokenizer
    tokenizer = tiny_tokenizer()
    assert tasks.prompt_token_ids(tokenizer, "37+45=") == tokenizer.encode("37+45=", add_special_tokens=False)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    text = tokenizer.decode(tasks.prompt_token_ids(tokenizer, "What is 2+2?"))
    assert text == "<user>What is 2+2?\n<assistant>"


def qwen_tokenizer():
    """The tokenizer of conftest's Qwen-shaped model, with its chat template, without building the model."""
    from conftest import QWEN_CHAT_TEMPLATE

    from infra.tiny import tiny_tokenizer
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("prefill", ["The answer is", "<think>\n"])
def test_a_prompt_ending_with_the_assistant_is_continued(prefill):
    """Claim: a conversation whose last message is the assistant's (a prefilled "The answer is", "<think>") is
    rendered as TRL's maybe_apply_chat_template renders it (continue_final_message, no generation prompt): the model
    continues that message; the length check counts those tokens, at
    the context's edge exactly, as the inference side and the size probe feed them (both call prompt_token_ids)."""
    tokenizer = qwen_tokenizer()
    prompt = [{"role": "user", "content": "What is 4+1?"}, {"role": "assistant", "content": prefill}]
    ids = tasks.prompt_token_ids(tokenizer, prompt)
    assert tokenizer.decode(ids) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                     "assistant.<|im_end|>\n<|im_start|>user\nWhat is 4+1?<|im_end|>\n"
                                     f"<|im_start|>assistant\n{prefill}")
    trl = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=False,
                                        continue_final_message=True)  # TRL's maybe_apply_chat_template
    assert ids == tokenizer.encode(trl, add_special_tokens=False)
    assert tasks.count_tokens(tokenizer, prompt, 10_000) == (len(ids), None)
    tasks.check_prompt_lengths(tokenizer, [Example(prompt, "5")], len(ids) + 8, 8)
    with pytest.raises(TaskError, match=f"the longest prompt is {len(ids)} tokens"):
        tasks.check_prompt_lengths(tokenizer, [Example(prompt, "5")], len(ids) + 7, 8)
    user_last = tokenizer.decode(tasks.prompt_token_ids(tokenizer, prompt[:1]))
    assert user_last.endswith("What is 4+1?<|im_end|>\n<|im_start|>assistant\n")  # a generation prompt, as before


def test_a_template_that_drops_the_assistants_text_is_one_line():
    """Claim: a chat template that does not render the final assistant message's text (so it cannot be continued)
    is refused in one line naming the prompt, not with transformers' ValueError and its traceback."""
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{% if m.role != 'assistant' %}{{ m.content }}"
                               "{% endif %}\n{% endfor %}")
    prompt = [{"role": "user", "content": "What is 4+1?"}, {"role": "assistant", "content": "The answer is"}]
    with pytest.raises(TaskError, match=r"^the model's chat template cannot continue the assistant's message 'The "
                                        r"answer is'") as error:
        tasks.prompt_token_ids(tokenizer, prompt)
    assert "\n" not in str(error.value)


def test_every_prompt_is_rendered_in_one_place():
    """Claim: tasks.prompt_text is the only caller of apply_chat_template in the trainer's code (the inference side,
    the sampler, the size probe and the length check all tokenize through prompt_token_ids), so a prompt has one
    rendering everywhere."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    files = [*root.glob("*.py"), *root.glob("infra/*.py"), *root.glob("launch/*.py")]
    callers = [f.relative_to(root).as_posix() for f in files if ".apply_chat_template(" in f.read_text()]
    assert callers == ["infra/tasks.py"]
    assert (root / "infra/tasks.py").read_text().count(".apply_chat_template(") == 1


def test_a_system_prompt_only_where_asked():
    """Claim: --system-prompt is none by default (None or blank), a text as given, or 'math' for the GSM8K preset
    (SYSTEM_PROMPT, which asks for the '#### N' extract_final_number reads); it makes a text prompt a [system, user]
    conversation and goes in front of a conversation, leaving answer and columns as they are; a conversation with
    its own system message is refused in one line."""
    assert tasks.system_prompt_text(None) is None and tasks.system_prompt_text("  ") is None
    assert tasks.system_prompt_text("math") == tasks.SYSTEM_PROMPT and "####" in tasks.SYSTEM_PROMPT
    assert tasks.system_prompt_text("Be brief.") == "Be brief."
    example = Example("What is 2+2?", "4", {"level": 1})
    assert tasks.with_system_prompt(example, None) is example
    given = tasks.with_system_prompt(example, "Be brief.")
    assert given.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert (given.answer, given.columns) == ("4", {"level": 1})
    chat = Example([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "2+2?"}], "4")
    assert tasks.with_system_prompt(chat, "S").prompt == [{"role": "system", "content": "S"}, *chat.prompt]
    with pytest.raises(TaskError, match=r"^--system-prompt: a prompt of d.jsonl has its own system message \('Own'\)"):
        tasks.with_system_prompt(Example([{"role": "system", "content": "Own"}], "1"), "S", "d.jsonl")


def test_example_is_frozen():
    """Claim: examples are immutable values (safe to share between processes and as dict keys)."""
    with pytest.raises(AttributeError):
        Example("1+1=", "2").answer = "3"


def test_chain_task_has_a_long_tail_of_worked_answers():
    """Claim: the chain task's splits are disjoint and reproducible; each prompt's worked target ends in the gold
    answer (math_reward scores it 1, and 0 once one step is wrong); the target lengths run from 5 to ~100
    characters (= tokens for the byte-level tiny model) with a long tail: the median under 20, one in ten
    over 55."""
    train, held_out = data.load_task("chain", eval_size=64)
    assert train == tasks.chain_examples("train") and len(held_out) == 64
    assert not {e.prompt for e in train} & {e.prompt for e in tasks.chain_examples("eval")}
    for example in train[:200]:
        working = tasks.chain_working(example.prompt)
        assert tasks.math_reward(example.prompt, working, example.answer) == 1.0
    assert tasks.math_reward("3+8+1=", "3+8=11 11+1=13", "12") == 0.0
    lengths = sorted(len(tasks.chain_working(e.prompt)) for e in train)
    assert lengths[0] <= 6 and 90 <= lengths[-1] <= 110
    assert lengths[len(lengths) // 2] < 20 and lengths[int(0.9 * len(lengths))] > 55
