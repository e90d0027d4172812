"""The tests' fork server (tests/forkserver.py): its child behaves as a new interpreter in everything the tests
read (exit code, streams, folder, environment, argv, signals, process group, generators), or the launcher runs a
new interpreter instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, python, trainer_env

pytestmark = pytest.mark.skipif(os.environ.get("RLVR_TEST_FORKSERVER") == "0", reason="RLVR_TEST_FORKSERVER=0")

# What a process reports of itself, as JSON on stdout; it reads one line of stdin and exits with code 3.
PROBE = """
import json, os, sys
line = sys.stdin.readline()
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("RLVR_PROBE"), "name": __name__,
                  "path0": sys.path[0], "stdin": line, "forked": os.getppid() != int(os.environ["RLVR_CALLER"])}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


@pytest.fixture(scope="module")
def launcher() -> str:
    path = python()
    assert path != sys.executable, "the fork server did not start: every subprocess of the tests is slow"
    return path


def env(**extra: str) -> dict[str, str]:
    return {**trainer_env(), "RLVR_CALLER": str(os.getpid()), "RLVR_PROBE": "seen", **extra}


def both(launcher: str, tmp_path, args: list[str], **kw) -> list[subprocess.CompletedProcess]:
    """args run by a new interpreter and by the fork server's launcher, in tmp_path."""
    return [
        subprocess.run([exe, *args], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=60, **kw)
        for exe in (sys.executable, launcher)
    ]


@pytest.mark.parametrize("form", ["script", "-c", "-m", "-u script"])
def test_the_child_sees_what_a_new_interpreter_sees(launcher, tmp_path, form):
    (tmp_path / "probe.py").write_text(PROBE)
    args = {"script": ["probe.py", "a", "b"], "-c": ["-c", PROBE, "a", "b"], "-m": ["-m", "probe", "a", "b"],
            "-u script": ["-u", "probe.py", "a", "b"]}[form]  # fmt: skip
    fresh, child = both(launcher, tmp_path, args, input="hello\n")
    assert fresh.returncode == child.returncode == 3
    assert fresh.stderr == child.stderr == "to stderr\n"
    seen = [json.loads(p.stdout) for p in (fresh, child)]
    assert seen[0].pop("forked") is False and seen[1].pop("forked") is True
    assert seen[0] == seen[1]
    assert seen[1]["cwd"] == str(tmp_path) and seen[1]["x"] == "seen" and seen[1]["stdin"] == "hello\n"


@pytest.mark.parametrize(
    "code, status",
    [
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),  # killed by a signal
        ("raise KeyboardInterrupt", -signal.SIGINT),  # Python ends an uncaught Ctrl-C with SIGINT
        ("raise ValueError('boom')", 1),
        ("import sys; sys.exit('a message')", 1),
    ],
)
def test_the_launcher_ends_as_its_child_ended(launcher, tmp_path, code, status):
    fresh, child = both(launcher, tmp_path, ["-c", code])
    assert fresh.returncode == child.returncode == status
    assert fresh.stderr.splitlines()[-1:] == child.stderr.splitlines()[-1:]


HANDLER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append(1))
print(os.getpid(), os.getpgrp(), flush=True)
deadline = time.time() + 20
while time.time() < deadline and not got:
    time.sleep(0.01)
time.sleep(0.5)  # a second delivery would come within this
print(len(got), flush=True)
"""


def test_a_signal_to_the_launchers_pid_reaches_the_child_once(launcher, tmp_path):
    proc = subprocess.Popen([launcher, "-c", HANDLER], env=env(), stdout=subprocess.PIPE, text=True)
    pid, group = map(int, proc.stdout.readline().split())
    assert pid != proc.pid and group == os.getpgrp()  # the child took the launcher's place in this group
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert out.strip() == "1" and proc.returncode == 0


# A process group of its own, led by a Python that survives the signal, holding the command given: what a
# terminal or a scheduler signals as one.
GROUP = "import signal, subprocess, sys; signal.signal(signal.SIGTERM, lambda *a: None); sys.exit(subprocess.call(sys.argv[1:]))"


@pytest.mark.parametrize("exe", ["fresh", "launcher"])
def test_a_signal_to_the_process_group_reaches_the_child_once(launcher, exe):
    """The child took the launcher's place in its group, and the launcher left it: no second, passed-on copy."""
    cmd = [sys.executable, "-c", GROUP, sys.executable if exe == "fresh" else launcher, "-c", HANDLER]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    pid, group = map(int, proc.stdout.readline().split())
    assert group == proc.pid and (pid != proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert out.strip() == "1" and proc.returncode == 0


def test_timeout_stops_the_launcher_and_its_child(launcher):
    """`timeout` signals its command and its process group (a new interpreter gets both, often as one)."""
    proc = subprocess.run(
        ["timeout", "-s", "TERM", "2", launcher, "-c", HANDLER], env=env(), capture_output=True, text=True, timeout=60
    )
    assert int(proc.stdout.split()[-1]) >= 1 and proc.returncode == 124  # timeout's code for a command it stopped


def test_a_killed_launcher_takes_its_child_with_it(launcher):
    proc = subprocess.Popen(
        [launcher, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
        env=env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{child}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}"), "the child outlived its launcher"


def test_each_child_seeds_its_generators_as_a_new_process_does(launcher):
    code = "import random, numpy, torch; print(torch.initial_seed(), numpy.random.rand(), random.random())"
    seen = [subprocess.run([launcher, "-c", code], env=env(), capture_output=True, text=True).stdout for _ in "ab"]
    a, b = (line.split() for line in seen)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b)), seen


def test_threads_follow_omp_num_threads(launcher):
    code = "import torch; print(torch.get_num_threads())"
    one = subprocess.run([launcher, "-c", code], env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert one.stdout.strip() == "1"


def test_an_environment_the_imports_read_differently_gets_a_new_interpreter(launcher, tmp_path):
    """HF_HUB_OFFLINE is read when huggingface_hub is imported: the server's import saw another value."""
    code = "import os, huggingface_hub.constants as c; print(os.getppid() == int(os.environ['RLVR_CALLER']), c.HF_HUB_OFFLINE)"
    proc = subprocess.run([launcher, "-c", code], env=env(HF_HUB_OFFLINE="0"), capture_output=True, text=True)
    assert proc.stdout.split() == ["True", "False"], proc.stderr  # a new interpreter, which read the new value
    proc = subprocess.run([launcher, "-E", "-c", "print(1)"], env=env(), capture_output=True, text=True)
    assert proc.stdout == "1\n" and proc.returncode == 0  # an option the server does not take: a new interpreter


def test_a_pythonpath_sitecustomize_runs_in_the_child(launcher, tmp_path):
    """As site does at start-up (tests/signal_at relies on it)."""
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.RLVR_SITE = 'ran'\n")
    code = "import os, builtins; print(os.getppid() != int(os.environ['RLVR_CALLER']), builtins.RLVR_SITE)"
    proc = subprocess.run(
        [launcher, "-c", code], env=env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True, cwd=REPO
    )
    assert proc.stdout.split() == ["True", "ran"], proc.stderr


@pytest.mark.slow
@pytest.mark.background  # its own server: ~6 s of imports
def test_the_server_outlives_ctrl_c_and_vanishing_clients_and_its_children_die_with_it(tmp_path):
    """A Ctrl-C at the terminal reaches the server too (it is in the session's process group), and a client can
    leave before it reads the server's reply: neither ends the server. A server that does end, however, takes its
    children with it: nothing it started keeps running unserved."""
    import socket
    import tempfile

    import forkserver

    server = forkserver.Server(tempfile.mkdtemp(prefix="rlvr-forkserver-"), trainer_env())
    try:
        assert server.wait_ready(), server.error
        server.proc.send_signal(signal.SIGINT)
        for _ in range(3):  # clients that send a request (a fallback, then a fork) and leave without reading
            for argv in (["-E", "-c", "pass"], ["-c", "import time; time.sleep(30)"]):
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(server.socket)
                request = {"argv": argv, "env": trainer_env(), "cwd": str(tmp_path), "session": os.getsid(0)}
                forkserver._send(sock, {**request, "group": None}, [0, 1, 2])
                sock.close()
        time.sleep(1)
        assert server.proc.poll() is None, open(server.log).read()
        proc = subprocess.Popen(
            [server.launcher, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
            env=env(), stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        child = int(proc.stdout.readline())
        assert os.path.exists(f"/proc/{child}")
        server.proc.kill()
        deadline = time.time() + 10
        while time.time() < deadline and os.path.exists(f"/proc/{child}") and "Z" not in _state(child):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child}") or "Z" in _state(child), "a child outlived its server"
        assert proc.wait(timeout=30) != 0  # its launcher says so
    finally:
        server.close()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_fresh_is_a_new_interpreter_also_in_a_child(launcher):
    """In a child of the server (the background pytest is one) sys.executable is the launcher: fresh=True must still
    be the interpreter itself."""
    code = "import sys; sys.path.insert(0, 'tests'); import helpers; print(helpers.python(fresh=True))"
    proc = subprocess.run([launcher, "-c", code], env=env(), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.stdout.strip() == sys.executable, proc.stderr
