"""bench/throughput.py runs end to end at toy sizes on the CPU and writes the JSON it promises.

The grpo section (grpo.py, TRL) is left out: it needs grpo.py and TRL, which this test does not assume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_tiny_cpu(tmp_path):
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, "bench/throughput.py", "--device", "cpu", "--tiny", "--out", str(out)]
    cmd += ["--work-dir", str(tmp_path / "work"), "--sections", "check,generate,eval,ppo,hf_static,train"]
    env = dict(os.environ)
    if "GSM8K_DIR" not in env and (ROOT.parent / "shared/data/gsm8k").is_dir():  # the project's shared copy
        env["GSM8K_DIR"] = str(ROOT.parent / "shared/data/gsm8k")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engine_over_hf_dynamic" in proc.stdout  # the table was printed
    report = json.loads(out.read_text())
    assert {"device", "versions", "model", "settings", "sections", "ratios"} <= set(report)
    sec = report["sections"]
    assert set(sec) == {"check", "generate", "eval", "ppo", "hf_static", "train"}
    assert not any("error" in s for s in sec.values()), {k: s.get("error") for k, s in sec.items()}
    # fp32 on the CPU: the engine's greedy tokens are the plain path's, its log-probs the training forward's
    assert sec["check"]["greedy_rows_identical"] == 1.0
    assert sec["check"]["logprob_abs_error_engine"]["max"] < 1e-3
    for name in ("engine", "hf_dynamic"):
        assert sec["generate"][name]["tokens_per_s"] > 0
    assert sec["hf_static"]["tokens_per_s"] > 0
    assert sec["eval"]["warm_s"] > 0 and sec["eval"]["problems"] == 16
    ppo = sec["ppo"]["ppo"]
    assert ppo["returncode"] == 0 and ppo["step_s"] > 0 and ppo["steps_timed"] >= 1
    assert sec["train"]["eager"]["tokens_per_s"] > 0
    r = report["ratios"]
    assert r["engine_over_hf_dynamic"] > 0 and r["engine_over_hf_static_compiled"] > 0
    assert r["eval_full_test_s"] == sec["eval"]["warm_s"]
    assert r["grpo_step_s"] is None  # the grpo section did not run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of --device auto without a GPU")
def test_default_device_without_a_gpu_is_the_cpu(tmp_path):
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, "bench/throughput.py", "--tiny", "--sections", "check", "--out", str(out)]
    cmd += ["--work-dir", str(tmp_path / "work")]
    env = dict(os.environ)
    if "GSM8K_DIR" not in env and (ROOT.parent / "shared/data/gsm8k").is_dir():
        env["GSM8K_DIR"] = str(ROOT.parent / "shared/data/gsm8k")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "cpu" in json.dumps(report["device"]).lower() and "check" in report["sections"]
