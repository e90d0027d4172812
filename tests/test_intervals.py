"""The statistics of the crossover (docs/measurement.md): GRPO's error at the prompt state against its
error inside a completion on a synthetic value process, and the coverage of the report's intervals under
run-level (seed) effects. Every simulation has a fixed seed and runs in seconds."""

from __future__ import annotations

import math

import pytest
import torch

import intervals
import measure
from plumbing import models


def _grpo_on_a_value_process(
    d: float, n: int = 20000, G: int = 8, K: int = 8, seed: int = 0, own: bool = False
) -> dict:
    """GRPO's leave-one-out mean scored by baseline_error_by_state on a value process where the share d of the
    outcome's variance resolved at the inside state is known: with probability d the state already holds the
    outcome (V(s_t) = R), else it holds nothing yet (V(s_t) = p). Var(V(s_t) - p) = d p (1 - p)."""
    g = torch.Generator().manual_seed(seed)
    p = 0.1 + 0.8 * torch.rand(n, generator=g, dtype=torch.float64)  # [n] each prompt's success rate
    loo = (torch.rand(n, G - 1, generator=g, dtype=torch.float64) < p[:, None]).double().mean(-1)  # [n]
    outcome = (torch.rand(n, generator=g, dtype=torch.float64) < p).double()  # [n] the measured completion's R
    resolved = torch.rand(n, generator=g, dtype=torch.float64) < d
    v_inside = torch.where(resolved, outcome, p)  # [n] V(s_t)
    truth = torch.cat([p, v_inside])  # [2n] the prompt states, then one state inside each completion
    returns = (torch.rand(2 * n, K, generator=g, dtype=torch.float64) < truth[:, None]).double()  # [2n, K]
    t = torch.cat([torch.zeros(n), torch.full((n,), 5.0)]).long()
    b = (outcome + (G - 1) * loo) / G if own else loo  # own: the group mean, the completion's own reward in it
    return measure.baseline_error_by_state(
        torch.cat([b, b]), returns.mean(-1), K, t, groups=torch.arange(2 * n) % n, mc_var=returns.var(-1)
    )


@pytest.mark.parametrize("d", [0.3, 0.6])
def test_grpo_reads_one_over_g_minus_one_at_the_prompt_and_more_inside(d):
    """At the prompt GRPO's leave-one-out mean reads 1/(G-1) whatever p; at a state inside, where d of the outcome's
    variance is resolved, the same constant reads (1/(G-1) + d) / (1 - d): it cannot follow V(s_t)."""
    G = 8
    parts = _grpo_on_a_value_process(d, G=G)
    assert set(parts) == {"", "_prompt", "_inside"}
    assert parts["_prompt"]["nmse"] == pytest.approx(1 / (G - 1), rel=0.08)
    assert parts["_inside"]["nmse"] == pytest.approx((1 / (G - 1) + d) / (1 - d), rel=0.08)
    # every state together: sums of both parts, so between the two
    assert parts["_prompt"]["nmse"] < parts[""]["nmse"] < parts["_inside"]["nmse"]
    assert parts[""]["n"] == parts["_prompt"]["n"] + parts["_inside"]["n"]


@pytest.mark.parametrize("d", [0.3, 0.6])
def test_the_group_mean_reads_one_over_g_at_the_prompt_and_more_inside(d):
    """GRPO's group mean with the completion's own reward in it (mc/group, runs.csv nmse_group_mean): 1/G at the
    prompt; inside, (1 + (G-2) d) / (G (1 - d)): 0.50 at d = 0.3 and 1.44 at d = 0.6 for G = 8, below the
    leave-one-out mean's (1/(G-1) + d) / (1 - d) only because it holds that completion's own outcome."""
    G = 8
    parts = _grpo_on_a_value_process(d, G=G, own=True)
    assert parts["_prompt"]["nmse"] == pytest.approx(1 / G, rel=0.08)
    assert parts["_inside"]["nmse"] == pytest.approx((1 + (G - 2) * d) / (G * (1 - d)), rel=0.08)
    assert parts["_inside"]["nmse"] < _grpo_on_a_value_process(d, G=G)["_inside"]["nmse"]


def test_a_shaped_return_leaves_the_signal_to_the_scores():
    """--kl-mode reward: the return is score - KL ahead, continuous, so its K values almost always differ. The
    reward's own variance (nmse's denominator) and signal_fraction come from the 0/1 scores (signal_var)."""
    g = torch.Generator().manual_seed(1)
    n, K = 400, 8
    p = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, 0.5).double()  # half the prompts never solved
    scores = (torch.rand(n, K, generator=g, dtype=torch.float64) < p[:, None]).double()
    returns = scores - 0.05 * torch.rand(n, K, generator=g, dtype=torch.float64)  # the KL ahead, small
    pred = returns.mean(-1) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    shaped = measure.baseline_error(pred, returns.mean(-1), K, mc_var=returns.var(-1), signal_var=scores.var(-1))
    plain = measure.baseline_error(pred, returns.mean(-1), K, mc_var=returns.var(-1))
    assert plain["signal_fraction"] > 0.99  # the KL noise reads as signal
    assert shaped["signal_fraction"] == pytest.approx(float((scores.var(-1) > 0).double().mean()))
    assert shaped["signal_fraction"] < 0.6
    assert shaped["sum_signal_var"] == pytest.approx(float(scores.var(-1).sum()))


# ------------------------------------------------------------------------------------------------------
# Intervals over seeds: coverage under a run-level effect
# ------------------------------------------------------------------------------------------------------


def _pooled_problems_interval(a: list[list[float]], b: list[list[float]]) -> tuple[float, float, float]:
    """The comparison report.py made before: per problem the mean over seeds, then a paired t over problems."""
    n, S = len(a[0]), len(a)
    return intervals.paired_difference(
        [sum(a[s][i] for s in range(S)) / S for i in range(n)], [sum(b[s][i] for s in range(S)) / S for i in range(n)]
    )


def test_paired_seed_difference_covers_95_percent_with_a_run_level_effect():
    """Two methods the same in distribution; each run (method, seed) has its own shift of every problem's chance of
    being solved (a run-level effect, sd 5 points). The per-seed paired t interval covers the true difference, 0,
    in ~95% of simulations; the pooled-problems interval of the old report covers far less."""
    g = torch.Generator().manual_seed(0)
    reps, S, n = 1000, 3, 200
    q = 0.2 + 0.6 * torch.rand(reps, 1, 1, n, generator=g)  # [reps, 1, 1, n] each problem's difficulty
    shift = 0.05 * torch.randn(reps, 2, S, 1, generator=g)  # [reps, method, seed, 1] the run-level effect
    correct = (torch.rand(reps, 2, S, n, generator=g) < (q + shift).clamp(0, 1)).float().tolist()
    new = old = 0
    for a, b in correct:
        _, lo, hi = intervals.paired_seed_difference(a, b)
        new += lo <= 0 <= hi
        _, lo, hi = _pooled_problems_interval(a, b)
        old += lo <= 0 <= hi
    assert 0.92 <= new / reps <= 0.98, new / reps
    assert old / reps < 0.8, old / reps


def test_paired_seed_difference_is_the_mean_of_the_seeds_and_never_certain():
    a = [[1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]
    b = [[0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]]
    m, lo, hi = intervals.paired_seed_difference(a, b)
    per_seed = [0.25, 0.25, 0.25]
    assert m == pytest.approx(sum(per_seed) / 3)
    assert math.isnan(lo) and math.isnan(hi), "seeds that agree exactly give no interval, not a zero-width one"
    b[2] = [1, 1, 1, 1]  # seed 3's difference is now 0
    m, lo, hi = intervals.paired_seed_difference(a, b)
    d = [0.25, 0.25, 0.0]
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    assert m == pytest.approx(sum(d) / 3)
    assert (lo, hi) == pytest.approx((m - 4.303 * sd / math.sqrt(3), m + 4.303 * sd / math.sqrt(3)), rel=1e-3)
    # one seed: its problems' paired interval; identical runs: no interval
    assert intervals.paired_seed_difference(a[:1], b[:1]) == pytest.approx(intervals.paired_difference(a[0], b[0]))
    assert all(math.isnan(x) for x in intervals.paired_seed_difference([[1, 0]], [[1, 0]])[1:])
    with pytest.raises(ValueError):
        intervals.paired_seed_difference([[1, 0]], [[1, 0, 1]])


def _nmse_sums(reps: int, S: int, M: int, N: int, K: int, seed_sd: float, seed: int = 0, sigma: float = 0.05):
    """Per (rep, seed, measurement): the noise-corrected numerator and denominator of nmse for a critic whose
    error sd has a per-seed log-normal factor (the run-level effect), at a small success rate (p ~ Beta(0.3, 3):
    few mixed states, the skewed case). Returns num, den [reps, S, M] and the true pooled nmse."""
    g = torch.Generator().manual_seed(seed)
    a, b = 0.3, 3.0
    p = torch.distributions.Beta(torch.tensor(a), torch.tensor(b)).sample((reps, S, M, N)).double()
    returns = (torch.rand(reps, S, M, N, K, generator=g, dtype=torch.float64) < p[..., None]).double()
    p_hat, s2 = returns.mean(-1), returns.var(-1)
    sd = sigma * torch.exp(seed_sd * torch.randn(reps, S, 1, 1, generator=g, dtype=torch.float64))
    pred = p + sd * torch.randn(reps, S, M, N, generator=g, dtype=torch.float64)
    num = ((pred - p_hat) ** 2 - s2 / K).sum(-1)  # [reps, S, M] as baseline_error's sum_sq_err_nc
    den = s2.sum(-1)  # [reps, S, M] sum_signal_var
    e_pq = a / (a + b) - a * (a + 1) / ((a + b) * (a + b + 1))  # E[p (1 - p)]
    return num, den, sigma**2 * math.exp(2 * seed_sd**2) / e_pq


def test_nmse_interval_over_seeds_covers_95_percent_with_a_run_level_effect():
    """The pooled nmse's interval (intervals.ratio_interval over the seeds' sums) covers the true pooled nmse in ~95%
    of simulations of 3 seeds x 10 measurements x 50 states at a small success rate, with the critic's error
    differing by seed; the same interval with the 30 measurements as units (a bootstrap or t over measurements
    that forgets the seeds) covers far less. torch.manual_seed fixes the Beta sampler."""
    torch.manual_seed(0)
    reps = 1000
    num, den, truth = _nmse_sums(reps, S=3, M=10, N=50, K=8, seed_sd=0.25)
    seeds_ok = measurements_ok = 0
    for r in range(reps):
        m, lo, hi = intervals.ratio_interval(num[r].sum(-1).tolist(), den[r].sum(-1).tolist())
        assert m == pytest.approx(float(num[r].sum() / den[r].sum()))  # centred on the pooled value
        seeds_ok += lo <= truth <= hi
        _, lo, hi = intervals.ratio_interval(num[r].flatten().tolist(), den[r].flatten().tolist())
        measurements_ok += lo <= truth <= hi
    assert 0.92 <= seeds_ok / reps <= 0.98, seeds_ok / reps
    assert measurements_ok / reps < 0.85, measurements_ok / reps


def test_nmse_interval_over_seeds_under_covers_a_skewed_seed_effect():
    """What ratio_interval's docstring and docs/measurement.md state: with the critic's error sd differing between
    seeds by a log-normal factor of sd 0.5 (its error variance by a factor of e), 3 seeds cover ~86%, not 95%."""
    torch.manual_seed(0)
    reps = 1000
    num, den, truth = _nmse_sums(reps, S=3, M=10, N=50, K=8, seed_sd=0.5)
    ok = 0
    for r in range(reps):
        _, lo, hi = intervals.ratio_interval(num[r].sum(-1).tolist(), den[r].sum(-1).tolist())
        ok += lo <= truth <= hi
    assert 0.82 <= ok / reps <= 0.90, ok / reps


@pytest.mark.parametrize("seed_sd", [0.0, 0.25])
def test_the_difference_of_two_nmse_covers_95_percent_paired_by_seed(seed_sd):
    """A critic's nmse minus GRPO's, each pooled over 3 seeds (intervals.ratio_difference_interval: the linearised
    residuals of both ratios, paired by seed, t with 2 dof), covers the true difference in ~95% of simulations, with
    and without a seed effect on the critic; with one seed (intervals over each run's 10 measurements, Welch's dof)
    it covers ~95% of what that seed's runs would read again, and nothing about other seeds."""
    torch.manual_seed(1)
    reps = 1000
    num_c, den_c, truth_c = _nmse_sums(reps, S=3, M=10, N=50, K=8, seed_sd=seed_sd, seed=1)
    num_g, den_g, truth_g = _nmse_sums(reps, S=3, M=10, N=50, K=8, seed_sd=0.0, seed=2, sigma=0.1)
    truth = truth_c - truth_g
    seeds_ok = one_ok = 0
    for r in range(reps):
        d, lo, hi = intervals.ratio_difference_interval(
            num_c[r].sum(-1).tolist(), den_c[r].sum(-1).tolist(), num_g[r].sum(-1).tolist(), den_g[r].sum(-1).tolist()
        )
        assert d == pytest.approx(float(num_c[r].sum() / den_c[r].sum() - num_g[r].sum() / den_g[r].sum()))
        seeds_ok += lo <= truth <= hi
        if seed_sd == 0:  # one seed's runs: their measurements as units, the two runs unpaired
            _, lo, hi = intervals.ratio_difference_interval(
                num_c[r, 0].tolist(), den_c[r, 0].tolist(), num_g[r, 0].tolist(), den_g[r, 0].tolist(), paired=False
            )
            one_ok += lo <= truth <= hi
    assert 0.92 <= seeds_ok / reps <= 0.98, seeds_ok / reps
    if seed_sd == 0:
        assert 0.92 <= one_ok / reps <= 0.98, one_ok / reps
    nan = intervals.ratio_difference_interval([1.0], [2.0], [1.0], [4.0])
    assert nan[0] == pytest.approx(0.25) and math.isnan(nan[1]) and math.isnan(nan[2]), "one seed each: no interval"


def test_ratio_interval_is_centred_on_the_pooled_ratio_and_never_certain():
    nums, dens = [1.0, 3.0, 2.0], [10.0, 10.0, 40.0]
    r, lo, hi = intervals.ratio_interval(nums, dens)
    assert r == pytest.approx(6 / 60)
    assert (lo + hi) / 2 == pytest.approx(r)
    per_seed_mean = sum(n / d for n, d in zip(nums, dens)) / 3  # 0.15: what the old interval was centred on
    assert abs(per_seed_mean - r) > 0.04
    assert all(math.isnan(x) for x in intervals.ratio_interval([1.0, 2.0], [10.0, 20.0])[1:]), "agreeing seeds"
    assert all(math.isnan(x) for x in intervals.ratio_interval([1.0], [10.0])[1:]), "one seed"
    assert all(math.isnan(x) for x in intervals.ratio_interval([1.0, 1.0], [0.0, 0.0]))


# ------------------------------------------------------------------------------------------------------
# measure.monte_carlo: the parts it logs, and the signal under a shaped return
# ------------------------------------------------------------------------------------------------------


def _measure(penalty=None) -> dict:

    tok = models.load_tokenizer("tiny")
    model = models.load_model("tiny", tok, 0)
    T, R = 6, 4
    responses = [[9, 10, 11, 12, 13, 14][: 3 + i] for i in range(R)]
    out, _ = measure.monte_carlo(
        model, tok, prompts=[[5, 6, 7]] * R, responses=responses, golds=["1"] * R, groups=list(range(R)),
        row_ids=list(range(R)), baselines={"value": torch.full((R, T), 0.5)}, states=2, k=4, max_new_tokens=T,
        seed=0, step=0, task="toy", temperature=1.0, top_p=1.0, penalty=penalty,
    )  # fmt: skip
    return out


def test_monte_carlo_logs_the_prompt_states_apart_and_takes_the_signal_from_the_scores():
    """Every baseline is scored over every state (mc/<name>/...) and over the prompt states and the states inside
    apart (mc/<name>_prompt/..., mc/<name>_inside/...). Under a shaped return (PPO's --kl-mode reward subtracts the
    KL ahead: here a noise of ~0.01 per rollout) nmse's denominator and signal_fraction are the 0/1 scores' own:
    the same as without the penalty, on the same rollouts."""
    plain = _measure()
    gen = torch.Generator().manual_seed(3)
    shaped = _measure(penalty=lambda ro, used: 0.01 * torch.rand(len(used), generator=gen, dtype=torch.float64))
    for out in (plain, shaped):
        assert out["value/n"] == out["value_prompt/n"] + out["value_inside/n"] and out["value_prompt/n"] == 4
        assert out["value/sum_signal_var"] == pytest.approx(
            out["value_prompt/sum_signal_var"] + out["value_inside/sum_signal_var"]
        )
    assert plain["value/sum_signal_var"] > 0
    for key in ("sum_signal_var", "signal_fraction", "signal_groups"):
        for part in measure.STATE_PARTS:
            assert shaped[f"value{part}/{key}"] == pytest.approx(plain[f"value{part}/{key}"]), (part, key)
    assert shaped["value/sum_err"] != pytest.approx(plain["value/sum_err"])  # the target is the shaped return


# ------------------------------------------------------------------------------------------------------
# G* = 1 + 1/nmse: a critic's error in samples of GRPO's group
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G,nmse", [(2, 1.0), (4, 1 / 3), (8, 1 / 7), (16, 1 / 15)])
def test_grpo_group_reads_one_over_g_minus_one_and_g_star_inverts_it(G, nmse):
    assert intervals.group_nmse(G) == pytest.approx(nmse)
    assert intervals.critic_equivalent_group(intervals.group_nmse(G))[0] == pytest.approx(G)


def test_g_star_and_its_interval_on_known_inputs():
    """nmse 0.25 in (0.2, 0.5) is worth 5 samples, in (3, 6): the ends swap, as G* falls when nmse rises."""
    assert intervals.critic_equivalent_group(0.25, 0.2, 0.5) == pytest.approx((5.0, 3.0, 6.0))
    g, lo, hi = intervals.critic_equivalent_group(0.25)  # no interval given: none carried
    assert g == 5.0 and math.isnan(lo) and math.isnan(hi)
    # an nmse interval reaching 0 or below: no upper end
    assert intervals.critic_equivalent_group(0.1, -0.05, 0.2) == (pytest.approx(11.0), pytest.approx(6.0), math.inf)
    assert intervals.critic_equivalent_group(0.0, 0.0, 0.1)[::2] == (math.inf, math.inf)
    assert intervals.critic_equivalent_group(-0.02, -0.1, -0.01) == (math.inf, math.inf, math.inf)
    g, lo, hi = intervals.critic_equivalent_group(math.nan)
    assert math.isnan(g) and math.isnan(lo) and math.isnan(hi)


def test_g_star_beats_a_group_exactly_where_its_nmse_is_below_the_groups():
    for e in (0.05, 0.14, 0.2, 0.34, 0.9, 1.5):
        for G in (2, 4, 8, 16):
            assert (intervals.critic_equivalent_group(e)[0] > G) == (e < intervals.group_nmse(G))


@pytest.mark.parametrize("G", [1, 1.5, 0, -3, math.nan])
def test_a_group_below_two_is_refused(G):
    with pytest.raises(ValueError, match="at least 2"):
        intervals.group_nmse(G)


def test_an_upside_down_interval_is_refused():
    with pytest.raises(ValueError, match="above its upper end"):
        intervals.critic_equivalent_group(0.3, 0.5, 0.2)
