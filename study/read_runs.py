"""Reading a sweep's runs: each run folder's results.json and metrics.jsonl as one dict, and the numbers' formats.

Holds: the experiments and the variants' order, a run's name (its variant, GRPO's group size where it is an axis, a
pretrained critic's rollouts and price), reading metrics.jsonl, pooling a run's Monte Carlo measurements
(measure.pool_baseline_errors) into its baseline error, the interval over seeds of an nmse, a run's curves, the
run folders of a sweep and its plan, and how the report prints a number (percent, tokens, seconds, intervals).
Does not hold: the tables and report.md (report.py), the plots (plots.py), the duration estimate (estimate.py).
It only reads: nothing here writes or moves a run folder.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import intervals
import measure
from plumbing import cmdline, errors, rundir

EXPERIMENTS = ("critic", "h2h", "labels", "crossover")
# GRPO's G in the study (grpo.py's default, read from its source: no study tool imports a trainer but the preflight)
STUDY_GROUP = cmdline.trainer_default("grpo.py", "group_size")
# the experiments whose GRPO runs differ in G by design: a run there not at the study's G carries its G in its name
# (grpo-group-g4), the one at the study's G keeps the name every comparison reads (grpo-group: "vs GRPO")
GROUP_AXIS = ("crossover", "spread", "size")
VARIANT_ORDER = [
    "ppo-none",
    "ppo-small",
    "ppo-medium",
    "ppo-large",
    "ppo-full",
    "grpo-group",
    "grpo-group-unscaled",
    "dpo-self-offline",
    "dpo-self-online",
    "dpo-gold-offline",
    "dpo-gold-online",
]
# The baseline each method's MC measurement scores (metrics.jsonl: mc/<name>/<key>, measure.baseline_error): PPO's
# critic; GRPO's leave-one-out mean, the effective baseline of its group-mean advantage ((G-1)/G (r - loo)).
ERROR_COLUMNS = [
    "nmse",
    "nmse_centred",
    "within_nmse",
    "bias",
    "rmse",
    "explained_variance",
    "informative_any",
    "informative_share",
]


def error_columns(pooled: dict[str, float], prompt: dict[str, float] | None = None) -> dict[str, float]:
    """ERROR_COLUMNS from measure.pool_baseline_errors' ratios over every state (pooled) and over the prompt states
    (prompt). Its signal_fraction is a share of measured prompts whose K 0/1 scores are not all equal: over the
    prompt states, the informative share (as the preflight measures it, and named so); over every state, a prompt
    with any such state (informative_any: the states inside are more often decided, so it differs)."""
    named = {
        **pooled,
        "informative_any": pooled.get("signal_fraction", float("nan")),
        "informative_share": (prompt or {}).get("signal_fraction", float("nan")),
    }
    return {key: named.get(key, float("nan")) for key in ERROR_COLUMNS}


MC_BASELINE = {"ppo": "value", "grpo": "loo"}

# ======================================================================================================
# Reading runs
# ======================================================================================================


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows; a half-written line (a killed run) is skipped."""
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if finite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def measurement_sums(row: dict[str, Any], name: str) -> dict[str, float]:
    """One MC measurement's pooled sums (measure.POOLED_SUMS) of baseline `name`, from its metrics.jsonl row."""
    return {k: float(row[f"mc/{name}/{k}"]) for k in measure.POOLED_SUMS if finite(row.get(f"mc/{name}/{k}"))}


def mc_summary(rows: list[dict[str, Any]], method: str) -> dict[str, Any]:
    """The run's baseline error: its MC measurements after the first (the untrained critic) pooled as sums
    (measure.pool_baseline_errors). "sums" carries them on, so that seeds pool again, and "per_measurement" each
    measurement's (the units of a one-seed interval); "prompt_sums" the same at the prompt states only (nmse_prompt:
    where GRPO's leave-one-out mean reads 1/(G-1); runs measured before it leave it empty), and for GRPO
    "group_sums", its group mean with the completion's own reward in it (nmse_group_mean: over every state, where it
    reads (1 + (G-2) d) / (G (1 - d)); nmse_group_mean_prompt: at the prompt, 1/G). "old_format" marks a run
    measured before baseline_error (mc/value/centred_rmse and no sums): its columns stay empty."""
    name = MC_BASELINE.get(method, "value")
    meas = [r for r in rows if finite(r.get(f"mc/{name}/sum_signal_var"))]
    if len(meas) > 1:
        meas = meas[1:]
    per_measurement = [measurement_sums(r, name) for r in meas]
    pooled = measure.pool_baseline_errors(per_measurement)
    prompt = [measurement_sums(r, f"{name}_prompt") for r in meas]
    prompt = prompt if all(prompt) else []  # every measurement has it, or none counts
    prompt_pooled = measure.pool_baseline_errors(prompt)
    out: dict[str, Any] = error_columns(pooled, prompt_pooled)
    out["sums"] = {k: v for k, v in pooled.items() if k in measure.POOLED_SUMS}
    out["per_measurement"] = per_measurement
    out["prompt_per_measurement"] = prompt
    out["prompt_sums"] = {k: v for k, v in prompt_pooled.items() if k in measure.POOLED_SUMS}
    out["nmse_prompt"] = prompt_pooled.get("nmse", float("nan"))
    out["measurements"] = float(len(meas))
    out["old_format"] = not meas and any(finite(r.get("mc/value/centred_rmse")) for r in rows)
    if method == "grpo":  # the group mean with the completion's own reward in it, for comparison
        out["group_sums"] = measure.pool_baseline_errors([measurement_sums(r, "group") for r in meas])
        out["nmse_group_mean"] = out["group_sums"].get("nmse", float("nan"))
        group_prompt = [measurement_sums(r, "group_prompt") for r in meas]
        out["group_prompt_sums"] = measure.pool_baseline_errors(group_prompt if all(group_prompt) else [])
        out["nmse_group_mean_prompt"] = out["group_prompt_sums"].get("nmse", float("nan"))
    return out


# the numerator of each pooled ratio (measure.baseline_error_ratios), and the sums it pools: every state or the prompt's
NMSE_SUMS = {
    "nmse": ("sum_sq_err_nc", ""),
    "nmse_centred": ("sum_centred_sq_nc", ""),
    "within_nmse": ("sum_within_sq_nc", ""),
    "nmse_prompt": ("sum_sq_err_nc", "prompt_"),
}


def nmse_units(rs: list[dict[str, Any]], key: str) -> tuple[list[dict[str, float]], str]:
    """The units of a pooled baseline-error ratio of the runs rs (seeds of one method-variant): each seed's sums, or,
    with one seed, its measurements (what that run's critic did, nothing about other seeds)."""
    num_key, part = NMSE_SUMS[key]
    if len(rs) > 1:
        units, label = [r["mc"][f"{part}sums"] for r in rs], "seeds"
    else:
        units, label = rs[0]["mc"][f"{part}per_measurement"], "measurements, 1 seed"
    return [u for u in units if u and num_key in u and "sum_signal_var" in u], label


def nmse_interval(rs: list[dict[str, Any]], key: str = "nmse") -> tuple[float, float, float, str]:
    """A pooled baseline-error ratio of the runs rs (seeds of one method-variant) and its 95% interval, centred on
    it: intervals.ratio_interval with the seeds as units (it carries their variance), or, with one seed, its
    measurements as units (nmse_units). -> value, lo, hi, units."""
    num_key, part = NMSE_SUMS[key]
    units, label = nmse_units(rs, key)
    pooled = measure.pool_baseline_errors([r["mc"][f"{part}sums"] for r in rs]).get(key.removesuffix("_prompt"))
    lo = hi = float("nan")
    if len(units) >= len(rs):  # a seed without this measurement (an old run): the seeds that have it, no interval
        _, lo, hi = intervals.ratio_interval([u[num_key] for u in units], [u["sum_signal_var"] for u in units])
    return (pooled if finite(pooled) else float("nan")), lo, hi, label


def nmse_difference(
    rs: list[dict[str, Any]], ref: list[dict[str, Any]], key: str = "nmse"
) -> tuple[float, float, float, str]:
    """rs's pooled ratio less ref's (a critic's nmse less GRPO's), over the seeds both have, with its 95% interval
    (intervals.ratio_difference_interval): paired by seed; with one seed in common, each run's measurements as its
    units, unpaired. -> difference, lo, hi, units ('' when there is none)."""
    nan = float("nan")
    num_key, part = NMSE_SUMS[key]
    ref_by = {r["seed"]: r for r in ref}
    pairs = [(r, ref_by[r["seed"]]) for r in sorted(rs, key=lambda r: r["seed"]) if r["seed"] in ref_by]
    if not pairs:
        return nan, nan, nan, ""
    if len(pairs) > 1:  # each seed's sums, the seeds in the same order on both sides
        a, b = [x["mc"][f"{part}sums"] for x, _ in pairs], [y["mc"][f"{part}sums"] for _, y in pairs]
    else:  # one seed: each run's measurements
        ((x, y),) = pairs
        a, b = nmse_units([x], key)[0], nmse_units([y], key)[0]
    ok = [u for u in (*a, *b) if u and num_key in u and u.get("sum_signal_var", 0) > 0]
    if len(ok) < len(a) + len(b):  # a run without this measurement (an old run)
        return nan, nan, nan, ""
    args = ([u[num_key] for u in a], [u["sum_signal_var"] for u in a], [u[num_key] for u in b],
            [u["sum_signal_var"] for u in b])  # fmt: skip
    d, lo, hi = intervals.ratio_difference_interval(*args, paired=len(pairs) > 1)
    return d, lo, hi, ("seeds" if len(pairs) > 1 else "measurements, 1 seed")


FLOPS_PARTS = ("generation", "reference", "old", "update", "critic", "total", "measurement", "evaluation")


def flops_estimate(res: dict[str, Any], args: dict[str, Any]) -> dict[str, float]:
    """A run's training FLOPs by part, from what its results.json records: ~2 N a token through a forward and 6 N
    through a forward and backward, N the parameters (the policy's, or the critic's for its parts).

      generation  2 N x generated training tokens (the rollouts; offline DPO: its pair sampling)
      reference   2 N x the tokens the reference scores: every rollout token (PPO, GRPO with --kl-coef > 0), each
                  pair's chosen and rejected tokens once (DPO: reference_tokens)
      old         2 N x rollout tokens with --recompute-logprobs, and 2 N_critic x rollout tokens for the critic's
                  old values (a full critic's trunk forward; a head's, small)
      update      6 N x trained tokens (completion tokens x epochs; DPO: chosen + rejected tokens x epochs)
      critic      6 N_critic x trained tokens (its update)
      total       their sum: the training budget. The Monte Carlo measurement (2 N x mc_tokens) and the
                  evaluations (2 N x eval_tokens) are apart, as `measurement` and `evaluation`.
    Not counted: prompt tokens (prefill and their place in the training forward) and attention's quadratic term.
    nan where the run did not record what a part needs (runs written before the record; dpo.py before it)."""
    nan = float("nan")
    N, Nc = res.get("policy_params"), float(res.get("critic_params") or 0)
    gen, trained = res.get("generated_tokens"), res.get("trained_tokens")
    if not (finite(N) and finite(gen) and finite(trained)):
        return {k: nan for k in FLOPS_PARTS}
    N, gen, trained = float(N), float(gen), float(trained)
    if res.get("method") == "dpo":
        ref_tokens = res.get("reference_tokens")
        parts = {
            "generation": 2 * N * gen,
            "reference": 2 * N * float(ref_tokens) if finite(ref_tokens) else nan,
            "old": 0.0,
            "update": 6 * N * trained,
            "critic": 0.0,
        }
    else:
        parts = {
            "generation": 2 * N * gen,
            "reference": 2 * N * gen if float(args.get("kl_coef") or 0) > 0 else 0.0,
            "old": (2 * N * gen if args.get("recompute_logprobs") else 0.0) + 2 * Nc * gen,
            "update": 6 * N * trained,
            "critic": 6 * Nc * trained,
        }
    parts["total"] = sum(parts.values())
    parts["measurement"] = 2 * N * float(res.get("mc_tokens") or 0)
    parts["evaluation"] = 2 * N * float(res.get("eval_tokens") or 0)
    return parts


def curve(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Validation accuracy and training reward against step and generated training tokens."""
    tokens_at: dict[int, float] = {}
    reward: dict[int, float] = {}
    val: dict[int, float] = {}
    for r in rows:
        s = int(r["step"])
        if finite(r.get("generated_tokens")):
            tokens_at[s] = float(r["generated_tokens"])
        if finite(r.get("reward")):
            reward[s] = float(r["reward"])
        if finite(r.get("val/accuracy")):
            val[s] = float(r["val/accuracy"])  # the last row of a step wins (a resumed run logs the final eval again)

    def tokens(s: int) -> float:
        known = [t for k, t in tokens_at.items() if k <= s]
        return max(known) if known else 0.0

    return {
        "val_step": sorted(val),
        "val": [val[s] for s in sorted(val)],
        "val_tokens": [tokens(s) for s in sorted(val)],
        "reward_step": sorted(reward),
        "reward": [reward[s] for s in sorted(reward)],
        "reward_tokens": [tokens(s) for s in sorted(reward)],
    }


def load_run(run_dir: Path, experiment: str) -> dict[str, Any]:
    """One run: its results.json (rundir.read_results: a damaged one is a UserError naming it) and metrics."""
    res = rundir.read_results(run_dir / "results.json")
    try:
        method, seed = str(res["method"]), int(res["seed"])
        variant = run_variant(res)
        group = (res.get("args") or {}).get("group_size")
        if method == "grpo" and experiment in GROUP_AXIS and group != STUDY_GROUP:
            variant += f"-g{group}"
        test = res["test"]
        acc, n, (lo, hi) = float(test["accuracy"]), int(test["n"]), test["ci95"]
        gen = int(res["generated_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise errors.UserError(f"{run_dir / 'results.json'} is damaged: missing or malformed {e}") from None
    args = res.get("args") or {}
    rows = read_metrics(run_dir)
    correct = test.get("correct") if isinstance(test, dict) else None
    flops = flops_estimate(res, args)
    step_times = [r["time/step"] for r in rows if finite(r.get("time/step"))]
    wall = float(res.get("wall_time_s", float("nan")))
    test_s = float(test.get("seconds", 0.0)) if isinstance(test, dict) and finite(test.get("seconds")) else 0.0
    val_s = {r["step"]: r["val/seconds"] for r in rows if finite(r.get("val/seconds"))}  # a resume logs one twice
    not_training = sum(r["mc/seconds"] for r in rows if finite(r.get("mc/seconds"))) + sum(val_s.values()) + test_s
    return {
        "experiment": experiment,
        "run": f"{method}-{variant}",
        "method": method,
        "variant": variant,
        "seed": seed,
        "dir": run_dir,
        "steps": int(res.get("steps", 0)),
        "test_accuracy": acc,
        "test_ci_low": float(lo),
        "test_ci_high": float(hi),
        "test_n": n,
        "test_seconds": float(test.get("seconds", float("nan"))),
        "generated_tokens": gen,
        "token_budget": int(args.get("token_budget") or 0),
        "mc_tokens": int(res.get("mc_tokens", 0)),
        "eval_tokens": int(res.get("eval_tokens", 0)),
        "wall_time_s": wall,
        "train_time_s": wall - not_training,  # without the MC measurement and the evaluations (val and test)
        "critic_params": int(res.get("critic_params", 0)),
        "update_flops": flops["update"] + flops["critic"],  # the gradient updates, policy and critic
        "flops": flops,
        "correct": [float(c) for c in correct] if isinstance(correct, list) else None,
        "device": str(res.get("device", "")),
        "rollout": rollout_label(res),
        "model": str(args.get("model", "")),
        "scale": str(args.get("scale", "")),
        "task": str(args.get("task", "")),
        "scaled_down": res.get("scaled_down") or [],
        "args": args,
        "rows": rows,
        "step_times": step_times,
        "mc": mc_summary(rows, method),
        "curve": curve(rows),
        "data": res.get("data") if isinstance(res.get("data"), dict) else None,  # gsm8k.data_record
        # ppo.py --critic-init's pretraining (critics.load_critic_init): its rollouts, tokens, whether paid
        "critic_init": res.get("critic_init") if isinstance(res.get("critic_init"), dict) else None,
    }


def rollout_label(res: dict[str, Any]) -> str:
    """What a run's rollouts ran on (results.json's rollout_backend), its fallbacks named: "static (fell back:
    cuda_graph)"; "-" for a run from before the record."""
    backend = res.get("rollout_backend")
    if backend is None and "rollout_backend" not in res:
        return "-"
    fell = sorted({f.get("what", "?") for f in res.get("rollout_fallbacks") or []})
    return str(backend or "none") + (f" (fell back: {', '.join(fell)})" if fell else "")


def run_variant(res: dict[str, Any]) -> str:
    """A run's variant from its results.json (never from its folder's name): the critic (or grpo's "group", dpo's
    pairs), and the settings the sweep's extra arms change: GRPO without the std division, PPO at lambda < 1."""
    variant, args = res.get("variant", res.get("critic")), res.get("args") or {}  # "critic" before the rename
    if variant is None:
        raise KeyError("variant")  # a damaged results.json, as load_run reports it
    variant = str(variant)
    if res.get("method") == "grpo" and args.get("scale_rewards") == "none" and not variant.endswith("-unscaled"):
        variant += "-unscaled"  # grpo.py names it so itself since the sweep's unscaled arm; older runs did not
    if res.get("method") == "grpo" and args.get("baseline") == "loo":
        variant += "-loo"
    if res.get("method") == "ppo" and finite(args.get("lam")) and float(args["lam"]) != 1.0:
        variant += f"-lam{float(args['lam']):g}"
    init = res.get("critic_init")
    if res.get("method") == "ppo" and isinstance(init, dict):  # a pretrained critic: its rollouts and its price
        variant += f"-n{init.get('rollouts')}-{'paid' if init.get('paid') else 'amortised'}"
    return variant


def run_folders(out: Path) -> list[tuple[str, Path]]:
    """(experiment, folder) of every run folder under out; folders set aside (a '.' in the name) are not runs."""
    found = []
    for res in sorted(out.glob("*/*/results.json")):
        run_dir = res.parent
        if "." not in run_dir.name and "." not in run_dir.parent.name:
            found.append((run_dir.parent.name, run_dir))
    return found


def read_plan(out: Path) -> list[tuple[str, str, Path]]:
    """sweep.sh's plan.tsv: (experiment, run, folder) of every run the last sweep asked for. A folder is written
    relative to the sweep's (so that the sweep's folder reads the same wherever it is copied); an absolute one (an
    older sweep's) is read as it is."""
    path = out / "plan.tsv"
    plan = []
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3:
                plan.append((parts[0], parts[1], out / parts[2]))  # an absolute parts[2] replaces out
    return plan


def sort_key(experiment: str, run: str) -> tuple:
    """The experiments' order, then the variants': a run named after one of VARIANT_ORDER and more (ppo-small-n4096-
    paid, grpo-group-g16) beside it, numbers in the rest by value (g2, g4, g16)."""
    e = EXPERIMENTS.index(experiment) if experiment in EXPERIMENTS else len(EXPERIMENTS)
    base = max((v for v in VARIANT_ORDER if run == v or run.startswith(v + "-")), key=len, default="")
    v = VARIANT_ORDER.index(base) if base else len(VARIANT_ORDER)
    rest = [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", run[len(base) :])]
    return (e, experiment, v, rest)


# ======================================================================================================
# Numbers as the report prints them
# ======================================================================================================


def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}" if finite(x) else "-"


def fmt_num(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if finite(x) else "-"


def fmt_signed_interval(m: float, lo: float, hi: float) -> str:
    """A difference in percentage points with its interval: '+1.2 [-0.3, +2.7]'; '+0.0 [n/a]' where there is none
    (one unit, or units that agree exactly: an interval of zero width would read as certain)."""
    if not finite(m):
        return "-"
    return f"{100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]" if finite(lo) else f"{100 * m:+.1f} [n/a]"


def fmt_interval(x: float, lo: float, hi: float, digits: int = 3, signed: bool = False) -> str:
    """A value with its interval, '0.120 [0.080, 0.160]' ('+0.120 [+0.080, +0.160]' signed); '0.120 [n/a]' where the
    interval is undefined."""
    if not finite(x):
        return "-"
    f = f"{'+' if signed else ''}.{digits}f"
    return f"{x:{f}} " + (f"[{lo:{f}}, {hi:{f}}]" if finite(lo) and finite(hi) else "[n/a]")


def fmt_tokens(x: float) -> str:
    if not finite(x):
        return "-"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"


def fmt_time(s: float) -> str:
    if not finite(s):
        return "-"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
