"""The sweep's preflight (preflight.py, ./sweep.sh --preflight): its estimators and its predicted standard error
against simulations of measure.baseline_error, its three exit codes and its JSON on the tiny model, the sweep it
refuses (no run folder), a model that cannot be fetched, the informative-state count of the MC measurement, and
the report's opening and warning."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import REPO, check_one_error_line, python, trainer_env

import gsm8k
import measure
import preflight
import report
from plumbing import models

FIELDS = ("pass_rate", "signal", "informative", "prompts", "samples_per_prompt", "samples", "informative_prompts")


def sweep(*args: str | Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**trainer_env(), "PYTHON": python(), **(env or {})}
    return subprocess.run(
        ["bash", str(REPO / "sweep.sh"), *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


# ------------------------------------------------------------------------------------------------------
# The estimators and the predicted standard error, against simulations
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [2, 8])
def test_the_signal_is_unbiased_and_the_plug_in_is_not(G):
    g = torch.Generator().manual_seed(G)
    p = torch.rand(400, generator=g, dtype=torch.float64) ** 3  # skewed towards hard prompts, like GSM8K's
    q = p * (1 - p)
    reps = [preflight.signal_stats((torch.rand(400, G, generator=g, dtype=torch.float64) < p[:, None]).double())
            for _ in range(300)]  # fmt: skip
    signal = sum(r["signal"] for r in reps) / len(reps)
    assert signal == pytest.approx(q.mean().item(), rel=0.03)
    plug_in = signal * (G - 1) / G  # mean p_hat (1 - p_hat): low by (G - 1) / G
    assert abs(plug_in - q.mean().item()) > 3 * abs(signal - q.mean().item())
    if G >= 4:  # E[q^2] unbiased from G >= 4 samples
        assert sum(r["signal_sq"] for r in reps) / len(reps) == pytest.approx((q * q).mean().item(), rel=0.05)
    else:  # the bound E[q^2] <= E[q] / 4
        assert reps[0]["signal_sq"] >= (q * q).mean().item() and not reps[0]["signal_sq_unbiased"]
    one = reps[0]
    assert one["prompts"] == 400 and one["samples_per_prompt"] == G and one["samples"] == 400 * G
    assert 0 < one["informative"] == one["informative_prompts"] / 400 < 1


def _simulated_nmse(p: torch.Tensor, k: int, n: int | None, weights: torch.Tensor | None, reps: int, seed: int):
    """reps measurements of the states of true value p through measure.baseline_error: K fresh returns each, the
    baseline the truth (n None) or the mean of n other returns (GRPO's leave-one-out mean at the prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(reps):
        returns = (torch.rand(len(p), k, generator=g, dtype=torch.float64) < p[:, None]).double()
        pred = (
            p if n is None else (torch.rand(len(p), n, generator=g, dtype=torch.float64) < p[:, None]).double().mean(-1)
        )
        out.append(measure.baseline_error(pred, returns.mean(-1), k, weights=weights, mc_var=returns.var(-1))["nmse"])
    return torch.tensor(out)


@pytest.mark.parametrize("k,n", [(8, None), (8, 7), (4, None), (4, 3)])
def test_the_predicted_standard_error_matches_a_simulation_of_the_measurement(k, n):
    g = torch.Generator().manual_seed(k * 10 + (n or 0))
    p = torch.rand(300, generator=g, dtype=torch.float64)
    q = p * (1 - p)
    nmse = _simulated_nmse(p, k, n, None, 1500, 1)
    se = preflight.predicted_se(q.mean().item(), (q * q).mean().item(), len(p), k, n)
    assert nmse.mean().item() == pytest.approx(0.0 if n is None else 1 / n, abs=3 * se / math.sqrt(1500) + 1e-3)
    assert nmse.std().item() == pytest.approx(se, rel=0.08)


def test_the_standard_error_counts_token_weighted_states_by_their_effective_number():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 60, (80,), generator=g).tolist()
    w = torch.tensor([x for n in lengths for _, x in measure.mc_state_positions(n, 2, 0)], dtype=torch.float64)
    p = torch.rand(len(w), generator=g, dtype=torch.float64)
    q = p * (1 - p)
    nmse = _simulated_nmse(p, 8, None, w, 1500, 2)
    plan = preflight.measurement_plan({"mc_every": 1, "total_steps": 2, "mc_prompts": 80, "mc_states": 2}, lengths)
    assert plan["measurements"] == 1 and plan["prompt_states"] == 80 and plan["states"] == len(w)
    assert plan["effective_states"] == pytest.approx(w.sum().item() ** 2 / (w * w).sum().item(), rel=0.02)
    assert plan["effective_states"] < 0.8 * len(w)  # the prompt state weighs 1, a state inside ~ length / 2
    se = preflight.predicted_se(q.mean().item(), (q * q).mean().item(), plan["effective_states"], 8, None)
    assert nmse.std().item() == pytest.approx(se, rel=0.1)
    assert nmse.std().item() > 1.15 * preflight.predicted_se(q.mean().item(), (q * q).mean().item(), len(w), 8, None)


def test_the_measurement_plan_counts_what_the_report_pools():
    args = {"mc_every": 10, "total_steps": 200, "mc_prompts": 32, "mc_states": 2}
    plan = preflight.measurement_plan(args, [100] * 8)
    assert plan["measurements"] == 19  # steps 0, 10, ..., 190, the first left out
    assert plan["prompt_states"] == 19 * 32 and plan["states"] == 19 * 32 * 3
    assert preflight.measurement_plan({**args, "mc_every": 0}, [100])["states"] == 0
    assert math.isnan(preflight.predicted_se(0.0, 0.0, 100, 8, None))  # no signal: nothing to predict


# ------------------------------------------------------------------------------------------------------
# ./sweep.sh --preflight on the tiny model: the toy task passes, GSM8K does not, and a sweep stops before any run
# ------------------------------------------------------------------------------------------------------


def test_the_toy_task_passes_the_preflight_and_writes_its_json(tmp_path):
    proc = sweep("--preflight", "--smoke", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    p = json.loads((tmp_path / "preflight.json").read_text())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("preflight:")]
    assert len(lines) == 1 and "enough signal" in lines[0] and f"informative {p['informative']:.2f}" in lines[0]
    for key in FIELDS:
        assert key in p, key
    assert p["passed"] and p["informative"] >= p["threshold"]["informative"] == preflight.MIN_INFORMATIVE
    # the reference GRPO line as the sweep builds it: --smoke's sizes and the toy task
    assert p["settings"]["task"] == "toy" and p["settings"]["model"] == "tiny" and p["samples_per_prompt"] == 2
    assert p["settings"]["max_new_tokens"] == 8 and p["prompts"] == preflight.CPU_PROMPTS
    pr = p["predicted"]
    assert pr["mc_samples"] == 4 and pr["prompt_states"] == 2 and pr["states"] == 6 and pr["nmse_grpo"] == 1.0
    assert pr["se_nmse_perfect"] > 0 and pr["se_nmse_grpo"] > 0
    assert not [d for d in tmp_path.iterdir() if d.is_dir()], "the preflight made a folder"


def test_gsm8k_on_the_tiny_model_is_refused_and_a_sweep_stops_before_any_run_folder_exists(tmp_path):
    flags = ("--smoke", "--out", tmp_path, "--preflight-prompts", "4", "--", "--task", "gsm8k")
    proc = sweep("--preflight", *flags)
    assert proc.returncode == 3, proc.stderr + proc.stdout
    line = proc.stdout.strip().splitlines()[-1]
    assert "refused: informative 0.00 < 0.2" in line and "pass rate 0.000" in line
    p = json.loads((tmp_path / "preflight.json").read_text())
    assert not p["passed"] and p["prompts"] == 4 and p["pass_rate"] == 0 and p["settings"]["task"] == "gsm8k"
    assert p["predicted"]["se_nmse_grpo"] is None  # nothing to measure
    # the sweep itself: the same preflight (reused: the same command), refused, and nothing of a run written
    proc = sweep(*flags)
    assert proc.returncode == 3, proc.stderr + proc.stdout
    assert "(reused from" in proc.stdout
    refusal = [line for line in proc.stderr.splitlines() if line.startswith("sweep: not started")]
    assert len(refusal) == 1 and "informative 0.00 < 0.2" in refusal[0] and "0 of 4 prompts" in refusal[0]
    assert "--force" in refusal[0]
    assert sorted(x.name for x in tmp_path.iterdir()) == [".lock", "preflight.json"]  # no run, no plan, no log


def test_the_dry_run_shows_the_preflight_as_the_sweep_builds_it(tmp_path):
    out = tmp_path / "out"
    proc = sweep("--preflight", "--smoke", "--dry-run", "--out", out, "--", "--lr", "2e-6")
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    assert "preflight.py --out" in line and " -- grpo.py --run-dir " in line and "--model tiny" in line
    assert "--group-size 2" in line and "--task toy" in line and line.endswith("--lr 2e-6")  # smoke, then the extra
    full = sweep("--smoke", "--dry-run", "--out", out)
    assert "# preflight first: h2h/grpo-group for seed 1" in full.stdout
    assert "# preflight first" not in sweep("--smoke", "--dry-run", "--force", "--out", out).stdout
    assert not out.exists()


def test_a_model_that_cannot_be_fetched_is_one_error_line(tmp_path):
    proc = sweep("--preflight", "--smoke", "--out", tmp_path, "--", "--model", "no-such-org/no-such-model")
    line = check_one_error_line(proc)
    assert proc.returncode == 2 and "no-such-org/no-such-model" in line


def test_the_preflight_reads_a_trainers_settings_in_process_without_loading_anything(tmp_path, monkeypatch):
    """The trainer named after -- is imported and its Args and CPU preset go through runtime.cli in this process: no
    subprocess, no model, no run folder."""
    import grpo

    def refused(*a, **k):
        raise AssertionError("the preflight started a process or loaded a model to read the settings")

    monkeypatch.setattr(subprocess, "run", refused)
    monkeypatch.setattr(subprocess, "Popen", refused)
    monkeypatch.setattr(models, "load_model", refused)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --scale cpu, not the machine, picks the preset
    run_dir = tmp_path / "r"
    args = preflight.trainer_settings(
        ["grpo.py", "--model", "tiny", "--scale", "cpu", "--group-size", "3", "--run-dir", str(run_dir)]
    )
    assert args["group_size"] == 3 and args["model"] == "tiny"  # the flags given win
    assert args["max_new_tokens"] == grpo.CPU_SCALE["max_new_tokens"] == 96  # the CPU preset applied
    assert args["scale"] == "cpu" and not run_dir.exists()
    assert preflight.trainer_settings([str(REPO / "grpo.py")])["group_size"] == grpo.Args().group_size


@pytest.mark.parametrize(
    "command,named",
    [
        (["report.py", "--out", "x"], "report.py"),
        (["sweep_runner.py"], "sweep_runner.py"),
        (["bench/throughput.py"], "bench/throughput.py"),
        (["/elsewhere/grpo.py"], "/elsewhere/grpo.py"),
        ([], "grpo.py"),
        (["dpo.py"], "--group-size"),
        (["grpo.py", "--group-size", "two"], "--group-size"),
    ],
)
def test_a_command_the_preflight_cannot_sample_is_one_line(command, named):
    """Only a trainer of this repository (and one with a group) is sampled; anything else, or a bad flag in the
    trainer's command, is a UserError of one line (run_main: `error:` and exit 2), raised in this process."""
    from plumbing import errors

    with pytest.raises(errors.UserError) as e:
        preflight.trainer_settings(command)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------------
# The measurement's informative-state count, and the report
# ------------------------------------------------------------------------------------------------------


def test_monte_carlo_counts_the_informative_states(tiny_tokenizer):

    model = models.load_model(models.TINY_MODEL, tiny_tokenizer, 0).eval()
    prompts = [gsm8k.encode_prompt(tiny_tokenizer, q, "chat") for q in ("one", "two plus two", "three")]
    responses = [[5, 17, 32, 8], [40, 41], [16, 2, 3]]
    out, _ = measure.monte_carlo(
        model, tiny_tokenizer, prompts=prompts, responses=responses, golds=["1", "2", "3"], groups=[0, 1, 2],
        row_ids=[0, 1, 2], baselines={"b": torch.zeros(3, 8)}, states=2, k=4, max_new_tokens=6, seed=1, step=0,
        task="toy", temperature=1.0, top_p=1.0,
    )  # fmt: skip
    assert out["states"] == 3 + 2 + 1 + 2  # each prompt state, and up to 2 inside each completion
    assert 0 < out["informative_states"] <= out["states"]
    assert out["informative_states"] >= out["b/signal_groups"]  # a prompt with signal has a state with it


def _run(root: Path, name: str, informative: float, states: float) -> None:
    run_dir = root / "h2h" / name
    run_dir.mkdir(parents=True)
    res = {"method": "grpo", "critic": "group", "seed": 1, "steps": 2, "generated_tokens": 10, "args": {},
           "test": {"accuracy": 0.1, "n": 8, "ci95": [0.0, 0.4]}}  # fmt: skip
    (run_dir / "results.json").write_text(json.dumps(res))
    rows = [{"step": s, "mc/informative_states": informative, "mc/states": states} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_opens_with_the_preflight_and_warns_of_few_informative_states(tmp_path):

    _run(tmp_path, "grpo-group-s1", 10.0, 96.0)  # 20 of 192 pooled after the first: below 0.2 x 192
    _run(tmp_path, "grpo-group-s2", 40.0, 96.0)
    p = {"settings": {"model": "tiny", "task": "toy", "temperature": 1.0, "max_new_tokens": 8}, "prompts": 8,
         "samples_per_prompt": 2, "pass_rate": 0.1875, "signal": 0.1875, "informative": 0.375,
         "informative_prompts": 3, "threshold": {"informative": 0.2}, "passed": True, "written": "2026-12-01 21:00",
         "predicted": {"se_nmse_grpo": 1.054, "se_nmse_perfect": 0.21, "nmse_grpo": 1.0, "prompt_states": 2,
                       "states": 6, "mc_samples": 4}}  # fmt: skip
    (tmp_path / "preflight.json").write_text(json.dumps(p))
    md = report.write_report(tmp_path, tmp_path / "report").read_text().splitlines()
    opening = md[2]
    assert opening.startswith("**Preflight**") and "pass rate 0.188" in opening and "informative 0.38" in opening
    assert "threshold 0.2: passed" in opening and "1.054" in opening and "0.210" in opening
    warnings = [line for line in md if "warning:" in line]
    assert len(warnings) == 1 and "h2h/grpo-group-s1 measured 20 informative states of 192" in warnings[0]
    assert "39" in warnings[0]  # ceil(0.2 x 192)
    (tmp_path / "preflight.json").unlink()
    md = report.write_report(tmp_path, tmp_path / "report").read_text().splitlines()
    assert md[2].startswith("Preflight: none") and len([line for line in md if "warning:" in line]) == 1
