"""A run's life in one process: its state, run_main, the command line, ranges, seeding, stop signals, the guard.

Holds: RunState (everything this process remembers for the run it runs: notices said, the stop signal, the run
folder's lock, the rollout record), begun afresh by run_main; run_main (every error one line and its exit code,
the lock released on every exit); cli (tyro with a preset as its default, parsed by cmdline.py) and the range checks
every trainer's validate() calls; seeding; StopSignal, stoppable, check_stop and stop_point (a signal stops a run
within seconds); FiniteGuard (nothing non-finite is trained on); notice_once.
Does not hold: processes and devices (distributed.py), the run folder's rules and lock (rundir.py), logs and
results (logs.py), checkpoints (checkpoint.py), tyro's parsing and its one-line refusals (cmdline.py). Imports
errors, rundir, cmdline, models (a model's own settings) and distributed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import random
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from plumbing import cmdline, models, rundir
from plumbing.distributed import all_ok, all_reduce_sum, world_size
from plumbing.errors import (
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_USAGE,
    NonFiniteError,
    RunFinished,
    Stopped,
    UserError,
    WriteFailed,
)
from plumbing.models import MODEL_SETTINGS, ORGANISM, check_organism_prompt, is_organism

# ======================================================================================================
# The run's state in this process: one place, begun afresh where a run starts (run_main)
# ======================================================================================================


@dataclass
class RunState:
    """What this process holds for the run it is running, in one place. begin_run() starts it afresh, so that a
    second run in the same process (the tests run many) sees nothing of the first."""

    notices: set[str] = field(default_factory=set)  # the notices said once (notice_once)
    stop: StopSignal | None = None  # the run's stop signal, once the loop installs it
    stoppable: list[str] = field(default_factory=list)  # what a stop signal cuts short now, innermost last
    lock: rundir.RunLock | None = None  # the run folder's lock (lock_run_dir), released on every exit
    backends: list[str] = field(default_factory=list)  # the rollout backends generate() used, in first-use order
    fallbacks: list[dict[str, str]] = field(default_factory=list)  # the static engine's fallbacks, with reasons


RUN = RunState()


def begin_run() -> None:
    """A new run in this process: an earlier run's lock released, everything it left (notices said, a stop signal,
    the rollout record, its memory check) forgotten. run_main calls it first."""
    release_run_lock()
    vars(RUN).update(vars(RunState()))
    models.forget_memory_check()


def lock_run_dir(run_dir: Path) -> None:
    """Lock run_dir for this run (rundir.RunLock), released by run_main on every exit."""
    release_run_lock()
    RUN.lock = rundir.RunLock(run_dir).acquire()


def release_run_lock() -> None:
    if RUN.lock is not None:
        RUN.lock.release()
        RUN.lock = None


def notice_once(message: str) -> None:
    """A note on stderr (rank 0), said once per run: a fallback, a skipped step, rows moved aside."""
    if message not in RUN.notices:
        RUN.notices.add(message)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"note: {message}", file=sys.stderr, flush=True)


def run_main(main: Callable[[], Any]) -> None:
    """Run a trainer's main(): a UserError (a bad flag included: see cli) becomes one line and exit code 2 on every rank; a NonFiniteError
    one line and exit 3; a file-system error (a full disk, a folder that cannot be written) one line naming
    the path and exit 1; a closed stdout (`--help | head`) exit 1 in silence; Ctrl-C before the stop signal is installed (start-up) one line and exit 130. The
    run folder's lock is released on every exit, and a run folder this run created and left empty goes."""
    main_rank = int(os.environ.get("RANK", "0")) == 0
    code, finished = 0, False
    begin_run()
    try:
        main()
        finished = True
    except RunFinished as e:
        if main_rank:
            print(str(e), flush=True)
    except UserError as e:
        if main_rank:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_USAGE
    except NonFiniteError as e:
        if main_rank:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_NONFINITE
    except Stopped as e:
        if main_rank:
            print(f"\n{e}; {rundir.after_stop(RUN.lock.run_dir if RUN.lock else None)}", flush=True)
    except WriteFailed as e:
        if main_rank:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 1
    except BrokenPipeError:  # stdout's reader went away (`--help | head`): nothing to say, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        code = 1
    except KeyboardInterrupt:
        if main_rank:
            print("error: interrupted (SIGINT) during start-up; nothing was saved", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except OSError as e:
        if not e.filename:  # not a file-system error: the traceback is what helps
            raise
        if main_rank:
            print(f"error: {e.filename}: {e.strerror or e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        release_run_lock()
        # a process group left to the interpreter's teardown can abort in gloo's threads ("terminate called
        # without an active exception", exit -6 after a finished run): every rank that finished waits for the
        # others, the modules that hold the group (FSDP's mesh, DDP's reducer, in reference cycles) are freed,
        # and the group is closed while everything is alive
        if dist.is_available() and dist.is_initialized():
            if finished:
                dist.barrier()
            gc.collect()
            dist.destroy_process_group()
    if code:
        sys.exit(code)


T = TypeVar("T")


def cli(cls: type[T], cpu: dict[str, dict[str, Any]], args: Sequence[str] | None = None) -> tuple[T, list[str]]:
    """A trainer's Args from the command line, its defaults one of two explicit presets: the study's (cls()) or a
    CPU preset. --scale cpu, or --scale auto where --device resolves to the CPU, runs a CPU preset; --scale study
    the study's. The CPU presets are keyed by model: the first is the default model's, the one --model names when it
    has its own, else the last (cpu: {"organism": {...}, "smollm2": {...}}). A model's own settings
    (models.MODEL_SETTINGS: the organism's prompt) hold at either scale. --scale, --device and --model are read
    first (flag_value), then tyro parses the command line once with the chosen defaults, so --help shows the values
    that would run. A flag given always wins. Returns the args and what the CPU preset changed ("batch_size 512 ->
    8": each field left to the preset where it differs from the study's), for the banner and results.json. A bad
    flag or value is a UserError of one line, not tyro's box; so is a prompt format an organism cannot read
    (models.check_organism_prompt). args: the flags (default: the command line)."""
    flags = list(sys.argv[1:] if args is None else args)
    study = cls()
    scale = cmdline.flag_value(flags, "scale", study.scale)
    device = cmdline.flag_value(flags, "device", study.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (scale == "cpu" or (scale == "auto" and not device.startswith("cuda"))):
        study = dataclasses.replace(study, **model_settings(cls, cmdline.flag_value(flags, "model", study.model)))
        out, changed = cmdline.parse(cls, study, flags), []  # a bad --scale or --device is tyro's to refuse
    else:
        preset = cpu_preset(cls, cpu, cmdline.flag_value(flags, "model", None))
        description = f"{cmdline.help_opening(cls)}\n\n{cmdline.fill(preset_note(preset.model, scale))}"
        out = cmdline.parse(cls, preset, flags, description=description)
        given = cmdline.given_fields(cls, flags)
        changed = [
            f"{f.name} {getattr(study, f.name)} -> {getattr(preset, f.name)}"
            for f in dataclasses.fields(cls)
            if f.name not in given and getattr(study, f.name) != getattr(preset, f.name)
        ]
    if is_organism(getattr(out, "model", "")) and hasattr(out, "prompt_format"):
        check_organism_prompt(out.prompt_format)  # a model's setting it cannot run without: before anything loads
    return out, changed


def preset_note(model: str, scale: str) -> str:
    """--help's second paragraph under a CPU preset: its defaults are not the study's, and (the organism's) not
    GSM8K either."""
    why = "No GPU here" if scale == "auto" else "--scale cpu"
    if model == ORGANISM:
        what = (
            "the CPU preset, the model organism (organism.py: a 0.6M-parameter model of multi-step arithmetic in "
            "GSM8K's format), not GSM8K"
        )
    elif is_organism(model):
        what = f"the organism's CPU preset, on {model} (organism.py's arithmetic in GSM8K's format), not GSM8K"
    else:
        what = f"the CPU preset of --model {model}"
    return f"{why}: the defaults below are {what}; --scale study shows the study's."


def cpu_preset(cls: type[T], cpu: dict[str, dict[str, Any]], model: str | None = None) -> T:
    """The CPU preset's Args for --model (None: not given): the model's own preset, else the last one (a model given
    without its own), or the first (the default model's) when none is given; the model's own settings applied."""
    presets = list(cpu.values())
    key = ORGANISM if model is not None and is_organism(model) and model not in cpu else model  # the organisms' own
    chosen = presets[0] if key is None else cpu.get(key, presets[-1])
    out = cls(**chosen)
    if model is not None:
        out = dataclasses.replace(out, model=model)
    return dataclasses.replace(out, **model_settings(cls, out.model))


def model_settings(cls: type, model: str) -> dict[str, Any]:
    """The settings a model holds at any scale, unless a flag says otherwise (models.MODEL_SETTINGS), for the
    fields cls has."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in MODEL_SETTINGS.get(model, {}).items() if k in names}


def check_divides(what: str, n: int, by: int, by_what: str) -> None:
    if by <= 0 or n % by != 0:
        raise UserError(f"{what} ({n}) must be a positive multiple of {by_what} ({by})")


# ------------------------------------------------------------------------------------------------------
# Argument ranges: each trainer's validate(args) calls check_ranges right after parsing, before anything loads
# ------------------------------------------------------------------------------------------------------

SEED_MAX = 2**63 - 1  # torch.manual_seed takes a 64-bit seed


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bound(x: float) -> str:
    """A range's end as a reader writes it: 0, 1, 2^63 - 1 (the seed's), 0.5."""
    if x == SEED_MAX:
        return "2^63 - 1"
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def range_words(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False) -> str:
    """A range in words: "0 or more", "more than 0", "from 0 to 1", "more than 0 and at most 1"."""
    lo, hi = _bound(low), _bound(high)
    if high == math.inf:
        return f"more than {lo}" if low_open else f"{lo} or more"
    if not (low_open or high_open):
        return f"from {lo} to {hi}"
    return f"{'more than' if low_open else 'at least'} {lo} and {'less than' if high_open else 'at most'} {hi}"


def check_range(name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False) -> None:  # fmt: skip
    """One flag in its range (open ends where asked), finite; else a UserError naming it, its value and the range
    in words: "--total-steps -3: must be 0 or more"."""
    finite = _is_number(value) and (isinstance(value, int) or math.isfinite(value))  # an int of any size is finite
    ok = finite and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        words = range_words(low, high, low_open=low_open, high_open=high_open)
        raise UserError(f"{_flag(name)} {value}: must be {'' if finite else 'a finite number '}{words}")


def check_ranges(
    args: Any,
    *,
    positive: Sequence[str] = (),
    non_negative: Sequence[str] = (),
    probability: Sequence[str] = (),
    unit: Sequence[str] = (),
    seeds: Sequence[str] = (),
) -> None:
    """The numeric fields of args by kind (a field set to None is skipped): the trainer's own, named here, and
    the ones every trainer shares (SHARED_RANGES, where args has them).
    positive: sizes, counts, learning rates, temperatures (> 0, finite); non_negative: counts where 0 means
    'off' or 'all', coefficients (>= 0, finite); probability: (0, 1]; unit: [0, 1]; seeds: 0 .. 2^63 - 1."""
    kinds = [
        (positive, "positive", dict(low=0, low_open=True)),
        (non_negative, "non_negative", dict(low=0)),
        (probability, "probability", dict(low=0, high=1, low_open=True)),
        (unit, "unit", dict(low=0, high=1)),
        (seeds, "seeds", dict(low=0, high=SEED_MAX)),
    ]
    for names, kind, kw in kinds:
        for name in (*SHARED_RANGES.get(kind, ()), *names):
            value = getattr(args, name, None)
            if value is not None:
                check_range(name, value, **kw)


# The flags the trainers share, by kind: checked by check_ranges wherever a trainer's Args has them.
SHARED_RANGES = {
    "positive": ("batch_size", "max_new_tokens", "temperature", "lr", "max_grad_norm", "micro_batch_size",
                 "update_epochs", "eval_batch_size", "eval_max_new_tokens"),
    "non_negative": ("val_size", "total_steps", "token_budget", "warmup_steps", "weight_decay", "kl_coef",
                     "mc_every", "mc_states", "eval_every", "eval_size", "test_size", "save_every"),
    "probability": ("top_p",),
    "seeds": ("seed",),
}  # fmt: skip


def seed_everything(seed: int) -> None:
    """Seed every global RNG. Sampling uses its own per-step uniforms (see step_uniforms)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


class StopSignal:
    """SIGTERM / SIGINT (preemption under a scheduler) set a flag; the loop finishes its step, saves, exits 0.

    Under torchrun a signal may reach one rank only: `should_stop()` all-reduces the flag so that every rank
    stops after the same step and no rank waits alone in a collective. Outside the step (an evaluation, the
    Monte Carlo measurement, DPO's pair sampling: see stoppable) check_stop ends a one-process run at once
    (within a decode step), and stop_point every rank of a torchrun together (within a batch).
    """

    def __init__(self) -> None:
        self.flag = False
        self.name = ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        RUN.stop = self

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag, self.name = True, signal.Signals(signum).name

    def should_stop(self) -> bool:
        return not all_ok(not self.flag)


@contextlib.contextmanager
def stoppable(what: str) -> Any:
    """Within it, check_stop() ends the run on a stop signal: work never saved (an evaluation), redone on resume."""
    RUN.stoppable.append(what)
    try:
        yield
    finally:
        RUN.stoppable.pop()


def check_stop() -> None:
    """Raise Stopped if a stop signal arrived inside stoppable(...). One process only: under torchrun a signal may
    reach one rank, and a rank that left alone would leave the others in a collective; there the ranks stop
    together at stop_point()s (and at the step's end)."""
    if not (RUN.stoppable and RUN.stop is not None and RUN.stop.flag) or world_size() > 1:
        return
    if signal.getsignal(signal.SIGTERM) == RUN.stop._handle:  # still the run's handler (not a finished run's)
        raise Stopped(f"stopped by {RUN.stop.name} during {RUN.stoppable[-1]}")


def stop_point() -> None:
    """check_stop at a point every rank passes the same number of times (a batch of an evaluation or of the Monte
    Carlo measurement, a chunk of DPO's pair sampling): under torchrun the flag is all-reduced there (one tiny
    all-reduce), so a signal that reached one rank stops every rank at the same point, within one batch."""
    if world_size() <= 1:
        check_stop()
    elif RUN.stoppable and RUN.stop is not None and not all_ok(not RUN.stop.flag):  # every rank takes the same branch
        who = RUN.stop.name if RUN.stop.flag else "a signal on another rank"
        raise Stopped(f"stopped by {who} during {RUN.stoppable[-1]}")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (FSDP), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor: every element of every tensor finite (no host sync)."""
    flags = [torch.isfinite(_local(t)).all() for t in tensors if t is not None and _local(t).numel()]
    return torch.stack(flags).all() if flags else torch.tensor(True)


class FiniteGuard:
    """Nothing non-finite is trained on: around each optimiser step,

        loss.backward(); guard.track(loss)            # every micro-batch
        if guard.ok(step, grad_norm):                 # after clipping; False: skip this step
            optimizer.step()

    A non-finite loss or gradient norm skips the step (the caller's zero_grad drops its gradients) and counts
    it (take_skips(), logged as nonfinite_skips); a second one within `window` optimiser steps, or non-finite
    weights, raises NonFiniteError naming the step and the quantity (exit code 3, no save on the way out).
    Every rank calls ok() at the same point: the verdict is all-reduced, so that the ranks skip together."""

    def __init__(self, *modules: nn.Module | None, window: int = 10) -> None:
        self.params = [p for m in modules if m is not None for p in m.parameters()]
        self.window, self.calls, self.last_skip, self.skips = window, 0, None, 0
        self._loss_ok: torch.Tensor | None = None

    def track(self, loss: torch.Tensor) -> None:
        ok = torch.isfinite(loss.detach()).all()
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok

    def ok(self, step: int, *grad_norms: torch.Tensor | None) -> bool:
        self.calls += 1
        loss_ok = self._loss_ok if self._loss_ok is not None else torch.tensor(True)
        self._loss_ok = None
        # under FSDP clip_grad_norm_ returns a DTensor: its full value, the same on every rank
        whole = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grad_norms if g is not None]
        norms = [torch.as_tensor(g).detach().reshape(1) for g in whole]
        grad_ok = all_finite(norms)
        weights_ok = all_finite([p.detach() for p in self.params])
        device = weights_ok.device
        bad = torch.stack([~loss_ok.to(device), ~grad_ok.to(device), ~weights_ok]).float()
        bad = all_reduce_sum(bad).tolist()  # [3], one host sync, the same on every rank
        if bad[2]:
            raise NonFiniteError(
                f"step {step}: non-finite weights after the previous optimiser step; stopped, the last good "
                "checkpoint was left as it was"
            )
        if not (bad[0] or bad[1]):
            return True
        what = " and ".join(q for q, b in (("loss", bad[0]), ("gradient norm", bad[1])) if b)
        if self.last_skip is not None and self.calls - self.last_skip <= self.window:
            raise NonFiniteError(
                f"step {step}: non-finite {what}, the second within {self.window} optimiser steps; stopped, "
                "the last good checkpoint was left as it was"
            )
        self.last_skip, self.skips = self.calls, self.skips + 1
        notice_once(f"step {step}: non-finite {what}; that optimiser step was skipped (nonfinite_skips)")
        return False

    def take_skips(self) -> int:
        """Steps skipped since the last call: the step's nonfinite_skips."""
        n, self.skips = self.skips, 0
        return n
