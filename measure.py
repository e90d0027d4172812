"""The Monte Carlo measurement: how wrong a baseline is at the states its update uses (docs/measurement.md).

At each measured state s a baseline predicts b(s); K fresh rollouts from s give the Monte Carlo mean p_hat(s) of the
return. monte_carlo() picks the states (the prompt and M token-weighted states inside each measured completion,
as VinePPO does: https://arxiv.org/abs/2410.01679), runs the rollouts (mc_values) and hands (b, p_hat) to
baseline_error(), which scales the baseline's noise-corrected error by the reward's own variance there (nmse), raw,
centred (what whitening removes) and within prompts, split by state (the prompt, inside); the sums pool over
measurements and seeds before any ratio.
Does not hold: the baselines themselves (the critic in ppo.py, the group mean in grpo.py), intervals over seeds
(intervals.py), the report's tables (study/report.py). Imports common.py, gsm8k.py (the reward) and the plumbing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import common
import gsm8k
from plumbing import distributed, errors, generation, rollout, runtime

# ======================================================================================================
# Which prompts are measured: the same ones on one rank or N
# ======================================================================================================


def measured_prompts(n: int, measured: int, rank: int, world: int) -> list[int]:
    """Which of this rank's n / world prompts the Monte Carlo measurement takes: `measured` prompts spread
    evenly over the global batch of n (global position j * n // measured), the same ones on one rank or N.
    Returns positions within this rank's share; `measured` must divide by world."""
    lo, _ = common.shard_range(n, rank, world)
    per = measured // world
    return [j * n // measured - lo for j in range(rank * per, (rank + 1) * per)]


# ======================================================================================================
# Advantage-error metrics: how wrong a baseline is, against Monte Carlo estimates
# ======================================================================================================
#
# The measurement (docs/measurement.md): at each measured state s a baseline predicts b(s); K fresh rollouts from s
# give the Monte Carlo mean p_hat(s) of the return. measure.monte_carlo picks the states, runs the rollouts and hands
# (b, p_hat) to measure.baseline_error, which scales the baseline's error by the reward's own variance there.


def mc_state_positions(length: int, states: int, seed: int) -> list[tuple[int, float]]:
    """The measured states of one completion of `length` tokens, as (t, weight): t tokens of it already written.

    The prompt state (t = 0, the baseline of the first token) with weight 1, then `states` distinct positions
    drawn uniformly from 1..length-1, each weighted (length - 1) / drawn: the weights sum to `length`, so that
    pooled over completions every token counts once, as in a token-mean loss (with gamma = lambda = 1 the
    advantage of token t is R - V(s_t)). A completion shorter than states + 1 tokens gives all its positions.
    """
    inside = list(range(1, length))
    if len(inside) > states:
        inside = sorted(random.Random(seed).sample(inside, states))
    w = (length - 1) / len(inside) if inside else 0.0
    return [(0, 1.0)] + [(t, w) for t in inside]


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
    penalty: Any = None,
    buckets: int = 2,
    scores_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, int]:
    """The returns of k fresh rollouts from each state (prompt + response prefix).  -> [N, k], used, generated

    A state whose prefix holds t response tokens has max_new_tokens - t left, as the policy had: its rollouts
    are cut there and only those tokens count (`used`). The states are generated in up to `buckets` batches of
    similar budget, each batch for its largest budget (`generated`: what the engine ran, cut-off tokens too).
    The reward reads the whole completion (prefix + continuation). uniforms: [N * k, >= max_new_tokens].
    penalty(rollout, used_lengths [B]) -> [B]: a shaped part of the return to subtract (PPO's KL in the reward).
    scores_out: [N, k], filled (when given) with the verifier's scores before the penalty: the 0/1 outcome whose
    variance is the reward's own (baseline_error's signal_var).
    """
    n = len(prompts)
    budget = [max_new_tokens - len(x) for x in prefixes]  # [N] tokens each state may still write
    order = sorted(range(n), key=lambda i: -budget[i])
    per = -(-n // max(1, buckets)) if n else 1
    returns = torch.zeros(n, k, dtype=torch.float64)
    used_total = generated = 0
    batches = [order[b0 : b0 + per] for b0 in range(0, n, per)]
    for b in range(max(1, buckets)):  # as many passes on every rank: stop_point is a collective under torchrun
        runtime.stop_point()
        if b >= len(batches):
            continue
        states = batches[b]
        rows = [i * k + j for i in states for j in range(k)]  # rows of the uniform table, k per state
        ro = generation.generate(
            model,
            [list(prompts[i]) + list(prefixes[i]) for i in states for _ in range(k)],
            max_new_tokens=budget[states[0]],
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            uniforms=uniforms[rows],
            temperature=temperature,
            top_p=top_p,
        )
        lengths = ro.lengths.cpu()
        used = torch.tensor([min(int(lengths[r]), budget[states[r // k]]) for r in range(len(rows))])  # [b * k]
        ids = [
            list(prefixes[states[r // k]]) + row[: int(u)]
            for r, (row, u) in enumerate(zip(ro.response_ids.tolist(), used))
        ]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        scores = torch.tensor(
            gsm8k.score(task, texts, ids, [golds[states[r // k]] for r in range(len(rows))]), dtype=torch.float64
        )
        if scores_out is not None:
            scores_out[torch.tensor(states)] = scores.view(len(states), k).to(scores_out.dtype)
        if penalty is not None:
            scores = scores - penalty(ro, used).double().cpu()
        returns[torch.tensor(states)] = scores.view(len(states), k)
        used_total += int(used.sum())
        generated += int(lengths.sum())
    return returns, used_total, generated


def baseline_error(
    pred: torch.Tensor,
    mc: torch.Tensor,
    k: int,
    groups: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    mc_var: torch.Tensor | None = None,
    signal_var: torch.Tensor | None = None,
) -> dict[str, float]:
    """How wrong a baseline is, on the scale of the reward's own variance, noise-corrected.  [N] x (2-6) -> dict

    pred: the baseline b_i at each measured state i; mc: the mean p_i of K fresh returns there (K = k); groups:
    the prompt of each state; weights w_i (default 1; measure.mc_state_positions: token weights); mc_var: the
    unbiased sample variance of the K returns (default, for 0/1 rewards: K/(K-1) p_i (1 - p_i)); signal_var: the
    unbiased sample variance s_i^2 of the K 0/1 scores (default mc_var), which differs from mc_var only when the
    return holds a shaped part (PPO's --kl-mode reward: the KL ahead is not the reward's own variance).
    With e_i = b_i - p_i, the MC noise of state i, Var(p_i) = mc_var_i / K =: v_i, W = sum w, and sums over i:

      nmse          = (sum w e^2 - sum w v) / sum w s^2
                      the baseline's MSE against the true value, over E[Var(R | s)]: the share by which it
                      inflates Var(R - b) over a perfect baseline's (0 perfect). The crossover's x axis. A
                      leave-one-out mean of G rollouts reads 1/(G-1) at the prompt state whatever the success
                      rate; at a state inside the completion, where a share d of the outcome's variance is
                      already resolved, its one constant reads (1/(G-1) + d) / (1 - d) (docs/measurement.md).
      nmse_centred  = (sum w (e - e_bar)^2 - (sum w v - sum w^2 v / W)) / sum w s^2,  e_bar = sum w e / W
                      the same after removing the mean error (what whitening removes); the noise share of a
                      centred MSE is (1 - 1/N) of the noise for equal weights.
      within_nmse   = sum over prompts g of (sum_g w (e - e_bar_g)^2 - (sum_g w v - sum_g w^2 v / W_g)) / sum w s^2
                      after removing each prompt's mean error ((1 - 1/m) of the noise for m equal states).
      bias = e_bar;  rmse = sqrt(max(0, (sum w e^2 - sum w v) / W))
      explained_variance = 1 - (centred error variance) / (variance of the true values), both noise-corrected
      signal_fraction: the share of prompts (of states without groups) whose K returns are not all equal
                      (0 < p < 1 for 0/1 rewards): where a baseline can matter at all.

    Every ratio is of pooled sums, never of roots: the sum_* and count entries let the report (pool_baseline_errors)
    pool measurements and seeds again. Noise terms assume the K returns of a state are independent of the others'.
    """
    e = (pred.double() - mc.double()).flatten()
    p = mc.double().flatten()
    w = torch.ones_like(e) if weights is None else weights.double().flatten()
    var = p * (1 - p) * k / (k - 1) if mc_var is None else mc_var.double().flatten()  # [N] Var(return | s)
    v = var / k  # [N] Var(p_hat)
    s2 = var if signal_var is None else signal_var.double().flatten()  # [N] Var(R | s) of the 0/1 score, unbiased
    W = w.sum()
    sum_e, sum_e2, sum_v, sum_w2v, sum_s2 = (
        (w * e).sum(),
        (w * e * e).sum(),
        (w * v).sum(),
        (w * w * v).sum(),
        (w * s2).sum(),
    )
    centred = sum_e2 - sum_e**2 / W - (sum_v - sum_w2v / W)
    value_var = (w * p * p).sum() - (w * p).sum() ** 2 / W - (sum_v - sum_w2v / W)
    mixed = s2 > 0
    out = {
        "n": float(e.numel()),
        "weight": W.item(),
        "sum_err": sum_e.item(),
        "sum_sq_err_nc": (sum_e2 - sum_v).item(),
        "sum_centred_sq_nc": centred.item(),
        "sum_signal_var": sum_s2.item(),
        "sum_value_var_nc": value_var.item(),
        "noise_var": (sum_v / W).item(),
        "target_mean": ((w * p).sum() / W).item(),
    }
    if groups is not None:
        _, g = torch.unique(groups.flatten().long(), return_inverse=True)
        m = int(g.max()) + 1
        Wg = torch.zeros(m, dtype=e.dtype).index_add_(0, g, w)
        eg = torch.zeros(m, dtype=e.dtype).index_add_(0, g, w * e) / Wg
        noise_g = (
            torch.zeros(m, dtype=e.dtype).index_add_(0, g, w * v)
            - torch.zeros(m, dtype=e.dtype).index_add_(0, g, w * w * v) / Wg
        )
        out["sum_within_sq_nc"] = ((w * (e - eg[g]) ** 2).sum() - noise_g.sum()).item()
        out["groups"] = float(m)
        out["signal_groups"] = float(torch.zeros(m, dtype=e.dtype).index_add_(0, g, mixed.double()).gt(0).sum())
    else:
        out["groups"], out["signal_groups"] = float(e.numel()), float(mixed.sum())
    out.update(baseline_error_ratios(out))
    return out


# The states baseline_error_by_state scores apart from all of them: "" (every state, token-weighted), "_prompt"
# (t = 0: what GRPO's group mean estimates) and "_inside" (t > 0, token-weighted). metrics.jsonl: mc/<name><part>/<key>.
STATE_PARTS = ("", "_prompt", "_inside")


def baseline_error_by_state(
    pred: torch.Tensor,
    mc: torch.Tensor,
    k: int,
    t: torch.Tensor,
    groups: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    mc_var: torch.Tensor | None = None,
    signal_var: torch.Tensor | None = None,
) -> dict[str, dict[str, float]]:
    """baseline_error over every state, over the prompt states (t = 0) and over the states inside (t > 0), keyed by
    STATE_PARTS.  [N] x (4-8) -> {part: dict}; a part with no state is left out.

    Why apart: GRPO's baseline is one constant per completion, a Monte Carlo estimate of the prompt's value. At the
    prompt its leave-one-out mean of G reads nmse = 1/(G-1) whatever p: noise. Inside, it cannot follow V(s_t):
    with d the share of the outcome's variance resolved by s_t, it reads (1/(G-1) + d) / (1 - d): a baseline that
    does not track the value, not a noisier one. A critic is "less noisy" than the group at the prompt, and
    "tracks the value better" inside."""
    t = t.flatten()
    out = {}
    for part, keep in (("", None), ("_prompt", t == 0), ("_inside", t > 0)):
        if keep is not None and not bool(keep.any()):
            continue
        xs = [
            x if x is None or keep is None else x.flatten()[keep]
            for x in (pred, mc, groups, weights, mc_var, signal_var)
        ]
        out[part] = baseline_error(xs[0], xs[1], k, *xs[2:])
    return out


def group_mean_error(returns: torch.Tensor, group: int, draws: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """GRPO's baseline at the prompt measured, not assumed: each prompt's K Monte Carlo returns split at random into
    the G - 1 others of a group (their mean is the leave-one-out baseline one sample of the group sees) and the K -
    G + 1 left (their mean p_hat, independent of it). E[(b - p_hat)^2] = E[(b - p)^2] + Var(p_hat), and the left
    samples' variance / (K - G + 1) estimates Var(p_hat) without bias, so their difference is the baseline's squared
    error with the noise removed, averaged over `draws` random splits. The scale is the prompt's p(1-p), estimated
    without bias by the K returns' variance (K - 1 in the denominator): the ratio of the sums is measure.py's nmse at
    the prompt, 1/(G - 1) in expectation for Bernoulli rewards (intervals.group_nmse): a check of the formula on the
    policy's own prompts. Needs K - G + 1 >= 2.  returns [N, K] (0/1) -> per prompt (squared error, p(1-p)), [N] each"""
    n, k = returns.shape
    left = k - (group - 1)
    if group < 2 or left < 2:
        raise ValueError(f"a group of {group} needs at least {group + 1} Monte Carlo samples a prompt, not {k}")
    g = torch.Generator().manual_seed(seed)
    err = torch.zeros(n, dtype=torch.float64)
    for _ in range(draws):
        r = returns.double().gather(1, torch.argsort(torch.rand(n, k, generator=g), dim=1))  # [N, K] shuffled
        base, rest = r[:, : group - 1].mean(1), r[:, group - 1 :]
        err += (base - rest.mean(1)) ** 2 - rest.var(1, unbiased=True) / left
    return err / draws, returns.double().var(1, unbiased=True)


def baseline_error_ratios(sums: dict[str, float]) -> dict[str, float]:
    """nmse, nmse_centred, within_nmse, bias, rmse, explained_variance, signal_fraction from baseline_error's sums."""
    nan = float("nan")
    W, S = sums.get("weight", 0.0), sums.get("sum_signal_var", 0.0)
    out = {
        "nmse": sums["sum_sq_err_nc"] / S if S > 0 else nan,
        "nmse_centred": sums["sum_centred_sq_nc"] / S if S > 0 else nan,
        "within_nmse": sums["sum_within_sq_nc"] / S if S > 0 and "sum_within_sq_nc" in sums else nan,
        "bias": sums["sum_err"] / W if W > 0 else nan,
        "rmse": math.sqrt(max(0.0, sums["sum_sq_err_nc"] / W)) if W > 0 else nan,
        "explained_variance": 1 - sums["sum_centred_sq_nc"] / sums["sum_value_var_nc"]
        if sums.get("sum_value_var_nc", 0.0) > 0
        else nan,
        "signal_fraction": sums["signal_groups"] / sums["groups"] if sums.get("groups", 0.0) > 0 else nan,
    }
    return out


POOLED_SUMS = (
    "n", "weight", "sum_err", "sum_sq_err_nc", "sum_centred_sq_nc", "sum_signal_var", "sum_value_var_nc",
    "sum_within_sq_nc", "groups", "signal_groups",
)  # fmt: skip


def pool_baseline_errors(measurements: Sequence[dict[str, float]]) -> dict[str, float]:
    """Several baseline_error results (measurements, seeds) as one: their sums added, then the ratios.

    The centred and within-prompt sums stay centred per measurement (whitening acts on each batch apart).
    A sum missing from any measurement (within_nmse without groups) is left out."""
    measurements = [m for m in measurements if m]
    if not measurements:
        return {}
    sums = {key: sum(float(m[key]) for m in measurements) for key in POOLED_SUMS if all(key in m for m in measurements)}
    sums["measurements"] = float(len(measurements))
    return {**sums, **baseline_error_ratios(sums)}


def check_measurement(args: Any, world: int) -> None:
    """The Monte Carlo flags of ppo.py and grpo.py, checked before anything loads (a UserError, one line): K of at
    least 2 (the noise correction divides by K - 1), the measured prompts a positive multiple of the world size and
    at most the batch; --mc-states above a completion's T - 1 inside states is clamped, with a note."""
    if not args.mc_every:
        return
    if args.mc_samples < 2:
        raise errors.UserError(
            f"--mc-samples {args.mc_samples} must be at least 2 (the noise correction divides by K - 1)"
        )
    runtime.check_range("mc_prompts", args.mc_prompts, 0, low_open=True)
    runtime.check_divides("--mc-prompts", args.mc_prompts, world, "the world size")
    if args.mc_prompts > args.batch_size:
        raise errors.UserError(f"--mc-prompts {args.mc_prompts} exceeds --batch-size {args.batch_size}")
    inside = max(0, args.max_new_tokens - 1)
    if args.mc_states > inside:
        runtime.notice_once(
            f"--mc-states {args.mc_states} exceeds the {inside} states inside a completion of --max-new-tokens "
            f"{args.max_new_tokens}: clamped to {inside}"
        )
        args.mc_states = inside


@torch.no_grad()
@runtime.stoppable("the Monte Carlo measurement")  # a stop signal ends the run within a decode step
def monte_carlo(
    model: nn.Module,
    tokenizer: Any,
    *,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    golds: Sequence[str],
    groups: Sequence[int],
    row_ids: Sequence[int],
    baselines: dict[str, torch.Tensor],
    states: int,
    k: int,
    max_new_tokens: int,
    seed: int,
    step: int,
    task: str,
    temperature: float,
    top_p: float,
    penalty: Any = None,
) -> tuple[dict[str, float], int]:
    """The shared Monte Carlo measurement of baselines at token-weighted states of this rank's measured completions.

    prompts, responses, golds, groups (prompt ids), row_ids (global row of each completion: seeds its states):
    the measured completions on this rank. baselines: name -> [R, >= T] the baseline's value at each state t of
    each completion (PPO: its critic's V(s_t); GRPO: the group's mean at every t). Per completion the states of
    mc_state_positions (the prompt, and `states` positions inside); k rollouts from each (mc_values, stream 1 of
    the step's uniforms, indexed by the state's global place); everything gathered over ranks, then baseline_error
    per baseline, over every state and over the prompt states and the states inside apart (baseline_error_by_state;
    nmse's denominator and signal_fraction from the 0/1 scores, before any penalty). Returns {"<name><part>/<key>":
    ...} (part: STATE_PARTS) plus states, informative_states (those whose K 0/1 scores are not all equal: where a
    baseline can matter; the report warns when a run has few) and tokens, and the MC tokens used on all ranks.
    k is at least 2 (check_measurement refuses less before anything loads).
    """
    picked = [
        (i, t, w)
        for i, (resp, rid) in enumerate(zip(responses, row_ids))
        for t, w in mc_state_positions(len(resp), states, seed * 1_000_003 + step * 7_919 + int(rid))
    ]
    counts = distributed.all_gather_objects(len(picked))
    rank = dist.get_rank() if distributed.world_size() > 1 else 0
    first, total = sum(counts[:rank]), sum(counts)
    u = rollout.step_uniforms(seed, step, 1, total * k, max_new_tokens, torch.device("cpu"))[
        first * k : (first + len(picked)) * k
    ]
    scores = torch.zeros(len(picked), k, dtype=torch.float64)  # [S, k] the 0/1 scores, before any penalty
    returns, used, generated = mc_values(
        model,
        tokenizer,
        [prompts[i] for i, _, _ in picked],
        [list(responses[i][:t]) for i, t, _ in picked],
        [golds[i] for i, _, _ in picked],
        task=task,
        k=k,
        max_new_tokens=max_new_tokens,
        uniforms=u.to(next(distributed.unwrap(model).parameters()).device),
        temperature=temperature,
        top_p=top_p,
        penalty=penalty,
        scores_out=scores,
    )
    i_idx, t_idx = torch.tensor([i for i, _, _ in picked]), torch.tensor([t for _, t, _ in picked])
    local = {
        "mc": returns.mean(-1),
        "var": returns.var(-1, unbiased=True),
        "signal_var": scores.var(-1, unbiased=True),  # the reward's own variance: the 0/1 score's, without the KL
        "t": t_idx,
        "w": torch.tensor([w for _, _, w in picked], dtype=torch.float64),
        "group": torch.tensor([int(groups[i]) for i, _, _ in picked]),
        **{f"b/{name}": b.detach().double().cpu()[i_idx, t_idx] for name, b in baselines.items()},
    }
    cat = {key: torch.cat([g[key] for g in distributed.all_gather_objects(local)]) for key in local}
    out: dict[str, float] = {}
    for name in baselines:  # every state, then the prompt states and the states inside apart (STATE_PARTS)
        parts = baseline_error_by_state(
            cat[f"b/{name}"], cat["mc"], k, cat["t"], cat["group"], cat["w"], cat["var"], cat["signal_var"]
        )
        out.update({f"{name}{part}/{key}": v for part, err in parts.items() for key, v in err.items()})
    tokens = distributed.all_reduce_sum(torch.tensor([float(used), float(generated)], dtype=torch.float64)).tolist()
    out["states"], out["tokens"], out["tokens_generated"] = float(total), tokens[0], tokens[1]
    out["informative_states"] = float((cat["signal_var"] > 0).sum())  # states whose K 0/1 scores differ
    return out, int(tokens[0])
