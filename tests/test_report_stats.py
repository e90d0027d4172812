"""report.py's numbers and plots, on synthetic runs (issue 20): GRPO's prompt-state reference, intervals centred on
what the table prints and never of zero width, nmse_group_mean pooled, the compute columns, and plots that show
every point or say where they are cut."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import measure
import plots
import read_runs
import report


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
        "wall_time_s": 100.0, "args": {"group_size": 8} if method == "grpo" else {},
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


def test_grpo_is_measured_at_the_prompt_state_and_its_line_is_drawn_there(tmp_path):
    """The table's "nmse at prompt" pools the prompt states alone (mc/<name>_prompt/); the crossover draws GRPO's
    prompt-state value (open star) beside its token-weighted one, and names the 1/(G-1) line for the prompt state."""
    runs = _sweep(tmp_path)
    grpo = [r for r in runs if r["method"] == "grpo"]
    direct = measure.pool_baseline_errors(
        [read_runs.measurement_sums(row, "loo_prompt") for r in grpo for row in r["rows"][1:3]]
    )
    summary = {r["run"]: r for r in report.summarize(runs)}
    assert summary["grpo-group"]["nmse_prompt"] == pytest.approx(direct["nmse"], rel=1e-9)
    assert summary["grpo-group"]["nmse_prompt"] != pytest.approx(summary["grpo-group"]["nmse"], rel=1e-3)
    keep = _KeepFigures()
    caption = plots.plot_crossover(keep, runs, tmp_path / "c.png")
    labels = keep.figs[0].axes[0].get_legend_handles_labels()[1]
    assert any("prompt states" in label for label in labels), labels
    assert any(label.startswith("1/(G-1)") and "prompt state only" in label for label in labels), labels
    assert "whatever the success rate" in caption and "(1/(G-1) + d)" in caption
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    assert "nmse at prompt" in md.splitlines()[[i for i, x in enumerate(md.splitlines()) if x.startswith("| exp")][0]]


def test_the_nmse_interval_is_centred_on_the_pooled_value_and_group_mean_is_pooled(tmp_path):
    """The printed nmse is pooled over seeds' sums; its interval is centred on it (intervals.ratio_interval over the
    seeds), not on the mean of the seeds' ratios. nmse_group_mean pools the same way (it was a mean of ratios)."""
    runs = _sweep(tmp_path)
    summary = {r["run"]: r for r in report.summarize(runs)}
    for run in ("ppo-small", "grpo-group"):
        row = summary[run]
        assert (row["nmse_low"] + row["nmse_high"]) / 2 == pytest.approx(row["nmse"], rel=1e-9)
        assert row["nmse_interval"] == "seeds"
        cells = [line for line in report.markdown_table([row]).splitlines() if line.startswith("| h2h")]
        assert f"{row['nmse']:.3f} [{row['nmse_low']:.3f}, {row['nmse_high']:.3f}]" in cells[0]
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
    table = report.markdown_table(list(summary.values()))
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
    head = [line for line in md.splitlines() if line.startswith("| experiment")][0]
    assert "| wall time | train time |" in head and "| update FLOPs |" in head and "train FLOPs" not in md
    assert "79.0 s" in md and "100.0 s" in md
    assert "prompt tokens, generation, the reference" in md


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
