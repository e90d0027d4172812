"""Nothing trained on garbage, nothing lost: the finiteness guard, the run-folder lock, the leftovers of a
killed save, a finished run's resume, file-system and decoding errors, Ctrl-C during start-up.

The NaN tests poison the loss of chosen optimiser steps through a hook on the loss function (as a bf16
overflow would), in this process, and read what the run wrote."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    SMALL_RUN,
    TINY,
    check_ok,
    check_one_error_line,
    cli,
    copy_run,
    read_metrics,
    run_here,
    signal_at,
    start_trainer,
    step_rows,
    tree_digest,
)

import common
from plumbing import checkpoint, errors, logs, rundir
from study import read_runs

GRPO_TINY = dict(batch_size=2, group_size=4, micro_batch_size=4, num_minibatches=2, max_new_tokens=8)
DPO_TINY = dict(batch_size=4, samples_per_prompt=4, micro_batch_size=4, offline_prompts=8, max_new_tokens=8)
# trainer -> (flags, the loss function to poison, its optimiser steps per training step)
TRAINERS = {
    "ppo.py": (dict(task="toy", critic="small", lr=1e-3), "clipped_surrogate", 4),  # 2 epochs x 2 minibatches
    "grpo.py": (dict(task="toy", lr=1e-3, **GRPO_TINY), "clipped_surrogate", 4),
    "dpo.py": (dict(task="gsm8k", pairs="gold", lr=1e-3, **DPO_TINY), "dpo_loss", 1),
}


DPO_BASE = {k: v for k, v in TINY.items() if k not in ("num-minibatches", "mc-every")}  # flags dpo.py lacks


def args_for(script: str, run_dir: Path, **flags) -> list[str]:
    return cli(run_dir, DPO_BASE if script == "dpo.py" else None, **flags)


def poison(monkeypatch, name: str, calls: set[int]) -> None:
    """common.<name> returns a NaN loss on its calls numbered in `calls` (from 1): one micro-batch each here."""
    real = getattr(common, name)
    count = [0]

    def poisoned(*args, **kwargs):
        count[0] += 1
        out = real(*args, **kwargs)
        if count[0] in calls:
            return (out[0] * float("nan"), *out[1:])
        return out

    monkeypatch.setattr(common, name, poisoned)


def saved_weights_finite(run_dir: Path) -> bool:
    from safetensors.torch import load_file

    ckpt = run_dir / checkpoint.CHECKPOINT
    tensors = list(load_file(ckpt / "policy" / "model.safetensors").values())
    if (ckpt / "critic.safetensors").is_file():
        tensors += list(load_file(ckpt / "critic.safetensors").values())
    return all(torch.isfinite(t).all() for t in tensors)


@pytest.mark.parametrize("script", list(TRAINERS))
def test_one_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch, script):
    flags, loss_fn, per_step = TRAINERS[script]
    poison(monkeypatch, loss_fn, {per_step + 1})  # the first optimiser step of training step 2
    run_dir = tmp_path / "run"
    check_ok(run_here(script, args_for(script, run_dir, **flags, total_steps=3)))
    rows = [r for r in read_metrics(run_dir) if "nonfinite_skips" in r]
    assert [r["nonfinite_skips"] for r in rows] == [0, 1, 0], read_metrics(run_dir)
    assert saved_weights_finite(run_dir)
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 3


@pytest.mark.parametrize("script", list(TRAINERS))
def test_a_second_nonfinite_step_stops_the_run_with_exit_3(tmp_path, monkeypatch, script):
    flags, loss_fn, per_step = TRAINERS[script]
    poison(monkeypatch, loss_fn, {per_step + 1, per_step + 2})  # step 2 (dpo: steps 2 and 3)
    run_dir = tmp_path / "run"
    proc = run_here(script, args_for(script, run_dir, **flags, total_steps=4, save_every=1))
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    stop_step = 2 if per_step > 1 else 3
    assert line.startswith("error: ") and f"step {stop_step}" in line and "loss" in line, proc.stderr
    assert "Traceback" not in proc.stderr
    state = json.loads((run_dir / checkpoint.CHECKPOINT / "state.json").read_text())
    assert state["counters"]["step"] == stop_step - 1, "the last good checkpoint was replaced"
    checkpoint.verify_checkpoint(run_dir / checkpoint.CHECKPOINT)
    assert saved_weights_finite(run_dir)
    assert not (run_dir / "results.json").exists()


def test_nonfinite_weights_are_never_saved(tmp_path, monkeypatch):
    """An optimiser step that writes NaN into a weight (finite loss and gradients): the save refuses, exit 3."""
    real_step = torch.optim.AdamW.step
    count = [0]

    def bad_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        count[0] += 1
        if count[0] == 4:  # the last optimiser step of training step 1
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", bad_step)
    run_dir = tmp_path / "run"
    proc = run_here("ppo.py", cli(run_dir, **TRAINERS["ppo.py"][0], total_steps=2, save_every=1))
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "step 1" in line and "weights" in line, proc.stderr
    assert not (run_dir / checkpoint.CHECKPOINT).exists() and not (run_dir / "results.json").exists()
    assert not list(run_dir.glob(".checkpoint.*"))


def test_metrics_write_nan_as_nan_and_readers_parse_it(tmp_path):

    logger = logs.MetricsLogger(tmp_path, True)
    logger.log(1, {"reward": 0.5, "vf_loss": float("nan"), "kl": float("inf"), "none": None})
    logger.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" in text and "Infinity" in text
    (row,) = read_metrics(tmp_path)
    assert math.isnan(row["vf_loss"]) and row["kl"] == math.inf and row["none"] is None
    assert math.isnan(read_runs.read_metrics(tmp_path)[0]["vf_loss"])


# ------------------------------------------------------------------------------------------------------
# the run-folder lock
# ------------------------------------------------------------------------------------------------------

LONG_RUN = dict(task="toy", critic="small", total_steps=40)


@pytest.mark.slow
def test_a_second_trainer_on_a_live_run_folder_is_refused_naming_the_holder(tmp_path):
    """The lock is taken before the model loads: a second trainer, new or --resume, is refused while the first
    lives, naming its pid; the kernel releases it however the first ends (here SIGKILL)."""
    run_dir = tmp_path / "run"
    lock = run_dir / ".lock"
    with open(tmp_path / "first.log", "w") as log:
        proc = start_trainer("ppo.py", cli(run_dir, **LONG_RUN), log)  # its pid is in the lock
        try:
            deadline = time.time() + 300
            while not (lock.is_file() and lock.read_text().endswith("\n")) and time.time() < deadline:
                assert proc.poll() is None, (tmp_path / "first.log").read_text()
                time.sleep(0.02)
            assert json.loads(lock.read_text()) == {"pid": proc.pid, "holder": "ppo.py"}
            for script, extra in (("ppo.py", {}), ("ppo.py", {"resume": True}), ("grpo.py", {"resume": True})):
                line = check_one_error_line(run_here(script, cli(run_dir, **extra, task="toy")))
                assert f"pid {proc.pid}" in line and "ppo.py" in line and str(run_dir) in line, line
            assert proc.poll() is None, "the first run was disturbed"
        finally:
            proc.kill()
            proc.wait(timeout=60)
    with rundir.RunLock(run_dir):  # released by the kernel: taken again at once
        pass


def test_the_lock_is_released_when_the_run_ends(tmp_path):
    lock = rundir.RunLock(tmp_path)
    with lock:
        with pytest.raises(errors.UserError, match=f"pid {os.getpid()}"):
            rundir.RunLock(tmp_path).acquire()
    with rundir.RunLock(tmp_path):
        pass


# ------------------------------------------------------------------------------------------------------
# leftovers of a killed save, a finished run, a resume from the set-aside checkpoint
# ------------------------------------------------------------------------------------------------------


def killed_copy(src: Path, tmp_path: Path) -> Path:
    """The finished run as a run killed after its last save: no results.json."""
    dst = copy_run(src, tmp_path)
    (dst / "results.json").unlink()
    return dst


def test_resume_of_a_finished_run_says_so_and_touches_nothing(finished_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = tree_digest(run_dir)
    names = sorted(p.name for p in run_dir.iterdir())
    proc = run_here("ppo.py", cli(run_dir, **SMALL_RUN, resume=True))
    check_ok(proc)
    assert len(proc.stdout.strip().splitlines()) == 1 and "finished" in proc.stdout and not proc.stderr.strip()
    assert tree_digest(run_dir) == before and sorted(p.name for p in run_dir.iterdir()) == names


def test_leftovers_of_killed_saves_are_removed_at_the_next_start(finished_run, tmp_path):
    run_dir = killed_copy(finished_run, tmp_path)
    import shutil

    shutil.copytree(run_dir / checkpoint.CHECKPOINT, run_dir / ".checkpoint.tmp-12345")
    shutil.copytree(run_dir / checkpoint.CHECKPOINT, run_dir / ".checkpoint.old-23456")
    check_ok(run_here("ppo.py", cli(run_dir, **SMALL_RUN, resume=True)))
    assert not list(run_dir.glob(".checkpoint.*")), sorted(p.name for p in run_dir.iterdir())
    assert (run_dir / "results.json").is_file()


def test_only_a_set_aside_checkpoint_is_refused_unless_resume_from_backup(finished_run, tmp_path):
    run_dir = killed_copy(finished_run, tmp_path)
    (run_dir / checkpoint.CHECKPOINT).rename(run_dir / ".checkpoint.old-23456")
    before = tree_digest(run_dir)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **SMALL_RUN, resume=True)))
    assert ".checkpoint.old-23456" in line and "--resume-from-backup" in line
    assert tree_digest(run_dir) == before
    check_ok(run_here("ppo.py", cli(run_dir, **SMALL_RUN, resume=True, resume_from_backup=True)))
    assert (run_dir / checkpoint.CHECKPOINT).is_dir() and (run_dir / "results.json").is_file()
    assert not list(run_dir.glob(".checkpoint.*"))


def test_metrics_after_the_resumed_step_are_set_aside_not_dropped(finished_run, tmp_path):
    run_dir = killed_copy(finished_run, tmp_path)
    final_val = (run_dir / "metrics.jsonl").read_text().splitlines()[-1]  # logged after the last save
    assert "val/accuracy" in final_val and "reward" not in final_val
    later = json.dumps({"step": 2, "reward": -1.0}) + "\n" + '{"step": 3, "rew'
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(later)
    check_ok(run_here("ppo.py", cli(run_dir, **SMALL_RUN, resume=True)))
    assert [r["step"] for r in step_rows(run_dir)] == [1]
    (aside,) = run_dir.glob("metrics.jsonl.discarded-*")
    assert aside.read_text().strip() == (final_val + "\n" + later).strip()
    assert sum("val/accuracy" in r for r in read_metrics(run_dir)) == 1, "the final validation row logged twice"


# ------------------------------------------------------------------------------------------------------
# file-system and decoding errors, Ctrl-C during start-up
# ------------------------------------------------------------------------------------------------------


def test_a_run_dir_that_is_a_file_is_one_error_line(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a folder")
    line = check_one_error_line(run_here("ppo.py", cli(path, **SMALL_RUN)))
    assert str(path) in line and "not a folder" in line
    assert path.read_text() == "not a folder"


def test_an_unwritable_run_dir_is_one_error_line(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere chmod allows nothing; /sys refuses a new folder to root too
        path = Path("/sys/rlvr-test-run")
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        path = tmp_path / "ro" / "run"
    proc = run_here("ppo.py", cli(path, **SMALL_RUN))
    line = check_one_error_line(proc)
    assert str(path) in line and proc.returncode == 2


def test_a_train_file_that_is_not_utf8_is_one_error_line(tmp_path, gsm8k_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_bytes((gsm8k_dir / "test.jsonl").read_bytes())
    (data / "train.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    line = check_one_error_line(run_here("ppo.py", cli(tmp_path / "run", **SMALL_RUN, data_dir=data)))
    assert str(data / "train.jsonl") in line and "UTF-8" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("at", ["gsm8k.load_gsm8k:1", "plumbing.models.load_model:1"])  # the run folder exists by then
def test_ctrl_c_during_start_up_leaves_no_traceback_and_no_run_folder(tmp_path, at):
    # the SIGINT comes at a known point of start-up (the process sends it itself: tests/signal_at), not when a
    # poll sees the run folder: on a busy machine the poll saw it only once the stop signal was installed, and
    # the run then finished its one step and exited 0
    run_dir = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        proc = start_trainer(
            "ppo.py", cli(run_dir, **SMALL_RUN), log, signal_at(at, tmp_path / "signal.log", name="SIGINT")
        )
        try:
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = (tmp_path / "log").read_text()
    assert "signal" in (tmp_path / "signal.log").read_text(), "the signal was never sent"
    assert rc == 130 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1].startswith("error: interrupted"), out
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
