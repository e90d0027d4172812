"""What a run writes besides its checkpoint: the banner, metrics.jsonl (and TensorBoard, W&B), results.json.

Holds: the banner every trainer prints first, --track's checks and Weights & Biases run (CleanRL's wandb.init),
MetricsLogger (one JSON line per step, the same scalars to TensorBoard and W&B; a resumed run's rows after its
checkpoint moved aside), and write_results (results.json, atomically, and the run's last line).
Does not hold: the checkpoint (checkpoint.py), the run folder's files and lock (rundir.py), reading results back
for the report (read_runs.py). Imports errors, rundir, runtime and distributed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plumbing.distributed import Dist, device_description, dtype_name
from plumbing.errors import UserError
from plumbing.rundir import named_path, open_nofollow, write_json_atomic
from plumbing.runtime import notice_once


# ======================================================================================================
# Logging: settings first, metrics.jsonl per step, TensorBoard scalars, Weights & Biases with --track
# ======================================================================================================
def describe_run(title: str, args: Any, dist_: Dist, extra: dict[str, Any], scaled: list[str]) -> str:
    """The banner every trainer prints first: device, dtype, model, data, and every setting."""
    lines = [f"== {title} ==", f"device: {dist_.device} x {dist_.world} process(es), dtype: {dtype_name(dist_.device)}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    if scaled:
        lines.append(
            "no GPU: scaled down for the CPU (pass --scale study to run the study's settings): " + ", ".join(scaled)
        )
    lines.append("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))
    return "\n".join(lines)


def check_tracking(args: Any) -> None:
    """--track needs wandb (an optional dependency, imported only then): refused in one line before anything
    loads when it is missing."""
    if getattr(args, "track", False) and importlib.util.find_spec("wandb") is None:
        raise UserError("--track logs to Weights & Biases, which is not installed: pip install wandb (or drop --track)")


def start_tracking(args: Any, run_dir: Path) -> Any:
    """A Weights & Biases run for --track (CleanRL's wandb.init: the project, the entity, the run's name, every
    setting as its config); None without --track. Its id is kept in run_dir/wandb/run_id, so that --resume
    continues the same W&B run. WANDB_MODE=offline writes it under run_dir/wandb/ without a network."""
    if not getattr(args, "track", False):
        return None
    import wandb  # the optional dependency: imported here only

    id_file = run_dir / "wandb" / "run_id"
    id_file.parent.mkdir(parents=True, exist_ok=True)
    run_id = id_file.read_text().strip() if id_file.is_file() else os.urandom(4).hex()
    id_file.write_text(run_id + "\n")
    config = {k: _jsonable(v) for k, v in vars(args).items()}
    return wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=run_dir.name, id=run_id,
                      resume="allow", dir=str(run_dir), config=config)  # fmt: skip


def metric_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics row (step aside; None, strings and lists left out): what TensorBoard and
    W&B get."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLogger:
    """Appends one JSON line per step to run_dir/metrics.jsonl, the same numbers as TensorBoard scalars
    (run_dir/tb/), and to Weights & Biases when the trainer runs with --track."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        resume_step: int | None = None,
        resume_rows: int | None = None,
        first_row: Callable[[], dict[str, Any]] | None = None,
        track: Any = None,
    ) -> None:
        """resume_step: the checkpoint's step; resume_rows: the rows metrics.jsonl held when it was saved (its
        counters' metrics_rows; None for a checkpoint saved before they were counted). Rows a killed run logged
        after it (and a half-written last line) are moved to metrics.jsonl.discarded-TIME, as the resumed run
        logs them again: with resume_rows, every row after the first resume_rows (a final evaluation's row at
        the checkpoint's own step among them); without, the rows of later steps.
        first_row: fields added to metrics.jsonl's first row (the trainers: generation.rollout_record; a resumed
        process's own backend is in results.json).
        track: the trainer's args (W&B only with --track: start_tracking)."""
        self.enabled = enabled
        self.first_row = first_row
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        self.rows = 0  # rows in metrics.jsonl: a checkpoint records it (counters["metrics_rows"])
        if enabled and resume_step is not None and self.path.is_file():
            kept, later = [], []
            for n, line in enumerate(self.path.read_text().splitlines()):
                step = None
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    step = json.loads(line)["step"]
                keep = isinstance(step, int) and step <= resume_step and (resume_rows is None or n < resume_rows)
                (kept if keep else later).append(line + "\n")
            self.rows = len(kept)
            if later:  # set aside, never dropped: metrics.jsonl.discarded-TIME
                aside = self.path.with_name(f"{self.path.name}.discarded-{time.strftime('%Y%m%d-%H%M%S')}")
                aside.write_text("".join(later))
                tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
                tmp.write_text("".join(kept))
                os.replace(tmp, self.path)
                notice_once(f"{len(later)} metrics row(s) after the checkpoint's step {resume_step} moved to {aside}")
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge)
            except ImportError:  # tensorboard is in requirements.txt; a bare install without it still runs
                self.tb = None
            self.wandb = start_tracking(track, run_dir)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        if self.first_row is not None:  # metrics.jsonl's first line only: a resume's rows match a straight run's
            if self.rows == 0:
                row.update(self.first_row())
            self.first_row = None
        with named_path(self.path), open(self.path, "a", opener=open_nofollow) as f:
            f.write(json.dumps(row) + "\n")
        self.rows += 1
        scalars = metric_scalars(row)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v  # NaN and inf as NaN and Infinity (Python's json reads them back); None stays null


def write_results(
    run_dir: Path, fields: dict[str, Any], test: dict[str, Any], device: torch.device, world: int
) -> None:
    """results.json (written atomically) and the one line a run ends with: its test accuracy."""
    results = {**fields, "test": test, "device": device_description(device, world), "date": time.strftime("%Y-%m-%d")}
    write_json_atomic(run_dir / "results.json", results)
    lo, hi = test["ci95"]
    acc = "none" if test["accuracy"] is None else f"{100 * test['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"
    print(
        f"test accuracy {acc} on {test['n']} problems after {fields['steps']} steps ({run_dir / 'results.json'})",
        flush=True,
    )
