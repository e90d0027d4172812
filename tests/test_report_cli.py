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
    assert len(list(study.glob("*/*-s[123]/results.json"))) == 54, "the 18 runs x 3 seeds, every one finished"
    assert not list(study.rglob("checkpoint")), "no checkpoints committed"
    monkeypatch.chdir(root)  # the report's title names the folder as given: from the project root, as documented
    check_ok(run_here("report.py", [str(study.relative_to(root)), "--report-dir", str(tmp_path)]))

    def text(folder: Path) -> list[str]:
        return [line for line in (folder / "report.md").read_text().splitlines() if not line.startswith("Written by")]

    assert text(tmp_path) == text(study / "report")
    assert (tmp_path / "summary.csv").read_text() == (study / "report" / "summary.csv").read_text()
