"""The in-process runner (helpers.run_here) the end-to-end tests use: a trainer's main() called in the test's
process gives what a fresh process gives, and leaves nothing behind for the next test (threads, RNG, environment,
folder, signal handlers, notices, the run lock). And conftest's lists hold: the fast lane's slow list names tests
that exist, the smoke sweep's readers are where they run in one worker."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
import torch
from helpers import check_ok, cli, read_metrics, run_here, run_trainer

from plumbing import runtime

RUN = dict(task="toy", critic="small", total_steps=2, lr=1e-3)
TIMES = ("time/", "tokens_per_s", "seconds")  # the clock, the only thing two identical runs may differ in


def untimed(run_dir) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(t in k for t in TIMES)} for row in read_metrics(run_dir)]


@pytest.fixture()
def two_threads():
    """torch on two threads during the test (a count the runs below must leave as it is), as before after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_two_runs_in_process_equal_a_fresh_process_and_leave_no_state(tmp_path, monkeypatch, two_threads):
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the fresh process's threads, as threads=1 below
    check_ok(run_trainer("ppo.py", cli(fresh, **RUN)))  # a new interpreter
    random.seed(7)
    torch.manual_seed(7)
    before = (torch.get_num_threads(), random.getstate(), torch.random.get_rng_state(), dict(os.environ),
              os.getcwd(), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))  # fmt: skip
    for name in ("a", "b"):  # twice: the second run must not see anything the first left
        check_ok(run_here("ppo.py", cli(tmp_path / name, **RUN), threads=1))
        after = (torch.get_num_threads(), random.getstate(), torch.random.get_rng_state(), dict(os.environ),
                 os.getcwd(), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))  # fmt: skip
        assert after[0] == before[0] and after[1] == before[1] and torch.equal(after[2], before[2])
        assert after[3:] == before[3:]
        assert vars(runtime.RUN) == vars(runtime.RunState()), "the run left state behind (notices, lock, record)"
        assert untimed(tmp_path / name) == untimed(fresh), f"run {name} in this process differs from a fresh one"


def test_every_test_the_fast_lane_leaves_out_exists():
    """conftest.SLOW_TOO names tests by file::function[parameters prefix]: a renamed test must not leave a stale
    entry behind (the fast lane would then quietly keep a slow test, or a new one would take its name)."""
    from conftest import SLOW_TOO

    here = Path(__file__).parent
    for prefix in SLOW_TOO:
        file, test = prefix.split("::")
        function, _, params = test.partition("[")
        text = (here / file).read_text()
        assert f"def {function}(" in text, prefix
        assert not params or "parametrize" in text, prefix


def test_every_reader_of_the_smoke_sweep_is_in_test_sweep_py(request):
    """The smoke sweep runs once per session because its readers run in one xdist worker: tests/test_sweep.py is
    one unit of work (conftest.ONE_WORKER). A reader in another file would run it again in another worker."""
    from conftest import ONE_WORKER

    readers = [item.nodeid for item in request.session.items if "smoke_sweep" in getattr(item, "fixturenames", ())]
    assert "tests/test_sweep.py" in ONE_WORKER
    assert all(nodeid.startswith("tests/test_sweep.py::") for nodeid in readers), readers


def test_a_runs_memory_check_is_not_the_next_runs(tmp_path):
    """A run refused for its --model (its memory check made, with that model) and then, in the same process, a run
    that makes no memory check of its own (study/pretrain_critic.py): the second must not recheck the first's model.
    It did, and failed with 'unknown model' (test_pretrain's module fixture in a whole-suite run, 2026-12-07)."""
    from plumbing import models

    refused = run_here("grpo.py", cli(tmp_path / "run", model="no-such-model"))
    assert refused.returncode == 2 and "unknown model 'no-such-model'" in refused.stderr
    runtime.begin_run()  # what run_main does first
    assert models._MEMORY_CHECKED is None
    models.recheck_generation_memory(512)  # nothing to recheck: no error
