"""Processes and devices: torchrun's ranks, the collectives, DDP and FSDP2, whole-weight copies, autocast.

Holds: Dist and setup_distributed (nanoGPT style: one process when torchrun is absent; NCCL on GPUs, gloo on the
CPU), the collectives the trainers use (named sums reduced once a step, gathers, rank 0's verdict shared), DDP or
FSDP2 around the training forward (parallelize, no_sync), FullWeights (the whole policy for generation under
--fsdp), autocast and the dtype, parameter counts, unwrap, and the hardware a result was measured on.
Does not hold: a run's state or its errors' lines (runtime.py), checkpoints (checkpoint.py). Imports only errors.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from plumbing.errors import UserError


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


def reshard(module: nn.Module | None) -> None:
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

        reshard(self.lm)
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


def device_description(device: torch.device, world: int) -> str:
    """'1 x NVIDIA H200' or '2 x cpu (2 cores)': the hardware a results.json was measured on."""
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}"
    threads = torch.get_num_threads()
    return f"{world} x cpu ({os.cpu_count()} cores, {threads} thread{'s' if threads != 1 else ''})"
