"""Pretrain critics on the frozen starting policy's rollouts, and measure their learning curve against Monte Carlo.

One pool of rollouts of the frozen policy (its own generation path, the train prompts in a seeded order, the
reward of gsm8k.score), generated in chunks; for each capacity and each number of rollouts n, a critic fitted on the
pool's first n (critics.fit_critic: every response state regressed on its rollout's final reward) and saved as a
file `ppo.py --critic-init` loads (critic-CAPACITY-nN.safetensors, its record in the header). With --measure, each
critic's error on held-out prompts: the last --holdout train prompts are never pretrained on; for --mc-prompts of
them one completion, its prompt state and --mc-states states inside, K = --mc-samples fresh rollouts from each
(measure.mc_values), and measure.baseline_error_by_state's nmse at the prompt, inside and over all states, with a
95% interval over the prompts (intervals.ratio_interval), G* = 1 + 1/nmse with its interval, and the
value_explained_variance ppo.py would log for that critic on those completions; beside them the constant baseline
(the rollouts' mean reward) and the ceiling of a head, the "linear" row: the best linear read-out of the frozen
policy's hidden state, a ridge on the held-out Monte Carlo targets cross-fitted over the prompts in 8 folds (a
completion's values from the fit that never saw its prompt, the penalty chosen inside each fit). curve.json and
curve.csv hold it.

Everything lands in --out and is kept: the same command run again (after a stop signal, a crash, or with more
--rollouts or --critics) reuses every chunk and every fitted critic of the same settings and does only what is
missing; a folder of other settings is refused. --pool-from links another folder's rollouts and held-out Monte Carlo
in (the same sampling settings, checked), so that a curve of the fit's own settings costs only its fits.

    python -m study.pretrain_critic --critics small --rollouts 4096 --out runs/critic-init        # one critic
    python -m study.pretrain_critic --critics small medium large full --rollouts 256 1024 4096 16384 --measure
    python -m study.pretrain_critic --rollouts 4096 --lr 3e-3 --epochs 16 --measure --pool-from OUT --out OUT2

Does not hold: the fit and the critic file (critics.py), the measurement's arithmetic (measure.py), intervals
(intervals.py), the ridge of the linear read-out (study/readout.py), the trainer that uses the critics (ppo.py).
Imports the method's modules, never a trainer.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

if __package__ in (None, ""):  # run as a file (python study/pretrain_critic.py): the repository's modules beside it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm.auto import tqdm

import common
import critics
import gsm8k
import intervals
import measure
from plumbing import cmdline, distributed, errors, forward, generation, models, rollout, rundir, runtime
from study import readout

# The uniform streams of this tool's sampling (rollout.step_uniforms(seed, chunk, stream)): apart from the
# trainers' (0: a step's rollouts, 1: its Monte Carlo measurement), so that no pretraining rollout repeats a
# training one's draws.
POOL_STREAM, HELD_STREAM, MC_STREAM = 2, 3, 4
GROUPS = (2, 4, 8, 16)  # GRPO's group sizes whose leave-one-out nmse, 1/(G-1), the curve is read against


@dataclass
class Args:
    out: str = "runs/critic-pretrain"
    """folder of everything made: rollouts/, critic-CAPACITY-nN.safetensors, heldout/, curve.json and curve.csv"""
    model: str = "organism"
    """the policy, frozen, as ppo.py's --model names it (organism, tiny, qwen2.5-0.5b, a path)"""
    seed: int = 1
    """seed of the sampling, each critic's init and the fit's order (and of --model tiny's weights, as ppo.py's)"""
    critics: tuple[Literal["small", "medium", "large", "full"], ...] = ("small",)
    """the capacities fitted (critics.py)"""
    rollouts: tuple[int, ...] = (4096,)
    """the numbers of rollouts each capacity is fitted on, one critic each: the first n of one pool"""
    task: Literal["gsm8k", "toy"] = "gsm8k"
    """the reward, as ppo.py's --task"""
    prompt_format: Literal["chat", "question", "plain"] = "chat"
    """the prompt, as ppo.py's --prompt-format (the organism's own: question)"""
    data_dir: str | None = None
    """as ppo.py's --data-dir (None: the organism's own task for --model organism, else $GSM8K_DIR, else the hub)"""
    val_size: int = 500
    """as ppo.py's --val-size: the train split's indices are the run's only with the same one"""
    temperature: float = 1.0
    """sampling temperature, as the run's"""
    max_new_tokens: int = 64
    """longest completion, as the run's --max-new-tokens (the organism's CPU preset: 64)"""
    holdout: int = 512
    """the last N train prompts, never pretrained on: --measure's prompts"""
    chunk: int = 256
    """rollouts generated and saved together (a stopped run resumes after the last chunk saved)"""
    lr: float | None = None
    """the fit's learning rate; None: 1e-3 for a head, 1e-4 for the full critic"""
    epochs: int = 4
    """passes of the fit over its rollouts"""
    batch_size: int = 64
    """rollouts per optimiser step of the fit"""
    micro_batch_size: int = 64
    """rollouts per forward (the policy's states for a head, the full critic's trunk)"""
    measure: bool = False
    """measure every critic on the held-out prompts against Monte Carlo: curve.json, curve.csv"""
    pool_from: str | None = None
    """another --out of this tool whose rollouts and held-out Monte Carlo (same sampling settings: checked) this run
    links in rather than makes again, so that only the fits are made: a curve of the fit's own settings (--lr,
    --epochs, --batch-size) on the same rollouts and targets"""
    mc_prompts: int = 512
    """held-out prompts measured (at most --holdout), one completion each"""
    mc_samples: int = 16
    """fresh rollouts per measured state (K)"""
    mc_states: int = 2
    """states drawn inside each measured completion besides its prompt (token-weighted)"""
    mc_chunk: int = 64
    """held-out prompts measured and saved together"""
    device: str = "auto"
    """auto (cuda when present), cpu or cuda"""
    progress: bool = True
    """show tqdm progress bars"""


class _Stop(Exception):
    """A stop signal seen between two saved pieces of work."""


def parse(flags: list[str] | None = None) -> Args:
    """Args from the command line, the model's own settings (the organism's prompt) as defaults; then validate."""
    flags = list(sys.argv[1:] if flags is None else flags)
    default = Args()
    default = dataclasses.replace(
        default, **runtime.model_settings(Args, cmdline.flag_value(flags, "model", default.model))
    )
    args = cmdline.parse(Args, default, flags)
    if models.is_organism(args.model):
        models.check_organism_prompt(args.prompt_format)  # before the organism is copied or built
    runtime.check_ranges(
        args,
        positive=("holdout", "chunk", "epochs", "mc_chunk", "mc_prompts"),
        non_negative=("mc_states",),
    )
    for n in args.rollouts:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise errors.UserError(f"--rollouts {n} must be a positive number of rollouts")
    if not args.rollouts or not args.critics:
        raise errors.UserError("--rollouts and --critics need at least one value each")
    if args.measure and args.mc_samples < 2:
        raise errors.UserError(
            f"--mc-samples {args.mc_samples} must be at least 2 (the noise correction divides by K - 1)"
        )
    if args.measure and args.mc_prompts > args.holdout:
        raise errors.UserError(f"--mc-prompts {args.mc_prompts} exceeds the --holdout {args.holdout} prompts held out")
    if args.pool_from is not None:
        source = Path(args.pool_from)
        if not source.is_dir():
            raise errors.UserError(f"--pool-from {source}: no such folder")
        if source.resolve() == Path(args.out).resolve():
            raise errors.UserError(f"--pool-from {source} is --out itself: name the folder whose pool to reuse")
    args.rollouts = tuple(sorted(set(args.rollouts)))
    args.critics = tuple(dict.fromkeys(args.critics))
    return args


def lr_of(args: Args, capacity: str) -> float:
    return args.lr or (1e-4 if capacity == "full" else 1e-3)


# ======================================================================================================
# Chunks: each saved atomically as it is made, reused by a later run of the same settings
# ======================================================================================================


def save_chunk(path: Path, obj: dict[str, Any]) -> None:
    """torch.save of plain tensors and numbers, written whole or not at all (rundir.write_bytes_atomic)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    rundir.write_bytes_atomic(path, buf.getvalue())


def load_chunk(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise errors.UserError(f"{path} is damaged ({type(e).__name__}: {e}); remove it and run again") from None


def settings_differ(path: Path, settings: dict[str, Any], remedy: str) -> list[str]:
    """The keys whose value in the settings.json at path differs from settings ([] where none does); a damaged
    file is one UserError naming it and the remedy."""
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:
        raise errors.UserError(f"{path} is damaged ({e}); {remedy}") from None
    return sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))


def check_settings(folder: Path, settings: dict[str, Any]) -> None:
    """folder/settings.json written, or, where one is there, the same settings: the chunks beside it are then these
    settings' own. Other settings are refused in one line naming what differs."""
    path = folder / "settings.json"
    if path.is_file():
        if keys := settings_differ(path, settings, f"remove {folder} and run again"):
            raise errors.UserError(
                f"{folder} holds work of other settings ({', '.join(keys)} differ); choose another --out"
            )
        return
    folder.mkdir(parents=True, exist_ok=True)
    rundir.write_json_atomic(path, settings)


def pack(idx: list[int], prompts: list[list[int]], responses: list[list[int]], scores: list[float]) -> dict:
    """Rollouts as flat tensors (torch.load(weights_only=True) reads them back, nothing else)."""
    flat = lambda seqs: torch.tensor([t for s in seqs for t in s], dtype=torch.long)  # noqa: E731
    return {
        "prompt_idx": torch.tensor(idx, dtype=torch.long),
        "prompt_tokens": flat(prompts),
        "prompt_len": torch.tensor([len(p) for p in prompts], dtype=torch.long),
        "response_tokens": flat(responses),
        "response_len": torch.tensor([len(r) for r in responses], dtype=torch.long),
        "scores": torch.tensor(scores, dtype=torch.float64),
    }


def unpack(d: dict) -> tuple[list[int], list[list[int]], list[list[int]], list[float]]:
    def split(tokens: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
        return [t.tolist() for t in tokens.split(lengths.tolist())]

    return (
        d["prompt_idx"].tolist(),
        split(d["prompt_tokens"], d["prompt_len"]),
        split(d["response_tokens"], d["response_len"]),
        d["scores"].tolist(),
    )


def chunk_prompts(n: int, seed: int, chunk: int, size: int) -> list[int]:
    """Chunk `chunk`'s prompts: the seeded order of the n pretraining prompts (gsm8k.PromptSampler, a permutation
    per epoch), positions chunk x size onward."""
    sampler = gsm8k.PromptSampler(n, seed)
    for _ in range(chunk):
        sampler.next(size)
    return sampler.next(size)


# ======================================================================================================
# The work: the pool, the fits, the held-out measurement, the curve
# ======================================================================================================


class Work:
    """The frozen policy and what is made from it in --out."""

    def __init__(self, args: Args, device: torch.device) -> None:
        self.args, self.device, self.out = args, device, Path(args.out)
        self.show = args.progress
        self.splits = gsm8k.load_gsm8k(args.data_dir, args.val_size, model=args.model)
        self.data = gsm8k.data_record(args.data_dir, self.splits, args.model)
        self.tokenizer = models.load_tokenizer(args.model)
        gsm8k.check_prompt_lengths(self.splits, self.tokenizer, args.prompt_format, args.model, args.max_new_tokens)
        n_train = len(self.splits["train"])
        if args.holdout >= n_train:
            raise errors.UserError(
                f"--holdout {args.holdout} leaves none of the {n_train} train prompts to pretrain on"
            )
        self.n_pre = n_train - args.holdout  # prompts [0, n_pre) pretrain; [n_pre, n_train) are held out
        self.policy = models.load_model(args.model, self.tokenizer, args.seed).to(device).requires_grad_(False)
        self.fingerprint = critics.model_fingerprint(self.policy)
        self.stopper = runtime.StopSignal()
        self.prompt_cache: dict[int, list[int]] = {}
        self.settings = {
            "model": args.model,
            "fingerprint": self.fingerprint,
            "seed": args.seed,
            **{k: getattr(args, k) for k in critics.SAMPLING},
            "val_size": args.val_size,
            "holdout": args.holdout,
            "chunk": args.chunk,
            "data": {k: v for k, v in self.data.items() if k != "folder"},  # the splits' fingerprint, not the path
        }

    def check_stop(self) -> None:
        if self.stopper.flag:
            raise _Stop

    def prompt(self, i: int) -> list[int]:
        if i not in self.prompt_cache:
            q = self.splits["train"][i].question
            self.prompt_cache[i] = gsm8k.encode_prompt(self.tokenizer, q, self.args.prompt_format)
        return self.prompt_cache[i]

    def sample(self, idx: list[int], stream: int, step: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
        """One rollout of each prompt idx from the frozen policy, uniforms (seed, step, stream): prompts, responses,
        scores."""
        a = self.args
        prompts = [self.prompt(i) for i in idx]
        u = rollout.step_uniforms(a.seed, step, stream, len(idx), a.max_new_tokens, self.device)
        with runtime.stoppable("the frozen policy's rollouts"):
            ro = generation.generate(
                self.policy, prompts, max_new_tokens=a.max_new_tokens, eos_id=self.tokenizer.eos_token_id,
                pad_id=self.tokenizer.pad_token_id, uniforms=u, temperature=a.temperature, top_p=1.0,
            )  # fmt: skip
        texts, ids = rollout.decode_responses(self.tokenizer, ro)
        scores = gsm8k.score(a.task, texts, ids, [self.splits["train"][i].gold for i in idx])
        return prompts, ids, scores

    def heldout_settings(self) -> dict[str, Any]:
        a = self.args
        return {**self.settings, "mc_samples": a.mc_samples, "mc_states": a.mc_states, "mc_chunk": a.mc_chunk}

    def link_pool(self, source: Path) -> None:
        """--pool-from: source's rollouts/ and heldout/ linked into --out (a hard link each, a copy where the file
        system has none; a file already here is kept), after checking that they were made with this run's sampling
        settings (another's are refused in one line, before anything is linked). Only the fits are then made here."""
        parts = {"rollouts": self.settings, "heldout": self.heldout_settings()}
        for sub, settings in parts.items():
            path = source / sub / "settings.json"
            if not path.is_file():
                continue  # none of it made there: made here
            if keys := settings_differ(path, settings, "make it again there, or name another --pool-from"):
                raise errors.UserError(
                    f"--pool-from {source}: its {sub} were made with other settings ({', '.join(keys)} differ)"
                )
        linked = 0
        for sub in parts:
            files = sorted((source / sub).glob("chunk-*.pt"))
            if not files:
                continue
            (self.out / sub).mkdir(parents=True, exist_ok=True)
            for f in [source / sub / "settings.json", *files]:
                if not (target := self.out / sub / f.name).exists():
                    try:
                        os.link(f, target)
                    except OSError:
                        shutil.copy2(f, target)
                    linked += f.name != "settings.json"
        print(f"pool: {linked} chunks of rollouts and held-out Monte Carlo linked from {source}", flush=True)

    # --- the pool ------------------------------------------------------------------------------------------

    def pool(self, n: int) -> dict[str, Any]:
        """The pool's first n rollouts or more (whole chunks), each chunk made once and saved."""
        a, folder = self.args, self.out / "rollouts"
        check_settings(folder, self.settings)
        chunks = -(-n // a.chunk)
        idx, prompts, responses, scores, seconds = [], [], [], [], 0.0
        made = 0
        bar = tqdm(total=chunks, desc="rollouts", unit="chunk", disable=not self.show)
        for c in range(chunks):
            path = folder / f"chunk-{c:05d}.pt"
            if path.is_file():
                d = load_chunk(path)
            else:
                t0 = time.time()
                want = chunk_prompts(self.n_pre, a.seed, c, a.chunk)
                d = pack(want, *self.sample(want, POOL_STREAM, c))
                d["seconds"] = time.time() - t0
                save_chunk(path, d)
                made += 1
            i, p, r, s = unpack(d)
            idx, prompts, responses, scores = idx + i, prompts + p, responses + r, scores + s
            seconds += float(d.get("seconds", 0.0))
            bar.update(1)
            self.check_stop()
        bar.close()
        tokens = sum(len(x) for x in responses)
        made_now = f"{made} chunk{'s' * (made != 1)} made now, {chunks - made} reused"
        print(f"rollouts: {len(idx):,} of the frozen policy ({made_now}), "
              f"{tokens:,} tokens, mean reward {sum(scores) / len(scores):.3f}, {seconds:.0f} s generating "
              f"({len(idx) / max(seconds, 1e-9):.0f} rollouts/s)", flush=True)  # fmt: skip
        return {"idx": idx, "prompts": prompts, "responses": responses, "scores": scores, "seconds": seconds}

    # --- the fits ------------------------------------------------------------------------------------------

    def critic_path(self, capacity: str, n: int) -> Path:
        return self.out / f"critic-{capacity}-n{n}.safetensors"

    def fit(self, capacity: str, n: int, pool: dict[str, Any]) -> dict[str, Any]:
        """critic-CAPACITY-nN.safetensors, fitted on the pool's first n rollouts, or the one there (of these fit
        settings: others are refused). -> its record"""
        a, path = self.args, self.critic_path(capacity, n)
        want = {"lr": lr_of(a, capacity), "epochs": a.epochs, "batch_size": a.batch_size, "seed": a.seed}
        if path.is_file():
            record = critics.read_critic_record(path, "--out")
            if (had := {k: record.get(k) for k in want}) != want:
                raise errors.UserError(f"{path} was fitted with {had}, not {want}; choose another --out")
            return record
        bar = tqdm(total=a.epochs, desc=f"fit {capacity} n={n}", unit="epoch", disable=not self.show)

        def on_epoch(epoch: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            self.check_stop()

        t0 = time.time()
        critic, report = critics.build_and_fit(
            capacity, self.policy, a.seed, prompts=pool["prompts"][:n], responses=pool["responses"][:n],
            scores=pool["scores"][:n], lr=want["lr"], epochs=a.epochs, batch_size=a.batch_size,
            pad_id=self.tokenizer.pad_token_id, micro=a.micro_batch_size, on_epoch=on_epoch,
        )  # fmt: skip
        bar.close()
        record = {
            "capacity": capacity,
            "model": {"name": a.model, "fingerprint": self.fingerprint},
            "sampling": {k: getattr(a, k) for k in critics.SAMPLING},
            "rollouts": n,
            "tokens": sum(len(r) for r in pool["responses"][:n]),
            "mean_reward": sum(pool["scores"][:n]) / n,
            "prompts": sorted(set(pool["idx"][:n])),
            "holdout": {"first": self.n_pre, "count": a.holdout},
            "val_size": a.val_size,
            "data": self.data,
            **want,
            **report,
            "fit_seconds": time.time() - t0,
        }
        return critics.save_critic_file(path, critic, record)

    # --- the held-out measurement ------------------------------------------------------------------------

    def heldout(self) -> dict[str, Any]:
        """For each of --mc-prompts held-out prompts one completion, its states (measure.mc_state_positions) and K
        fresh rollouts from each (measure.mc_values), in chunks of --mc-chunk prompts, each saved once."""
        a, folder = self.args, self.out / "heldout"
        check_settings(folder, self.heldout_settings())
        prompts = list(range(self.n_pre, self.n_pre + a.mc_prompts))
        parts: list[dict] = []
        chunks = -(-len(prompts) // a.mc_chunk)
        bar = tqdm(total=chunks, desc="held-out Monte Carlo", unit="chunk", disable=not self.show)
        for c in range(chunks):
            idx = prompts[c * a.mc_chunk : (c + 1) * a.mc_chunk]
            path = folder / f"chunk-{c:05d}.pt"
            d = load_chunk(path) if path.is_file() else None
            if d is None or d["prompt_idx"].tolist() != idx:  # absent, or a last chunk of fewer prompts
                d = self.measure_chunk(idx, c)
                save_chunk(path, d)
            parts.append(d)
            bar.update(1)
            self.check_stop()
        bar.close()
        rows = [unpack(d) for d in parts]
        out = {
            "idx": [i for r in rows for i in r[0]],
            "prompts": [p for r in rows for p in r[1]],
            "responses": [x for r in rows for x in r[2]],
            "scores": [s for r in rows for s in r[3]],
        }
        offset, rows_of_state = 0, []
        for d in parts:  # each chunk's states name its own completions: made global
            rows_of_state.append(d["row"] + offset)
            offset += len(d["prompt_idx"])
        out["row"] = torch.cat(rows_of_state)
        for key in ("t", "w", "mc", "var", "signal_var"):
            out[key] = torch.cat([d[key] for d in parts])
        # each prompt's K returns at the prompt, for GRPO's measured baseline (a chunk saved before they were kept
        # has none: that measurement is then left out)
        if all("prompt_returns" in d for d in parts):
            out["prompt_returns"] = torch.cat([d["prompt_returns"] for d in parts])
        out["mc_tokens"] = sum(int(d["mc_tokens"]) for d in parts)
        out["seconds"] = sum(float(d["seconds"]) for d in parts)
        return out

    def measure_chunk(self, idx: list[int], c: int) -> dict[str, Any]:
        a, t0 = self.args, time.time()
        prompts, responses, scores = self.sample(idx, HELD_STREAM, c)
        picked = [
            (j, t, w)
            for j, (i, resp) in enumerate(zip(idx, responses))
            for t, w in measure.mc_state_positions(len(resp), a.mc_states, a.seed * 1_000_003 + i)
        ]
        k = a.mc_samples
        u = rollout.step_uniforms(a.seed, c, MC_STREAM, len(picked) * k, a.max_new_tokens, self.device)
        signal = torch.zeros(len(picked), k, dtype=torch.float64)
        with runtime.stoppable("the held-out Monte Carlo measurement"):
            returns, used, _ = measure.mc_values(
                self.policy, self.tokenizer, [prompts[j] for j, _, _ in picked],
                [responses[j][:t] for j, t, _ in picked], [self.splits["train"][idx[j]].gold for j, _, _ in picked],
                task=a.task, k=k, max_new_tokens=a.max_new_tokens, uniforms=u, temperature=a.temperature, top_p=1.0,
                scores_out=signal,
            )  # fmt: skip
        return {
            **pack(idx, prompts, responses, scores),
            "row": torch.tensor([j for j, _, _ in picked], dtype=torch.long),
            "t": torch.tensor([t for _, t, _ in picked], dtype=torch.long),
            "w": torch.tensor([w for _, _, w in picked], dtype=torch.float64),
            "mc": returns.mean(-1),
            "var": returns.var(-1, unbiased=True),
            "prompt_returns": signal[torch.tensor([t == 0 for _, t, _ in picked])].to(torch.uint8),  # [N, K] 0/1
            "signal_var": signal.var(-1, unbiased=True),
            "mc_tokens": used,
            "seconds": time.time() - t0,
        }

    # --- the curve: each critic's error on the held-out states ---------------------------------------------

    @torch.no_grad()
    def values(self, critic: torch.nn.Module, held: dict[str, Any]) -> torch.Tensor:
        """The critic's V(s_t) at every state of the held-out completions.  -> [N, T] on the CPU, 0 on padding"""
        prompts, responses = held["prompts"], held["responses"]
        out = torch.zeros(len(prompts), max(len(r) for r in responses))
        lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)])
        for rows in forward.length_sorted_micro_batches(
            torch.arange(len(prompts)), lengths, self.args.micro_batch_size
        ):
            rows = rows.tolist()
            ids, mask, P = rollout.join_prompt_response(
                [prompts[i] for i in rows], [responses[i] for i in rows], self.tokenizer.pad_token_id
            )
            with distributed.autocast_ctx(self.device):
                v = critics.critic_values(self.policy, critic, ids.to(self.device), mask.to(self.device), P)
            out[rows, : v.shape[1]] = v.float().cpu()
        return out

    def score(self, values: torch.Tensor, held: dict[str, Any]) -> tuple[dict[str, Any], Units]:
        """A baseline's values [N, T] on the held-out completions, measured: measure.baseline_error_by_state over the
        states pooled (the prompt, inside, all), each nmse with its 95% interval over the prompts as units
        (intervals.ratio_interval of the per-prompt sums), G* with its interval, and the explained variance of the
        completions' scores that ppo.py logs as value_explained_variance. -> that record, and the per-prompt sums
        by part (for paired_differences)"""
        k, row, t = self.args.mc_samples, held["row"], held["t"]
        pred = values[row, t]  # [S] the baseline at each measured state
        extra = dict(weights=held["w"], mc_var=held["var"], signal_var=held["signal_var"])
        pooled = measure.baseline_error_by_state(pred, held["mc"], k, t, groups=row, **extra)
        parts = {part: name for part, name in zip(measure.STATE_PARTS, ("all", "prompt", "inside")) if part in pooled}
        units: Units = {name: ([], []) for name in parts.values()}
        for j in range(len(held["prompts"])):  # each prompt's own sums: the units of the interval
            sel = row == j
            own = measure.baseline_error_by_state(
                pred[sel], held["mc"][sel], k, t[sel], **{key: v[sel] for key, v in extra.items()}
            )
            for part, name in parts.items():
                units[name][0].append(own[part]["sum_sq_err_nc"] if part in own else 0.0)
                units[name][1].append(own[part]["sum_signal_var"] if part in own else 0.0)
        out: dict[str, Any] = {}
        for part, name in parts.items():
            e = pooled[part]
            _, lo, hi = intervals.ratio_interval(*units[name])
            out[name] = {
                "nmse": e["nmse"], "nmse_lo": lo, "nmse_hi": hi, "nmse_centred": e["nmse_centred"],
                "within_nmse": e["within_nmse"], "explained_variance": e["explained_variance"], "bias": e["bias"],
                "states": e["n"], "signal_fraction": e["signal_fraction"],
                "g_star": list(intervals.critic_equivalent_group(e["nmse"], lo, hi)),
            }  # fmt: skip
        lengths = torch.tensor([len(r) for r in held["responses"]])
        mask = (torch.arange(values.shape[1])[None, :] < lengths[:, None]).float()  # [N, T]
        scores = torch.tensor(held["scores"], dtype=torch.float32)[:, None] * mask
        out["value_explained_variance"] = common.explained_variance_masked(values, scores, mask)
        return out, units

    def linear_values(self, held: dict[str, Any]) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """The best linear read-out of the frozen policy's hidden state (what a head reads) as a critic's values on
        the held-out completions: a ridge from each measured state's hidden state to its Monte Carlo mean, the
        prompt states and the states inside apart, cross-fitted over the prompts (FOLDS folds by the prompt's
        place: a completion's values come from the fit that never saw its prompt), the penalty chosen inside each
        fit by generalised cross-validation (readout.choose_penalty). -> values [N, T] (0 on padding), each fit's
        penalty per part"""
        prompts, responses, row, t = held["prompts"], held["responses"], held["row"], held["t"]
        states = critics.response_states(
            self.policy, prompts, responses, self.tokenizer.pad_token_id, self.args.micro_batch_size
        )  # N x [L_i, H]
        fold = torch.arange(len(prompts)) % FOLDS
        values = torch.zeros(len(prompts), max(len(r) for r in responses))
        penalties: dict[str, list[float]] = {}
        for part, measured in (("prompt", t == 0), ("inside", t > 0)):
            x = torch.stack([states[j][s] for j, s in zip(row[measured].tolist(), t[measured].tolist())]).double()
            y, unit = held["mc"][measured].double(), row[measured]
            for f in range(FOLDS):
                fit = fold[unit] != f
                if fit.sum() < 3:  # too few states to fit: left at 0
                    continue
                penalty = readout.choose_penalty(x[fit], y[fit])
                penalties.setdefault(part, []).append(penalty)
                predict = readout.ridge(x[fit], y[fit], penalty)
                for j in (fold == f).nonzero().flatten().tolist():
                    where = slice(0, 1) if part == "prompt" else slice(1, len(responses[j]))
                    values[j, where] = predict(states[j][where].double()).float()
        return values, penalties

    def curve(self, pool: dict[str, Any], held: dict[str, Any], records: dict[tuple[str, int], dict]) -> dict:
        a = self.args
        prompt_states = held["t"] == 0
        summary = {
            "prompts": len(held["prompts"]),
            "states": int(len(held["t"])),
            "mc_samples": a.mc_samples,
            "mc_tokens": held["mc_tokens"],
            "seconds": held["seconds"],
            "pass_rate": held["mc"][prompt_states].mean().item(),  # the prompts' mean Monte Carlo value
            "informative_share": (held["signal_var"][prompt_states] > 0).double().mean().item(),
            "mean_p_1_minus_p": held["signal_var"][prompt_states].mean().item(),  # E[p(1-p)], unbiased
        }
        rows, units = [], []

        def add(row: dict[str, Any], values: torch.Tensor) -> None:
            record, sums = self.score(values, held)
            rows.append({**row, **record})
            units.append(sums)

        shape = (len(held["prompts"]), max(map(len, held["responses"])))
        for n in a.rollouts:  # the constant baseline: the mean reward of the pretraining rollouts
            constant = torch.full(shape, sum(pool["scores"][:n]) / n)
            tokens = sum(len(r) for r in pool["responses"][:n])
            add({"capacity": "constant", "rollouts": n, "tokens": tokens}, constant)
        bar = tqdm(total=len(records), desc="measuring critics", disable=not self.show)
        for (capacity, n), record in records.items():
            with torch.random.fork_rng(devices=[]):
                critic = critics.build_critic(capacity, self.policy.config.hidden_size, self.policy)
            critic = critic.to(self.device).eval()
            critics.load_critic_file(self.critic_path(capacity, n), critic, "--out")
            fit = {k: record[k] for k in ("tokens", "lr", "epochs", "batch_size", "final_loss", "fit_seconds")}
            add({"capacity": capacity, "rollouts": n, **fit}, self.values(critic, held))
            bar.update(1)
        bar.close()
        values, penalties = self.linear_values(held)  # the ceiling of a head: the best linear read-out, honest
        add({"capacity": "linear", "rollouts": None, "folds": FOLDS, "penalties": penalties}, values)
        paired_differences(rows, units)
        return {
            "settings": {**self.settings, "data": self.data, **{k: getattr(a, k) for k in ("mc_samples", "mc_states")}},
            "heldout": summary,
            "grpo_prompt_nmse": {str(G): intervals.group_nmse(G) for G in GROUPS},
            "grpo_prompt_measured": grpo_measured(held.get("prompt_returns")),
            **card(a.model),  # the organism's card (its build's report), where --model names one
            "rows": rows,
        }


def card(model: str) -> dict[str, Any]:
    """{"organism": its organism.json's settings and report} where --model names an organism, else {}: the curve
    says which policy it measured (parameters, the task's knobs, build time, greedy accuracy, pass rate)."""
    if not models.is_organism(model):
        return {}
    info = models.organism_info(model)
    return {"organism": {"name": model, "settings": info["settings"], "report": info["report"],
                         "weights_sha256": info["sha256"]["model/model.safetensors"]}}  # fmt: skip


def grpo_measured(returns: torch.Tensor | None) -> dict[str, dict[str, float]]:
    """GRPO's leave-one-out baseline at the held-out prompts, measured on their Monte Carlo returns
    (measure.group_mean_error) at each G of GROUPS that K allows (K >= G + 1): {G: nmse, its 95% interval over the
    prompts}. Binary rewards make it 1/(G - 1) in expectation: the measurement checks the formula on the policy's
    own prompts, and puts GRPO's line on the critics' scale with the same held-out noise. None: no returns kept."""
    if returns is None:
        return {}
    out = {}
    for G in GROUPS:
        if returns.shape[1] < G + 1:
            continue
        err, scale = measure.group_mean_error(returns.float(), G, seed=G)
        nmse, lo, hi = intervals.ratio_interval(err.tolist(), scale.tolist())
        out[str(G)] = {"nmse": nmse, "nmse_lo": lo, "nmse_hi": hi, "prompts": int(returns.shape[0])}
    return out


# ======================================================================================================
# Against the references: the linear read-out's folds, each row's paired differences
# ======================================================================================================

# the linear read-out's cross-fitting over the held-out prompts: each fit sees 7/8 of them. With 2 folds (256 prompts a
# fit at the study's 512) the organism's read-out at the prompt finds no penalty that beats the mean, with 8 it reads
# nmse 0.232 (the probe, a ridge on 1,024 prompts: 0.214-0.231)
FOLDS = 8


Units = dict[str, tuple[list[float], list[float]]]  # part of the states -> per-prompt (error sums, signal sums)


def paired_differences(rows: list[dict[str, Any]], units: list[Units]) -> None:
    """Each row's nmse less the constant baseline's at the same rollouts ("vs_constant") and less the linear
    read-out's ("vs_linear"), per part of the states, with its paired 95% interval over the held-out prompts
    (intervals.ratio_difference_interval: both sides measured on the same prompts against the same Monte Carlo
    means, whose noise cancels in the difference; two rows' own intervals carry it twice). Written into
    row[part] as [d, lo, hi], negative where the row reads less than the reference; a row is not compared with
    itself, and the linear row (no rollouts) has no constant to pair with. rows[i]'s sums are units[i]."""
    constant = {r["rollouts"]: u for r, u in zip(rows, units) if r["capacity"] == "constant"}
    linear = next((u for r, u in zip(rows, units) if r["capacity"] == "linear"), None)
    for row, own in zip(rows, units):
        refs = {"vs_constant": None if row["capacity"] == "constant" else constant.get(row["rollouts"]),
                "vs_linear": None if row["capacity"] == "linear" else linear}  # fmt: skip
        for key, ref in refs.items():
            for part in own:
                if ref is None or part not in row or part not in ref:
                    continue
                row[part][key] = list(intervals.ratio_difference_interval(*own[part], *ref[part], paired=True))


# ======================================================================================================
# Files out: curve.json and curve.csv, written atomically
# ======================================================================================================


def finite_or_none(x: Any) -> Any:
    """nan -> None (null in JSON: a statistic of nothing); infinity stays (G*'s open upper end)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite_or_none(v) for v in x]
    return x


CSV_PARTS = ("prompt", "inside", "all")


def csv_text(rows: list[dict[str, Any]]) -> str:
    """One line per (capacity, rollouts): nmse with its interval, G* with its interval, at each part of the states."""
    head = ["capacity", "rollouts", "tokens", "lr", "epochs", "final_loss", "value_explained_variance"]
    for part in CSV_PARTS:
        head += [f"{part}_{k}" for k in ("nmse", "nmse_lo", "nmse_hi", "g_star", "g_star_lo", "g_star_hi",
                                          "nmse_centred", "explained_variance", "states")]  # fmt: skip
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for r in rows:
        line = [r.get(k) for k in head[:7]]
        for part in CSV_PARTS:
            p = r.get(part, {})
            g = p.get("g_star", [None] * 3)
            line += [p.get("nmse"), p.get("nmse_lo"), p.get("nmse_hi"), *g, p.get("nmse_centred"),
                     p.get("explained_variance"), p.get("states")]  # fmt: skip
        w.writerow(["" if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in line])
    return buf.getvalue()


def show(value: Any, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def main() -> None:
    args = parse()
    dist_ = distributed.setup_distributed(args.device)
    settings = dataclasses.asdict(args)
    print("pretrain_critic.py: critics fitted on the frozen policy's Monte Carlo returns", flush=True)
    for key in ("out", "model", "seed", "critics", "rollouts", "task", "prompt_format", "temperature",
                "max_new_tokens", "val_size", "holdout", "chunk", "lr", "epochs", "batch_size", "measure"):  # fmt: skip
        print(f"  {key}: {settings[key]}" + (" (1e-3 a head, 1e-4 the full critic)" if key == "lr" and args.lr is None
                                              else ""), flush=True)  # fmt: skip
    if args.measure:
        print(f"  measure: {args.mc_prompts} held-out prompts x (1 + {args.mc_states} states) x K = {args.mc_samples}")
    runtime.release_run_lock()
    runtime.RUN.lock = rundir.RunLock(Path(args.out), flag="--out", who="a critic pretraining").acquire()
    work = Work(args, dist_.device)
    if args.pool_from is not None:
        work.link_pool(Path(args.pool_from))
    try:
        pool = work.pool(max(args.rollouts))
        records = {}
        for capacity in args.critics:
            for n in args.rollouts:
                records[capacity, n] = r = work.fit(capacity, n, pool)
                print(f"critic {capacity} n={n}: final loss {r['final_loss']:.4f} (lr {r['lr']:g}, {r['epochs']} "
                      f"epochs), {r['tokens']:,} tokens -> {work.critic_path(capacity, n)}", flush=True)  # fmt: skip
                work.check_stop()
        if args.measure:
            held = work.heldout()
            curve = finite_or_none(work.curve(pool, held, records))
            rundir.write_json_atomic(work.out / "curve.json", curve)
            rundir.write_bytes_atomic(work.out / "curve.csv", csv_text(curve["rows"]).encode())
            h = curve["heldout"]
            print(f"held out: {h['prompts']} prompts, {h['states']} states, pass rate {h['pass_rate']:.3f}, "
                  f"informative {h['informative_share']:.2f}, E[p(1-p)] {h['mean_p_1_minus_p']:.3f}, "
                  f"{h['seconds']:.0f} s of Monte Carlo", flush=True)  # fmt: skip
            for r in curve["rows"]:
                p = r.get("prompt", {})
                g = p.get("g_star", [None] * 3)
                print(f"  {r['capacity']:>8} n={r['rollouts'] or '-':<6} nmse at the prompt {show(p.get('nmse'))} "
                      f"[{show(p.get('nmse_lo'))}, {show(p.get('nmse_hi'))}], G* {show(g[0], 1)} "
                      f"[{show(g[1], 1)}, {show(g[2], 1)}], inside {show(r.get('inside', {}).get('nmse'))}, "
                      f"value_explained_variance {show(r['value_explained_variance'])}", flush=True)  # fmt: skip
            print(f"curve: {work.out / 'curve.json'}, {work.out / 'curve.csv'}", flush=True)
    except (_Stop, errors.Stopped):
        print(f"\nstopped by {work.stopper.name or 'a signal'}: everything saved in {args.out} is kept; run the "
              "same command again to continue", flush=True)  # fmt: skip


if __name__ == "__main__":
    runtime.run_main(main)
