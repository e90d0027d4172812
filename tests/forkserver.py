"""A fork server for the tests' subprocesses: a trainer started by a test pays ~0.1 s to start, not the ~5 s a new
Python spends importing torch and transformers (most of what a tiny run costs).

How it works. `start()` runs `python forkserver.py serve SOCKET` once per test session: it imports the heavy
third-party modules (WARM, never the project's own) and waits on a Unix socket. It also writes a `python`
launcher (`launcher()`): a stdlib-only client that the tests use where they would use sys.executable (their
subprocesses, sweep.sh's PYTHON, torchrun's ranks through sys.executable). The client sends its argv, environment,
working folder and standard streams (the file descriptors themselves) to the server, which forks a child that
becomes `python ARGV` in that folder, that environment and on those streams. The client waits for it, passes on
the signals it gets (SIGTERM, SIGINT, ...) and ends as the child ended: the same exit code, or killed by the same
signal. A client killed outright (SIGKILL) takes its child with it: the server kills a child whose client is gone.

What the child shares with the server, and how it is made a fresh process's equal: the modules in WARM (the
server checks that importing them printed nothing and left torch's generator alone; a fresh process's import
prints nothing either), the hash seed (arbitrary either way), Python's, NumPy's and torch's generators (reseeded
from the OS after the fork, as a new process seeds them), torch's thread count (set from OMP_NUM_THREADS when
the environment gives it). Anything the imports read from the environment (HF_*, TORCH*, PYTHON*, ...,
IMPORT_ENV) must match the server's; otherwise, and for any interpreter option but -u, -m and -c, the client
runs the real interpreter instead (`exec`), so that a test never gets a different behaviour, only a slower one.
PYTHONPATH entries the server lacks are put on sys.path, and their sitecustomize.py is run, as site does.

What stays a real new process, on purpose: a test whose point is the process itself (the warnings a user sees on
stderr from a fresh start, a lock naming the pid the test started, a fresh process compared with an in-process
run) passes `fresh=True` to helpers.command and friends. The child's pid is not the client's.

Set RLVR_FORKSERVER_LOG=FILE to log each request (fork or fallback, and why).
"""

from __future__ import annotations

import gc
import json
import os
import re
import select
import signal
import socket
import struct
import sys
import time

# The heavy third-party modules a trainer, report.py, preflight.py or the benchmark imports; the server imports
# them once. Never a project module: each child imports those itself, so their module state is fresh and a test's
# import hook (tests/signal_at) still sees them load. Nor a module a child runs with -m (torch.distributed.run:
# its launcher API instead): runpy would warn that it was imported before it ran.
WARM = [
    "numpy", "torch", "torch.nn.functional", "torch.distributed", "torch.distributed.launcher.api", "torch.distributed.tensor",
    "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.utils.tensorboard", "safetensors.torch", "tyro", "tqdm.auto", "transformers", "tokenizers",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
    "transformers.generation.utils", "transformers.tokenization_utils_fast", "matplotlib", "matplotlib.pyplot", "gguf",
]  # fmt: skip

# Environment variables the imports above read (or may read) once, at import: a request whose values differ from
# the server's runs the real interpreter. OMP_NUM_THREADS is applied in the child (torch.set_num_threads);
# PYTHONPATH and PYTHONUNBUFFERED too.
IMPORT_ENV = re.compile(
    r"^(HF_|HUGGINGFACE|TRANSFORMERS|TOKENIZERS_|TORCH_LOGS|TORCHDYNAMO|TORCHINDUCTOR|TORCH_COMPILE|PYTORCH_|MKL_|KMP_"
    r"|OPENBLAS|GOTO|CUDA_|MPL|XDG_|HOME$|TMPDIR$|LANG$|LC_|PYTHON(?!PATH$|UNBUFFERED$)[A-Z])"
)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _log(what: str) -> None:
    path = os.environ.get("RLVR_FORKSERVER_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} {os.getpid()} {what}\n")


# ======================================================================================================
# The client: stdlib only, started as `python -IS forkserver.py client REAL_PYTHON ARGS...` by the launcher
# ======================================================================================================


def _send(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data))], list(fds))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def client(real_python: str, path: str, argv: list[str]) -> None:
    """Be `real_python ARGV`: through the server listening at path when it can, else by exec.

    The child takes the client's place in its process group (a signal to the group, from `timeout` or a
    terminal, reaches the child as it would reach a new interpreter), and the client moves to a group of its own
    so that it does not pass that signal on a second time; a signal sent to the client's pid is passed on. A
    client that leads its group (started in a session of its own, as torchrun starts its ranks) keeps it, alone:
    the child starts a session of its own, and a signal to the client's group reaches it through the client."""
    child, early = [], []

    def forward(signum, frame):
        if not child:
            early.append(signum)  # before the child exists: passed on once it does
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:  # it ended already: its status is on its way
            pass

    for s in FORWARDED:
        signal.signal(s, forward)
    group = os.getpgrp()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    replies = sock.makefile("rb")  # one reader for both lines: a second one could miss what the first read ahead
    try:
        leader = group == os.getpid()
        if not leader:
            os.setpgid(0, 0)
        sock.connect(path)
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "session": os.getsid(0)}
        request["group"] = None if leader else group
        _send(sock, request, [0, 1, 2])
        reply = json.loads(replies.readline() or b"{}")
    except (OSError, ValueError) as e:
        reply = {"fallback": f"no server ({e})"}
    if "pid" not in reply:
        sock.close()
        try:
            if os.getpgrp() != group:
                os.setpgid(0, group)  # back where it was started
        except OSError:
            pass
        for s in FORWARDED:
            signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
        for s in early:
            os.kill(os.getpid(), s)
        os.execv(real_python, [real_python, *argv])

    child.append(reply["pid"])
    for s in early:
        forward(s, None)
    line = replies.readline()  # retried after a forwarded signal (PEP 475)
    if not line:
        sys.stderr.write("forkserver: the server went away before its child ended\n")
        os._exit(1)
    status = json.loads(line)["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def write_launcher(path: str, real_python: str, server: str) -> str:
    """An executable `python` at path: the client of the server at `server`, run by the real interpreter in
    isolated mode (no site, no PYTHON* variables: it starts in ~20 ms)."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(path, "w") as f:
        f.write(
            f"#!{real_python} -IS\n"
            f"import sys\nsys.path.insert(0, {here!r})\nimport forkserver\n"
            f"forkserver.client({real_python!r}, {server!r}, sys.argv[1:])\n"
        )
    os.chmod(path, 0o755)
    return path


# ======================================================================================================
# The server
# ======================================================================================================


def _parse(argv: list[str]) -> tuple[str, str, list[str], bool] | None:
    """(mode, target, args, unbuffered) for `python [-u] (script | -m module | -c code) args`, else None."""
    unbuffered = False
    i = 0
    while i < len(argv) and argv[i] == "-u":
        unbuffered, i = True, i + 1
    if i >= len(argv):
        return None
    if argv[i] in ("-m", "-c"):
        if i + 1 >= len(argv):
            return None
        return argv[i], argv[i + 1], argv[i + 2 :], unbuffered
    if argv[i].startswith("-"):
        return None
    return "script", argv[i], argv[i + 1 :], unbuffered


def _why_not(request: dict, server_env: dict, imported: dict, free: set[str]) -> str | None:
    if _parse(request["argv"]) is None:
        return f"interpreter options {request['argv'][:2]}"
    if request.get("group") is not None and request.get("session") != os.getsid(0):
        return "another session (the child could not join the client's process group)"
    env = request["env"]
    for key in sorted(set(env) | set(server_env)):
        allowed = (server_env.get(key), imported.get(key, server_env.get(key)))
        if IMPORT_ENV.match(key) and key not in free and env.get(key) not in allowed:
            return f"{key} differs"
    if "OMP_NUM_THREADS" in server_env and "OMP_NUM_THREADS" not in env:
        return "OMP_NUM_THREADS unset"
    return None


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when the server ends (Linux's PR_SET_PDEATHSIG): a server that dies,
    however, leaves no child running without it. Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the server ended before the request took effect
        os._exit(1)


def real_executable() -> str:
    """The interpreter itself, also in a child (whose sys.executable is the launcher): for a fresh process."""
    return getattr(sys, "_forkserver_real_executable", sys.executable)


def _become(request: dict, fds: list[int], server_path: list[str], launcher: str, server_pid: int):
    """In the forked child: take the client's streams, folder, environment, argv and generators; returns the
    function that runs the target (called at the top level, so that an exception ends the process as it would
    end `python script`)."""
    import io
    import random
    import runpy
    import types

    _die_with(server_pid)
    try:
        if request["group"] is None:
            os.setsid()  # the client leads its group, alone: a signal to it comes through the client
        else:
            os.setpgid(0, request["group"])  # the client's place (it left the group for one of its own)
    except OSError as e:
        os.write(fds[2], f"forkserver: cannot join process group {request['group']}: {e}\n".encode())
        os._exit(1)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    mode, target, args, unbuffered = _parse(request["argv"])
    env = request["env"]
    unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        if name == "stdin":
            stream = io.TextIOWrapper(open(fd, "rb", closefd=False), encoding=old.encoding, errors=old.errors)
        else:
            raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
            line = name == "stderr" or os.isatty(fd)
            stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, line_buffering=line,
                                      write_through=unbuffered)  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    sys._forkserver_real_executable = real_executable()
    sys.executable = launcher  # what the child starts with sys.executable (torchrun's ranks) comes here too
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    extra = [p for p in extra if p not in server_path]
    sys.path[:] = [*extra, *server_path]

    import numpy as np
    import torch

    random.seed()
    np.random.seed()
    torch.seed()  # a new process's generator is seeded from the OS
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if any(os.path.isfile(os.path.join(p, "sitecustomize.py")) for p in extra):
        sys.modules.pop("sitecustomize", None)
        import sitecustomize  # noqa: F401  (as site imports it at start-up)

    if mode == "script":
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
        return lambda: runpy.run_path(target, run_name="__main__")
    if mode == "-m":
        sys.argv = ["-m", *args]  # runpy puts the module's path in argv[0]
        sys.path.insert(0, os.getcwd())
        return lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)
    sys.argv = ["-c", *args]
    sys.path.insert(0, "")
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    return lambda: exec(compile(target, "<string>", "exec"), main.__dict__)


def serve(path: str, launcher: str):
    """Import WARM, then fork a child per request until stdin closes. Returns only in a child: the target."""
    import importlib

    # A Ctrl-C at the terminal reaches the whole process group: the server ends when the session closes its stdin
    # (the session's own Ctrl-C handling kills what it started), not before, leaving its children unserved.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    server_env, server_path = dict(os.environ), list(sys.path[1:])  # [0]: this file's folder, not the child's
    for name in WARM:
        importlib.import_module(name)
    gc.freeze()  # the imports' objects out of every collection: a child's collections (and its exit's) skip them
    # what the imports set in the environment (transformers' modeling code sets TORCHINDUCTOR_CACHE_DIR to
    # inductor's default folder): a request may carry either value (a child of a child of the server carries it)
    keys = set(os.environ) | set(server_env)
    imported = {k: os.environ.get(k) for k in keys if os.environ.get(k) != server_env.get(k)}
    import torch

    free = set() if torch.version.cuda else {"CUDA_VISIBLE_DEVICES"}  # a CPU build of torch never reads it
    server_pid = os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    live: dict[socket.socket, int] = {}  # client connection -> child pid
    done: dict[int, int] = {}  # child pid -> wait status, for a child reaped before its pid was recorded

    while True:
        ready, _, _ = select.select([listener, sys.stdin, *live], [], [], 0.05)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1024):  # the test session ended
            for pid in live.values():
                _kill(pid)
            listener.close()
            os.unlink(path)
            os._exit(0)
        while True:  # reap first: tell each client how its child ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            done[pid] = status
        for conn, pid in list(live.items()):
            if pid in done:
                try:
                    conn.sendall((json.dumps({"status": done.pop(pid)}) + "\n").encode())
                except OSError:
                    pass
                conn.close()
                del live[conn]
        for conn in [c for c in ready if c in live]:  # a live child's client connection readable: it went away
            try:
                gone = not conn.recv(1)
            except OSError:  # reset: it left before reading what it was sent
                gone = True
            if gone:
                _kill(live.pop(conn))  # not reaped yet, so the pid is still this child's
                conn.close()
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            head, fds, _, _ = socket.recv_fds(conn, 4, 3)
            request = json.loads(_recv_exact(conn, struct.unpack("!I", _recv_exact_prefix(conn, head))[0]))
        except (OSError, ValueError, EOFError, struct.error):
            conn.close()
            continue
        why = _why_not(request, server_env, imported, free) if len(fds) == 3 else "no streams"
        if why:
            _log(f"fallback {request.get('argv', [])[:2]}: {why}")
            for fd in fds:
                os.close(fd)
            _reply(conn, {"fallback": why})
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            for c in [conn, *live]:
                c.close()
            return _become(request, fds, server_path, launcher, server_pid)
        _log(f"fork {pid} {request['argv'][:2]}")
        for fd in fds:
            os.close(fd)
        if not _reply(conn, {"pid": pid}):
            _kill(pid)
        live[conn] = pid  # reaped, and its connection closed, in a later pass


def _reply(conn: socket.socket, message: dict) -> bool:
    """One line of JSON to the client; False when it is gone already."""
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        return False
    return True


def _recv_exact_prefix(conn: socket.socket, head: bytes) -> bytes:
    """The 4-byte length: what recv_fds returned, completed from the stream if it came short."""
    return head + (_recv_exact(conn, 4 - len(head)) if len(head) < 4 else b"")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ======================================================================================================
# The tests' side: start the server once, hand out the launcher
# ======================================================================================================


class Server:
    """The running server of this test session (start()), or why there is none."""

    def __init__(self, folder: str, env: dict[str, str]) -> None:
        import subprocess

        self.socket = os.path.join(folder, "sock")
        self.launcher = write_launcher(os.path.join(folder, "python"), sys.executable, self.socket)
        self.log = os.path.join(folder, "server.log")
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "serve", self.socket, self.launcher],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=folder,
            )  # fmt: skip
        self.error: str | None = None
        self.ready: bool | None = None

    def wait_ready(self, timeout: float = 120) -> bool:
        """Whether the server is up: its imports done, and silent (a new interpreter's would be too)."""
        if self.ready is None:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else b""
            with open(self.log) as f:
                noise = f.read()
            self.ready = line.strip() == b"ready" and not noise
            if not self.ready:
                self.error = f"the fork server did not start cleanly: {line!r} {noise[-2000:]!r}"
                self.close()
        return self.ready

    def close(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server kills what is left and exits
            try:
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
        shutil.rmtree(os.path.dirname(self.socket), ignore_errors=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        target = serve(argv[1], argv[2])
        target()  # in a child: an uncaught exception or SystemExit ends it as it ends `python script`
        return
    raise SystemExit("usage: forkserver.py serve SOCKET LAUNCHER")


if __name__ == "__main__":
    main(sys.argv[1:])
