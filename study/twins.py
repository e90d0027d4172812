"""A paid PPO run and its amortised twin in the sweep: which plan line continues which, and the copy that starts one
from the other.

Under a constant learning rate a PPO run with --count-critic-init-tokens (its critic's pretraining spent from the
token budget) is the same run without the flag stopped early, step for step: the learning rate does not follow the
budget and nothing else reads it (checkpoint.BUDGET_ARGS). So the sweep trains those steps once: the amortised run
waits for its paid twin, starts from a copy of the twin's last checkpoint and trains on to its own budget.
Holds: pair_paid (the twins of a plan, on sweep_runner's Run objects) and fork (the copy). Does not hold: the
scheduling (sweep_runner.Sweep.pool waits for the twin), the trainers' check that the two runs differ only in the
budget (plumbing/checkpoint.py). No torch: the runner imports it (tests/test_layout.py NO_TORCH).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from plumbing import cmdline, rundir
from plumbing.errors import UserError

PAID = "--count-critic-init-tokens"  # ppo.py's paid price: the critic's pretraining spent from the token budget


def pair_paid(runs: list[Any], extra: list[str]) -> None:
    """Set each amortised run's paid twin (run.continues): the line of the same experiment, seed and script whose
    flags are its own and --count-critic-init-tokens. Under a constant learning rate (the trainers' default) the paid
    run is the amortised one stopped early, step for step (the learning rate does not follow the budget and nothing
    else reads it), so the sweep continues the paid run's last checkpoint into the amortised run (fork) rather
    than train those steps twice. A decaying --lr-schedule, or the flag for every run (--extra), pairs nothing."""
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


def fork(run: Any, command_flags: list[str]) -> str:
    """Start the amortised run from its paid twin's last checkpoint: copy it into run.dir with the metrics rows it
    counts, so that the trainer's --resume takes the steps from there. Only a twin that finished at this run's
    budget less its critic's pretraining (the same reference run) is its prefix; otherwise (the twin failed, or ran
    at another budget) nothing is copied and the run starts from scratch. Returns what the log says of it."""
    twin = run.continues
    if twin is None:
        return ""
    res, ckpt = twin.dir / "results.json", rundir.find_checkpoint(twin.dir)
    try:
        r = rundir.read_results(res) if res.is_file() else None
        spent = int(r["args"]["token_budget"]) + int(r["critic_init"]["tokens"]) if r else None
        state = json.loads((ckpt / "state.json").read_text()) if ckpt is not None else None
        rows = int(state["counters"]["metrics_rows"]) if state else None
        step = int(state["counters"]["step"]) if state else None
    except (UserError, OSError, KeyError, TypeError, ValueError):
        spent = rows = None
    wanted = cmdline.flag_value(command_flags, "token_budget", None)
    if spent is None or rows is None or ckpt is None or ckpt.name != rundir.CHECKPOINT or str(spent) != str(wanted):
        return f" (from scratch: {twin.label} is not its first steps at this budget)"
    run.dir.mkdir(parents=True, exist_ok=True)
    tmp = run.dir / f".{rundir.CHECKPOINT}.fork-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp, symlinks=True)  # a link in it is refused by the checkpoint's own check at load
    rows_kept = (twin.dir / "metrics.jsonl").read_text().splitlines(keepends=True)[:rows]
    (run.dir / "metrics.jsonl").write_text("".join(rows_kept))
    os.rename(tmp, run.dir / rundir.CHECKPOINT)  # last: a sweep killed before it leaves no checkpoint to resume
    return f" (continuing {twin.label}'s {step} steps)"
