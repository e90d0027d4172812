"""The report's figures: the crossover (accuracy against a baseline's error), the curves, the errors, one run's curves.

Each function takes matplotlib's pyplot (imported by the caller, report.py, only when installed) and the runs as
read_runs.py reads them, and writes one PNG. Does not hold: reading runs (read_runs.py, which also reads the study's
group size G, the 1/(G-1) a run without a group is read against), the tables (report.py), the crossover's curve and
its figure (crossover.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import intervals
from plumbing import errors, rundir
from study.read_runs import (
    EXPERIMENTS,
    MC_BASELINE,
    STUDY_GROUP,
    finite,
    fmt_pct,
    mc_summary,
    mean,
    nmse_interval,
    read_metrics,
    run_variant,
    sort_key,
)

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


# a point of the crossover resting on fewer informative prompts says how many beside it: at 100 informative prompt
# states (p = 0.5, K = G = 8) GRPO's nmse at the prompt has a standard error of ~0.04 (preflight.predicted_se), near
# the smallest effect the preflight asks for (0.05); below, a point's place says little
FEW_STATES = 100
NOT_A_RESULT = "not a result"


def seed_stats(values: list[float]) -> tuple[float, float]:
    """Mean over seeds and the half-width of intervals.mean_interval: nan where there is none (one seed, or seeds
    that agree), never 0, which would draw a bar of zero width that reads as certain."""
    values = [v for v in values if finite(v)]
    if not values:
        return float("nan"), float("nan")
    m, lo, hi = intervals.mean_interval(values)
    return m, (hi - lo) / 2 if finite(lo) else float("nan")


def pooled_over_seeds(rs: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """A baseline-error ratio pooled over the seeds' sums, and the half-width of its interval (nmse_interval,
    centred on it; nan where there is none)."""
    x, lo, hi, _ = nmse_interval(rs, key)
    return x, (hi - lo) / 2 if finite(lo) else float("nan")


def titled(title: str, note: str) -> str:
    """A figure's title, led by why it is no result where it is none (report.toy_reason: the tiny model, the toy
    task, a refused preflight)."""
    return f"{note}: {NOT_A_RESULT}\n{title}" if note else title


def point(ax: Any, x: float, y: float, xerr: float, yerr: float | tuple[float, float], **kw: Any) -> bool:
    """One point with its intervals (yerr a half-width, or the distances down and up of an interval that is not
    symmetric: Wilson's); where either is missing (nan) the marker is hollow and that bar is not drawn (never a bar
    of zero width). Returns whether it was drawn hollow."""
    ys = yerr if isinstance(yerr, tuple) else (yerr, yerr)
    has_x, has_y = finite(xerr), all(finite(v) for v in ys)
    if not (has_x and has_y):
        kw = {**kw, "mfc": "none"}
    ax.errorbar(
        x, y, xerr=xerr if has_x else None, yerr=[[ys[0]], [ys[1]]] if has_y else None, capsize=3, **kw
    )  # fmt: skip
    return not (has_x and has_y)


def accuracy(rs: list[dict[str, Any]]) -> tuple[float, float | tuple[float, float]]:
    """Mean test accuracy over seeds (%) and its interval for point(): over seeds (seed_stats), or one seed's own
    Wilson interval, which is not symmetric about its value."""
    y, half = seed_stats([r["test_accuracy"] for r in rs])
    if len(rs) == 1:
        return 100 * y, (100 * (y - rs[0]["test_ci_low"]), 100 * (rs[0]["test_ci_high"] - y))
    return 100 * y, 100 * half


def informative(rs: list[dict[str, Any]], part: str) -> float:
    """The informative prompts (their K 0/1 scores not all equal) a pooled nmse rests on, over rs's seeds."""
    return sum(float(r["mc"].get(part, {}).get("signal_groups", 0.0)) for r in rs)


def few_states_note(ax: Any, x: float, y: float, n: float, what: str) -> None:
    """Beside a point resting on fewer than FEW_STATES informative prompts: how many. Each note of an axis a line
    above the last; points close together that read the same count at the same accuracy (critics on one another)
    share one note."""
    if n >= FEW_STATES:
        return
    text = f"{n:.0f} informative {what}{'' if round(n) == 1 else 's'}"
    if any(t.get_text() == text and t.xy[1] == y and abs(t.xy[0] - x) <= 0.15 * max(1.0, abs(x)) for t in ax.texts):
        return
    ax.annotate(text, (x, y), textcoords="offset points", xytext=(6, 6 + 9 * len(ax.texts)), fontsize=7, color="grey")


def plot_crossover(plt: Any, runs: list[dict[str, Any]], path: Path, note: str = "") -> str:
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
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), sharey=True)
    hollow = False
    for ax, (key, xlabel) in zip(axes, panels):
        by_run: dict[str, list[dict[str, Any]]] = {}
        for r in ppo:
            by_run.setdefault(r["run"], []).append(r)
        left, right = 0.0, 0.0

        def reach(x: float, xerr: float) -> None:
            nonlocal left, right
            half = xerr if finite(xerr) else 0.0
            left, right = min(left, x - half), max(right, x + half)

        for run, rs in sorted(by_run.items(), key=lambda kv: sort_key(source, kv[0])):
            x, xerr = pooled_over_seeds(rs, key)
            y, yerr = accuracy(rs)
            if not finite(x):
                continue
            reach(x, xerr)
            label = f"PPO, critic {run.removeprefix('ppo-')}"
            hollow |= point(ax, x, y, xerr, yerr, fmt="o", color=colour(run), label=label)
            few_states_note(ax, x, y, informative(rs, "sums"), "prompt")
        g = grpo[0]["args"].get("group_size") if grpo else None
        if grpo:
            x, xerr = pooled_over_seeds(grpo, key)
            y, yerr = accuracy(grpo)
            if finite(x):
                reach(x, xerr)
                if finite(xerr):
                    ax.axvspan(x - xerr, x + xerr, color=colour("grpo-group"), alpha=0.12, lw=0)
                label = f"GRPO, group of G={g or '?'}, measured (leave-one-out), token-weighted states"
                hollow |= point(ax, x, y, xerr, yerr, fmt="*", ms=12, color=colour("grpo-group"),
                                label=label)  # fmt: skip
                few_states_note(ax, x, y, informative(grpo, "sums"), "prompt")
            if key == "nmse":  # the prompt states alone: where its expected value is 1/(G-1)
                xp, xperr = pooled_over_seeds(grpo, "nmse_prompt")
                if finite(xp):
                    reach(xp, xperr)
                    hollow |= point(ax, xp, y, xperr, yerr, fmt="D", ms=7, color=colour("grpo-group"),
                                    label="GRPO at the prompt states (where 1/(G-1) holds)")  # fmt: skip
                    few_states_note(ax, xp, y, informative(grpo, "prompt_sums"), "prompt state")
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
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 2), fontsize=7, frameon=False)
    axes[0].set_ylabel("final test accuracy (%)")
    caption = (
        f"PPO critics from the {'head-to-head (matched tokens)' if source == 'h2h' else 'critic sweep (matched steps)'}"
        " runs. x: the baseline's noise-corrected MSE at token-weighted states over the reward's own variance"
        " there (0: a perfect baseline; below 0 only by the noise correction), pooled over measurements and seeds,"
        " with its 95% interval over seeds (over measurements for one seed); y: mean test accuracy over seeds with"
        " its 95% interval. GRPO's star is its measured value at the same states; its diamond is its value"
        " at the prompt states alone, where its leave-one-out mean of G reads 1/(G-1) (the dotted line) whatever"
        " the success rate. Inside a completion its one constant cannot follow V(s_t) and reads more, (1/(G-1) + d)"
        " / (1 - d) with d the share of the outcome's variance already resolved: left of the star a critic"
        " tracks the value better than the group does (less wrong, not less noisy). Less noisy is read at the prompt"
        ' states: the table\'s "nmse at prompt" of a critic against GRPO\'s (and its "less GRPO\'s" interval).'
        f" A point resting on fewer than {FEW_STATES} informative prompts says how many beside it."
    )
    if hollow:
        caption += (
            " A hollow marker has no interval on at least one axis (one unit, or units that agree exactly): that bar"
            " is left out, never drawn at zero width, and the point's place is not known to be exact."
        )
    title = "Is the critic worth having? Accuracy against the baseline's scaled error"
    fig.suptitle(titled(title, note), fontsize=11)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return caption


STYLES = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))), ("P", (0, (1, 1))), ("X", "-")]


def plot_curves(plt: Any, runs: list[dict[str, Any]], path: Path, note: str = "") -> None:
    """Validation accuracy (top) and training reward (bottom) per experiment, mean over seeds with a band. Each run
    has its own marker and line style, and a curve drawn exactly over an earlier one says so in the legend ("same
    as ..."): the smoke sweep's critics all read 50% and would show as one."""
    experiments = [e for e in EXPERIMENTS if any(r["experiment"] == e for r in runs)]
    experiments += sorted({r["experiment"] for r in runs} - set(experiments))
    fig, axes = plt.subplots(2, len(experiments), figsize=(5 * len(experiments), 7), squeeze=False)
    for j, exp in enumerate(experiments):
        by_run: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["experiment"] == exp:
                by_run.setdefault(r["run"], []).append(r)
        use_tokens = exp in ("h2h", "crossover")  # matched compute: against generated tokens
        for i, (kind, label) in enumerate((("val", "validation accuracy (%)"), ("reward", "training reward"))):
            ax = axes[i][j]
            drawn: dict[tuple, list[str]] = {}  # a curve's points -> the runs drawn with them
            for n_run, (run, rs) in enumerate(sorted(by_run.items(), key=lambda kv: sort_key(exp, kv[0]))):
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
                    m, lo, hi = intervals.mean_interval(vals)
                    xs.append(mean(toks) if use_tokens else s)
                    ms.append(m)
                    los.append(lo)
                    his.append(hi)
                scale = 100 if kind == "val" else 1
                if use_tokens and len(set(xs)) == 1 and len(xs) > 1:  # offline DPO: every token spent before step 1
                    xs, ms, los, his = xs[-1:], ms[-1:], los[-1:], his[-1:]
                    run = run + " (final)"
                key = (tuple(xs), tuple(ms))
                under = drawn.setdefault(key, [])  # the runs already drawn with these very points
                same = f" (same as {under[0]})" if under else ""
                marker, style = STYLES[n_run % len(STYLES)]
                ax.plot(xs, [scale * m for m in ms], marker=marker, ms=3 + 2 * min(len(under), 4), ls=style,
                        mfc="none" if under else None, color=colour(run.split(" ")[0]), label=run + same)  # fmt: skip
                under.append(run)  # each one drawn over another: a larger ring
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
                ax.set_title({"critic": "critic sweep", "h2h": "head-to-head (matched tokens)",
                              "crossover": "crossover: G and pretrained critics (matched tokens)"}.get(exp, exp))  # fmt: skip
                if ax.get_legend_handles_labels()[0]:  # no curve drawn (no metric logged): no legend
                    ax.legend(fontsize=7, loc="best")
    if note:
        fig.suptitle(f"{note}: {NOT_A_RESULT}", fontsize=11)
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


def plot_errors(plt: Any, runs: list[dict[str, Any]], path: Path, note: str = "") -> None:
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
        titled("Raw against centred error per baseline\n(small: each measurement; large: the run, pooled)", note) + cut,
        fontsize=9,
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
    its group mean beside it) over every measured state and (name_prompt) at the prompt states alone, generated
    training tokens. A curve nothing logged is empty; the last row of a step wins (a resumed run logs its final
    evaluation again)."""
    keys = {"reward": "reward", "kl": "kl_ref", "tokens": "generated_tokens", "tokens_per_s": "tokens_per_s"}
    keys.update({f"nmse {name}": f"mc/{name}/nmse" for name in ("value", "loo", "group", "value_prompt", "loo_prompt")})
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


def run_results(run_dir: Path) -> dict[str, Any] | None:
    """results.json of a finished run, else None."""
    try:
        return rundir.read_results(run_dir / "results.json")
    except (errors.UserError, KeyError, TypeError, ValueError):
        return None


def run_title(run_dir: Path) -> str:
    """'ppo-small-s1: ppo small, seed 1; test accuracy 1.6% [0.3, 8.3] on 64' from results.json, or the folder's
    name and 'running' when the run has not finished."""
    try:
        res = rundir.read_results(run_dir / "results.json")
        test = res["test"]
        lo, hi = test["ci95"]
        return (
            f"{run_dir.name}: {res['method']} {run_variant(res)}, seed {res['seed']}, {res['steps']} steps; test "
            f"accuracy {fmt_pct(test['accuracy'])}% [{100 * lo:.1f}, {100 * hi:.1f}] on {test['n']}"
        )
    except (errors.UserError, KeyError, TypeError, ValueError):
        return f"{run_dir.name}: not finished (no results.json)"


def empty_panel_note(rows: list[dict], keys: Sequence[str]) -> str:
    """What a panel with no curve says: its keys never logged, or logged but never a number (a baseline's nmse
    over states whose Monte Carlo scores were all equal is undefined: a model that solves nothing)."""
    if not any(key in r for r in rows for key in keys):
        return "not logged by this run"
    if any(key.endswith("/nmse") for key in keys):
        return "measured, undefined at every step:\nno state's Monte Carlo scores differed\n(nothing for a baseline to predict)"
    return "logged, never a finite number"


# the baselines a run measures (measure.monte_carlo's names), as its legend says them
BASELINE_NAMES = {
    "value": "PPO's baseline V(s_t)",
    "loo": "GRPO's leave-one-out group mean",
    "group": "GRPO's group mean with its own reward",
}
POINTS = "a point: one measurement (its metrics row logs sums over its prompts, not their spread: no interval)"


def run_method(res: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str:
    """The run's method: results.json's, or (a run still going) what its measurements say (GRPO logs mc/loo)."""
    if res and res.get("method"):
        return str(res["method"])
    return "grpo" if any("mc/loo/nmse" in r for r in rows) else "ppo"


def reference_group(run_dir: Path, res: dict[str, Any] | None, method: str) -> tuple[int, str]:
    """G for GRPO's 1/(G-1) line and whose it is: a GRPO run's own (results.json's args, or a running run's
    checkpoint/args.json), else the study's GRPO (STUDY_GROUP)."""
    args = (res or {}).get("args")
    if args is None and (run_dir / "checkpoint" / "args.json").is_file():
        with contextlib.suppress(errors.UserError, ValueError, OSError):
            args = rundir.read_results(run_dir / "checkpoint" / "args.json")
    g = (args or {}).get("group_size")
    if method == "grpo" and isinstance(g, int) and g > 1:
        return g, "this run's"
    return STUDY_GROUP, "the study's GRPO" + ("" if method == "grpo" else "; this run has no group")


def nmse_panel(ax: Any, run_dir: Path, rows: list[dict[str, Any]], series: dict[str, Any]) -> bool:
    """The baseline's nmse at each measurement (no interval of its own: a metrics row logs its measurement's sums,
    not their spread over prompts), every measured state and, for the run's own baseline, the prompt states apart;
    each pooled over the measurements after the first (the report's rule: the untrained critic left out) with its
    95% interval over measurements (read_runs.nmse_interval, the report's one-seed interval) as a band; and GRPO's
    1/(G-1), its leave-one-out mean's nmse at the prompt state, dashed. The legend goes under the panel. Returns
    whether anything was drawn."""
    res = run_results(run_dir)
    method = run_method(res, rows)
    own = MC_BASELINE.get(method, "value")
    name = dict(BASELINE_NAMES)
    if method == "ppo" and res and run_variant(res) == "none":
        name["value"] = "PPO's batch-mean baseline (no critic)"
    drawn, low = False, 0.0
    for base, colour_ in (("value", "C0"), ("loo", "C0"), ("group", "C1")):
        for part, where, style in (("", "every measured state", "-"), ("_prompt", "the prompt states", ":")):
            c = series.get(f"nmse {base}{part}", {"step": []})
            if not c["step"]:
                continue
            ax.plot(c["step"], c["y"], marker="o" if not part else "D", ms=3, ls=style, color=colour_,
                    mfc=None if not part else "none", label=f"{name[base]}, {where}")  # fmt: skip
            drawn, low = True, min(low, *c["y"])
            if base != own:
                continue
            try:
                mc = mc_summary(rows, method)
                x, lo, hi, _ = nmse_interval([{"mc": mc}], "nmse" + part)
            except KeyError:  # a run measured before the sums were logged: its points alone
                continue
            if not finite(x):
                continue
            pooled = f"  pooled over measurements 2-{mc['measurements'] + 1:.0f}: {x:.2f}"
            if finite(lo):
                ax.axhspan(lo, hi, color=colour_, alpha=0.12 if not part else 0.25, lw=0,
                           label=f"{pooled} [{lo:.2f}, {hi:.2f}], 95% interval over them")  # fmt: skip
                ax.axhline(x, color=colour_, ls=style, lw=0.8)
                low = min(low, lo)
            else:
                ax.axhline(x, color=colour_, ls=style, lw=0.8, label=f"{pooled}, no interval (one measurement)")
    if drawn:
        g, whose = reference_group(run_dir, res, method)
        ax.axhline(1 / (g - 1), color=colour("grpo-group"), ls="--", lw=1,
                   label=f"1/(G-1) = {1 / (g - 1):.3f}, G = {g} ({whose}): GRPO's leave-one-out mean at the prompt")  # fmt: skip
        ax.set_ylim(bottom=low - 0.05 * (ax.get_ylim()[1] - low))  # 0, a perfect baseline, in view
        legend = ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(-0.05, -0.14), frameon=False,
                           title=POINTS, title_fontsize=7, alignment="left")  # fmt: skip
        legend.set_in_layout(False)  # below the panel, in the room run_figure leaves: the panels keep their width
    return drawn


def run_figure(plt: Any, run_dir: Path) -> Any:
    """run_dir's curves against the step (run_series) in one figure, each panel's y axis labelled with its unit."""
    rows = read_metrics(run_dir)
    series = run_series(rows)
    fig, axes = plt.subplots(2, 3, figsize=(15, 9))
    panels = [  # title, y label, curves (name in run_series, label)
        ("training reward", "mean reward (1 correct, 0 not)", [("reward", "reward")]),
        ("validation accuracy, 95% interval", "greedy accuracy (%)", []),
        ("KL to the reference (kl_ref)", "KL (nats per token)", [("kl", "kl_ref")]),
        ("baseline error (nmse; 0 = perfect)", "nmse (MSE / Var(R | s), no unit)", None),
        ("generated training tokens (cumulative)", "tokens", [("tokens", "generated_tokens")]),
        ("rollout throughput", "generated tokens/s", [("tokens_per_s", "tokens_per_s")]),
    ]
    for ax, (title, ylabel, curves) in zip(axes.flat, panels):
        drawn = False
        if curves is None:
            drawn = nmse_panel(ax, run_dir, rows, series)
            keys = [f"mc/{b}/nmse" for b in BASELINE_NAMES]
        else:
            keys = [key for _, key in curves]
        for name, _ in curves or []:
            c = series[name]
            if c["step"]:
                ax.plot(c["step"], c["y"], marker="o", ms=3)
                drawn = True
        if title.startswith("validation"):
            c = series["val"]
            if c["step"]:
                ys = [100 * y for y in c["y"]]
                err = [[y - 100 * lo for y, lo in zip(ys, c["lo"])], [100 * hi - y for y, hi in zip(ys, c["hi"])]]
                ax.errorbar(c["step"], ys, yerr=err, marker="o", ms=3, capsize=3)
                drawn = True
        if not drawn:
            note = empty_panel_note(rows, keys)
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="grey", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    fig.suptitle(run_title(run_dir), fontsize=11)
    fig.tight_layout(rect=(0, 0.1 if axes[1][0].get_legend() else 0, 1, 1))
    return fig


def plot_run(plt: Any, run_dir: Path) -> Path:
    """run_dir's curves (run_figure) in one PNG beside its metrics.jsonl; returns its path."""
    fig = run_figure(plt, run_dir)
    path = run_dir / RUN_PLOT
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
