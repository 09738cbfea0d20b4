"""Shared fixtures: the repository on sys.path and a small random Qwen2 model saved like a real one."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny Qwen2 model + tokenizer in a directory, loaded through from_pretrained like any model."""
    from models import build_tiny_model
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path, seed=0)
    return path
