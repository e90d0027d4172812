"""Every numeric flag range-checked before the model loads: one `error:` line naming the flag, exit 2,
nothing written. In this process for the many values (each exits in milliseconds, before any model),
and as a real subprocess for one value per trainer, so that stderr is exactly what a user sees."""

from __future__ import annotations

import pytest
from helpers import TINY, check_one_error_line, cli, run_here, run_trainer

BASE = {
    "ppo.py": dict(task="toy", critic="small"),
    "grpo.py": dict(task="toy", batch_size=2, group_size=4, micro_batch_size=4),
    "dpo.py": dict(task="gsm8k", batch_size=4, samples_per_prompt=4, micro_batch_size=4, offline_prompts=8),
}

# dpo.py has no --num-minibatches or --mc-every
DPO_BASE = {k: v for k, v in TINY.items() if k not in ("num-minibatches", "mc-every")}


def args_for(script: str, run_dir, **flags) -> list[str]:
    return cli(run_dir, DPO_BASE if script == "dpo.py" else None, **flags)


HUGE = 10**12
# (flag, value) refused by all three trainers
EVERY_TRAINER = [
    ("seed", -1),
    ("seed", 10**25),
    ("val-size", -1),
    ("batch-size", 0),
    ("batch-size", -4),
    ("max-new-tokens", 0),
    ("max-new-tokens", -5),
    ("temperature", 0),
    ("temperature", -1),
    ("temperature", "nan"),
    ("top-p", 0),
    ("top-p", 1.5),
    ("top-p", "nan"),
    ("total-steps", -1),
    ("token-budget", -1),
    ("lr", -1),
    ("lr", 0),
    ("lr", "nan"),
    ("lr", "inf"),
    ("warmup-steps", -1),
    ("weight-decay", -1),
    ("weight-decay", "nan"),
    ("max-grad-norm", -1),
    ("max-grad-norm", 0),
    ("max-grad-norm", "nan"),
    ("micro-batch-size", 0),
    ("update-epochs", 0),
    ("eval-every", -1),
    ("eval-size", -1),
    ("test-size", -3),
    ("eval-batch-size", 0),
    ("eval-max-new-tokens", 0),
    ("save-every", -1),
]
ONE_TRAINER = [
    ("ppo.py", "group-size", 0),
    ("ppo.py", "num-minibatches", 0),
    ("ppo.py", "critic-lr", -1),
    ("ppo.py", "critic-lr", "nan"),
    ("ppo.py", "clip-eps", 0),
    ("ppo.py", "vf-coef", -1),
    ("ppo.py", "vf-clip", -1),
    ("ppo.py", "gamma", 1.5),
    ("ppo.py", "lam", -0.1),
    ("ppo.py", "kl-coef", -0.1),
    ("ppo.py", "kl-coef", "nan"),
    ("ppo.py", "mc-every", -1),
    ("ppo.py", "mc-prompts", 0),
    ("ppo.py", "mc-states", -1),
    ("grpo.py", "num-minibatches", 0),
    ("grpo.py", "clip-eps", -0.2),
    ("grpo.py", "clip-eps-high", 0),
    ("grpo.py", "kl-coef", "inf"),
    ("grpo.py", "mc-prompts", 0),
    ("ppo.py", "top-p", 0.9),  # the engine's log-probs are the untruncated softmax's: the ratio would be biased
    ("grpo.py", "top-p", 0.9),
    ("dpo.py", "samples-per-prompt", 0),
    ("dpo.py", "offline-prompts", 0),
    ("dpo.py", "beta", "nan"),
    ("dpo.py", "beta", "inf"),
]
CASES = [(s, f, v) for s in BASE for f, v in EVERY_TRAINER] + ONE_TRAINER


def expect_refused(proc, run_dir, named: str) -> str:
    line = check_one_error_line(proc)
    assert proc.returncode == 2, proc.returncode
    assert named in line, line
    assert not run_dir.exists(), "something was written before the refusal"
    return line


@pytest.mark.parametrize(("script", "flag", "value"), CASES, ids=[f"{s}-{f}={v}" for s, f, v in CASES])
def test_a_bad_value_is_one_error_line_before_anything_is_written(tmp_path, script, flag, value):
    run_dir = tmp_path / "run"
    extra = {"mc-every": 1} if flag == "mc-prompts" else {}
    base = {**BASE[script], **extra, flag: value}
    proc = run_here(script, args_for(script, run_dir, **base))
    line = expect_refused(proc, run_dir, f"--{flag}")
    assert line.startswith("error:") and f"--{flag}" in line, line


@pytest.mark.parametrize("script", list(BASE))
def test_a_batch_too_large_for_memory_is_refused_with_the_estimate(tmp_path, script):
    run_dir = tmp_path / "run"
    big = dict(BASE[script], batch_size=HUGE, micro_batch_size=HUGE, eval_batch_size=HUGE)
    big.pop("group_size", None)
    line = expect_refused(run_here(script, args_for(script, run_dir, **big)), run_dir, "memory")
    assert "GiB" in line


@pytest.mark.parametrize("script", list(BASE))
def test_an_unknown_task_is_refused_before_the_model_loads(tmp_path, script):
    """Whether the Args type (a Literal) or validate() refuses it: exit 2, no traceback, nothing written."""
    run_dir = tmp_path / "run"
    proc = run_here(script, args_for(script, run_dir, **{**BASE[script], "task": "bogus"}))
    assert proc.returncode == 2 and "--task" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(("script", "flag", "value"), [("ppo.py", "max-grad-norm", -1), ("grpo.py", "top-p", 0),
                                                       ("dpo.py", "batch-size", 0)])  # fmt: skip
def test_a_bad_value_in_a_fresh_process_is_one_error_line(tmp_path, script, flag, value):
    run_dir = tmp_path / "run"
    # a new interpreter: every warning a fresh start prints is seen
    proc = run_trainer(script, args_for(script, run_dir, **{**BASE[script], flag: value}), timeout=120)
    line = expect_refused(proc, run_dir, f"--{flag}")
    assert proc.stderr.strip() == line and "Traceback" not in proc.stderr, proc.stderr  # the user sees one line


def test_fsdp_with_the_kl_in_the_reward_and_a_measurement_is_refused(tmp_path):
    """--kl-mode reward puts the reference's KL of the Monte Carlo rollouts into their returns: under --fsdp each of
    those reference forwards is a collective, and the ranks' MC rollouts (completions of different lengths) need
    different numbers of them: a hang, not a run. Refused before anything loads, with what to do instead."""
    run_dir = tmp_path / "run"
    flags = args_for("ppo.py", run_dir, **BASE["ppo.py"]) + ["--fsdp", "--kl-mode", "reward", "--mc-every", "2"]
    line = expect_refused(run_here("ppo.py", flags), run_dir, "--kl-mode reward")
    assert "--fsdp" in line and "--mc-every 0" in line


# a refusal names the flag and its value once, then the range in words: no interval notation, no "inf"
RANGE_WORDS = [
    (dict(non_negative=("total_steps",)), "total_steps", -3, "--total-steps -3: must be 0 or more"),
    (dict(positive=("lr",)), "lr", 0.0, "--lr 0.0: must be more than 0"),
    (dict(positive=("lr",)), "lr", float("inf"), "--lr inf: must be a finite number more than 0"),
    (dict(probability=("top_p",)), "top_p", 1.5, "--top-p 1.5: must be more than 0 and at most 1"),
    (dict(unit=("gamma",)), "gamma", -0.5, "--gamma -0.5: must be from 0 to 1"),
    (dict(unit=("gamma",)), "gamma", float("nan"), "--gamma nan: must be a finite number from 0 to 1"),
    (dict(seeds=("seed",)), "seed", -1, "--seed -1: must be from 0 to 2^63 - 1"),
]


@pytest.mark.parametrize(("kind", "name", "value", "said"), RANGE_WORDS, ids=[r[-1] for r in RANGE_WORDS])
def test_a_range_refusal_says_the_range_once_in_words(kind, name, value, said):
    """Every kind of range check_ranges knows, in the words a reader checks a value against."""
    from types import SimpleNamespace

    from plumbing import errors, runtime

    with pytest.raises(errors.UserError) as e:
        runtime.check_ranges(SimpleNamespace(**{name: value}), **kind)
    assert str(e.value) == said


def test_a_negative_step_count_is_refused_in_one_plain_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_here("ppo.py", args_for("ppo.py", run_dir, **{**BASE["ppo.py"], "total-steps": -3}))
    assert expect_refused(proc, run_dir, "--total-steps") == "error: --total-steps -3: must be 0 or more"


def test_a_validation_split_larger_than_train_is_refused_with_the_train_size():
    """--val-size is carved out of train: the refusal says how many problems train holds (the organism's shipped
    data here, read as GSM8K's files)."""
    from pathlib import Path

    import gsm8k
    from plumbing import errors

    data = Path(__file__).resolve().parents[1] / "organism-seed0" / "data"
    n = sum(1 for line in (data / "train.jsonl").read_text().splitlines() if line.strip())
    with pytest.raises(errors.UserError) as e:
        gsm8k.load_gsm8k(str(data), n)
    assert str(e.value) == f"--val-size {n}: must be from 0 to {n - 1} (the train split holds {n} problems)"


def test_a_model_folder_that_does_not_exist_is_named_as_missing(tmp_path):
    run_dir = tmp_path / "run"
    missing = tmp_path / "no-such-model"
    proc = run_here("ppo.py", args_for("ppo.py", run_dir, **{**BASE["ppo.py"], "model": str(missing)}))
    assert expect_refused(proc, run_dir, "--model") == f"error: --model {missing}: no such folder"
