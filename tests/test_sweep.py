"""sweep.sh and report.py end to end on the CPU: the smoke sweep and its report, dry runs, bad input, a second
invocation, an interrupted, a failed and a damaged run on the GPU pool, and SLURM submission (a stand-in sbatch).

The smoke sweep runs once per session (about two minutes on 2 cores); the other tests copy what they change.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, check_ok, check_one_error_line, run_here, run_sweep, trainer_env, tree_digest

import intervals
import measure
from plumbing import checkpoint, rundir
from study import report, sweep_runner

CRITICS = ["none", "small", "medium", "large", "full"]
EXPECTED = {
    "critic": [f"ppo-{c}" for c in CRITICS],
    "h2h": ["grpo-group", "grpo-group-unscaled", *[f"ppo-{c}" for c in CRITICS], "dpo-gold-online", "dpo-gold-offline"],
    "labels": ["dpo-self-offline", "dpo-self-online", "dpo-gold-offline", "dpo-gold-online"],
}
N_RUNS = sum(len(v) for v in EXPECTED.values())  # 18 per seed
PNGS = ["crossover.png", "curves.png", "errors.png"]


def sweep(*args: str | Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """./sweep.sh ARGS from the repository root, with this interpreter as the trainers' python (helpers.run_sweep)."""
    return run_sweep(*args, env=env, timeout=timeout)


def check_report(report: Path, runs: int) -> None:
    """report.md, the two CSVs and the three PNGs exist and are not empty; a table row for every run."""
    md = (report / "report.md").read_text()
    for experiment, names in EXPECTED.items():
        for name in names:
            assert f"| {experiment} | {name} |" in md, f"no table row for {experiment}/{name}"
    with open(report / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == runs
    with open(report / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == N_RUNS  # one row per experiment and run, whatever the seeds
    for name in PNGS:
        data = (report / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, f"{name} is empty or not a PNG"
        assert f"![{name}]({name})" in md


@pytest.fixture
def smoke(smoke_sweep) -> tuple[Path, subprocess.CompletedProcess, float]:
    """The session's smoke sweep (conftest.smoke_sweep): read it, copy what you change."""
    return smoke_sweep


def test_the_smoke_sweep_finishes_every_run_and_writes_the_report(smoke):
    out, proc, seconds = smoke
    assert seconds < 600, f"the smoke sweep took {seconds:.0f} s"
    assert f"sweep: {N_RUNS} of {N_RUNS} runs finished" in proc.stdout
    cores = len(os.sched_getaffinity(0))  # what nproc says, OMP_NUM_THREADS aside
    assert ("2 runs at once on the CPU" in proc.stdout) == (cores >= 2), "--smoke runs one run per core, two at most"
    for experiment, names in EXPECTED.items():
        for name in names:
            res = rundir.read_results(out / experiment / f"{name}-s1" / "results.json")
            assert f"{res['method']}-{res.get('variant', res.get('critic'))}" == name and res["seed"] == 1
            if res["method"] == "grpo":  # the head-to-head's two GRPO arms: with and without the std division
                assert res["args"]["scale_rewards"] == ("none" if name == "grpo-group-unscaled" else "group")
            assert res["args"]["model"] == "tiny" and res["scaled_down"] == []
    check_report(out / "report", N_RUNS)
    plan = [line.split("\t") for line in (out / "plan.tsv").read_text().splitlines()]
    assert len(plan) == N_RUNS and all(not Path(folder).is_absolute() for _, _, folder in plan)  # copied, it reads
    # the preflight ran first (the toy task passes it) and opens the report; every measurement counts its signal
    # (a cold cache's one-time GGUF conversion notice may come before it: the tiny model borrows SmolLM2's tokenizer)
    lines = [x for x in proc.stdout.splitlines() if not x.startswith(("converting ", "the cached conversion "))]
    assert lines[0].startswith("preflight: tiny on toy") and "enough signal" in proc.stdout
    assert (out / "report" / "report.md").read_text().splitlines()[2].startswith("**Preflight** (preflight.json")
    rows = [json.loads(x) for x in (out / "h2h" / "grpo-group-s1" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["mc/informative_states"] <= r["mc/states"] for r in rows if "mc/states" in r)


def test_the_head_to_head_is_matched_in_generated_tokens(smoke):
    out, proc, _ = smoke
    ref = rundir.read_results(out / "h2h" / "grpo-group-s1" / "results.json")
    budget = ref["generated_tokens"]
    assert budget > 0 and f"{budget:,} generated tokens" in (out / "report" / "report.md").read_text()
    for name in EXPECTED["h2h"][1:]:
        res = rundir.read_results(out / "h2h" / f"{name}-s1" / "results.json")
        assert res["args"]["token_budget"] == budget, name
        assert res["generated_tokens"] >= budget, f"{name}: the step cap, not the budget, ended it"
        if name != "dpo-gold-offline":  # offline DPO trains for the reference's steps; the others until the budget
            assert res["args"]["total_steps"] == 10 * ref["steps"]
            assert res["steps"] < res["args"]["total_steps"]


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py", "dpo.py"])
def test_a_budget_matched_runs_cosine_schedule_ends_with_its_budget(tmp_path, script):
    """The head-to-head's runs stop on --token-budget under a step cap of 10x GRPO's steps. Their learning rate
    follows the budget: after each step it is the cosine of the share of the budget spent (generated_tokens / budget),
    and 0 once it is spent, not the start of a cosine stretched over the cap."""
    budget, lr = 200, 1e-5
    flags = ["--model", "tiny", "--batch-size", "4", "--max-new-tokens", "16", "--micro-batch-size",
             "4", "--eval-every", "0", "--eval-size", "4", "--test-size", "4", "--eval-max-new-tokens", "4",
             "--token-budget", str(budget), "--total-steps", "40", "--lr", str(lr), "--lr-schedule", "cosine",
             "--run-dir", str(tmp_path / "run"), "--no-progress"]  # fmt: skip
    flags += {"grpo.py": ["--task", "toy", "--group-size", "2", "--num-minibatches", "2", "--mc-every", "0"],
              "ppo.py": ["--task", "toy", "--num-minibatches", "2", "--mc-every", "0"],
              "dpo.py": ["--online", "--pairs", "gold", "--samples-per-prompt", "2"]}[script]  # fmt: skip
    check_ok(run_here(script, flags))
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "lr" in r]
    assert 2 <= len(rows) < 40 and rows[-1]["generated_tokens"] >= budget > rows[-2]["generated_tokens"]
    for r in rows:
        share = min(1.0, r["generated_tokens"] / budget)
        assert r["lr"] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * share)), rel=1e-6, abs=1e-15), r
    assert rows[-1]["lr"] == pytest.approx(0.0, abs=1e-15)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_second_invocation_skips_finished_runs(smoke):
    out, _, _ = smoke
    before = {p: p.stat().st_mtime_ns for p in (out / "labels").glob("*/results.json")}
    proc = sweep("--smoke", "--out", out, "--experiments", "labels")
    check_ok(proc)
    assert proc.stdout.count("skip  labels/") == 4 and "run   " not in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_a_dry_run_and_bad_input_load_no_torch(tmp_path):
    """The sweep's runner reads results.json and finds checkpoints through plumbing/rundir.py, so that a dry run
    answers at once: torch (a second or more to import) is for the trainers it starts. A refusal stops before the
    runs' states are read; it is checked too, as a guard. Seen through `python -X importtime`, whose report names
    every module the process loaded."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -X importtime "$@"\n')
    wrapper.chmod(0o755)
    for args, code in ((["--dry-run"], 0), (["--experiments", "nosuch"], 2)):
        proc = run_sweep(*args, "--out", tmp_path / "out", env={"PYTHON": str(wrapper)})
        assert proc.returncode == code, proc.stderr[-2000:]
        loaded = {
            line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")
        }
        assert "plumbing.rundir" in loaded, proc.stderr[-2000:]  # the runner ran (a module run by -m is not listed)
        assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}, (args, proc.returncode)
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_every_command_and_the_budget_symbolically(tmp_path):
    out = tmp_path / "out"
    proc = sweep("--dry-run", "--out", out, "--seeds", "1,2")
    check_ok(proc)
    commands = [line for line in proc.stdout.splitlines() if ".py --run-dir " in line]
    assert len(commands) == 2 * N_RUNS
    for seed in (1, 2):
        for experiment, names in EXPECTED.items():
            for name in names:
                assert any(f"--run-dir {out}/{experiment}/{name}-s{seed} " in c for c in commands), (experiment, name)
        ref = out / "h2h" / f"grpo-group-s{seed}"
        budgeted = [c for c in commands if f"--token-budget <generated_tokens of {ref}>" in c]
        assert len(budgeted) == 8  # GRPO without the std division, five PPO critics, DPO online and offline
    assert not out.exists()  # a dry run creates nothing


def test_dry_run_shows_the_budget_once_the_reference_run_exists(smoke, tmp_path):
    out, _, _ = smoke
    new = tmp_path / "out"
    shutil.copytree(out / "h2h" / "grpo-group-s1", new / "h2h" / "grpo-group-s1")
    budget = rundir.read_results(new / "h2h" / "grpo-group-s1" / "results.json")["generated_tokens"]
    proc = sweep("--smoke", "--dry-run", "--out", new, "--experiments", "h2h")
    check_ok(proc)
    assert "# h2h/grpo-group-s1: finished" in proc.stdout
    assert proc.stdout.count(f"--token-budget {budget} ") == 8


def test_the_organism_study_is_the_plan_on_the_organism_two_runs_at_once_each_on_one_thread(tmp_path, monkeypatch):
    """--organism: every run of the default experiments on --model organism at --scale cpu (the trainers' organism
    presets), seeds 1, 2, 3, two jobs, the preflight on its own prompt count; the folder runs/organism unless given."""
    out = tmp_path / "out"
    proc = sweep("--organism", "--dry-run", "--out", out)
    check_ok(proc)
    commands = [line for line in proc.stdout.splitlines() if ".py --run-dir " in line]
    assert len(commands) == 3 * N_RUNS
    assert all(" --model organism --scale cpu --no-progress" in c for c in commands)
    pre = sweep("--organism", "--preflight", "--dry-run", "--out", out)
    check_ok(pre)
    assert f"--prompts {sweep_runner.ORGANISM_PREFLIGHT_PROMPTS} " in pre.stdout and "--model organism" in pre.stdout
    o = sweep_runner.parse_args(["--organism", "--default-experiments", "h2h,critic"], ["h2h", "critic", "labels"])
    assert (o.model, o.scale, o.jobs, o.seeds) == ("organism", "cpu", min(2, len(os.sched_getaffinity(0))), [1, 2, 3])
    assert o.out == Path("runs/organism").absolute()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert sweep_runner.run_env(o)["OMP_NUM_THREADS"] == "1"  # each run on one thread
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert sweep_runner.run_env(o)["OMP_NUM_THREADS"] == "2"  # unless the environment says otherwise


def test_the_moves_experiments_run_each_organism_and_smoke_runs_the_tiny_model(tmp_path):
    """spread and size: a curve per named organism (its line's --model, after the sweep's); under --smoke a line's
    own --model gives way to the tiny one (no organism is built by a smoke run)."""
    out = tmp_path / "out"
    proc = sweep("--organism", "--dry-run", "--out", out, "--experiments", "spread,size")
    check_ok(proc)
    steps = [line for line in proc.stdout.splitlines() if "-m study.pretrain_critic" in line]
    for name in ("organism-wide", "organism-small", "organism-large"):
        (line,) = [x for x in steps if f"--model {name} " in x]
        assert line.index("--model organism ") < line.index(f"--model {name} ")  # the line's own: last, so it wins
    # the head-to-head where G* was measured: GRPO at two G (batch x G = 256), PPO with the organism's own curve's
    # critic at both prices, at the tokens of the same seed's GRPO run at the larger G
    runs = [line for line in proc.stdout.splitlines() if ".py --run-dir " in line]
    for experiment, organism, groups, critic, budget in [
        ("spread", "organism-wide", (2, 4), "large", "grpo-group-g4"),
        ("size", "organism-large", (4, 8), "small", "grpo-group"),
    ]:
        mine = [x for x in runs if f"--run-dir {out}/{experiment}/" in x]
        assert len(mine) == 3 * 5 and all(f"--model {organism} " in x for x in mine)
        for g in groups:
            assert sum(f"--group-size {g} --batch-size {256 // g} " in x for x in mine) == 3
        ppo = [x for x in mine if x.startswith(".venv/bin/python ppo.py") or " ppo.py " in x]
        assert len(ppo) == 9 and sum("--count-critic-init-tokens" in x for x in ppo) == 3
        init = (
            f"--critic {critic} --critic-init {out}/{experiment}/curve-{organism.split('-')[1]}/critic-{critic}-n4096"
        )
        assert sum(init in x for x in ppo) == 6 and sum("--critic none --token-budget" in x for x in ppo) == 3
        for seed in (1, 2, 3):
            assert all(
                f"<generated_tokens of {out}/{experiment}/{budget}-s{seed}>" in x for x in ppo if f"-s{seed} " in x
            )
    smoke = sweep("--smoke", "--dry-run", "--out", out, "--experiments", "spread,size")
    check_ok(smoke)
    assert "organism-" not in smoke.stdout and smoke.stdout.count("--model tiny") >= 3


def test_critic_lambda_is_an_optional_arm_at_lambda_095(tmp_path):
    out = tmp_path / "out"
    default = sweep("--dry-run", "--out", out, "--seeds", "1")
    check_ok(default)
    assert "--lam" not in default.stdout and "/critic-lambda/" not in default.stdout  # off by default
    proc = sweep("--dry-run", "--out", out, "--seeds", "1,2", "--experiments", "critic-lambda")
    check_ok(proc)
    commands = [line for line in proc.stdout.splitlines() if ".py --run-dir " in line]
    assert len(commands) == 2 * 4  # small, medium, large, full: per seed
    for c in ["small", "medium", "large", "full"]:
        for seed in (1, 2):
            (line,) = [x for x in commands if f"--run-dir {out}/critic-lambda/ppo-{c}-s{seed} " in x]
            assert "ppo.py --run-dir" in line and f"--critic {c} --mc-states 2 --lam 0.95" in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--experiments", "critic,bogus"], "unknown experiment 'bogus'"),
        (["--seeds", ""], "--seeds is empty"),
        (["--seeds", ","], "--seeds is empty"),
        (["--seeds", "1,x"], "'x' is not a seed"),
        (["--launcher", "cloud"], "invalid choice 'cloud' for argument '--launcher'"),
        (["--scale", "huge"], "invalid choice 'huge' for argument '--scale'"),
        (["--gpus", "0"], "--gpus 0 is not a positive number"),
        (["--gpus", "two"], "--gpus"),
        (["--jobs", "0"], "--jobs 0 is not a positive number"),
        (["--jobs", "2", "--launcher", "slurm"], "--jobs runs several runs at once on the CPU"),
        (["--preflight-prompts", "0"], "--preflight-prompts 0 is not a positive number"),
        (["--bogus"], "Unrecognized options: --bogus"),
        (["--dry-run=yes"], "Unrecognized options: yes"),  # a switch takes no value
        (["--out"], "Missing value for argument '--out'"),
        (["--organism", "--smoke"], "--organism is its own sweep"),
        (["--organism", "--model", "tiny"], "drop --smoke, --model, --scale, --gpus, --launcher"),
        (["--organism", "--gpus", "2"], "--organism is its own sweep, on this CPU"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_created(tmp_path, args, message):
    """tyro's refusals (a bad choice, an unknown flag, a missing value) and the sweep's own checks alike: one
    `error:` line, exit 2, before anything is written."""
    out = tmp_path / "out"
    proc = sweep("--out", out, *args) if args != ["--out"] else sweep(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert not out.exists()


def test_the_flags_after_dashes_go_last_to_every_trainer_and_never_to_the_sweep(tmp_path):
    """`--` ends the sweep's options: what follows goes, as given, at the end of every trainer's command (a flag the
    sweep also has, --seeds, included); --sbatch takes a value that starts with a dash, in either spelling."""
    out = tmp_path / "out"
    proc = sweep(
        "--dry-run", "--out", out, "--seeds", "1", "--experiments", "labels", "--", "--lr", "2e-6", "--seeds", "9"
    )
    check_ok(proc)
    commands = [line for line in proc.stdout.splitlines() if ".py --run-dir " in line]
    assert len(commands) == 4 and all(c.endswith(" --lr 2e-6 --seeds 9") for c in commands), commands
    assert "seeds 1," in proc.stdout and "-s9" not in proc.stdout  # the sweep's own seeds
    for sbatch in (["--sbatch", "--partition=gpu --time=1:00:00"], ["--sbatch=--partition=gpu --time=1:00:00"]):
        proc = sweep("--dry-run", "--launcher", "slurm", "--out", out, "--experiments", "labels", *sbatch)
        check_ok(proc)
        assert " --partition=gpu --time=1:00:00 --job-name=sweep " in proc.stdout, proc.stdout
    assert not out.exists()


def test_damaged_interrupted_and_failed_runs_on_the_gpu_pool(smoke, tmp_path):
    """A damaged results.json is named, kept aside and its run redone; an interrupted run resumes; a run that
    fails is recorded and named while the others go on; a finished run is left alone. On the GPU pool (--gpus 2
    on a machine without GPUs: the slots 0 and 1 are still handed out, and the CPU ignores them)."""
    out, _, _ = smoke
    new = tmp_path / "out"
    shutil.copytree(out / "labels", new / "labels")
    runs = new / "labels"
    damaged = runs / "dpo-gold-online-s1" / "results.json"
    damaged.write_text('{"method": "dpo", "test": {"accuracy": 0.')  # cut short
    (runs / "dpo-self-online-s1" / "results.json").unlink()  # interrupted after its last checkpoint
    failing = runs / "dpo-gold-offline-s1"
    (failing / "results.json").unlink()
    (failing / checkpoint.CHECKPOINT / "manifest.json").write_text("{")  # its checkpoint refuses to load
    untouched = tree_digest(runs / "dpo-self-offline-s1")

    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    pool = {"CUDA_VISIBLE_DEVICES": "", "PATH": path}
    proc = sweep("--smoke", "--gpus", "2", "--out", new, "--experiments", "labels", env=pool)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "one run per GPU on GPUs 0 1" in proc.stdout
    assert "on GPU 0 (resuming" in proc.stdout and "on GPU 1 (resuming" in proc.stdout
    # the damaged file: one line naming it, kept aside as it was, the run redone
    named = [line for line in proc.stderr.splitlines() if str(damaged) in line]
    assert len(named) == 1 and "damaged" in named[0], proc.stderr
    aside = list(damaged.parent.glob("results.json.damaged-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"method": "dpo", "test": {"accuracy": 0.'
    assert rundir.read_results(damaged)["variant"] == "gold-online"
    # the interrupted run resumed from its checkpoint
    assert re.search(r"labels/dpo-self-online-s1 on GPU \d \(resuming from its checkpoint\)", proc.stdout)
    assert (runs / "dpo-self-online-s1" / "results.json").is_file()
    # the failed run: recorded, named in the summary and the report, its checkpoint left as it was
    assert "FAIL  labels/dpo-gold-offline-s1" in proc.stdout
    assert "unfinished: labels/dpo-gold-offline-s1 (exit 2;" in proc.stdout
    assert (failing / checkpoint.CHECKPOINT / "manifest.json").read_text() == "{"
    assert (new / "logs" / "labels" / "dpo-gold-offline-s1.status").read_text().startswith("failed 2")
    md = (new / "report" / "report.md").read_text()
    assert "labels/dpo-gold-offline-s1: failed (exit 2;" in md
    # the finished run was skipped
    assert "skip  labels/dpo-self-offline-s1" in proc.stdout
    assert tree_digest(runs / "dpo-self-offline-s1") == untouched


def test_report_on_existing_runs(smoke, tmp_path):
    out, _, _ = smoke
    report = tmp_path / "report"
    proc = run_here("report.py", [str(out), "--report-dir", str(report)])  # in this process: the imports paid once
    check_ok(proc)
    check_report(report, N_RUNS)
    md = (report / "report.md").read_text()
    assert "nmse" in md and "noise-corrected" in md and "python report.py --estimate" in md

    est = run_here("report.py", ["--estimate", str(out), "--steps", "200", "--seeds", "3"])
    check_ok(est)
    assert "**Total:" in est.stdout and est.stdout.count("| h2h |") == len(EXPECTED["h2h"])


def test_report_names_a_damaged_results_json_and_skips_it(smoke, tmp_path):
    out, _, _ = smoke
    new = tmp_path / "out"
    shutil.copytree(out / "critic" / "ppo-none-s1", new / "critic" / "ppo-none-s1")
    shutil.copytree(out / "critic" / "ppo-small-s1", new / "critic" / "ppo-small-s1")
    bad = new / "critic" / "ppo-small-s1" / "results.json"
    bad.write_text("[]")
    proc = run_here("report.py", [str(new)])
    check_ok(proc)
    md = (new / "report" / "report.md").read_text()
    assert f"{bad} is damaged" in md and "| critic | ppo-none |" in md and "| critic | ppo-small |" not in md
    assert bad.read_text() == "[]"  # the report reads; only the sweep sets files aside


@pytest.mark.slow
def test_slurm_submits_one_array_task_per_run(tmp_path):
    """A stand-in sbatch records its calls; then one array task runs for real, as SLURM would start it."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\necho $((1000 + $(wc -l < {calls})))\n')
    (bin_dir / "sbatch").chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = sweep("--smoke", "--launcher", "slurm", "--out", out, "--", "--lr", "2e-6", env=env)
    check_ok(proc)
    first, second, report = calls.read_text().splitlines()
    assert "--array=0,1,2,3,4,5,6,7,8,9 " in first and "--requeue" in first and "--signal=B:TERM@300" in first
    assert "--array=10,11,12,13,14,15,16,17 " in second and "--dependency=afterany:1001" in second
    assert "--dependency=afterany:1002" in report and "report.py" in report
    task = (out / "slurm" / "task.sh").read_text()
    assert '--slurm-task "$SLURM_ARRAY_TASK_ID" -- --lr 2e-6' in task

    # task 0 is h2h's GRPO run (the budget's reference): run it as an array task would
    run = subprocess.run(
        ["bash", str(out / "slurm" / "task.sh")],
        env={**trainer_env(), "PYTHON": sys.executable, "SLURM_ARRAY_TASK_ID": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(run)
    res = rundir.read_results(out / "h2h" / "grpo-group-s1" / "results.json")
    assert res["method"] == "grpo" and res["args"]["lr"] == 2e-6
    assert json.loads(json.dumps(res["args"]))["run_dir"] == str(out / "h2h" / "grpo-group-s1")


HOLD = """
import fcntl, json, os, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
f.truncate(0); f.write(json.dumps({"pid": os.getpid(), "holder": sys.argv[2]}) + "\\n"); f.flush()
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@contextlib.contextmanager
def held_lock(path: Path, holder: str):
    """Another process holds path's lock (flock), as a sweep or a trainer writes it: {"pid": N, "holder": ...}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path), holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"held\n"
        yield p.pid
    finally:
        p.stdin.close()
        p.wait(timeout=30)


@pytest.mark.parametrize("holder, kind", [("sweep", "a sweep"), ("ppo.py", "a trainer (ppo.py")])
def test_a_held_lock_is_one_line_naming_the_holder(tmp_path, holder, kind):
    out = tmp_path / "out"
    with held_lock(out / ".lock", holder) as pid:
        proc = sweep("--smoke", "--out", out, "--experiments", "labels")
    line = check_one_error_line(proc)
    assert proc.returncode == 2 and f"{out} is in use by {kind}" in line and f"pid {pid}" in line, line
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing started, nothing written


@pytest.mark.slow
def test_the_sweep_holds_its_lock_for_its_life_and_skips_a_run_a_trainer_holds(tmp_path):
    """A stand-in torchrun that waits for SIGTERM keeps the sweep alive: its lock names it; a second sweep on the same
    folder is refused naming it; a run whose folder a trainer holds is failed, naming the trainer, and skipped."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/usr/bin/env bash\nsleep 120 &\ntrap 'kill $!; exit 0' TERM\nwait\n")
    (bin_dir / "torchrun").chmod(0o755)
    env = {**trainer_env(), "PYTHON": sys.executable, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    args = ["--launcher", "torchrun", "--gpus", "1", "--out", str(out), "--experiments", "labels", "--seeds", "1"]
    args.append("--force")  # no preflight: its sampling of the default model would only cost time here
    with held_lock(out / "labels" / "dpo-self-offline-s1" / ".lock", "dpo.py") as trainer:
        first = subprocess.Popen(
            ["bash", str(REPO / "sweep.sh"), *args], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            lines = []
            while not any(line.startswith("run   ") for line in lines):  # the sweep's first trainer has started
                lines.append(first.stdout.readline())
                assert lines[-1], "".join(lines)
            assert json.loads((out / ".lock").read_text()) == {"pid": first.pid, "holder": "sweep"}
            second = sweep(*args)
            assert f"is in use by a sweep (pid {first.pid})" in check_one_error_line(second)
        finally:
            first.send_signal(signal.SIGTERM)
            rest, _ = first.communicate(timeout=60)
    text = "".join(lines) + rest
    assert first.returncode == 130, text  # stopped: the same command resumes
    busy = [x for x in text.splitlines() if x.startswith("FAIL  labels/dpo-self-offline-s1")]
    assert len(busy) == 1 and f"in use by a trainer (dpo.py, pid {trainer})" in busy[0], text
    assert "run   labels/dpo-self-offline-s1" not in text and "run   labels/dpo-self-online-s1" in text  # the next one


# ------------------------------------------------------------------------------------------------------
# report.py on synthetic runs: pooled sums, the paired comparison, runs written before the measurement
# ------------------------------------------------------------------------------------------------------


def _write_run(root: Path, experiment: str, name: str, results: dict, rows: list[dict]) -> Path:
    run_dir = root / experiment / name
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps(results))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_report_pools_sums_pairs_problems_and_names_what_old_runs_cannot_fill(tmp_path):
    import torch

    sys.path.insert(0, str(REPO))

    g = torch.Generator().manual_seed(0)
    k, n_test = 8, 200
    measured: dict[tuple[str, int], list[dict]] = {}
    for method, name, noise in (("ppo", "value", 0.15), ("grpo", "loo", 0.3)):
        for seed in (1, 2, 3):
            rows, parts = [], []
            for step in range(4):
                truth = torch.rand(40, generator=g, dtype=torch.float64)
                mc = (torch.rand(40, k, generator=g, dtype=torch.float64) < truth[:, None]).double().mean(-1)
                pred = truth + noise * torch.randn(40, generator=g, dtype=torch.float64)
                err = measure.baseline_error(pred, mc, k, torch.arange(40) // 4)
                rows.append({"step": step + 1, **{f"mc/{name}/{key}": v for key, v in err.items()}})
                if name == "loo":
                    rows[-1].update({f"mc/group/{key}": v for key, v in err.items()})
                if step > 0:  # the report leaves out the first measurement (the untrained critic)
                    parts.append((pred, mc))
            measured[(method, seed)] = parts
            acc = 0.5 if method == "ppo" else 0.4
            correct = (torch.rand(n_test, generator=g) < acc).float().tolist()
            results = {
                "method": method, "critic": "small" if method == "ppo" else "group", "seed": seed, "steps": 4,
                "generated_tokens": 1000, "trained_tokens": 2000, "policy_params": 10, "critic_params": 5,
                "args": {"group_size": 8} if method == "grpo" else {},
                "test": {"accuracy": sum(correct) / n_test, "n": n_test, "ci95": [0.3, 0.6], "correct": correct},
            }  # fmt: skip
            variant = "ppo-small" if method == "ppo" else "grpo-group"
            _write_run(tmp_path, "h2h", f"{variant}-s{seed}", results, rows)
    # a run written before this change: old keys, no per-problem correctness, no trained tokens
    old = {"method": "ppo", "critic": "none", "seed": 1, "steps": 2, "generated_tokens": 10,
           "test": {"accuracy": 0.1, "n": n_test, "ci95": [0.0, 0.2]}}  # fmt: skip
    _write_run(tmp_path, "h2h", "ppo-none-s1", old, [{"step": 1, "mc/value/centred_rmse": 0.2, "mc/value/rmse": 0.3}])

    runs, damaged = report.load_runs(tmp_path)
    assert not damaged and len(runs) == 7
    summary = {r["run"]: r for r in report.summarize(runs)}
    # the pooled number: one direct computation on every state of every seed's measurements after the first
    for method, run in (("ppo", "ppo-small"), ("grpo", "grpo-group")):
        states = [p for seed in (1, 2, 3) for p in measured[(method, seed)]]
        parts = [measure.baseline_error(pred, mc, k, torch.arange(40) // 4) for pred, mc in states]
        direct = measure.baseline_error(torch.cat([p for p, _ in states]), torch.cat([m for _, m in states]), k)
        assert summary[run]["nmse"] == pytest.approx(direct["nmse"], rel=1e-9)
        assert summary[run]["rmse"] == pytest.approx(direct["rmse"], rel=1e-9)
        centred = sum(p["sum_centred_sq_nc"] for p in parts) / direct["sum_signal_var"]
        assert summary[run]["nmse_centred"] == pytest.approx(centred, rel=1e-9)
        assert summary[run]["nmse_low"] < summary[run]["nmse"] < summary[run]["nmse_high"]
    assert summary["ppo-small"]["nmse"] < summary["grpo-group"]["nmse"]
    # paired on the same problems, seed by seed: the t interval over the per-seed differences
    by = {(r["run"], r["seed"]): r["correct"] for r in runs if r["correct"] is not None}
    per_seed = [sum(x - y for x, y in zip(by[("ppo-small", s)], by[("grpo-group", s)])) / n_test for s in (1, 2, 3)]
    d, lo, hi = intervals.mean_interval(per_seed)
    row = summary["ppo-small"]
    assert (row["vs_grpo"], row["vs_grpo_low"], row["vs_grpo_high"]) == pytest.approx((d, lo, hi))
    assert row["vs_grpo_seeds"] == 3 and row["vs_grpo_problems"] == n_test
    assert row["update_flops"] == pytest.approx(6 * 2000 * 15)
    # the old run: its row is written, its new columns are empty, and one line says which
    assert all(r != r for r in (summary["ppo-none"]["nmse"], summary["ppo-none"]["vs_grpo"]))
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    lines = [line for line in md.splitlines() if "leave these columns empty" in line]
    assert len(lines) == 1 and "h2h/ppo-none-s1" in lines[0] and "nmse" in lines[0] and "paired" in lines[0]
    assert "| h2h | ppo-none |" in md and "| h2h | ppo-small |" in md


def test_report_names_each_seeds_budget_once_from_the_reference_run(tmp_path):
    """The matched budget comes from grpo-group, the run the sweep reads it from; the unscaled GRPO arm of the same
    seed (method grpo too) is a budget-matched run, not a second budget."""
    sys.path.insert(0, str(REPO))

    test = {"accuracy": 0.1, "n": 10, "ci95": [0.0, 0.4]}
    for name, variant, tokens in (("grpo-group-s1", "group", 1000), ("grpo-group-unscaled-s1", "group-unscaled", 990)):
        res = {"method": "grpo", "variant": variant, "seed": 1, "steps": 4, "generated_tokens": tokens, "test": test}
        _write_run(tmp_path, "h2h", name, res, [{"step": 1, "reward": 0.0}])
    md = report.write_report(tmp_path, tmp_path / "report").read_text()
    (line,) = [line for line in md.splitlines() if line.startswith("Matched budget")]
    assert line.count("seed 1:") == 1 and "1,000 generated tokens in 4 steps" in line and "990" not in line, line
