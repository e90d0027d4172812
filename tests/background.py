"""The session's second pytest process: the long tests marked `background` (and every test that reads the smoke
sweep) run there, started as the session starts, while this process runs the others; each then reports here, at
the end of the session, with what the second process saw (its failure text, its skip reason).

Why: pytest runs one test at a time, and a test on the tiny model keeps about one core busy, so on a 2-core
machine the other core sat idle for most of the session. Nothing of a test changes: it runs whole, with its own
fixtures, in a pytest process of the same configuration (a child of the fork server, tests/forkserver.py, on
the same fork server). Only when the selection has tests of both kinds; RLVR_TEST_BACKGROUND=0 runs every test
in this process. The second process's own output (with its durations) is in the log named at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time

import pytest

REPORTS = "RLVR_BACKGROUND_REPORTS"  # set for the second process: the file it writes its reports to
# taken out of the environment, so that a pytest the second process starts (run_gpu.sh's part b) is not taken
# for it
_REPORTS_PATH = os.environ.pop(REPORTS, None)
WAIT_S = 1800  # the longest a test waits for the second process before it fails


def in_background() -> bool:
    """Whether this process is the second one."""
    return _REPORTS_PATH is not None


class Background:
    """The second process: started with the node ids of its tests; `reports(nodeid)` waits for one's reports."""

    def __init__(self, config, nodeids: list[str]) -> None:
        from helpers import python

        folder = tempfile.mkdtemp(prefix="rlvr-background-")
        self.reports_path, self.log_path = os.path.join(folder, "reports.jsonl"), os.path.join(folder, "pytest.log")
        open(self.reports_path, "w").close()
        cmd = [python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids]
        if config.option.durations is not None:
            cmd.append(f"--durations={config.option.durations}")
        env = {**os.environ, REPORTS: self.reports_path, "RLVR_TEST_PYTHON": python()}
        self.started, self.count, self.seen = time.time(), len(nodeids), {}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=config.rootpath,  # node ids are relative to it
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.offset = 0

    def _read(self) -> None:
        with open(self.reports_path) as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]  # a line still being written waits for the next read
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            report = json.loads(line)
            self.seen.setdefault(report["nodeid"], []).append(report)

    def reports(self, nodeid: str) -> list[dict]:
        deadline = time.time() + WAIT_S
        while True:
            self._read()
            done = self.seen.get(nodeid, [])
            if any(r["when"] == "teardown" for r in done):
                return done
            if self.proc.poll() is not None:
                self._read()
                if any(r["when"] == "teardown" for r in self.seen.get(nodeid, [])):
                    return self.seen[nodeid]
                raise BackgroundLost(f"the background pytest ended (exit {self.proc.returncode}) without {nodeid}")
            if time.time() > deadline:
                raise BackgroundLost(f"no result for {nodeid} from the background pytest after {WAIT_S} s")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def summary(self) -> str:
        ran = sum(1 for reports in self.seen.values() if any(r["when"] == "teardown" for r in reports))
        return f"{ran} of {self.count} tests ran in the background pytest; its output: {self.log_path}"


class BackgroundLost(Exception):
    pass


class BackgroundFailure(Exception):
    pass


class BackgroundItem(pytest.Item):
    """A test that ran in the second process: its outcome there is its outcome here."""

    def __init__(self, *, background: Background, **kwargs) -> None:
        super().__init__(**kwargs)
        self.background = background

    def runtest(self) -> None:
        reports = self.background.reports(self.nodeid)
        for r in reports:
            if r["outcome"] == "failed":
                raise BackgroundFailure(f"in the background pytest ({r['when']}):\n{r['text']}")
        for r in reports:
            if r["outcome"] == "skipped":
                pytest.skip(f"{r['text']} (in the background pytest)")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, BackgroundFailure | BackgroundLost):
            return f"{excinfo.value}\n(the background pytest's output: {self.background.log_path})"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, self.name


def split(config, items: list) -> None:
    """Move the selected `background` tests into the second process (started here), and their stand-ins to the
    end of this session. Called last among the collection hooks, on the final selection."""
    if in_background() or os.environ.get("RLVR_TEST_BACKGROUND") == "0":
        return
    chosen = [item for item in items if item.get_closest_marker("background")]
    if not chosen or len(chosen) == len(items):
        return
    background = Background(config, [item.nodeid for item in chosen])
    config.stash[KEY] = background
    stand_ins = []
    for item in chosen:
        new = BackgroundItem.from_parent(item.parent, name=item.name, background=background)
        new.own_markers = list(item.own_markers)
        new.keywords.update(item.keywords)
        stand_ins.append(new)
    items[:] = [item for item in items if not item.get_closest_marker("background")] + stand_ins


def write_report(report) -> None:
    """In the second process: each phase's outcome, one JSON line, as it ends."""
    text = ""
    if report.failed:
        text = str(report.longrepr)
    elif report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "text": text}
    with open(_REPORTS_PATH, "a") as f:
        f.write(json.dumps(line) + "\n")


KEY = pytest.StashKey[Background]()


class Plugin:
    """Registered by conftest.pytest_configure."""

    @pytest.hookimpl(trylast=True)  # after -m, -k and --deselect have made the selection
    def pytest_collection_modifyitems(self, config, items) -> None:
        split(config, items)

    def pytest_runtest_logreport(self, report) -> None:
        if in_background():
            write_report(report)

    def pytest_terminal_summary(self, terminalreporter, config) -> None:
        if KEY in config.stash:
            terminalreporter.write_line(config.stash[KEY].summary())

    def pytest_unconfigure(self, config) -> None:
        if KEY in config.stash:
            config.stash[KEY].close()
