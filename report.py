"""The sweep's report: a results table (Markdown and CSV) and plots from the runs' results.json and metrics.jsonl.

sweep.sh writes every run into OUT/<experiment>/<method>-<variant>-s<seed> and calls this at the end; it also
works on demand, on whatever runs a folder holds. matplotlib draws the plots when it is installed (it is in
requirements.txt); without it the tables are still written.

    python report.py runs/sweep                         # -> runs/sweep/report/: report.md, summary.csv, runs.csv, *.png
    python report.py --estimate runs/timing --steps 200 --seeds 3   # the full sweep's duration from measured step times

It only reads: no run folder is moved or renamed here (the sweep's scheduler, sweep_runner.py, owns the runs).
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import tyro

import common
import models
import preflight
import runtime

EXPERIMENTS = ("critic", "h2h", "labels")
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
# The baseline each method's MC measurement scores (metrics.jsonl: mc/<name>/<key>, common.baseline_error): PPO's
# critic; GRPO's leave-one-out mean, the effective baseline of its group-mean advantage ((G-1)/G (r - loo)).
MC_BASELINE = {"ppo": "value", "grpo": "loo"}
ERROR_COLUMNS = [
    "nmse",
    "nmse_centred",
    "within_nmse",
    "bias",
    "rmse",
    "explained_variance",
    "signal_fraction",
]
# What report.py fills only from runs written after the measurement of docs/measurement.md
NEW_COLUMNS = {
    "nmse": "baseline error (nmse, nmse_centred, within_nmse, ...)",
    "paired": "paired difference vs GRPO",
    "update_flops": "update FLOPs estimate",
}

DEFINITIONS = """\
How to read it (the definitions, with formulas: docs/measurement.md):
- **test accuracy**: greedy, strict `####` answer, on the test problems (n in runs.csv). One seed: the run's
  Wilson 95% interval. Several seeds: the mean over seeds with a t interval, mean +- t(0.975, n - 1) sd / sqrt(n)
  (t = 4.30 for 3 seeds; common.mean_interval); the spread (sd over seeds) is shown too.
- **vs GRPO**: the paired difference in test accuracy from GRPO's group-mean run of the same experiment, on the
  same test problems (per-problem correctness is in each run's results.json): per seed the mean over problems of
  the difference, then the mean over the seeds both have with the t interval over those per-seed differences
  (common.paired_seed_difference: it carries the seed-to-seed variance; t = 4.30 for 3 seeds, so wide). One seed:
  the paired t interval over its problems, which says nothing about another seed.
- **[n/a]**: no interval: one unit, or units (seeds) that agree exactly. An interval of zero width would read as
  certain; agreeing seeds say that the spread is small, and the interval needs more seeds.
- **generated tokens**: tokens of training rollouts only, the compute that the head-to-head matches. Monte Carlo
  measurement tokens never train and are counted apart (mc_tokens in the CSV), as are evaluation tokens.
  **update FLOPs** ~ 6 x trained completion tokens (x epochs) x trainable parameters (policy + critic: a full
  critic doubles the trunk): the gradient updates only; prompt tokens, generation, the reference and old-policy
  forwards and the MC measurement are not counted. **wall time**: the run's own clock, everything in it;
  **train time**: wall time less the MC measurement (mc/seconds) and the evaluations (val/seconds, the test's
  seconds), what the method itself spent. Matched compute is read three ways: tokens (the budget), FLOPs, time.
  **rollout**: what the run's rollouts ran on (static + CUDA graphs, static, hf; "fell back" names each
  fallback, its reason in results.json): a slow run is not a slow method; "-" for a run from before the record.
- **matched compute (h2h)**: for each seed, grpo.py runs first for the scale's steps; its generated tokens are the
  budget. Every PPO critic and online DPO then run with `--token-budget` = that budget (and a step cap 10x GRPO's
  steps, so that the budget ends them); a run stops after the step that reaches the budget, so it can overshoot by
  one step's tokens ("vs budget"). Offline DPO spends the budget once, sampling its pairs from the reference
  model, then trains for GRPO's number of steps.
- **baseline error** (common.baseline_error, against K fresh rollouts from the prompt and from states drawn
  uniformly inside each measured completion, token-weighted): **nmse** = the baseline's noise-corrected MSE
  against the true value over the reward's own variance there, E[p(1-p)] of the 0/1 score: the share by which
  the baseline inflates Var(R - b) over a perfect baseline's (0 perfect; below 0 only by the noise correction).
  **nmse at prompt**: the same at the prompt states only, where GRPO's leave-one-out mean of G reads 1/(G-1)
  (0.14 at G = 8) whatever the success rate; at states inside a completion its one constant cannot follow V(s_t)
  and reads (1/(G-1) + d)/(1 - d), d the share of the outcome's variance already resolved (docs/measurement.md):
  at the prompt a critic is compared for noise, inside for tracking the value. **nmse centred**: the same after
  removing the mean error (what whitening removes). **within**: after removing each prompt's mean error.
  **signal**: the share of measured prompts whose K scores differ (where a baseline matters at all). Pooled as
  sums over a run's measurements after the first (the untrained critic) and over seeds, never averaged as roots
  or ratios; the interval [95%] is centred on that pooled value: common.ratio_interval with the seeds as units
  (it carries their variance; one seed: its measurements as units). With 3 seeds it covered 95% in simulation
  with a moderate seed effect (tests/test_stats.py) and less (~86%) when the critic's error differs between
  seeds by a factor of e (a skewed seed effect): read it as approximate. GRPO's row is its leave-one-out mean
  (its effective baseline); its group mean including the completion's own reward reads ~1/G (runs.csv
  nmse_group_mean, pooled as the rest).
"""


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
    """One MC measurement's pooled sums (common.POOLED_SUMS) of baseline `name`, from its metrics.jsonl row."""
    return {k: float(row[f"mc/{name}/{k}"]) for k in common.POOLED_SUMS if finite(row.get(f"mc/{name}/{k}"))}


def mc_summary(rows: list[dict[str, Any]], method: str) -> dict[str, Any]:
    """The run's baseline error: its MC measurements after the first (the untrained critic) pooled as sums
    (common.pool_baseline_errors). "sums" carries them on, so that seeds pool again, and "per_measurement" each
    measurement's (the units of a one-seed interval); "prompt_sums" the same at the prompt states only (nmse_prompt:
    where GRPO's leave-one-out mean reads 1/(G-1); runs measured before it leave it empty), and for GRPO
    "group_sums", its group mean with the completion's own reward in it (nmse_group_mean). "old_format" marks a run
    measured before baseline_error (mc/value/centred_rmse and no sums): its columns stay empty."""
    name = MC_BASELINE.get(method, "value")
    meas = [r for r in rows if finite(r.get(f"mc/{name}/sum_signal_var"))]
    if len(meas) > 1:
        meas = meas[1:]
    per_measurement = [measurement_sums(r, name) for r in meas]
    pooled = common.pool_baseline_errors(per_measurement)
    out: dict[str, Any] = {key: pooled.get(key, float("nan")) for key in ERROR_COLUMNS}
    out["sums"] = {k: v for k, v in pooled.items() if k in common.POOLED_SUMS}
    out["per_measurement"] = per_measurement
    prompt = [measurement_sums(r, f"{name}_prompt") for r in meas]
    prompt = [m for m in prompt if m] if all(prompt) else []  # every measurement has it, or none counts
    out["prompt_per_measurement"] = prompt
    out["prompt_sums"] = {k: v for k, v in common.pool_baseline_errors(prompt).items() if k in common.POOLED_SUMS}
    out["nmse_prompt"] = common.pool_baseline_errors(prompt).get("nmse", float("nan"))
    out["measurements"] = float(len(meas))
    out["old_format"] = not meas and any(finite(r.get("mc/value/centred_rmse")) for r in rows)
    if method == "grpo":  # the group mean with the completion's own reward in it, for comparison
        out["group_sums"] = common.pool_baseline_errors([measurement_sums(r, "group") for r in meas])
        out["nmse_group_mean"] = out["group_sums"].get("nmse", float("nan"))
    return out


def nmse_interval(rs: list[dict[str, Any]], key: str = "nmse") -> tuple[float, float, float, str]:
    """A pooled baseline-error ratio of the runs rs (seeds of one method-variant) and its 95% interval, centred on
    it: common.ratio_interval with the seeds as units (it carries their variance), or, with one seed, its
    measurements as units (what that run's critic did, nothing about other seeds). -> value, lo, hi, units."""
    num_key = {"nmse": "sum_sq_err_nc", "nmse_centred": "sum_centred_sq_nc", "nmse_prompt": "sum_sq_err_nc"}[key]
    part = "prompt_" if key == "nmse_prompt" else ""
    if len(rs) > 1:
        units, label = [r["mc"][f"{part}sums"] for r in rs], "seeds"
    else:
        units, label = rs[0]["mc"][f"{part}per_measurement"], "measurements, 1 seed"
    units = [u for u in units if u and num_key in u and "sum_signal_var" in u]
    pooled = common.pool_baseline_errors([r["mc"][f"{part}sums"] for r in rs]).get(key.removesuffix("_prompt"))
    lo = hi = float("nan")
    if len(units) >= len(rs):  # a seed without this measurement (an old run): the seeds that have it, no interval
        _, lo, hi = common.ratio_interval([u[num_key] for u in units], [u["sum_signal_var"] for u in units])
    return (pooled if finite(pooled) else float("nan")), lo, hi, label


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
    """One run: its results.json (runtime.read_results: a damaged one is a UserError naming it) and metrics."""
    res = runtime.read_results(run_dir / "results.json")
    try:
        method, seed = str(res["method"]), int(res["seed"])
        variant = run_variant(res)
        test = res["test"]
        acc, n, (lo, hi) = float(test["accuracy"]), int(test["n"]), test["ci95"]
        gen = int(res["generated_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise runtime.UserError(f"{run_dir / 'results.json'} is damaged: missing or malformed {e}") from None
    args = res.get("args") or {}
    rows = read_metrics(run_dir)
    correct = test.get("correct") if isinstance(test, dict) else None
    params = res.get("policy_params")
    trained = res.get("trained_tokens")
    flops = 6.0 * trained * (params + int(res.get("critic_params", 0))) if finite(params) and finite(trained) else None
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
        "update_flops": float(flops) if flops is not None else float("nan"),
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
        "data": res.get("data") if isinstance(res.get("data"), dict) else None,  # common.data_record
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
    """sweep.sh's plan.tsv: (experiment, run, folder) of every run the last sweep asked for."""
    path = out / "plan.tsv"
    plan = []
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3:
                plan.append((parts[0], parts[1], Path(parts[2])))
    return plan


def sort_key(experiment: str, run: str) -> tuple:
    e = EXPERIMENTS.index(experiment) if experiment in EXPERIMENTS else len(EXPERIMENTS)
    v = VARIANT_ORDER.index(run) if run in VARIANT_ORDER else len(VARIANT_ORDER)
    return (e, experiment, v, run)


# ======================================================================================================
# Tables
# ======================================================================================================


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (experiment, method-variant): the mean over seeds, with intervals and spread; the baseline error
    pooled over seeds' sums with the t interval of the per-seed values; the paired difference from GRPO."""
    paired = paired_vs_grpo(runs)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["experiment"], r["run"]), []).append(r)
    rows = []
    for (experiment, run), rs in sorted(groups.items(), key=lambda kv: sort_key(*kv[0])):
        rs = sorted(rs, key=lambda r: r["seed"])
        accs = [r["test_accuracy"] for r in rs]
        m, lo, hi = common.mean_interval(accs)  # seeds that agree: no interval (nan), never a zero-width one
        kind = "over seeds" if finite(lo) else "seeds agree: needs more seeds"
        if len(rs) == 1:  # one seed: the run's own (Wilson) interval
            lo, hi, kind = rs[0]["test_ci_low"], rs[0]["test_ci_high"], "wilson"
        sd = math.sqrt(sum((a - m) ** 2 for a in accs) / (len(accs) - 1)) if len(accs) > 1 else float("nan")
        budgets = [r["token_budget"] for r in rs if r["token_budget"]]
        row = {
            "experiment": experiment,
            "run": run,
            "method": rs[0]["method"],
            "variant": rs[0]["variant"],
            "seeds": len(rs),
            "seed_list": " ".join(str(r["seed"]) for r in rs),
            "test_accuracy": m,
            "interval_low": lo,
            "interval_high": hi,
            "interval": kind,
            "sd_over_seeds": sd,
            "min": min(accs),
            "max": max(accs),
            "test_n": rs[0]["test_n"],
            "steps": mean([r["steps"] for r in rs]),
            "generated_tokens": mean([r["generated_tokens"] for r in rs]),
            "token_budget": mean(budgets) if budgets else float("nan"),
            "tokens_vs_budget": mean([r["generated_tokens"] / r["token_budget"] for r in rs if r["token_budget"]]),
            "mc_tokens": mean([r["mc_tokens"] for r in rs]),
            "wall_time_s": mean([r["wall_time_s"] for r in rs]),
            "train_time_s": mean([r["train_time_s"] for r in rs]),
            "rollout": "; ".join(sorted({r.get("rollout", "-") for r in rs})),
            "critic_params": rs[0]["critic_params"],
        }
        row["update_flops"] = mean([r["update_flops"] for r in rs])
        pooled = common.pool_baseline_errors([r["mc"]["sums"] for r in rs])  # sums over seeds, then the ratios
        for key in ERROR_COLUMNS:
            row[key] = pooled.get(key, float("nan"))
        for key in ("nmse", "nmse_centred", "nmse_prompt"):  # centred on the pooled value printed
            x, lo, hi, units = nmse_interval(rs, key)
            row[key], row[f"{key}_low"], row[f"{key}_high"] = x, lo, hi
        row["nmse_interval"] = units
        group = common.pool_baseline_errors([r["mc"].get("group_sums") or {} for r in rs])  # pooled as the rest
        row["nmse_group_mean"] = group.get("nmse", float("nan"))
        d, lo, hi, n_items, n_seeds = paired.get((experiment, run), (float("nan"),) * 5)
        row.update(vs_grpo=d, vs_grpo_low=lo, vs_grpo_high=hi, vs_grpo_problems=n_items, vs_grpo_seeds=n_seeds)
        rows.append(row)
    return rows


def paired_vs_grpo(runs: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[float, float, float, float, float]]:
    """(experiment, run) -> the paired difference in test accuracy from that experiment's GRPO group-mean run over
    the seeds both have: common.paired_seed_difference (the t interval over the per-seed paired differences, which
    carries the seed-to-seed variance; one seed: its problems' paired interval), the number of problems and of
    seeds. Needs per-problem correctness (results.json's test.correct) of the same problems in both."""
    out = {}
    for experiment in {r["experiment"] for r in runs}:
        ref = {r["seed"]: r["correct"] for r in runs if r["experiment"] == experiment and r["run"] == "grpo-group"}
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["experiment"] == experiment and r["run"] != "grpo-group":
                groups.setdefault(r["run"], []).append(r)
        for run, rs in groups.items():
            pairs = [
                (r["correct"], ref[r["seed"]])
                for r in rs
                if r["correct"] is not None
                and ref.get(r["seed"]) is not None
                and len(r["correct"]) == len(ref[r["seed"]])
            ]
            if not pairs or len({len(a) for a, _ in pairs}) != 1:
                continue
            a, b = [p[0] for p in pairs], [p[1] for p in pairs]
            out[(experiment, run)] = (*common.paired_seed_difference(a, b), float(len(a[0])), float(len(pairs)))
    return out


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


def fmt_interval(x: float, lo: float, hi: float, digits: int = 3) -> str:
    """A value with its interval, '0.120 [0.080, 0.160]'; '0.120 [n/a]' where the interval is undefined."""
    if not finite(x):
        return "-"
    return f"{x:.{digits}f} " + (f"[{lo:.{digits}f}, {hi:.{digits}f}]" if finite(lo) and finite(hi) else "[n/a]")


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


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "experiment",
        "run",
        "seeds",
        "test acc. %",
        "95% interval",
        "sd",
        "steps",
        "gen. tokens",
        "vs budget",
        "update FLOPs",
        "wall time",
        "train time",
        "rollout",
        "critic params",
        "vs GRPO (paired) %",
        "nmse [95%]",
        "nmse at prompt",
        "nmse centred",
        "within",
        "bias",
        "signal",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [
            r["experiment"],
            r["run"],
            str(r["seeds"]),
            fmt_pct(r["test_accuracy"]),
            f"[{fmt_pct(r['interval_low'])}, {fmt_pct(r['interval_high'])}]"
            if finite(r["interval_low"])
            else f"n/a ({r['interval']})",
            fmt_pct(r["sd_over_seeds"]),
            f"{r['steps']:.0f}",
            fmt_tokens(r["generated_tokens"]),
            fmt_num(r["tokens_vs_budget"], 2),
            fmt_tokens(r["update_flops"]),
            fmt_time(r["wall_time_s"]),
            fmt_time(r["train_time_s"]),
            r.get("rollout", "-"),
            f"{r['critic_params']:,}",
            fmt_signed_interval(r["vs_grpo"], r["vs_grpo_low"], r["vs_grpo_high"]),
            fmt_interval(r["nmse"], r["nmse_low"], r["nmse_high"]),
            fmt_num(r["nmse_prompt"]),
            fmt_num(r["nmse_centred"]),
            fmt_num(r["within_nmse"]),
            fmt_num(r["bias"]),
            fmt_pct(r["signal_fraction"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if isinstance(r.get(k), float) and not finite(r[k]) else r.get(k)) for k in columns})


RUN_COLUMNS = [
    "experiment",
    "run",
    "method",
    "variant",
    "seed",
    "dir",
    "steps",
    "test_accuracy",
    "test_ci_low",
    "test_ci_high",
    "test_n",
    "generated_tokens",
    "token_budget",
    "mc_tokens",
    "eval_tokens",
    "wall_time_s",
    "train_time_s",
    "critic_params",
    "update_flops",
    "device",
    "model",
    "scale",
    "task",
    *ERROR_COLUMNS,
    "nmse_prompt",
    "nmse_group_mean",
    "measurements",
]


def flat_run(r: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in r.items() if k not in ("mc", "correct")}, **r["mc"]}


# ======================================================================================================
# Plots (matplotlib, optional)
# ======================================================================================================

COLOURS = {
    "ppo-none": "#7f7f7f",
    "ppo-small": "#9ecae1",
    "ppo-medium": "#4292c6",
    "ppo-large": "#08519c",
    "ppo-full": "#08306b",
    "grpo-group": "#d62728",
    "grpo-group-unscaled": "#ff9896",
    "dpo-self-offline": "#fdae6b",
    "dpo-self-online": "#e6550d",
    "dpo-gold-offline": "#a1d99b",
    "dpo-gold-online": "#31a354",
}


def colour(run: str) -> str:
    return COLOURS.get(run, "#555555")


def seed_stats(values: list[float]) -> tuple[float, float]:
    """Mean over seeds and the half-width of common.mean_interval (0 for one seed)."""
    values = [v for v in values if finite(v)]
    if not values:
        return float("nan"), 0.0
    m, lo, hi = common.mean_interval(values)
    return m, (hi - lo) / 2 if finite(lo) else 0.0  # one seed, or seeds that agree: no bar


def pooled_over_seeds(rs: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """A baseline-error ratio pooled over the seeds' sums, and the half-width of its interval (nmse_interval,
    centred on it; 0 where there is none)."""
    x, lo, hi, _ = nmse_interval(rs, key)
    return x, (hi - lo) / 2 if finite(lo) else 0.0


def plot_crossover(plt: Any, runs: list[dict[str, Any]], path: Path) -> str:
    """Final test accuracy against the baseline's nmse (left) and nmse centred (right): one point per PPO critic,
    GRPO's leave-one-out mean as a star with its interval at its measured value. Returns the caption."""
    source = "h2h" if any(r["experiment"] == "h2h" and r["method"] == "ppo" for r in runs) else "critic"
    ppo = [r for r in runs if r["experiment"] == source and r["method"] == "ppo"]
    grpo_exp = source if any(r["experiment"] == source and r["run"] == "grpo-group" for r in runs) else None
    grpo = [r for r in runs if r["run"] == "grpo-group" and (grpo_exp is None or r["experiment"] == grpo_exp)]
    panels = [
        ("nmse", "nmse = baseline MSE / E[p(1-p)]"),
        ("nmse_centred", "nmse centred (mean error removed)"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, (key, xlabel) in zip(axes, panels):
        by_run: dict[str, list[dict[str, Any]]] = {}
        for r in ppo:
            by_run.setdefault(r["run"], []).append(r)
        left, right = 0.0, 0.0
        for run, rs in sorted(by_run.items(), key=lambda kv: sort_key(source, kv[0])):
            x, xerr = pooled_over_seeds(rs, key)
            y, yerr = seed_stats([r["test_accuracy"] for r in rs])
            if len(rs) == 1:  # one seed: the run's own interval
                yerr = (rs[0]["test_ci_high"] - rs[0]["test_ci_low"]) / 2
            if not finite(x):
                continue
            left, right = min(left, x - xerr), max(right, x + xerr)
            label = f"PPO, critic {run.removeprefix('ppo-')}"
            ax.errorbar(x, 100 * y, xerr=xerr, yerr=100 * yerr, fmt="o", color=colour(run), capsize=3, label=label)
        g = grpo[0]["args"].get("group_size") if grpo else None
        if grpo:
            x, xerr = pooled_over_seeds(grpo, key)
            y, yerr = seed_stats([r["test_accuracy"] for r in grpo])
            if len(grpo) == 1:
                yerr = (grpo[0]["test_ci_high"] - grpo[0]["test_ci_low"]) / 2
            if finite(x):
                left, right = min(left, x - xerr), max(right, x + xerr)
                if xerr > 0:
                    ax.axvspan(x - xerr, x + xerr, color=colour("grpo-group"), alpha=0.12, lw=0)
                label = f"GRPO, group of G={g or '?'}, measured (leave-one-out), token-weighted states"
                ax.errorbar(
                    x, 100 * y, xerr=xerr, yerr=100 * yerr, fmt="*", ms=12, color=colour("grpo-group"), capsize=3,
                    label=label,
                )  # fmt: skip
            if key == "nmse":  # the prompt states alone: where its expected value is 1/(G-1)
                xp, xperr = pooled_over_seeds(grpo, "nmse_prompt")
                if finite(xp):
                    left, right = min(left, xp - xperr), max(right, xp + xperr)
                    ax.errorbar(
                        xp, 100 * y, xerr=xperr, fmt="*", ms=12, mfc="none", color=colour("grpo-group"), capsize=3,
                        label="GRPO at the prompt states (where 1/(G-1) holds)",
                    )  # fmt: skip
        if isinstance(g, int) and g > 1 and key == "nmse":
            ax.axvline(
                1 / (g - 1), color=colour("grpo-group"), ls=":", lw=1,
                label=f"1/(G-1) = {1 / (g - 1):.3f}: GRPO's expected nmse at the prompt state only",
            )  # fmt: skip
            right = max(right, 1 / (g - 1))
        span = 1.15 * (right - left) if right > left else 1.0
        # every point shows, a negative nmse too (the noise correction can take a near-perfect baseline below 0)
        ax.set_xlim(left - 0.04 * span, left + span)
        ax.set_xlabel(xlabel + " (lower is better)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    axes[0].set_ylabel("final test accuracy (%)")
    caption = (
        f"PPO critics from the {'head-to-head (matched tokens)' if source == 'h2h' else 'critic sweep (matched steps)'}"
        " runs. x: the baseline's noise-corrected MSE at token-weighted states over the reward's own variance"
        " there (0: a perfect baseline; below 0 only by the noise correction), pooled over measurements and seeds,"
        " with its 95% interval over seeds (over measurements for one seed); y: mean test accuracy over seeds with"
        " its 95% interval. GRPO's filled star is its measured value at the same states; its open star is its value"
        " at the prompt states alone, where its leave-one-out mean of G reads 1/(G-1) (the dotted line) whatever"
        " the success rate. Inside a completion its one constant cannot follow V(s_t) and reads more, (1/(G-1) + d)"
        " / (1 - d) with d the share of the outcome's variance already resolved: left of the filled star a critic"
        " tracks the value better than the group does (less wrong, not less noisy). Less noisy is read at the prompt"
        " states: the table's \"nmse at prompt\" of a critic against GRPO's."
    )
    fig.suptitle("Is the critic worth having? Accuracy against the baseline's scaled error", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return caption


def plot_curves(plt: Any, runs: list[dict[str, Any]], path: Path) -> None:
    """Validation accuracy (top) and training reward (bottom) per experiment, mean over seeds with a band."""
    experiments = [e for e in EXPERIMENTS if any(r["experiment"] == e for r in runs)]
    experiments += sorted({r["experiment"] for r in runs} - set(experiments))
    fig, axes = plt.subplots(2, len(experiments), figsize=(5 * len(experiments), 7), squeeze=False)
    for j, exp in enumerate(experiments):
        by_run: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["experiment"] == exp:
                by_run.setdefault(r["run"], []).append(r)
        use_tokens = exp == "h2h"  # matched compute: against generated tokens
        for i, (kind, label) in enumerate((("val", "validation accuracy (%)"), ("reward", "training reward"))):
            ax = axes[i][j]
            for run, rs in sorted(by_run.items(), key=lambda kv: sort_key(exp, kv[0])):
                steps = sorted({s for r in rs for s in r["curve"][f"{kind}_step"]})
                if not steps:
                    continue
                xs, ms, los, his = [], [], [], []
                for s in steps:
                    vals, toks = [], []
                    for r in rs:
                        c = r["curve"]
                        if s in c[f"{kind}_step"]:
                            k = c[f"{kind}_step"].index(s)
                            vals.append(c[kind][k])
                            toks.append(c[f"{kind}_tokens"][k])
                    m, lo, hi = common.mean_interval(vals)
                    xs.append(mean(toks) if use_tokens else s)
                    ms.append(m)
                    los.append(lo)
                    his.append(hi)
                scale = 100 if kind == "val" else 1
                if use_tokens and len(set(xs)) == 1 and len(xs) > 1:  # offline DPO: every token spent before step 1
                    xs, ms, los, his = xs[-1:], ms[-1:], los[-1:], his[-1:]
                    run = run + " (final)"
                ax.plot(xs, [scale * m for m in ms], marker="o", ms=3, color=colour(run.split(" ")[0]), label=run)
                if len(rs) > 1:
                    ax.fill_between(
                        xs,
                        [scale * v for v in los],
                        [scale * v for v in his],
                        color=colour(run.split(" ")[0]),
                        alpha=0.2,
                    )
            ax.set_xlabel("generated training tokens" if use_tokens else "step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title({"critic": "critic sweep", "h2h": "head-to-head (matched tokens)"}.get(exp, exp))
                if ax.get_legend_handles_labels()[0]:  # no curve drawn (no metric logged): no legend
                    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def error_axis_limits(single: list[float], pooled: list[float]) -> tuple[float, float]:
    """The errors plot's axis range: every pooled (run) value, and single measurements up to their 10th and 90th
    percentiles, with a margin; 0 always inside. One measurement's ratio rests on a few states and can read ~2,000
    where the runs read ~0.1: outside this range such points are drawn on the edge, and the title says so."""

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else 0.0

    lo = min(0.0, *pooled, pct(single, 0.1)) if pooled else min(0.0, pct(single, 0.1))
    hi = max(0.0, *pooled, pct(single, 0.9)) if pooled else max(0.0, pct(single, 0.9))
    span = (hi - lo) or 1.0
    return lo - 0.1 * span, hi + 0.1 * span


def plot_errors(plt: Any, runs: list[dict[str, Any]], path: Path) -> None:
    """nmse against nmse centred, one small point per MC measurement and a large one per run (pooled); the
    distance below the diagonal is the constant offset that whitening removes. The axes cover the runs' values
    and most measurements (error_axis_limits); a measurement beyond is drawn on the edge as a triangle, counted
    in the title."""
    fig, ax = plt.subplots(figsize=(6, 5))
    series = []
    for r in sorted(runs, key=lambda r: sort_key(r["experiment"], r["run"])):
        name = MC_BASELINE.get(r["method"], "value")
        meas = [
            row
            for row in r["rows"]
            if finite(row.get(f"mc/{name}/nmse")) and finite(row.get(f"mc/{name}/nmse_centred"))
        ]
        if meas and finite(r["mc"]["nmse"]) and finite(r["mc"]["nmse_centred"]):
            xs = [row[f"mc/{name}/nmse"] for row in meas]
            ys = [row[f"mc/{name}/nmse_centred"] for row in meas]
            series.append((r, xs, ys))
    single = [v for _, xs, ys in series for v in (*xs, *ys)]
    pooled = [v for r, _, _ in series for v in (r["mc"]["nmse"], r["mc"]["nmse_centred"])]
    lo, hi = error_axis_limits(single, pooled)
    beyond = 0
    labelled = set()
    for r, xs, ys in series:
        marker = "s" if r["experiment"] == "h2h" else "o"
        shown = [lo <= x <= hi and lo <= y <= hi for x, y in zip(xs, ys)]
        inside = [(x, y) for x, y, ok in zip(xs, ys, shown) if ok]
        outside = [(min(max(x, lo), hi), min(max(y, lo), hi)) for x, y, ok in zip(xs, ys, shown) if not ok]
        beyond += len(outside)
        if inside:
            ax.scatter(*zip(*inside), s=10, color=colour(r["run"]), alpha=0.35, marker=marker)
        if outside:
            ax.scatter(*zip(*outside), s=16, color=colour(r["run"]), alpha=0.6, marker=">")
        label = f"{r['run']} ({r['experiment']})"
        ax.scatter(
            [r["mc"]["nmse"]],
            [r["mc"]["nmse_centred"]],
            s=60,
            color=colour(r["run"]),
            marker=marker,
            edgecolors="black",
            label=None if label in labelled else label,
        )
        labelled.add(label)
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, ls=":", label="no offset (y = x)")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("nmse (counts the mean error)")
    ax.set_ylabel("nmse centred (mean error removed)")
    cut = (
        f"\naxes cut at [{lo:.2g}, {hi:.2g}]: {beyond} of {len(single) // 2} measurements beyond, drawn on the edge (>)"
        if beyond
        else ""
    )
    ax.set_title(
        "Raw against centred error per baseline\n(small: each measurement; large: the run, pooled)" + cut, fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ======================================================================================================
# One run folder in a picture: python report.py runs/ppo-small-s1 -> runs/ppo-small-s1/curves.png
# ======================================================================================================

RUN_PLOT = "curves.png"


def run_series(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """A run's curves from its metrics.jsonl rows, each {"step": [...], "y": [...]} (validation accuracy also "lo",
    "hi": its 95% interval): reward, val accuracy, kl_ref, the baseline's nmse (mc/value for PPO, mc/loo for GRPO;
    its group mean beside it), generated training tokens. A curve nothing logged is empty; the last row of a step
    wins (a resumed run logs its final evaluation again)."""
    keys = {"reward": "reward", "kl": "kl_ref", "tokens": "generated_tokens", "tokens_per_s": "tokens_per_s"}
    keys.update({f"nmse {name}": f"mc/{name}/nmse" for name in ("value", "loo", "group")})
    by_step: dict[str, dict[int, float]] = {name: {} for name in [*keys, "val", "val_lo", "val_hi"]}
    for r in rows:
        s = int(r["step"])
        for name, key in keys.items():
            if finite(r.get(key)):
                by_step[name][s] = float(r[key])
        if finite(r.get("val/accuracy")):
            by_step["val"][s] = float(r["val/accuracy"])
            by_step["val_lo"][s] = float(r.get("val/ci_low", r["val/accuracy"]))
            by_step["val_hi"][s] = float(r.get("val/ci_high", r["val/accuracy"]))
    out = {}
    for name in [*keys, "val"]:
        steps = sorted(by_step[name])
        out[name] = {"step": steps, "y": [by_step[name][s] for s in steps]}
    out["val"]["lo"] = [by_step["val_lo"][s] for s in out["val"]["step"]]
    out["val"]["hi"] = [by_step["val_hi"][s] for s in out["val"]["step"]]
    return out


def run_title(run_dir: Path) -> str:
    """'ppo-small-s1: ppo small, seed 1; test accuracy 1.6% [0.3, 8.3] on 64' from results.json, or the folder's
    name and 'running' when the run has not finished."""
    try:
        res = runtime.read_results(run_dir / "results.json")
        test = res["test"]
        lo, hi = test["ci95"]
        return (
            f"{run_dir.name}: {res['method']} {run_variant(res)}, seed {res['seed']}, {res['steps']} steps; test "
            f"accuracy {fmt_pct(test['accuracy'])}% [{100 * lo:.1f}, {100 * hi:.1f}] on {test['n']}"
        )
    except (runtime.UserError, KeyError, TypeError, ValueError):
        return f"{run_dir.name}: not finished (no results.json)"


def empty_panel_note(rows: list[dict], keys: Sequence[str]) -> str:
    """What a panel with no curve says: its keys never logged, or logged but never a number (a baseline's nmse
    over states whose Monte Carlo scores were all equal is undefined: a model that solves nothing)."""
    if not any(key in r for r in rows for key in keys):
        return "not logged by this run"
    if any(key.endswith("/nmse") for key in keys):
        return "measured, undefined at every step:\nno state's Monte Carlo scores differed\n(nothing for a baseline to predict)"
    return "logged, never a finite number"


def plot_run(plt: Any, run_dir: Path) -> Path:
    """run_dir's curves against the step (run_series) in one PNG beside its metrics.jsonl; returns its path."""
    rows = read_metrics(run_dir)
    series = run_series(rows)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    panels = [
        ("training reward", [("reward", "reward")]),
        ("validation accuracy (%), 95% interval", []),
        ("KL to the reference (kl_ref, per token)", [("kl", "kl_ref")]),
        ("baseline error (nmse; 0 = perfect)", [(f"nmse {b}", f"mc/{b}/nmse") for b in ("value", "loo", "group")]),
        ("generated training tokens (cumulative)", [("tokens", "generated_tokens")]),
        ("rollout throughput (generated tokens/s)", [("tokens_per_s", "tokens_per_s")]),
    ]
    for ax, (title, curves) in zip(axes.flat, panels):
        drawn = False
        for name, label in curves:
            c = series[name]
            if c["step"]:
                ax.plot(c["step"], c["y"], marker="o", ms=3, label=label)
                drawn = True
        if title.startswith("validation"):
            c = series["val"]
            if c["step"]:
                ys = [100 * y for y in c["y"]]
                err = [[y - 100 * lo for y, lo in zip(ys, c["lo"])], [100 * hi - y for y, hi in zip(ys, c["hi"])]]
                ax.errorbar(c["step"], ys, yerr=err, marker="o", ms=3, capsize=3)
                drawn = True
        if not drawn:
            note = empty_panel_note(rows, [key for _, key in curves])
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="grey", fontsize=9)
        elif len(curves) > 1:
            ax.legend(fontsize=7, loc="best")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    fig.suptitle(run_title(run_dir), fontsize=11)
    fig.tight_layout()
    path = run_dir / RUN_PLOT
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ======================================================================================================
# The full sweep's duration from measured step times
# ======================================================================================================


def estimate(
    runs: list[dict[str, Any]], steps: int, seeds: int, eval_every: int = 25
) -> tuple[list[dict[str, Any]], float]:
    """Seconds per run of the full sweep, one run after another on the hardware the runs were made on.

    Per run: steps_planned x s/step (time/step less the MC measurement in it, after the first step: warm-up)
    + MC measurements (one every --mc-every steps) x their mean seconds + evaluations (one every eval_every
    steps and a final one) x mean val seconds + the test + the rest of the run's wall time (offline DPO's pair
    sampling, checkpoints). steps_planned = steps; a budget-matched run scales its measured steps by steps / its
    GRPO reference's steps (its budget grows with GRPO's steps), and budget-matched offline DPO's pair sampling
    scales the same way. Process start-up and model loading (before a run's clock starts) are not counted.
    """
    ref_steps = {r["seed"]: r["steps"] for r in runs if r["experiment"] == "h2h" and r["method"] == "grpo"}
    kinds: dict[tuple[str, str], list[float]] = {}
    detail: dict[tuple[str, str], dict[str, Any]] = {}
    for r in runs:
        train = [row for row in r["rows"] if finite(row.get("time/step"))]
        no_mc = [row["time/step"] - (row.get("mc/seconds") or 0.0) for row in train]
        t_step = mean(no_mc[1:] if len(no_mc) > 1 else no_mc)
        t_mc = mean([row["mc/seconds"] for row in train if finite(row.get("mc/seconds"))])
        evals = [row["val/seconds"] for row in r["rows"] if finite(row.get("val/seconds"))]
        t_eval = mean(evals)
        t_test = r["test_seconds"] if finite(r["test_seconds"]) else t_eval
        other = max(0.0, r["wall_time_s"] - sum(r["step_times"]) - sum(evals) - (t_test if finite(t_test) else 0.0))
        planned = steps
        if r["token_budget"] and r["seed"] in ref_steps:
            factor = steps / max(ref_steps[r["seed"]], 1)
            if r["method"] != "dpo" or r["args"].get("online"):
                planned = round(r["steps"] * factor)
            else:
                other *= factor  # offline DPO: sampling its pairs is what the budget pays for
        mc_every = int(r["args"].get("mc_every") or 0)
        n_mc = -(-planned // mc_every) if mc_every and finite(t_mc) else 0
        n_evals = ((planned - 1) // eval_every if eval_every else 0) + 1  # during training, then the final one
        total = planned * t_step + n_mc * (t_mc if n_mc else 0.0) + n_evals * t_eval + t_test + other
        key = (r["experiment"], r["run"])
        kinds.setdefault(key, []).append(total)
        detail[key] = {
            "experiment": r["experiment"],
            "run": r["run"],
            "device": r["device"],
            "s_per_step": t_step,
            "s_per_mc": t_mc,
            "s_per_eval": t_eval,
            "planned_steps": planned,
            "other_s": other,
        }
    out = []
    grand = 0.0
    for key in sorted(kinds, key=lambda k: sort_key(*k)):
        per_seed = mean(kinds[key])
        grand += per_seed * seeds
        out.append({**detail[key], "per_seed_s": per_seed, "all_seeds_s": per_seed * seeds})
    return out, grand


def estimate_markdown(runs: list[dict[str, Any]], steps: int, seeds: int, eval_every: int = 25) -> str:
    rows, total = estimate(runs, steps, seeds, eval_every)
    lines = [
        f"Estimated from the step times in these runs' metrics.jsonl, for {steps} steps, an evaluation every "
        f"{eval_every} steps and {seeds} seed(s), one run after another on the hardware they ran on "
        "(`python report.py --estimate OUT --steps S --seeds N`; start-up and model loading not counted):",
        "",
        "| experiment | run | measured on | s/step | s/MC | s/eval | steps | per seed | all seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['experiment']} | {r['run']} | {r['device']} | {fmt_num(r['s_per_step'], 2)} | "
            f"{fmt_num(r['s_per_mc'], 1)} | {fmt_num(r['s_per_eval'], 1)} | {r['planned_steps']} | "
            f"{fmt_time(r['per_seed_s'])} | {fmt_time(r['all_seeds_s'])} |"
        )
    lines += ["", f"**Total: {fmt_time(total)}** ({total / 3600:.2f} h) on one device, one run after another."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# Before any run: the study's memory and time on one GPU, from the model's shape (read, not run)
# ------------------------------------------------------------------------------------------------------

# the shapes of the --model short names, from their config.json (hub, 2026-12-01); tied: one embedding matrix
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, inter=1536, tied=True),
    "smollm2-360m": dict(vocab=49152, hidden=960, layers=32, heads=15, kv_heads=5, head_dim=64, inter=2560, tied=True),
    "smollm2-1.7b": dict(vocab=49152, hidden=2048, layers=24, heads=32, kv_heads=32, head_dim=64, inter=8192,
                         tied=True),
    "qwen2.5-0.5b": dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, inter=4864, tied=True,
                         qkv_bias=True),
    "qwen2.5-1.5b": dict(vocab=151936, hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, inter=8960,
                         tied=True, qkv_bias=True),
}  # fmt: skip
# one GPU: memory (bytes, as torch reports it), dense bf16 peak (FLOP/s) and HBM bandwidth (bytes/s)
GPUS = {"h200": dict(name="H200", memory=139 * 2**30, flops=989e12, bandwidth=4.8e12)}  # 141 GB sold, ~139 GiB usable
# what one decoder layer saves for its backward under bf16 autocast, bytes per token: 31 H + 8 I (fitted to the
# saved-tensor bytes of a Qwen2 layer at 0.5B's and 1.5B's shapes, torch.autograd.graph.saved_tensors_hooks on the
# CPU under bf16 autocast: 66,368 and 118,840 bytes per token)
ACT_BYTES_H, ACT_BYTES_I = 31, 8
MFU = 0.30  # the training forward and backward's share of the bf16 peak (HF eager layers, micro-batches of 64)
KERNEL_GAP_S = 36 * 1.5e-6  # per layer per decode step: 36 kernels x ~1.5 us between kernels (docs/throughput.md)
PROMPT_TOKENS = models.PROMPT_TOKENS  # a generous GSM8K chat prompt
GSM8K_TEST = 1319
# the study's settings (each trainer's Args() defaults; tests/test_qwen2.py checks they agree)
STUDY = {
    "ppo": dict(batch_size=512, group_size=1, max_new_tokens=256, micro_batch_size=64, update_epochs=2,
                mc_every=10, mc_prompts=32, mc_samples=8, mc_states=2, eval_size=500, eval_batch_size=256,
                eval_max_new_tokens=400, kl_coef=0.04),
    "grpo": dict(batch_size=64, group_size=8, max_new_tokens=256, micro_batch_size=64, update_epochs=2,
                 mc_every=10, mc_prompts=32, mc_samples=8, mc_states=2, eval_size=500, eval_batch_size=256,
                 eval_max_new_tokens=400, kl_coef=0.04),
    "dpo": dict(batch_size=64, samples_per_prompt=8, max_new_tokens=256, micro_batch_size=16, update_epochs=1,
                eval_size=500, eval_batch_size=256, eval_max_new_tokens=400, offline_prompts=2048),
}  # fmt: skip


def model_params(s: dict[str, Any]) -> dict[str, int]:
    """Parameters of a shape: total (the tied embedding once), embedding (V x H), and per layer."""
    H, d, q, kv = s["hidden"], s["head_dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layer = H * (q + 2 * kv) + q * H + 3 * H * s["inter"] + 2 * H + ((q + 2 * kv) if s.get("qkv_bias") else 0)
    embed = s["vocab"] * H
    total = embed * (1 if s["tied"] else 2) + s["layers"] * layer + H
    del d
    return {"total": total, "embedding": embed, "layer": layer, "trunk": total - (0 if s["tied"] else embed)}


def kv_bytes(s: dict[str, Any], rows: int, slots: int) -> float:
    """The static engine's bf16 KV cache: layers x (k, v) x rows x kv heads x slots x head dim x 2 bytes."""
    return s["layers"] * 2 * rows * s["kv_heads"] * slots * s["head_dim"] * 2


def _bucket(rows: int) -> int:
    return next((b for b in (64, 256, 512, 1024) if b >= rows), -(-rows // 1024) * 1024)


def run_memory(s: dict[str, Any], method: str, critic: str, micro: int | None = None) -> dict[str, float]:
    """Peak bytes of one run on one GPU, by part: the training state (fp32 weights, gradients and AdamW's two
    moments: 16 bytes a parameter), the fp32 reference, a full critic's own training state, the engine's weight
    copies, the largest generation batch (KV cache, logits, hidden states) and the training micro-batch's
    activations (ACT_BYTES per token per layer, a full critic's trunk as many again, the chunked LM head's fp32
    logits). Training and generation do not overlap: the peak holds the larger of the two."""
    st, p = STUDY[method], model_params(s)
    V, H, L = s["vocab"], s["hidden"], s["layers"]
    out = {"policy (weights, grads, AdamW)": 16.0 * p["total"]}
    if st.get("kl_coef", 0) > 0 or method == "dpo":
        out["reference (fp32)"] = 4.0 * p["total"]
    if critic == "full":
        out["full critic (weights, grads, AdamW)"] = 16.0 * p["trunk"]
    out["engine weights (fp32 embedding, bf16 rest)"] = (
        4.0 * p["embedding"] + 2.0 * (p["total"] - p["embedding"]) + 2.0 * V * H
    )
    # generation: the training batch, the evaluation, the MC measurement (1 + states states, k rollouts each)
    G = st.get("group_size", st.get("samples_per_prompt", 1))
    slots = lambda n: -(-(PROMPT_TOKENS + n) // 256) * 256  # noqa: E731
    hidden = method == "ppo" and critic != "none"  # PPO's rollout keeps each state's hidden state for the critic
    batches = [(st["batch_size"] * G, slots(st["max_new_tokens"]), hidden)]
    batches.append((st["eval_batch_size"], slots(st["eval_max_new_tokens"]), False))
    if "mc_every" in st:  # common.mc_values: the states' k rollouts each, in two batches, prefix + rest <= max_new
        mc_rows = st["mc_prompts"] * G * (1 + st["mc_states"]) * st["mc_samples"]
        batches.append((-(-mc_rows // 2), slots(st["max_new_tokens"]), False))
    gen = max(
        kv_bytes(s, _bucket(r), n) + _bucket(r) * V * 4 * 4 + (_bucket(r) * st["max_new_tokens"] * H * 4 if h else 0)
        for r, n, h in batches
    )  # the KV cache, the sampler's [rows, V] fp32 buffers (logits, log-softmax, weights, their blocks), hidden
    micro = micro or st["micro_batch_size"]  # DPO's micro-batch is of pairs: two sequences each
    tokens = micro * (PROMPT_TOKENS + st["max_new_tokens"]) * (2 if method == "dpo" else 1)
    act = tokens * L * (ACT_BYTES_H * H + ACT_BYTES_I * s["inter"]) * (2 if critic == "full" else 1)
    act += 3 * 1024 * V * 4  # the chunked LM head: a chunk's logits, log-softmax and gradient in fp32
    if gen >= act:
        out["generation (KV cache, logits, hidden)"] = gen
    else:
        out["training micro-batch activations"] = act
    return out


def run_seconds(s: dict[str, Any], method: str, critic: str, steps: int, eval_every: int) -> dict[str, float]:
    """Seconds of one run: generation (a decode step as docs/throughput.md's: max(bytes / bandwidth, FLOPs / peak)
    + kernels x gap, its bytes the bf16 weights, the KV cache read and the sampler's fp32 [rows, V] passes),
    training (6 FLOPs per parameter per token trained, a full critic as many again, 2 for the reference's forward,
    at MFU), the MC measurements and the evaluations."""
    st, p, gpu = STUDY[method], model_params(s), GPUS["h200"]
    G = st.get("group_size", st.get("samples_per_prompt", 1))
    T = st["max_new_tokens"]

    def decode(rows: int, new: int, prompt: int = PROMPT_TOKENS // 2) -> float:  # seconds for `new` steps
        per_step = 0.0
        weights = 2.0 * (p["total"] - p["embedding"]) + 2.0 * p["embedding"]  # bf16 trunk and head
        for t in range(0, new, 16):
            kv = kv_bytes(s, rows, prompt + t)
            flops = 2.0 * p["total"] * rows + 4.0 * rows * (prompt + t) * s["heads"] * s["head_dim"] * s["layers"]
            per_step += 16 * (max((weights + kv + rows * s["vocab"] * 4 * 6) / gpu["bandwidth"], flops / gpu["flops"])
                              + KERNEL_GAP_S * s["layers"])  # fmt: skip
        return per_step

    rows = st["batch_size"] * G
    trained = (2 * st["batch_size"] if method == "dpo" else rows) * (PROMPT_TOKENS // 2 + T)  # DPO: its pairs
    factor = 6.0 * p["total"] * st["update_epochs"] + (
        6.0 * p["trunk"] * st["update_epochs"] if critic == "full" else 0
    )
    if st.get("kl_coef", 0) > 0 or method == "dpo":  # the reference's forward
        factor += 2.0 * p["total"]
    out = {"rollouts": steps * decode(rows, T), "training": steps * trained * factor / (gpu["flops"] * MFU)}
    if method == "dpo" and critic == "offline":  # its pairs sampled once, from offline_prompts prompts
        out["rollouts"] = decode(st["batch_size"] * G, T) * st["offline_prompts"] / st["batch_size"]
    if "mc_every" in st:
        mc_rows = st["mc_prompts"] * G * (1 + st["mc_states"]) * st["mc_samples"]
        out["MC measurement"] = -(-steps // st["mc_every"]) * decode(mc_rows, T // 2, PROMPT_TOKENS // 2 + T // 2)
    n_evals = ((steps - 1) // eval_every if eval_every else 0) + 1
    val = -(-st["eval_size"] // st["eval_batch_size"]) * decode(st["eval_batch_size"], st["eval_max_new_tokens"])
    test = -(-GSM8K_TEST // st["eval_batch_size"]) * decode(st["eval_batch_size"], st["eval_max_new_tokens"])
    out["evaluations"] = n_evals * val + test
    return out


SWEEP_RUNS = [  # one seed of the default experiments (sweep.sh): (method, critic) per run
    *[("ppo", c) for c in ("none", "small", "medium", "large", "full")] * 2,  # critic, and h2h at the same steps
    ("grpo", "none"), ("grpo", "none"),  # h2h: grpo-group and grpo-group-unscaled
    ("dpo", "online"), ("dpo", "offline"),  # h2h: DPO gold online and offline
    ("dpo", "offline"), ("dpo", "online"), ("dpo", "offline"), ("dpo", "online"),  # labels: self and gold
]  # fmt: skip


def model_estimate_markdown(model: str, steps: int, seeds: int, eval_every: int = 25, gpu: str = "h200") -> str:
    """The study's memory per run and the full sweep's time on one GPU, by arithmetic from the model's shape."""
    if model not in MODEL_SHAPES:
        raise runtime.UserError(f"--estimate-model {model!r}: choose one of {', '.join(MODEL_SHAPES)}")
    s, g = MODEL_SHAPES[model], GPUS[gpu]
    p = model_params(s)
    lines = [
        f"{model}: {p['total'] / 1e6:,.1f}M parameters ({'tied' if s['tied'] else 'untied'} embeddings, vocabulary "
        f"{s['vocab']:,}, hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads on {s['kv_heads']} kv heads), "
        f"the study's settings, one {g['name']} ({g['memory'] / 2**30:.0f} GiB). Arithmetic, not a measurement "
        f"(`python report.py --estimate-model {model} --steps {steps} --seeds {seeds}`): training at {MFU:.0%} of the "
        f"bf16 peak, a decode step at max(bytes / HBM bandwidth, FLOPs / peak) + {KERNEL_GAP_S * 1e6:.0f} us per "
        f"layer, activations {ACT_BYTES_H} H + "
        f"{ACT_BYTES_I} I bytes per token per layer.",
        "",
        "| run | peak memory | fits | the largest part | rollouts | training | MC | evaluations | per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total = 0.0
    for method, critic in dict.fromkeys(SWEEP_RUNS):
        mem = run_memory(s, method, critic)
        peak = sum(mem.values())
        big = max(mem, key=mem.get)
        sec = run_seconds(s, method, critic, steps, eval_every)
        name = method if method == "grpo" else f"{method}-{critic}"
        fits = "yes"
        if peak > g["memory"]:  # the largest micro-batch that fits, halving from the preset's
            micro = STUDY[method]["micro_batch_size"] // 2
            while micro > 1 and sum(run_memory(s, method, critic, micro).values()) > g["memory"]:
                micro //= 2
            need = sum(run_memory(s, method, critic, micro).values())
            fits = f"**no**: at --micro-batch-size {micro}, {need / 2**30:.0f} GiB"
        lines.append(
            f"| {name} | {peak / 2**30:.1f} GiB | {fits} | {big}: "
            f"{mem[big] / 2**30:.1f} GiB | {fmt_time(sec['rollouts'])} | {fmt_time(sec['training'])} | "
            f"{fmt_time(sec.get('MC measurement', 0.0))} | {fmt_time(sec['evaluations'])} | "
            f"{fmt_time(sum(sec.values()))} |"
        )
    for method, critic in SWEEP_RUNS:
        total += sum(run_seconds(s, method, critic, steps, eval_every).values())
    lines += [
        "",
        f"**The full sweep: {len(SWEEP_RUNS)} runs x {seeds} seeds, {total * seeds / 3600:.1f} h on one {g['name']}**, "
        "one run after another (the budget-matched runs taken at GRPO's steps; process start-up and model loading "
        "not counted).",
    ]
    return "\n".join(lines)


# ======================================================================================================
# The report
# ======================================================================================================


def load_runs(out: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every readable run under out, and one line per damaged results.json (named; left in place here)."""
    runs, problems = [], []
    for experiment, run_dir in run_folders(out):
        try:
            runs.append(load_run(run_dir, experiment))
        except runtime.UserError as e:
            problems.append(str(e))
    return runs, problems


def missing_runs(out: Path, runs: list[dict[str, Any]]) -> list[str]:
    """Planned runs without a results.json, with what the sweep recorded about them."""
    have = {Path(r["dir"]).resolve() for r in runs}
    lines = []
    for experiment, _run, run_dir in read_plan(out):
        if run_dir.resolve() in have:
            continue
        status_path = out / "logs" / experiment / f"{run_dir.name}.status"
        log_path = status_path.with_suffix(".log")
        status = status_path.read_text().split() if status_path.is_file() else []
        if status and status[0] == "failed":
            why = f"failed (exit {status[1]}; log {log_path})" + (
                f": {' '.join(status[3:])}" if len(status) > 3 else ""
            )
        elif status and status[0] == "stopped":
            why = "stopped by a signal after a checkpoint; ./sweep.sh resumes it"
        else:
            why = "not run yet"
        lines.append(f"{experiment}/{run_dir.name}: {why}")
    return lines


def old_run_columns(runs: list[dict[str, Any]]) -> str:
    """One line naming the columns that runs written before the current measurement cannot fill, or ''."""
    missing: dict[str, list[str]] = {}
    for r in runs:
        name = f"{r['experiment']}/{Path(r['dir']).name}"
        if r["mc"]["old_format"]:
            missing.setdefault(NEW_COLUMNS["nmse"], []).append(name)
        if r["correct"] is None:
            missing.setdefault(NEW_COLUMNS["paired"], []).append(name)
        if not finite(r["update_flops"]) and r["method"] in ("ppo", "grpo"):  # dpo.py does not record it
            missing.setdefault(NEW_COLUMNS["update_flops"], []).append(name)
    if not missing:
        return ""
    parts = [f"{col} ({len(names)} run{'s' if len(names) > 1 else ''}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
             for col, names in missing.items()]  # fmt: skip
    return "Runs written before the current measurement leave these columns empty: " + "; ".join(parts) + "."


def preflight_lines(out: Path) -> list[str]:
    """report.md's opening: the preflight's numbers (OUT/preflight.json, written by preflight.py), or one line
    saying that this folder has none."""
    path = out / "preflight.json"
    if not path.is_file():
        return ["", "Preflight: none in this folder (`./sweep.sh --preflight` measures the model's signal first)."]
    try:
        p = json.loads(path.read_text())
        st, pr, thr = p["settings"], p["predicted"], p["threshold"]["informative"]

        def num(x: Any) -> str:
            return fmt_num(x) if finite(x) else "n/a"

        text = (
            f"**Preflight** ({path.name}, {p.get('written', '?')}): {st['model']} on {st['task']} at temperature "
            f"{st['temperature']:g}, {st['max_new_tokens']} new tokens, {p['prompts']} train prompts x "
            f"{p['samples_per_prompt']}: pass rate {p['pass_rate']:.3f}, signal E[p(1-p)] {p['signal']:.4f}, "
            f"informative {p['informative']:.2f} ({p['informative_prompts']} prompts with 0 < p < 1); threshold "
            f"{thr:g}: {'passed' if p['passed'] else 'refused (the sweep ran with --force)'}. Predicted standard "
            f"error of one run's nmse: GRPO's leave-one-out mean {num(pr['se_nmse_grpo'])} at {pr['prompt_states']} "
            f"prompt states (its value {num(pr['nmse_grpo'])}), a perfect critic's {num(pr['se_nmse_perfect'])} "
            f"over {pr['states']} states (K = {pr['mc_samples']})."
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        return ["", f"Preflight: {path} is damaged ({type(e).__name__}: {e}); ./sweep.sh --preflight writes it anew."]
    if not p["passed"]:
        text += " Too few prompts carry signal: the baselines' errors below rest on little."
    return ["", text]


def informative_warnings(runs: list[dict[str, Any]], out: Path) -> list[str]:
    """One warning per run whose pooled count of informative states (metrics.jsonl's mc/informative_states over
    the measurements after the first, as mc_summary pools them) is below what the preflight's threshold implies:
    threshold x the states it measured (preflight.json's threshold, else preflight.MIN_INFORMATIVE)."""
    threshold = preflight.MIN_INFORMATIVE
    try:
        threshold = float(json.loads((out / "preflight.json").read_text())["threshold"]["informative"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    lines = []
    for r in sorted(runs, key=lambda r: (*sort_key(r["experiment"], r["run"]), r["seed"])):
        meas = [row for row in r["rows"] if finite(row.get("mc/informative_states")) and finite(row.get("mc/states"))]
        meas = meas[1:] if len(meas) > 1 else meas
        k, n = sum(row["mc/informative_states"] for row in meas), sum(row["mc/states"] for row in meas)
        if meas and k < threshold * n:
            lines.append(
                f"- warning: {r['experiment']}/{Path(r['dir']).name} measured {k:.0f} informative states of {n:.0f} "
                f"(0 < p < 1; fewer than the {math.ceil(threshold * n)} that the preflight's threshold {threshold:g} "
                "implies): its baseline error rests on few states"
            )
    return ["", *lines] if lines else []


def data_differences(runs: list[dict[str, Any]]) -> list[str]:
    """One line per experiment whose runs used different data (results.json's "data": each split's count and
    SHA-256), naming the runs of each version; runs from before the fingerprint are left out of the comparison."""
    lines = []
    for experiment in sorted({r["experiment"] for r in runs}, key=lambda e: sort_key(e, "")):
        versions: dict[tuple, list[str]] = {}  # (train, val, test) as (n, sha256) -> the runs' folder names
        for r in sorted(runs, key=lambda r: (*sort_key(r["experiment"], r["run"]), r["seed"])):
            if r["experiment"] == experiment and r.get("data"):
                split = [r["data"].get(s) or {} for s in ("train", "val", "test")]
                key = tuple((d.get("n"), d.get("sha256")) for d in split)
                versions.setdefault(key, []).append(Path(r["dir"]).name)
        if len(versions) > 1:
            shown = "; ".join(
                f"{', '.join(names)} (train {k[0][0]}, val {k[1][0]}, test {k[2][0]} problems; "
                f"sha256 {'/'.join(str(h)[:8] for _, h in k)})"
                for k, names in versions.items()
            )
            lines.append(f"- warning: the runs of {experiment} used different data: {shown}")
    return ["", *lines] if lines else []


def write_report(out: Path, report_dir: Path) -> Path:
    runs, damaged = load_runs(out)
    if not runs:
        raise runtime.UserError(f"no finished run (results.json) under {out}/<experiment>/<run>/")
    report_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)
    summary_cols = list(summary[0].keys())
    write_csv(report_dir / "summary.csv", summary, summary_cols)
    write_csv(
        report_dir / "runs.csv",
        sorted((flat_run(r) for r in runs), key=lambda r: (*sort_key(r["experiment"], r["run"]), r["seed"])),
        RUN_COLUMNS,
    )

    plots: list[tuple[str, str]] = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        caption = plot_crossover(plt, runs, report_dir / "crossover.png")
        plots.append(("crossover.png", caption))
        plot_curves(plt, runs, report_dir / "curves.png")
        plots.append(("curves.png", "Learning curves: mean over seeds, with a 95% band where there are several."))
        plot_errors(plt, runs, report_dir / "errors.png")
        plots.append(
            (
                "errors.png",
                "nmse against nmse centred per baseline: below the diagonal is a constant offset. The axes keep to the"
                " runs' scale; a measurement beyond is drawn on the edge (>), and the title says how many.",
            )
        )

    models = sorted({r["model"] for r in runs})
    devices = sorted({r["device"] for r in runs})
    scales = sorted({r["scale"] for r in runs})
    budgets = sorted(
        {
            (r["seed"], r["generated_tokens"], r["steps"], str(r["dir"]))
            for r in runs
            if r["experiment"] == "h2h" and r["method"] == "grpo" and r["variant"] == "group"  # the reference run
        }
    )
    lines = [
        f"# Sweep report: {out}",
        *preflight_lines(out),
        *informative_warnings(runs, out),
        *data_differences(runs),
        "",
        f"Written by report.py on {time.strftime('%Y-%m-%d %H:%M')} from {len(runs)} finished runs. "
        f"Model: {', '.join(models)}; scale: {', '.join(scales)}; device: {', '.join(devices)}.",
    ]
    if "tiny" in models:
        lines.append(
            "\nA smoke sweep: the tiny random model at a few steps. The numbers show that every piece runs, not "
            "what the methods do. Every run but the gold-pair DPO runs uses the toy task (reward 1 when a target "
            "token appears), since the tiny model never solves GSM8K."
        )
    if budgets:
        lines.append(
            "\nMatched budget (h2h), from each seed's GRPO run: "
            + "; ".join(f"seed {s}: {t:,} generated tokens in {n} steps" for s, t, n, _ in budgets)
            + "."
        )
    lines += ["", DEFINITIONS, "## Results", "", markdown_table(summary), ""]
    lines.append(
        "Per-run numbers (every seed, MC tokens, RMSE, explained variance, GRPO's group mean): runs.csv; this table: "
        "summary.csv."
    )
    unfilled = old_run_columns(runs)
    if unfilled:
        lines += ["", unfilled]
    problems = damaged + missing_runs(out, runs)
    if problems:
        lines += ["", "## Failed, missing or damaged runs", ""] + [f"- {p}" for p in problems]
    if plots:
        lines += ["", "## Plots", ""]
        for name, caption in plots:
            lines += [f"![{name}]({name})", "", caption, ""]
    else:
        lines += ["", "matplotlib is not installed: no plots (`pip install matplotlib`, then `python report.py OUT`)."]
    lines += ["", "## Duration of the full sweep", ""]
    if any("cpu" not in r["device"] for r in runs):
        gpu_runs = [r for r in runs if "cpu" not in r["device"]]
        lines.append(estimate_markdown(gpu_runs, 200, 3))
    else:
        lines.append(
            "These runs were made on the CPU, so they say nothing about a GPU. On a GPU, run the sweep briefly at the "
            "study's settings and extrapolate from its step times:\n\n"
            "    ./sweep.sh --seeds 1 --scale study --out runs/timing -- --total-steps 12 --eval-every 6\n"
            "    python report.py --estimate runs/timing --steps 200 --seeds 3\n\n"
            "per run: steps x s/step + MC measurements x s/MC + evaluations x s/eval + the test + the rest "
            "(offline DPO's pair sampling); summed over the 17 runs of one seed, times the seeds."
        )
    text = "\n".join(lines) + "\n"
    (report_dir / "report.md").write_text(text)
    return report_dir / "report.md"


@dataclass
class Args:
    """The sweep's report (report.py OUT -> OUT/report/), each run's curves (report.py RUN_DIR [RUN_DIR ...] ->
    RUN_DIR/curves.png), or the full sweep's duration (report.py --estimate OUT --steps 200 --seeds 3)."""

    paths: Annotated[list[str], tyro.conf.Positional, tyro.conf.arg(metavar="FOLDER ...")] = field(default_factory=list)
    """a sweep's folder (OUT/<experiment>/<run>/results.json): its report; or run folders (each holding metrics.jsonl): each run's curves as curves.png beside it"""
    report_dir: str | None = None
    """where a sweep's report goes (default: OUT/report)"""
    estimate: str | None = None
    """print the full sweep's duration from the step times of the runs under this sweep folder"""
    estimate_model: str | None = None
    """print the study's memory and time by arithmetic for this model (report.MODEL_SHAPES: its short names)"""
    steps: int = 200
    """--estimate: the study's steps per run"""
    seeds: int = 3
    """--estimate: seeds in the full sweep"""
    eval_every: int = 25
    """--estimate: the study's --eval-every"""


def is_run_folder(path: Path) -> bool:
    """A trainer's run folder (it holds metrics.jsonl), not a sweep's folder of experiments."""
    return (path / "metrics.jsonl").is_file()


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed), or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def main(argv: list[str] | None = None) -> None:
    a = runtime.parse_args(Args, argv)
    if a.estimate_model:
        print(model_estimate_markdown(a.estimate_model, a.steps, a.seeds, a.eval_every))
        return
    if bool(a.paths) == bool(a.estimate):
        raise runtime.UserError("give a sweep's folder OUT, run folders, or --estimate OUT (exactly one)")
    for flag, value, default in (("--steps", a.steps, 1), ("--seeds", a.seeds, 1), ("--eval-every", a.eval_every, 1)):
        if value < default:
            raise runtime.UserError(f"{flag} {value} must be a positive number")
    if a.estimate:
        runs, damaged = load_runs(Path(a.estimate))
        for line in damaged:
            print(f"warning: {line}", file=sys.stderr)
        if not runs:
            raise runtime.UserError(f"no finished run (results.json) under {a.estimate}/<experiment>/<run>/")
        print(estimate_markdown(runs, a.steps, a.seeds, a.eval_every))
        return
    paths = [Path(p) for p in a.paths]
    for path in paths:
        if not path.is_dir():
            raise runtime.UserError(f"{path} is not a folder")
    runs = [p for p in paths if is_run_folder(p)]
    if not runs:  # a sweep's folder
        if len(paths) > 1:
            raise runtime.UserError(f"give one sweep folder at a time, not {len(paths)}: {' '.join(map(str, paths))}")
        path = write_report(paths[0], Path(a.report_dir) if a.report_dir else paths[0] / "report")
        print(f"report: {path}")
        return
    if len(runs) < len(paths):
        other = next(p for p in paths if not is_run_folder(p))
        raise runtime.UserError(f"{other} holds no metrics.jsonl: give run folders, or one sweep folder alone")
    if a.report_dir:
        raise runtime.UserError("--report-dir is for a sweep's report; a run's curves go beside its metrics.jsonl")
    plt = pyplot()
    if plt is None:
        raise runtime.UserError("drawing a run's curves needs matplotlib: pip install matplotlib")
    for run_dir in runs:
        print(f"curves: {plot_run(plt, run_dir)}")


if __name__ == "__main__":
    runtime.run_main(main)
