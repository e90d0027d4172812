"""Advantage-error metrics on synthetic data with known answers; the lambda < 1 offset; intervals."""

import math
import random
import statistics

import pytest
import torch

import common
import intervals
import measure
from plumbing import generation, models, rollout

# ------------------------------------------------------------------------------------------------------
# The instrument before measure.baseline_error (report.py's old reading): no trainer uses it now; it stays here
# as the reference the tests below compare the new instrument with.
# ------------------------------------------------------------------------------------------------------


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


def mc_noise(p_hat: torch.Tensor, k: int) -> float:
    """The Monte Carlo target's own variance, unbiased: mean of p(1 - p) / (K - 1) over states.  [N] -> float"""
    return (p_hat.double() * (1 - p_hat.double()) / (k - 1)).mean().item()


def _loop_metrics(pred, target, groups=None):
    """Every metric of advantage_error by plain Python."""
    p, y = [float(v) for v in pred], [float(v) for v in target]
    n = len(p)
    err = [a - b for a, b in zip(p, y)]
    bias = sum(err) / n
    mp, my = sum(p) / n, sum(y) / n
    cov = sum((a - mp) * (b - my) for a, b in zip(p, y))
    var_p, var_y = sum((a - mp) ** 2 for a in p), sum((b - my) ** 2 for b in y)
    var_e = sum((e - bias) ** 2 for e in err) / n
    out = {
        "n": n,
        "mae": sum(abs(e) for e in err) / n,
        "rmse": math.sqrt(sum(e * e for e in err) / n),
        "bias": bias,
        "centred_rmse": math.sqrt(var_e),
        "pearson": cov / math.sqrt(var_p * var_y),
        "explained_variance": 1 - var_e / (var_y / n),
    }
    if groups is not None:
        by = {}
        for g, e in zip(groups, err):
            by.setdefault(int(g), []).append(e)
        sq = sum((e - sum(es) / len(es)) ** 2 for es in by.values() for e in es)
        out["within_group_rmse"] = math.sqrt(sq / n)
    return out


def test_advantage_error_against_loop():
    torch.manual_seed(0)
    target = torch.rand(60)
    pred = target + 0.2 * torch.randn(60) - 0.1
    groups = torch.arange(60) // 4 * 7  # non-contiguous group ids
    got = advantage_error(pred, target, groups)
    expected = _loop_metrics(pred, target, groups)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_advantage_error_known_offset_and_noise():
    g = torch.Generator().manual_seed(1)
    N, c, s = 400_000, 0.5, 0.3
    target = torch.randn(N, generator=g, dtype=torch.float64)
    pred = target + c + s * torch.randn(N, generator=g, dtype=torch.float64)
    m = advantage_error(pred, target)
    assert m["bias"] == pytest.approx(c, abs=0.005)
    assert m["centred_rmse"] == pytest.approx(s, rel=0.01)
    assert m["rmse"] == pytest.approx(math.sqrt(c * c + s * s), rel=0.01)
    assert m["pearson"] == pytest.approx(1 / math.sqrt(1 + s * s), abs=0.005)  # cov 1, Var(pred) 1 + s^2
    assert m["explained_variance"] == pytest.approx(1 - s * s, abs=0.005)  # the offset does not count
    assert "within_group_rmse" not in m


def test_within_group_rmse_removes_group_offsets():
    g = torch.Generator().manual_seed(2)
    groups = torch.arange(4000) // 8  # 500 groups of 8
    target = torch.rand(4000, generator=g, dtype=torch.float64)
    offsets = torch.randn(500, generator=g, dtype=torch.float64)
    m = advantage_error(target + offsets[groups], target, groups)
    assert m["within_group_rmse"] == pytest.approx(0.0, abs=1e-12)
    assert m["centred_rmse"] > 0.5  # the offsets differ between groups
    # plain noise: removing each group's mean error leaves s^2 (G - 1) / G
    s = 0.2
    noisy = advantage_error(target + s * torch.randn(4000, generator=g, dtype=torch.float64), target, groups)
    assert noisy["within_group_rmse"] == pytest.approx(s * math.sqrt(7 / 8), rel=0.03)


def test_mc_noise():
    p = torch.tensor([0.0, 0.25, 0.5, 1.0, 0.75])
    for k in (2, 4, 16):
        expected = sum(float(v) * (1 - float(v)) / (k - 1) for v in p) / len(p)
        assert mc_noise(p, k) == pytest.approx(expected, rel=1e-12)


def test_mc_noise_is_unbiased():
    # the observed MSE of a perfect critic against a K-sample target is, on average, the estimated noise
    g = torch.Generator().manual_seed(3)
    k, n = 8, 100_000
    true_p = torch.rand(n, generator=g, dtype=torch.float64)
    p_hat = (torch.rand(n, k, generator=g, dtype=torch.float64) < true_p[:, None]).double().mean(-1)
    mse = (p_hat - true_p).pow(2).mean().item()
    assert mc_noise(p_hat, k) == pytest.approx(mse, rel=0.02)


def _simulate(p, n, k, g):
    """n states with true value p (a float or [n]), and the mean of k fresh 0/1 returns from each."""
    p = torch.full((n,), p, dtype=torch.float64) if isinstance(p, float) else p
    mc = (torch.rand(n, k, generator=g, dtype=torch.float64) < p[:, None]).double().mean(-1)
    return p, mc


def _old_centred_nc(pred, mc, k):
    """The reading report.py gave before baseline_error: sqrt(max(0, centred RMSE^2 - the full MC noise))."""
    m = advantage_error(pred, mc)
    return math.sqrt(max(0.0, m["centred_rmse"] ** 2 - mc_noise(mc, k)))


@pytest.mark.parametrize("p", [0.02, 0.2, 0.5])
def test_nmse_reads_the_planted_fraction_whatever_the_success_rate(p):
    # a baseline whose error variance is f E[p(1-p)] reads nmse = f at every success rate (the x axis is the critic's)
    g = torch.Generator().manual_seed(10)
    n, k, f = 400_000, 8, 0.3
    truth, mc = _simulate(p, n, k, g)
    pred = truth + math.sqrt(f * p * (1 - p)) * torch.randn(n, generator=g, dtype=torch.float64)
    m = measure.baseline_error(pred, mc, k)
    assert m["nmse"] == pytest.approx(f, abs=0.02)
    assert m["nmse_centred"] == pytest.approx(f, abs=0.02)  # no offset planted
    assert m["bias"] == pytest.approx(0.0, abs=0.002)
    assert m["rmse"] == pytest.approx(math.sqrt(f * p * (1 - p)), rel=0.05)
    assert m["signal_fraction"] == pytest.approx(1 - p**k - (1 - p) ** k, abs=0.005)


def test_a_perfect_baseline_reads_zero_where_the_old_reading_did_not():
    g = torch.Generator().manual_seed(11)
    n, k = 200_000, 8
    truth, mc = _simulate(torch.rand(n, generator=g, dtype=torch.float64), n, k, g)
    m = measure.baseline_error(truth, mc, k)
    assert m["nmse"] == pytest.approx(0.0, abs=0.01)
    assert m["nmse_centred"] == pytest.approx(0.0, abs=0.01)
    assert m["explained_variance"] == pytest.approx(1.0, abs=0.01)
    assert m["rmse"] < 0.03
    # per measurement of 32 states, as a run logs it: the old reading averaged roots and read far above 0
    old, sums = [], []
    for i in range(0, 32 * 400, 32):
        old.append(_old_centred_nc(truth[i : i + 32], mc[i : i + 32], k))
        sums.append(measure.baseline_error(truth[i : i + 32], mc[i : i + 32], k))
    assert statistics.fmean(old) > 0.02
    assert measure.pool_baseline_errors(sums)["nmse_centred"] == pytest.approx(0.0, abs=0.02)


@pytest.mark.parametrize("G", [4, 8])
def test_the_leave_one_out_mean_of_g_reads_one_over_g_minus_one(G):
    g = torch.Generator().manual_seed(12)
    n, k = 100_000, 8
    truth = 0.05 + 0.9 * torch.rand(n, generator=g, dtype=torch.float64)
    rewards = (torch.rand(n, G, generator=g, dtype=torch.float64) < truth[:, None]).double()  # [n, G]
    loo = (rewards.sum(-1) - rewards[:, 0]) / (G - 1)  # the baseline of completion 0: the other G - 1
    _, mc = _simulate(truth, n, k, g)
    m = measure.baseline_error(loo, mc, k)
    assert m["nmse"] == pytest.approx(1 / (G - 1), rel=0.05)
    assert m["nmse"] > 1.05 / G  # not 1/G: the noise of a group mean without the completion's own reward


def test_within_nmse_of_a_perfect_critic_is_zero_and_of_per_prompt_offsets_too():
    # 3 states per prompt, K = 8: the old within_group_rmse read about 0.115 for a perfect critic
    g = torch.Generator().manual_seed(13)
    prompts, m_states, k = 20_000, 3, 8
    n = prompts * m_states
    groups = torch.arange(n) // m_states
    truth, mc = _simulate(torch.rand(n, generator=g, dtype=torch.float64), n, k, g)
    old = advantage_error(truth, mc, groups)["within_group_rmse"]
    assert old > 0.1
    m = measure.baseline_error(truth, mc, k, groups)
    assert m["within_nmse"] == pytest.approx(0.0, abs=0.01)
    offsets = 0.2 * torch.randn(prompts, generator=g, dtype=torch.float64)
    shifted = measure.baseline_error(truth + offsets[groups], mc, k, groups)
    assert shifted["within_nmse"] == pytest.approx(0.0, abs=0.01)  # a per-prompt offset is not within-prompt error
    assert shifted["nmse_centred"] > 0.1
    # unequal token weights: the noise share is still removed exactly on average
    w = torch.rand(n, generator=g, dtype=torch.float64) * 3
    assert measure.baseline_error(truth, mc, k, groups, w)["within_nmse"] == pytest.approx(0.0, abs=0.015)


def test_a_constant_offset_moves_nmse_not_nmse_centred():
    g = torch.Generator().manual_seed(14)
    n, k, c = 100_000, 8, 0.15
    truth, mc = _simulate(torch.rand(n, generator=g, dtype=torch.float64), n, k, g)
    pred = truth + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    a, b = measure.baseline_error(pred, mc, k), measure.baseline_error(pred + c, mc, k)
    signal = a["sum_signal_var"] / a["weight"]  # E[p(1-p)]
    assert b["nmse"] - a["nmse"] == pytest.approx(c * c / signal + 2 * c * a["bias"] / signal, rel=1e-9)
    assert b["nmse_centred"] == pytest.approx(a["nmse_centred"], abs=1e-12)
    assert b["bias"] == pytest.approx(a["bias"] + c, abs=1e-12)


def test_baseline_error_against_a_loop_and_the_pooled_number_against_the_pooled_states():
    g = torch.Generator().manual_seed(15)
    k = 4
    parts = []
    for n in (7, 12, 5):  # three measurements of different sizes
        truth, mc = _simulate(torch.rand(n, generator=g, dtype=torch.float64), n, k, g)
        pred = truth + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
        w = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
        groups = torch.arange(n) // 3
        parts.append((pred, mc, w, groups))
    # a loop over one measurement, by the formulas of the docstring
    pred, mc, w, groups = parts[1]
    e, v, s2 = [], [], []
    for b, p in zip(pred.tolist(), mc.tolist()):
        e.append(b - p)
        s2.append(p * (1 - p) * k / (k - 1))
        v.append(s2[-1] / k)
    w_ = w.tolist()
    W = sum(w_)
    eb = sum(wi * ei for wi, ei in zip(w_, e)) / W
    S = sum(wi * si for wi, si in zip(w_, s2))
    noise = sum(wi * vi for wi, vi in zip(w_, v))
    noise_c = noise - sum(wi * wi * vi for wi, vi in zip(w_, v)) / W
    got = measure.baseline_error(pred, mc, k, groups, w)
    assert got["nmse"] == pytest.approx((sum(wi * ei * ei for wi, ei in zip(w_, e)) - noise) / S, rel=1e-9)
    centred = sum(wi * (ei - eb) ** 2 for wi, ei in zip(w_, e))
    assert got["nmse_centred"] == pytest.approx((centred - noise_c) / S, rel=1e-9)
    within = 0.0
    for gid in set(groups.tolist()):
        idx = [i for i, x in enumerate(groups.tolist()) if x == gid]
        Wg = sum(w_[i] for i in idx)
        eg = sum(w_[i] * e[i] for i in idx) / Wg
        within += sum(w_[i] * (e[i] - eg) ** 2 for i in idx)
        within -= sum(w_[i] * v[i] for i in idx) - sum(w_[i] ** 2 * v[i] for i in idx) / Wg
    assert got["within_nmse"] == pytest.approx(within / S, rel=1e-9)
    assert got["bias"] == pytest.approx(eb, rel=1e-9)
    # pooled over the three: the sums of the parts, not a mean of their ratios
    pooled = measure.pool_baseline_errors([measure.baseline_error(p, m, k, gr, w) for p, m, w, gr in parts])
    cat = [torch.cat(x) for x in zip(*parts)]
    direct = measure.baseline_error(cat[0], cat[1], k, None, cat[2])
    assert pooled["nmse"] == pytest.approx(direct["nmse"], rel=1e-9)
    assert pooled["bias"] == pytest.approx(direct["bias"], rel=1e-9)
    assert pooled["rmse"] == pytest.approx(direct["rmse"], rel=1e-9)
    ratios = [measure.baseline_error(p, m, k, gr, w)["nmse"] for p, m, w, gr in parts]
    assert pooled["nmse"] != pytest.approx(statistics.fmean(ratios), rel=1e-3)
    # centred stays centred per measurement: the pooled centred sum is the sum of the parts' centred sums
    centred_parts = [measure.baseline_error(p, m, k, gr, w)["sum_centred_sq_nc"] for p, m, w, gr in parts]
    assert pooled["nmse_centred"] == pytest.approx(sum(centred_parts) / direct["sum_signal_var"], rel=1e-9)


def test_a_shaped_return_uses_its_own_sample_variance():
    # returns that are not 0/1 (PPO's KL in the reward): the noise is the K returns' sample variance / K
    g = torch.Generator().manual_seed(16)
    n, k = 100_000, 6
    truth = torch.rand(n, generator=g, dtype=torch.float64)
    returns = (torch.rand(n, k, generator=g, dtype=torch.float64) < truth[:, None]).double()
    returns = returns - 0.3 * torch.rand(n, k, generator=g, dtype=torch.float64)  # a penalty with its own noise
    value = truth - 0.15
    m = measure.baseline_error(value, returns.mean(-1), k, mc_var=returns.var(-1))
    assert m["nmse"] == pytest.approx(0.0, abs=0.01)


def test_mc_state_positions_are_token_weighted():
    for length, states in ((1, 2), (2, 2), (3, 2), (50, 2), (50, 7)):
        pos = measure.mc_state_positions(length, states, seed=length)
        assert pos[0] == (0, 1.0)
        ts = [t for t, _ in pos[1:]]
        assert len(ts) == min(states, length - 1) and len(set(ts)) == len(ts)
        assert all(1 <= t < length for t in ts)
        assert sum(w for _, w in pos) == pytest.approx(length)  # every token counts once
    # uniform over the completion's tokens: each inside position equally often
    counts = [0] * 10
    for s in range(20_000):
        for t, _ in measure.mc_state_positions(10, 2, seed=s)[1:]:
            counts[t] += 1
    assert counts[0] == 0 and max(counts[1:]) / min(counts[1:]) < 1.1


def test_the_t_interval_covers_95_percent_with_three_seeds():
    rng = random.Random(17)
    trials, covered_t, covered_z = 20_000, 0, 0
    for _ in range(trials):
        xs = [rng.gauss(0.3, 0.05) for _ in range(3)]
        _, lo, hi = intervals.mean_interval(xs)
        covered_t += lo <= 0.3 <= hi
        _, lo, hi = intervals.mean_interval(xs, z=1.96)
        covered_z += lo <= 0.3 <= hi
    assert covered_t / trials == pytest.approx(0.95, abs=0.006)
    assert covered_z / trials < 0.85  # the old normal interval with n = 3


def test_t_quantile_against_the_table():
    for dof, t in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (9, 2.2622), (29, 2.0452)):
        assert intervals.t_quantile(0.975, dof) == pytest.approx(t, abs=2e-4)
    assert intervals.t_quantile(0.995, 4) == pytest.approx(4.6041, abs=2e-4)
    for q in (0.6, 0.9, 0.975, 0.999):  # the closed forms: Cauchy at dof 1, and dof 2
        assert intervals.t_quantile(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-9)
        assert intervals.t_quantile(q, 2) == pytest.approx((2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-9)
    welch = [intervals.t_quantile(0.975, 2 + k / 10) for k in range(11)]  # Welch's dof: between the whole ones
    # 3.5747 at dof 2.5: what the Simpson-rule CDF integration this replaced gave too (3.57465)
    assert all(a > b for a, b in zip(welch, welch[1:])) and welch[5] == pytest.approx(3.5747, abs=2e-4)


def test_paired_difference():
    a, b = [1, 0, 1, 1, 0, 1], [0, 0, 1, 0, 0, 1]
    m, lo, hi = intervals.paired_difference(a, b)
    d = [1, 0, 0, 1, 0, 0]
    half = intervals.t_quantile(0.975, 5) * statistics.stdev(d) / math.sqrt(6)
    assert (m, lo, hi) == pytest.approx((1 / 3, 1 / 3 - half, 1 / 3 + half))


# ---------------------------------------------------------------------------------------------- the offset question


def _episode_batch(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 16, 12
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), lengths - 1] = (torch.rand(B, generator=g) < 0.5).double()  # a score at the last token
    values = torch.rand(B, T, generator=g, dtype=torch.float64) * mask
    return rewards, values, mask, lengths.tolist()


@pytest.mark.parametrize("c", [0.3, -0.7])
def test_constant_offset_is_removed_by_whitening_only_when_lambda_is_one(c):
    rewards, values, mask, lengths = _episode_batch(seed=6)
    B, T = rewards.shape

    def whitened(gamma, lam, v):
        adv, _ = common.gae(rewards, v, mask, gamma, lam)
        return adv, common.masked_whiten(adv, mask)

    # gamma = lambda = 1: every advantage moves by exactly -c, and whitening removes it
    a_true, w_true = whitened(1.0, 1.0, values)
    a_off, w_off = whitened(1.0, 1.0, (values + c) * mask)
    assert torch.allclose((a_off - a_true)[mask > 0], torch.full_like(a_true[mask > 0], -c), atol=1e-12)
    assert torch.allclose(w_off, w_true, atol=1e-9)

    # lambda = 0.9: the shift is -c * (gamma * lambda)^(L - 1 - t), not constant, and whitening keeps it
    gamma, lam = 1.0, 0.9
    a_true, w_true = whitened(gamma, lam, values)
    a_off, w_off = whitened(gamma, lam, (values + c) * mask)
    for b in range(B):
        for t in range(lengths[b]):
            predicted = -c * (gamma * lam) ** (lengths[b] - 1 - t)
            assert float(a_off[b, t] - a_true[b, t]) == pytest.approx(predicted, abs=1e-12)
    assert (w_off - w_true).abs().max() > 0.05

    # gamma < 1 too: the shift is c * (gamma * S(m - 1) - S(m)), S(j) = sum_{k <= j} (gamma lambda)^k, m = L - 1 - t
    gamma, lam = 0.95, 0.9
    a_true, _ = whitened(gamma, lam, values)
    a_off, _ = whitened(gamma, lam, (values + c) * mask)
    for b in range(B):
        for t in range(lengths[b]):
            m = lengths[b] - 1 - t
            s_m = sum((gamma * lam) ** k for k in range(m + 1))
            s_m1 = sum((gamma * lam) ** k for k in range(m))
            assert float(a_off[b, t] - a_true[b, t]) == pytest.approx(c * (gamma * s_m1 - s_m), abs=1e-12)


# ---------------------------------------------------------------------------------------------- intervals


def test_wilson_interval_hand_computed():
    z = 1.96
    # 7 of 20: p = 0.35, z^2 = 3.8416; centre = (0.35 + 3.8416 / 40) / (1 + 3.8416 / 20)
    centre = (0.35 + 0.09604) / 1.19208
    half = z * math.sqrt(0.35 * 0.65 / 20 + 3.8416 / 1600) / 1.19208
    lo, hi = intervals.wilson_interval(7, 20)
    assert (lo, hi) == pytest.approx((centre - half, centre + half), abs=1e-9)
    assert (lo, hi) == pytest.approx((0.1812, 0.5671), abs=1e-4)
    # the bounds are where |p_hat - p| = z sqrt(p (1 - p) / n)
    for p in (lo, hi):
        assert abs(0.35 - p) == pytest.approx(z * math.sqrt(p * (1 - p) / 20), abs=1e-9)


@pytest.mark.parametrize("n", [1, 10, 1319])
def test_wilson_interval_edges(n):
    z2 = 1.96**2
    lo, hi = intervals.wilson_interval(0, n)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(z2 / (n + z2))
    lo, hi = intervals.wilson_interval(n, n)
    assert lo == pytest.approx(n / (n + z2)) and hi == pytest.approx(1.0, abs=1e-12)
    assert 0.0 <= lo <= hi <= 1.0
    assert intervals.wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_interval():
    m, lo, hi = intervals.mean_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.1824 * math.sqrt(5 / 3) / 2  # sample sd sqrt(5/3), n = 4: t with 3 degrees of freedom
    assert (m, lo, hi) == pytest.approx((2.5, 2.5 - half, 2.5 + half), rel=1e-4)
    values = [0.31, 0.35, 0.29]
    m, lo, hi = intervals.mean_interval(values, z=2.0)
    assert m == pytest.approx(statistics.fmean(values))
    half = 2.0 * statistics.stdev(values) / math.sqrt(3)
    assert (lo, hi) == pytest.approx((m - half, m + half))
    m, lo, hi = intervals.mean_interval([0.4])  # one seed: a mean, and no interval rather than a zero-width one
    assert m == 0.4 and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(x) for x in intervals.mean_interval([]))


def test_mc_rollouts_from_state_t_write_and_count_at_most_t_minus_t_tokens(monkeypatch):
    """A state t tokens into a completion of at most T has T - t tokens left: its MC rollouts are cut there and
    only those count (they used to run up to T tokens from every state, all counted in mc_tokens)."""

    tok = models.load_tokenizer("tiny")
    model = models.load_model("tiny", tok, 0)
    T, k = 8, 3
    prefixes = [[], [9] * (T - 1), [9] * (T - 2), [9] * 2]
    budgets = [T - len(x) for x in prefixes]
    calls = []
    real = generation.generate

    def generate(m, prompts, **kw):
        ro = real(m, prompts, **kw)
        calls.append((kw["max_new_tokens"], [len(p) for p in prompts], ro.lengths.tolist()))
        return ro

    monkeypatch.setattr(generation, "generate", generate)
    u = rollout.step_uniforms(0, 0, 1, len(prefixes) * k, T, torch.device("cpu"))
    returns, used, generated = measure.mc_values(
        model, tok, [[5, 6, 7]] * len(prefixes), prefixes, ["1"] * len(prefixes),
        task="toy", k=k, max_new_tokens=T, uniforms=u, temperature=1.0, top_p=1.0,
    )  # fmt: skip
    assert returns.shape == (len(prefixes), k)
    rows = [(c - 3, n) for _, ctx, ns in calls for c, n in zip(ctx, ns)]  # (prefix length t, tokens generated)
    assert len(rows) == len(prefixes) * k
    assert used == sum(min(n, T - t) for t, n in rows) <= k * sum(budgets)
    assert generated == sum(n for _, n in rows) >= used
    assert any(n > T - t for t, n in rows), "some rollout ran past its state's budget and was cut"


# ------------------------------------------------------------------------------------------------------
# The line a run ends with: the test before and after training, paired only over the same problems
# ------------------------------------------------------------------------------------------------------


def _evaluation(correct: list[int]) -> dict:
    n = len(correct)
    return {"accuracy": sum(correct) / n, "ci95": list(intervals.wilson_interval(sum(correct), n)), "n": n,
            "correct": correct}  # fmt: skip


def _ending(tmp_path, capsys, before: dict, after: dict) -> str:
    from plumbing import logs

    logs.write_results(tmp_path, {"steps": 3, "test_before": before}, after, torch.device("cpu"), 1)
    return capsys.readouterr().out


def test_the_paired_line_pairs_the_same_problems_and_says_when_it_cannot(tmp_path, capsys):
    before, after = _evaluation([0, 0, 1, 0, 1, 0]), _evaluation([1, 0, 1, 1, 1, 0])
    out = _ending(tmp_path, capsys, before, after)
    assert "paired difference +33.3 points [" in out and "(2 problems changed answer)" in out, out
    same = _ending(tmp_path, capsys, before, before)  # nothing changed: a zero difference with no interval
    assert "paired difference +0.0 points (no interval) (0 problems changed answer)" in same, same
    resized = _ending(tmp_path, capsys, _evaluation([0, 1, 1, 0]), after)  # --test-size changed on resume
    assert "not paired (--test-size changed on resume)" in resized and "paired difference" not in resized, resized
    assert "on 4 problems, after" in resized and resized.splitlines()[-1].startswith("test accuracy 66.7% ")


def test_the_hardware_line_counts_threads_in_words(monkeypatch):
    from plumbing.distributed import device_description

    for n, words in ((1, "1 thread)"), (2, "2 threads)")):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)
        assert device_description(torch.device("cpu"), 1).endswith(words)
