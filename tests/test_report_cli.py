"""report.py's command line (tyro) and one run folder in a picture: `python report.py RUN_DIR [RUN_DIR ...]` draws
each run's curves as curves.png beside its metrics.jsonl; the sweep's invocations (OUT, --report-dir, --estimate)
parse as before; bad input is one line. On synthetic run folders (no trainer runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, check_ok, check_one_error_line, run_here

from study import plots, report

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, rows: list[dict], results: dict | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if results is not None:
        (run_dir / "results.json").write_text(json.dumps(results))
    return run_dir


def ppo_rows(steps: int = 4) -> list[dict]:
    """A PPO run's rows as the trainer writes them: a step row each, a measurement at every other step, and a
    validation row (accuracy with its interval) at steps 2 and 4, the final one again for the last step."""
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "reward": 0.1 * s, "kl_ref": 0.01 * s, "generated_tokens": 32 * s, "tokens_per_s": 100.0}
        if s % 2:
            row["mc/value/nmse"] = 1.0 / s
        rows.append(row)
        if s % 2 == 0:
            rows.append({"step": s, "val/accuracy": 0.25, "val/ci_low": 0.1, "val/ci_high": 0.5})
    rows.append({"step": steps, "val/accuracy": 0.5, "val/ci_low": 0.2, "val/ci_high": 0.8})  # the final one wins
    return rows


RESULTS = {"method": "ppo", "variant": "small", "seed": 1, "steps": 4, "generated_tokens": 128,
           "test": {"accuracy": 0.25, "n": 8, "ci95": [0.07, 0.59]}}  # fmt: skip


def test_run_series_reads_every_curve_and_its_interval():
    series = plots.run_series(ppo_rows())
    assert series["reward"] == {"step": [1, 2, 3, 4], "y": pytest.approx([0.1, 0.2, 0.3, 0.4])}
    assert series["kl"]["y"] == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert series["nmse value"] == {"step": [1, 3], "y": pytest.approx([1.0, 1 / 3])}
    assert series["nmse loo"]["step"] == []  # GRPO's baseline: not logged by a PPO run
    assert series["tokens"]["y"] == [32, 64, 96, 128]
    assert series["val"] == {"step": [2, 4], "y": [0.25, 0.5], "lo": [0.1, 0.2], "hi": [0.5, 0.8]}


def test_an_empty_panel_says_whether_its_curve_was_logged_or_undefined():
    nan = float("nan")
    nmse = ["mc/value/nmse", "mc/loo/nmse"]
    assert plots.empty_panel_note([{"step": 1, "reward": 0.0}], nmse) == "not logged by this run"
    # the packaged SmolLM2 on GSM8K: every Monte Carlo score 0, so the nmse is NaN at every measured step
    note = plots.empty_panel_note([{"step": 1, "mc/value/nmse": nan}, {"step": 2, "reward": 0.0}], nmse)
    assert "undefined at every step" in note and "Monte Carlo scores" in note
    assert plots.empty_panel_note([{"step": 1, "kl_ref": nan}], ["kl_ref"]) == "logged, never a finite number"


def test_a_run_folder_gets_its_curves_beside_its_metrics(tmp_path):
    run_dir = write_run(tmp_path / "ppo-small-s1", ppo_rows(), RESULTS)
    before = sorted(p.name for p in run_dir.iterdir())
    proc = run_here("report.py", [str(run_dir)])
    check_ok(proc)
    png = run_dir / plots.RUN_PLOT
    assert proc.stdout.strip() == f"curves: {png}"
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([*before, plots.RUN_PLOT])  # nothing else written
    assert "test accuracy 25.0% [7.0, 59.0] on 8" in plots.run_title(run_dir)


def test_several_run_folders_and_an_unfinished_one(tmp_path):
    """Each folder its own picture; a run still going (no results.json) and a DPO run (no KL, no measurement)
    are drawn with what they logged."""
    ppo = write_run(tmp_path / "ppo", ppo_rows(), RESULTS)
    dpo = write_run(
        tmp_path / "dpo", [{"step": s, "reward": 0.5, "loss": 0.6, "generated_tokens": 8 * s} for s in (1, 2)]
    )
    proc = run_here("report.py", [str(ppo), str(dpo)])
    check_ok(proc)
    assert proc.stdout.splitlines() == [f"curves: {ppo / plots.RUN_PLOT}", f"curves: {dpo / plots.RUN_PLOT}"]
    assert (dpo / plots.RUN_PLOT).read_bytes()[:8] == PNG
    assert plots.run_title(dpo) == "dpo: not finished (no results.json)"


def measured_rows(baseline: str, steps: int = 8) -> list[dict]:
    """A run's rows with a Monte Carlo measurement every other step, as measure.monte_carlo logs one: each
    measurement's sums (measure.POOLED_SUMS: every state, and the prompt states apart), its nmse their ratio."""
    import measure

    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "reward": 0.1 * s, "kl_ref": 0.01 * s, "generated_tokens": 32 * s, "tokens_per_s": 100.0}
        if s % 2:
            for part, err, var in (("", 0.5 + 0.1 * s, 2.0), ("_prompt", 0.05 + 0.02 * s, 0.5)):
                sums = {k: 1.0 for k in measure.POOLED_SUMS} | {"sum_sq_err_nc": err, "sum_signal_var": var}
                sums |= measure.baseline_error_ratios(sums)
                row |= {f"mc/{baseline}{part}/{k}": v for k, v in sums.items()}
        rows.append(row)
    return rows


def curves_of(run_dir: Path):
    """The figure `report.py RUN_DIR` draws, its axes by title: what a reader sees in curves.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plots.run_figure(plt, run_dir)
    return {ax.get_title(): ax for ax in fig.axes}


def test_every_panel_of_a_runs_curves_says_what_its_y_axis_is_and_no_legend_shows_a_raw_key(tmp_path):
    run_dir = write_run(tmp_path / "ppo-small-s1", measured_rows("value"), RESULTS)
    axes = curves_of(run_dir)
    assert len(axes) == 6
    for title, ax in axes.items():
        assert ax.get_ylabel().strip(), f"{title}: no y label"
        legend = ax.get_legend()
        for text in legend.get_texts() if legend else []:
            assert "mc/" not in text.get_text() and "/nmse" not in text.get_text(), text.get_text()
    units = " ".join(ax.get_ylabel() for ax in axes.values())
    for unit in ("%", "nats per token", "tokens/s", "tokens"):
        assert unit in units, unit


def nmse_axis(axes: dict):
    return next(ax for title, ax in axes.items() if title.startswith("baseline error"))


@pytest.mark.parametrize(
    ("method", "group", "g", "whose"), [("ppo", 1, 8, "the study's GRPO"), ("grpo", 4, 4, "this run's")]
)
def test_the_nmse_panel_shows_the_pooled_interval_and_grpos_one_over_g_minus_one(tmp_path, method, group, g, whose):
    """The baseline's nmse at each measurement, pooled over the measurements after the first (the report's rule:
    the untrained critic left out) with its 95% interval over measurements (read_runs.nmse_interval, the report's
    one-seed interval), every state and the prompt states apart; and GRPO's leave-one-out 1/(G-1) at the prompt
    state as a dashed line, G the run's own for GRPO, the study's for PPO, the legend saying which."""
    from study import read_runs

    baseline = read_runs.MC_BASELINE[method]
    results = {**RESULTS, "method": method, "variant": "small" if method == "ppo" else "group",
               "args": {"group_size": group}}  # fmt: skip
    rows = measured_rows(baseline)
    run_dir = write_run(tmp_path / f"{method}-s1", rows, results)
    ax = nmse_axis(curves_of(run_dir))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    mc = read_runs.mc_summary(rows, method)
    for key in ("nmse", "nmse_prompt"):
        x, lo, hi, _ = read_runs.nmse_interval([{"mc": mc}], key)
        assert lo < x < hi
        assert any(f"{x:.2f} [{lo:.2f}, {hi:.2f}]" in label for label in labels), (key, labels)
        bands = [p for p in ax.patches if abs(p.get_y() - lo) < 1e-9 and abs(p.get_y() + p.get_height() - hi) < 1e-9]
        assert len(bands) == 1, (key, [(p.get_y(), p.get_height()) for p in ax.patches])
    lines = [line for line in ax.get_lines() if line.get_linestyle() == "--" and set(line.get_ydata()) == {1 / (g - 1)}]
    assert len(lines) == 1, [(line.get_linestyle(), line.get_ydata()) for line in ax.get_lines()]
    assert any(f"G = {g}" in label and whose in label for label in labels), labels
    assert "no interval" in ax.get_legend().get_title().get_text()  # a point's own: why it has none


def test_a_measurement_too_few_for_an_interval_draws_its_pooled_value_alone(tmp_path):
    """Two measurements: one after the first, no interval (an interval needs two units): the pooled value is drawn
    and the legend says why no band; nothing pretends to an interval of zero width."""
    run_dir = write_run(tmp_path / "ppo-s1", measured_rows("value", steps=3), RESULTS)
    ax = nmse_axis(curves_of(run_dir))
    labels = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "no interval" in labels and not ax.patches, labels


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "exactly one"),
        (["--estimate", "{sweep}", "{run}"], "exactly one"),
        (["{tmp}/missing"], "is not a folder"),
        (["{run}", "{sweep}"], "holds no metrics.jsonl"),
        (["{sweep}", "{sweep}"], "one sweep folder at a time"),
        (["{run}", "--report-dir", "{tmp}/r"], "--report-dir is for a sweep's report"),
        (["--estimate", "{sweep}", "--steps", "0"], "--steps 0 must be a positive number"),
        (["--estimate", "{sweep}", "--steps", "x"], "--steps"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_input_is_one_error_line_and_nothing_written(tmp_path, args, message):
    run_dir = write_run(tmp_path / "run", ppo_rows(), RESULTS)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    argv = [a.format(run=run_dir, sweep=sweep, tmp=tmp_path) for a in args]
    line = check_one_error_line(run_here("report.py", argv))
    assert message in line, line
    assert not (run_dir / plots.RUN_PLOT).exists() and list(sweep.iterdir()) == []


def test_the_sweeps_invocations_parse_as_before(tmp_path, monkeypatch):
    """sweep_runner.py calls `report.py OUT`; the docs `report.py OUT --report-dir D` and `report.py --estimate OUT
    --steps 200 --seeds 3 [--eval-every 25]`: each reaches the same function with the same values."""
    calls = []
    monkeypatch.setattr(
        report, "write_report", lambda out, report_dir: calls.append(("report", out, report_dir)) or report_dir
    )
    monkeypatch.setattr(report, "load_runs", lambda out: ([{"run": "x"}], []))
    monkeypatch.setattr(
        report,
        "estimate_markdown",
        lambda runs, steps, seeds, every: calls.append(("estimate", steps, seeds, every)) or "",
    )
    out = tmp_path / "out"
    out.mkdir()
    for argv in ([str(out)], [str(out), "--report-dir", str(tmp_path / "r")],
                 ["--estimate", str(out), "--steps", "200", "--seeds", "3"],
                 ["--estimate", str(out), "--steps", "12", "--seeds", "1", "--eval-every", "6"]):  # fmt: skip
        report.main(argv)
    assert calls == [
        ("report", out, out / "report"),
        ("report", out, tmp_path / "r"),
        ("estimate", 200, 3, 25),
        ("estimate", 12, 1, 6),
    ]


def test_help_has_a_line_for_every_flag():
    proc = run_here("report.py", ["--help"])
    check_ok(proc)
    for flag in ("FOLDER", "--report-dir", "--estimate", "--steps", "--seeds", "--eval-every"):
        assert flag in proc.stdout, flag
    assert "curves.png" in proc.stdout


def test_the_plan_is_read_relative_to_the_sweeps_folder_wherever_it_is(tmp_path):
    """plan.tsv names each run's folder relative to the sweep's (a sweep copied elsewhere, docs/organism among them,
    reads the same); an older plan's absolute folder is read as written."""
    from study import read_runs

    out = tmp_path / "moved"
    out.mkdir()
    (out / "plan.tsv").write_text(
        "h2h\tgrpo-group\th2h/grpo-group-s1\ncritic\tppo-none\t/elsewhere/critic/ppo-none-s1\n"
    )
    assert read_runs.read_plan(out) == [
        ("h2h", "grpo-group", out / "h2h" / "grpo-group-s1"),
        ("critic", "ppo-none", Path("/elsewhere/critic/ppo-none-s1")),
    ]


def test_the_committed_organism_study_gives_its_committed_report(tmp_path, monkeypatch):
    """docs/organism holds the whole organism study (every run's results.json and metrics.jsonl, the plan, the
    preflight) and its report: report.py on it writes the same report.md and summary.csv, from the project root on
    any machine (the report's one "Written by" line carries the clock time)."""
    root = REPO
    study = root / "docs" / "organism"
    # the 18 runs x 3 seeds of the study, the crossover's 12 x 3 (GRPO at 4 G, PPO with 3 heads amortised and paid,
    # the full critic amortised, the control) and the head-to-heads of organism-wide and
    # organism-large, 5 x 3 each (GRPO at 2 G, PPO with a critic at 2 prices, the control), every one finished; the
    # curves of the four organisms
    assert len(list(study.glob("*/*-s[123]/results.json"))) == 18 * 3 + 12 * 3 + 5 * 3 + 5 * 3
    for curve in ("crossover/curve", "spread/curve-wide", "size/curve-small", "size/curve-large"):
        assert (study / curve / "curve.json").is_file(), curve
    assert not list(study.rglob("checkpoint")), "no checkpoints committed"
    monkeypatch.chdir(root)  # the report's title names the folder as given: from the project root, as documented
    check_ok(run_here("report.py", [str(study.relative_to(root)), "--report-dir", str(tmp_path)]))

    def text(folder: Path) -> list[str]:
        return [line for line in (folder / "report.md").read_text().splitlines() if not line.startswith("Written by")]

    assert text(tmp_path) == text(study / "report")
    assert (tmp_path / "summary.csv").read_text() == (study / "report" / "summary.csv").read_text()
