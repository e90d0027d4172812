"""How the crossover moves: the critic-equivalent group size G* against the policy's size and the task's spread.

Reads the organisms' learning curves in a sweep's folder (study/pretrain_critic.py --measure on each named organism,
plumbing/models.py ORGANISMS): the organism's own from the crossover experiment (OUT/crossover/curve/curve.json) and
the moves experiments' (OUT/size/curve-small, OUT/size/curve-large, OUT/spread/curve-wide). Holds: each organism's card
(its build's report: parameters, the task's operations, greedy accuracy; the held-out measurement's pass rate,
informative share, E[p(1-p)] and the constant baseline's nmse at the prompt, which is the spread of difficulty:
between-prompt variance of the success rate over E[p(1-p)]), the table of G* per organism and capacity at one
pretraining size with its interval, GRPO's leave-one-out mean measured at each G, the sentence that says which way
the crossover moves, and its figure (moves.png: G* against parameters, and against the spread). A folder without
these curves gets no section, so an older sweep's report reads as it did.
Also the head-to-head where G* was measured (the spread and size experiments' runs, H2H): GRPO at the two group
sizes either side of G*, PPO with the best pretrained head at both prices; their accuracy at matched compute, each
against both of GRPO's G on the same test problems.
Does not hold: the measurement (pretrain_critic.py, measure.py), reading a curve and G*'s arithmetic (crossover.py,
intervals.py), reading and pooling the runs and the paired differences' arithmetic (read_runs.py, report.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from plumbing import errors, models
from study.crossover import (
    COLOURS,
    CONTROL,
    GROUP_COLOURS,
    GROUPS,
    critics_of,
    fmt_accuracy,
    g_star,
    part_of,
    pretraining_tokens,
    price_of,
    read_curve,
    table,
)
from study.read_runs import finite, fmt_interval, fmt_num, fmt_signed_interval, fmt_tokens, mean

# each organism's curve in a sweep's folder, in the order of the tables (the organism first: the crossover's own)
CURVES = {
    models.ORGANISM: Path("crossover") / "curve" / "curve.json",
    "organism-small": Path("size") / "curve-small" / "curve.json",
    "organism-large": Path("size") / "curve-large" / "curve.json",
    "organism-wide": Path("spread") / "curve-wide" / "curve.json",
}
SAME_TASK = (models.ORGANISM, "organism-small", "organism-large")  # the size axis: one task, three policies
ROLLOUTS = 4096  # the pretraining size G* is read at: every curve has it, and the crossover's PPO runs use it
HEADS = ("small", "medium", "large")  # the capacities every organism's curve fits: the sentence's best is one of them
FIGURE = "moves.png"
# experiment -> (its organism, GRPO's runs at the two G either side of the measured G*: the smaller first; the larger's
# tokens are the PPO runs' budget, sweep.sh's --budget-from)
H2H = {
    "spread": ("organism-wide", ("grpo-group-g2", "grpo-group-g4")),
    "size": ("organism-large", ("grpo-group-g4", "grpo-group")),
}
Paired = dict[str, dict[tuple[str, str], tuple]]  # reference run -> (experiment, run) -> report.paired_vs_grpo's tuple


# ======================================================================================================
# The organisms: each curve and its card
# ======================================================================================================


def read_organisms(out: Path) -> dict[str, dict[str, Any]]:
    """{name: curve} for every organism whose curve the folder holds (read_curve: a damaged one is a UserError)."""
    return {name: read_curve(out / rel) for name, rel in CURVES.items() if (out / rel).is_file()}


def card(name: str, curve: dict[str, Any]) -> dict[str, Any]:
    """The organism's numbers: its build's (the curve's "organism", or the shipped build's record for a curve made
    before curves carried it) and its held-out measurement's, with the constant baseline's nmse at the prompt at
    ROLLOUTS (the spread: 0 when every prompt is as hard as the next)."""
    built = curve.get("organism")
    if built is None and name == models.ORGANISM:
        built = json.loads((models.SHIPPED_ORGANISMS[name] / models.ORGANISM_RECORD).read_text())
    settings, report = (built or {}).get("settings", {}), (built or {}).get("report", {})
    held = curve.get("heldout", {})
    constant = row_at(curve, "constant")
    return {
        "parameters": report.get("parameters"),
        "ops": (settings.get("min_ops"), settings.get("max_ops")),
        "max_number": settings.get("max_number"),
        "build_seconds": report.get("seconds"),
        "greedy": report.get("test_greedy"),
        "pass_rate": held.get("pass_rate"),
        "informative": held.get("informative_share"),
        "p1p": held.get("mean_p_1_minus_p"),
        "spread": part_of(constant, "prompt") if constant else (math.nan,) * 3,
        "prompts": held.get("prompts"),
        "mc_samples": held.get("mc_samples"),
    }


def row_at(curve: dict[str, Any], capacity: str, rollouts: int = ROLLOUTS) -> dict[str, Any] | None:
    """A capacity's row at `rollouts` (the largest below it where the curve stops short; the linear read-out's one
    row), or None."""
    rows = [r for r in curve["rows"] if r["capacity"] == capacity]
    if capacity == "linear":
        return rows[0] if rows else None
    below = [r for r in rows if r["rollouts"] <= rollouts]
    return below[-1] if below else None


def best_head(curve: dict[str, Any]) -> str | None:
    """The head (HEADS: a value head on the policy's features) with the lowest nmse at the prompt at ROLLOUTS (None:
    no head's row). The full critic, its own layers, is no head: a curve that has it (the crossover's) is compared
    with curves that do not by what every organism's curve holds, and its G* stands in the table beside them."""
    heads = [cap for cap in critics_of(curve) if cap in HEADS]
    scored = [(part_of(r, "prompt")[0], cap) for cap in heads if (r := row_at(curve, cap))]
    scored = [(x, cap) for x, cap in scored if finite(x)]
    return min(scored)[1] if scored else None


# ======================================================================================================
# The section of report.md
# ======================================================================================================


def fmt_g(gs: tuple[float, float, float]) -> str:
    g, lo, hi = gs
    if not (finite(g) or g == math.inf):
        return "-"
    end = lambda x: "inf" if x == math.inf else f"{x:.1f}"  # noqa: E731
    return f"{end(g)} [{end(lo)}, {end(hi)}]" if finite(lo) and (finite(hi) or hi == math.inf) else end(g)


def fmt_nmse(x: tuple[float, float, float]) -> str:
    v, lo, hi = x
    return "-" if not finite(v) else f"{v:.3f} [{lo:.3f}, {hi:.3f}]" if finite(lo) and finite(hi) else f"{v:.3f}"


def card_table(organisms: dict[str, dict[str, Any]]) -> list[str]:
    head = ["organism", "parameters", "operations", "build", "greedy (test)", "pass rate", "informative",
            "E[p(1-p)]", "spread: constant baseline's nmse at the prompt"]  # fmt: skip
    rows = []
    for name, curve in organisms.items():
        c = card(name, curve)
        ops = "-" if c["ops"][0] is None else f"{c['ops'][0]}-{c['ops'][1]}, numbers 0-{c['max_number']}"
        rows.append([
            name, f"{c['parameters']:,}" if c["parameters"] else "-", ops,
            f"{c['build_seconds'] / 60:.1f} min" if c["build_seconds"] else "-",
            fmt_num(c["greedy"], 3), fmt_num(c["pass_rate"], 3), fmt_num(c["informative"], 2), fmt_num(c["p1p"], 3),
            fmt_nmse(c["spread"]),
        ])  # fmt: skip
    return table(head, rows)


def g_star_table(organisms: dict[str, dict[str, Any]]) -> list[str]:
    capacities = [cap for cap in ("small", "medium", "large", "full") if any(cap in critics_of(c) for c in
                                                                             organisms.values())]  # fmt: skip
    head = ["organism", "constant", *[f"critic {cap}" for cap in capacities], "linear read-out (ceiling)",
            "GRPO measured nmse, G = 2 / 4 / 8 / 16"]  # fmt: skip
    rows = []
    for name, curve in organisms.items():
        cells = [name]
        for cap in ("constant", *capacities, "linear"):
            r = row_at(curve, cap)
            cells.append(fmt_g(g_star(*part_of(r, "prompt"))) if r else "-")
        measured = curve.get("grpo_prompt_measured") or {}
        cells.append(" / ".join(fmt_num(measured.get(str(G), {}).get("nmse"), 3) for G in GROUPS))
        rows.append(cells)
    return table(head, rows)


def moves_sentence(organisms: dict[str, dict[str, Any]]) -> list[str]:
    """Which way G* (the best head's, at the prompt) moves with the parameters (the same task) and with the spread."""
    best = {}
    for name, curve in organisms.items():
        cap = best_head(curve)
        if cap is not None:
            best[name] = (cap, g_star(*part_of(row_at(curve, cap), "prompt")), card(name, curve))
    out = []
    sized = sorted((best[n][2]["parameters"] or 0, n) for n in SAME_TASK if n in best)
    if len(sized) >= 2:
        steps = ", ".join(f"G* {fmt_g(best[n][1])} at {p / 1e6:.2f}M ({n}, critic {best[n][0]})" for p, n in sized)
        out.append(f"**Against the policy's size** (one task, 2-3 operations): {steps}.")
    if models.ORGANISM in best and "organism-wide" in best:
        parts = []
        for n in (models.ORGANISM, "organism-wide"):
            cap, gs, c = best[n]
            parts.append(f"G* {fmt_g(gs)} on {n} (spread {fmt_nmse(c['spread'])}, critic {cap})")
        out.append(f"**Against the task's spread** (one policy size): {' to '.join(parts)}.")
    return out


def carries_line(organisms: dict[str, dict[str, Any]]) -> str:
    """How far the reading carries, and the group sizes the GPU study should compare: GRPO's G that bracket every
    organism's G* (the best head's, at the prompt), from the largest at or below the least to the smallest at or
    above the most. '' without a finite G*."""
    best = [g_star(*part_of(row_at(c, cap), "prompt"))[0] for c in organisms.values() if (cap := best_head(c))]
    best = [g for g in best if finite(g)]
    params = [card(n, c)["parameters"] for n, c in organisms.items()]
    if not best:
        return ""
    low = max([G for G in GROUPS if G <= min(best)] or [min(GROUPS)])
    high = min([G for G in GROUPS if G >= max(best)] or [max(GROUPS)])
    compare = [G for G in GROUPS if low <= G <= high]
    largest = max((p for p in params if p), default=0)
    return (
        f"**How far it carries**: organisms of up to {largest / 1e6:.2f}M parameters on this arithmetic; on a 0.5B "
        f"policy and GSM8K it is a hypothesis the GPU study tests. G* spans {min(best):.1f}-{max(best):.1f} here, so "
        f"that study should compare GRPO at G = {', '.join(map(str, compare))} with the pretrained critic, and read "
        "its own spread (the constant's nmse at the prompt) first: G* cannot be much above 1 + 1/spread unless the "
        "critic tells prompts apart."
    )


def has_parts(out: Path) -> bool:
    """Whether the folder holds a curve of an organism other than the crossover's own: else no section."""
    return any((out / rel).is_file() for name, rel in CURVES.items() if name != models.ORGANISM)


def section(
    out: Path,
    plt: Any,
    report_dir: Path,
    note: str = "",
    summary: list[dict[str, Any]] | None = None,
    runs: list[dict[str, Any]] | None = None,
    paired: Paired | None = None,
) -> list[str]:
    """report.md's "How the crossover moves", and its figure into report_dir (plt None: none); [] without its parts.
    summary, runs and paired (report.py's, paired against each of H2H's GRPO runs) give its head-to-head table."""
    if not has_parts(out):
        return []
    lines = ["", "## How the crossover moves", ""]
    try:
        organisms = read_organisms(out)
    except errors.UserError as e:
        return lines + [f"No comparison: {e}."]
    lines += [
        "Each organism's critics pretrained on its frozen starting policy's rollouts and measured the crossover's way "
        "(512 held-out prompts against Monte Carlo; the organism's own curve is the crossover experiment's). The "
        "spread of difficulty is the constant baseline's nmse at the prompt: the variance of the prompts' success "
        "rates over E[p(1-p)] (0: every prompt as hard as the next). The card's build numbers are organism.py's "
        "(greedy accuracy on the 1,000 test problems); the pass rate and informative share are the held-out "
        "measurement's.",
        "",
        *card_table(organisms),
        "",
        f"G* = 1 + 1/nmse at the prompt (95% interval) after {ROLLOUTS:,} pretraining rollouts; a critic beats GRPO's "
        "group of G where G* > G. GRPO measured: its leave-one-out mean on the held-out prompts' Monte Carlo "
        "returns (split samples, noise removed), against 1/(G-1) = 1, 0.333, 0.143, 0.067 ('-': too few samples a "
        "prompt, or a curve made before it was measured).",
        "",
        *g_star_table(organisms),
    ]
    if sentence := moves_sentence(organisms):
        lines += ["", *sentence]
    if carries := carries_line(organisms):
        lines += ["", carries]
    if plt is not None and len(organisms) >= 2:
        plot_moves(plt, organisms, report_dir / FIGURE, note)
        lines += ["", f"![{FIGURE}]({FIGURE})", "", figure_caption()]
    if acc := accuracy_table(summary or [], runs or [], paired or {}):
        lines += [
            "",
            "### Accuracy at matched compute, where G* was measured",
            "",
            "On each organism, GRPO at the two group sizes either side of its G* (batch x G = 256 completions a step, "
            "50 steps) and PPO with its best head pretrained on 4,096 rollouts (the lowest nmse at the prompt above) "
            "at the tokens of the same seed's GRPO run at the larger G; amortised: the pretraining free, paid: its "
            "tokens out of the budget. vs the smaller / larger G: the paired difference in test accuracy from that "
            "GRPO run on the same test problems, the t interval over the per-seed differences (as the Results "
            "table); vs PPO without a critic: the same from the control (PPO whose baseline is the batch's mean "
            "reward, at the same budget), what the pretrained critic adds to PPO. A critic with G* between the two G "
            "should beat the smaller and lose to the larger, if the baseline's error at the prompt is what decides.",
            "",
            *acc,
        ]
    return lines


def accuracy_table(summary: list[dict[str, Any]], runs: list[dict[str, Any]], paired: Paired) -> list[str]:
    """The head-to-head's runs at matched compute, per organism: GRPO at each G, then PPO per price; test accuracy
    over seeds, its paired difference from GRPO at each of the two G and, for a pretrained critic, from PPO without
    one (CONTROL) (paired: report.paired_vs_grpo against each reference run), the baseline's nmse at the prompt
    measured in training, the training and pretraining tokens."""
    rows = []
    for experiment, (organism, refs) in H2H.items():
        mine = [r for r in runs if r["experiment"] == experiment]
        names, pre = {r["run"] for r in mine}, pretraining_tokens(mine)
        group_of = {r["run"]: r["args"].get("group_size") for r in mine if r["method"] == "grpo"}
        for s in sorted((s for s in summary if s["experiment"] == experiment and s["run"] in names),
                        key=lambda s: (s["method"] != "grpo", s["run"] != CONTROL, group_of.get(s["run"]) or 0, s["run"])):  # fmt: skip
            what = f"G = {group_of[s['run']]}" if s["run"] in group_of else f"critic {s['variant'].split('-')[0]}"
            what = "no critic" if s["run"] == CONTROL else what
            vs = [paired.get(ref, {}).get((experiment, s["run"])) for ref in refs]
            vs.append(paired.get(CONTROL, {}).get((experiment, s["run"])) if s["run"] in pre else None)
            rows.append([
                organism, s["run"], what, price_of(s["run"], pre), str(s["seeds"]), fmt_accuracy(s),
                *(fmt_signed_interval(*v[:3]) if v else "-" for v in vs),
                fmt_interval(s["nmse_prompt"], s["nmse_prompt_low"], s["nmse_prompt_high"]),
                fmt_tokens(s["generated_tokens"]), fmt_tokens(mean(pre[s["run"]])) if s["run"] in pre else "-",
            ])  # fmt: skip
    head = ["organism", "run", "G / critic", "price", "seeds", "test acc. % [95%]", "vs the smaller G, points [95%]",
            "vs the larger G, points [95%]", f"vs PPO without a critic ({CONTROL}), points [95%]",
            "nmse at prompt [95%]", "training tokens", "pretraining tokens"]  # fmt: skip
    return table(head, rows) if rows else []


def figure_caption() -> str:
    return (
        f"{FIGURE}: G* at the prompt (log scale, 95% intervals) after {ROLLOUTS:,} pretraining rollouts, per "
        "capacity; left against the policy's parameters on one task, right against the task's spread (the constant "
        "baseline's nmse at the prompt) for every organism. Dashed: GRPO's group sizes; a critic above a line beats "
        "that group."
    )


def plot_moves(plt: Any, organisms: dict[str, dict[str, Any]], path: Path, note: str = "") -> Path:
    """G* per capacity against parameters (left: the same task's organisms) and against the spread (right: all).
    -> path"""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    caps = [cap for cap in ("constant", "small", "medium", "large", "full", "linear")
            if any(row_at(c, cap) for c in organisms.values())]  # fmt: skip
    for ax, axis in zip(axes, ("parameters", "spread")):
        names = [n for n in organisms if axis == "spread" or n in SAME_TASK]
        for k, cap in enumerate(caps):
            pts = []
            for n in names:
                c, r = card(n, organisms[n]), row_at(organisms[n], cap)
                x = c["parameters"] if axis == "parameters" else c["spread"][0]
                if r is None or not x or not finite(x):
                    continue
                g, lo, hi = g_star(*part_of(r, "prompt"))
                if finite(g):
                    hi = hi if finite(hi) else 100.0
                    pts.append((x, g, g - lo if finite(lo) else 0.0, hi - g, n))
            if not pts:
                continue
            pts.sort()
            xs, ys, el, eh, which = zip(*pts)
            shift = 1 + 0.02 * (k - len(caps) / 2) if axis == "parameters" else 1.0  # the bars apart
            style = dict(color="black", ls=":" if cap == "constant" else "-.", marker="s") if cap in (
                "constant", "linear") else dict(color=COLOURS.get(cap, "#555555"), marker="o")  # fmt: skip
            label = {"constant": "constant baseline", "linear": "linear read-out (ceiling)"}.get(cap, f"critic {cap}")
            ax.errorbar([x * shift for x in xs], ys, yerr=[el, eh], capsize=3, label=label, **style)
            if axis == "spread" and k == 0:  # each organism named once, at its first capacity's point
                for x, y, n in zip(xs, ys, which):
                    ax.annotate(n, (x, y), fontsize=7, xytext=(4, -10), textcoords="offset points")
        for G in GROUPS:
            ax.axhline(G, color=GROUP_COLOURS.get(G, "#d62728"), ls="--", lw=1, label=f"GRPO G = {G}")
        ax.set_yscale("log")
        ax.set_yticks(GROUPS, [str(G) for G in GROUPS])  # GRPO's group sizes as the ticks: read G* against them
        ax.yaxis.set_minor_formatter(plt.NullFormatter())
        if axis == "parameters":
            ax.set_xscale("log")
            ax.set_xlabel("policy parameters (log scale; 2-3 operations)")
        else:
            ax.set_xlabel("spread of difficulty: constant baseline's nmse at the prompt")
        ax.set_ylabel("G* at the prompt (critic-equivalent group; log scale)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    title = "How the crossover moves: G* against the policy's size and the task's spread"
    fig.suptitle(f"{note}: not a result\n{title}" if note else title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
