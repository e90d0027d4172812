"""tests/background.py: a test run in the second pytest process reports there what it did here (passed, failed
with its text, skipped with its reason), a second process that dies fails the tests it owed, and the session's
exit status is that of all of them. Each case is a small pytest session of its own, in a temporary folder, with
the plugin registered as conftest.py registers it; its subprocesses are plain interpreters (no torch).
The fast lane keeps the first test; the others are slow, and run in the second pytest process of this suite,
beside the long tests (pytest's own process is the longer of the two)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import forkserver
import pytest

TESTS = Path(__file__).resolve().parent
PYTHON = forkserver.real_executable()  # in the second pytest process sys.executable is the fork server's launcher

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


def session(
    tmp_path: Path, body: str, *args: str, conftest_extra: str = "", **env: str
) -> tuple[subprocess.CompletedProcess, Path]:
    folder = tmp_path / "session"
    pids = tmp_path / "pids"
    folder.mkdir(exist_ok=True)
    pids.mkdir(exist_ok=True)
    (folder / "conftest.py").write_text(CONFTEST + conftest_extra)
    (folder / "test_cases.py").write_text(body)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RLVR_TEST", "RLVR_BACKGROUND", "PYTEST_"))}
    full_env.update({"PIDS": str(pids), "RLVR_TEST_PYTHON": PYTHON, "TMPDIR": str(tmp_path), **env})
    proc = subprocess.run(
        [PYTHON, "-m", "pytest", "-q", "-rfsxX", *args],
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
    assert "5 of 5 tests ran in the background pytest; its output:" in out
    assert "exited" not in out  # its exit code 1 is its failed test's
    # the background tests ran in one other process, the others here
    here = pid(pids, "fg_passes")
    there = {pid(pids, n) for n in ("bg_passes", "bg_fails", "bg_param_a_b", "bg_param_c_1")}
    assert here == pid(pids, "session")
    assert len(there) == 1 and here not in there


@pytest.mark.slow
@pytest.mark.background
def test_a_selection_of_one_kind_runs_in_this_process(tmp_path):
    proc, pids = session(tmp_path, CASES, "-k", "bg_passes or bg_fails")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout
    assert pid(pids, "bg_passes") == pid(pids, "bg_fails") == pid(pids, "session")
    assert "in the background pytest" not in proc.stdout


@pytest.mark.slow
@pytest.mark.background
def test_rlvr_test_background_0_runs_everything_here(tmp_path):
    proc, pids = session(tmp_path, CASES, RLVR_TEST_BACKGROUND="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 4 passed, 1 skipped" in proc.stdout
    assert pid(pids, "bg_passes") == pid(pids, "fg_passes") == pid(pids, "bg_param_a_b") == pid(pids, "session")


@pytest.mark.slow
@pytest.mark.background
def test_a_second_process_that_dies_fails_what_it_owed(tmp_path):
    body = CASES.replace(
        'def test_bg_skips():\n    pytest.skip("no reason to run")',
        "def test_bg_skips():\n    os.kill(os.getpid(), signal.SIGKILL)",
    )
    assert body != CASES
    proc, _ = session(tmp_path, body)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "the background pytest ended (exit -9): no result for test_cases.py::test_bg_skips" in out, out
    # the tests after it in the second process are failed too, not passed
    assert "FAILED test_cases.py::test_bg_parametrized[a b]" in out, out
    assert "passed" in out and "fg_passes" not in out.split("short test summary")[-1]


@pytest.mark.slow
@pytest.mark.background
def test_stop_at_the_first_failure_ends_the_second_process(tmp_path):
    proc, pids = session(tmp_path, CASES, "-x")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stopping after 1 failures" in proc.stdout
    with pytest.raises(ProcessLookupError):  # the second process is gone with the session
        os.kill(pid(pids, "bg_passes"), 0)


@pytest.mark.slow
@pytest.mark.background
def test_a_hung_second_process_fails_what_it_owes_within_one_deadline(tmp_path):
    """RLVR_BACKGROUND_WAIT_S is the second process's deadline as a whole, not each test's: a hung test fails
    itself and every test after it at that deadline, and the second process is stopped."""
    body = CASES.replace(
        'def test_bg_skips():\n    pytest.skip("no reason to run")',
        'def test_bg_skips():\n    mark("hung")\n    import time\n    time.sleep(120)',
    )
    assert body != CASES
    started = time.time()
    proc, pids = session(tmp_path, body, RLVR_BACKGROUND_WAIT_S="2")
    took = time.time() - started
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    # bg_skips and the two after it, read in the failures' own section: the short summary's lines are cut to the
    # terminal's width except on CI (pytest reads CI and BUILD_NUMBER), so they can hold a message twice or half
    failures = out.split("short test summary info")[0]
    owed = re.findall(
        r"no result from the background pytest after 2 s .*: no result for (test_cases\.py::[^\n]*)", failures
    )
    assert sorted(owed) == [
        "test_cases.py::test_bg_parametrized[a b]",
        "test_cases.py::test_bg_parametrized[c:1]",
        "test_cases.py::test_bg_skips",
    ], out
    failed = {line.split(" - ")[0].removeprefix("FAILED ") for line in out.splitlines() if line.startswith("FAILED ")}
    assert failed == {"test_cases.py::test_bg_fails", *owed}, out
    assert took < 2 + 12, f"{took:.0f} s: each test waited its own deadline"
    with pytest.raises(ProcessLookupError):  # the second process is gone with the session
        os.kill(pid(pids, "hung"), 0)


XFAIL = """
import pytest

@pytest.mark.background
@pytest.mark.xfail(strict=True, reason="known")
def test_bg_xpass_strict():
    pass

@pytest.mark.background
@pytest.mark.xfail(reason="known")
def test_bg_xfails():
    assert False

@pytest.mark.background
def test_bg_warns():
    import warnings
    warnings.warn("a warning", UserWarning)

def test_fg_passes():
    pass
"""


@pytest.mark.slow
@pytest.mark.background
def test_xfail_and_warning_options_read_as_in_one_process(tmp_path):
    """A strict XPASS there fails here, an xfail reads xfailed, and -W error reaches the second process."""
    proc, _ = session(tmp_path, XFAIL, "-W", "error::UserWarning")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "FAILED test_cases.py::test_bg_xpass_strict" in out and "XPASS(strict)" in out, out
    assert "XFAIL test_cases.py::test_bg_xfails" in out, out
    assert "FAILED test_cases.py::test_bg_warns" in out and "UserWarning: a warning" in out, out
    assert "2 failed, 1 passed, 1 xfailed" in out, out
    one, _ = session(tmp_path, XFAIL, "-W", "error::UserWarning", RLVR_TEST_BACKGROUND="0")
    assert one.stdout.splitlines()[-1].split(" in ")[0] == out.splitlines()[-1].split(" in ")[0]


@pytest.mark.slow
@pytest.mark.background
def test_last_failed_reruns_only_those_and_addopts_do_not_break_the_second_process(tmp_path):
    body = CASES + "\ndef test_fg_fails():\n    assert False\n"
    first, _ = session(tmp_path, body)
    assert first.returncode == 1 and "2 failed" in first.stdout
    again, _ = session(tmp_path, body, PYTEST_ADDOPTS="--lf")
    out = again.stdout
    assert again.returncode == 1, out + again.stderr
    assert "2 failed" in out and "passed" not in out.splitlines()[-1], out
    assert "1 of 1 tests ran in the background pytest" in out, out


@pytest.mark.slow
@pytest.mark.background
def test_a_second_process_that_exits_non_zero_fails_the_session(tmp_path):
    """Its tests all passed, but it ended with an error (here one its conftest makes): the session says so."""
    extra = """
def pytest_sessionfinish(session):
    if background.in_background():
        session.exitstatus = 3
"""
    proc, _ = session(tmp_path, CASES, "-k", "passes", conftest_extra=extra)
    assert "2 passed" in proc.stdout
    assert proc.returncode != 0 and "the background pytest exited 3 although none of its tests failed" in proc.stdout, (
        proc.stdout
    )


STOPPED = """
import os
import re
import subprocess
import time
import pytest

def test_fg_fails_once_the_sleep_runs():
    path = os.path.join(os.environ["PIDS"], "sleep")
    deadline = time.time() + 60
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.05)
    assert False

@pytest.mark.background
def test_bg_runs_a_subprocess():
    proc = subprocess.Popen(["sleep", "120"])
    with open(os.path.join(os.environ["PIDS"], "sleep"), "w") as f:
        f.write(str(proc.pid))
    try:
        proc.wait()
    finally:
        proc.kill()
"""


@pytest.mark.slow
@pytest.mark.background
def test_a_stopped_second_process_ends_what_its_tests_started(tmp_path):
    """Stopped early (-x here), the second process gets a Ctrl-C first, as a person would send, so that its tests
    clean up: a subprocess one of them started does not outlive the session."""
    proc, pids = session(tmp_path, STOPPED, "-x")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    sleep = pid(pids, "sleep")
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{sleep}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{sleep}"), "a subprocess of a background test outlived the session"
