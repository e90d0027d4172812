"""Where a run's numbers go besides metrics.jsonl: TensorBoard scalars always (tensorboard is in requirements.txt),
Weights & Biases with --track (offline here: WANDB_MODE=offline), the same flag in all three trainers; wandb is
imported only under --track, and --track without it is one line."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import TINY, check_ok, check_one_error_line, cli, read_metrics, run_here

from plumbing import logs

DPO_BASE = {k: v for k, v in TINY.items() if k not in ("num-minibatches", "mc-every")}  # flags dpo.py has not
RUNS = {  # one step of each trainer on the toy task (the TensorBoard test: two of PPO)
    "ppo.py": (TINY, dict(task="toy", critic="small", total_steps=1)),
    "grpo.py": (TINY, dict(task="toy", batch_size=2, group_size=4, total_steps=1)),
    "dpo.py": (DPO_BASE, dict(task="toy", pairs="self", online=True, batch_size=2, samples_per_prompt=4,
                              micro_batch_size=2, total_steps=1)),
}  # fmt: skip


def scalar_rows(run_dir) -> dict[int, dict[str, float]]:
    """metrics.jsonl's numbers by step (logs.metric_scalars), later rows of a step merged in."""
    out: dict[int, dict[str, float]] = {}
    for row in read_metrics(run_dir):
        out.setdefault(row["step"], {}).update(logs.metric_scalars(row))
    return out


def test_tensorboard_gets_every_scalar_of_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    check_ok(run_here("ppo.py", cli(run_dir, **{**RUNS["ppo.py"][1], "total_steps": 2})))
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    want = scalar_rows(run_dir)
    tags = set(events.Tags()["scalars"])
    assert {"reward", "kl_ref", "val/accuracy", "generated_tokens"} <= tags
    for tag in tags:
        logged = {e.step: e.value for e in events.Scalars(tag)}
        assert logged == {s: pytest.approx(r[tag], rel=1e-6, nan_ok=True) for s, r in want.items() if tag in r}, tag


@pytest.mark.parametrize("script", list(RUNS))
def test_track_logs_every_row_to_wandb_offline(tmp_path, monkeypatch, script):
    wandb = pytest.importorskip("wandb")  # in requirements.txt: CI has it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged: list[tuple[int, dict]] = []
    inits = []
    real_init = wandb.init

    def init(**kwargs):  # the real offline run, its log calls recorded on the way
        run = real_init(**kwargs)
        real_log = run.log
        inits.append(kwargs)
        monkeypatch.setattr(
            run, "log", lambda data, step: logged.append((step, dict(data))) or real_log(data, step=step)
        )
        return run

    monkeypatch.setattr(wandb, "init", init)
    run_dir = tmp_path / "run"
    base, flags = RUNS[script]
    check_ok(run_here(script, cli(run_dir, base, **flags, track=True, wandb_project="rlvr-test")))
    (kw,) = inits
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    assert kw["project"] == "rlvr-test" and kw["id"] == run_id and kw["name"] == "run"
    assert kw["config"]["track"] is True and kw["config"]["run_dir"] == str(run_dir)
    assert logged and {s for s, _ in logged} == set(scalar_rows(run_dir))
    merged: dict[int, dict] = {}
    for step, data in logged:
        merged.setdefault(step, {}).update(data)
    assert json.dumps(merged, sort_keys=True) == json.dumps(scalar_rows(run_dir), sort_keys=True)
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")  # what `wandb sync` uploads
    data = offline.read_bytes()
    assert all(key.encode() in data for key in merged[1])


def test_without_track_wandb_is_never_imported_and_track_without_it_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as when it is not installed
    check_ok(run_here("ppo.py", cli(tmp_path / "plain", **RUNS["ppo.py"][1])))
    assert not (tmp_path / "plain" / "wandb").exists()
    for script in RUNS:
        run_dir = tmp_path / script
        base, flags = RUNS[script]
        line = check_one_error_line(run_here(script, cli(run_dir, base, **flags, track=True)))
        assert "--track" in line and "pip install wandb" in line, line
        assert not run_dir.exists()
