"""bench/: run_gpu.sh's parts rehearsed on the CPU at toy sizes (each its own process and limit, one killed by
it with the earlier parts' numbers kept), a failed trainer's step times kept, the toy run's reward rise, and the
TRL settings and caveats printed beside the ratio. Part q (PARTS=q, bench/qwen_part.py) is rehearsed on its own with
tiny-qwen2: whole, and stopped by its limit (fired once the preflight is done); beside them its sizing arithmetic, its skip without QWEN_GGUF.

The trainers' part (d) is killed by its limit in the rehearsal (3 s): a full one takes 29 s on 2 CPU cores
(2026-12-02; `T_D=300 bash bench/run_gpu.sh --tiny` runs it). TRL is not assumed installed: its part records a skip.
bench/busy_machine.py runs a job that reports its thread variables and the busy processes beside it (nothing timed).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import qwen_part  # noqa: E402
import throughput  # noqa: E402
import trl_grpo  # noqa: E402
from helpers import process_state, trainer_env  # noqa: E402

from plumbing import models, static_engine  # noqa: E402


def _env() -> dict:
    """The trainers' environment (helpers.trainer_env), and this interpreter as run_gpu.sh's PYTHON."""
    return {**trainer_env(), "PYTHON": sys.executable}


@pytest.mark.slow
def test_run_gpu_flow_tiny_cpu_keeps_the_parts_before_one_killed_by_its_limit(tmp_path):
    """Every part of run_gpu.sh on the CPU; part d (the trainers) is killed by a 3 s limit: the numbers of
    parts a-c stay in throughput.json, parts e and f still run, and the table names the part that stopped."""
    out = tmp_path / "out"
    env = {**_env(), "OUT": str(out), "T_D": "3"}
    proc = subprocess.run(
        ["bash", "bench/run_gpu.sh", "--tiny"], cwd=ROOT, capture_output=True, text=True, timeout=1500, env=env
    )
    assert proc.returncode != 0, "a part was killed: the run must not exit 0"
    parts = {n: int(rc) for n, rc, _ in map(str.split, (out / "parts.tsv").read_text().splitlines())}
    assert parts == {"a_probe": 0, "b_tests": 0, "c_generate": 0, "d_train": 124, "e_trl": 0, "f_rest": 0}, parts
    for name in ("env.txt", "a_probe.log", "b_tests.log", "c_generate.log", "d_train.log", "throughput.json"):
        assert (out / name).is_file(), name
    assert "part d_train" in proc.stdout and "STOPPED" in proc.stdout and "killed by its time limit" in proc.stdout
    assert "engine_over_hf_dynamic" in proc.stdout and "decode step: measured" in proc.stdout

    report = json.loads((out / "throughput.json").read_text())
    assert {"device", "versions", "model", "settings", "sections", "ratios", "parts"} <= set(report)
    assert report["parts"]["d_train"]["rc"] == 124
    sec = report["sections"]
    assert sec["rng_probe"]["skipped"] == "no CUDA device"
    gen = sec["generate"]  # part c's variants and part f's hf_dynamic in one section
    for name in ("engine", "engine_no_compile"):
        assert gen[name]["tokens_per_s"] > 0
        assert gen[name]["backend"] == "static" and gen[name]["fell_back"] is False and gen[name]["fallbacks"] == []
    assert gen["hf_dynamic"]["tokens_per_s"] > 0
    assert "ran as: generate/engine " in proc.stdout
    started = [n for n in ("grpo", "ppo", "toy") if n in sec]  # part d's sections, in their order
    if started:  # killed in the last one it started: on the record as unfinished; or just after it finished
        last = sec[started[-1]]
        assert ("running" in last and "UNFINISHED" in proc.stdout) or ("section_s" in last and "running" not in last)
        assert not any("running" in sec[n] for n in started[:-1])  # the ones before it finished
    assert "trl" in sec and ("skipped" in sec["trl"] or sec["trl"].get("step_s"))
    # part f: the numerics and the SDPA kernels
    assert sec["check"]["greedy_rows_identical"] == 1.0 and sec["check"]["logprob_abs_error_engine"]["max"] < 1e-3
    assert sec["sdpa"]["decode"] and "unknown" not in sec["sdpa"]["decode"] + sec["sdpa"]["prefill"]
    floor = gen["engine"]["floor"]
    assert floor["expected_ms"] > 0 and floor["measured_ms"] > 0 and floor["ops_per_step_eager"] > 10
    assert floor["ops_source"].startswith("eager") and floor["ops_per_step"] == floor["ops_per_step_eager"]  # CPU
    assert floor["bytes_read"] >= floor["bytes_valid"] > floor["weight_bytes"] + floor["logit_bytes"]
    assert sec["eval"]["warm_s"] > 0 and sec["eval"]["problems"] == 16
    r = report["ratios"]
    assert r["engine_over_hf_dynamic"] > 0 and r["engine_over_hf_static_compiled"] > 0  # against the anchor
    assert r["logprob_abs_error_max"] == sec["check"]["logprob_abs_error_engine"]["max"]
    assert r["decode_step_ms_floor"] == floor["expected_ms"]
    assert r["grpo_step_s"] == sec.get("grpo", {}).get("grpo", {}).get("step_s")  # None unless grpo.py finished


def _part_q_env(tmp_path: Path, limit_s: int, q_args: str = "") -> tuple[dict, Path]:
    """The environment of `PARTS=q bash bench/run_gpu.sh --tiny` under T_Q=limit_s (tiny-qwen2 whatever QWEN_GGUF
    says), and its OUT folder."""
    out = tmp_path / "out"
    env = {**_env(), "OUT": str(out), "PARTS": "q", "T_Q": str(limit_s), "Q_ARGS": q_args}
    env.pop("Q_MODEL", None)
    return env, out


def _part_q(tmp_path: Path, limit_s: int) -> tuple[subprocess.CompletedProcess, Path]:
    """`PARTS=q bash bench/run_gpu.sh --tiny` under T_Q=limit_s, run to its end."""
    env, out = _part_q_env(tmp_path, limit_s)
    proc = subprocess.run(
        ["bash", "bench/run_gpu.sh", "--tiny"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    return proc, out


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step" in r]


@pytest.mark.slow
def test_run_gpu_part_q_tiny_cpu_writes_every_step_at_one_token_budget(tmp_path):
    """Part q on the CPU with tiny-qwen2 at toy sizes: the preflight's refusal on the record and the part going on,
    the accuracy before training, GRPO and PPO-small at one token budget with the Monte Carlo measurement on, each
    with its curves and its accuracy after, no checkpoint left."""
    proc, out = _part_q(tmp_path, 300)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    parts = {n: int(rc) for n, rc, _ in map(str.split, (out / "parts.tsv").read_text().splitlines())}
    assert parts == {"q_qwen": 0}, parts
    q = out / "q"
    for name in ("preflight.json", "summary.json", "eval-before/results.json", "eval-before/metrics.jsonl"):
        assert (q / name).is_file(), name
    for run in ("grpo", "ppo-small"):
        for name in ("metrics.jsonl", "results.json", "curves.png"):
            assert (q / run / name).is_file(), f"{run}/{name}"
    assert not [p for p in out.rglob("*checkpoint*")], "a checkpoint was left under OUT"
    summary = json.loads((q / "summary.json").read_text())
    assert summary["model"] == "tiny-qwen2" and summary["finished"] is True and summary["killed"] is None
    assert summary["unfinished"] == [] and all(s["status"] == "done" for s in summary["steps"].values())

    # a. the tiny random model cannot answer GSM8K: refused (exit 3), on the record
    pf = json.loads((q / "preflight.json").read_text())
    assert pf["passed"] is False and pf["settings"]["model"] == "tiny-qwen2" and pf["settings"]["task"] == "gsm8k"
    assert pf["prompts"] == 4 and pf["samples_per_prompt"] == 4
    assert summary["steps"]["preflight"]["rc"] == 3 and summary["steps"]["preflight"]["verdict"] == "refused"
    assert "refused" in summary["steps"]["preflight"]["line"]

    # b. before training: no step, nothing generated but the evaluation
    before = json.loads((q / "eval-before/results.json").read_text())
    assert before["steps"] == 0 and before["generated_tokens"] == 0 and before["test"]["n"] == 8

    # c. one token budget, both runs stopped by it (at it or within their last step past it), MC measured
    budget = summary["budget"]["token_budget"]
    assert budget > 0
    for run, method in (("grpo", "grpo"), ("ppo-small", "ppo")):
        res = json.loads((q / run / "results.json").read_text())
        assert res["method"] == method and res["args"]["token_budget"] == budget, (run, res["args"])
        assert res["args"]["mc_every"] > 0 and res["mc_tokens"] > 0 and res["args"]["scale"] == "study"
        made = [r["generated_tokens"] for r in _steps(q / run)]
        assert made[-1] == res["generated_tokens"] >= budget, (run, made, budget)
        assert len(made) == 1 or made[-2] < budget, (run, made, budget)
        assert res["steps"] < res["args"]["total_steps"]  # the budget stopped it, not the step count
        assert any("mc/seconds" in r for r in _steps(q / run))
        assert summary["steps"][run.replace("-", "_")]["stopped_by"] == "token budget"
    assert json.loads((q / "ppo-small/results.json").read_text())["args"]["critic"] == "small"

    # d. the accuracies before and after, with their intervals, as the runs wrote them
    acc = summary["accuracy"]
    assert set(acc) == {"before", "after_grpo", "after_ppo_small"}
    for key, run in (("before", "eval-before"), ("after_grpo", "grpo"), ("after_ppo_small", "ppo-small")):
        test = json.loads((q / run / "results.json").read_text())["test"]
        lo, hi = acc[key]["ci95"]
        assert acc[key]["accuracy"] == test["accuracy"] and [lo, hi] == test["ci95"] and acc[key]["n"] == 8
        assert 0 <= lo <= acc[key]["accuracy"] <= hi <= 1 and hi > lo
    assert acc["after_grpo"]["paired_vs_before"]["n"] == 8
    assert "part q: tiny-qwen2" in proc.stdout and "budget:" in proc.stdout


def _processes() -> list[tuple[int, str, int, int]]:
    """Every process as (pid, name, parent pid, session id), from Linux's /proc/PID/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # a process that ended while we looked
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        found.append((int(stat.parent.name), name, int(rest[1]), int(rest[3])))
    return found


def _children(pid: int, comm: str) -> list[int]:
    """The pids of PID's child processes named COMM."""
    return [p for p, name, parent, _ in _processes() if name == comm and parent == pid]


def _gnu_timeout() -> bool:
    """Whether `timeout` is GNU coreutils', which takes a SIGALRM from outside as its own limit elapsing."""
    try:
        said = subprocess.run(["timeout", "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return False
    return "GNU coreutils" in said.split("\n", 1)[0]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to find run_gpu.sh's timeout")
@pytest.mark.skipif(not _gnu_timeout(), reason="fires GNU timeout's limit by its SIGALRM")
def test_run_gpu_part_q_killed_by_its_limit_keeps_what_finished(tmp_path):
    """Part q stopped by its limit (run_gpu.sh's `timeout`): parts.tsv says 124, summary.json names the kill and what
    did not finish, every step it calls done has its files on disk, and a step that never started left no folder.

    The limit fires at a known point, not on a clock: the part runs under T_Q = 300 s with runs of 20 steps, and once
    summary.json calls the preflight done the test sends `timeout` the SIGALRM its own clock would have sent (GNU
    timeout then signals the part and exits 124, as at its limit). A 10 s limit raced the preflight on a busy machine
    (CI). The output goes to a file (a pipe nobody reads could fill and stall the part); whatever is left running at
    the end of the test's own session of processes is killed."""
    env, out = _part_q_env(tmp_path, 300, "--max-steps 20")
    log = tmp_path / "stdout.txt"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            ["bash", "bench/run_gpu.sh", "--tiny"], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline, fired = time.monotonic() + 300, False
            while time.monotonic() < deadline and proc.poll() is None and not fired:
                time.sleep(0.2)
                try:
                    steps = json.loads((out / "q/summary.json").read_text())["steps"]
                except (OSError, ValueError, KeyError):  # not written yet (each write is a rename: never half a file)
                    continue
                if steps["preflight"]["status"] == "done":
                    for pid in _children(proc.pid, "timeout"):
                        os.kill(pid, signal.SIGALRM)
                        fired = True
            proc.wait(timeout=120)
        finally:  # timeout makes a process group of its own: every process of the session goes
            for pid in [p for p, _, _, session in _processes() if session == proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    stdout = log.read_text()
    assert fired, stdout[-3000:]
    parts = {n: int(rc) for n, rc, _ in map(str.split, (out / "parts.tsv").read_text().splitlines())}
    assert parts == {"q_qwen": 124}, (parts, stdout[-3000:])
    assert proc.returncode != 0
    summary = json.loads((out / "q/summary.json").read_text())
    steps = summary["steps"]
    assert summary["killed"].startswith("SIGTERM") and summary["finished"] is False
    assert "ppo_small" in summary["unfinished"] and summary["unfinished"] == [
        n for n in summary["order"] if steps[n]["status"] != "done"
    ]
    assert steps["preflight"]["status"] == "done", steps
    assert json.loads((out / "q/preflight.json").read_text())["passed"] is False
    statuses = [steps[n]["status"] for n in summary["order"]]
    code = "".join({"done": "d", "skipped": "d", "killed": "k", "not started": "n"}[s] for s in statuses)
    assert re.fullmatch("d+k?n*", code), statuses  # in order: done, at most one killed, then never started
    wanted = {"eval_before": ["results.json"], "grpo": ["results.json", "curves.png"], "ppo_small": ["results.json"]}
    for name, status in zip(summary["order"], statuses):
        folder = out / "q" / qwen_part.FOLDERS[name]
        if status == "done":
            assert all((folder / f).is_file() for f in wanted.get(name, [])), name
        if status == "not started":
            assert not folder.exists(), name
    assert not [p for p in out.rglob("*checkpoint*")], "a checkpoint was left under OUT"
    assert "KILLED: SIGTERM" in stdout  # run_gpu.sh printed the table from summary.json


@pytest.mark.slow
def test_run_gpu_part_q_without_qwen_gguf_is_skipped_on_the_record_and_bad_parts_are_refused(tmp_path):
    """Not --tiny and no QWEN_GGUF: part q is skipped with its reason (SmolLM2 is not needed for it, nor is the
    throughput table); an unknown part is one error line and exit 2, before anything runs."""
    env = {k: v for k, v in _env().items() if k not in ("QWEN_GGUF", "SMOLLM2_GGUF")}
    out = tmp_path / "out"
    cmd = ["bash", "bench/run_gpu.sh"]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**env, "OUT": str(out), "PARTS": "q"}
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "parts.tsv").read_text().split()[:2] == ["q_qwen", "0"]
    assert "part q: skipped: QWEN_GGUF is unset" in (out / "q_qwen.log").read_text()
    assert "QWEN_GGUF is unset" in json.loads((out / "q/summary.json").read_text())["skipped"]
    assert not (out / "throughput.json").exists() and not (out / "table.txt").exists()

    def run_bad(env: dict, parts: str) -> subprocess.CompletedProcess:
        out_env = {**env, "OUT": str(tmp_path / "bad"), "PARTS": parts}
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=out_env)

    bad = run_bad(env, "a,z")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: unknown part 'z' in PARTS=a,z (the parts: a,b,c,d,e,f and q)"
    ]
    no_data = {k: v for k, v in env.items() if k != "GSM8K_DIR"}
    bad = run_bad(no_data, "q")
    assert bad.returncode == 2 and bad.stderr.startswith("error: GSM8K_DIR is unset")
    assert not (tmp_path / "bad").exists()


def test_part_q_sizes_one_budget_that_both_runs_fit():
    """size_budget: B = (left - sum(fixed + one step)) / sum(step_s / tokens), capped, at least one step."""
    runs = {
        "grpo": {"step_s": 10.0, "tokens": 1000.0, "fixed_s": 30.0},
        "ppo_small": {"step_s": 20.0, "tokens": 2000.0, "fixed_s": 40.0},
    }
    b = qwen_part.size_budget(400.0, runs, max_steps=200)
    assert b["token_budget"] == 15_000  # (400 - (30 + 10) - (40 + 20)) / (10 / 1000 + 20 / 2000)
    assert b["expected_steps"] == {"grpo": 15, "ppo_small": 8} and b["total_steps"] == 4 * 15 + 4
    assert b["fits"] and sum(b["predicted_s"].values()) <= 400 and not b["capped_by_max_steps"]
    capped = qwen_part.size_budget(400.0, runs, max_steps=3)
    assert capped["token_budget"] == 3000 and capped["capped_by_max_steps"]
    over = qwen_part.size_budget(50.0, runs, max_steps=200)
    assert over["token_budget"] == 1 and not over["fits"]  # one step each, and on the record that it does not fit
    # the first step's Monte Carlo measurement, taken every other step later, and its warm-up kept in
    assert qwen_part.step_cost(12.0, 4.0, 2) == 10.0 and qwen_part.step_cost(12.0, 4.0, 1) == 12.0


def test_part_q_bad_input_is_one_error_line_and_no_model_is_a_recorded_skip(tmp_path, capsys):
    assert qwen_part.main(["--limit-s", "0", "--out", str(tmp_path / "a")]) == 2
    assert qwen_part.main(["--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "b")]) == 2
    assert qwen_part.main(["--no-such-flag"]) == 2
    assert qwen_part.main(["--tiny", "--max-steps", "0", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err), err
    assert not [*tmp_path.iterdir()]  # nothing written
    assert qwen_part.main(["--model", "", "--out", str(tmp_path / "q")]) == 0  # run_gpu.sh without QWEN_GGUF
    summary = json.loads((tmp_path / "q/summary.json").read_text())
    assert "QWEN_GGUF is unset" in summary["skipped"] and summary["finished"] is False
    assert "part q: skipped: QWEN_GGUF is unset" in capsys.readouterr().out


def test_reward_rise_compares_the_last_third_with_the_first():
    assert throughput.reward_rise([0.1, 0.2, 0.1, 0.5, 0.6, 0.9]) == {
        "reward_first": pytest.approx(0.15),
        "reward_last": pytest.approx(0.75),
        "reward_rose": True,
    }
    assert throughput.reward_rise([0.5, 0.4, 0.3])["reward_rose"] is False
    assert throughput.reward_rise([0.5])["reward_rose"] is None


def test_trl_ratio_prints_its_caveats_and_both_step_counts(capsys):
    report = {"device": "x", "model": "m", "dtype": "bf16", "sections": {
        "grpo": {"grpo": {"step_s": 1.0, "steps_timed": 4}},
        "trl": {"step_s": 7.0, "steps_timed": 4, "caveats": list(throughput.TRL_CAVEATS)},
    }}  # fmt: skip
    report["ratios"] = throughput.ratios(report["sections"])
    assert report["ratios"]["trl_step_over_grpo_step"] == 7.0
    throughput.print_table(report)
    shown = capsys.readouterr().out
    assert "TRL 4 steps, grpo.py 4" in shown.replace("  ", " ").replace("  ", " ") or "grpo.py 4" in shown
    for caveat in throughput.TRL_CAVEATS:
        assert caveat[:60] in shown


def test_hf_static_is_off_by_default_and_its_anchor_stands_in():
    assert "hf_static" in throughput.SECTIONS and "hf_static" not in throughput.DEFAULT_SECTIONS
    assert "hf_static" not in throughput.Args().sections.split(",")
    anchor = throughput.HF_STATIC_ANCHOR["tokens_per_s"]
    r = throughput.ratios({"generate": {"engine": {"tokens_per_s": 2 * anchor}}})
    assert r["engine_over_hf_static_compiled"] == 2.0
    r = throughput.ratios({"generate": {"engine": {"tokens_per_s": 100.0}}, "hf_static": {"tokens_per_s": 50.0}})
    assert r["engine_over_hf_static_compiled"] == 2.0  # measured when the section ran


FAILING_TRAINER = """
import json, sys
from pathlib import Path
run = Path(sys.argv[sys.argv.index("--run-dir") + 1]); run.mkdir(parents=True)
with open(run / "metrics.jsonl", "w") as f:
    for i, t in enumerate([9.0, 2.0, 3.0, 4.0]):
        f.write(json.dumps({"step": i, "time/step": t, "time/rollout": t / 2, "response_len": 10}) + "\\n")
print("Traceback: CUDA error: an illegal memory access was encountered")
sys.exit(3)
"""


def test_a_failed_trainer_keeps_its_step_times(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(FAILING_TRAINER)
    args = throughput.Args(tiny=True, work_dir=str(tmp_path / "work"), warmup_steps=1, subprocess_timeout_s=60)
    (tmp_path / "work").mkdir()
    bench = types.SimpleNamespace(args=args, model_name="tiny", device=torch.device("cpu"), over_deadline=lambda: None)
    out = throughput.run_trainer(bench, str(script), [], "failing")
    assert out["returncode"] == 3 and "illegal memory access" in out["error"]
    assert out["step_times_logged"] == [9.0, 2.0, 3.0, 4.0]
    assert out["step_s"] == 3.0 and out["steps_timed"] == 3  # the median after the warm-up step


def test_trl_settings_that_differ_from_grpo_are_listed():
    g = trl_grpo.grpo_settings("--update-epochs 1 --num-minibatches 4 --group-size 8 --batch-size 64")
    assert (g["update_epochs"], g["num_minibatches"], g["batch_size"], g["group_size"]) == (1, 4, 64, 8)
    assert g["gradient_checkpointing"] is False
    config = types.SimpleNamespace(
        learning_rate=g["lr"],
        beta=g["kl_coef"],
        epsilon=g["clip_eps"],
        epsilon_high=None,
        temperature=1.0,
        top_p=1.0,
        num_iterations=1,
        steps_per_generation=None,
        gradient_accumulation_steps=8,
        scale_rewards="group",
        loss_type="dapo",
        max_grad_norm=g["max_grad_norm"],
        weight_decay=0.0,
        lr_scheduler_type="linear",
        warmup_steps=0,
        gradient_checkpointing=True,
        num_generations=8,
        max_completion_length=g["max_new_tokens"],
    )
    diff = trl_grpo.differences_from_grpo(config, g, 512)
    assert set(diff) == {"optimizer_steps_per_generation", "lr_scheduler_type", "gradient_checkpointing"}, diff
    assert diff["optimizer_steps_per_generation"] == {"trl": 1, "grpo.py": 4}
    config.gradient_checkpointing, config.lr_scheduler_type, config.steps_per_generation = False, "constant", 32
    assert trl_grpo.differences_from_grpo(config, g, 512) == {}


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of --device auto without a GPU")
def test_default_device_without_a_gpu_is_the_cpu(tmp_path, monkeypatch):
    out = tmp_path / "throughput.json"
    argv = ["throughput.py", "--tiny", "--sections", "check", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    printed, code = io.StringIO(), None
    with process_state(), contextlib.redirect_stdout(printed):  # `python bench/throughput.py ...`, in this process
        monkeypatch.setattr(sys, "argv", argv)
        os.environ.update(trainer_env())
        try:
            throughput.main()
        except SystemExit as e:
            code = e.code
    assert code in (None, 0), f"exit {code}\n{printed.getvalue()[-3000:]}"  # exit 0
    report = json.loads(out.read_text())
    assert "cpu" in json.dumps(report["device"]).lower() and "check" in report["sections"]


def test_decode_floor_reads_the_row_groups_widths():
    """decode_floor's KV bytes read: with one group every row reads the longest row's chunk; with two row groups
    the longest eighth (here two of the 16 rows: the engine takes at least 16 on the CPU, the extra ones holding one
    token) reads its own width and the other rows theirs (the engine's rows sorted longest first); the valid bytes do
    not change. The GPU's chunk of 64 slots, given."""
    tok = models.load_tokenizer(models.TINY_MODEL)
    lm = models.load_model(models.TINY_MODEL, tok, seed=0)
    lens, T = [12, 200, 9, 30, 15, 11, 8, 10], 16
    slot = lm.config.num_hidden_layers * 2 * lm.config.num_key_value_heads * lm.config.head_dim * 4  # fp32 bytes
    one = throughput.decode_floor(static_engine.StaticEngine(lm, row_groups=1, kv_chunk=64), lens, T, ops=100)
    two = throughput.decode_floor(static_engine.StaticEngine(lm, row_groups=2, kv_chunk=64), lens, T, ops=100)
    assert one["row_groups"] == 1 and two["row_groups"] == 2 and one["rows"] == two["rows"] == 16
    assert one["kv_bytes_read"] == pytest.approx(16 * 256 * slot)  # 200 + t + 1 -> 256, for every row
    assert two["kv_bytes_read"] == pytest.approx((2 * 256 + 14 * 64) * slot)  # 200 and 30; the rest 15 + t + 1 -> 64
    assert (
        one["kv_bytes_valid"]
        == two["kv_bytes_valid"]
        == pytest.approx(sum(sum(lens) + 8 + 16 * (t + 1) for t in range(T)) / T * slot)
    )


# the job bench/busy_machine.py runs in the test below: its thread variables and the spinning processes beside it
# (children of its parent, the benchmark, whose command line is the busy loop)
_SEES_HOGS = """
import os
def parent(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
hogs = 0
for pid in set(filter(str.isdigit, os.listdir("/proc"))) - {str(os.getpid())}:
    try:
        hogs += b"while True: pass" in open(f"/proc/{pid}/cmdline", "rb").read() and parent(pid) == os.getppid()
    except OSError:
        pass
print(*(os.environ.get(v) for v in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")), hogs)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to see the busy processes")
def test_busy_machine_runs_each_configuration_idle_and_beside_its_busy_processes():
    """bench/busy_machine.py on a job that reports what it ran beside: the chosen configuration with no thread
    variable, torch's with its count and libgomp's default spin, passive with its count and a passive wait; no busy
    process idle (those of the repeat before were killed), --busy of them beside the busy runs; then the table of
    medians and ratios. Nothing timed."""
    proc = subprocess.run(
        [sys.executable, "bench/busy_machine.py", "--repeats", "2", "--busy", "2", "--", "-c", _SEES_HOGS],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=trainer_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [line for line in proc.stdout.splitlines() if line.startswith("repeat ")]
    assert len(runs) == 12, proc.stdout
    for line in runs:
        condition, config, said = line.split()[2], line.split()[3], line.rsplit(": ", 1)[1].split()
        assert said[3] == ("2" if condition == "busy" else "0"), line
        if config == "chosen":
            assert said[:3] == ["None", "None", "None"], line
        else:  # a fresh torch's count, and how its idle threads wait
            assert said[0].isdigit() and int(said[0]) >= 1, line
            assert said[1:3] == (["300000", "None"] if config == "torch" else ["None", "PASSIVE"]), line
    table = proc.stdout.split("median wall time", 1)[1].splitlines()
    assert [row.split()[0] for row in table[1:]] == ["chosen", "torch", "passive", "torch", "passive"], table
