"""Shared fixtures: the repository on sys.path, where GSM8K lies, a small random Qwen2 model saved like a real one."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# GSM8K (train.jsonl, test.jsonl) is read from a path, never copied into the repository; tests that need it skip
# when it is absent. Default: the checkout's sibling shared/data/gsm8k; PERIODIC_RL_GSM8K overrides.
GSM8K_DIR = Path(os.environ.get("PERIODIC_RL_GSM8K", ROOT.parent / "shared" / "data" / "gsm8k"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny Qwen2 model + tokenizer in a directory, loaded through from_pretrained like any model."""
    from models import build_tiny_model
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path, seed=0)
    return path
