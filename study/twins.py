"""A paid PPO run and its amortised twin in the sweep: which plan line continues which, and the copy that starts one
from the other.

Under a constant learning rate a PPO run with --count-critic-init-tokens (its critic's pretraining spent from the
token budget) is the same run without the flag stopped early, step for step: in ppo.py the learning rate does not
follow the budget and nothing else reads it but the stop (checkpoint.BUDGET_ARGS). So the sweep trains those steps
once: the amortised run waits for its paid twin, starts from a copy of the twin's last checkpoint and trains on to its
own budget.
Holds: pair_paid (the twins of a plan, on sweep_runner's Run objects) and fork (the copy). Does not hold: the
scheduling (sweep_runner.Sweep.pool waits for the twin), the trainers' check that the two runs differ only in the
budget (plumbing/checkpoint.py). No torch: the runner imports it (tests/test_layout.py NO_TORCH).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from plumbing import cmdline, rundir
from plumbing.errors import UserError

PAID = "--count-critic-init-tokens"  # ppo.py's paid price: the critic's pretraining spent from the token budget


def pair_paid(runs: list[Any], extra: list[str]) -> None:
    """Set each amortised run's paid twin (run.continues): the line of the same experiment, seed and script whose
    flags are its own and --count-critic-init-tokens. Under a constant learning rate (the trainers' default) the paid
    run is the amortised one stopped early, step for step (module docstring), so the sweep continues the paid run's
    last checkpoint into the amortised run (fork) rather than train those steps twice. Flags in the same order and
    the flag spelled so; else nothing pairs, and each runs whole. A decaying --lr-schedule, or the flag for every run
    (--extra), pairs nothing."""
    if PAID in extra:
        return
    for run in runs:
        if run.step or PAID in run.flags:
            continue
        for twin in runs:
            same = (twin.experiment, twin.seed, twin.script) == (run.experiment, run.seed, run.script)
            if same and PAID in twin.flags and [f for f in twin.flags if f != PAID] == run.flags:
                given = cmdline.flag_value([*run.flags, *extra], "lr_schedule", None)
                if (given or cmdline.trainer_default(run.script, "lr_schedule")) == "constant":
                    run.continues = twin


def ran_as(log: Path, command: list[str]) -> bool:
    """Whether every start the sweep logged for a run (its log's '=== DATE TIME COMMAND' lines) ran the command it
    would run now, the interpreter and --resume aside: a twin made by an earlier sweep with other flags is no prefix."""
    want = " ".join(command[1:])
    try:
        starts = [
            line.split(" ", 3)[3] for line in log.read_text(errors="replace").splitlines() if line.startswith("=== ")
        ]
    except (OSError, IndexError):
        return False
    said = [start.split(" ", 1)[1] if " " in start else "" for start in starts]  # without the interpreter
    return bool(said) and all(s.removesuffix(" --resume") == want for s in said)


def fork(run: Any, twin_command: list[str], twin_log: Path) -> str:
    """Start the amortised run from its paid twin's last checkpoint: copy it into run.dir with the metrics rows it
    counts (not the final evaluation's after it), so that the trainer's --resume takes the steps from there. Only a
    twin that finished and ran as the plan runs it now (ran_as: its budget among its flags, the same reference run's
    as this run's) is its prefix; otherwise, or if the copy fails, nothing is left and the run starts from scratch.
    Returns what the sweep's log says of it."""
    twin = run.continues
    if twin is None:
        return ""
    ckpt = rundir.find_checkpoint(twin.dir)
    try:
        rundir.read_results(twin.dir / "results.json")
        state = json.loads((ckpt / "state.json").read_text()) if ckpt is not None else None
        rows, step = int(state["counters"]["metrics_rows"]), int(state["counters"]["step"])
    except (UserError, OSError, KeyError, TypeError, ValueError):
        state = None
    why = (
        "has not finished" if state is None or ckpt.name != rundir.CHECKPOINT
        else "ran with other flags than the plan's now" if not ran_as(twin_log, twin_command)
        else ""
    )  # fmt: skip
    if why:
        return f" (from scratch: its paid twin {twin.label} {why})"
    run.dir.mkdir(parents=True, exist_ok=True)
    tmp, metrics = run.dir / f".{rundir.CHECKPOINT}.fork-{os.getpid()}", run.dir / "metrics.jsonl"
    made = False
    try:
        kept = (twin.dir / "metrics.jsonl").read_text().splitlines(keepends=True)[:rows]
        shutil.copytree(ckpt, tmp, symlinks=True)  # a link in it is refused by the checkpoint's own check at load
        with open(metrics, "x", opener=rundir.open_nofollow) as f:  # the folder is a new run's: nothing to overwrite
            made = True
            f.write("".join(kept))
        os.rename(tmp, run.dir / rundir.CHECKPOINT)  # last: a sweep killed before it leaves no checkpoint to resume
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if made:
            metrics.unlink(missing_ok=True)
        return f" (from scratch: copying its paid twin {twin.label} failed: {e})"
    return f" (continuing {twin.label}'s {step} steps)"
