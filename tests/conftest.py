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


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished one-step PPO run with a checkpoint (helpers.SMALL_RUN); tests copy it before changing anything."""
    from helpers import SMALL_RUN, check_ok, cli, run_here

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    check_ok(run_here("ppo.py", cli(run_dir, **SMALL_RUN)))
    return run_dir
