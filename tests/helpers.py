"""Run a trainer with tiny settings, as a subprocess (run_trainer, start_trainer: a new interpreter,
sys.executable) or in this process (run_here, run_in_process: main() with its argv, every global it changes
restored after), and read what it wrote. Imported by the end-to-end tests.

A subprocess is for a test whose point is the process itself (a signal and the exit it causes, torchrun's ranks,
stderr exactly as a user sees it, the exit code of a real interpreter, a pid in a lock, sweep.sh's runs); every
other test runs the trainer here (run_here), without the ~5 s a new interpreter spends importing torch and
transformers.

Kept out of conftest.py on purpose: plain functions, no fixtures, so that it merges with any conftest.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A run that takes a few seconds on one CPU core: tiny model, short completions, small evaluations.
TINY = {
    "model": "tiny",
    "batch-size": 8,
    "max-new-tokens": 16,
    "micro-batch-size": 8,
    "num-minibatches": 2,
    "mc-every": 0,
    "eval-every": 0,
    "eval-size": 8,
    "test-size": 8,
    "eval-max-new-tokens": 8,
}


# the committed sample of GSM8K (tests/data/gsm8k/README.md): the trainers read GSM8K's files even on the toy task
GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k"


def gsm8k_sample_dir() -> str:
    """The folder the tests' trainers read GSM8K from: the committed sample (conftest.py sets GSM8K_DIR to it too)."""
    return str(GSM8K_SAMPLE)


# glibc's malloc keeps freed memory for reuse instead of mapping each large tensor afresh (conftest.pytest_sessionstart
# says why: a third of a tiny run's time went to the kernel); the same in pytest's process, set there with mallopt
MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def trainer_env() -> dict[str, str]:
    """The environment of a test's subprocess: offline, GSM8K, malloc's setting, and torch on one thread unless
    OMP_NUM_THREADS says otherwise (the xdist workers keep every core busy: a second thread would spin, a tiny run
    took 11-19 CPU seconds on two threads against 7-11 on one beside other work, 2026-12-03)."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, **MALLOC}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("GSM8K_DIR", gsm8k_sample_dir())  # a test's own folder where it set one (monkeypatch.setenv)
    env.pop("RANK", None)  # one process, whatever the test runner's environment says
    return env


def cli(run_dir: Path | str, base: dict | None = None, **flags) -> list[str]:
    """Command-line flags: TINY (or `base`), then `flags` (underscores become hyphens; None drops a flag).

    A True value is a bare switch; every run gets --no-progress so that stderr stays empty.
    """
    merged = dict(TINY if base is None else base)
    merged.update({k.replace("_", "-"): v for k, v in flags.items()})
    out = ["--run-dir", str(run_dir), "--no-progress"]
    for key, value in merged.items():
        if value is None:
            continue
        out += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return out


def command(script: str, args: list[str]) -> list[str]:
    return [sys.executable, str(REPO / script), *args]


def run_trainer(script: str, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python script args` from the repository root, a new interpreter; returns the finished process (never
    raises on rc)."""
    return subprocess.run(
        command(script, args), cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=timeout
    )


@contextlib.contextmanager
def process_state():
    """Whatever a trainer's main() changes in its process, put back after: the environment, the working folder,
    the SIGTERM/SIGINT handlers, torch's thread count and every global RNG (Python's, NumPy's, torch's), the
    warning filters, transformers' log level, the run's state in runtime.RUN (its notices, stop signal, lock and
    rollout record: begun afresh for the run, as in a fresh process, and forgotten after), and torch.compile's caches (a second run in this process
    must not hit the recompile limit a fresh process would not). A test that calls main() in its own process
    therefore leaves no trace on the next one."""
    import random

    import numpy as np
    import torch

    from plumbing import runtime

    saved_env, cwd = dict(os.environ), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    threads, rng = torch.get_num_threads(), (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    hf_logging = sys.modules.get("transformers.utils.logging")
    verbosity = hf_logging.get_verbosity() if hf_logging else None
    runtime.begin_run()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        runtime.begin_run()  # the run's lock released, its notices and record forgotten
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(cwd)
        for s, h in handlers.items():
            signal.signal(s, h)
        torch.set_num_threads(threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.random.set_rng_state(rng[2])
        if verbosity is not None:
            hf_logging.set_verbosity(verbosity)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


@contextlib.contextmanager
def as_trainer(script: str, args: list[str], threads: int | None = None):
    """The trainer module (e.g. "grpo" or "grpo.py") with sys.argv and the environment set as for
    `python script args` (and torch's thread count, when given: OMP_NUM_THREADS of a fresh process), the
    process's state restored after (process_state)."""
    module = importlib.import_module(script.removesuffix(".py"))
    saved_argv = sys.argv
    with process_state():
        sys.argv = [f"{module.__name__}.py", *args]
        os.environ.update(trainer_env())
        os.environ.pop("RANK", None)
        if threads is not None:  # as OMP_NUM_THREADS of a fresh process: the trainer's threads.use_threads reads it
            import torch

            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        try:
            yield module
        finally:
            sys.argv = saved_argv


def run_in_process(script: str, args: list[str]) -> None:
    """`script`.main() in this process, so that a test can watch its internals through monkeypatch; an
    exception propagates."""
    with as_trainer(script, args) as module:
        module.main()


def run_here(script: str, args: list[str], threads: int | None = None) -> subprocess.CompletedProcess:
    """run_trainer in this process: the same exit code, stdout and stderr, without the ~4 s a new Python takes
    to import torch and transformers (most of a tiny run's time). Bad input too: the refusal line is the same;
    a few refusals (test_validation.py's fresh-process tests, one damaged checkpoint) go through run_trainer,
    whose fresh process also shows every warning a user would see on stderr, which pytest captures here.
    threads: torch's thread count for the run (a fresh process's OMP_NUM_THREADS), restored after.
    """

    out, err, rc = io.StringIO(), io.StringIO(), 0
    with as_trainer(script, args, threads) as module, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            from plumbing import runtime

            runtime.run_main(module.main)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc()
            rc = 1
    return subprocess.CompletedProcess([script, *args], rc, out.getvalue(), err.getvalue())


def run_sweep(*args: str | Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """./sweep.sh ARGS from the repository root, with this interpreter as the trainers' python."""
    env = {**trainer_env(), "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(REPO / "sweep.sh"), *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def wait_for_first_step(proc: subprocess.Popen, run_dir: Path, timeout: float = 180) -> None:
    """Wait until the run in the background has logged a step to metrics.jsonl (it must still be running)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before its first step was logged"
        if (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().strip():
            return
        time.sleep(0.05)
    raise AssertionError("no step logged in time")


def assert_rises(values: list[float], by: float, to: float, what: str = "reward") -> None:
    """A learning test's check: the mean of the last five values beats the first five by `by` and reaches `to`."""
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    assert last >= first + by and last >= to, f"{what} did not rise: {[round(v, 2) for v in values]}"


def default_signals() -> None:
    """A test's signalled process starts with SIGINT and SIGTERM at their default disposition, as from a terminal,
    whatever pytest inherited: a parent that ignores SIGINT (a non-interactive shell's background job, nohup-like
    wrappers) passes SIG_IGN on through exec, Python then never raises KeyboardInterrupt during start-up, and a
    Ctrl-C test would see the run finish and exit 0. Runs in the child between fork and exec (preexec_fn)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def start_trainer(script: str, args: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a trainer in the background (a new interpreter), stdout and stderr into the open file `log` (a pipe
    could fill up), with SIGINT and SIGTERM at their defaults (default_signals): a test signals this process."""
    cmd = command(script, args)
    env = dict(trainer_env(), **(env or {}))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_signals)


def signal_at(at: str, log: Path, rank: int | None = None, name: str = "SIGTERM") -> dict[str, str]:
    """The environment that makes a trainer's process send itself signal `name` on a function's Nth call
    (at = "module.function:N"), on `rank` only if given, logging the signal's and the exit's time to `log`:
    a signal at a known point rather than after a sleep (tests/signal_at/sitecustomize.py)."""
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "signal_at"), os.environ.get("PYTHONPATH")])),
        "RLVR_SIGNAL_AT": at,
        "RLVR_SIGNAL_LOG": str(log),
        "RLVR_SIGNAL_NAME": name,
    }
    return env if rank is None else dict(env, RLVR_SIGNAL_RANK=str(rank))


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )


def check_one_error_line(proc: subprocess.CompletedProcess) -> str:
    """A user error: non-zero exit, exactly one line on stderr starting 'error:', no traceback. Returns it."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0, f"expected a failure, got exit 0\nstdout:\n{proc.stdout[-2000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr is not one 'error:' line:\n{proc.stderr}"
    return lines[0]


def check_results(run_dir: Path, steps: int) -> dict:
    """results.json of a finished run: the test accuracy inside its 95% interval, the step count, the tokens
    generated for training, the wall time and the arguments. Returns it for the trainer's own checks."""
    results = json.loads((Path(run_dir) / "results.json").read_text())
    test = results["test"]
    assert 0 <= test["accuracy"] <= 1 and test["n"] > 0
    lo, hi = test["ci95"]
    assert 0 <= lo <= test["accuracy"] <= hi <= 1
    assert results["steps"] == steps
    assert isinstance(results["generated_tokens"], int) and results["generated_tokens"] > 0
    assert is_finite(results["wall_time_s"]) and results["wall_time_s"] > 0
    assert isinstance(results["args"], dict) and results["args"]["run_dir"] == str(run_dir)
    return results


def check_checkpoint(run_dir: Path, step: int) -> None:
    """run_dir's checkpoint matches its manifest and was saved at `step`."""

    from plumbing import checkpoint

    ckpt = Path(run_dir) / checkpoint.CHECKPOINT
    checkpoint.verify_checkpoint(ckpt)
    assert json.loads((ckpt / "state.json").read_text())["counters"]["step"] == step
    assert (ckpt / "policy" / "model.safetensors").is_file()


def read_metrics(run_dir: Path) -> list[dict]:
    """Every row of run_dir/metrics.jsonl."""
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def step_rows(run_dir: Path) -> list[dict]:
    """The per-step training rows (those with a reward), in order."""
    return [row for row in read_metrics(run_dir) if "reward" in row]


def is_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def tree_digest(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under folder, by relative path: equal digests mean nothing was touched."""
    folder = Path(folder)
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# One step on the toy task with a large learning rate: the policy, critic and optimizer state all move.
SMALL_RUN = dict(task="toy", critic="small", lr=1e-3, kl_coef=0.04, total_steps=1)


def copy_run(src: Path, tmp_path: Path) -> Path:
    """A copy of a run folder under tmp_path, for a test to change."""
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst
