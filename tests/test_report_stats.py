"""report.py's numbers and plots, on synthetic runs: GRPO's prompt-state reference, intervals centred on
what the table prints and never of zero width, nmse_group_mean pooled, the compute columns, and plots that show
every point or say where they are cut."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import intervals
import measure
from study import plots, read_runs, report


def _rows(name: str, measurements: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], k: int) -> list[dict]:
    """metrics.jsonl rows, one per MC measurement (pred, p_hat, t of each state), as measure.monte_carlo logs them."""
    rows = []
    for step, (pred, mc, t) in enumerate(measurements):
        parts = measure.baseline_error_by_state(pred, mc, k, t, groups=torch.arange(len(pred)) % 10)
        row = {"step": step + 1, "mc/seconds": 3.0}
        for part, err in parts.items():
            row.update({f"mc/{name}{part}/{key}": v for key, v in err.items()})
            if name == "loo":
                row.update({f"mc/group{part}/{key}": v for key, v in err.items()})
        rows.append(row)
    return rows


def _write(root: Path, experiment: str, method: str, seed: int, rows: list[dict], correct: list[float], **res) -> None:
    run = "ppo-small" if method == "ppo" else "grpo-group"
    run_dir = root / experiment / f"{run}-s{seed}"
    run_dir.mkdir(parents=True)
    n = len(correct)
    results = {
        "method": method, "critic": "small" if method == "ppo" else "group", "seed": seed, "steps": len(rows),
        "generated_tokens": 1000, "trained_tokens": 2000, "policy_params": 10, "critic_params": 5,
        "wall_time_s": 100.0, "args": {"group_size": 8} if method == "grpo" else {}, "device": "cpu",
        "test": {"accuracy": sum(correct) / n, "n": n, "ci95": [0.0, 1.0], "correct": correct, "seconds": 5.0},
        **res,
    }  # fmt: skip
    (run_dir / "results.json").write_text(json.dumps(results))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _measurement(g: torch.Generator, noise: float, n: int = 40, k: int = 8, exact: bool = False):
    truth = torch.rand(n, generator=g, dtype=torch.float64)
    mc = (torch.rand(n, k, generator=g, dtype=torch.float64) < truth[:, None]).double().mean(-1)
    pred = mc.clone() if exact else truth + noise * torch.randn(n, generator=g, dtype=torch.float64)
    return pred, mc, torch.arange(n) % 4  # every fourth state a prompt state


class _KeepFigures:
    """matplotlib.pyplot, with the figures kept open for the test to read."""

    def __init__(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt, self.figs = plt, []

    def subplots(self, *a, **kw):
        fig, ax = self.plt.subplots(*a, **kw)
        self.figs.append(fig)
        return fig, ax

    def close(self, fig) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.plt, name)


def _sweep(tmp_path: Path, ppo_exact: bool = False, same_correct: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    n_test = 50
    for method, name, noise in (("ppo", "value", 0.15), ("grpo", "loo", 0.3)):
        for seed in (1, 2, 3):
            sizes = (40, 40, 40) if seed != 3 else (40, 200, 200)  # seed 3 measures more states
            meas = [_measurement(g, noise, n, exact=ppo_exact and method == "ppo") for n in sizes]
            correct = [0.0] * n_test if same_correct else (torch.rand(n_test, generator=g) < 0.4).float().tolist()
            final_val = {"step": 3, "val/accuracy": 0.1, "val/seconds": 7.0}
            rows = _rows(name, meas, 8) + [final_val, final_val]  # a resume logs the final evaluation twice
            _write(tmp_path, "h2h", method, seed, rows, correct)
    runs, damaged = report.load_runs(tmp_path)
    assert not damaged and len(runs) == 6
    return runs


def _grpo_pooled(runs: list[dict], name: str) -> float:
    """GRPO's nmse of baseline `name` pooled directly from its metrics rows (the measurements after the first)."""
    grpo = [r for r in runs if r["method"] == "grpo"]
    sums = [read_runs.measurement_sums(row, name) for r in grpo for row in r["rows"][1:3]]
    return measure.pool_baseline_errors(sums)["nmse"]


def test_grpo_is_measured_at_the_prompt_state_and_its_line_is_drawn_there(tmp_path):
    """The table's "nmse at prompt" pools the prompt states alone (mc/<name>_prompt/); the crossover draws GRPO's
    prompt-state value (open star) beside its token-weighted one, and names the 1/(G-1) line for the prompt state."""
    runs = _sweep(tmp_path)
    summary = {r["run"]: r for r in report.summarize(runs)}
    assert summary["grpo-group"]["nmse_prompt"] == pytest.approx(_grpo_pooled(runs, "loo_prompt"), rel=1e-9)
    assert summary["grpo-group"]["nmse_prompt"] != pytest.approx(summary["grpo-group"]["nmse"], rel=1e-3)
    keep = _KeepFigures()
    caption = plots.plot_crossover(keep, runs, tmp_path / "c.png")
    labels = keep.figs[0].axes[0].get_legend_handles_labels()[1]
    assert any("prompt states" in label for label in labels), labels
    assert any(label.startswith("1/(G-1)") and "prompt state only" in label for label in labels), labels
    assert "whatever the success rate" in caption and "(1/(G-1) + d)" in caption
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    heads = [x for x in md.splitlines() if x.startswith("| exp")]
    assert "nmse at prompt" in heads[1]  # the baseline-error table, after accuracy and compute


def test_the_nmse_interval_is_centred_on_the_pooled_value_and_group_mean_is_pooled(tmp_path):
    """The printed nmse is pooled over seeds' sums; its interval is centred on it (intervals.ratio_interval over the
    seeds), not on the mean of the seeds' ratios. nmse_group_mean pools the same way (it was a mean of ratios)."""
    runs = _sweep(tmp_path)
    summary = {r["run"]: r for r in report.summarize(runs)}
    for run in ("ppo-small", "grpo-group"):
        row = summary[run]
        assert (row["nmse_low"] + row["nmse_high"]) / 2 == pytest.approx(row["nmse"], rel=1e-9)
        assert row["nmse_interval"] == "seeds"
        cells = [line for line in report.markdown_tables([row]).splitlines() if line.startswith("| h2h")]
        assert f"{row['nmse']:.3f} [{row['nmse_low']:.3f}, {row['nmse_high']:.3f}]" in cells[1]  # the error table
    grpo = [r for r in runs if r["method"] == "grpo"]
    pooled = measure.pool_baseline_errors(
        [read_runs.measurement_sums(row, "group") for r in grpo for row in r["rows"][1:3]]
    )
    mean_of_ratios = sum(r["mc"]["nmse_group_mean"] for r in grpo) / 3
    assert summary["grpo-group"]["nmse_group_mean"] == pytest.approx(pooled["nmse"], rel=1e-9)
    assert abs(mean_of_ratios - pooled["nmse"]) > 1e-6  # seed 3 weighs more: the two differ


def test_no_interval_is_printed_with_zero_width(tmp_path):
    """Seeds that agree exactly (every run 0% on every problem): no "[0.0, 0.0]" as if certain, but n/a, and the
    accuracy cell says why."""
    runs = _sweep(tmp_path, same_correct=True)
    summary = {r["run"]: r for r in report.summarize(runs)}
    row = summary["ppo-small"]
    assert row["vs_grpo"] == 0 and math.isnan(row["vs_grpo_low"]) and math.isnan(row["interval_low"])
    table = report.markdown_tables(list(summary.values()))
    assert "[0.0, 0.0]" not in table and "[+0.0, +0.0]" not in table
    assert "n/a (seeds agree: needs more seeds)" in table and "+0.0 [n/a]" in table


def test_train_time_leaves_out_the_measurement_and_the_evaluations_and_flops_say_what_they_count(tmp_path):
    """wall time 100 s; the MC measurement 3 x 3 s, a validation 7 s (logged twice, as after a resume: counted
    once), the test 5 s: train time 79 s, both shown.
    The FLOPs column is named for what it counts (the updates), and the definitions say what it leaves out."""
    runs = _sweep(tmp_path)
    summary = {r["run"]: r for r in report.summarize(runs)}
    assert summary["ppo-small"]["train_time_s"] == pytest.approx(100 - 9 - 7 - 5)
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    head = [line for line in md.splitlines() if line.startswith("| experiment | run | gen. tokens")][0]  # compute
    assert "| wall time | train time |" in head and "| update FLOPs |" in head and "train FLOPs" not in md
    assert "79.0 s" in md and "100.0 s" in md
    # what the FLOPs leave out (generation and the reference are now counted, each as a part)
    assert "prompt tokens and attention's quadratic term are not counted" in md


def test_a_negative_nmse_stays_on_the_crossover_plot(tmp_path):
    """A baseline equal to the MC mean reads nmse = -1/K after the noise correction: the x axis reaches it."""
    runs = _sweep(tmp_path, ppo_exact=True)
    x = {r["run"]: r for r in report.summarize(runs)}["ppo-small"]["nmse"]
    assert x == pytest.approx(-1 / 8, rel=1e-6)
    keep = _KeepFigures()
    plots.plot_crossover(keep, runs, tmp_path / "c.png")
    left, right = keep.figs[0].axes[0].get_xlim()
    assert left < x < right


def test_the_errors_plot_is_on_the_runs_scale_and_says_where_it_is_cut(tmp_path):
    """One measurement on a few near-certain states reads an nmse in the thousands; the axes stay on the runs'
    scale, the outlier is drawn on the edge, and the title says how many are beyond."""
    runs = _sweep(tmp_path)
    ppo = [r for r in runs if r["method"] == "ppo"][0]
    ppo["rows"][1]["mc/value/nmse"] = 2000.0
    ppo["rows"][1]["mc/value/nmse_centred"] = 1500.0
    keep = _KeepFigures()
    plots.plot_errors(keep, runs, tmp_path / "e.png")
    ax = keep.figs[0].axes[0]
    assert ax.get_xlim()[1] < 5 and ax.get_ylim()[1] < 5
    assert "1 of" in ax.get_title() and "beyond" in ax.get_title()
    pooled = [r["mc"]["nmse"] for r in runs]
    assert all(ax.get_xlim()[0] <= x <= ax.get_xlim()[1] for x in pooled)


def _table(md: str, first_column: str) -> list[str]:
    """The rows of report.md's table whose header starts with `first_column`, the header first."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column}"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [lines[start]] + lines[start + 2 : end]


def test_every_nmse_has_its_interval_and_each_critic_its_difference_to_grpo(tmp_path):
    """The docs send a reader to nmse at the prompt (less noisy), over states (tracks the value), centred and within:
    each is printed with its interval, and for each critic its nmse less GRPO's, at the prompt and over states,
    with the interval of that difference (paired by seed), so that a reader compares intervals, not points."""
    runs = _sweep(tmp_path)
    summary = {r["run"]: r for r in report.summarize(runs)}
    ppo, grpo = summary["ppo-small"], summary["grpo-group"]
    for key in ("nmse", "nmse_prompt", "nmse_centred", "within_nmse"):
        assert ppo[f"{key}_low"] < ppo[key] < ppo[f"{key}_high"], key
    by = {(r["run"], r["seed"]): r for r in runs}
    for key, part in (("diff_prompt", "prompt_sums"), ("diff", "sums")):
        a = [by[("ppo-small", s)]["mc"][part] for s in (1, 2, 3)]
        b = [by[("grpo-group", s)]["mc"][part] for s in (1, 2, 3)]
        want = intervals.ratio_difference_interval(
            [u["sum_sq_err_nc"] for u in a], [u["sum_signal_var"] for u in a],
            [u["sum_sq_err_nc"] for u in b], [u["sum_signal_var"] for u in b],
        )  # fmt: skip
        assert (ppo[key], ppo[f"{key}_low"], ppo[f"{key}_high"]) == pytest.approx(want), key
        assert ppo[key] == pytest.approx(ppo[key.replace("diff", "nmse")] - grpo[key.replace("diff", "nmse")])
    assert ppo["diff_high"] < 0  # the critic (error sd 0.15) beats GRPO's stand-in (0.3), and the interval says so
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    rows = _table(md, "experiment | run | seeds | nmse at prompt")
    row = next(line for line in rows if "| ppo-small |" in line)
    for key in ("nmse_prompt", "diff_prompt", "nmse", "diff", "nmse_centred", "within_nmse"):
        signed = "+" if key.startswith("diff") else ""
        x, lo, hi = ppo[key], ppo[f"{key}_low"], ppo[f"{key}_high"]
        assert f"{x:{signed}.3f} [{lo:{signed}.3f}, {hi:{signed}.3f}]" in row, (key, row)
    # the table comes first, short; how to read it after
    assert md.index("| experiment | run | seeds | test acc.") < md.index("How to read it")
    assert all(len(line.split("|")) - 2 <= 11 for line in (rows[0], _table(md, "experiment | run | seeds | test")[0]))


def test_one_seed_cells_say_their_interval_is_not_over_seeds(tmp_path):
    """One seed: its intervals are over its measurements (nmse) or test problems (accuracy, the paired difference),
    not over seeds; such a cell is marked and a note says what it covers. Three seeds: no mark."""
    runs = [r for r in _sweep(tmp_path) if r["seed"] == 1]
    md = report.markdown_tables(report.summarize(runs))
    row = next(line for line in _table(md, "experiment | run | seeds | nmse at prompt") if "| ppo-small |" in line)
    assert row.count("†") == 6, row  # nmse at prompt and over states, the differences, centred and within
    acc = next(line for line in _table(md, "experiment | run | seeds | test") if "| ppo-small |" in line)
    assert acc.count("†") == 2, acc  # its Wilson interval, its paired difference over problems
    assert "† one seed:" in md and "not over seeds" in md
    md3 = report.markdown_tables(report.summarize(_sweep(tmp_path / "three")))
    assert "†" not in md3.split("† one seed")[0]


def test_the_group_mean_is_read_at_the_prompt_and_its_words_say_where(tmp_path):
    """GRPO's group mean (its own reward in it) reads 1/G at the prompt; pooled over token-weighted states it reads
    (1 + (G-2) d) / (G (1 - d)) (tests/test_intervals.py), so the definitions may not call that column ~1/G."""
    runs = _sweep(tmp_path)
    summary = {r["run"]: r for r in report.summarize(runs)}
    assert summary["grpo-group"]["nmse_group_mean_prompt"] == pytest.approx(
        _grpo_pooled(runs, "group_prompt"), rel=1e-9
    )
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    assert "reads ~1/G (runs.csv nmse_group_mean" not in md
    assert "nmse_group_mean_prompt" in md and "(1 + (G-2) d) / (G (1 - d))" in md


def test_the_compute_section_shows_each_runs_flops_by_part_and_no_count_is_written_in(tmp_path):
    """Each run's budget as generated tokens, its FLOPs by part (generation, reference, old values, update, critic)
    and its wall time; the duration note counts the runs it read, whatever their number."""
    runs = _sweep(tmp_path)
    ppo = next(r for r in runs if r["run"] == "ppo-small")
    f = ppo["flops"]
    assert f["generation"] == 2 * 10 * 1000 and f["update"] == 6 * 10 * 2000 and f["critic"] == 6 * 5 * 2000
    assert f["old"] == 2 * 5 * 1000 and f["reference"] == 0.0  # no kl_coef recorded: no reference
    assert f["total"] == pytest.approx(sum(f[k] for k in ("generation", "reference", "old", "update", "critic")))
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    head = _table(md, "experiment | run | gen. tokens")[0]
    for col in ("generation", "reference", "old values", "update", "critic", "total", "wall time"):
        assert col in head, col
    assert "summed over the 2 runs of one seed" in md and "17 runs" not in md


def test_a_missing_interval_is_a_hollow_marker_never_a_zero_width_bar(tmp_path):
    """Seeds that agree exactly (every run 0% on every problem) have no accuracy interval: the crossover draws such
    a point hollow, without a bar of zero width, and its caption says what hollow means."""
    runs = _sweep(tmp_path, same_correct=True)
    assert math.isnan(plots.seed_stats([0.0, 0.0, 0.0])[1]), "no interval: nan, not a half-width of 0"
    keep = _KeepFigures()
    caption = plots.plot_crossover(keep, runs, tmp_path / "c.png")
    ax = keep.figs[0].axes[0]
    points = [line for line in ax.lines if line.get_marker() in ("o", "*") and len(line.get_xdata()) == 1]
    assert points and all(line.get_markerfacecolor() == "none" for line in points), "no interval: hollow"
    for container in ax.containers:  # every bar drawn has a width
        for bars in container.lines[2]:
            for seg in bars.get_segments():
                assert abs(seg[1][0] - seg[0][0]) + abs(seg[1][1] - seg[0][1]) > 0
    assert "hollow" in caption and "no interval" in caption


def test_toy_figures_say_so_and_a_point_on_few_states_says_how_few(tmp_path):
    """A smoke sweep's figures are titled as toy output; a point whose nmse rests on fewer informative states than
    plots.FEW_STATES carries its count beside it."""
    runs = _sweep(tmp_path)
    keep = _KeepFigures()
    plots.plot_crossover(keep, runs, tmp_path / "c.png", note="A smoke sweep")
    plots.plot_curves(keep, runs, tmp_path / "u.png", note="A smoke sweep")
    plots.plot_errors(keep, runs, tmp_path / "e.png", note="A smoke sweep")
    titles = [fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title() for fig in keep.figs]
    assert all("A smoke sweep" in t and "not a result" in t for t in titles), titles
    texts = [t.get_text() for t in keep.figs[0].axes[0].texts]
    few = [r for r in report.summarize(runs) if r["run"] == "ppo-small"][0]
    n = round(sum(r["mc"]["sums"]["signal_groups"] for r in runs if r["run"] == "ppo-small"))
    assert n < plots.FEW_STATES and any(f"{n} informative" in t for t in texts), (n, texts, few["nmse"])


def test_curves_that_lie_on_one_another_are_told_apart(tmp_path):
    """Two runs with the same curve (the smoke sweep's critics, all at 50%): each drawn with its own marker and line
    style, and the legend says which lies under which."""
    runs = _sweep(tmp_path)
    for r in runs:  # every run the same validation curve
        r["curve"] = {**r["curve"], "val_step": [1, 2], "val": [0.5, 0.5], "val_tokens": [10.0, 20.0]}
    keep = _KeepFigures()
    plots.plot_curves(keep, runs, tmp_path / "u.png")
    ax = keep.figs[0].axes[0]
    lines = [line for line in ax.lines if line.get_label() and not line.get_label().startswith("_")]
    assert len(lines) == 2
    assert len({(line.get_marker(), line.get_linestyle()) for line in lines}) == 2
    assert any("same as ppo-small" in line.get_label() for line in lines), [x.get_label() for x in lines]


def test_the_informative_share_is_read_at_the_prompt_states_as_the_preflight_reads_it(tmp_path):
    """The table's informative share and the warning count the same states as the preflight: the prompt states
    (a share of 0 of 2 prompt states beside a column reading 1.00 over every state told a reader two things)."""
    runs = _sweep(tmp_path)
    rs = [r for r in runs if r["run"] == "ppo-small"]
    prompt = measure.pool_baseline_errors(
        [read_runs.measurement_sums(row, "value_prompt") for r in rs for row in r["rows"][1:3]]
    )
    row = {r["run"]: r for r in report.summarize(runs)}["ppo-small"]
    assert row["informative_share"] == pytest.approx(prompt["signal_groups"] / prompt["groups"])
    assert row["informative_any"] == pytest.approx(
        sum(r["mc"]["sums"]["signal_groups"] for r in rs) / sum(r["mc"]["sums"]["groups"] for r in rs)
    )
    assert rs[0]["mc"]["informative_share"] == pytest.approx(
        rs[0]["mc"]["prompt_sums"]["signal_groups"] / rs[0]["mc"]["prompt_sums"]["groups"]
    )
