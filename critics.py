"""Critics of selectable capacity for ppo.py (`build_critic(name, hidden_size, policy=None)`), their pretraining on
the frozen starting policy's Monte Carlo returns, and the file that carries a pretrained one to `ppo.py --critic-init`.

A head reads the policy's final hidden state at every token (the same forward as the policy's log-probs,
detached by default so the value loss cannot move the policy) and gives one value per token, V(s_t).
`full` is a separate copy of the policy's transformer with a linear value head: the standard critic of
TRL, OpenRLHF and verl, and the far end of the sweep.

Shapes and trainable parameters (H = hidden size: Qwen2.5-0.5B, the study's model, H = 896; the packaged
SmolLM2-135M H = 576; the tiny test model H = 64). A head of width n has (H + 2) n + 1 parameters:

| name   | shape                               | H = 896     | H = 576     | H = 64    |
|--------|-------------------------------------|-------------|-------------|-----------|
| none   | no critic: REINFORCE, batch mean    | 0           | 0           | 0         |
| small  | MLP H -> 64 -> 1 (two layers)       | 57,473      | 36,993      | 4,225     |
| medium | MLP H -> 512 -> 1 (two layers)      | 459,777     | 295,937     | 33,793    |
| large  | MLP H -> 1024 -> 1 (two layers)     | 919,553     | 591,873     | 67,585    |
| full   | a copy of the policy trunk + H -> 1 | 494,033,665 | 134,515,585 | 3,219,841 |

small < medium < large strictly; large has twice medium's width at the same depth, so 2 x medium - 1 parameters
(591,873 = 2 x 295,937 - 1): every step up in the sweep is a step up in capacity. The last layer of every head
starts at zero, so the first values are 0 (the N implementation details of RLHF with PPO, Huang et al. 2022).

Value pretraining. A critic that starts from zero on a 0/1 reward and a moving policy learns the batch's mean and little
else (the organism study: explained variance between -0.035 and +0.009 in every run). VC-PPO
(https://arxiv.org/abs/2503.01491) and VAPO (https://arxiv.org/abs/2504.05118) pretrain the value on the fixed
starting policy's own rollouts, with Monte Carlo targets, before PPO starts. fit_critic regresses every response state
s_t of a rollout on that rollout's final reward (PPO's value loss with gamma = lambda = 1: 0.5 (V(s_t) - R)^2, a mean
over tokens), the values read as ppo.py's training forward reads them (critic_values: the hidden state at position
P + t - 1, forward.PolicyForward's). The file (save_critic_file, read_critic_record, load_critic_file) is safetensors,
its record in the header (the policy's weights' fingerprint, the sampling, the rollouts, tokens and prompts, the fit),
written atomically, its tensors checked by sha256 when read; load_critic_init is ppo.py's --critic-init (the
refusals, the paid budget, what results.json records).
Does not hold: the rollouts a critic is pretrained on and its learning curve (study/pretrain_critic.py), the Monte
Carlo measurement (measure.py). Imports the plumbing only.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from plumbing import checkpoint, distributed, errors, forward, rollout, rundir

CRITICS = ("none", "small", "medium", "large", "full")
HEAD_WIDTHS = {"small": 64, "medium": 512, "large": 1024}


class MLPHead(nn.Module):
    """Two-layer MLP value head: H -> width -> 1, GELU between, zero-initialised output layer."""

    needs_trunk = False

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden_size, width)
        self.out = nn.Linear(width, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T]
        return self.out(nn.functional.gelu(self.fc(hidden))).squeeze(-1)


class FullCritic(nn.Module):
    """A separate transformer trunk (a copy of the policy's, trained on its own) with a linear value head."""

    needs_trunk = True

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.trunk = copy.deepcopy(policy.model)  # the decoder without the LM head
        self.trunk.requires_grad_(True)
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.head(h).squeeze(-1)  # [B, L]


def build_critic(name: str, hidden_size: int, policy: nn.Module | None = None) -> nn.Module | None:
    """The critic for --critic NAME: None for `none`, a value head, or a full copy of the policy's trunk."""
    if name == "none":
        return None
    if name in HEAD_WIDTHS:
        return MLPHead(hidden_size, HEAD_WIDTHS[name])
    if name == "full":
        if policy is None:
            raise ValueError("the full critic copies the policy's trunk: pass policy=")
        return FullCritic(policy)
    raise ValueError(f"unknown critic {name!r}: choose one of {', '.join(CRITICS)}")


# ======================================================================================================
# Value pretraining: the weights' fingerprint, the fit, the critic file, ppo.py's --critic-init
# ======================================================================================================

FORMAT = "rlvr-critic-init/1"  # the record's "format": a file of another layout is refused, not misread
# What the returns a critic regressed depend on besides the policy: a run that samples otherwise refuses the file
SAMPLING = ("task", "temperature", "max_new_tokens", "prompt_format")


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors, by name in order: each name, dtype, shape and bytes. The same weights give the same
    digest on any machine; a changed bit, name or shape another one."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def model_fingerprint(model: nn.Module) -> str:
    """The policy's identity for a critic file: tensors_sha256 of its state dict as loaded (fp32 master weights)."""
    return tensors_sha256(distributed.unwrap(model).state_dict())


# ======================================================================================================
# The fit: every response state regressed on its rollout's final reward
# ======================================================================================================


def critic_values(
    policy: nn.Module, critic: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_prompt: int
) -> torch.Tensor:
    """V(s_t) at every response state, as ppo.py's training forward gives them, without the log-probs: a head
    reads the frozen policy's final hidden state (no gradient into the policy), the full critic runs its own
    trunk.  [B, P + T] ids and mask -> [B, T] float32, 0 on padding"""
    pos = rollout.position_ids_from_mask(attention_mask)
    rmask = attention_mask[:, n_prompt:].float()
    if getattr(critic, "needs_trunk", False):
        values = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos)[:, n_prompt - 1 : -1]
    else:
        with torch.no_grad():
            hidden = policy.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos)
        values = critic(hidden.last_hidden_state[:, n_prompt - 1 : -1].float())
    return values.float() * rmask


@torch.no_grad()
def response_states(
    policy: nn.Module, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, micro: int
) -> list[torch.Tensor]:
    """The frozen policy's final hidden state at each response state s_0 .. s_{L-1} of each rollout, in
    length-sorted micro-batches of `micro`: what a head reads, computed once for every epoch.  -> N x [L_i, H]"""
    device = next(policy.parameters()).device
    lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)])
    out: list[torch.Tensor | None] = [None] * len(prompts)
    for rows in forward.length_sorted_micro_batches(torch.arange(len(prompts)), lengths, micro):
        rows = rows.tolist()
        ids, mask, P = rollout.join_prompt_response([prompts[i] for i in rows], [responses[i] for i in rows], pad_id)
        ids, mask = ids.to(device), mask.to(device)
        with distributed.autocast_ctx(device):
            hidden = policy.model(input_ids=ids, attention_mask=mask, position_ids=rollout.position_ids_from_mask(mask))
        states = hidden.last_hidden_state[:, P - 1 : -1].float()  # [b, T, H]
        for j, i in enumerate(rows):
            out[i] = states[j, : len(responses[i])].clone()
    return out  # type: ignore[return-value]


def fit_critic(
    critic: nn.Module,
    policy: nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    scores: Sequence[float],
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    seed: int,
    pad_id: int,
    micro: int = 64,
    max_grad_norm: float = 1.0,
    weight_decay: float = 0.0,
    on_epoch: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Fit the critic on rollouts of the frozen policy: every response state regressed on its rollout's score.

    `epochs` passes over the rollouts in a seeded order, minibatches of `batch_size` rollouts, one AdamW step each
    (PPO's optimiser: eps 1e-8, the gradient norm clipped to max_grad_norm), the loss 0.5 (V(s_t) - R)^2 as a
    mean over the minibatch's tokens. A head reads the policy's hidden states, computed once (response_states); the
    full critic runs its trunk on each minibatch, in micro-batches of `micro` rollouts. The policy is not touched.
    on_epoch(epoch, mean loss) after each pass (a progress bar, a stop signal). -> {"losses": per epoch, the mean
    over its tokens before each step; "final_loss": the last; "trained_tokens": response tokens x epochs}"""
    device = next(critic.parameters()).device
    n = len(prompts)
    lengths = torch.tensor([len(r) for r in responses])
    target = torch.tensor(list(scores), dtype=torch.float32)
    needs_trunk = getattr(critic, "needs_trunk", False)
    states = None if needs_trunk else response_states(policy, prompts, responses, pad_id, micro)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=lr, weight_decay=weight_decay, eps=1e-8)
    g = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    critic.train()
    for epoch in range(epochs):
        order = torch.randperm(n, generator=g)
        total, tokens = 0.0, 0
        for rows in order.split(batch_size):
            n_tok = int(lengths[rows].sum())
            if states is not None:  # a head: the states of the minibatch, flat, each with its rollout's score
                h = torch.cat([states[i] for i in rows.tolist()])  # [n_tok, H]
                r = torch.repeat_interleave(target[rows], lengths[rows]).to(device)  # [n_tok]
                loss = 0.5 * ((critic(h).float() - r) ** 2).sum() / max(n_tok, 1)
                loss.backward()
                total += loss.item() * n_tok
            else:
                full = [prompts[i] for i in rows.tolist()], [responses[i] for i in rows.tolist()]
                for sub in forward.length_sorted_micro_batches(torch.arange(len(rows)), lengths[rows] + 0, micro):
                    sub = sub.tolist()
                    ids, mask, P = rollout.join_prompt_response(
                        [full[0][j] for j in sub], [full[1][j] for j in sub], pad_id
                    )
                    ids, mask = ids.to(device), mask.to(device)
                    with distributed.autocast_ctx(device):
                        v = critic_values(policy, critic, ids, mask, P)  # [b, T]
                    r = target[rows[sub]].to(device)[:, None] * mask[:, P:]  # [b, T]
                    sq = 0.5 * ((v - r) ** 2 * mask[:, P:]).sum()
                    (sq / max(n_tok, 1)).backward()
                    total += sq.item()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens += n_tok
        losses.append(total / max(tokens, 1))
        if on_epoch is not None:
            on_epoch(epoch, losses[-1])
    critic.eval()
    return {
        "losses": losses,
        "final_loss": losses[-1] if losses else None,
        "trained_tokens": int(lengths.sum()) * epochs,
    }


# ======================================================================================================
# The critic file: safetensors, its record in the header, written atomically, checked when read
# ======================================================================================================


def save_critic_file(path: Path, critic: nn.Module, record: dict[str, Any]) -> dict[str, Any]:
    """The critic's weights and its record (what it was fitted on, how, on which policy) in one safetensors file,
    written into a temporary file beside it, fsync'ed and renamed into place: a killed save leaves the previous
    file or the new one. The record gains format, capacity's parameter count and the tensors' sha256. -> the
    record as written"""
    from safetensors.torch import save

    tensors = {k: v.detach().cpu().contiguous() for k, v in critic.state_dict().items()}
    record = {
        "format": FORMAT,
        **record,
        "params": sum(t.numel() for t in tensors.values()),
        "tensors_sha256": tensors_sha256(tensors),
    }
    data = save(tensors, metadata={"record": json.dumps(record)})
    path = Path(path)
    rundir.write_bytes_atomic(path, data)
    checkpoint.fsync_dir(path.parent)
    return record


def read_critic_record(path: Path | str, flag: str = "--critic-init") -> dict[str, Any]:
    """The record in a critic file's header, read without its tensors; a file that is missing, not safetensors, or
    without a record of this format is a UserError naming it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise errors.UserError(f"{flag} {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        record = json.loads(meta["record"])
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"its record is not a {FORMAT} record")
    except Exception as e:  # safetensors' own errors, a missing or unreadable record
        raise errors.UserError(f"{flag} {path} is damaged or not a critic file ({type(e).__name__}: {e})") from None
    return record


def load_critic_file(path: Path | str, critic: nn.Module, flag: str = "--critic-init") -> dict[str, Any]:
    """The file's weights into `critic` after its checks: its tensors' sha256 the record's, their names and shapes
    the critic's. -> its record"""
    from safetensors.torch import load_file

    record = read_critic_record(path, flag)
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise errors.UserError(f"{flag} {path} is damaged ({type(e).__name__}: {e})") from None
    if tensors_sha256(tensors) != record.get("tensors_sha256"):
        raise errors.UserError(f"{flag} {path} is damaged: its weights are not the ones its record was written with")
    own = critic.state_dict()
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if shapes != {k: tuple(v.shape) for k, v in own.items()}:
        raise errors.UserError(
            f"{flag} {path} holds weights of another shape than this {record.get('capacity')} critic"
        )
    critic.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()})
    return record


def load_critic_init(args: Any, critic: nn.Module | None, policy: nn.Module) -> dict[str, Any]:
    """ppo.py's --critic-init: the pretrained critic's weights into `critic`, after refusing (one line each) a
    critic file missing or damaged, --critic none, a file of another capacity, of returns sampled otherwise
    (SAMPLING), or of another policy (its fingerprint), and --count-critic-init-tokens without a budget to spend.
    Paid (--count-critic-init-tokens): the pretraining's generated tokens come out of --token-budget, so that
    args.token_budget is what training has left (the loop and the schedule stop there) and the entry keeps the
    budget given. -> {"critic_init": results.json's entry} ({} without --critic-init): the file, its weights' sha256,
    the pretraining's rollouts, tokens, prompts, seed, lr, epochs and final loss, paid or not"""
    path = args.critic_init
    if path is None:
        if args.count_critic_init_tokens:
            raise errors.UserError("--count-critic-init-tokens counts a pretrained critic's tokens: pass --critic-init")
        return {}
    if critic is None:
        raise errors.UserError(f"--critic-init {path} loads a critic, and --critic none has none")
    record = read_critic_record(path)
    if record.get("capacity") != args.critic:
        raise errors.UserError(
            f"--critic-init {path} holds a {record.get('capacity')} critic, not the --critic {args.critic} asked for"
        )
    sampling = record.get("sampling", {})
    if other := [f"--{k.replace('_', '-')} {sampling.get(k)}" for k in SAMPLING if sampling.get(k) != getattr(args, k)]:
        raise errors.UserError(
            f"--critic-init {path} regressed returns sampled with {', '.join(other)}, not this run's: pretrain it "
            "with the run's settings"
        )
    model = record.get("model", {})
    if model.get("fingerprint") != (mine := model_fingerprint(policy)):
        raise errors.UserError(
            f"--critic-init {path} was pretrained on another policy ({model.get('name')}, weights "
            f"{str(model.get('fingerprint'))[:12]}), not this run's --model {args.model} (weights {mine[:12]})"
        )
    tokens = int(record["tokens"])
    entry = {
        "file": str(path),
        "critic_sha256": record["tensors_sha256"],
        "capacity": record["capacity"],
        **{k: record[k] for k in ("rollouts", "tokens", "seed", "lr", "epochs", "batch_size", "final_loss")},
        "prompts": len(record["prompts"]),
        "paid": bool(args.count_critic_init_tokens),
    }
    if args.count_critic_init_tokens:
        if not args.token_budget:
            raise errors.UserError(
                "--count-critic-init-tokens spends the pretraining's tokens from --token-budget: give one"
            )
        if tokens >= args.token_budget:
            raise errors.UserError(
                f"--critic-init {path}'s pretraining generated {tokens:,} tokens, not less than --token-budget "
                f"{args.token_budget:,}: nothing would be left to train on"
            )
        entry["token_budget"] = args.token_budget  # the budget given: pretraining and training together
        args.token_budget -= tokens  # training's share
    load_critic_file(path, critic)
    return {"critic_init": entry}


def init_metrics(init: dict[str, Any]) -> dict[str, Any]:
    """metrics.jsonl's record of --critic-init, on every row, apart from the training's own counts: the pretraining's
    rollouts and generated tokens (nothing without --critic-init)."""
    entry = init.get("critic_init") or {}
    return {f"critic_init/{k}": entry[k] for k in ("rollouts", "tokens") if k in entry}


def build_and_fit(capacity: str, policy: nn.Module, seed: int, **fit: Any) -> tuple[nn.Module, dict[str, Any]]:
    """A critic of `capacity` built as ppo.py builds it (critics.build_critic under the run's seed, on the policy's
    device), then fitted (fit_critic's keyword arguments). -> the critic, fit_critic's report"""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = build_critic(capacity, policy.config.hidden_size, policy)
    critic = critic.to(next(policy.parameters()).device)
    return critic, fit_critic(critic, policy, seed=seed, **fit)
