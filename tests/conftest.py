"""Shared fixtures: the GSM8K folder, the tiny model's tokenizer (SmolLM2's, from the packaged GGUF), a finished
one-step run, and the smoke sweep (run once per session).

Markers (pyproject.toml): `packaged` (the packaged SmolLM2 model), `slow` (the tests the fast lane,
`python -m pytest -q -m "not slow"`, leaves out: torchrun, the smoke sweep, learning tests, long subprocesses)."""

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
    import models

    return models.load_tokenizer(models.TINY_MODEL)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished one-step PPO run with a checkpoint (helpers.SMALL_RUN); tests copy it before changing anything."""
    from helpers import SMALL_RUN, check_ok, cli, run_here

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    check_ok(run_here("ppo.py", cli(run_dir, **SMALL_RUN)))
    return run_dir


@pytest.fixture(scope="session")
def smoke_sweep(tmp_path_factory):
    """`./sweep.sh --smoke` once per session (about two minutes on 2 cores): (its OUT folder, the finished
    process, seconds). Tests read it, and copy what they change; a test that uses it is slow by nature."""
    import time

    from helpers import check_ok, run_sweep

    out = tmp_path_factory.mktemp("sweep") / "smoke"
    t0 = time.time()
    proc = run_sweep("--smoke", "--out", out)
    seconds = time.time() - t0
    check_ok(proc)
    return out, proc, seconds


def pytest_collection_modifyitems(config, items):
    """A test that reads the smoke sweep is slow (the sweep is minutes), whichever file it is in."""
    for item in items:
        if "smoke_sweep" in getattr(item, "fixturenames", ()):  # directly or through another fixture
            item.add_marker(pytest.mark.slow)


@pytest.fixture()
def one_thread():
    """torch on one CPU thread for the test, as a torchrun worker runs. With more, SDPA's CPU kernel splits a
    decode query's slots by the width it reads, so a row's last bits follow the width (one hidden value 1e-4
    apart at 2 threads between row groups and none, 2026-12-02); with one, they are bitwise equal."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
