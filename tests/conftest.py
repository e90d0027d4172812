"""Shared fixtures: the GSM8K folder and the tiny model's tokenizer (SmolLM2's, from the packaged GGUF)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # import common, engine, runtime, critics from the repository root
os.environ.setdefault("GSM8K_DIR", str(ROOT / ".." / "shared" / "data" / "gsm8k"))


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    path = Path(os.environ["GSM8K_DIR"])
    if not (path / "train.jsonl").is_file():
        pytest.skip(f"no GSM8K folder at {path} (set GSM8K_DIR)")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    import runtime

    return runtime.load_tokenizer(runtime.TINY_MODEL)
