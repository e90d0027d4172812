"""Where the crossover lies: the critics pretrained on the frozen policy against GRPO's group of G.

Reads a sweep's crossover parts: OUT/crossover/curve/curve.json (study/pretrain_critic.py --measure: each capacity's
nmse after n pretraining rollouts, on held-out prompts against Monte Carlo, with its 95% interval) and the crossover
experiment's runs (GRPO at each G, PPO with each pretrained critic, amortised or paid; read by read_runs.py, pooled by
report.summarize). Holds: reading and checking curve.json, the section of report.md "Where the crossover lies" (the
learning curve beside GRPO's 1/(G-1) for each G; each capacity's critic-equivalent group G* = 1 + 1/nmse with its
interval and the half-width reached; the rollouts at which each critic crosses each G; accuracy at matched compute
against G and capacity; the ceiling; the fit's settings, where OUT/crossover/fit-* holds other fits on the curve's
pool), and its figure, nmse against pretraining rollouts (crossover-curve.png). A
folder without the crossover's parts gets no section, so an older sweep's report reads as it did.
Also a command for a curve alone, before any run: `python -m study.crossover runs/crossover-curve` prints its tables
and writes its figure beside curve.json.
Does not hold: the measurement (pretrain_critic.py, measure.py), the intervals' arithmetic (intervals.py), reading and
pooling the runs (read_runs.py, report.py), the report's other tables and figures (report.py, plots.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import tyro

import intervals
from plumbing import cmdline, errors, runtime
from study.read_runs import (
    STUDY_GROUP,
    finite,
    fmt_interval,
    fmt_num,
    fmt_pct,
    fmt_signed_interval,
    fmt_tokens,
    mean,
    sort_key,
)

EXPERIMENT = "crossover"
CURVE = Path(EXPERIMENT) / "curve" / "curve.json"  # in a sweep's folder: the plan's step writes it
FITS = "fit-*/curve.json"  # in OUT/crossover: other fit settings on the curve's pool (pretrain_critic --pool-from)
FIGURE = "crossover-curve.png"
GROUPS = (2, 4, 8, 16)  # GRPO's group sizes the plan runs and the curve is read against
CONTROL = "ppo-none"  # PPO without a critic (the batch's mean reward): what a pretrained critic adds is read against it
CAPACITIES = ("constant", "small", "medium", "large", "full", "linear")  # the curve's rows in this order
PARTS = {"prompt": "at the prompt", "inside": "inside completions", "all": "over all states"}


# ======================================================================================================
# The curve: curve.json read and checked, its rows in order
# ======================================================================================================


def check_groups(groups: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """GRPO's group sizes, each a whole number of at least 2 (a group below 2 has no leave-one-out mean), sorted."""
    if not groups:
        raise errors.UserError("no group size to compare with: give G = 2 or more")
    for g in groups:
        if isinstance(g, bool) or not isinstance(g, int) or g < 2:
            raise errors.UserError(
                f"group size {g}: G must be a whole number of at least 2 (GRPO's leave-one-out mean)"
            )
    return tuple(sorted(set(groups)))


def read_curve(path: Path) -> dict[str, Any]:
    """curve.json as pretrain_critic.py writes it, checked: its rows, each a capacity, a positive number of rollouts
    and the nmse at the prompt (value, interval) at least. A damaged file is a UserError naming it."""
    try:
        curve = json.loads(path.read_text())
        rows = curve["rows"]
        assert isinstance(rows, list) and rows, "no rows"
        for r in rows:
            assert isinstance(r["capacity"], str), "a capacity that is not a name"
            n = r["rollouts"]  # the linear read-out's: None (it is fitted on the held-out targets, cross-validated)
            ok = isinstance(n, int) and not isinstance(n, bool) and n > 0 or (n is None and r["capacity"] == "linear")
            assert ok, f"rollouts {n!r}"
            for part in PARTS:
                if part in r:
                    for key in ("nmse", "nmse_lo", "nmse_hi"):
                        x = r[part][key]
                        assert x is None or isinstance(x, int | float), f"{part} {key} {x!r}"
            r["prompt"]["nmse"]  # noqa: B018 -- the prompt's nmse is the curve's first number
    except OSError as e:
        raise errors.UserError(f"{path} cannot be read ({e.strerror})") from None
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise errors.UserError(f"{path} is damaged: {type(e).__name__} {e}") from None
    curve["rows"] = sorted(rows, key=lambda r: (capacity_order(r["capacity"]), r["rollouts"] or 0))
    return curve


def capacity_order(capacity: str) -> tuple[int, str]:
    return (CAPACITIES.index(capacity) if capacity in CAPACITIES else len(CAPACITIES), capacity)


def number(x: Any) -> float:
    """A curve's number: null (a statistic of nothing) is nan; infinity stays (G*'s open end)."""
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else math.nan


def part_of(row: dict[str, Any], part: str) -> tuple[float, float, float]:
    """(nmse, lo, hi) of a curve row at one part of the states; nan where it was not measured."""
    p = row.get(part) or {}
    return number(p.get("nmse")), number(p.get("nmse_lo")), number(p.get("nmse_hi"))


def paired_of(row: dict[str, Any], part: str, key: str) -> tuple[float, float, float]:
    """(d, lo, hi) of a row's paired difference at one part ("vs_constant", "vs_linear": pretrain_critic's
    paired_differences); nan where the curve has none (a curve made before they were written, or the reference
    itself)."""
    x = (row.get(part) or {}).get(key)
    if not (isinstance(x, list) and len(x) == 3):
        return math.nan, math.nan, math.nan
    return number(x[0]), number(x[1]), number(x[2])


def critics_of(curve: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The fitted critics' rows by capacity, each by rollouts ascending (the constant baseline and a linear read-out,
    which are no critic ppo.py trains, apart)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in curve["rows"]:
        if r["capacity"] not in ("constant", "linear"):
            out.setdefault(r["capacity"], []).append(r)
    return out


# ======================================================================================================
# The numbers: G*, the bracket of G it falls in, the crossings
# ======================================================================================================


def g_star(nmse: float, lo: float, hi: float) -> tuple[float, float, float]:
    """G* = 1 + 1/nmse with its interval (intervals.critic_equivalent_group); nan where nmse is."""
    if not finite(nmse):
        return math.nan, math.nan, math.nan
    return intervals.critic_equivalent_group(nmse, lo if finite(lo) else math.nan, hi if finite(hi) else math.nan)


def bracket(gs: tuple[float, float, float], groups: tuple[int, ...]) -> str:
    """Where G* and its interval fall among GRPO's G: 'between G = 4 and G = 8' when the whole interval lies between
    two neighbours (it tells them apart), else the G's it reaches."""
    g, lo, hi = gs
    if not finite(g) and not (isinstance(g, float) and g == math.inf):
        return "not measured"
    below = [G for G in groups if G < g]
    where = (
        f"below G = {groups[0]}" if not below else
        f"above G = {groups[-1]}" if len(below) == len(groups) else
        f"between G = {below[-1]} and G = {groups[len(below)]}"
    )  # fmt: skip
    if not (finite(lo) and (finite(hi) or hi == math.inf)):
        return f"{where} (no interval)"
    reached = [G for G in groups if lo <= G <= hi]
    if not reached:
        return f"{where}, its whole interval too"
    return f"{where}; its interval reaches G = {', '.join(map(str, reached))}"


def grpo_line(group: int) -> float:
    """GRPO's leave-one-out mean at the prompt: 1/(G-1) (intervals.group_nmse)."""
    return intervals.group_nmse(group)


def crossing(rows: list[dict[str, Any]], part: str, line: float) -> tuple[int | None, int | None]:
    """A critic's rows (rollouts ascending) against a GRPO line: the first n whose nmse lies below it, and the first
    whose whole 95% interval does (None: never)."""
    first = sure = None
    for r in rows:
        x, _, hi = part_of(r, part)
        if first is None and finite(x) and finite(line) and x < line:
            first = r["rollouts"]
        if sure is None and finite(hi) and finite(line) and hi < line:
            sure = r["rollouts"]
    return first, sure


def crossings(
    curve: dict[str, Any], groups: tuple[int, ...], part: str = "prompt", lines: dict[int, float] | None = None
) -> dict[tuple[str, int], tuple[int | None, int | None]]:
    """(capacity, G) -> crossing(): at the prompt against 1/(G-1), or against the lines given (GRPO's measured nmse
    over states, one per G; a G without one is left out)."""
    groups = check_groups(groups)
    lines = {G: grpo_line(G) for G in groups} if lines is None else lines
    return {
        (cap, G): crossing(rows, part, lines[G])
        for cap, rows in critics_of(curve).items()
        for G in groups
        if G in lines
    }


def fmt_rollouts(n: int | None) -> str:
    return "never" if n is None else f"{n:,}"


# ======================================================================================================
# The section of report.md
# ======================================================================================================


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def curve_table(curve: dict[str, Any], groups: tuple[int, ...]) -> list[str]:
    """(i): one row per capacity and number of rollouts: nmse at the prompt, inside and over all states with their
    95% intervals, G* at the prompt, the G whose line it is under, value_explained_variance."""
    rows = []
    for r in curve["rows"]:
        nmse = part_of(r, "prompt")
        gs = g_star(*nmse)
        under = [str(G) for G in groups if finite(nmse[0]) and nmse[0] < grpo_line(G)]
        n = (
            f"{r['rollouts']:,}"
            if r["rollouts"]
            else f"none (fitted on the held-out targets, {r.get('folds', '?')} folds)"
        )
        rows.append([
            r["capacity"], n, fmt_tokens(number(r.get("tokens"))), fmt_interval(*nmse),
            fmt_interval(*gs, digits=1), ", ".join(under) or "none",
            fmt_interval(*paired_of(r, "prompt", "vs_constant"), signed=True),
            fmt_interval(*part_of(r, "inside")), fmt_interval(*part_of(r, "all")),
            fmt_num(number(r.get("value_explained_variance"))),
        ])  # fmt: skip
    head = ["critic", "rollouts", "tokens", "nmse at prompt [95%]", "G* [95%]", "below GRPO's G",
            "vs constant at prompt [95%, paired]", "nmse inside [95%]", "nmse all states [95%]",
            "value expl. var."]  # fmt: skip
    lines = " ".join(f"G = {G}: {grpo_line(G):.3f};" for G in groups).rstrip(";")
    return [
        *table(head, rows),
        "",
        f"GRPO's leave-one-out mean at the prompt, 1/(G-1): {lines}. \"vs constant\": the critic's nmse less the "
        "constant baseline's of the same rollouts, on the same held-out prompts and Monte Carlo means, its interval "
        "paired over the prompts (their shared noise cancels, so it is narrower than the two rows' own intervals "
        "suggest); below zero, the critic has learned something a mean reward does not say.",
    ]


def g_star_lines(curve: dict[str, Any], groups: tuple[int, ...]) -> list[str]:
    """(ii): each capacity at its largest number of rollouts: G* with its interval, where it falls among the G's,
    and the half-width of its nmse's interval at the prompt."""
    out = []
    gap = ", ".join(
        f"G = {a} and {b}: {grpo_line(a) - grpo_line(b):.3f}" for a, b in zip(groups, groups[1:])
    )  # the distance a half-width must be under to tell two neighbours apart
    for cap, rows in critics_of(curve).items():
        r = rows[-1]
        x, lo, hi = part_of(r, "prompt")
        gs = g_star(x, lo, hi)
        half = (hi - lo) / 2 if finite(lo) and finite(hi) else math.nan
        out.append(
            f"- {cap}, {r['rollouts']:,} rollouts: G* = {fmt_interval(*gs, digits=1)} at the prompt (nmse "
            f"{fmt_interval(x, lo, hi)}, half-width reached {fmt_num(half)}): {bracket(gs, groups)}."
        )
    if out:
        out.append(f"- The gaps between GRPO's neighbouring lines at the prompt: {gap}.")
    return out


def crossing_table(
    curve: dict[str, Any], groups: tuple[int, ...], part: str, lines: dict[int, float] | None = None
) -> list[str]:
    """(iii): per capacity and G, the first n below GRPO's line, and in brackets the first whose interval is."""
    found = crossings(curve, groups, part, lines)
    shown = [G for G in groups if any(key[1] == G for key in found)]
    rows = []
    for cap in critics_of(curve):
        cells = []
        for G in shown:
            first, sure = found[(cap, G)]
            cells.append(fmt_rollouts(first) + (f" [{fmt_rollouts(sure)}]" if first is not None else ""))
        rows.append([cap, *cells])
    if not shown:
        return []
    return table(["critic", *(f"G = {G}" for G in shown)], rows)


def measured_grpo(summary: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """G -> the crossover's GRPO row of report.summarize (the study's G is grpo-group, the others grpo-group-gG)."""
    group_of = {r["run"]: r["args"].get("group_size") for r in runs if r["experiment"] == EXPERIMENT}
    return {
        group_of[row["run"]]: row
        for row in summary
        if row["experiment"] == EXPERIMENT and row["method"] == "grpo" and isinstance(group_of.get(row["run"]), int)
        and not row["run"].endswith("-unscaled")
    }  # fmt: skip


def pretraining_tokens(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """run -> each seed's critic pretraining tokens (results.json's critic_init), for the runs whose critic was
    pretrained."""
    pre: dict[str, list[float]] = {}
    for r in runs:
        init = r.get("critic_init") or {}
        if finite(init.get("tokens")):
            pre.setdefault(r["run"], []).append(float(init["tokens"]))
    return pre


def price_of(run: str, pre: dict[str, list[float]]) -> str:
    """A pretrained critic's price, as the plan names its run (amortised, or -paid: spent from the budget); '-' for a
    run without one."""
    return ("paid" if run.endswith("-paid") else "amortised") if run in pre else "-"


def fmt_accuracy(s: dict[str, Any]) -> str:
    """A summary row's test accuracy over seeds in % with its 95% interval: '55.0 [54.0, 56.0]' ('[n/a]': none)."""
    low, high = s["interval_low"], s["interval_high"]
    return f"{fmt_pct(s['test_accuracy'])} " + (f"[{fmt_pct(low)}, {fmt_pct(high)}]" if finite(low) else "[n/a]")


def accuracy_table(
    summary: list[dict[str, Any]], runs: list[dict[str, Any]], control: dict[tuple[str, str], tuple] | None = None
) -> list[str]:
    """(iv): the crossover's runs at matched compute: GRPO per G, PPO per capacity and price; test accuracy over
    seeds, the paired difference from GRPO at the study's G (grpo-group) and, for a pretrained critic, from PPO
    without one (control: (experiment, run) -> report.paired_vs_grpo's tuple against CONTROL), the baseline's nmse
    measured in training, the training tokens and the pretraining's."""
    control = control or {}
    mine = [r for r in runs if r["experiment"] == EXPERIMENT]
    pre = pretraining_tokens(mine)
    group_of = {r["run"]: r["args"].get("group_size") for r in mine if r["method"] == "grpo"}

    def order(s: dict[str, Any]) -> tuple:  # GRPO by G, then the critics by capacity, amortised before paid
        return (0, group_of.get(s["run"]) or 0, ()) if s["method"] == "grpo" else (1, 0, sort_key(EXPERIMENT, s["run"]))

    rows = []
    for s in sorted((s for s in summary if s["experiment"] == EXPERIMENT), key=order):
        group = group_of.get(s["run"])
        what = f"G = {group}" if s["method"] == "grpo" else s["variant"].split("-")[0]
        price, acc = price_of(s["run"], pre), fmt_accuracy(s)
        vs_none = control.get((EXPERIMENT, s["run"])) if s["run"] in pre else None
        rows.append([
            s["run"], what, price, str(s["seeds"]), acc, fmt_signed_interval(s["vs_grpo"], s["vs_grpo_low"],
            s["vs_grpo_high"]), fmt_signed_interval(*vs_none[:3]) if vs_none else "-", fmt_interval(s["nmse_prompt"], s["nmse_prompt_low"], s["nmse_prompt_high"]),
            fmt_interval(s["nmse"], s["nmse_low"], s["nmse_high"]), fmt_tokens(s["generated_tokens"]),
            fmt_tokens(mean(pre[s["run"]])) if s["run"] in pre else "-",
        ])  # fmt: skip
    head = ["run", "G / critic", "price", "seeds", "test acc. % [95%]", f"vs GRPO G = {STUDY_GROUP}, points [95%]",
            f"vs PPO without a critic ({CONTROL}), points [95%]", "nmse at prompt [95%]", "nmse [95%]",
            "training tokens", "pretraining tokens"]  # fmt: skip
    return table(head, rows) if rows else []


def ceiling_lines(curve: dict[str, Any]) -> list[str]:
    """(v): the best linear read-out of the frozen policy's hidden state (pretrain_critic.py's "linear" row: a ridge
    fitted to the Monte Carlo targets, cross-fitted over the held-out prompts), or a line saying it is not
    measured."""
    rows = [r for r in curve["rows"] if r["capacity"] == "linear"]
    if not rows:
        return [
            "TODO: not measured. This curve.json has no linear read-out of the frozen policy's hidden state (a ridge "
            "fitted to the Monte Carlo targets, cross-fitted over the held-out prompts, at the prompt and inside "
            "completions), so how far each critic stands from what its features allow is not known here; "
            'study/pretrain_critic.py --measure writes it as the "linear" row.'
        ]
    r = rows[-1]
    parts = "; ".join(f"{PARTS[p]} {fmt_interval(*part_of(r, p))}" for p in PARTS if p in r)
    x, lo, hi = part_of(r, "prompt")
    return [
        f"The best linear read-out of the frozen policy's last hidden state (a ridge on the Monte Carlo targets, "
        f"cross-fitted over the held-out prompts in {r.get('folds', '?')} folds, so that no prompt's values come from a "
        "fit on its own targets, the penalty chosen inside each fit by generalised cross-validation): "
        f"nmse {parts}; G* at the prompt {fmt_interval(*g_star(x, lo, hi), digits=1)}. The heads read the same "
        "features: a head above this line has not learned what a linear read-out of them gives (an MLP goes below "
        "it only by what is not linear in them); the full critic computes features of its own."
    ]


def fit_settings_table(out: Path, curve: dict[str, Any]) -> list[str]:
    """(vi) the fit's settings: each critic under the --lr and --epochs of every OUT/crossover/fit-*/curve.json (made
    with pretrain_critic.py --pool-from the curve: the same pool and held-out targets, so the rows differ by the fit
    alone) beside the curve's own fit of the same capacity and rollouts; [] where no such folder is there."""
    fits = []
    for path in sorted((out / EXPERIMENT).glob(FITS)):
        try:
            fits.append((path.parent.name, read_curve(path)))
        except errors.UserError as e:
            return [f"The fit's settings: {e}."]
    if not fits:
        return []
    refit = {(r["capacity"], r["rollouts"]) for _, c in fits for rows in critics_of(c).values() for r in rows}
    found = [
        (r, where)
        for where, c in [("the curve", curve), *fits]
        for rows in critics_of(c).values()
        for r in rows
        if (r["capacity"], r["rollouts"]) in refit
    ]
    found.sort(key=lambda x: (capacity_order(x[0]["capacity"]), x[0]["rollouts"], number(x[0].get("lr")),
                              number(x[0].get("epochs"))))  # fmt: skip
    rows = [
        [r["capacity"], f"{r['rollouts']:,}", f"{number(r.get('lr')):g}", str(r.get("epochs", "?")), where,
         fmt_num(number(r.get("final_loss")), 4), fmt_interval(*part_of(r, "prompt")),
         fmt_interval(*paired_of(r, "prompt", "vs_constant"), signed=True),
         fmt_interval(*paired_of(r, "prompt", "vs_linear"), signed=True),
         fmt_interval(*part_of(r, "all")), fmt_interval(*paired_of(r, "all", "vs_constant"), signed=True),
         fmt_num(number(r.get("value_explained_variance")))]
        for r, where in found
    ]  # fmt: skip
    head = ["critic", "rollouts", "lr", "epochs", "folder", "final fit loss", "nmse at prompt [95%]",
            "vs constant [paired]", "vs linear read-out [paired]", "nmse all states [95%]",
            "all states vs constant [paired]", "value expl. var."]  # fmt: skip
    return [
        "### The fit's settings",
        "",
        "Each critic fitted again under other settings on the same rollouts, measured on the same held-out targets "
        f"(OUT/{EXPERIMENT}/fit-*: pretrain_critic.py --pool-from the curve), so the rows of one critic differ by the "
        "fit alone; their intervals share the held-out prompts' noise, so a difference between two rows is smaller "
        "than their intervals suggest: the \"paired\" columns give each critic's nmse less the constant baseline's "
        "(of the same rollouts) and less the linear read-out's with the interval paired over the held-out prompts, "
        "where that noise cancels. The settings were judged on these held-out targets, the ones the curve "
        "reports: a choice among them is a selection on the measurement.",
        "",
        *table(head, rows),
    ]


def has_parts(out: Path, runs: list[dict[str, Any]]) -> bool:
    """Whether the sweep's folder holds the crossover's parts (its curve or its runs): else no section."""
    return (out / EXPERIMENT / "curve").is_dir() or any(r["experiment"] == EXPERIMENT for r in runs)


def section(
    out: Path,
    summary: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    plt: Any,
    report_dir: Path,
    note: str = "",
    control: dict[tuple[str, str], tuple] | None = None,
) -> list[str]:
    """report.md's "Where the crossover lies", and its figure into report_dir (plt None: none); [] where the folder
    has no crossover parts."""
    if not has_parts(out, runs):
        return []
    lines = ["", "## Where the crossover lies", ""]
    grpo = measured_grpo(summary, runs)
    groups = tuple(sorted(set(GROUPS) | set(grpo)))
    path = out / CURVE
    curve = None
    try:
        curve = read_curve(path)
    except errors.UserError as e:
        lines.append(f"No learning curve: {e if path.exists() else f'{path} is missing (the plan runs it first)'}.")
    if curve is not None:
        lines += curve_lines(curve, groups, grpo)
        if fits := fit_settings_table(out, curve):
            lines += ["", *fits]
        if plt is not None:
            plot_curve(plt, curve, report_dir / FIGURE, groups, grpo, note)
            lines += ["", f"![{FIGURE}]({FIGURE})", "", figure_caption(grpo)]
    budgets = sorted({(r["seed"], r["generated_tokens"], r["steps"]) for r in runs
                      if r["experiment"] == EXPERIMENT and r["run"] == "grpo-group"})  # fmt: skip
    acc = accuracy_table(summary, runs, control)
    lines += ["", "### Accuracy at matched compute", ""]
    if acc:
        budget = "; ".join(f"seed {s}: {t:,} generated tokens in {n} steps" for s, t, n in budgets)
        lines += [
            "Each PPO run's budget is the generated training tokens of the same seed's GRPO run at G = 8 "
            f"({budget or 'not run yet'}); GRPO at every G generates the same completions a step (batch x G). "
            "Amortised: the critic's pretraining is free (one critic serves many runs); paid: its tokens come out "
            "of the budget (ppo.py --count-critic-init-tokens), so training has fewer. vs GRPO: the paired "
            "difference in test accuracy from GRPO at G = 8 on the same test problems, the t interval over the "
            "per-seed differences (as the Results table); vs PPO without a critic: the same from the control, "
            f"{CONTROL} (PPO whose baseline is the batch's mean reward): what the pretrained critic adds to PPO. nmse: "
            "the run's own baseline measured in training.",
            "",
            *acc,
        ]
    else:
        lines.append("No crossover run has finished yet.")
    return lines


def curve_lines(curve: dict[str, Any], groups: tuple[int, ...], grpo: dict[int, dict[str, Any]]) -> list[str]:
    """The curve's parts of the section: (i) the table, (ii) G*, (iii) the crossings, (v) the ceiling."""
    h = curve.get("heldout") or {}
    about = (
        f"{h.get('prompts', '?')} held-out prompts (pass rate {fmt_num(number(h.get('pass_rate')))}, E[p(1-p)] "
        f"{fmt_num(number(h.get('mean_p_1_minus_p')))}), {h.get('states', '?')} states, K = "
        f"{h.get('mc_samples', '?')} Monte Carlo samples each"
    )
    lines = [
        f"Critics pretrained on the frozen starting policy's rollouts (study/pretrain_critic.py, {CURVE}), each "
        f"measured on {about}, against GRPO's group of G. nmse is 0 for a perfect baseline; GRPO's leave-one-out "
        "mean reads 1/(G-1) at the prompt whatever the success rate, so a critic at nmse e is worth G* = 1 + 1/e "
        "samples there (intervals.critic_equivalent_group: its interval is nmse's mapped). The constant row is the "
        "pretraining rollouts' mean reward, a baseline that knows nothing of the prompt.",
        "",
        "### The critics' learning curve",
        "",
        *curve_table(curve, groups),
        "",
        "### What each critic is worth at the prompt: G*",
        "",
        *g_star_lines(curve, groups),
        "",
        "### The rollouts at which each critic crosses each G",
        "",
        "At the prompt, against 1/(G-1): the first number of pretraining rollouts whose nmse lies below GRPO's, in "
        "brackets the first whose whole 95% interval does (never: at no n measured).",
        "",
        *crossing_table(curve, groups, "prompt"),
    ]
    states = {G: row["nmse"] for G, row in grpo.items() if finite(row["nmse"])}
    if states:
        lines += [
            "",
            "Over all states, against GRPO's nmse over states as its runs measured it in training (the prompt's "
            "group mean at every state of the completion; measured on the training policy's train prompts, the "
            "curve on the frozen policy's held-out ones):",
            "",
            *crossing_table(curve, groups, "all", states),
        ]
    return lines + ["", "### The ceiling", "", *ceiling_lines(curve)]


def figure_caption(grpo: dict[int, dict[str, Any]]) -> str:
    over = (
        " Right: over all states, GRPO's dashed lines are its runs' measured nmse over states (training, train "
        "prompts)."
        if grpo
        else " Right: over all states (no GRPO run measured yet)."
    )
    return (
        "nmse against pretraining rollouts (log scale), one line per capacity with its 95% interval as a band. Left: "
        "at the prompt, GRPO's leave-one-out mean of G as dashed lines at 1/(G-1); a critic below a line is worth "
        "more than that group." + over + " Dotted: the constant baseline (the rollouts' mean reward); dash-dot, "
        "where measured: the best linear read-out of the policy's hidden state (the ceiling of a head)."
    )


# ======================================================================================================
# The figure
# ======================================================================================================

COLOURS = {"small": "#9ecae1", "medium": "#4292c6", "large": "#08519c", "full": "#08306b"}
GROUP_COLOURS = {2: "#fcbba1", 4: "#fb6a4a", 8: "#d62728", 16: "#67000d"}


def plot_curve(
    plt: Any, curve: dict[str, Any], path: Path, groups: tuple[int, ...] = GROUPS,
    grpo: dict[int, dict[str, Any]] | None = None, note: str = "",
) -> Path:  # fmt: skip
    """nmse against pretraining rollouts (log x) at the prompt (left) and over all states (right): a line per
    capacity with its interval as a band, GRPO's 1/(G-1) (left) and measured nmse over states (right) dashed, the
    constant baseline dotted, the linear read-out dash-dot. -> path"""
    groups = check_groups(groups)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=False)
    ns = sorted({r["rollouts"] for r in curve["rows"] if r["rollouts"]})
    for ax, part in zip(axes, ("prompt", "all")):
        for cap, rows in critics_of(curve).items():
            xs = [r["rollouts"] for r in rows]
            ys, los, his = zip(*(part_of(r, part) for r in rows))
            c = COLOURS.get(cap, "#555555")
            ax.plot(xs, ys, marker="o", color=c, label=f"critic {cap}")
            if all(finite(v) for v in (*los, *his)):
                ax.fill_between(xs, los, his, color=c, alpha=0.2, lw=0)
        for cap, style in (("constant", ":"), ("linear", "-.")):
            rows = [r for r in curve["rows"] if r["capacity"] == cap]
            ys = [part_of(r, part)[0] for r in rows]
            if rows and any(finite(y) for y in ys):
                label = "constant baseline" if cap == "constant" else "linear read-out (ceiling)"
                if len(rows) == 1 or cap == "linear":
                    ax.axhline(ys[-1], color="black", ls=style, lw=1, label=label)
                else:
                    ax.plot([r["rollouts"] for r in rows], ys, color="black", ls=style, lw=1, label=label)
        for G in groups:
            y = grpo_line(G) if part == "prompt" else (grpo or {}).get(G, {}).get("nmse", math.nan)
            if finite(y):
                what = f"1/(G-1) = {y:.3f}" if part == "prompt" else f"measured {y:.3f}"
                ax.axhline(y, color=GROUP_COLOURS.get(G, "#d62728"), ls="--", lw=1, label=f"GRPO G = {G}: {what}")
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))  # 0, a perfect baseline, in view
        ax.set_xscale("log")
        ax.set_xticks(ns, [f"{n:,}" for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("pretraining rollouts (log scale)")
        ax.set_ylabel(f"nmse {PARTS[part]} (0 = perfect; lower is better)")
        ax.set_title(PARTS[part].capitalize(), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    title = "Where the crossover lies: critics pretrained on the frozen policy against GRPO's group of G"
    fig.suptitle(f"{note}: not a result\n{title}" if note else title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ======================================================================================================
# The command: a curve alone
# ======================================================================================================


@dataclass
class Args:
    """A learning curve's tables and figure (python -m study.crossover FOLDER: FOLDER/curve.json ->
    FOLDER/crossover-curve.png and the tables on stdout)."""

    folder: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="FOLDER")] = ""
    """the folder of study/pretrain_critic.py --measure's curve.json"""
    groups: tuple[int, ...] = GROUPS
    """GRPO's group sizes to read the curve against (each at least 2)"""


def main(argv: list[str] | None = None) -> None:
    a = cmdline.parse_args(Args, argv)
    groups = check_groups(a.groups)
    folder = Path(a.folder)
    if not (folder / "curve.json").is_file():
        raise errors.UserError(f"{folder / 'curve.json'} is missing: give the --out of pretrain_critic.py --measure")
    curve = read_curve(folder / "curve.json")
    print("\n".join(curve_lines(curve, groups, {})))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure")
        return
    print(f"figure: {plot_curve(plt, curve, folder / FIGURE, groups)}")


if __name__ == "__main__":
    runtime.run_main(main)
