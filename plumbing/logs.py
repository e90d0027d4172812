"""What a run writes besides its checkpoint: the banner, metrics.jsonl (and TensorBoard, W&B), results.json.

Holds: the banner every trainer prints first (every setting, grouped as its Args groups them, within 120 columns),
--track's checks and Weights & Biases run (CleanRL's wandb.init), MetricsLogger (one JSON line per step, the same
scalars to TensorBoard and W&B; a resumed run's rows after its checkpoint moved aside), and write_results
(results.json, atomically, and the run's last line).
Does not hold: the checkpoint (checkpoint.py), the run folder's files and lock (rundir.py), reading results back
for the report (study/read_runs.py). Imports errors, rundir, runtime, distributed and
intervals (the paired difference a run ends with).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import re
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import intervals
from plumbing.distributed import Dist, device_description, dtype_name
from plumbing.errors import UserError
from plumbing.models import is_organism
from plumbing.rundir import named_path, open_nofollow, write_json_atomic
from plumbing.runtime import notice_once

# ======================================================================================================
# Logging: settings first, metrics.jsonl per step, TensorBoard scalars, Weights & Biases with --track
# ======================================================================================================
BANNER_WIDTH = 120


ON_GSM8K = "--model smollm2 runs GSM8K on the packaged SmolLM2-135M (the pipeline; it solves 0.6%)"


# The settings whose 0 or None stands for something other than that number (their Args docstrings say what): the
# banner shows what the run does, for a reader takes test_size=0 for no test problems and token_budget=0 for none
MEANINGS: dict[str, dict[Any, str]] = {
    "test_size": {0: "all"},
    "eval_size": {0: "all"},
    "token_budget": {0: "none"},
    "mc_every": {0: "never"},
    "eval_every": {0: "end-only"},
    "save_every": {0: "end-only"},
    "vf_clip": {0: "off"},
    "wandb_entity": {None: "default"},
}
FALLBACKS = {"clip_eps_high": "clip_eps"}  # None: the value of that other setting


def setting_value(args: Any, name: str, resolved: dict[str, Any]) -> Any:
    """What the banner shows for a setting: the value the trainer resolved it to (resolved: the run folder, the data
    folder), what its 0 or None means (MEANINGS, FALLBACKS), else its value."""
    if name in resolved:
        return resolved[name]
    value = getattr(args, name)
    if value is None and name in FALLBACKS:
        return getattr(args, FALLBACKS[name])
    meanings = MEANINGS.get(name, {})
    return meanings[value] if not isinstance(value, bool) and value in meanings else value


def describe_run(
    title: str, args: Any, dist_: Dist, extra: dict[str, Any], scaled: list[str], run_dir: Path | None = None,
    data_folder: str | None = None,
) -> str:  # fmt: skip
    """The banner every trainer prints first, each line at most BANNER_WIDTH characters (a longer word alone on its
    line): the device, what the trainer says of its run (extra: the model, the method, the data, the run folder),
    what the CPU preset changed, and every setting, `name=value`, grouped as Args groups them, one group a line;
    each value as the run uses it (setting_value), run_dir and data_dir the folders the trainer resolved them to."""
    resolved = {k: v for k, v in (("run_dir", run_dir), ("data_dir", data_folder)) if v is not None}
    wrap = dict(width=BANNER_WIDTH, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
    lines = [f"== {title} ==", f"device: {dist_.device} x {dist_.world} process(es), dtype: {dtype_name(dist_.device)}"]
    lines += [textwrap.fill(f"{k}: {v}", **wrap) for k, v in extra.items()]
    if is_organism(args.model) and any(s.startswith("model ") for s in scaled):  # the CPU preset chose it: say so
        note = f"no GPU: the model organism (organism.py, arithmetic in GSM8K's format), not GSM8K; {ON_GSM8K}"
        lines.insert(1, textwrap.fill(note, **wrap))
    if scaled:
        lines += _fill("CPU preset (no GPU; --scale study runs the study's settings):", scaled, ",", "    ")
    lines.append("settings:")
    for group, names in setting_groups(type(args)):
        lines += _fill(f"  {group}:", [f"{n}={setting_value(args, n, resolved)}" for n in names], "", "    ")
    return "\n".join(lines)


def setting_groups(cls: type) -> list[tuple[str, list[str]]]:
    """A dataclass's fields as its source groups them under `# --- name ---` comments (the name up to a comma or a
    parenthesis), in order; fields before any such comment, or every field when the source cannot be read, under
    "settings"."""
    names = [f.name for f in dataclasses.fields(cls)]
    source = _class_source(cls)
    if source is None:
        return [("settings", names)]
    groups: list[tuple[str, list[str]]] = [("settings", [])]
    placed: set[str] = set()
    for line in source.splitlines():
        header = re.match(r"\s*# --- (.+?) -+\s*$", line)
        field = re.match(r"    (\w+)\s*:", line)  # a field at the class body's indentation
        if header:
            groups.append((re.split(r"[,(]", header.group(1))[0].strip(), []))
        elif field and field.group(1) in names and field.group(1) not in placed:
            groups[-1][1].append(field.group(1))
            placed.add(field.group(1))
    groups[0][1].extend(n for n in names if n not in placed)
    return [(g, ns) for g, ns in groups if ns]


@functools.cache
def _class_source(cls: type) -> str | None:
    """inspect.getsource(cls), or None where it cannot be read; once per class and process: Python finds a class's
    lines by parsing its whole module, ~25 ms for a trainer's, and a process that runs several trainers' main()
    (the tests' in-process runs) prints a banner for each."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return None


def _fill(head: str, items: list[str], sep: str, indent: str) -> list[str]:
    """head and the items, sep after each but the last, on lines of at most BANNER_WIDTH characters; an item is
    never cut, the lines after the first begin with indent."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + (sep if i < len(items) - 1 else "")
        if len(line) + 1 + len(piece) > BANNER_WIDTH and line.strip() != head.strip():
            lines.append(line)
            line = indent + piece
        else:
            line = f"{line} {piece}"
    return [*lines, line]


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
        self.run_dir, self.resume_step, self.track = run_dir, resume_step, track
        self.tb = None
        self.wandb = None
        self.rows = 0  # rows in metrics.jsonl: a checkpoint records it (counters["metrics_rows"])
        self.kept: list[str] = []  # on a resume, metrics.jsonl's rows up to the checkpoint
        self.later: list[str] = []  # rows after the checkpoint, set aside when the first row is logged
        self.started = False
        if enabled and resume_step is not None and self.path.is_file():
            for n, line in enumerate(self.path.read_text().splitlines()):
                step = None
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    step = json.loads(line)["step"]
                keep = isinstance(step, int) and step <= resume_step and (resume_rows is None or n < resume_rows)
                (self.kept if keep else self.later).append(line + "\n")
            self.rows = len(self.kept)

    def start(self) -> None:
        """What the logger writes before its first row, deferred to it: the rows after the checkpoint set aside
        (metrics.jsonl.discarded-TIME, never dropped), TensorBoard's writer, the W&B run. So a resume refused after
        the logger is made (a checkpoint's data position that does not fit the data) has written nothing."""
        self.started = True
        if not self.enabled:
            return
        if self.later:
            aside = self.path.with_name(f"{self.path.name}.discarded-{time.strftime('%Y%m%d-%H%M%S')}")
            aside.write_text("".join(self.later))
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text("".join(self.kept))
            os.replace(tmp, self.path)
            notice_once(
                f"{len(self.later)} metrics row(s) after the checkpoint's step {self.resume_step} moved to {aside}"
            )
        try:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if self.resume_step is None else self.resume_step + 1
            self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge)
        except ImportError:  # tensorboard is in requirements.txt; a bare install without it still runs
            self.tb = None
        self.wandb = start_tracking(self.track, self.run_dir)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.started:
            self.start()
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


def accuracy_text(res: dict[str, Any]) -> str:
    """An evaluation's accuracy and its 95% interval, in percent: "31.1% [28.3, 34.1]" ("none" over no problems)."""
    if res["accuracy"] is None:
        return "none"
    lo, hi = res["ci95"]
    return f"{100 * res['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def write_results(
    run_dir: Path, fields: dict[str, Any], test: dict[str, Any], device: torch.device, world: int
) -> None:
    """results.json (written atomically) and the one line a run ends with: its test accuracy."""
    results = {**fields, "test": test, "device": device_description(device, world), "date": time.strftime("%Y-%m-%d")}
    write_json_atomic(run_dir / "results.json", results)
    acc = accuracy_text(test)
    before = fields.get("test_before")
    if before and before.get("n") != test["n"]:  # a resume with another --test-size: not the same problems
        print(
            f"test accuracy before training {accuracy_text(before)} on {before.get('n')} problems, after {acc} on "
            f"{test['n']}: not paired (--test-size changed on resume)",
            flush=True,
        )
    elif before and test["n"]:
        diff, d_lo, d_hi = intervals.paired_difference(test["correct"], before["correct"])
        changed = sum(a != b for a, b in zip(test["correct"], before["correct"]))
        ci = "(no interval)" if math.isnan(d_lo) else f"[{100 * d_lo:+.1f}, {100 * d_hi:+.1f}]"
        print(
            f"test accuracy before training {accuracy_text(before)}, after {acc}: paired difference "
            f"{100 * diff:+.1f} points {ci} ({changed} problems changed answer)",
            flush=True,
        )
    print(
        f"test accuracy {acc} on {test['n']} problems after {fields['steps']} steps ({run_dir / 'results.json'})",
        flush=True,
    )
