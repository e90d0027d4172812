"""A run knows its data: the fingerprint of train, val and test (counts and SHA-256) in the
checkpoint and results.json with the folder actually read; a resume on changed data refused in one line naming
the split unless --allow-data-change; report.md naming the runs of one experiment that used different data.
Synthetic GSM8K folders (150 train, 20 test problems) and the tiny model at one step."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from helpers import SMALL_RUN, check_ok, check_one_error_line, cli, run_here

import dpo
import grpo
import gsm8k
import ppo
from plumbing import checkpoint
from study import report

RUN = {**SMALL_RUN, "val_size": 4}


def _problem(i: int) -> str:
    return json.dumps({"question": f"Tom has {i} apples and buys 1. How many now?", "answer": f"{i} + 1\n#### {i + 1}"})


def _gsm8k(folder: Path, train: int = 150, test: int = 20) -> Path:
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text("".join(_problem(i) + "\n" for i in range(train)))
    (folder / "test.jsonl").write_text("".join(_problem(1000 + i) + "\n" for i in range(test)))
    return folder


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One finished step on a synthetic folder given through GSM8K_DIR (no --data-dir): (run folder, data)."""
    tmp = tmp_path_factory.mktemp("fingerprint")
    data = _gsm8k(tmp / "gsm8k")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GSM8K_DIR", str(data))
        check_ok(run_here("ppo.py", cli(tmp / "run", **RUN)))
    return tmp / "run", data


def _copy(first_run, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """The finished run and its data copied, GSM8K_DIR pointing at the copy, the results removed so that the
    resume is what writes them."""
    run_dir, data = shutil.copytree(first_run[0], tmp_path / "run"), shutil.copytree(first_run[1], tmp_path / "gsm8k")
    monkeypatch.setenv("GSM8K_DIR", str(data))
    (run_dir / "results.json").unlink()
    return Path(run_dir), Path(data)


def _resume(run_dir: Path, **flags):
    """--resume of the finished step (killed, say, before its results were written): the evaluation again."""
    return run_here("ppo.py", cli(run_dir, **RUN, resume=True, **flags))


def test_results_and_checkpoint_carry_the_fingerprint_and_the_folder_read(first_run):
    run_dir, data = first_run
    results = json.loads((run_dir / "results.json").read_text())
    assert results["args"]["data_dir"] is None  # as given: the folder came from GSM8K_DIR
    expected = gsm8k.data_fingerprint(gsm8k.load_gsm8k(str(data), val_size=4))
    assert expected["train"]["n"] == 146 and expected["val"]["n"] == 4 and expected["test"]["n"] == 20
    assert results["data"] == {"folder": str(data.resolve()), **expected}
    state = json.loads((run_dir / checkpoint.CHECKPOINT / "state.json").read_text())
    assert state["data"] == results["data"]


def test_the_fingerprint_changes_with_any_problem_and_with_the_order():
    ps = [gsm8k.Problem(f"q{i}", f"a{i} #### {i}", str(i)) for i in range(5)]
    fp = gsm8k.data_fingerprint({"train": ps})["train"]
    assert fp["n"] == 5 and len(fp["sha256"]) == 64
    assert gsm8k.data_fingerprint({"train": list(ps)})["train"] == fp
    edited = [*ps[:2], gsm8k.Problem("q2", "a2 #### 3", "3"), *ps[3:]]
    assert gsm8k.data_fingerprint({"train": edited})["train"]["sha256"] != fp["sha256"]
    assert gsm8k.data_fingerprint({"train": ps[::-1]})["train"]["sha256"] != fp["sha256"]
    joined = [gsm8k.Problem("q0a", "0 #### 0", "0")]  # the same characters split differently
    assert gsm8k.data_fingerprint({"train": joined}) != gsm8k.data_fingerprint(
        {"train": [gsm8k.Problem("q0", "a0 #### 0", "0")]}
    )


def test_a_resume_on_train_data_with_100_lines_removed_is_refused_naming_train(first_run, tmp_path, monkeypatch):
    run_dir, data = _copy(first_run, tmp_path, monkeypatch)
    lines = (data / "train.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:-100]))
    line = check_one_error_line(_resume(run_dir))
    assert "train" in line and "146 -> 46" in line and "--allow-data-change" in line, line
    assert not (run_dir / "results.json").exists()


def test_a_resume_with_one_test_answer_changed_is_refused_naming_test(first_run, tmp_path, monkeypatch):
    run_dir, data = _copy(first_run, tmp_path, monkeypatch)
    lines = (data / "test.jsonl").read_text().splitlines(keepends=True)
    lines[3] = json.dumps({"question": json.loads(lines[3])["question"], "answer": "changed\n#### 7"}) + "\n"
    (data / "test.jsonl").write_text("".join(lines))
    line = check_one_error_line(_resume(run_dir))
    assert "the test split changed" in line and "test 20 -> 20 problems, same count" in line, line
    assert "train" not in line.split("(")[0], line

    # --allow-data-change lets it through, and the new fingerprint is recorded in the checkpoint and the results
    proc = _resume(run_dir, allow_data_change=True)
    check_ok(proc)
    assert "--allow-data-change: resuming on changed data (test 20 -> 20" in proc.stdout
    new = gsm8k.data_fingerprint(gsm8k.load_gsm8k(str(data), val_size=4))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 1 and results["data"]["test"] == new["test"]
    assert results["data"]["test"] != json.loads((first_run[0] / "results.json").read_text())["data"]["test"]
    state = json.loads((run_dir / checkpoint.CHECKPOINT / "state.json").read_text())
    assert state["data"]["test"] == new["test"]


def test_a_checkpoint_from_before_fingerprints_resumes_with_a_notice(first_run, tmp_path, monkeypatch):
    from test_checkpoint import rehash

    run_dir, _ = _copy(first_run, tmp_path, monkeypatch)
    ckpt = run_dir / checkpoint.CHECKPOINT
    state = json.loads((ckpt / "state.json").read_text())
    del state["data"]
    (ckpt / "state.json").write_text(json.dumps(state))
    args = json.loads((ckpt / "args.json").read_text())
    del args["allow_data_change"]  # nor the flag
    (ckpt / "args.json").write_text(json.dumps(args))
    rehash(ckpt)
    proc = _resume(run_dir)
    check_ok(proc)
    assert "records no data fingerprint" in proc.stdout
    assert "data" in json.loads((run_dir / "results.json").read_text())


def test_allow_data_change_is_one_shared_flag_in_the_three_trainers():
    fields = [{f.name: f for f in dataclasses.fields(m.Args)}["allow_data_change"] for m in (ppo, grpo, dpo)]
    assert all(f.default is False and f.type in (bool, "bool") for f in fields)
    assert "allow_data_change" in checkpoint.RESUMABLE_ARGS  # a resume may add it without differing in essentials


def test_report_names_the_runs_of_one_experiment_that_used_different_data(first_run, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    same, other = out / "h2h" / "ppo-small-s1", out / "h2h" / "ppo-small-s2"
    shutil.copytree(first_run[0], same)
    shutil.copytree(first_run[0], other)
    results = json.loads((other / "results.json").read_text())
    results["seed"] = 2
    results["data"]["train"] = {"n": 46, "sha256": "f" * 64}  # as if run on the folder with 100 lines removed
    (other / "results.json").write_text(json.dumps(results))
    text = report.write_report(out, out / "report").read_text()
    lines = [line for line in text.splitlines() if "used different data" in line]
    assert len(lines) == 1 and "h2h" in lines[0], text[:2000]
    assert "ppo-small-s1 (train 146" in lines[0] and "ppo-small-s2 (train 46" in lines[0], lines[0]
    assert not report.data_differences([r for r in report.load_runs(out)[0] if r["seed"] == 1])
