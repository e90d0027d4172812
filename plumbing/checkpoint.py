"""Checkpoints: what a run saves so that --resume continues the same curve, and how it is written and read.

What a checkpoint promises:
- Atomic. run_dir/checkpoint is written into a temporary folder, every file fsync'ed, then renamed into place;
  a run killed at any moment leaves the previous checkpoint or the new one, never half of one (a kill between
  the two renames leaves the previous one as .checkpoint.old-PID, resumed only with --resume-from-backup).
- Data only. Weights in safetensors (policy/ loads with from_pretrained as it stands), the optimiser, scheduler
  and RNG states through torch.save of plain tensors and numbers, read back with torch.load(weights_only=True);
  under --fsdp, torch.distributed.checkpoint shards read through a restricted unpickler. Loading one executes
  nothing it holds.
- Verified before load. manifest.json lists every file with its SHA-256; an unlisted, missing or altered file,
  or a symbolic link, is refused in one line and the checkpoint is left in place. Arguments that change the run
  (all but RESUMABLE_ARGS, and BUDGET_ARGS from a paid PPO run to its amortised twin) must match the checkpoint's args.json.
- The last good one kept. Nothing non-finite is saved; a save that fails on any rank removes its temporary
  folder and leaves the previous checkpoint as it was.

What it does not hold: metrics.jsonl, results.json and DPO's pairs.jsonl (beside it in the run folder); the
data (only the position in it, and its fingerprint: gsm8k.data_record); the reference model (rebuilt from
--model); the code's version. The manifest checks integrity, not origin: it is not signed.
Also here: the checks before a run starts (prepare_run_dir: no symbolic links, no run overwritten, the folder
locked). The folder's names, its lock and link rules are rundir.py's; the collectives distributed.py's.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from plumbing import runtime
from plumbing.distributed import (
    all_ok,
    all_reduce_sum,
    count_params,
    is_sharded,
    on_rank0,
    reshard,
    unwrap,
    world_size,
)
from plumbing.errors import NonFiniteError, RunFinished, UserError, WriteFailed
from plumbing.models import file_sha256
from plumbing.rundir import CHECKPOINT, find_checkpoint, refuse_links, set_aside
from plumbing.runtime import all_finite

# ======================================================================================================
# Checkpoints: one folder per run, written atomically, safetensors, torch.load(weights_only=True)
# ======================================================================================================


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        s = np.random.get_state()
        state["numpy"] = (s[0], torch.from_numpy(s[1].astype("int64")), int(s[2]), int(s[3]), float(s[4]))
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s[0], s[1].numpy().astype("uint32"), s[2], s[3], s[4]))


def save_checkpoint(
    run_dir: Path,
    *,
    policy: nn.Module,
    tokenizer: Any,
    critic: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    args: dict[str, Any],
) -> Path:
    """Write run_dir/checkpoint atomically: a temporary folder, a manifest of SHA-256 sums, then a rename.

    policy/ loads with AutoModelForCausalLM.from_pretrained as it stands; critic.safetensors; optimizer,
    scheduler and RNG states through torch.save of plain tensors and numbers (loaded with weights_only=True);
    state.json holds the step, the data position and the counters; args.json the arguments.

    Call it on every rank; rank 0 writes. Under --fsdp every rank also writes its shards of the policy, the
    critic and the optimizer into dcp/ through torch.distributed.checkpoint (instead of optimizer.pt), and
    policy/ and critic.safetensors are gathered whole onto rank 0, so that they load as without FSDP. The
    ranks agree on success before the rename: a failure on any rank keeps the last good checkpoint and raises
    on every rank.
    """
    _check_finite_before_saving(policy, critic, optimizer, state)
    main = _rank() == 0
    final = run_dir / CHECKPOINT
    tmp = run_dir / f".{CHECKPOINT}.tmp-{_rank0_pid()}"  # one folder for every rank's shards
    error: Exception | None = None
    if main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except Exception as e:
            error = e
    if all_ok(error is None):  # every rank takes part in both all_ok calls, whatever fails where
        try:
            whole = None
            if is_sharded(policy):
                whole = _gather_whole(policy, critic)  # on rank 0's CPU
                _save_shards(tmp / "dcp", policy, critic, optimizer)
            if main:
                _write_checkpoint_files(tmp, policy, tokenizer, critic, optimizer, scheduler, state, args, whole)
        except Exception as e:
            error = e
        except BaseException:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    if not all_ok(error is None):
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # the last good checkpoint stays as it was
        if isinstance(error, (UserError, NonFiniteError)):
            raise error
        raise WriteFailed(_save_failed(run_dir, tmp, error)) from None
    if main:
        # the previous checkpoint is kept under .checkpoint.old-PID until the new one is in place: a crash
        # between the two renames leaves it there, and find_checkpoint() falls back on it
        old = run_dir / f".{CHECKPOINT}.old-{os.getpid()}"
        try:
            if final.exists():
                os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(run_dir)  # the renames themselves reach the disk
        except OSError as e:
            raise WriteFailed(_save_failed(run_dir, tmp, e)) from None
        for aside in run_dir.glob(f".{CHECKPOINT}.old-*"):  # this one, and one a --resume-from-backup came from
            shutil.rmtree(aside, ignore_errors=True)
    if world_size() > 1:
        dist.barrier()  # no rank goes on (or saves again) before the new checkpoint is in place
    return final


def _save_failed(run_dir: Path, tmp: Path, error: Exception | None) -> str:
    """One line for a save that failed, whatever raised it (OSError, torch's RuntimeError, SafetensorError)."""
    why = "it failed on another rank" if error is None else f"{type(error).__name__}: {' '.join(str(error).split())}"
    where = getattr(error, "filename", None) or tmp
    last = find_checkpoint(run_dir)
    kept, then = f"the last good checkpoint ({last}) was left as it was", "continue with --resume"
    if last is None:
        kept, then = "no earlier checkpoint exists", "start the run again"
    return (
        f"could not save the checkpoint in {where} ({why[:300]}); {kept}; free space on that disk (or make "
        f"{run_dir} writable) and {then}"
    )


def _check_finite_before_saving(policy: nn.Module, critic: nn.Module | None, optimizer: Any, state: dict) -> None:
    """Nothing non-finite is ever saved: weights and optimiser state checked on every rank, before any write."""
    tensors = [p.detach() for m in (policy, critic) if m is not None for p in m.parameters()]
    moments = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    verdict = all_reduce_sum(torch.stack([~all_finite(tensors).cpu(), ~all_finite(moments).cpu()]).float()).tolist()
    if any(verdict):
        what = "weights" if verdict[0] else "optimizer state"
        step = state.get("counters", {}).get("step", "?")
        raise NonFiniteError(f"step {step}: non-finite {what}; not saved, the last good checkpoint was left as it was")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def _rank0_pid() -> int:
    box = [os.getpid()]
    if world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _training_modules(policy: nn.Module, critic: nn.Module | None) -> nn.Module:
    """Policy and critic under one module: the keys of a DCP checkpoint ('policy.model...', 'critic...')."""
    return nn.ModuleDict({"policy": policy} if critic is None else {"policy": policy, "critic": critic})


def _gather_whole(policy: nn.Module, critic: nn.Module | None) -> dict[str, Any]:
    """Whole state dicts of a sharded policy and critic, on rank 0's CPU (empty elsewhere). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    reshard(policy)
    tied = {n for n, _ in policy.named_parameters(remove_duplicate=False)} - {n for n, _ in policy.named_parameters()}
    whole = get_model_state_dict(policy, options=options)
    out = {"policy": {k: v for k, v in whole.items() if k not in tied}, "critic": None}  # as save_pretrained
    if critic is not None:
        out["critic"] = get_model_state_dict(critic, options=options)
    return out


def _save_shards(path: Path, policy: nn.Module, critic: nn.Module | None, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    reshard(policy)
    model_state, optim_state = get_state_dict(_training_modules(policy, critic), optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _load_shards(path: Path, policy: nn.Module, critic: nn.Module | None, optimizer: torch.optim.Optimizer) -> None:
    """Load dcp/ into the policy, critic and optimizer, sharded over any number of ranks or whole in one:
    torch.distributed.checkpoint reads each rank's part of every tensor, whatever the sharding it was saved in."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reshard(policy)
    modules = _training_modules(policy, critic)
    model_state, optim_state = get_state_dict(modules, optimizer)
    both = {"model": model_state, "optim": optim_state}
    try:  # read (restricted) before DCP does: its own fallbacks would log tracebacks on the way to a refusal
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # a crafted or damaged pickle can raise anything
        raise UserError(f"checkpoint {path.parent} is refused (dcp/.metadata: {e}); it was left in place") from None
    try:
        dcp.load(
            both,
            storage_reader=_SafeDCPReader(path, metadata),
            planner=_SafeDCPPlanner(),
            no_dist=not (dist.is_available() and dist.is_initialized()),
        )
    except Exception as e:  # DCP wraps a rank's error in a CheckpointException: its .failures hold the causes
        causes = [str(f[0] if isinstance(f, tuple) else f) for f in getattr(e, "failures", {}).values()] + [str(e)]
        why = next((c for c in causes if _DCP_REFUSED in c), None)
        if why is None:
            raise
        raise UserError(f"checkpoint {path.parent} is refused ({why}); it was left in place") from None
    set_state_dict(modules, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])


# torch.distributed.checkpoint pickles its .metadata (plain pickle.load in torch 2.13) and loads its byte
# entries with torch.load(weights_only=False): either runs any code a crafted file names. These read the same
# files with an unpickler that builds only DCP's own metadata classes, and torch.load(weights_only=True).
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


_DCP_REFUSED = "which a checkpoint never holds"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if module == "torch.distributed.checkpoint.metadata":  # its dataclasses and enums, nothing it imports
            import torch.distributed.checkpoint.metadata as meta

            cand = getattr(meta, name, None)
            obj = cand if isinstance(cand, type) and cand.__module__ == module else None
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        elif (module, name) in _DCP_GLOBALS:
            obj = super().find_class(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"dcp/.metadata names {module}.{name}, {_DCP_REFUSED}")
        return obj


def _dcp_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def __init__(self, path: Path, metadata: Any) -> None:
            super().__init__(path)
            self.checked_metadata = metadata  # read by _MetadataUnpickler

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = self.checked_metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader


def _dcp_planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise pickle.UnpicklingError(f"a dcp/ byte entry names code, {_DCP_REFUSED}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner


def _SafeDCPReader(path: Path, metadata: Any) -> Any:  # noqa: N802 (a class, built lazily: DCP imports are slow)
    return _dcp_reader_class()(path, metadata)


def _SafeDCPPlanner() -> Any:  # noqa: N802
    return _dcp_planner_class()()


def _write_checkpoint_files(tmp, policy, tokenizer, critic, optimizer, scheduler, state, args, whole=None) -> None:
    from safetensors.torch import save_file

    if whole is None:
        unwrap(policy).save_pretrained(tmp / "policy", safe_serialization=True)
        critic_state = unwrap(critic).state_dict() if critic is not None else {}
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    else:  # under --fsdp: whole weights gathered on this rank; the optimizer's shards are in dcp/
        unwrap(policy).save_pretrained(tmp / "policy", state_dict=whole["policy"], safe_serialization=True)
        critic_state = whole["critic"] or {}
    tokenizer.save_pretrained(tmp / "policy")
    if critic is not None and count_params(critic, trainable_only=False) > 0:
        save_file({k: v.detach().contiguous().cpu() for k, v in critic_state.items()}, str(tmp / "critic.safetensors"))
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    (tmp / "args.json").write_text(json.dumps(args, indent=2, default=str))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(tmp)): file_sha256(p) for p in files}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    for p in files + [tmp / "manifest.json"]:
        with open(p, "rb") as f:
            os.fsync(f.fileno())


_SHA256_HEX = frozenset("0123456789abcdef")


def verify_checkpoint(path: Path) -> None:
    """The checkpoint is exactly what its manifest lists: manifest.json an object of relative path -> SHA-256,
    every file in the folder listed (an unlisted file is refused, whatever it is), none missing, none altered,
    no symbolic links. Anything else is a UserError, and the checkpoint is left in place.

    This checks integrity, not origin: the manifest is not signed, so anyone can re-hash a folder they edited.
    What makes a checkpoint from someone else safe to load is that nothing in it is executed: safetensors for
    weights, torch.load(weights_only=True) for the rest, and DCP's metadata through a restricted unpickler."""

    def damaged(why: str) -> UserError:
        return UserError(f"checkpoint {path} is damaged ({why}); it was left in place")

    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        raise damaged("no readable manifest.json") from None
    if not isinstance(manifest, dict) or not manifest:
        raise damaged("manifest.json is not an object of file -> SHA-256")
    for rel, digest in manifest.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts or rel == "manifest.json":
            raise damaged(f"manifest.json lists {rel!r}, not a file inside the checkpoint")
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _SHA256_HEX):
            raise damaged(f"manifest.json's entry for {rel} is not a SHA-256")
    present = set()
    for p in path.rglob("*"):
        if p.is_symlink():
            raise damaged(f"{p.relative_to(path)} is a symbolic link")
        if p.is_file() and p != path / "manifest.json":
            present.add(p.relative_to(path).as_posix())
    unlisted = sorted(present - {Path(rel).as_posix() for rel in manifest})
    if unlisted:
        raise damaged(f"{unlisted[0]} is not in the manifest")
    for rel, digest in manifest.items():
        p = path / rel
        if not p.is_file() or file_sha256(p) != digest:
            raise damaged(f"{rel} is missing or altered")


def _read_json_object(path: Path, ckpt: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        out = None
    if not isinstance(out, dict):
        raise UserError(f"checkpoint {ckpt} is damaged ({path.name} is not a JSON object); it was left in place")
    return out


# Arguments that may change between a run and its resume; every other one must match: --total-steps and
# every argument the LR schedule depends on among them. A checkpoint saved with --fsdp resumes with or without it.
RESUMABLE_ARGS = {
    "resume",
    "resume_from_backup",
    "allow_data_change",
    "run_dir",
    "eval_every",
    "save_every",
    "log_every",
    "test_size",
    "progress",
    "fsdp",
}

# A paid PPO run continued as its amortised twin: ppo.py's --count-critic-init-tokens spends a pretrained critic's
# tokens from --token-budget (which the run records less them). Under a constant learning rate nothing in ppo.py reads
# the budget but the stop (warmup counts optimiser steps; the evaluations, the Monte Carlo measurement and the
# minibatches go by step and seed), so the paid run is the amortised one stopped early, step for step, and its
# checkpoint continues into it: these two arguments may then change, from a paid save to an amortised resume, and in
# no other case (a budget changed by mistake, the other direction, another trainer: refused as before). The sweep
# continues each paid run into its twin so (study/twins.py).
BUDGET_ARGS = {"token_budget", "count_critic_init_tokens"}


def paid_to_amortised(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a checkpoint's args (saved) are a paid PPO run's and its resume's (now) that run's amortised twin."""
    constant = saved.get("lr_schedule") == now.get("lr_schedule") == "constant"
    return constant and saved.get("count_critic_init_tokens") is True and now.get("count_critic_init_tokens") is False


def may_differ(key: str, saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether argument key may differ between a checkpoint's args (saved) and its resume's (now)."""
    return key in RESUMABLE_ARGS or (key in BUDGET_ARGS and paid_to_amortised(saved, now))


def _check_state(state: dict[str, Any], path: Path, saved: dict[str, Any]) -> None:
    """Every field a resume reads from state.json, checked: a consistent but wrong state is one line, not a
    traceback (or a run that goes on from a step that never was). The sampler's position against its data is
    checked by gsm8k.PromptSampler.load_state_dict, which knows the data's size."""

    def bad(why: str) -> UserError:
        return UserError(f"checkpoint {path} is damaged (state.json: {why}); it was left in place")

    def count(v: Any) -> bool:  # a non-negative int, never a bool
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    counters = state.get("counters")
    if not isinstance(counters, dict):
        raise bad("no counters object")
    for key in ("step", "generated_tokens", "mc_tokens", "eval_tokens", "wall_time"):
        if key not in counters:
            raise bad(f"counters lack {key!r}")
    for key, v in counters.items():
        ok = (
            (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
            if key == "wall_time"
            else count(v)
        )
        if not ok:
            raise bad(f"counters.{key} is {v!r}, not a {'time' if key == 'wall_time' else 'count'}")
    total = saved.get("total_steps")
    if count(total) and counters["step"] > total:
        raise bad(f"counters.step is {counters['step']}, beyond --total-steps {total}")
    sampler = state.get("sampler")
    if not (isinstance(sampler, dict) and count(sampler.get("epoch")) and count(sampler.get("pos"))):
        raise bad(f"sampler is {sampler!r}, not an epoch and a position")
    if "world" in state and not (count(state["world"]) and state["world"] >= 1):
        raise bad(f"world is {state['world']!r}, not a number of ranks")
    if state.get("test_before") is not None and not isinstance(state["test_before"], dict):
        raise bad(f"test_before is {state['test_before']!r}, not an evaluation")
    if "data" in state and not isinstance(state["data"], dict):  # absent in a checkpoint from before fingerprints
        raise bad(f"data is {state['data']!r}, not a data fingerprint")


def load_checkpoint(
    run_dir: Path,
    *,
    policy: nn.Module,
    critic: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    args: dict[str, Any],
    map_location: torch.device,
) -> dict[str, Any]:
    """Restore everything save_checkpoint wrote; returns state.json. Refuses a damaged checkpoint and one
    whose essential arguments differ from this run's. Call it on every rank.

    A run saved on N ranks resumes on M (the data position and the batches are global): a checkpoint saved
    without FSDP holds everything whole; one saved with --fsdp is resharded by torch.distributed.checkpoint,
    onto FSDP shards or whole modules. The one mapping refused: --fsdp from a checkpoint saved without it."""
    from safetensors.torch import load_file

    path = find_checkpoint(run_dir)
    if path is None:
        raise UserError(f"--resume: no checkpoint in {run_dir}")
    on_rank0(lambda: verify_checkpoint(path))  # hashed once, the verdict shared
    saved = _read_json_object(path / "args.json", path)
    now = json.loads(json.dumps(args, default=str))
    diff = sorted(k for k in set(saved) | set(now) if not may_differ(k, saved, now) and saved.get(k) != now.get(k))
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:4])
        raise UserError(
            f"cannot resume {run_dir}: essential arguments differ ({shown}); the checkpoint was left in place"
        )
    state = _read_json_object(path / "state.json", path)
    _check_state(state, path, saved)
    if paid_to_amortised(saved, now):
        runtime.notice_once(
            f"continuing the paid run of {path} as its amortised twin (without --count-critic-init-tokens): --token-"
            f"budget {saved.get('token_budget')} -> {now.get('token_budget')}, the critic's pretraining no longer spent"
        )
    if (path / "dcp").exists() != (saved.get("fsdp") is True):  # the sharded branch only for an --fsdp save
        raise UserError(
            f"checkpoint {path} is damaged (its args.json says fsdp={saved.get('fsdp')!r} but it "
            f"{'holds' if (path / 'dcp').exists() else 'lacks'} dcp/); it was left in place"
        )
    if saved.get("fsdp") is True:  # saved with --fsdp: reshards onto any number of ranks, with or without FSDP
        _load_shards(path / "dcp", policy, critic, optimizer)
    elif is_sharded(policy):
        raise UserError(
            f"cannot resume {run_dir} with --fsdp: its checkpoint was saved without it (on {state.get('world', 1)} "
            "rank(s)) and holds the optimizer whole, not in shards; resume it without --fsdp, on any number of ranks"
        )
    else:
        weights = load_file(str(path / "policy" / "model.safetensors"), device=str(map_location))
        missing, unexpected = unwrap(policy).load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise UserError(f"checkpoint {path}: policy weights do not match the model ({(missing + unexpected)[:3]})")
        if critic is not None and (path / "critic.safetensors").is_file():
            unwrap(critic).load_state_dict(load_file(str(path / "critic.safetensors"), device=str(map_location)))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return state


# What a run writes before its first checkpoint: a new run refuses a folder that holds one (a run that never saved
# left it), and a resume takes it up. pairs.jsonl: dpo.py's offline pairs, sampled once before the first step.
EARLY_FILES = ("metrics.jsonl", "pairs.jsonl")


def prepare_run_dir(run_dir: Path, resume: bool, is_main: bool, from_backup: bool = False) -> None:
    """A new run needs a folder without a checkpoint; --resume needs one. Nothing is ever overwritten.

    In order: a run folder that is a file is refused, and one that is (or holds) a symbolic link; --resume of a
    finished run (results.json) says so and ends (RunFinished, exit 0) before touching anything; the folder is locked for the life of the run (rank 0;
    a folder in use is refused naming its holder); the leftovers of a killed save (.checkpoint.tmp-*, and
    .checkpoint.old-* beside a checkpoint) are removed; a resume that finds only a set-aside .checkpoint.old-*
    is refused unless --resume-from-backup; a new run that finds what a run writes before its first checkpoint
    (EARLY_FILES) is refused."""
    if run_dir.exists() and not run_dir.is_symlink() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is not a folder (a file of that name exists)")
    refuse_links(run_dir)  # before anything is read or written through one
    if resume and (run_dir / "results.json").exists():
        raise RunFinished(
            f"{run_dir} is finished ({run_dir / 'results.json'} exists): nothing to resume, nothing touched"
        )

    def lock_and_clean() -> None:
        runtime.lock_run_dir(run_dir)
        for tmp in run_dir.glob(f".{CHECKPOINT}.tmp-*"):  # a save killed before its rename
            shutil.rmtree(tmp, ignore_errors=True)
        if (run_dir / CHECKPOINT).is_dir():  # a save killed after its rename, before removing the old one
            for aside in set_aside(run_dir):
                shutil.rmtree(aside, ignore_errors=True)

    on_rank0(lock_and_clean)  # rank 0 locks and cleans; a refusal there stops every rank
    has_ckpt = find_checkpoint(run_dir) is not None
    if resume and not has_ckpt:
        raise UserError(f"--resume: no checkpoint in {run_dir}")
    if resume and not (run_dir / CHECKPOINT).is_dir() and not from_backup:
        aside = find_checkpoint(run_dir)
        raise UserError(
            f"--resume: {run_dir} has no {CHECKPOINT}/, only {aside.name}, the previous checkpoint a save set aside "
            "before it was killed; pass --resume-from-backup to resume from it"
        )
    if not resume and (has_ckpt or (run_dir / "results.json").exists()):
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    for early in EARLY_FILES:  # only a resume reuses them, under the checkpoint's checks
        if not resume and (run_dir / early).exists():
            raise UserError(
                f"{run_dir} holds {early} from a run that never saved a checkpoint; remove it or choose another --run-dir"
            )
