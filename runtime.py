"""The plumbing every trainer needs and no method depends on: errors, processes, logs, the lock.

Holds: user errors, run_main and the command line (cli: tyro with a preset as its default), distributed setup
and its collectives, seeding, the stop signal, DDP/FSDP and whole-weight copies, the run banner, metrics logging
and results.
Does not hold: model and tokenizer loading, the --model names, the packaged GGUF's cache, the tiny test models and
the generation memory check (models.py); checkpoints, the run folder's checks and its lock (checkpoint.py),
generation or the training forward (engine.py), data, reward, losses or measurement (common.py).
Nothing here imports another module of this project.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import io
import json
import math
import os
import random
import re
import signal
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

# ======================================================================================================
# Errors and distributed setup
# ======================================================================================================


class UserError(Exception):
    """Bad input: reported as one line on stderr and a non-zero exit, never a traceback."""


class NonFiniteError(Exception):
    """A NaN or inf that would be trained on or saved: one line naming the step and the quantity, exit code 3."""


class WriteFailed(Exception):
    """A write that failed (a full disk, whatever library raised it): one line naming the path, exit 1."""


class Stopped(Exception):
    """A stop signal honoured outside the training loop's step end (check_stop): the run ends at once, with
    nothing after its last checkpoint kept; run_main says so in one line and exits 0, as a stop does."""


class RunFinished(Exception):
    """--resume of a run whose results.json exists: one line, exit code 0, nothing touched."""


EXIT_USAGE, EXIT_NONFINITE, EXIT_INTERRUPTED = 2, 3, 130

# The run folder's part in run_main, set by checkpoint.py (which holds the run folder and its lock; this module
# imports nothing of the project): the lock's release on every exit, and what a stopped run's user does next.
_RUN_FOLDER: dict[str, Callable[[], Any]] = {"release": lambda: None, "after_stop": lambda: "continue with --resume"}


def run_main(main: Callable[[], Any]) -> None:
    """Run a trainer's main(): a UserError (a bad flag included: see cli) becomes one line and exit code 2 on every rank; a NonFiniteError
    one line and exit 3; a file-system error (a full disk, a folder that cannot be written) one line naming
    the path and exit 1; a closed stdout (`--help | head`) exit 1 in silence; Ctrl-C before the stop signal is installed (start-up) one line and exit 130. The
    run folder's lock is released on every exit, and a run folder this run created and left empty goes."""
    main_rank = int(os.environ.get("RANK", "0")) == 0
    code, finished = 0, False
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
            print(f"\n{e}; {_RUN_FOLDER['after_stop']()}", flush=True)
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
        _RUN_FOLDER["release"]()
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


PRINT_ARGS = "--print-args"  # a trainer's settings as it would run them, one JSON line, then exit 0


def cli(cls: type[T], cpu: T, args: Sequence[str] | None = None) -> tuple[T, list[str]]:
    """A trainer's Args from the command line (tyro), its defaults one of two explicit presets: the study's
    (cls()) or the CPU's (`cpu`). --scale cpu, or --scale auto where --device resolves to the CPU, runs the CPU
    preset; --scale study the study's; --help shows the one that runs on this machine. A flag given always wins.
    Returns the args and what the CPU preset changed ("batch_size 512 -> 8"), for the banner and results.json.
    A bad flag or value is a UserError of one line, not tyro's box. args: the flags (default: the command line).

    --print-args (PRINT_ARGS) anywhere among the flags prints {"args": every setting, "scaled": what the preset
    changed} as one JSON line and exits 0, loading nothing: how the sweep's preflight (preflight.py) reads a plan
    line's settings without importing a trainer."""
    flags = list(sys.argv[1:] if args is None else args)
    if PRINT_ARGS in flags:
        out, changed = cli(cls, cpu, [f for f in flags if f != PRINT_ARGS])
        print(json.dumps({"args": dataclasses.asdict(out), "scaled": changed}), flush=True)
        sys.exit(0)
    on_gpu = torch.cuda.is_available()
    study = cls()
    first = _tyro_cli(cls, study if on_gpu else cpu, args)  # --help stops here, with this machine's preset
    second = _tyro_cli(cls, cpu if on_gpu else study, args)
    at_study, at_cpu = (first, second) if on_gpu else (second, first)
    device = at_study.device if at_study.device != "auto" else ("cuda" if on_gpu else "cpu")
    if at_study.scale == "study" or (at_study.scale == "auto" and device.startswith("cuda")):
        return at_study, []
    # both parses saw the same flags: a field differs only where it was left to the preset
    changed = [
        f"{f.name} {getattr(at_study, f.name)} -> {getattr(at_cpu, f.name)}"
        for f in dataclasses.fields(cls)
        if getattr(at_study, f.name) != getattr(at_cpu, f.name)
    ]
    return at_cpu, changed


def parse_args(cls: type[T], args: Sequence[str] | None = None) -> T:
    """A script's Args (a dataclass, its defaults cls()'s) from the command line with tyro, for a script without
    the trainers' two presets (report.py). A bad flag or value is a UserError of one line, as in cli."""
    return _tyro_cli(cls, cls(), args)


def _tyro_cli(cls: type[T], default: T, args: Sequence[str] | None) -> T:
    import tyro

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            out = tyro.cli(cls, default=default, args=args)
    except SystemExit as e:
        if e.code == 2:  # tyro printed an error box and exits 2: its message, as one line
            raise UserError(_tyro_message(err.getvalue())) from None
        sys.stderr.write(err.getvalue())
        raise
    sys.stderr.write(err.getvalue())  # tyro's warnings, if any
    return out


def _tyro_message(box: str) -> str:
    """tyro's error box -> its message on one line. rich draws the box with borders and the title in the top one,
    or (no terminal features) plain: the title alone above a rule of dashes. The message is the first block of
    text after the title, up to the next rule; the help hints after it are left out."""
    box = re.sub(r"\x1b\[[0-9;]*m", "", box)  # colours, if any
    rows = [line.strip().strip("│").strip() for line in box.splitlines()]
    is_rule = [bool(r) and set(r) <= set("─-") for r in rows]
    blocks: list[list[str]] = [[]]
    for i, (row, rule) in enumerate(zip(rows, is_rule)):
        if rule or row[:1] in ("╭", "╰"):  # a rule, or a border (the rich title lives there)
            blocks.append([])
        elif row:
            title = not any(blocks) and i + 1 < len(rows) and is_rule[i + 1] and len(blocks) == 1
            if not title:  # the plain title: a first line right above a rule
                blocks[-1].append(row)
    text = next((b for b in blocks if b), [])
    out = ""
    for piece in text:  # rich wraps at the box's width; a wrapped "." or ")" joins without a space
        out += piece if not out or piece[0] in ".,;:)]" else " " + piece
    return out or "bad command line (run with --help)"


@dataclass
class Dist:
    """Where this process stands: rank, world size, its device. One process when torchrun is absent."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str = "auto", fsdp: bool = False) -> Dist:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; NCCL on GPUs, gloo on the CPU (nanoGPT style)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for, but no CUDA device is visible")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UserError(f"unknown --device {device!r}: use auto, cpu or cuda")
    if fsdp and "RANK" not in os.environ:
        raise UserError("--fsdp shards the model over the processes of a torchrun launch: start it with torchrun")
    if "RANK" not in os.environ:
        return Dist(device=torch.device(device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"  # NCCL for GPU tensors; gloo for the CPU ones (counters, objects, DCP)
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return Dist(rank=rank, world=world, local_rank=local_rank, device=dev)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (a no-op in one process). Returns a new tensor; the input is untouched."""
    x = x.clone()
    if world_size() > 1:  # gloo reduces CPU tensors, NCCL CUDA ones (setup_distributed's backends)
        dist.all_reduce(x)
    return x


def all_reduce_sums(sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """A step's named sums, each summed over ranks: one all_reduce (float64) and one copy to the host per step.
    Every rank passes the same names."""
    names = sorted(sums)
    # a DTensor (clip_grad_norm_'s norm under FSDP) as a plain tensor; every rank does it, in the same order
    local = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sums.items()}
    device = next((v.device for v in local.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    x = torch.stack([torch.as_tensor(local[k], dtype=torch.float64, device=device).reshape(()) for k in names])
    return dict(zip(names, all_reduce_sum(x).tolist()))


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's obj, in rank order (a list of one in one process)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def on_rank0(check: Callable[[], Any]) -> None:
    """Run a check on rank 0 only (reading a large checkpoint once, not once per rank) and share its verdict:
    a UserError there is raised on every rank with the same message, so that no rank waits alone."""
    message = None
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            check()
        except UserError as e:
            message = str(e)
    if world_size() > 1:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise UserError(message)


def all_ok(ok: bool) -> bool:
    """True on every rank when ok is True on every rank (an all-reduce): ranks agree before going on."""
    return bool(all_reduce_sum(torch.tensor([0.0 if ok else 1.0])).item() == 0)


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


def check_range(name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False, what: str = "") -> None:  # fmt: skip
    """One flag in [low, high] (open ends where asked), finite; else a UserError naming it and the range."""
    ok = _is_number(value) and (isinstance(value, int) or math.isfinite(value))  # an int of any size is finite
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise UserError(f"{_flag(name)} {value} must be {what or 'a finite number'} in {lo}{low}, {high}{hi}")


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
        (positive, "positive", dict(low=0, low_open=True, what="positive")),
        (non_negative, "non_negative", dict(low=0, what="zero or positive")),
        (probability, "probability", dict(low=0, high=1, low_open=True, what="a probability")),
        (unit, "unit", dict(low=0, high=1, what="a number")),
        (seeds, "seeds", dict(low=0, high=SEED_MAX, what="an integer")),
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
        global _STOP
        self.flag = False
        self.name = ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        _STOP = self

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag, self.name = True, signal.Signals(signum).name

    def should_stop(self) -> bool:
        return not all_ok(not self.flag)


_STOP: StopSignal | None = None  # the run's stop signal (the latest made in this process)
_STOPPABLE: list[str] = []  # what the run is doing that a stop signal cuts short, innermost last


@contextlib.contextmanager
def stoppable(what: str) -> Any:
    """Within it, check_stop() ends the run on a stop signal: work never saved (an evaluation), redone on resume."""
    _STOPPABLE.append(what)
    try:
        yield
    finally:
        _STOPPABLE.pop()


def check_stop() -> None:
    """Raise Stopped if a stop signal arrived inside stoppable(...). One process only: under torchrun a signal may
    reach one rank, and a rank that left alone would leave the others in a collective; there the ranks stop
    together at stop_point()s (and at the step's end)."""
    if not (_STOPPABLE and _STOP is not None and _STOP.flag) or world_size() > 1:
        return
    if signal.getsignal(signal.SIGTERM) == _STOP._handle:  # still the run's handler (not a finished run's)
        raise Stopped(f"stopped by {_STOP.name} during {_STOPPABLE[-1]}")


def stop_point() -> None:
    """check_stop at a point every rank passes the same number of times (a batch of an evaluation or of the Monte
    Carlo measurement, a chunk of DPO's pair sampling): under torchrun the flag is all-reduced there (one tiny
    all-reduce), so a signal that reached one rank stops every rank at the same point, within one batch."""
    if world_size() <= 1:
        check_stop()
    elif _STOPPABLE and _STOP is not None and not all_ok(not _STOP.flag):  # every rank takes the same branch
        who = _STOP.name if _STOP.flag else "a signal on another rank"
        raise Stopped(f"stopped by {who} during {_STOPPABLE[-1]}")


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
        _notice_once(f"step {step}: non-finite {what}; that optimiser step was skipped (nonfinite_skips)")
        return False

    def take_skips(self) -> int:
        """Steps skipped since the last call: the step's nonfinite_skips."""
        n, self.skips = self.skips, 0
        return n


# ------------------------------------------------------------------------------------------------------
# Data parallel (DDP) and sharded (--fsdp, FSDP2) training
# ------------------------------------------------------------------------------------------------------

_FSDP_ROOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a sharded policy or critic -> its FSDP root


def parallelize(model: nn.Module, ref_model: nn.Module | None, dist_: Dist, fsdp: bool) -> nn.Module:
    """The module a trainer calls for its training forward and backward.

    One process: `model` itself. Under torchrun: DDP(model), whose backward averages the gradients over ranks.
    With --fsdp: `model` and `ref_model` (PolicyForward modules) sharded in place with FSDP2
    (torch.distributed.fsdp.fully_shard). Each decoder layer of the policy, the reference and a full critic is
    one unit; a critic is one more; the root, the PolicyForward, holds the rest (embeddings, final norm, the tied
    LM head) and gathers it for its whole forward, the chunked LM head included. Weights, gradients and Adam's
    moments live in shards; on a GPU a unit gathers its weights in bf16 and reduces gradients in fp32.
    Gradients are averaged over ranks as under DDP, so the trainers' losses are the same.
    """
    if fsdp:
        for module in (model, ref_model):
            if module is not None:
                _fsdp_shard(module, dist_.device)
        return model
    if dist_.world == 1:
        return model
    return DDP(model, device_ids=[dist_.local_rank] if dist_.device.type == "cuda" else None)


def _fsdp_shard(module: nn.Module, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FullCritic and MLPHead return a squeezed view; no caller writes into a critic's output in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (world_size(),))
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()  # fp32 on the CPU, as autocast_ctx
    layers = set(getattr(module.lm, "_no_split_modules", None) or ())  # transformers names its decoder layers
    for part in (module.lm, module.critic):
        if part is not None:
            for m in part.modules():
                if type(m).__name__ in layers:
                    fully_shard(m, mesh=mesh, mp_policy=mp)
    if module.critic is not None:
        fully_shard(module.critic, mesh=mesh, mp_policy=mp)
        _FSDP_ROOTS[module.critic] = module
    fully_shard(module, mesh=mesh, mp_policy=mp)
    # FSDP2 makes the first module to run forward the root of its tree; PPO's rollout calls the critic alone
    # before any training forward, so settle the root now (torch 2.13 has no public call for this)
    module._get_fsdp_state()._lazy_init()
    _FSDP_ROOTS[module.lm] = module


def is_sharded(module: nn.Module | None) -> bool:
    """Whether FSDP holds this module's weights in shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return module is not None and any(isinstance(p, DTensor) for p in module.parameters())


def _reshard(module: nn.Module | None) -> None:
    """Put an FSDP root's own weights back in their shards: after a forward without gradients it keeps them
    gathered (the layers reshard themselves). Reading whole weights or saving shards starts from here."""
    root = _FSDP_ROOTS.get(module) if module is not None else None
    if root is not None:
        root.reshard()


def no_sync(model: nn.Module, last_micro: bool) -> contextlib.AbstractContextManager:
    """Gradient accumulation over micro-batches: DDP all-reduces on the minibatch's last micro-batch only
    (no_sync() before it); FSDP reduce-scatters every micro-batch, so that only shards accumulate."""
    if isinstance(model, DDP) and not last_micro:
        return model.no_sync()
    return contextlib.nullcontext()


class FullWeights:
    """The policy with whole weights, for generation: rollouts, Monte Carlo values, evaluation.

    Without FSDP, get() is the policy itself, at no cost. Under --fsdp the rollout engines need whole layers,
    so every rank keeps a plain copy of the model (bf16 on a GPU, fp32 on the CPU) and get() refreshes it from
    the shards, one parameter at a time: an all-gather of the fp32 weights per call, and a whole copy's memory
    on every rank (2 bytes per parameter on a GPU, besides the training shards). Under FSDP get() is a
    collective: every rank calls it at the same point.
    """

    def __init__(self, lm: nn.Module, device: torch.device) -> None:
        self.lm, self.device, self.copy = lm, device, None

    @torch.no_grad()
    def get(self) -> nn.Module:
        if not is_sharded(self.lm):
            return self.lm
        from torch.distributed.tensor import DTensor
        from transformers import AutoModelForCausalLM

        _reshard(self.lm)
        if self.copy is None:
            with torch.device(self.device):
                dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
                self.copy = AutoModelForCausalLM.from_config(self.lm.config, dtype=dtype).eval().requires_grad_(False)
        params, buffers = dict(self.copy.named_parameters()), dict(self.copy.named_buffers())
        for name, p in self.lm.named_parameters():  # the same order on every rank: the all-gathers match
            # cast the shard first: the same bits, half the all-gather's bytes (and memory) for bf16 copies
            params[name].copy_(p.to(params[name].dtype).full_tensor() if isinstance(p, DTensor) else p)
        for name, b in self.lm.named_buffers():  # buffers are not sharded
            buffers[name].copy_(b)
        return self.copy


def autocast_ctx(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on a GPU (fp32 master weights, fp32 log-softmax); plain fp32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def dtype_name(device: torch.device) -> str:
    return "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32"


def count_params(module: nn.Module | None, trainable_only: bool = True) -> int:
    if module is None:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def unwrap(module: nn.Module) -> nn.Module:
    """The plain module under DDP / torch.compile wrappers (never save '_orig_mod.' or 'module.' prefixes)."""
    while True:
        if hasattr(module, "module"):
            module = module.module
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


# ------------------------------------------------------------------------------------------------------
# Notices: a line once per process, on rank 0
# ------------------------------------------------------------------------------------------------------

_NOTICES: set[str] = set()


def _notice_once(message: str) -> None:
    if message not in _NOTICES:
        _NOTICES.add(message)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"note: {message}", file=sys.stderr, flush=True)


# ======================================================================================================
# Logging: settings first, metrics.jsonl per step, TensorBoard scalars, Weights & Biases with --track
# ======================================================================================================


def device_description(device: torch.device, world: int) -> str:
    """'1 x NVIDIA H200' or '2 x cpu (2 cores)': the hardware a results.json was measured on."""
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}"
    return f"{world} x cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


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
        first_row: fields added to metrics.jsonl's first row (the trainers: engine.rollout_record; a resumed
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
                _notice_once(f"{len(later)} metrics row(s) after the checkpoint's step {resume_step} moved to {aside}")
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


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with named_path(path), open(tmp, "w", opener=open_nofollow) as f:  # os.replace replaces a link, not its target
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
