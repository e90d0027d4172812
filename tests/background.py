"""The session's second pytest process: the long tests marked `background` (and every test that reads the smoke
sweep) run there, started as the session starts, while this process runs the others; each then reports here, at
the end of the session, with what the second process saw (its failure text, its skip reason, its xfail).

Why: pytest runs one test at a time, and a test on the tiny model keeps about one core busy, so on a 2-core
machine the other core sat idle for most of the session. Nothing of a test changes: it runs whole, with its own
fixtures, in a pytest process of the same configuration (the options that change an outcome, -W, --runxfail,
-o, -c, --tb, -p, are passed on) on the same fork server (tests/forkserver.py). Only when the selection has tests
of both kinds; RLVR_TEST_BACKGROUND=0 runs every test in this process. The second process's own output (with its
durations) is in the log named at the end; it is removed when every test there passed and no durations were
asked for. tests/test_background.py holds it to all this.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

REPORTS = "RLVR_BACKGROUND_REPORTS"  # set for the second process: the file it writes its reports to
# taken out of the environment, so that a pytest the second process starts (run_gpu.sh's part b) is not taken
# for it
_REPORTS_PATH = os.environ.pop(REPORTS, None)
# the longest the second process may take, as a whole; then it is stopped and what it still owed fails
WAIT_S = float(os.environ.get("RLVR_BACKGROUND_WAIT_S", 1800))
# markers whose outcome the second process decides (the stand-in takes its report, not its own evaluation)
OUTCOME_MARKERS = {"skip", "skipif", "xfail"}


def in_background() -> bool:
    """Whether this process is the second one."""
    return _REPORTS_PATH is not None


def passed_on(config) -> list[str]:
    """This session's options that change a test's outcome or its failure text, for the second process."""
    opt, out = config.option, []
    for value in getattr(opt, "pythonwarnings", None) or []:
        out += ["-W", value]
    if getattr(opt, "runxfail", False):
        out.append("--runxfail")
    for value in getattr(opt, "override_ini", None) or []:
        out += ["-o", value]
    if getattr(opt, "inifilename", None):
        out += ["-c", str(opt.inifilename)]
    if getattr(opt, "tbstyle", "auto") != "auto":
        out.append(f"--tb={opt.tbstyle}")
    for value in getattr(opt, "plugins", None) or []:
        out += ["-p", value]
    if opt.durations is not None:
        out.append(f"--durations={opt.durations}")
    return out


class Background:
    """The second process: started with the node ids of its tests; `reports(nodeid)` waits for one's reports."""

    def __init__(self, config, nodeids: list[str]) -> None:
        from helpers import python

        self.folder = tempfile.mkdtemp(prefix="rlvr-background-")
        self.reports_path = os.path.join(self.folder, "reports.jsonl")
        self.log_path = os.path.join(self.folder, "pytest.log")
        open(self.reports_path, "w").close()
        cmd = [python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", *passed_on(config), *nodeids]
        # PYTEST_ADDOPTS has been read here already: its options arrive as passed_on's and as the node ids (an
        # --lf there would look for a cache the second process does not keep)
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        env.update({REPORTS: self.reports_path, "RLVR_TEST_PYTHON": python()})
        self.count, self.seen, self.offset = len(nodeids), {}, 0
        self.deadline, self.lost = time.time() + WAIT_S, None
        self.keep_log = config.option.durations is not None  # its durations are in its log
        self.note = ""
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=config.rootpath,  # node ids are relative to it
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _read(self) -> None:
        with open(self.reports_path) as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]  # a line still being written waits for the next read
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            report = json.loads(line)
            self.seen.setdefault(report["nodeid"], []).append(report)

    def _done(self, nodeid: str) -> list[dict] | None:
        reports = self.seen.get(nodeid, [])
        return reports if any(r["when"] == "teardown" for r in reports) else None

    def reports(self, nodeid: str) -> list[dict]:
        while True:
            if self.lost:
                raise BackgroundLost(f"{self.lost}: no result for {nodeid}")
            self._read()
            if done := self._done(nodeid):
                return done
            if self.proc.poll() is not None:
                self._read()
                if done := self._done(nodeid):
                    return done
                self.lost = f"the background pytest ended (exit {self.proc.returncode})"
            elif time.time() > self.deadline:
                self.lost = f"no result from the background pytest after {WAIT_S:g} s (RLVR_BACKGROUND_WAIT_S)"
                self.stop()
            else:
                time.sleep(0.1)

    def answered(self) -> int:
        self._read()
        return sum(1 for nodeid in self.seen if self._done(nodeid))

    def stop(self) -> None:
        """Ctrl-C first, as a person would, so that its fixtures end what they started (a sweep, a trainer);
        then SIGTERM, then SIGKILL."""
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                return
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass

    def finish(self, session) -> None:
        """At the session's end: wait for a second process that owes nothing (its summary), stop one that still
        does (-x, Ctrl-C here); an exit code other than 0 with every test answered fails the session."""
        if self.proc.poll() is None and self.answered() == self.count:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        answered, code = self.answered(), self.proc.returncode  # answered() reads what it wrote before it ended
        failed = any(r["outcome"] == "failed" for reports in self.seen.values() for r in reports)
        if answered == self.count and code != 0 and not failed:
            self.note = f"the background pytest exited {code} although none of its tests failed"
            if session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        self.keep_log = self.keep_log or failed or bool(self.note or self.lost) or session.exitstatus != 0

    def summary(self) -> str:
        line = f"{self.answered()} of {self.count} tests ran in the background pytest"
        if self.note:
            line = f"{self.note}; {line}"
        if not self.keep_log:
            return f"{line} (its output removed: nothing failed there)"
        return f"{line}; its output: {self.log_path}"

    def cleanup(self) -> None:
        if not self.keep_log:
            shutil.rmtree(self.folder, ignore_errors=True)


class BackgroundLost(Exception):
    pass


class BackgroundItem(pytest.Item):
    """A test that ran in the second process: its reports there are its reports here (pytest_runtest_makereport
    below puts them in place of the stand-in's own)."""

    def __init__(self, *, background: Background, **kwargs) -> None:
        super().__init__(**kwargs)
        self.background = background
        self.child_reports: list[dict] | None = None

    def runtest(self) -> None:
        self.child_reports = self.background.reports(self.nodeid)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, BackgroundLost):
            return f"{excinfo.value}\n(the background pytest's output: {self.background.log_path})"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, self.name

    def apply(self, report) -> None:
        """The second process's outcome onto this stand-in's call report: a failure in any phase (its text), an
        xfail or XPASS, a skip (its reason and place), else a pass."""
        if hasattr(report, "wasxfail"):  # this process's reading of an xfail marker: the second one decides
            del report.wasxfail
        reports = self.child_reports
        failed = [r for r in reports if r["outcome"] == "failed"]
        call = next((r for r in reports if r["when"] == "call"), None)
        if failed:
            report.outcome = "failed"
            report.longrepr = f"in the background pytest ({failed[0]['when']}):\n{failed[0]['text']}"
        elif call is not None and call.get("wasxfail") is not None:
            report.outcome = call["outcome"]  # skipped: xfailed; passed: XPASS (not strict)
            report.wasxfail = call["wasxfail"]
            report.longrepr = None
        elif skipped := [r for r in reports if r["outcome"] == "skipped"]:
            path, lineno = skipped[0].get("location") or (str(self.path), None)
            report.outcome = "skipped"
            report.longrepr = (path, lineno, f"{skipped[0]['text']} (in the background pytest)")
        else:
            report.outcome, report.longrepr = "passed", None


def split(config, items: list) -> None:
    """Move the selected `background` tests into the second process (started here), and their stand-ins to the
    end of this session. Called on the final selection (after -m, -k, --deselect, --lf)."""
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
        new.own_markers = [m for m in item.own_markers if m.name not in OUTCOME_MARKERS]
        new.keywords.update(item.keywords)
        stand_ins.append(new)
    items[:] = [item for item in items if not item.get_closest_marker("background")] + stand_ins


def write_report(report) -> None:
    """In the second process: each phase's outcome, one JSON line, as it ends."""
    text, location = "", None
    if report.failed:
        text = str(report.longrepr)
    elif report.skipped and isinstance(report.longrepr, tuple):
        location, text = list(report.longrepr[:2]), report.longrepr[2]
    line = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "text": text,
        "location": location,
        "wasxfail": getattr(report, "wasxfail", None),
    }
    with open(_REPORTS_PATH, "a") as f:
        f.write(json.dumps(line) + "\n")


KEY = pytest.StashKey[Background]()


class Plugin:
    """Registered by conftest.pytest_configure."""

    def pytest_collection_finish(self, session) -> None:
        # after every collection hook (--lf filters in a wrapper of pytest_collection_modifyitems)
        split(session.config, session.items)

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after the skipping plugin's reading of markers
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if isinstance(item, BackgroundItem) and call.when == "call" and item.child_reports is not None:
            item.apply(report)
        return report

    def pytest_runtest_logreport(self, report) -> None:
        if in_background():
            write_report(report)

    def pytest_sessionfinish(self, session) -> None:
        if KEY in session.config.stash:
            session.config.stash[KEY].finish(session)

    def pytest_terminal_summary(self, terminalreporter, config) -> None:
        if KEY in config.stash:
            terminalreporter.write_line(config.stash[KEY].summary())

    def pytest_unconfigure(self, config) -> None:
        if KEY in config.stash:
            config.stash[KEY].stop()
            config.stash[KEY].cleanup()
