"""The losses and advantages the three trainers share, and the dealing of rows over ranks.

Each is a small pure function with shape comments and, where it implements a paper, a link to it; each is tested
against a plain loop (tests/test_losses.py). The call sites and the sum of the loss stay inline in each trainer.
Holds: masked statistics, PPO's clipped surrogate and clipped value loss, the token/sequence loss weights, the KL
estimators, GAE (one lambda, or the policy's and the critic's apart), GRPO's group advantages (Dr. GRPO, RLOO), the
DPO and IPO losses, the learning-rate schedules, explained variance, and which rows each rank and each minibatch
takes (the same global rows on one rank or N).
Does not hold: GSM8K, the prompt or the reward (gsm8k.py), the Monte Carlo measurement (measure.py), anything that
runs a model (plumbing/). Imports only the plumbing's rollout (the per-row uniforms), distributed and errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from plumbing import distributed, errors, rollout

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
        s = distributed.all_reduce_sum(s.detach())
    return s[0] / s[1].clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, global_: bool = False) -> torch.Tensor:
    """Unbiased variance of x over mask == 1 (n / (n - 1) correction, as in the N implementation details)."""
    dtype, x, mask = x.dtype, x.detach().double(), mask.double()  # fp64 sums: E[x^2] - E[x]^2 cancels in fp32
    s = torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()])
    if global_:
        s = distributed.all_reduce_sum(s)
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


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's per-token value loss, 0.5 (V - R)^2, with V kept within `clip` of the rollout's values by taking the
    larger of the clipped and unclipped errors (0: no clipping; the N implementation details,
    https://arxiv.org/abs/2403.17031).  [B, T] x3 -> [B, T]"""
    loss = (values - returns) ** 2
    if clip > 0:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clip - returns) ** 2)
    return 0.5 * loss


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
    raise errors.UserError(f"unknown --loss-norm {mode!r}: use token, sequence or constant")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimates of KL(pi || ref) from samples of pi (http://joschu.net/blog/kl-approx.html).

    k1 = log r, k2 = (log r)^2 / 2, k3 = (r' - 1) - log r' with r' = ref / pi (via expm1).  [B, T] x2 -> [B, T]
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # expm1: no cancellation to 0 when the ratio is ~1
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


def gae_decoupled(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float, critic_lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with one lambda for the policy's advantages and another for the critic's value targets (VC-PPO,
    https://arxiv.org/abs/2503.01491; VAPO, https://arxiv.org/abs/2504.05118).  [B, T] x3 -> [B, T] x2

    Returns gae(lam)'s advantages and gae(critic_lam)'s returns. With gamma = critic_lam = 1 the targets are the
    Monte Carlo returns (the sum of the rewards ahead), whatever the critic predicts: a value learned from them is
    not biased by its own errors, as a lambda < 1 target is. With lam == critic_lam this is gae() itself, one pass
    and the same bits.
    """
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    if critic_lam != lam:
        returns = gae(rewards, values, mask, gamma, critic_lam)[1]
    return advantages, returns


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


class BudgetProgress:
    """The share of a token budget spent at each optimiser step: the length of a schedule that follows the budget.

    A run that stops on --token-budget (the head-to-head's, under a step cap of 10x GRPO's steps) does not know its
    steps in advance. Its decay reads the budget instead: at optimiser step k of the training step whose rollouts
    brought the tokens spent from `before` to `before + this`, and whose first optimiser step is `first`, the share
    is (before + this (k - first) / per_step) / budget. With the same tokens every step this is the step schedule of
    the steps the budget takes (tests/test_losses.py). The trainer calls start_step before each update."""

    def __init__(self, budget: int, per_step: int) -> None:
        self.budget, self.per_step = float(budget), max(1, per_step)
        self.before = self.this = 0.0
        self.first = 0

    def start_step(self, before: float, this: float, first: int) -> None:
        self.before, self.this, self.first = float(before), float(this), int(first)

    def __call__(self, step: int) -> float:
        done = min(1.0, max(0.0, (step - self.first) / self.per_step))
        return (self.before + self.this * done) / self.budget


def lr_schedule(
    schedule: str, warmup: int, total: int, progress: Callable[[int], float] | None = None
) -> Callable[[int], float]:
    """The learning-rate multiplier as a function of the optimiser step, for LambdaLR: the choice checked once.
    progress (a BudgetProgress): the decay reads the share of the budget spent instead of the step over total."""
    if schedule not in ("constant", "linear", "cosine"):
        raise errors.UserError(f"unknown --lr-schedule {schedule!r}: use constant, linear or cosine")
    if progress is None:
        return lambda step: lr_factor(step, warmup, total, schedule)
    return lambda step: lr_factor(step, warmup, total, schedule, progress(step))


def lr_factor(step: int, warmup: int, total: int, schedule: str, frac: float | None = None) -> float:
    """The learning-rate multiplier at an optimiser step: linear warmup, then constant, linear or cosine decay over
    the steps after warmup, or over frac, the share of the run done, where the caller knows it (a token budget)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup) if frac is None else frac)
    if schedule == "linear":
        return 1.0 - frac
    return 0.5 * (1.0 + math.cos(math.pi * frac))  # cosine (lr_schedule checked the name)


# ======================================================================================================
# Dealing rows over ranks: the same global rows, whatever the world size
# ======================================================================================================


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


def uniform_rows(
    seed: int, stream: int, first: int, rows: int, steps: int, device: torch.device, block: int = 1024
) -> torch.Tensor:
    """Rows [first, first + rows) of an unbounded table of uniforms, one per (global row, decode step).  -> [rows, steps]

    The table is drawn in blocks of `block` rows, block b from rollout.step_uniforms(seed, b, stream): only the
    blocks these rows touch are drawn, so the memory is in proportion to the rows asked for, not to the table
    (offline DPO's pair sampling over --offline-prompts 1000000), and a row's uniforms depend only on its
    global index: the same samples on one rank or N, chunked one way or another."""
    out = []
    for b in range(first // block, (first + rows - 1) // block + 1 if rows > 0 else first // block):
        u = rollout.step_uniforms(seed, b, stream, block, steps, device)  # [block, steps]
        out.append(u[max(first, b * block) - b * block : min(first + rows, (b + 1) * block) - b * block])
    return torch.cat(out) if out else torch.empty(0, steps, dtype=torch.float64, device=device)


def explained_variance_masked(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over mask == 1 on all ranks, as CleanRL logs it.  [B, T] x3 -> float"""
    var_r = masked_var(returns, mask, global_=True)
    var_e = masked_var(returns - values, mask, global_=True)
    return (1 - var_e / var_r).item() if var_r > 0 else float("nan")
