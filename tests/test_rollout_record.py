"""A trainer's results.json and the first line of its metrics.jsonl name the rollout backend it actually ran
and every fallback with its reason (generation.rollout_record), so a slow run is never read as a slow method."""

from __future__ import annotations

import json

from study import report


def test_results_and_first_metrics_row_name_the_rollout_backend(finished_run):
    results = json.loads((finished_run / "results.json").read_text())
    assert results["rollout_backend"] == "static"  # generation.generate's "auto": the engine, on the CPU too
    assert results["rollout_fallbacks"] == []
    rows = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rollout_backend"] == "static" and rows[0]["rollout_fallbacks"] == []
    assert all("rollout_backend" not in r for r in rows[1:])  # the first line only


def test_report_has_a_rollout_column_with_the_fallbacks(tmp_path):

    def write(name: str, extra: dict) -> None:
        run_dir = tmp_path / "h2h" / name
        run_dir.mkdir(parents=True)
        res = {"method": "grpo", "critic": "group", "seed": 1, "steps": 1, "generated_tokens": 10,
               "test": {"accuracy": 0.1, "n": 10, "ci95": [0.0, 0.2]}, **extra}  # fmt: skip
        (run_dir / "results.json").write_text(json.dumps(res))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")

    fell = {"what": "cuda_graph", "kind": "error", "reason": "CUDA graph capture failed: RuntimeError: x"}
    write("grpo-group-s1", {"rollout_backend": "static", "rollout_fallbacks": [fell]})
    write("ppo-none-s1", {"method": "ppo", "critic": "none"})  # a run from before the record
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    # the compute table: each run's budget and what its rollouts ran on (the results table comes first)
    lines = md.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| experiment") and "| update FLOPs |" in line)
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    table = lines[first:end]
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]  # noqa: E731
    rollout = cells(table[0]).index("rollout")
    by_run = {cells(line)[1]: cells(line)[rollout] for line in table[2:]}
    assert by_run["grpo-group"] == "static (fell back: cuda_graph)"
    assert by_run["ppo-none"] == "-"
