"""ppo.py end to end on the CPU: every critic runs, reward rises on the toy task, bad input is one line, and
the `none` critic is REINFORCE with the batch-mean score as its baseline."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_rises,
    check_ok,
    check_one_error_line,
    cli,
    is_finite,
    require_gsm8k_dir,
    run_here,
    run_trainer,
    step_rows,
)

import common
import runtime
from critics import CRITICS

# Trainable critic parameters at the tiny model's hidden size 64 (the table in critics.py).
CRITIC_PARAMS = {"none": 0, "small": 4_225, "medium": 33_793, "large": 67_585, "full": 3_219_841}


@pytest.mark.parametrize("critic", CRITICS)
def test_each_critic_runs_two_steps_with_the_mc_measurement(tmp_path, critic):
    run_dir = tmp_path / "run"
    flags = dict(critic=critic, total_steps=2, mc_every=1, mc_states=1, mc_prompts=2, mc_samples=2)
    check_ok(run_here("ppo.py", cli(run_dir, **flags)))

    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 2 and results["critic"] == critic
    assert 0 <= results["test"]["accuracy"] <= 1 and results["test"]["n"] == 8
    lo, hi = results["test"]["ci95"]
    assert 0 <= lo <= results["test"]["accuracy"] <= hi <= 1
    assert results["generated_tokens"] > 0 and results["mc_tokens"] > 0
    assert results["wall_time_s"] > 0 and results["args"]["critic"] == critic
    assert results["critic_params"] == CRITIC_PARAMS[critic]

    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert is_finite(r["reward"]) and 0 <= r["reward"] <= 1
        for key in ("mc/value/rmse", "mc/value/bias", "mc/adv/rmse", "mc/white/rmse", "mc/value/within_group_rmse"):
            assert is_finite(r[key]), f"{key} = {r.get(key)}"
        assert r["mc/tokens"] > 0 and r["mc/value/n"] > 2  # the prompts and states inside the completions
        assert (r["vf_loss"] is None) == (critic == "none")

    ckpt = run_dir / runtime.CHECKPOINT
    runtime.verify_checkpoint(ckpt)
    assert json.loads((ckpt / "state.json").read_text())["counters"]["step"] == 2
    assert (ckpt / "critic.safetensors").is_file() == (critic != "none")


def test_recompute_logprobs_takes_old_logprobs_and_full_critic_values_from_the_training_forward(tmp_path):
    """--recompute-logprobs: one training forward per micro-batch gives the old log-probs and a full critic's
    old values. With one minibatch and one epoch the first update's ratio is then exactly 1 (approx_kl 0),
    and the value loss is the one the rollout's own log-probs give."""
    flags = dict(critic="full", task="toy", total_steps=1, lr=1e-3, update_epochs=1, num_minibatches=1)
    rows = {}
    for recompute in (False, True):
        run_dir = tmp_path / f"recompute-{recompute}"
        check_ok(run_here("ppo.py", cli(run_dir, **flags, recompute_logprobs=recompute or None)))
        rows[recompute] = step_rows(run_dir)[0]
    assert rows[True]["approx_kl"] == 0.0 and rows[False]["approx_kl"] != 0.0
    assert rows[True]["reward"] == rows[False]["reward"]
    assert rows[True]["vf_loss"] == pytest.approx(rows[False]["vf_loss"], rel=1e-5)


@pytest.mark.parametrize("critic", ["none", "small"])
def test_reward_rises_on_the_toy_task(tmp_path, critic):
    # The toy task: reward 1 when a completion of 4 tokens holds a token id divisible by 16 (~0.2 at the start).
    # At lr 3e-3 the climb is slow enough that the CPU's floating-point path decides the outcome (0.19 -> 0.38
    # in 30 steps on one machine, past 0.6 on another). At 1e-2 (grpo.py's learning test), measured with
    # OMP_NUM_THREADS 1 and 2: the small critic reaches 1.0 by step 9-11, then over-steps (approx_kl 1e6) at step
    # 25 or 29, reward back to 0.16-0.56; none climbs slowest with one thread (0.78 at step 20, 0.94 at 22).
    # 22 steps sit between: the last five's mean was 0.83-1.0 (criterion 0.6), the rise 0.65-0.78 (criterion 0.3).
    flags = dict(
        seed=1,
        task="toy",
        critic=critic,
        total_steps=22,
        batch_size=32,
        max_new_tokens=4,
        lr=1e-2,
        kl_coef=0,
        micro_batch_size=32,
        num_minibatches=2,
        eval_size=16,
        test_size=16,
        eval_max_new_tokens=4,
        scale="study",
    )
    check_ok(run_here("ppo.py", cli(tmp_path / "run", **flags)))
    rewards = [r["reward"] for r in step_rows(tmp_path / "run")]
    assert len(rewards) == 22
    assert_rises(rewards, by=0.3, to=0.6)


# ------------------------------------------------------------------------------------------------------
# bad input: one line on stderr, starting 'error:', no traceback
# ------------------------------------------------------------------------------------------------------

BAD_INPUT = {
    "unknown critic": (dict(critic="huge"), "--critic"),
    "one MC sample": (dict(mc_every=1, mc_samples=1), "--mc-samples"),
    "minibatch does not divide": (dict(batch_size=6, num_minibatches=4), "--num-minibatches"),
    "unknown model": (dict(model="no-such-model"), "no-such-model"),
    "missing data folder": (dict(data_dir="/nonexistent/gsm8k"), "/nonexistent/gsm8k"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line(tmp_path, case):
    flags, named = BAD_INPUT[case]
    line = check_one_error_line(run_trainer("ppo.py", cli(tmp_path / "run", **flags), timeout=120))
    assert named in line


def test_cpu_scale_leaves_flags_given_on_the_command_line():
    """--num-minibatches 4 equals the default; given explicitly, the CPU scale-down must not change it."""
    from ppo import CPU_SCALE, Args

    args = Args(num_minibatches=4, batch_size=6)
    changed = runtime.apply_cpu_scale(args, torch.device("cpu"), CPU_SCALE, argv=["--num-minibatches", "4"])
    assert args.num_minibatches == 4 and not any(c.startswith("num_minibatches") for c in changed)
    assert args.batch_size == 6  # not a default: kept
    assert args.max_new_tokens == CPU_SCALE["max_new_tokens"]  # left at its default: scaled
    assert runtime.apply_cpu_scale(Args(scale="study"), torch.device("cpu"), CPU_SCALE, argv=[]) == []


# ------------------------------------------------------------------------------------------------------
# the `none` critic: REINFORCE with a batch-mean baseline, seen at the advantage computation
# ------------------------------------------------------------------------------------------------------


def run_ppo_in_process(argv: list[str], monkeypatch) -> None:
    """ppo.main() in this process, so that a test can watch its internals; signal handlers restored after."""
    import ppo

    monkeypatch.setattr(sys, "argv", ["ppo.py", *argv])
    monkeypatch.setenv("GSM8K_DIR", require_gsm8k_dir())
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        ppo.main()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def test_critic_none_is_reinforce_with_the_batch_mean_baseline(tmp_path, monkeypatch):
    calls = []
    real_gae = common.gae

    def watched_gae(rewards, values, mask, gamma, lam):
        adv, ret = real_gae(rewards, values, mask, gamma, lam)
        calls.append((rewards.clone(), values.clone(), mask.clone(), adv.clone(), ret.clone(), gamma, lam))
        return adv, ret

    monkeypatch.setattr(common, "gae", watched_gae)
    flags = dict(task="toy", critic="none", total_steps=2, batch_size=16, max_new_tokens=6, kl_coef=0)
    run_ppo_in_process(cli(tmp_path / "run", **flags), monkeypatch)

    assert len(calls) == 2
    for rewards, values, mask, adv, ret, gamma, lam in calls:
        assert gamma == 1.0 and lam == 1.0
        scores = rewards.sum(-1)  # [B]: one reward per completion, at its last token
        assert 0 < scores.mean() < 1, "the test needs a batch with both rewards"
        lengths = mask.sum(-1).long()
        assert torch.equal(rewards[torch.arange(len(scores)), lengths - 1], scores)
        baseline = scores.mean()
        # the value of every state of every completion is the batch-mean score
        torch.testing.assert_close(values, baseline * mask, atol=1e-6, rtol=0)
        # and every token of completion i gets the advantage score_i - mean (REINFORCE), return score_i
        torch.testing.assert_close(adv, (scores - baseline)[:, None] * mask, atol=1e-6, rtol=0)
        torch.testing.assert_close(ret, scores[:, None] * mask, atol=1e-6, rtol=0)
    assert json.loads((Path(tmp_path) / "run" / "results.json").read_text())["critic_params"] == 0
