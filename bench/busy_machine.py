"""The main job on an idle machine and beside busy processes, at the threads the scripts choose and at torch's defaults.

A laptop or a shared node is never idle. This runs a job (by default a short version of the main job, `python ppo.py
--critic small --total-steps 2 --test-size 100 --eval-size 0`; --full: the main job itself) in a fresh process,
idle and beside --busy processes that spin (`python -c 'while True: pass'`, started and killed here), in three
configurations:

  chosen  the environment without OMP_NUM_THREADS, OMP_WAIT_POLICY and GOMP_SPINCOUNT: the scripts' own choice
          (plumbing/threads.py: one thread below 20M parameters, torch's count above; a passive OpenMP wait)
  torch   torch's defaults, given explicitly (a user's setting wins over the scripts' choice): OMP_NUM_THREADS at
          torch's own count (read from a fresh torch) and GOMP_SPINCOUNT=300000, libgomp's spin when no policy is set

Each repeat runs (idle, busy) x the configurations (--configs) in turn, the configurations' order alternating from one
repeat to the next, so that a change in the machine's other work falls on both. It prints each run (wall seconds,
the job's CPU seconds, the 1-minute load average as it started, its last line), then the medians and the ratios:
beside the busy processes over idle, and each other configuration over the chosen threads. A run past --timeout is stopped
and counts as --timeout seconds (a lower bound, marked >=). A benchmark, not a test: the times are this machine's.

    python bench/busy_machine.py                          # the short job, 3 repeats, 1 busy process
    python bench/busy_machine.py --full --repeats 1       # the main job itself (2-4 min a run on 2 cores; 6 runs)
    python bench/busy_machine.py --busy 2 -- grpo.py --model smollm2 --total-steps 1 --test-size 8 --eval-size 0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORT_JOB = ["ppo.py", "--critic", "small", "--total-steps", "2", "--test-size", "100", "--eval-size", "0"]
FULL_JOB = ["ppo.py", "--critic", "small"]
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
LIBGOMP_SPIN = "300000"  # libgomp's GOMP_SPINCOUNT when OMP_WAIT_POLICY is unset (OMP_DISPLAY_ENV=VERBOSE shows it)
CONDITIONS = ("idle", "busy")
CONFIGS = ("chosen", "torch", "passive")


@dataclass
class Run:
    condition: str  # idle or busy
    config: str  # chosen or torch
    wall: float  # seconds, start to exit (or to the stop at --timeout)
    cpu: float  # the job's user + system seconds
    load: float  # the 1-minute load average as it started
    stopped: bool  # stopped at --timeout
    last: str  # the job's last line of output


def torch_threads() -> int:
    """torch's own thread count on this machine: a fresh interpreter's, OMP_NUM_THREADS unset."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)


def environments(threads: int) -> dict[str, dict[str, str]]:
    """The configurations' environments: the scripts' choice, torch's defaults given explicitly, and torch's count
    with a passive wait."""
    base = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    return {
        "chosen": base,
        "torch": {**base, "OMP_NUM_THREADS": str(threads), "GOMP_SPINCOUNT": LIBGOMP_SPIN},
        "passive": {**base, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"},
    }


def run_once(job: list[str], env: dict[str, str], busy: int, timeout: float, run_dir: Path) -> tuple[float, float, bool, str]:  # fmt: skip
    """The job in a fresh process (run_dir appended as --run-dir when the job is a trainer), beside `busy` spinning
    processes, killed after. The job runs in a process group of its own, killed whole at the timeout (or when this
    script is stopped): a trainer's children go with it (organism.py, run once where the cached organism is missing).
    -> (wall seconds, CPU seconds of the job and its children, stopped at the timeout, its last line)"""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    proc = None
    try:
        command = [sys.executable, *job]
        if job and job[0].endswith(".py"):
            command += ["--run-dir", str(run_dir), "--no-progress"]
        with tempfile.TemporaryFile("w+") as out:
            t0 = time.time()
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
            stopped = False
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.time() - t0 > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    _, status, usage = os.wait4(proc.pid, 0)
                    stopped = True
                    break
                time.sleep(0.2)
            wall = time.time() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            lines = out.read().strip().splitlines()
        if proc.returncode and not stopped:
            raise SystemExit(f"error: the job exited {proc.returncode}: {' '.join(command)}\n" + "\n".join(lines[-20:]))
        return wall, usage.ru_utime + usage.ru_stime, stopped, (lines[-1] if lines else "")
    finally:
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # what is left of its group: nothing, once it exited
        for hog in hogs:
            hog.kill()
            hog.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def median(runs: list[Run], condition: str, config: str) -> tuple[float, bool]:
    """The median wall seconds of one cell, and whether a stopped run is among them (then a lower bound)."""
    cell = [r for r in runs if r.condition == condition and r.config == config]
    return statistics.median(r.wall for r in cell), any(r.stopped for r in cell)


def summary(runs: list[Run], busy: int, configs: tuple[str, ...]) -> str:
    """The medians, each configuration's busy/idle ratio, and each other configuration over the chosen threads."""
    cells = {(c, k): median(runs, c, k) for c in CONDITIONS for k in configs}

    def sec(cell: tuple[float, bool]) -> str:
        return f"{'>=' if cell[1] else ''}{cell[0]:.0f} s"

    def ratio(a: tuple[float, bool], b: tuple[float, bool]) -> str:
        return f"{'>=' if a[1] and not b[1] else ''}{a[0] / b[0]:.2f}" if not b[1] else "n/a"

    beside = f"beside {busy} busy"
    lines = [f"{'median wall time':<18}{'idle':>10}{beside:>16}{'busy/idle':>11}"]
    for config in configs:
        idle, busy_ = cells[("idle", config)], cells[("busy", config)]
        lines.append(f"{config:<18}{sec(idle):>10}{sec(busy_):>16}{ratio(busy_, idle):>11}")
    for config in configs:
        if config != "chosen" and "chosen" in configs:
            lines.append(
                f"{config + ' / chosen':<18}{ratio(cells[('idle', config)], cells[('idle', 'chosen')]):>10}"
                f"{ratio(cells[('busy', config)], cells[('busy', 'chosen')]):>16}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the main job itself (`ppo.py --critic small`)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (condition, configuration)")
    parser.add_argument("--busy", type=int, default=1, help="spinning processes beside the job (default 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a run is stopped (default 900)")
    parser.add_argument(
        "--configs", default="chosen,torch,passive", help="comma-separated, of chosen, torch, passive (default all)"
    )
    parser.add_argument("job", nargs="*", help="after --: the job's script and flags, instead of the short job")
    a = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `kill`: the busy processes and the job go too
    if a.repeats < 1 or a.busy < 1 or a.timeout <= 0:
        parser.error("--repeats and --busy must be at least 1, --timeout positive")
    configs = tuple(c.strip() for c in a.configs.split(",") if c.strip())
    if not configs or set(configs) - set(CONFIGS) or len(set(configs)) != len(configs):
        parser.error(f"--configs {a.configs}: give each of {', '.join(CONFIGS)} at most once")
    job = a.job or (FULL_JOB if a.full else SHORT_JOB)
    threads = torch_threads()
    envs = environments(threads)
    print(f"job: python {' '.join(job)}; {os.cpu_count()} cores; torch's defaults: {threads} threads, "
          f"GOMP_SPINCOUNT={LIBGOMP_SPIN}; busy: {a.busy} x python -c 'while True: pass'", flush=True)  # fmt: skip
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="busy-machine-") as tmp:
        for rep in range(a.repeats):
            order = configs if rep % 2 == 0 else configs[::-1]
            for condition in CONDITIONS:
                for config in order:
                    load = os.getloadavg()[0]
                    wall, cpu, stopped, last = run_once(
                        job, envs[config], a.busy if condition == "busy" else 0, a.timeout, Path(tmp) / "run"
                    )
                    runs.append(Run(condition, config, wall, cpu, load, stopped, last))
                    said = "stopped at --timeout" if stopped else last[:90]
                    print(f"repeat {rep + 1} {condition:<5} {config:<7} {'>=' if stopped else ''}{wall:6.1f} s wall, "
                          f"{cpu:6.1f} s CPU, load {load:.2f} at start: {said}", flush=True)  # fmt: skip
    print(summary(runs, a.busy, configs), flush=True)


if __name__ == "__main__":
    main()
