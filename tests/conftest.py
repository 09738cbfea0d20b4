"""Shared fixtures: the repository on sys.path, where GSM8K lies, a small random Qwen2 model saved like a real one,
and folders made once for the whole session, however many pytest-xdist workers run it."""
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# GSM8K (train.jsonl, test.jsonl) is read from a path, never copied into the repository; tests that need it skip
# when it is absent. Default: the checkout's sibling shared/data/gsm8k; PERIODIC_RL_GSM8K overrides.
GSM8K_DIR = Path(os.environ.get("PERIODIC_RL_GSM8K", ROOT.parent / "shared" / "data" / "gsm8k"))


def once_per_session(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `make(folder)` once for the whole test run: under `pytest -n 2` the first
    worker to ask makes it while holding a lock, the others wait and take it (the pattern pytest-xdist documents
    for session data). Meant for what several tests compare against (a model, a single-process reference run):
    each is computed once, not once per module and per worker. The folder is read-only by convention."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder, made = root / name, root / f"{name}.made"
    with FileLock(f"{folder}.lock"):
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            made.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny Qwen2 model + tokenizer in a directory, loaded through from_pretrained like any model."""
    from infra.tiny import build_tiny_model
    return once_per_session(tmp_path_factory, "tiny-model", lambda path: build_tiny_model(path, seed=0))


# Qwen's chat template, chat tokens and shipped generation_config: the same as tools/qwen_shaped_random.py's
# Qwen2.5-0.5B-shaped directory for GPU runs
from tools.qwen_shaped_random import QWEN_CHAT_TEMPLATE, QWEN_SAMPLING, qwen_chat_tokenizer, qwen_generation_config  # noqa: E402,F401 (tests import them)

LOGIT_SCALE = 8.0


def save_qwen_shaped(source: Path, out: Path) -> Path:
    """The tiny model re-shaped like Qwen2.5-Instruct: <|im_start|>/<|im_end|> added, the tokenizer's EOS is
    <|im_end|>, its pad <|endoftext|>; generation_config lists both as EOS ([<|im_end|>, <|endoftext|>]) with
    the sampling defaults Qwen ships."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = qwen_chat_tokenizer(AutoTokenizer.from_pretrained(source))
    model = AutoModelForCausalLM.from_pretrained(source)
    torch.manual_seed(0)  # the two new embedding rows
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # peaked next-token distributions, as a trained LLM has (random init is nearly flat)
        model.model.norm.weight.mul_(LOGIT_SCALE)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id = im_end, endoftext, endoftext
    model.generation_config = qwen_generation_config(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def qwen_shaped_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A model directory shaped like Qwen2.5-Instruct: chat template, two EOS ids, Qwen's shipped sampling."""
    return save_qwen_shaped(tiny_model_dir, tmp_path_factory.mktemp("qwen-shaped"))


@pytest.fixture(scope="session")
def qwen_shaped_bare_dir(qwen_shaped_dir, tmp_path_factory) -> Path:
    """The same weights and tokenizer (copied) with a generation_config that ships no sampling defaults."""
    import json
    import shutil
    out = tmp_path_factory.mktemp("qwen-bare") / "model"
    shutil.copytree(qwen_shaped_dir, out)
    config = json.loads((out / "generation_config.json").read_text())
    for key in QWEN_SAMPLING:
        config.pop(key)
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def learn_iteration(learner, groups) -> None:
    """Drive a Learner through one iteration as periodic_rl.train does: take groups in arrival order, accumulate
    each ready micro-batch, step whenever a mini-batch is done."""
    for group in groups:
        learner.take(group)
        for micro_batch in learner.ready():
            learner.accumulate(micro_batch)
            if learner.minibatch_done():
                learner.step()


@pytest.fixture(autouse=True)
def no_module_from_a_test_folder(tmp_path_factory):
    """After each test, forget the modules it imported from pytest's temporary folders (reward files: infra/reward.py
    registers a file's module under its name, as import does), so that a later test's file of the same name, in
    the same process, is imported afresh instead of found in sys.modules (a test then failed or passed by order)."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(base):
            del sys.modules[name]
