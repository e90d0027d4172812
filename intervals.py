"""Intervals: a proportion's (Wilson), a mean's over seeds (t), paired differences, and a ratio of sums over seeds;
and the exchange rate between a critic and GRPO's group (G* = 1 + 1/nmse) with its interval.

Small pure functions on plain numbers; no torch, no project import. Evaluation gives each accuracy its Wilson
interval (gsm8k.evaluate); the report compares methods seed by seed (paired_seed_difference) and pools the
baseline error's sums before its ratio (ratio_interval); a critic's nmse becomes the group size it is worth
(critic_equivalent_group). Their coverage is checked by simulation in
tests/test_intervals.py; docs/measurement.md says what each assumes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

# ======================================================================================================
# Intervals: Wilson for a proportion, t over seeds, paired differences, ratios
# ======================================================================================================


def ratio(total: float, n: float) -> float | None:
    """total / n, or None over zero items: a statistic of nothing is absent (null in JSON), never 0.0."""
    return total / n if n else None


def wilson_interval(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval for k successes in n trials."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function, by the modified Lentz method (it converges fast
    for x < (a + 1) / (a + b + 2); _regularised_beta swaps the arguments otherwise)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _regularised_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function, for x in [0, 1]."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


@functools.lru_cache(maxsize=256)
def t_quantile(q: float, dof: float) -> float:
    """The q quantile of Student's t with dof degrees of freedom (q in (0.5, 1); dof need not be whole: Welch's):
    bisection on its CDF, P(T <= x) = 1 - I_{dof/(dof+x^2)}(dof/2, 1/2) / 2 for x >= 0 (the incomplete beta by its
    continued fraction). t_quantile(0.975, 2) = 4.303, (0.975, 29) = 2.045."""
    if dof < 1 or not 0.5 < q < 1:
        raise ValueError(f"t_quantile needs dof >= 1 and 0.5 < q < 1, got {q}, {dof}")

    def cdf(x: float) -> float:  # P(T <= x) for x >= 0
        return 1.0 - 0.5 * _regularised_beta(dof / 2, 0.5, dof / (dof + x * x))

    lo, hi = 0.0, 1.0
    while cdf(hi) < q:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


@functools.lru_cache(maxsize=64)
def chi2_median(dof: int) -> float:
    """The median of a chi-square with dof degrees of freedom: bisection on its CDF, the regularised lower incomplete
    gamma P(dof/2, x/2) by its power series. chi2_median(2) = 2 ln 2 = 1.386."""
    if dof < 1:
        raise ValueError(f"chi2_median needs dof >= 1, got {dof}")
    a = dof / 2

    def cdf(x: float) -> float:
        y, term, total = x / 2, 1.0 / a, 1.0 / a
        for n in range(1, 1000):
            term *= y / (a + n)
            total += term
            if term < 1e-15 * total:
                break
        return math.exp(a * math.log(y) - y - math.lgamma(a)) * total

    lo, hi = 0.0, float(dof)
    while cdf(hi) < 0.5:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < 0.5 else (lo, mid)
    return (lo + hi) / 2


def median_half_width(se: float, units: int) -> float:
    """The median half-width of the 95% t interval over `units` units (seeds) whose values scatter with sd `se`:
    t(0.975, S - 1) sd_hat / sqrt(S), sd_hat's median sd sqrt(chi2_median(S - 1) / (S - 1)). For 3 seeds 2.07 se
    (4.30 x 0.83 / 1.73): what ratio_interval and mean_interval print, half the time wider. No seed effect assumed:
    a run-level effect widens it."""
    if units < 2 or not math.isfinite(se):
        return math.nan
    return t_quantile(0.975, units - 1) * se * math.sqrt(chi2_median(units - 1) / (units - 1)) / math.sqrt(units)


def mean_interval(values: Sequence[float], z: float | None = None) -> tuple[float, float, float]:
    """Mean and a 95% interval of a list of numbers (across seeds, say): mean +- t sd / sqrt(n), with t the 0.975
    quantile of Student's t with n - 1 degrees of freedom (4.30 for 3 seeds; a normal 1.96 there covers ~81%).
    z overrides the quantile.

    One number has no spread to estimate: its interval is (nan, nan), not a zero-width interval that would
    look certain; so are numbers that all agree (three seeds at 0% accuracy): they say the spread is small, not
    that it is zero, and the interval needs more of them. No numbers: all three are nan.
    """
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    m = sum(values) / n
    if n < 2:
        return m, math.nan, math.nan
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    if sd == 0:
        return m, math.nan, math.nan
    q = t_quantile(0.975, n - 1) if z is None else z
    return m, m - q * sd / math.sqrt(n), m + q * sd / math.sqrt(n)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Mean of a - b over paired items (the same test problems) and its 95% t interval.  [n], [n] -> 3 floats"""
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs equal lengths, got {len(a)} and {len(b)}")
    return mean_interval([float(x) - float(y) for x, y in zip(a, b)])


def paired_seed_difference(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """The difference in accuracy of two methods on the same test problems over seeds, and its 95% interval.
    a[s][i], b[s][i]: seed s's 0/1 result on test problem i (the same n problems for every seed) -> mean, lo, hi

    Seeds differ by more than problem-level noise (a run-level effect: one seed's policy is simply better), so the
    interval is the t interval over the per-seed paired differences d_s = mean_i (a[s][i] - b[s][i]), with S - 1
    degrees of freedom (t = 4.30 for 3 seeds: wide, and honest). Pooling the problems of all seeds into one paired
    t interval ignores that variance (in simulation its 95% interval covered 44-73%).
    One seed: its problems' paired t interval (intervals.paired_difference), which knows nothing of other seeds.
    Seeds (or, with one seed, problems) that all agree give (mean, nan, nan): no interval rather than a certain one.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_seed_difference needs the same seeds, at least one, got {len(a)} and {len(b)}")
    n = {len(x) for x in (*a, *b)}
    if len(n) != 1 or n == {0}:
        raise ValueError(f"paired_seed_difference needs the same test problems in every seed, got sizes {sorted(n)}")
    if len(a) == 1:
        return paired_difference(a[0], b[0])
    return mean_interval([sum(float(x) - float(y) for x, y in zip(xs, ys)) / len(xs) for xs, ys in zip(a, b)])


def _ratio_residuals(nums: Sequence[float], dens: Sequence[float]) -> tuple[float, list[float]]:
    """R = sum N / sum D and the linearised residuals z_s = (N_s - R D_s) / mean(D) of each unit (mean 0)."""
    S, num, den = len(nums), float(sum(nums)), float(sum(dens))
    if S == 0 or den <= 0:
        return math.nan, []
    r = num / den
    return r, [(float(n) - r * float(d)) / (den / S) for n, d in zip(nums, dens)]


def ratio_interval(nums: Sequence[float], dens: Sequence[float]) -> tuple[float, float, float]:
    """A pooled ratio sum(nums) / sum(dens) and its 95% interval, with clusters (seeds) as the units.  [S], [S] -> 3

    The linearised (delta-method) interval of a ratio estimator: R = sum N / sum D, residuals z_s = (N_s - R D_s)
    / mean(D), R +- t(0.975, S - 1) sd(z) / sqrt(S). Centred on the pooled value that the report prints (a t
    interval over per-seed ratios is centred on their mean, not on it) and carrying the clusters' variance: with one
    cluster per seed, the seed-to-seed variance. Its coverage in simulation (tests/test_intervals.py, 3 seeds x 10
    measurements x 50 states, a critic whose error sd has a per-seed log-normal factor): 0.95 at a factor of sd 0.25,
    0.86 at sd 0.5 (the error variance differing by a factor of e between seeds): with 3 seeds a skewed seed effect
    is under-covered, and the interval is approximate. Fewer than two clusters, a non-positive denominator or
    residuals that all agree: (R, nan, nan).
    """
    if len(nums) != len(dens):
        raise ValueError(f"ratio_interval needs as many numerators as denominators, got {len(nums)}, {len(dens)}")
    r, z = _ratio_residuals(nums, dens)
    return (r, *_t_around(r, z))


def _t_around(centre: float, z: Sequence[float], dof: float | None = None) -> tuple[float, float]:
    """centre +- t(0.975, dof) sd(z) / sqrt(S) for residuals z of mean 0 (dof S - 1 unless given); nan, nan for fewer
    than two or residuals that all agree."""
    S = len(z)
    if S < 2 or not math.isfinite(centre):
        return math.nan, math.nan
    sd = math.sqrt(sum(x * x for x in z) / (S - 1))
    if sd == 0:
        return math.nan, math.nan
    half = t_quantile(0.975, S - 1 if dof is None else dof) * sd / math.sqrt(S)
    return centre - half, centre + half


def ratio_difference_interval(
    a_nums: Sequence[float],
    a_dens: Sequence[float],
    b_nums: Sequence[float],
    b_dens: Sequence[float],
    paired: bool = True,
) -> tuple[float, float, float]:
    """The difference of two pooled ratios, sum a_N / sum a_D - sum b_N / sum b_D, and its 95% interval.  -> 3 floats

    paired (the same seeds, in the same order, a seed's two runs as one unit): the linearised residuals of each
    ratio (ratio_interval's z), their difference per unit, d +- t(0.975, S - 1) sd / sqrt(S): a critic's nmse less
    GRPO's over the seeds both have. Unpaired (one seed: each run's measurements as its units, the two runs
    independent): sqrt(se_a^2 + se_b^2) with Welch's degrees of freedom; it says what that seed's runs would read
    again, nothing about another seed. Coverage by simulation in tests/test_intervals.py. No interval where either
    side has fewer than two units, or the residuals all agree: (d, nan, nan).
    """
    ra, za = _ratio_residuals(a_nums, a_dens)
    rb, zb = _ratio_residuals(b_nums, b_dens)
    d = ra - rb
    if paired:
        if len(za) != len(zb):
            raise ValueError(f"a paired difference needs the same units on both sides, got {len(za)} and {len(zb)}")
        return (d, *_t_around(d, [x - y for x, y in zip(za, zb)]))
    if len(za) < 2 or len(zb) < 2 or not math.isfinite(d):
        return d, math.nan, math.nan
    va = sum(x * x for x in za) / (len(za) - 1) / len(za)  # se_a^2
    vb = sum(x * x for x in zb) / (len(zb) - 1) / len(zb)
    if va + vb == 0:
        return d, math.nan, math.nan
    dof = (va + vb) ** 2 / (va * va / (len(za) - 1) + vb * vb / (len(zb) - 1))
    half = t_quantile(0.975, dof) * math.sqrt(va + vb)
    return d, d - half, d + half


# ======================================================================================================
# The exchange rate: a critic's nmse in samples of GRPO's group
# ======================================================================================================


def group_nmse(group_size: float) -> float:
    """GRPO's baseline error at the prompt: the leave-one-out mean of the G - 1 other samples has nmse 1/(G - 1)
    whatever the success rate (G = 2: 1.0; 4: 0.333; 8: 0.143; 16: 0.067; docs/measurement.md). A group below 2
    has no other sample to average: ValueError."""
    if not group_size >= 2:  # nan too
        raise ValueError(f"a group of {group_size} has no leave-one-out mean: G must be at least 2")
    return 1.0 / (group_size - 1)


def _equivalent(nmse: float) -> float:
    if math.isnan(nmse):
        return math.nan
    return 1.0 + 1.0 / nmse if nmse > 0 else math.inf


def critic_equivalent_group(nmse: float, lo: float = math.nan, hi: float = math.nan) -> tuple[float, float, float]:
    """G* = 1 + 1/nmse, the group size whose leave-one-out mean reads the same nmse at the prompt as a baseline
    with this one (group_nmse inverted): a critic at nmse e is worth G* samples of the prompt, and beats GRPO's group
    of G exactly where G* > G. With nmse's 95% interval (lo, hi), G*'s: G* falls as nmse rises, so its ends are
    the ends of nmse's mapped and swapped, (1 + 1/hi, 1 + 1/lo). The noise-corrected nmse can reach 0 or below (a
    baseline indistinguishable from the true value at this many Monte Carlo samples): G* is then infinite, and an
    interval whose lower end reaches 0 has no upper end (inf). nan stays nan (no interval: (G*, nan, nan)).
    -> G*, its lower end, its upper end"""
    if not (math.isnan(lo) or math.isnan(hi)) and lo > hi:
        raise ValueError(f"an interval's lower end {lo} is above its upper end {hi}")
    return _equivalent(nmse), _equivalent(hi), _equivalent(lo)
