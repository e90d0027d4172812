"""Advantage-error metrics on synthetic data with known answers; the lambda < 1 offset; intervals."""

import math
import statistics

import pytest
import torch

import common


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
    got = common.advantage_error(pred, target, groups)
    expected = _loop_metrics(pred, target, groups)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_advantage_error_known_offset_and_noise():
    g = torch.Generator().manual_seed(1)
    N, c, s = 400_000, 0.5, 0.3
    target = torch.randn(N, generator=g, dtype=torch.float64)
    pred = target + c + s * torch.randn(N, generator=g, dtype=torch.float64)
    m = common.advantage_error(pred, target)
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
    m = common.advantage_error(target + offsets[groups], target, groups)
    assert m["within_group_rmse"] == pytest.approx(0.0, abs=1e-12)
    assert m["centred_rmse"] > 0.5  # the offsets differ between groups
    # plain noise: removing each group's mean error leaves s^2 (G - 1) / G
    s = 0.2
    noisy = common.advantage_error(target + s * torch.randn(4000, generator=g, dtype=torch.float64), target, groups)
    assert noisy["within_group_rmse"] == pytest.approx(s * math.sqrt(7 / 8), rel=0.03)


def test_mc_noise():
    p = torch.tensor([0.0, 0.25, 0.5, 1.0, 0.75])
    for k in (2, 4, 16):
        expected = sum(float(v) * (1 - float(v)) / (k - 1) for v in p) / len(p)
        assert common.mc_noise(p, k) == pytest.approx(expected, rel=1e-12)


def test_mc_noise_is_unbiased():
    # the observed MSE of a perfect critic against a K-sample target is, on average, the estimated noise
    g = torch.Generator().manual_seed(3)
    k, n = 8, 100_000
    true_p = torch.rand(n, generator=g, dtype=torch.float64)
    p_hat = (torch.rand(n, k, generator=g, dtype=torch.float64) < true_p[:, None]).double().mean(-1)
    mse = (p_hat - true_p).pow(2).mean().item()
    assert common.mc_noise(p_hat, k) == pytest.approx(mse, rel=0.02)


def test_baseline_report_planted_offset():
    g = torch.Generator().manual_seed(4)
    n, k = 2000, 8
    mc = (torch.randint(0, k + 1, (n,), generator=g) / k).double()
    returns = (torch.rand(n, generator=g, dtype=torch.float64) < mc).double()
    pred_values = mc + 0.3
    pred_adv = returns - pred_values
    r = common.baseline_report(pred_values, mc, returns, pred_adv, k, group_ids=torch.arange(n) // 4)
    assert r["value/bias"] == pytest.approx(0.3, abs=1e-9)
    assert r["adv/bias"] == pytest.approx(-0.3, abs=1e-9)
    assert r["value/centred_rmse"] == pytest.approx(0.0, abs=1e-9)
    assert r["adv/centred_rmse"] == pytest.approx(0.0, abs=1e-9)
    assert r["value/within_group_rmse"] == pytest.approx(0.0, abs=1e-9)
    assert r["white/rmse"] == pytest.approx(0.0, abs=1e-6)
    assert r["value/rmse"] == pytest.approx(0.3, abs=1e-9)
    assert r["value/mc_noise_var"] == pytest.approx(common.mc_noise(mc, k))
    assert r["value/mse_noise_corrected"] == pytest.approx(0.09 - r["value/mc_noise_var"], abs=1e-9)


def test_baseline_report_noise_is_not_removed_by_whitening():
    g = torch.Generator().manual_seed(5)
    n = 5000
    mc = torch.rand(n, generator=g, dtype=torch.float64)
    returns = (torch.rand(n, generator=g, dtype=torch.float64) < mc).double()
    pred_values = mc + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    r = common.baseline_report(pred_values, mc, returns, returns - pred_values, 4)
    assert r["value/centred_rmse"] == pytest.approx(0.2, rel=0.05)
    assert r["white/rmse"] > 0.1


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
    lo, hi = common.wilson_interval(7, 20)
    assert (lo, hi) == pytest.approx((centre - half, centre + half), abs=1e-9)
    assert (lo, hi) == pytest.approx((0.1812, 0.5671), abs=1e-4)
    # the bounds are where |p_hat - p| = z sqrt(p (1 - p) / n)
    for p in (lo, hi):
        assert abs(0.35 - p) == pytest.approx(z * math.sqrt(p * (1 - p) / 20), abs=1e-9)


@pytest.mark.parametrize("n", [1, 10, 1319])
def test_wilson_interval_edges(n):
    z2 = 1.96**2
    lo, hi = common.wilson_interval(0, n)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(z2 / (n + z2))
    lo, hi = common.wilson_interval(n, n)
    assert lo == pytest.approx(n / (n + z2)) and hi == pytest.approx(1.0, abs=1e-12)
    assert 0.0 <= lo <= hi <= 1.0
    assert common.wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_interval():
    m, lo, hi = common.mean_interval([1.0, 2.0, 3.0, 4.0])
    half = 1.96 * math.sqrt(5 / 3) / 2  # sample sd sqrt(5/3), n = 4
    assert (m, lo, hi) == pytest.approx((2.5, 2.5 - half, 2.5 + half))
    values = [0.31, 0.35, 0.29]
    m, lo, hi = common.mean_interval(values, z=2.0)
    assert m == pytest.approx(statistics.fmean(values))
    half = 2.0 * statistics.stdev(values) / math.sqrt(3)
    assert (lo, hi) == pytest.approx((m - half, m + half))
    m, lo, hi = common.mean_interval([0.4])  # one seed: a mean, and no interval rather than a zero-width one
    assert m == 0.4 and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(x) for x in common.mean_interval([]))
