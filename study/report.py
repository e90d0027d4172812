"""The sweep's report: a results table (Markdown and CSV) and plots from the runs' results.json and metrics.jsonl.

sweep.sh writes every run into OUT/<experiment>/<method>-<variant>-s<seed> and calls this at the end; it also
works on demand, on whatever runs a folder holds. matplotlib draws the plots (plots.py) when it is installed (it
is in requirements.txt); without it the tables are still written.

    python report.py runs/sweep                         # -> runs/sweep/report/: report.md, summary.csv, runs.csv, *.png
    python report.py runs/ppo-small-s1                  # one run's curves: runs/ppo-small-s1/curves.png
    python report.py --estimate runs/timing --steps 200 --seeds 3   # the full sweep's duration from measured step times

Holds: the column definitions, the summary per method and variant (intervals over seeds), the paired comparison
with GRPO, the tables, report.md with the preflight's numbers and warnings, and the command line.
Does not hold: reading runs (read_runs.py), drawing (plots.py), estimating durations and memory (estimate.py), the
crossover's section and figure (crossover.py), how it moves with the organism (moves.py): this calls each where the
sweep's folder has its parts.
It only reads: no run folder is moved or renamed here (the sweep's scheduler, sweep_runner.py, owns the runs).
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import tyro

import intervals
import measure
from plumbing import cmdline, errors, runtime
from study import crossover, moves, preflight
from study.estimate import estimate_markdown, model_estimate_markdown
from study.plots import plot_crossover, plot_curves, plot_errors, plot_run
from study.read_runs import (
    ERROR_COLUMNS,
    FLOPS_PARTS,
    NMSE_SUMS,
    error_columns,
    finite,
    fmt_interval,
    fmt_num,
    fmt_pct,
    fmt_signed_interval,
    fmt_time,
    fmt_tokens,
    load_run,
    mean,
    nmse_difference,
    nmse_interval,
    read_plan,
    run_folders,
    sort_key,
)

# What report.py fills only from runs written after the measurement of docs/measurement.md
NEW_COLUMNS = {
    "nmse": "baseline error (nmse, nmse_centred, within_nmse, ...)",
    "paired": "paired difference vs GRPO",
    "update_flops": "FLOPs estimate",
}

DEFINITIONS = """\
The definitions, with their formulas: docs/measurement.md.

- **test acc.**: greedy, strict `####` answer, on the test problems (n in runs.csv). Several seeds: the mean over
  seeds with a t interval, mean +- t(0.975, n - 1) sd / sqrt(n) (t = 4.30 for 3 seeds; intervals.mean_interval).
  One seed (†): the run's Wilson interval over its problems.
- **vs GRPO**: the paired difference in test accuracy, in points, from GRPO's group-mean run of the same experiment
  on the same test problems: per seed the mean over problems of the difference, then the t interval over those
  per-seed differences (intervals.paired_seed_difference: it carries the seed-to-seed variance; t = 4.30 for 3
  seeds, so wide). One seed (†): the paired t interval over its problems, which says nothing about another seed.
- **[n/a]**: no interval: one unit, or units (seeds) that agree exactly. An interval of zero width would read as
  certain; agreeing seeds say that the spread is small, and the interval needs more seeds.
- **gen. tokens**: tokens of training rollouts only, the compute that the head-to-head matches (Monte Carlo and
  evaluation tokens are apart). **total FLOPs**: the training FLOPs, estimated from what each run recorded
  (read_runs.flops_estimate): ~2 N a token through a forward (the rollouts, the reference's log-probs, old
  log-probs and a critic's old values) and 6 N a trained token (completion tokens x epochs) for the update, the
  critic's with its own N; prompt tokens and attention's quadratic term are not counted, the MC measurement and the
  evaluations are apart. The Compute section gives each part, wall time (the run's own clock) and train time (less
  the MC measurement and the evaluations). Matched compute is read three ways: tokens (the budget), FLOPs, time;
  what each matching leaves unmatched (prompts per token, gold solutions, pairs per completion): docs/sweep.md.
- **matched compute (h2h)**: for each seed, grpo.py runs first for the scale's steps; its generated tokens are the
  budget. The others run with `--token-budget` = that budget (and a step cap 10x GRPO's steps, so that the budget
  ends them; a linear or cosine learning rate decays over the budget, not the cap); a run stops after the step that
  reaches the budget, so it can overshoot by one step's tokens ("vs budget"). Offline DPO spends the budget once,
  sampling its pairs from the reference model, then trains for GRPO's number of steps.
- **nmse** (measure.baseline_error, against K fresh rollouts from the prompt and from states drawn uniformly inside
  each measured completion, token-weighted): the baseline's noise-corrected MSE against the true value over the
  outcome variance there, E[p(1-p)] of the 0/1 score: the share by which the baseline inflates Var(R - b) over a
  perfect baseline's (0 perfect; below 0 only by the noise correction). **nmse at prompt**: the same at the prompt
  states only, where GRPO's leave-one-out mean of G reads 1/(G-1) (0.14 at G = 8) whatever the success rate: a
  critic is compared there for noise. Over the token-weighted states (**nmse**) GRPO's one constant cannot follow
  V(s_t) and reads (1/(G-1) + d)/(1 - d), d the share of the outcome's variance already resolved (the preflight
  measures it): a critic is compared there for tracking the value. **less GRPO's**: this baseline's nmse minus
  GRPO's (the experiment's grpo-group, else the head-to-head's), below 0 where it is the better, with the interval
  of that difference (intervals.ratio_difference_interval, paired by seed). **nmse centred**: after removing the
  mean error (what whitening removes). **within**: after removing each prompt's mean error. **informative share**:
  the share of measured prompt states whose K 0/1 scores differ (0 < p < 1: where a baseline can matter at all),
  as the preflight measures it (informative_any in the CSVs: a prompt with any such state, inside ones too).
- Every nmse is pooled as sums over a run's measurements after the first (the untrained critic) and over seeds,
  never averaged as roots or ratios; its interval is centred on that pooled value (intervals.ratio_interval, the
  seeds as units; one seed (†): its measurements). With 3 seeds it covered 95% in simulation with a moderate seed
  effect and 86% when the critic's error differs between seeds by a factor of e: read it as approximate.
- GRPO's row is its leave-one-out mean (its effective baseline). Its group mean, the completion's own reward in it,
  reads 1/G at the prompt (summary.csv and runs.csv: nmse_group_mean_prompt); pooled over the token-weighted states
  (nmse_group_mean) it reads (1 + (G-2) d) / (G (1 - d)) (0.50 at d = 0.3, G = 8), below the leave-one-out mean
  only because it holds that completion's own outcome.
"""


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
        m, lo, hi = intervals.mean_interval(accs)  # seeds that agree: no interval (nan), never a zero-width one
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
        for part in FLOPS_PARTS:
            row[f"flops_{part}"] = mean([r["flops"][part] for r in rs])
        pooled = measure.pool_baseline_errors([r["mc"]["sums"] for r in rs])  # sums over seeds, then the ratios
        row.update(error_columns(pooled, measure.pool_baseline_errors([r["mc"]["prompt_sums"] for r in rs])))
        for key in NMSE_SUMS:  # centred on the pooled value printed
            x, lo, hi, units = nmse_interval(rs, key)
            row[key], row[f"{key}_low"], row[f"{key}_high"] = x, lo, hi
        row["nmse_interval"] = units
        ref = grpo_reference(runs, experiment)
        for key, diff in (("nmse_prompt", "diff_prompt"), ("nmse", "diff")):  # this run's nmse less GRPO's
            d, lo, hi, units = nmse_difference(rs, ref, key) if ref and ref != rs else (float("nan"),) * 3 + ("",)
            row.update({diff: d, f"{diff}_low": lo, f"{diff}_high": hi, f"{diff}_interval": units})
        for name, part in (("nmse_group_mean", "group_sums"), ("nmse_group_mean_prompt", "group_prompt_sums")):
            group = measure.pool_baseline_errors([r["mc"].get(part) or {} for r in rs])  # pooled as the rest
            row[name] = group.get("nmse", float("nan"))
        d, lo, hi, n_items, n_seeds = paired.get((experiment, run), (float("nan"),) * 5)
        row.update(vs_grpo=d, vs_grpo_low=lo, vs_grpo_high=hi, vs_grpo_problems=n_items, vs_grpo_seeds=n_seeds)
        rows.append(row)
    return rows


def grpo_reference(runs: list[dict[str, Any]], experiment: str) -> list[dict[str, Any]]:
    """The GRPO runs a baseline's nmse is compared with: the experiment's grpo-group, else the head-to-head's (the
    critic sweep has none of its own; h2h's runs for the same steps and seeds)."""
    for exp in (experiment, "h2h"):
        ref = [r for r in runs if r["experiment"] == exp and r["run"] == "grpo-group"]
        if ref:
            return ref
    return []


def paired_vs_grpo(
    runs: list[dict[str, Any]], reference: str = "grpo-group"
) -> dict[tuple[str, str], tuple[float, float, float, float, float]]:
    """(experiment, run) -> the paired difference in test accuracy from that experiment's reference run (GRPO's
    group mean; the crossover's control, ppo-none, for its critics) over the seeds both have: intervals.paired_seed_difference (the t interval over the per-seed paired differences, which
    carries the seed-to-seed variance; one seed: its problems' paired interval), the number of problems and of
    seeds. Needs per-problem correctness (results.json's test.correct) of the same problems in both."""
    out = {}
    for experiment in {r["experiment"] for r in runs}:
        ref = {r["seed"]: r["correct"] for r in runs if r["experiment"] == experiment and r["run"] == reference}
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["experiment"] == experiment and r["run"] != reference:
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
            out[(experiment, run)] = (*intervals.paired_seed_difference(a, b), float(len(a[0])), float(len(pairs)))
    return out


ONE_SEED = "†"


def markdown_tables(rows: list[dict[str, Any]]) -> str:
    """The results, first and short: accuracy and compute, then the baseline error with its intervals and its
    difference from GRPO's. A cell whose interval is over one seed's measurements or test problems is marked †."""

    def mark(cell: str, one_seed: bool) -> str:
        return cell + ONE_SEED if one_seed and "[" in cell and "n/a" not in cell else cell

    def pooled(r: dict[str, Any], key: str, signed: bool = False) -> str:
        x, lo, hi = r[key], r[f"{key}_low"], r[f"{key}_high"]
        units = r.get(f"{key}_interval", r["nmse_interval"]) if key.startswith("diff") else r["nmse_interval"]
        return mark(fmt_interval(x, lo, hi, signed=signed), units.endswith("1 seed"))

    head = ["experiment", "run", "seeds", "test acc. % [95%]", "vs GRPO, points [95%]", "gen. tokens", "total FLOPs",
            "wall time"]  # fmt: skip
    acc = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        interval = (
            f"[{fmt_pct(r['interval_low'])}, {fmt_pct(r['interval_high'])}]"
            if finite(r["interval_low"])
            else f"n/a ({r['interval']})"
        )
        vs = fmt_signed_interval(r["vs_grpo"], r["vs_grpo_low"], r["vs_grpo_high"])
        cells = [r["experiment"], r["run"], str(r["seeds"]), mark(f"{fmt_pct(r['test_accuracy'])} {interval}",
                 r["interval"] == "wilson"), mark(vs, r["vs_grpo_seeds"] == 1), fmt_tokens(r["generated_tokens"]),
                 fmt_tokens(r["flops_total"]), fmt_time(r["wall_time_s"])]  # fmt: skip
        acc.append("| " + " | ".join(cells) + " |")
    head = ["experiment", "run", "seeds", "nmse at prompt [95%]", "less GRPO's", "nmse [95%]", "less GRPO's",
            "nmse centred [95%]", "within [95%]", "informative share"]  # fmt: skip
    err = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if not (finite(r["nmse"]) or finite(r["nmse_prompt"])):
            continue
        cells = [r["experiment"], r["run"], str(r["seeds"]), pooled(r, "nmse_prompt"), pooled(r, "diff_prompt", True),
                 pooled(r, "nmse"), pooled(r, "diff", True), pooled(r, "nmse_centred"), pooled(r, "within_nmse"),
                 fmt_num(r["informative_share"], 2)]  # fmt: skip
        err.append("| " + " | ".join(cells) + " |")
    out = "\n".join(acc)
    if len(err) > 2:
        out += (
            "\n\nThe baselines' error against Monte Carlo (nmse: 0 for a perfect baseline; GRPO's leave-one-out mean "
            "reads 1/(G-1) at the prompt; \"less GRPO's\": this nmse minus GRPO's, below 0 where this baseline is the "
            "better, with the interval of that difference):\n\n" + "\n".join(err)
        )
    if ONE_SEED in out:
        out += (
            f"\n\n{ONE_SEED} one seed: the interval is over that run's measurements (nmse) or test problems (accuracy, "
            "Wilson; the paired difference), not over seeds: it says what the same run would read again, not what "
            "another seed would (with a seed effect it covered the cross-seed value 69-90% in simulation)."
        )
    return out


def compute_table(rows: list[dict[str, Any]]) -> str:
    """Each run's budget, three ways: generated training tokens, FLOPs by part (read_runs.flops_estimate) and time."""
    head = ["experiment", "run", "gen. tokens", "vs budget", "generation", "reference", "old values", "update FLOPs",
            "critic", "total FLOPs", "MC FLOPs", "wall time", "train time", "rollout"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["experiment"], r["run"], fmt_tokens(r["generated_tokens"]), fmt_num(r["tokens_vs_budget"], 2),
                 *(fmt_tokens(r[f"flops_{p}"]) for p in ("generation", "reference", "old", "update", "critic",
                                                          "total", "measurement")),
                 fmt_time(r["wall_time_s"]), fmt_time(r["train_time_s"]), r.get("rollout", "-")]  # fmt: skip
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
    "nmse_group_mean_prompt",
    "measurements",
    *(f"flops_{p}" for p in FLOPS_PARTS),
]


def flat_run(r: dict[str, Any]) -> dict[str, Any]:
    flops = {f"flops_{p}": v for p, v in r["flops"].items()}
    return {**{k: v for k, v in r.items() if k not in ("mc", "correct", "flops")}, **r["mc"], **flops}


# ======================================================================================================
# The report
# ======================================================================================================


def load_runs(out: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every readable run under out, and one line per damaged results.json (named; left in place here)."""
    runs, problems = [], []
    for experiment, run_dir in run_folders(out):
        try:
            runs.append(load_run(run_dir, experiment))
        except errors.UserError as e:
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
        if not finite(r["flops"]["total"]):  # the tokens and parameters read_runs.flops_estimate needs
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
        if isinstance(p, dict) and "passed" in p and "smallest_effect" not in p:
            return ["", f"Preflight: {path} was written by an older preflight (an informative-share threshold, no "
                    "standard error over states); `./sweep.sh --preflight` writes it anew."]  # fmt: skip
        st, pr, effect = p["settings"], p["predicted"], float(p["smallest_effect"])
        bounds = pr.get("bounds") or []

        def num(key: str) -> str:
            return ("<= " if key in bounds else "") + fmt_num(pr.get(key)) if finite(pr.get(key)) else "n/a"

        rule = f"the smallest effect {effect:g}" if effect else "no smallest effect asked (--smallest-effect 0)"
        resolved_se = f" +- {num('se_resolved')}" if "se_resolved" in pr else ""  # older files: d alone
        text = (
            f"**Preflight** ({path.name}, {p.get('written', '?')}): {st['model']} on {st['task']} at temperature "
            f"{st['temperature']:g}, {st['max_new_tokens']} new tokens, {p['prompts']} train prompts x "
            f"{p['samples_per_prompt']}: pass rate {p['pass_rate']:.3f}, outcome variance E[p(1-p)] "
            f"{p['signal']:.4f}, informative share {p['informative']:.2f} ({p['informative_prompts']} prompts with "
            f"0 < p < 1), resolved share inside d {num('resolved')}{resolved_se}. Predicted for one run's nmse, value "
            f"+- standard error: GRPO's leave-one-out mean {num('nmse_grpo_prompt')} +- {num('se_grpo_prompt')} at "
            f"{pr['prompt_states']} prompt states and {num('nmse_grpo_states')} +- {num('se_grpo_states')} over "
            f"{pr['effective_states']:,.0f} effective of {pr['states']:,} token-weighted states; a perfect critic "
            f"0 +- {num('se_perfect_prompt')} and 0 +- {num('se_perfect_states')} (K = {pr['mc_samples']}). GRPO's "
            f"3-seed interval at the prompt: +- {num('half_width_3_seeds')} (median), against {rule}: "
            f"{'passed' if p['passed'] else 'refused (the sweep ran with --force)'}."
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return ["", f"Preflight: {path} is damaged ({type(e).__name__}: {e}); ./sweep.sh --preflight writes it anew."]
    if not p["passed"]:
        text += " The baselines' errors below cannot tell the smallest effect apart."
    return ["", text]


def toy_banner(runs: list[dict[str, Any]], out: Path) -> list[str]:
    """A line saying that these numbers are no result, where they are none: the tiny random model or the toy task
    (the smoke sweep), or a model the preflight refused (the sweep ran with --force)."""
    why = toy_reason(runs, out)
    return (
        ["", f"**{why}: the numbers and figures below show that every piece runs, not what the methods do.**"]
        if why
        else []
    )


def toy_reason(runs: list[dict[str, Any]], out: Path) -> str:
    """Why these runs answer nothing ('' where they may): the tiny model, the toy task, or a refused preflight."""
    models, tasks = {r["model"] for r in runs}, {r["task"] for r in runs}
    if "tiny" in models or "toy" in tasks:
        return "A smoke sweep (the tiny random model; the toy task: reward 1 when a target token appears)"
    try:
        if not json.loads((out / "preflight.json").read_text())["passed"]:
            return "The preflight refused this model (too little signal; the sweep ran with --force)"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return ""


def informative_warnings(runs: list[dict[str, Any]]) -> list[str]:
    """One warning per run whose measured prompt states have an informative share (their K 0/1 scores not all
    equal: 0 < p < 1) below preflight.MIN_INFORMATIVE, pooled over the measurements after the first as mc_summary
    pools them. Like with like: the preflight's informative share is measured at the prompt too; states inside a
    completion are more often decided, so their share is lower for the same model."""
    lines = []
    for r in sorted(runs, key=lambda r: (*sort_key(r["experiment"], r["run"]), r["seed"])):
        sums = r["mc"].get("prompt_sums") or {}
        k, n = sums.get("signal_groups"), sums.get("groups")
        if finite(k) and finite(n) and n > 0 and k < preflight.MIN_INFORMATIVE * n:
            lines.append(
                f"- warning: {r['experiment']}/{Path(r['dir']).name}: {k:.0f} of {n:.0f} prompt states informative "
                f"(0 < p < 1; share {k / n:.2f} < {preflight.MIN_INFORMATIVE:g}): its baseline error at the prompt "
                "rests on few states"
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
        raise errors.UserError(f"no finished run (results.json) under {out}/<experiment>/<run>/")
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
        note = toy_reason(runs, out)  # in every figure's title, where these runs answer nothing
        caption = plot_crossover(plt, runs, report_dir / "crossover.png", note)
        plots.append(("crossover.png", caption))
        plot_curves(plt, runs, report_dir / "curves.png", note)
        plots.append(
            (
                "curves.png",
                "Learning curves: mean over seeds, with a 95% band where there are several; a curve drawn over an"
                ' earlier one is a larger ring and says "same as" in the legend.',
            )
        )
        plot_errors(plt, runs, report_dir / "errors.png", note)
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
        *toy_banner(runs, out),
        *informative_warnings(runs),
        *data_differences(runs),
        "",
        "## Results",
        "",
        f"Written by report.py on {time.strftime('%Y-%m-%d %H:%M')} from {len(runs)} finished runs. "
        f"Model: {', '.join(models)}; scale: {', '.join(scales)}; device: {', '.join(devices)}.",
    ]
    if budgets:
        lines.append(
            "\nMatched budget (h2h), from each seed's GRPO run: "
            + "; ".join(f"seed {s}: {t:,} generated tokens in {n} steps" for s, t, n, _ in budgets)
            + "."
        )
    lines += ["", markdown_tables(summary), ""]
    lines.append(
        "Every column, and per run (every seed, MC tokens, RMSE, bias, explained variance, GRPO's group mean): "
        "summary.csv, runs.csv."
    )
    unfilled = old_run_columns(runs)
    if unfilled:
        lines += ["", unfilled]
    hardware = "one kind of hardware, " + devices[0] if len(devices) == 1 else f"{len(devices)} kinds of hardware"
    lines += ["", "## Compute", "", f"Each run's budget, three ways (mean over seeds; wall time on {hardware}):", ""]
    lines += [compute_table(summary), ""]
    control = paired_vs_grpo(runs, crossover.CONTROL)  # the crossover's critics against PPO without one
    lines += crossover.section(out, summary, runs, plt, report_dir, toy_reason(runs, out), control)  # [] without it
    paired = {ref: paired_vs_grpo(runs, ref) for _, refs in moves.H2H.values() for ref in refs} | {
        crossover.CONTROL: control
    }
    lines += moves.section(out, plt, report_dir, toy_reason(runs, out), summary, runs, paired)  # [] without them
    problems = damaged + missing_runs(out, runs)
    if problems:
        lines += ["", "## Failed, missing or damaged runs", ""] + [f"- {p}" for p in problems]
    if plots:
        lines += ["", "## Plots", ""]
        for name, caption in plots:
            lines += [f"![{name}]({name})", "", caption, ""]
    else:
        lines += ["", "matplotlib is not installed: no plots (`pip install matplotlib`, then `python report.py OUT`)."]
    lines += ["", "## How to read it", "", DEFINITIONS, "## Duration of the full sweep", ""]
    per_seed = len({(e, name) for e, name, _ in read_plan(out)} or {(r["experiment"], r["run"]) for r in runs})
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
            f"(offline DPO's pair sampling); summed over the {per_seed} runs of one seed, times the seeds."
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
    """where a sweep's report goes; None: OUT/report"""
    estimate: str | None = None
    """print the full sweep's duration from the step times of the runs under this sweep folder"""
    estimate_model: str | None = None
    """print the study's memory and time by arithmetic for this model (estimate.MODEL_SHAPES: its short names)"""
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
    a = cmdline.parse_args(Args, argv)
    if a.estimate_model:
        print(model_estimate_markdown(a.estimate_model, a.steps, a.seeds, a.eval_every))
        return
    if bool(a.paths) == bool(a.estimate):
        raise errors.UserError("give a sweep's folder OUT, run folders, or --estimate OUT (exactly one)")
    for flag, value, default in (("--steps", a.steps, 1), ("--seeds", a.seeds, 1), ("--eval-every", a.eval_every, 1)):
        if value < default:
            raise errors.UserError(f"{flag} {value} must be a positive number")
    if a.estimate:
        runs, damaged = load_runs(Path(a.estimate))
        for line in damaged:
            print(f"warning: {line}", file=sys.stderr)
        if not runs:
            raise errors.UserError(f"no finished run (results.json) under {a.estimate}/<experiment>/<run>/")
        print(estimate_markdown(runs, a.steps, a.seeds, a.eval_every))
        return
    paths = [Path(p) for p in a.paths]
    for path in paths:
        if not path.is_dir():
            raise errors.UserError(f"{path} is not a folder")
    runs = [p for p in paths if is_run_folder(p)]
    if not runs:  # a sweep's folder
        if len(paths) > 1:
            raise errors.UserError(f"give one sweep folder at a time, not {len(paths)}: {' '.join(map(str, paths))}")
        path = write_report(paths[0], Path(a.report_dir) if a.report_dir else paths[0] / "report")
        print(f"report: {path}")
        return
    if len(runs) < len(paths):
        other = next(p for p in paths if not is_run_folder(p))
        raise errors.UserError(f"{other} holds no metrics.jsonl: give run folders, or one sweep folder alone")
    if a.report_dir:
        raise errors.UserError("--report-dir is for a sweep's report; a run's curves go beside its metrics.jsonl")
    plt = pyplot()
    if plt is None:
        raise errors.UserError("drawing a run's curves needs matplotlib: pip install matplotlib")
    for run_dir in runs:
        print(f"curves: {plot_run(plt, run_dir)}")


if __name__ == "__main__":
    runtime.run_main(main)
