"""tests/background.py: a test run in the second pytest process reports there what it did here (passed, failed
with its text, skipped with its reason), a second process that dies fails the tests it owed, and the session's
exit status is that of all of them. Each case is a small pytest session of its own, in a temporary folder, with
the plugin registered as conftest.py registers it; its subprocesses are plain interpreters (no torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import background

def pytest_configure(config):
    config.addinivalue_line("markers", "background: run in the second pytest process")
    config.pluginmanager.register(background.Plugin(), "rlvr-background")
    if not background.in_background():
        import os
        with open(os.path.join(os.environ["PIDS"], "session"), "w") as f:
            f.write(str(os.getpid()))
"""

# Each test writes the pid of the process it ran in, so that the case can tell where it ran.
CASES = """
import os
import signal
import pytest

def mark(name):
    with open(os.path.join(os.environ["PIDS"], name), "w") as f:
        f.write(str(os.getpid()))

@pytest.mark.background
def test_bg_passes():
    mark("bg_passes")

@pytest.mark.background
def test_bg_fails():
    mark("bg_fails")
    assert 1 == 2, "deliberately wrong"

@pytest.mark.background
def test_bg_skips():
    pytest.skip("no reason to run")

@pytest.mark.background
@pytest.mark.parametrize("label", ["a b", "c:1"])
def test_bg_parametrized(label):
    mark("bg_param_" + label.replace(" ", "_").replace(":", "_"))

def test_fg_passes():
    mark("fg_passes")
"""


def session(tmp_path: Path, body: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    folder = tmp_path / "session"
    pids = tmp_path / "pids"
    folder.mkdir()
    pids.mkdir()
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_cases.py").write_text(body)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RLVR_TEST", "RLVR_BACKGROUND", "PYTEST_"))}
    full_env.update({"PIDS": str(pids), "RLVR_TEST_PYTHON": sys.executable, **env})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, pids


def pid(pids: Path, name: str) -> int:
    return int((pids / name).read_text())


def test_outcomes_of_the_second_process_are_this_sessions(tmp_path):
    proc, pids = session(tmp_path, CASES)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "1 failed, 4 passed, 1 skipped" in out, out
    assert "deliberately wrong" in out and "in the background pytest (call)" in out
    assert "no reason to run (in the background pytest)" in out
    assert "5 of 5 tests ran in the background pytest" in out
    # the background tests ran in one other process, the others here
    here = pid(pids, "fg_passes")
    there = {pid(pids, n) for n in ("bg_passes", "bg_fails", "bg_param_a_b", "bg_param_c_1")}
    assert here == pid(pids, "session")
    assert len(there) == 1 and here not in there


def test_a_selection_of_one_kind_runs_in_this_process(tmp_path):
    proc, pids = session(tmp_path, CASES, "-k", "bg_passes or bg_fails")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout
    assert pid(pids, "bg_passes") == pid(pids, "bg_fails") == pid(pids, "session")
    assert "in the background pytest" not in proc.stdout


def test_rlvr_test_background_0_runs_everything_here(tmp_path):
    proc, pids = session(tmp_path, CASES, RLVR_TEST_BACKGROUND="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 4 passed, 1 skipped" in proc.stdout
    assert pid(pids, "bg_passes") == pid(pids, "fg_passes") == pid(pids, "bg_param_a_b") == pid(pids, "session")


def test_a_second_process_that_dies_fails_what_it_owed(tmp_path):
    body = CASES.replace(
        'def test_bg_skips():\n    pytest.skip("no reason to run")',
        "def test_bg_skips():\n    os.kill(os.getpid(), signal.SIGKILL)",
    )
    assert body != CASES
    proc, _ = session(tmp_path, body)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "the background pytest ended (exit -9) without" in out and "test_bg_skips" in out
    # the tests after it in the second process are failed too, not passed
    assert "FAILED test_cases.py::test_bg_parametrized[a b]" in out, out
    assert "passed" in out and "fg_passes" not in out.split("short test summary")[-1]


def test_stop_at_the_first_failure_ends_the_second_process(tmp_path):
    proc, pids = session(tmp_path, CASES, "-x")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stopping after 1 failures" in proc.stdout
    with pytest.raises(ProcessLookupError):  # the second process is gone with the session
        os.kill(pid(pids, "bg_passes"), 0)
