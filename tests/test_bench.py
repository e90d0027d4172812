"""bench/: run_gpu.sh's flow rehearsed on the CPU at toy sizes (bench/throughput.py end to end, every JSON and log
under $OUT), a failed trainer's step times kept, and the TRL settings compared with grpo.py's.

The grpo section (grpo.py, TRL) is left out of the rehearsal: it needs TRL, which this test does not assume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import throughput  # noqa: E402
import trl_grpo  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    if "GSM8K_DIR" not in env and (ROOT.parent / "shared/data/gsm8k").is_dir():  # the project's shared copy
        env["GSM8K_DIR"] = str(ROOT.parent / "shared/data/gsm8k")
    return env


@pytest.mark.slow
def test_run_gpu_flow_tiny_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**_env(), "OUT": str(out), "BENCH_ARGS": "--sections sdpa,check,generate,eval,ppo,train"}
    proc = subprocess.run(
        ["bash", "bench/run_gpu.sh", "--tiny"], cwd=ROOT, capture_output=True, text=True, timeout=1500, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("env.txt", "tests.log", "sdpa.log", "sdpa.json", "bench.log", "throughput.json"):
        assert (out / name).is_file(), name
    assert (out / "work" / "ppo.log").is_file()  # the trainers' logs are under $OUT too
    assert "engine_over_hf_dynamic" in proc.stdout  # the table was printed
    assert "decode step: measured" in proc.stdout  # the arithmetic beside the measurement
    sdpa = json.loads((out / "sdpa.json").read_text())["sections"]["sdpa"]
    assert sdpa["decode"] and sdpa["prefill"] and "unknown" not in sdpa["decode"] + sdpa["prefill"]

    report = json.loads((out / "throughput.json").read_text())
    assert {"device", "versions", "model", "settings", "sections", "ratios"} <= set(report)
    sec = report["sections"]
    assert set(sec) == {"sdpa", "check", "generate", "eval", "ppo", "train"}
    assert not any("error" in s for s in sec.values()), {k: s.get("error") for k, s in sec.items()}
    # fp32 on the CPU: the engine's greedy tokens are the plain path's, its log-probs the training forward's
    assert sec["check"]["greedy_rows_identical"] == 1.0
    assert sec["check"]["logprob_abs_error_engine"]["max"] < 1e-3
    for name in ("engine", "hf_dynamic"):
        assert sec["generate"][name]["tokens_per_s"] > 0
    floor = sec["generate"]["engine"]["floor"]
    assert floor["expected_ms"] > 0 and floor["measured_ms"] > 0 and floor["ops_per_step_eager"] > 10
    assert floor["bytes_read"] >= floor["bytes_valid"] > floor["weight_bytes"] + floor["logit_bytes"]
    assert sec["eval"]["warm_s"] > 0 and sec["eval"]["problems"] == 16
    ppo = sec["ppo"]["ppo"]
    assert ppo["returncode"] == 0 and ppo["step_s"] > 0 and ppo["steps_timed"] >= 1
    assert sec["train"]["eager"]["tokens_per_s"] > 0
    r = report["ratios"]
    assert r["engine_over_hf_dynamic"] > 0 and r["engine_over_hf_static_compiled"] > 0  # against the anchor
    assert r["eval_full_test_s"] == sec["eval"]["warm_s"]
    assert r["logprob_abs_error_max"] == sec["check"]["logprob_abs_error_engine"]["max"]
    assert r["decode_step_ms_floor"] == floor["expected_ms"]
    assert r["grpo_step_s"] is None  # the grpo section did not run


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
def test_default_device_without_a_gpu_is_the_cpu(tmp_path):
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, "bench/throughput.py", "--tiny", "--sections", "check", "--out", str(out)]
    cmd += ["--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "cpu" in json.dumps(report["device"]).lower() and "check" in report["sections"]
