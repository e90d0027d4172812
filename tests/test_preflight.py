"""The sweep's preflight (python -m study.preflight, ./sweep.sh --preflight): its estimators and its predicted
standard error against simulations of measure.baseline_error, its three exit codes and its JSON on the tiny model, the
sweep it refuses (no run folder), a model that cannot be fetched, the informative-state count of the MC measurement,
and the report's opening and warning."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, check_one_error_line, trainer_env

import gsm8k
import intervals
import measure
from plumbing import models
from study import preflight, report, sweep_runner

FIELDS = ("pass_rate", "signal", "informative", "prompts", "samples_per_prompt", "samples", "informative_prompts")


def sweep(*args: str | Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**trainer_env(), "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(REPO / "sweep.sh"), *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


# ------------------------------------------------------------------------------------------------------
# The estimators and the predicted standard error, against simulations
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [2, 8])
def test_the_signal_is_unbiased_and_the_plug_in_is_not(G):
    g = torch.Generator().manual_seed(G)
    p = torch.rand(400, generator=g, dtype=torch.float64) ** 3  # skewed towards hard prompts, like GSM8K's
    q = p * (1 - p)
    reps = [preflight.signal_stats((torch.rand(400, G, generator=g, dtype=torch.float64) < p[:, None]).double())
            for _ in range(300)]  # fmt: skip
    signal = sum(r["signal"] for r in reps) / len(reps)
    assert signal == pytest.approx(q.mean().item(), rel=0.03)
    plug_in = signal * (G - 1) / G  # mean p_hat (1 - p_hat): low by (G - 1) / G
    assert abs(plug_in - q.mean().item()) > 3 * abs(signal - q.mean().item())
    if G >= 4:  # E[q^2] unbiased from G >= 4 samples
        assert sum(r["signal_sq"] for r in reps) / len(reps) == pytest.approx((q * q).mean().item(), rel=0.05)
    else:  # the bound E[q^2] <= E[q] / 4
        assert reps[0]["signal_sq"] >= (q * q).mean().item() and not reps[0]["signal_sq_unbiased"]
    one = reps[0]
    assert one["prompts"] == 400 and one["samples_per_prompt"] == G and one["samples"] == 400 * G
    assert 0 < one["informative"] == one["informative_prompts"] / 400 < 1


def _simulated_nmse(p: torch.Tensor, k: int, n: int | None, weights: torch.Tensor | None, reps: int, seed: int):
    """reps measurements of the states of true value p through measure.baseline_error: K fresh returns each, the
    baseline the truth (n None) or the mean of n other returns (GRPO's leave-one-out mean at the prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(reps):
        returns = (torch.rand(len(p), k, generator=g, dtype=torch.float64) < p[:, None]).double()
        pred = (
            p if n is None else (torch.rand(len(p), n, generator=g, dtype=torch.float64) < p[:, None]).double().mean(-1)
        )
        out.append(measure.baseline_error(pred, returns.mean(-1), k, weights=weights, mc_var=returns.var(-1))["nmse"])
    return torch.tensor(out)


@pytest.mark.parametrize("k,n", [(8, None), (8, 7), (4, None), (4, 3)])
def test_the_predicted_standard_error_matches_a_simulation_of_the_measurement(k, n):
    g = torch.Generator().manual_seed(k * 10 + (n or 0))
    p = torch.rand(300, generator=g, dtype=torch.float64)
    q = p * (1 - p)
    nmse = _simulated_nmse(p, k, n, None, 1500, 1)
    se = preflight.predicted_se(q.mean().item(), (q * q).mean().item(), len(p), k, n)
    assert nmse.mean().item() == pytest.approx(0.0 if n is None else 1 / n, abs=3 * se / math.sqrt(1500) + 1e-3)
    assert nmse.std().item() == pytest.approx(se, rel=0.08)


def test_the_standard_error_counts_token_weighted_states_by_their_effective_number():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 60, (80,), generator=g).tolist()
    w = torch.tensor([x for n in lengths for _, x in measure.mc_state_positions(n, 2, 0)], dtype=torch.float64)
    p = torch.rand(len(w), generator=g, dtype=torch.float64)
    q = p * (1 - p)
    nmse = _simulated_nmse(p, 8, None, w, 1500, 2)
    plan = preflight.measurement_plan({"mc_every": 1, "total_steps": 2, "mc_prompts": 80, "mc_states": 2}, lengths)
    assert plan["measurements"] == 1 and plan["prompt_states"] == 80 and plan["states"] == len(w)
    assert plan["effective_states"] == pytest.approx(w.sum().item() ** 2 / (w * w).sum().item(), rel=0.02)
    assert plan["effective_states"] < 0.8 * len(w)  # the prompt state weighs 1, a state inside ~ length / 2
    se = preflight.predicted_se(q.mean().item(), (q * q).mean().item(), plan["effective_states"], 8, None)
    assert nmse.std().item() == pytest.approx(se, rel=0.1)
    assert nmse.std().item() > 1.15 * preflight.predicted_se(q.mean().item(), (q * q).mean().item(), len(w), 8, None)


def _prompt_values(n: int, pass_rate: float, g: torch.Generator) -> torch.Tensor:
    """n prompts' success rates, GSM8K-like: a third never solved, the rest Beta-spread around the pass rate."""
    a = 0.8
    b = a * (1 / (1.5 * pass_rate) - 1)  # the solvable two thirds have mean 1.5 x pass_rate
    beta = torch.distributions.Beta(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    solvable = torch.rand(n, generator=g, dtype=torch.float64) < 2 / 3
    with torch.random.fork_rng(devices=[]):  # Beta samples from the global generator: seeded from g, left as it was
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        values = beta.sample((n,))
    return torch.where(solvable, values, torch.zeros(n, dtype=torch.float64))


def _layout(n: int, M: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The measured states of n completions of 20-200 tokens: prompt of each, tokens written, token weight."""
    lengths = torch.randint(20, 200, (n,), generator=g).tolist()
    picked = [(c, t, w) for c in range(n) for t, w in measure.mc_state_positions(lengths[c], M, c)]
    return (
        torch.tensor([c for c, _, _ in picked]),
        torch.tensor([x for _, x, _ in picked]),
        torch.tensor([x for _, _, x in picked], dtype=torch.float64),
    )


def _two_point_states(p: torch.Tensor, d: float, G: int, K: int, M: int, g: torch.Generator, layout=None) -> dict:
    """One measured completion per prompt (its group's first of G), as a run measures it: the prompt state and M
    token-weighted states inside (measure.mc_state_positions), K fresh 0/1 returns from each. The value process
    of tests/test_intervals.py: a state inside already holds the completion's outcome R with probability d
    (V(s_t) = R), else nothing yet (V(s_t) = p), so d of the outcome's variance is resolved there."""
    n = len(p)
    scores = (torch.rand(n, G, generator=g, dtype=torch.float64) < p[:, None]).double()  # [n, G]; column 0 measured
    comp, t, w = layout or _layout(n, M, g)
    resolved = (t > 0) & (torch.rand(len(t), generator=g, dtype=torch.float64) < d)
    value = torch.where(resolved, scores[comp, 0], p[comp])  # [S] V(s) of each state
    returns = (torch.rand(len(t), K, generator=g, dtype=torch.float64) < value[:, None]).double()  # [S, K]
    return {"scores": scores, "comp": comp, "t": t, "w": w, "returns": returns, "value": value}


def _simulated_run_nmse(pass_rate: float, d: float, m: int, reps: int, seed: int, G: int = 8, K: int = 8):
    """reps runs' pooled nmse through measure.baseline_error_by_state, each run m measured completions of fresh
    prompts: GRPO's leave-one-out mean and a perfect critic, at the prompt states and over every state."""
    g = torch.Generator().manual_seed(seed)
    out = {key: [] for key in ("grpo", "grpo_prompt", "perfect", "perfect_prompt")}
    layout = _layout(m, 2, g)
    for _ in range(reps):
        s = _two_point_states(_prompt_values(m, pass_rate, g), d, G, K, 2, g, layout)
        loo = s["scores"][:, 1:].mean(-1)[s["comp"]]  # [S] the other G - 1 of the measured completion's group
        p_hat, var = s["returns"].mean(-1), s["returns"].var(-1)
        for name, pred in (("grpo", loo), ("perfect", s["value"])):
            parts = measure.baseline_error_by_state(pred, p_hat, K, s["t"], s["comp"], s["w"], var)
            out[name].append(parts[""]["nmse"])
            out[f"{name}_prompt"].append(parts["_prompt"]["nmse"])
    return {key: torch.tensor(v) for key, v in out.items()}


@pytest.mark.parametrize("pass_rate,d", [(0.3, 0.3), (0.3, 0.6), (0.05, 0.3)])
def test_the_preflight_predicts_the_standard_error_of_what_the_report_compares(pass_rate, d):
    """The report compares GRPO's and the critics' nmse at the prompt states and over token-weighted states. One
    preflight sample (a large one here, so that its own noise is small) predicts each standard error of one run
    of the study's 608 measured completions; 300 simulated runs measure it. The old prediction, the prompt
    state's alone, reads 3-4x below GRPO's standard error over states. GRPO's error over states has a heavy tail
    (a long completion's resolved states weigh ~100 each): over six seeds of this test its predicted standard error
    read 0.80-1.16 of the simulated one, whose own noise at 300 runs is ~8%; the others 0.92-1.07."""
    G, K, m = 8, 8, 608  # the study's plan: 19 measurements x 32 prompts
    g = torch.Generator().manual_seed(int(100 * pass_rate + 10 * d))
    p = _prompt_values(4000, pass_rate, g)
    s = _two_point_states(p, d, G, K, 2, g)
    stats = preflight.signal_stats(s["scores"])
    states = preflight.state_stats(s["scores"], s["comp"], s["t"], s["w"], s["returns"])
    se = preflight.predicted_errors(stats, states, prompt_states=m, k=K, group_size=G)
    sim = _simulated_run_nmse(pass_rate, d, m, 300, seed=int(1000 * d))
    assert se["se_grpo_prompt"] == pytest.approx(sim["grpo_prompt"].std().item(), rel=0.1)
    assert se["se_perfect_prompt"] == pytest.approx(sim["perfect_prompt"].std().item(), rel=0.1)
    assert se["se_grpo_states"] == pytest.approx(sim["grpo"].std().item(), rel=0.2)
    assert se["se_perfect_states"] == pytest.approx(sim["perfect"].std().item(), rel=0.1)
    assert se["nmse_grpo_states"] == pytest.approx(sim["grpo"].mean().item(), rel=0.15)
    assert se["resolved"] == pytest.approx(d, abs=0.05)
    assert sim["grpo"].std().item() > 2.5 * se["se_grpo_prompt"], "over states GRPO's nmse is far noisier"


@pytest.mark.parametrize("G", [2, 4, 8])
def test_the_resolved_share_is_unbiased_when_a_completions_length_follows_its_outcome(G):
    """As on GSM8K, a right answer ends early (20 tokens) and a wrong one runs to the limit (400): the token weights
    of a completion's states follow its own outcome. q estimated from a group that holds that outcome correlated
    with the weights: at d = 0.3 it read 0.06-0.11 at G = 2 and 0.23-0.27 at G = 8. Estimated from the other G - 1
    rewards and the prompt state's K returns, q is independent of them, and d reads d within its standard error."""
    g = torch.Generator().manual_seed(G)
    n, d, K = 4000, 0.3, 8
    p = _prompt_values(n, 0.15, g)
    scores = (torch.rand(n, G, generator=g, dtype=torch.float64) < p[:, None]).double()  # [n, G]; column 0 measured
    lengths = [20 if right else 400 for right in scores[:, 0].tolist()]
    picked = [(c, t, w) for c in range(n) for t, w in measure.mc_state_positions(lengths[c], 2, c)]
    comp, t = torch.tensor([c for c, _, _ in picked]), torch.tensor([t for _, t, _ in picked])
    w = torch.tensor([w for _, _, w in picked], dtype=torch.float64)
    resolved = (t > 0) & (torch.rand(len(t), generator=g, dtype=torch.float64) < d)  # _two_point_states' process
    value = torch.where(resolved, scores[comp, 0], p[comp])  # [S]
    returns = (torch.rand(len(t), K, generator=g, dtype=torch.float64) < value[:, None]).double()  # [S, K]
    estimate, se = preflight.resolved_share(scores, comp, t, w, returns)
    assert se < 0.03 and abs(estimate - d) < 3 * se, (estimate, se)


def test_the_resolved_share_reads_below_zero_by_noise_and_its_standard_error_says_how_far():
    """d is a ratio of unbiased sums. Where nothing is resolved inside (d = 0) it reads below 0 about half the time,
    its mean is 0 up to the ratio's O(1/n) bias, and its standard error (delta method, completions as units) is the
    spread of its reading: at 64 prompts x 2 as at 4000. At the smoke preflight's 8 prompts x 2 (K = 4) even a true
    d of 0.3 reads below 0 about one time in five: its -0.139 +- 0.174 is noise, not a fault."""
    g = torch.Generator().manual_seed(5)
    for n, d, reps in ((64, 0.0, 400), (8, 0.3, 1000)):
        layout = _layout(n, 2, g)
        samples = (_two_point_states(_prompt_values(n, 0.3, g), d, 2, 4, 2, g, layout) for _ in range(reps))
        runs = [preflight.resolved_share(s["scores"], s["comp"], s["t"], s["w"], s["returns"]) for s in samples]
        values = torch.tensor([r for r, _ in runs if math.isfinite(r)], dtype=torch.float64)
        ses = torch.tensor([se for r, se in runs if math.isfinite(r)], dtype=torch.float64)
        below = (values < 0).double().mean().item()
        if d == 0:
            assert 0.35 < below < 0.65 and abs(values.mean().item()) < 0.05, (below, values.mean().item())
            assert values.std().item() == pytest.approx(ses.median().item(), rel=0.2)
            assert ((values - d).abs() <= 2 * ses).double().mean().item() > 0.9
        else:
            assert len(values) > 0.95 * reps and 0.1 < below < 0.35, below


def test_the_predicted_half_width_is_the_median_of_the_reports_3_seed_interval():
    """half_width_3_seeds: the half-width that intervals.ratio_interval prints for GRPO's nmse at the prompt over 3
    seeds' sums (the report's interval), its median over 2,000 simulated studies of 3 runs x 608 prompt states."""
    G, K, m, studies = 8, 8, 608, 2000
    g = torch.Generator().manual_seed(5)
    p = _prompt_values(studies * 3 * m, 0.3, g).view(studies, 3, m)
    loo = (torch.rand(studies, 3, m, G - 1, generator=g, dtype=torch.float64) < p[..., None]).double().mean(-1)
    returns = (torch.rand(studies, 3, m, K, generator=g, dtype=torch.float64) < p[..., None]).double()
    num = ((loo - returns.mean(-1)) ** 2 - returns.var(-1) / K).sum(-1)  # [studies, 3] sum_sq_err_nc
    den = returns.var(-1).sum(-1)  # [studies, 3] sum_signal_var
    halves = []
    for a, b in zip(num.tolist(), den.tolist()):
        _, lo, hi = intervals.ratio_interval(a, b)
        halves.append((hi - lo) / 2)
    stats = preflight.signal_stats(
        (torch.rand(4000, G, generator=g, dtype=torch.float64) < p.flatten()[:4000, None]).double()
    )
    se = preflight.predicted_se(stats["signal"], stats["signal_sq"], m, K, G - 1)
    predicted = intervals.median_half_width(se, 3)
    assert predicted == pytest.approx(torch.tensor(halves).median().item(), rel=0.06)
    assert predicted == pytest.approx(4.303 * math.sqrt(math.log(2)) / math.sqrt(3) * se, rel=1e-3)  # chi2(2): 2 ln 2


def _told_apart(pass_rate: float, delta: float, studies: int, seed: int) -> tuple[float, float]:
    """3-seed studies of the study's plan (608 prompt states a run, K = G = 8): GRPO's leave-one-out mean against a
    critic whose nmse at the prompt is 1/(G-1) - delta (its error Normal, independent of the outcome). Returns the
    share of studies whose "less GRPO's" interval at the prompt (intervals.ratio_difference_interval, paired by
    seed) lies below 0, and the median half-width of GRPO's own 3-seed interval there."""
    G, K, m, S = 8, 8, 608, 3
    g = torch.Generator().manual_seed(seed)
    p = _prompt_values(studies * S * 2 * m, pass_rate, g).view(studies, S, 2, m)  # [studies, seed, GRPO|critic, m]
    returns = (torch.rand(studies, S, 2, m, K, generator=g, dtype=torch.float64) < p[..., None]).double()
    p_hat, s2 = returns.mean(-1), returns.var(-1)
    loo = (torch.rand(studies, S, m, G - 1, generator=g, dtype=torch.float64) < p[:, :, 0, :, None]).double().mean(-1)
    sigma = math.sqrt((1 / (G - 1) - delta) * (p * (1 - p)).mean().item())
    critic = p[:, :, 1] + sigma * torch.randn(studies, S, m, generator=g, dtype=torch.float64)
    num = torch.stack([((b - p_hat[:, :, i]) ** 2 - s2[:, :, i] / K).sum(-1) for i, b in enumerate((loo, critic))])
    den = s2.sum(-1).movedim(2, 0)  # [2, studies, S]
    told, halves = 0, []
    for i in range(studies):
        _, _, hi = intervals.ratio_difference_interval(num[1, i].tolist(), den[1, i].tolist(), num[0, i].tolist(),
                                                       den[0, i].tolist())  # fmt: skip
        told += hi < 0
        _, lo, top = intervals.ratio_interval(num[0, i].tolist(), den[0, i].tolist())
        halves.append((top - lo) / 2)
    return told / studies, torch.tensor(halves).median().item()


def test_the_default_smallest_effect_tells_apart_what_the_docs_say():
    """docs/measurement.md's justification of --smallest-effect 0.05: where GRPO's 3-seed half-width at the prompt is
    at most 0.05 (an informative share of ~0.5 here), a critic 0.10 below GRPO's 1/(G-1) is told apart in ~92% of
    3-seed studies and one 0.05 below in ~40%; at a share of ~0.26 the half-width reads ~0.06 and they fall to
    ~73% and ~32%."""
    power, half = _told_apart(0.3, 0.10, 600, 1)
    assert half <= preflight.SMALLEST_EFFECT and power >= 0.85, (power, half)
    power, _ = _told_apart(0.3, 0.05, 600, 2)
    assert 0.33 <= power <= 0.52, power
    power, half = _told_apart(0.05, 0.10, 600, 3)
    assert half > preflight.SMALLEST_EFFECT and power < 0.85, (power, half)


def test_the_measurement_plan_counts_what_the_report_pools():
    args = {"mc_every": 10, "total_steps": 200, "mc_prompts": 32, "mc_states": 2}
    plan = preflight.measurement_plan(args, [100] * 8)
    assert plan["measurements"] == 19  # steps 0, 10, ..., 190, the first left out
    assert plan["prompt_states"] == 19 * 32 and plan["states"] == 19 * 32 * 3
    assert preflight.measurement_plan({**args, "mc_every": 0}, [100])["states"] == 0
    assert math.isnan(preflight.predicted_se(0.0, 0.0, 100, 8, None))  # no signal: nothing to predict


# ------------------------------------------------------------------------------------------------------
# ./sweep.sh --preflight on the tiny model: the toy task passes, GSM8K does not, and a sweep stops before any run
# ------------------------------------------------------------------------------------------------------


def test_the_toy_task_passes_the_preflight_and_writes_its_json(tmp_path):
    proc = sweep("--preflight", "--smoke", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    p = json.loads((tmp_path / "preflight.json").read_text())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("preflight:")]
    assert len(lines) == 1 and "enough signal" in lines[0] and f"informative share {p['informative']:.2f}" in lines[0]
    for key in FIELDS:
        assert key in p, key
    # --smoke asks for no effect (its 2 prompt states tell none apart): the toy task passes on its signal alone
    assert p["passed"] and p["smallest_effect"] == 0 and p["informative"] > 0
    # the reference GRPO line as the sweep builds it: --smoke's sizes and the toy task
    assert p["settings"]["task"] == "toy" and p["settings"]["model"] == "tiny" and p["samples_per_prompt"] == 2
    assert p["settings"]["max_new_tokens"] == 8 and p["prompts"] == preflight.CPU_PROMPTS
    pr = p["predicted"]
    assert pr["mc_samples"] == 4 and pr["prompt_states"] == 2 and pr["states"] == 6 and pr["nmse_grpo_prompt"] == 1.0
    for key in ("se_grpo_prompt", "se_grpo_states", "se_perfect_prompt", "se_perfect_states", "half_width_3_seeds"):
        assert pr[key] > 0, key
    assert pr["bounds"] == ["se_grpo_prompt", "se_perfect_prompt", "half_width_3_seeds"]  # G = 2: E[q^2] <= E[q]/4
    assert "<= " + f"{pr['se_grpo_prompt']:.3f}" in lines[0] and f"<= {pr['half_width_3_seeds']:.3f}" in lines[0]
    assert f"{pr['effective_states']:,.0f} effective of {pr['states']:,} token-weighted states" in lines[0]
    # the measurement made on the sample: the first completion of each prompt, its prompt state and 2 inside
    assert pr["measured_completions"] == p["prompts"] and p["prompts"] < pr["measured_states"] <= 3 * p["prompts"]
    assert not [d for d in tmp_path.iterdir() if d.is_dir()], "the preflight made a folder"
    # the same sample asked for the default smallest effect: 2 prompt states are far too few, so it refuses
    proc = subprocess.run(
        [sys.executable, "-m", "study.preflight", "--out", str(tmp_path / "d"), "--", *p["command"]],
        cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr + proc.stdout
    q = json.loads((tmp_path / "d" / "preflight.json").read_text())
    assert q["smallest_effect"] == preflight.SMALLEST_EFFECT == sweep_runner.SMALLEST_EFFECT
    half = q["predicted"]["half_width_3_seeds"]
    assert half > preflight.SMALLEST_EFFECT and f"refused: half-width {half:.3f} > smallest effect 0.05" in proc.stdout


def test_gsm8k_on_the_tiny_model_is_refused_and_a_sweep_stops_before_any_run_folder_exists(tmp_path):
    flags = ("--smoke", "--out", tmp_path, "--preflight-prompts", "4", "--", "--task", "gsm8k")
    proc = sweep("--preflight", *flags)
    assert proc.returncode == 3, proc.stderr + proc.stdout
    line = proc.stdout.strip().splitlines()[-1]
    assert (
        "refused: no half-width to set against" in line
        and "(no prompt with 0 < p < 1)" in line
        and "pass rate 0.000" in line
    )
    assert "informative share 0.00" in line
    p = json.loads((tmp_path / "preflight.json").read_text())
    assert not p["passed"] and p["prompts"] == 4 and p["pass_rate"] == 0 and p["settings"]["task"] == "gsm8k"
    assert p["predicted"]["se_grpo_prompt"] is None and p["predicted"]["half_width_3_seeds"] is None  # no signal
    # the sweep itself: the same preflight (reused: the same command), refused, and nothing of a run written
    proc = sweep(*flags)
    assert proc.returncode == 3, proc.stderr + proc.stdout
    assert "(reused from" in proc.stdout
    refusal = [line for line in proc.stderr.splitlines() if line.startswith("sweep: not started")]
    assert len(refusal) == 1 and "informative share 0.00" in refusal[0] and "0 of 4 prompts" in refusal[0]
    assert "no standard error to predict" in refusal[0]
    assert "--force" in refusal[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == [".lock", "preflight.json"]  # no run, no plan, no log


def test_the_sweeps_refusal_names_the_half_width_and_the_smallest_effect(tmp_path):
    """The one line that stops a sweep: the predicted half-width against the smallest effect, and the counts."""
    p = {"informative": 0.26, "informative_prompts": 66, "prompts": 256, "samples_per_prompt": 8, "pass_rate": 0.05,
         "signal": 0.03, "smallest_effect": 0.05, "predicted": {"half_width_3_seeds": 0.058}}  # fmt: skip
    (tmp_path / "preflight.json").write_text(json.dumps(p))
    line = sweep_runner.refusal(SimpleNamespace(out=tmp_path))
    assert "+- 0.058 over 3 seeds (predicted), wider than the smallest effect 0.05" in line
    assert "informative share 0.26: 66 of 256 prompts x 8" in line and "--force" in line


def test_the_dry_run_shows_the_preflight_as_the_sweep_builds_it(tmp_path):
    out = tmp_path / "out"
    proc = sweep("--preflight", "--smoke", "--dry-run", "--out", out, "--", "--lr", "2e-6")
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    assert "-m study.preflight --out" in line and " -- grpo.py --run-dir " in line and "--model tiny" in line
    assert "--group-size 2" in line and "--task toy" in line and line.endswith("--lr 2e-6")  # smoke, then the extra
    full = sweep("--smoke", "--dry-run", "--out", out)
    assert "# preflight first: h2h/grpo-group for seed 1" in full.stdout
    assert "# preflight first" not in sweep("--smoke", "--dry-run", "--force", "--out", out).stdout
    assert not out.exists()


def test_a_model_that_cannot_be_fetched_is_one_error_line(tmp_path):
    proc = sweep("--preflight", "--smoke", "--out", tmp_path, "--", "--model", "no-such-org/no-such-model")
    line = check_one_error_line(proc)
    assert proc.returncode == 2 and "no-such-org/no-such-model" in line


def test_the_preflight_reads_a_trainers_settings_in_process_without_loading_anything(tmp_path, monkeypatch):
    """The trainer named after -- is imported and its Args and CPU preset go through runtime.cli in this process: no
    subprocess, no model, no run folder."""
    import grpo

    def refused(*a, **k):
        raise AssertionError("the preflight started a process or loaded a model to read the settings")

    monkeypatch.setattr(subprocess, "run", refused)
    monkeypatch.setattr(subprocess, "Popen", refused)
    monkeypatch.setattr(models, "load_model", refused)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --scale cpu, not the machine, picks the preset
    run_dir = tmp_path / "r"
    args = preflight.trainer_settings(
        ["grpo.py", "--model", "tiny", "--scale", "cpu", "--group-size", "3", "--run-dir", str(run_dir)]
    )
    assert args["group_size"] == 3 and args["model"] == "tiny"  # the flags given win
    assert args["max_new_tokens"] == grpo.CPU_SCALE["smollm2"]["max_new_tokens"] == 96  # tiny's CPU preset applied
    assert args["scale"] == "cpu" and not run_dir.exists()
    assert preflight.trainer_settings([str(REPO / "grpo.py")])["group_size"] == grpo.Args().group_size


@pytest.mark.parametrize(
    "command,named",
    [
        (["report.py", "--out", "x"], "report.py"),
        (["sweep_runner.py"], "sweep_runner.py"),
        (["bench/throughput.py"], "bench/throughput.py"),
        (["/elsewhere/grpo.py"], "/elsewhere/grpo.py"),
        ([], "grpo.py"),
        (["dpo.py"], "--group-size"),
        (["grpo.py", "--group-size", "two"], "--group-size"),
    ],
)
def test_a_command_the_preflight_cannot_sample_is_one_line(command, named):
    """Only a trainer of this repository (and one with a group) is sampled; anything else, or a bad flag in the
    trainer's command, is a UserError of one line (run_main: `error:` and exit 2), raised in this process."""
    from plumbing import errors

    with pytest.raises(errors.UserError) as e:
        preflight.trainer_settings(command)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------------
# The measurement's informative-state count, and the report
# ------------------------------------------------------------------------------------------------------


def test_monte_carlo_counts_the_informative_states(tiny_tokenizer):

    model = models.load_model(models.TINY_MODEL, tiny_tokenizer, 0).eval()
    prompts = [gsm8k.encode_prompt(tiny_tokenizer, q, "chat") for q in ("one", "two plus two", "three")]
    responses = [[5, 17, 32, 8], [40, 41], [16, 2, 3]]
    out, _ = measure.monte_carlo(
        model, tiny_tokenizer, prompts=prompts, responses=responses, golds=["1", "2", "3"], groups=[0, 1, 2],
        row_ids=[0, 1, 2], baselines={"b": torch.zeros(3, 8)}, states=2, k=4, max_new_tokens=6, seed=1, step=0,
        task="toy", temperature=1.0, top_p=1.0,
    )  # fmt: skip
    assert out["states"] == 3 + 2 + 1 + 2  # each prompt state, and up to 2 inside each completion
    assert 0 < out["informative_states"] <= out["states"]
    assert out["informative_states"] >= out["b/signal_groups"]  # a prompt with signal has a state with it


def _run(root: Path, name: str, informative_prompts: float, informative_states: float) -> None:
    """A GRPO run of 3 measurements, each of 32 prompt states and 96 states in all, with these informative counts."""
    run_dir = root / "h2h" / name
    run_dir.mkdir(parents=True)
    res = {"method": "grpo", "critic": "group", "seed": 1, "steps": 2, "generated_tokens": 10, "args": {},
           "test": {"accuracy": 0.1, "n": 8, "ci95": [0.0, 0.4]}}  # fmt: skip
    (run_dir / "results.json").write_text(json.dumps(res))
    sums = {"n": 32.0, "weight": 32.0, "sum_err": 0.0, "sum_sq_err_nc": 0.5, "sum_centred_sq_nc": 0.5,
            "sum_signal_var": 4.0, "sum_value_var_nc": 1.0, "groups": 32.0}  # fmt: skip
    rows = [
        {"step": s, "mc/informative_states": informative_states, "mc/states": 96.0,
         **{f"mc/loo/{k}": v for k, v in sums.items()}, "mc/loo/signal_groups": informative_prompts,
         **{f"mc/loo_prompt/{k}": v for k, v in sums.items()}, "mc/loo_prompt/signal_groups": informative_prompts}
        for s in (1, 2, 3)
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_opens_with_the_preflight_and_warns_of_few_informative_states(tmp_path):
    """The opening names each standard error with where it is measured, and the rule. A run is warned of when its
    prompt states' informative share is below preflight.MIN_INFORMATIVE: the share the preflight measures, at the
    prompt. The states inside are more often decided (a share of 0.63 at the prompt reads ~0.50 over states at
    d = 0.3), so a count over every state against the prompts' share warned of runs that had the signal."""
    _run(tmp_path, "grpo-group-s1", 16.0, 15.0)  # prompts 0.50, every state 0.16: had the signal
    _run(tmp_path, "grpo-group-s2", 3.0, 40.0)  # prompts 0.09: too few where GRPO is compared for noise
    p = {"settings": {"model": "tiny", "task": "toy", "temperature": 1.0, "max_new_tokens": 8}, "prompts": 8,
         "samples_per_prompt": 2, "pass_rate": 0.1875, "signal": 0.1875, "informative": 0.375,
         "informative_prompts": 3, "smallest_effect": 0.05, "passed": True, "written": "2026-12-01 21:00",
         "predicted": {"se_grpo_prompt": 1.054, "se_perfect_prompt": 0.333, "se_grpo_states": 1.266,
                       "se_perfect_states": 0.21, "nmse_grpo_prompt": 1.0, "nmse_grpo_states": 0.978,
                       "resolved": -0.139, "se_resolved": 0.174, "half_width_3_seeds": 2.18, "prompt_states": 2, "states": 6, "effective_states": 5.02,
                       "mc_samples": 4, "bounds": ["se_grpo_prompt"]}}  # fmt: skip
    (tmp_path / "preflight.json").write_text(json.dumps(p))
    md = report.write_report(tmp_path, tmp_path / "report").read_text().splitlines()
    opening = md[2]
    assert opening.startswith("**Preflight**") and "pass rate 0.188" in opening
    assert "outcome variance E[p(1-p)] 0.1875" in opening and "informative share 0.38" in opening
    assert "resolved share inside d -0.139 +- 0.174." in opening  # below 0 by noise: its standard error beside it
    assert "1.000 +- <= 1.054 at 2 prompt states" in opening and "0.978 +- 1.266 over 5 effective of 6" in opening
    assert (
        "0 +- 0.333 and 0 +- 0.210" in opening
        and "+- 2.180 (median), against the smallest effect 0.05: passed" in opening
    )
    warnings = [line for line in md if "warning:" in line]
    assert len(warnings) == 1 and "h2h/grpo-group-s2" in warnings[0], warnings
    assert "6 of 64 prompt states" in warnings[0] and "0.09 < 0.2" in warnings[0]  # the two after the first
    old = {key: p[key] for key in p if key != "smallest_effect"} | {"threshold": {"informative": 0.2}}
    (tmp_path / "preflight.json").write_text(json.dumps(old))  # one written before the smallest effect
    md = report.write_report(tmp_path, tmp_path / "report").read_text().splitlines()
    assert "written by an older preflight" in md[2] and "damaged" not in md[2]
    (tmp_path / "preflight.json").unlink()
    md = report.write_report(tmp_path, tmp_path / "report").read_text().splitlines()
    assert md[2].startswith("Preflight: none") and len([line for line in md if "warning:" in line]) == 1
