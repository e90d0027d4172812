"""The run folder: where a run's files go, and the rules every run and sweep folder keeps. No torch.

Holds: the folder's names (checkpoint/, .lock), finding a checkpoint (or the one a killed save set aside), refusing
symbolic links (a folder received from someone else must not make a run write elsewhere), the folder's lock
(RunLock: a trainer's run folder and a sweep's OUT alike, flock'ed, its holder named to whoever comes second), what a
stopped run's user does next, and the small file helpers every writer uses (results.json read back, JSON written
atomically, files opened without following a link).
Does not hold: what a checkpoint contains or how it is verified (checkpoint.py), the run's life (runtime.py).
Imports nothing of the project but errors.py, and no torch: study/sweep_runner.py uses it before any trainer loads.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any

from plumbing.errors import UserError

CHECKPOINT = "checkpoint"  # run_dir/checkpoint: the last good checkpoint (checkpoint.py writes and reads it)
LOCK_FILE = ".lock"  # run_dir/.lock (or OUT/.lock): the lock, one JSON line naming its holder


def find_checkpoint(run_dir: Path) -> Path | None:
    """run_dir/checkpoint, or, when a save died between its two renames, the previous one it had set aside
    (.checkpoint.old-PID; prepare_run_dir resumes from it only with --resume-from-backup)."""
    path = run_dir / CHECKPOINT
    if path.is_dir():
        return path
    aside = set_aside(run_dir)
    return aside[-1] if aside else None


def set_aside(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob(f".{CHECKPOINT}.old-*"), key=lambda p: p.stat().st_mtime)


# ======================================================================================================
# Symbolic links: a run or a sweep never follows one in its folder
# ======================================================================================================


def first_link(folder: Path) -> tuple[Path, str] | None:
    """(path, target) of the folder itself if it is a symbolic link, else of the first link under it; None when
    there is none (or no folder). os.walk lists a link as a name and never follows it."""
    folder = Path(folder)
    if folder.is_symlink():
        return folder, os.readlink(folder)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            if p.is_symlink():
                return p, os.readlink(p)
    return None


def refuse_links(folder: Path, flag: str = "--run-dir", who: str = "a run") -> None:
    """A run's (or sweep's) folder, and everything in it, is never a symbolic link: a folder received from someone
    else must not make a run write (or read) a file elsewhere by following one. Refused in one line, before anything
    is written. The folders above it may be links (runs/ on a scratch disk). flag, who: as the refusal names them
    ("--run-dir", "a run"; "--out", "a sweep")."""
    folder = Path(folder)
    found = first_link(folder)
    if found is None:
        return
    link, target = found
    if link == folder:
        raise UserError(
            f"{flag} {folder} is a symbolic link (to {target}); {who} never follows one: "
            "pass the folder it points to, or another; nothing was written"
        )
    raise UserError(
        f"{folder} holds a symbolic link, {link.relative_to(folder)} -> {target}; {who} never "
        "follows one: remove it (or choose another folder); nothing was written"
    )


# ======================================================================================================
# The lock: FOLDER/.lock, one JSON line {"pid": N, "holder": "ppo.py"}, flock'ed for the holder's life
# ======================================================================================================


class RunLock:
    """An OS-level lock on a run's (or a sweep's) folder (fcntl.flock on FOLDER/.lock), held for the run's life.

    The file holds one JSON line, {"pid": N, "holder": "ppo.py"} (or "sweep"), for the refusal message of whoever
    comes second (holder_of). The kernel drops the lock when the process ends,
    however it ends; release() also removes the file, and the folder when the run created it and left nothing
    else in it. Acquiring checks that the file locked is still the one at the path (a releasing run may have
    just removed it), so that two runs never hold locks on two different files."""

    def __init__(self, run_dir: Path, holder: str | None = None, flag: str = "--run-dir", who: str = "a run") -> None:
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK_FILE
        self.holder = holder or Path(sys.argv[0]).name or "python"
        self.flag, self.who = flag, who  # for the refusals: "--run-dir" and "a run", or "--out" and "a sweep"
        self.fd: int | None = None
        self.created = False

    def acquire(self) -> RunLock:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"{self.flag} {self.run_dir} is not a folder (a file of that name exists)")
        refuse_links(self.run_dir, self.flag, self.who)
        self.created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the run folder {self.run_dir}: {e.strerror or e}") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # a link: ELOOP
            except OSError as e:
                raise UserError(f"cannot write in the run folder {self.run_dir}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = holder_of(self.path, fd)
                os.close(fd)
                raise UserError(f"{self.run_dir} is in use by {holder}") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # locked a file its holder removed on release: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"pid": os.getpid(), "holder": self.holder}) + "\n").encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still held: whoever opened it before checks the inode
        if self.created:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only when empty: a run that wrote nothing leaves no folder
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def describe_holder(text: str) -> str:
    """'a trainer (ppo.py, pid 1234)' or 'a sweep (pid 1234)', from the JSON line a lock file holds."""
    try:
        info = json.loads(text.splitlines()[0])
        pid, holder = int(info["pid"]), str(info["holder"])
    except (ValueError, KeyError, IndexError, TypeError):
        return "another process (its lock file names none)"
    return f"a sweep (pid {pid})" if holder == "sweep" else f"a trainer ({holder}, pid {pid})"


def holder_of(path: Path, fd: int | None = None) -> str | None:
    """Who holds the lock at path ('a trainer (ppo.py, pid N), which holds PATH'), or None when it is free (or the
    file is absent or unreadable: whoever takes it will say why). Never creates the file. fd: the caller's own open
    descriptor of it, read instead of opening the file again (a lock refused to the caller)."""
    if fd is not None:
        return f"{describe_holder(os.pread(fd, 4096, 0).decode(errors='replace'))}, which holds {path}"
    try:
        f = open(path, "r+") if Path(path).exists() else None
    except OSError:
        return None
    if f is None:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None  # closing the file releases it
        except BlockingIOError:
            return f"{describe_holder(f.read())}, which holds {path}"


def after_stop(run_dir: Path | None) -> str:
    """What a stopped run's user does next: --resume from its checkpoint, or start again when it saved none."""
    if run_dir is None:
        return "continue with --resume"
    if (run_dir / CHECKPOINT).is_dir():
        return f"nothing after the checkpoint in {run_dir / CHECKPOINT} was kept; continue with --resume"
    left = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    if not left:
        return "nothing was saved; run the same command again"
    return f"no checkpoint was saved yet; remove {run_dir} and run the same command again"


# ======================================================================================================
# Files: JSON written atomically, results.json read back, nothing opened through a link
# ======================================================================================================


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """data in path whole or not at all: a temporary beside it, fsynced, then renamed over it (nothing left of the
    temporary when a write fails). The one atomic writer: JSON, the curve's CSV and the critic files go through it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with named_path(path), open(tmp, "wb", opener=open_nofollow) as f:  # os.replace replaces a link, not its target
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, json.dumps(obj, indent=2, default=str).encode())


@contextlib.contextmanager
def named_path(path: Path) -> Any:
    """An OSError without a file name (a full disk during write or fsync) gets path's, so that run_main says
    it in one line instead of a traceback."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def read_results(path: Path) -> dict[str, Any]:
    """A run's results.json; a damaged one is a UserError naming the file."""
    try:
        with open(path) as f:
            out = json.load(f)
        if not isinstance(out, dict) or "test" not in out:
            raise ValueError("no 'test' entry")
        return out
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is damaged: {e}") from None


def open_nofollow(path: Path | str, flags: int) -> int:
    """os.open opener that refuses a symbolic link at the last component (ELOOP, an OSError naming the path)."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o644)
