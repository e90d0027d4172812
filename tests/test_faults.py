"""Faults a long run meets: links out of the run folder, a failing write during a save, a stop
signal outside the training loop, crafted checkpoint state. Each test plants the fault and checks for one
`error:` line (or a clean stop), a non-zero exit where it fails, nothing written outside the run folder and
nothing good lost."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import SMALL_RUN, check_ok, check_one_error_line, cli, copy_run, read_metrics, run_here, tree_digest
from test_dpo import DPO_TINY
from test_sweep import sweep

import gsm8k
import intervals
import measure
from plumbing import checkpoint, errors, generation, logs, models, rundir

# ------------------------------------------------------------------------------------------------------
# 1. Nothing outside the run folder is written or read by following a symbolic link
# ------------------------------------------------------------------------------------------------------


def _outside(tmp_path: Path) -> Path:
    """A folder outside the run's, with a file a planted link may point at; its digest must never change."""
    out = tmp_path / "elsewhere"
    out.mkdir()
    (out / "precious.txt").write_text("not the run's\n")
    return out


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "results.json", "tb"])
def test_a_link_planted_in_a_new_run_folder_is_refused_before_anything_is_written(tmp_path, name):
    outside, run_dir = _outside(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    target = outside if name == "tb" else outside / "precious.txt"
    (run_dir / name).symlink_to(target)
    before = tree_digest(outside)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **SMALL_RUN)))
    assert "symbolic link" in line and name in line, line
    assert tree_digest(outside) == before, "a file outside the run folder was written through the link"
    assert sorted(p.name for p in run_dir.iterdir()) == [name], "something was written in the run folder"


@pytest.mark.parametrize("name", [".lock", "checkpoint", "metrics.jsonl"])
def test_a_link_planted_in_a_run_folder_is_refused_on_resume(finished_run, tmp_path, name):
    outside = _outside(tmp_path)
    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "results.json").unlink()  # an unfinished run, to resume
    if name == "checkpoint":  # the checkpoint itself moved outside, a link left in its place
        (run_dir / name).rename(outside / name)
        (run_dir / name).symlink_to(outside / name)
    else:
        if (run_dir / name).exists():
            (run_dir / name).unlink()
        (run_dir / name).symlink_to(outside / "precious.txt")
    before, inside = tree_digest(outside), tree_digest(run_dir)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **SMALL_RUN, resume=True)))
    assert "symbolic link" in line and name in line, line
    assert tree_digest(outside) == before and tree_digest(run_dir) == inside


def test_a_run_folder_that_is_a_link_is_refused(tmp_path):
    outside = _outside(tmp_path)
    (tmp_path / "run").symlink_to(outside, target_is_directory=True)
    before = tree_digest(outside)
    line = check_one_error_line(run_here("ppo.py", cli(tmp_path / "run", **SMALL_RUN)))
    assert "is a symbolic link" in line, line
    assert tree_digest(outside) == before and sorted(p.name for p in outside.iterdir()) == ["precious.txt"]


def test_the_lock_never_opens_through_a_link(tmp_path, monkeypatch):
    """Below the folder check: RunLock opens .lock with O_NOFOLLOW (a link planted after the check is refused)."""

    outside = _outside(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(outside / "precious.txt")
    monkeypatch.setattr(rundir, "refuse_links", lambda *a, **k: None)  # planted after the check
    with pytest.raises(errors.UserError, match="cannot write in the run folder"):
        rundir.RunLock(tmp_path / "run").acquire()
    assert (outside / "precious.txt").read_text() == "not the run's\n"


def test_a_sweep_folder_that_is_or_holds_a_link_is_refused(tmp_path):
    outside = _outside(tmp_path)
    (tmp_path / "out").symlink_to(outside, target_is_directory=True)
    line = check_one_error_line(sweep("--dry-run", "--out", tmp_path / "out", "--seeds", "1"))
    assert "is a symbolic link" in line, line
    held = tmp_path / "held"
    held.mkdir()
    (held / ".lock").symlink_to(outside / "precious.txt")
    line = check_one_error_line(sweep("--dry-run", "--out", held, "--seeds", "1"))
    assert "symbolic link" in line and ".lock" in line, line
    assert (outside / "precious.txt").read_text() == "not the run's\n"


# ------------------------------------------------------------------------------------------------------
# 2. A write that fails during a save, whatever library raises it: one line, exit 1, the last good one kept
# ------------------------------------------------------------------------------------------------------


def _fail_second_save(monkeypatch, library: str, run_dir: Path) -> dict:
    """Make the second save's write fail as a full disk does in `library`; returns what the first save left
    (its digest), read the moment the failure strikes."""
    import safetensors.torch
    import torch

    seen: dict = {"calls": 0}
    ckpt = run_dir / checkpoint.CHECKPOINT

    def failing(real, message, exc):
        def wrapper(obj, path, *args, **kwargs):
            if ckpt.is_dir():  # the first save is in place: this is the second
                seen.setdefault("digest", tree_digest(ckpt))
                seen["calls"] += 1
                raise exc(message)
            return real(obj, path, *args, **kwargs)

        return wrapper

    if library == "torch":  # what torch.save raised on a full disk (optimizer.pt)
        msg = "[enforce fail at inline_container.cc:672] . unexpected pos 2304 vs 2198"
        monkeypatch.setattr(torch, "save", failing(torch.save, msg, RuntimeError))
    else:  # what safetensors raised (critic.safetensors)
        from safetensors import SafetensorError

        msg = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        monkeypatch.setattr(safetensors.torch, "save_file", failing(safetensors.torch.save_file, msg, SafetensorError))
    return seen


@pytest.mark.parametrize("library", ["torch", "safetensors"])
def test_a_write_failing_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, library):
    run_dir = tmp_path / "run"
    seen = _fail_second_save(monkeypatch, library, run_dir)
    proc = run_here("ppo.py", cli(run_dir, **{**SMALL_RUN, "total_steps": 2}, save_every=1))
    line = check_one_error_line(proc)
    assert proc.returncode == 1 and seen["calls"] == 1, proc.stdout[-2000:]
    assert "could not save the checkpoint in" in line and str(run_dir) in line and "--resume" in line, line
    ckpt = run_dir / checkpoint.CHECKPOINT
    assert tree_digest(ckpt) == seen["digest"], "the last good checkpoint was changed"
    checkpoint.verify_checkpoint(ckpt)
    assert json.loads((ckpt / "state.json").read_text())["counters"]["step"] == 1
    assert not list(run_dir.glob(".checkpoint.tmp-*")), "the failed save's temporary folder was left"


def test_a_full_disk_while_logging_is_one_line_naming_the_file(tmp_path, monkeypatch):

    logger = logs.MetricsLogger(tmp_path, enabled=True)
    logger.tb = None

    class Full:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def write(self, text):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr("builtins.open", Full)
    with pytest.raises(OSError) as info:
        logger.log(1, {"reward": 0.5})
    assert info.value.filename == str(tmp_path / "metrics.jsonl")  # run_main's one line names it


# ------------------------------------------------------------------------------------------------------
# 3. A stop signal is honoured wherever a run spends time; --resume redoes only what is missing
# ------------------------------------------------------------------------------------------------------

# PPO, three steps, a checkpoint after each; validation and the Monte Carlo measurement at step 2
STOPPED_RUN = {**SMALL_RUN, "total_steps": 3, "save_every": 1, "eval_every": 2, "mc_every": 2, "mc_prompts": 2}


def _signal_on_call(monkeypatch, module, name: str, nth: int) -> dict:
    """SIGTERM to this process as module.name is entered for the nth time (as a scheduler's would arrive
    then); counts the calls."""
    import signal

    real, seen = getattr(module, name), {"calls": 0}

    def wrapper(*args, **kwargs):
        seen["calls"] += 1
        if seen["calls"] == nth:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return seen


def _untimed(rows: list[dict]) -> list[dict]:
    """metrics.jsonl rows without the wall-clock fields, which differ between any two runs."""
    timed = ("time/", "seconds", "tokens_per_s", "wall_time")
    return [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in rows]


def _results(run_dir: Path) -> dict:
    r = json.loads((run_dir / "results.json").read_text())
    test = {k: r["test"][k] for k in ("accuracy", "n", "correct")}
    return {"test": test, "val": r["val"]["correct"], "test_before": r["test_before"]}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):

    run_dir = tmp_path_factory.mktemp("straight") / "run"
    check_ok(run_here("ppo.py", cli(run_dir, **STOPPED_RUN)))
    return read_metrics(run_dir), _results(run_dir)


@pytest.mark.parametrize(
    "where, nth, during",
    [
        ("evaluate", 1, "an evaluation"),  # the test before training, before any checkpoint
        ("evaluate", 2, "an evaluation"),  # the validation at step 2
        ("evaluate", 3, "an evaluation"),  # the final validation
        ("evaluate", 4, "an evaluation"),  # the final test
        ("monte_carlo", 2, "the Monte Carlo measurement"),  # at step 2 (the first is at step 0)
        ("save_checkpoint", 1, None),  # the save after step 1: the run stops then, not a step later
    ],
)
def test_a_stop_signal_anywhere_stops_at_once_and_resume_redoes_only_what_is_missing(
    tmp_path, monkeypatch, straight_run, where, nth, during
):

    run_dir = tmp_path / "run"
    module = {"save_checkpoint": checkpoint, "evaluate": gsm8k, "monte_carlo": measure}[where]
    seen = _signal_on_call(monkeypatch, module, where, nth)
    proc = run_here("ppo.py", cli(run_dir, **STOPPED_RUN))
    check_ok(proc)
    assert seen["calls"] == nth, f"{where} was called again after the signal: the run went on"
    if during is None:
        assert "stopped by SIGTERM after step 1" in proc.stdout, proc.stdout[-2000:]
        assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["counters"]["step"] == 1
    else:
        assert f"stopped by SIGTERM during {during}" in proc.stdout, proc.stdout[-2000:]
    saved = (run_dir / checkpoint.CHECKPOINT).exists()
    if where == "evaluate" and nth == 1:  # the test before training: nothing to resume from, and it says so
        assert not saved and "nothing was saved; run the same command again" in proc.stdout, proc.stdout[-2000:]
    else:
        assert saved and "--resume" in proc.stdout, proc.stdout[-2000:]
    assert not (run_dir / "results.json").exists()
    monkeypatch.undo()
    redone = _signal_on_call(monkeypatch, gsm8k, "evaluate", 0)  # counts the resumed run's evaluations
    check_ok(run_here("ppo.py", cli(run_dir, **STOPPED_RUN, **({"resume": True} if saved else {}))))
    if where == "save_checkpoint":  # stopped after step 1: the validation at step 2, the final validation and test
        assert redone["calls"] == 3, "the resume evaluated the test split before training again"
    rows, results = straight_run
    assert _untimed(read_metrics(run_dir)) == _untimed(rows), "a row is missing, changed or logged twice"
    assert _results(run_dir) == results


def test_a_stop_signal_during_dpo_pair_sampling_stops_at_once_and_nothing_is_left(tmp_path, monkeypatch):

    flags = {"total_steps": 1}
    straight = tmp_path / "straight"
    check_ok(run_here("dpo.py", cli(straight, DPO_TINY, **flags)))
    run_dir = tmp_path / "run"
    seen = _signal_on_call(monkeypatch, generation, "generate", 1)  # the first sampling batch of the offline pairs
    proc = run_here("dpo.py", cli(run_dir, DPO_TINY, **flags))
    check_ok(proc)
    assert seen["calls"] == 1, "the pair sampling went on after the signal"
    assert "stopped by SIGTERM during the offline pair sampling" in proc.stdout, proc.stdout[-2000:]
    assert "run the same command again" in proc.stdout
    monkeypatch.undo()
    check_ok(run_here("dpo.py", cli(run_dir, DPO_TINY, **flags)))  # as it says
    assert _untimed(read_metrics(run_dir)) == _untimed(read_metrics(straight))
    assert (run_dir / "pairs.jsonl").read_text() == (straight / "pairs.jsonl").read_text()


# ------------------------------------------------------------------------------------------------------
# 7. Every field a resume reads from a checkpoint's state is checked; no statistic over zero items
# ------------------------------------------------------------------------------------------------------

CRAFTED_STATES = {  # what a consistent (re-hashed) but wrong state.json holds, and a word the refusal names
    "no counters": (lambda s: s.pop("counters"), "counters"),
    "a counter missing": (lambda s: s["counters"].pop("step"), "step"),
    "a negative step": (lambda s: s["counters"].update(step=-1), "counters.step"),
    "a step as text": (lambda s: s["counters"].update(step="1"), "counters.step"),
    "a step beyond the run": (lambda s: s["counters"].update(step=99), "beyond --total-steps"),
    "a non-finite wall time": (lambda s: s["counters"].update(wall_time=float("inf")), "wall_time"),
    "a token count as a float": (lambda s: s["counters"].update(generated_tokens=1.5), "generated_tokens"),
    "no sampler": (lambda s: s.pop("sampler"), "sampler"),
    "a sampler position beyond the data": (lambda s: s["sampler"].update(pos=10**9), "data position"),
    "a sampler epoch below zero": (lambda s: s["sampler"].update(epoch=-1), "sampler"),
    "no ranks": (lambda s: s.update(world=0), "world"),
}


@pytest.mark.parametrize("crafted", list(CRAFTED_STATES))
def test_a_crafted_checkpoint_state_is_one_line(finished_run, tmp_path, crafted):
    from test_checkpoint import rehash

    change, word = CRAFTED_STATES[crafted]
    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "results.json").unlink()  # killed after its last save
    ckpt = run_dir / checkpoint.CHECKPOINT
    state = json.loads((ckpt / "state.json").read_text())
    change(state)
    (ckpt / "state.json").write_text(json.dumps(state))
    rehash(ckpt)
    before = tree_digest(ckpt)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **SMALL_RUN, resume=True)))
    assert word in line, line
    assert tree_digest(ckpt) == before and not (run_dir / "results.json").exists()


def test_an_evaluation_of_zero_problems_reads_absent_not_zero(tiny_tokenizer):
    model = models.load_model(models.TINY_MODEL, tiny_tokenizer)
    res = gsm8k.evaluate(
        model, tiny_tokenizer, [], task="gsm8k", prompt_format="chat", max_new_tokens=4, batch_size=4,
        show_progress=False,
    )  # fmt: skip
    assert res["n"] == 0
    assert res["accuracy"] is None and res["format_rate"] is None and res["mean_tokens"] is None
    assert res["ci95"] == [None, None]
    assert gsm8k.eval_metrics("test", res) == {"test/seconds": res["seconds"]}  # the rest absent
    assert intervals.ratio(0, 0) is None and intervals.ratio(3, 4) == 0.75


# ------------------------------------------------------------------------------------------------------
# 5. Inputs bounded before the work starts: a long question, a prompt beyond the context, the memory estimate
# ------------------------------------------------------------------------------------------------------


def _data_with_test_question(tmp_path: Path, gsm8k_dir: Path, question: str) -> tuple[Path, int]:
    """A copy of GSM8K whose test.jsonl gets one more problem with this question; returns it and its line."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(gsm8k_dir, data)
    with open(data / "test.jsonl", "a") as f:
        f.write(json.dumps({"question": question, "answer": "It is 4.\n#### 4"}) + "\n")
    return data, len((data / "test.jsonl").read_text().splitlines())


def test_a_200kb_question_is_refused_when_the_data_loads_naming_its_line(tmp_path, gsm8k_dir):
    data, line = _data_with_test_question(tmp_path, gsm8k_dir, "How many? " * 20_000)
    run_dir = tmp_path / "run"
    err = check_one_error_line(run_here("ppo.py", cli(run_dir, **SMALL_RUN, data_dir=data)))
    assert f"test.jsonl:{line}:" in err and "200,000 characters" in err, err
    assert not run_dir.exists() or not any(p.name != "tb" for p in run_dir.iterdir()), "work started"


def test_a_prompt_beyond_the_models_context_is_refused_before_any_work(tmp_path, gsm8k_dir):
    data, line = _data_with_test_question(tmp_path, gsm8k_dir, "€" * 3900)  # under the character limit
    run_dir = tmp_path / "run"
    proc = run_here("ppo.py", cli(run_dir, **SMALL_RUN, data_dir=data, eval_max_new_tokens=300))
    err = check_one_error_line(proc)
    assert f"test.jsonl:{line}:" in err and "context of 4,096" in err, err
    assert not (run_dir / "metrics.jsonl").exists()


def test_the_memory_estimate_is_made_again_with_the_longest_prompt(monkeypatch):
    batches = {"--eval-batch-size": (64, 8)}
    models.check_generation_memory(models.TINY_MODEL, torch.device("cpu"), batches)  # passes
    config = models.tiny_config()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * 64
    fits = per_token * (models.PROMPT_TOKENS + 8) + 64 * config.vocab_size * 4
    monkeypatch.setattr(models, "device_memory_bytes", lambda device: fits)  # room for 256-token prompts only
    models.recheck_generation_memory(models.PROMPT_TOKENS)
    with pytest.raises(errors.UserError, match="up to 1000 \\+ 8 tokens"):
        models.recheck_generation_memory(1000)


# ------------------------------------------------------------------------------------------------------
# 6. A damaged model or tokenizer cache is named, moved aside and rebuilt, or refused with the command
# ------------------------------------------------------------------------------------------------------


def _damaged_cache(tmp_path: Path, monkeypatch) -> Path:
    """A temporary RLVR_CACHE holding the tiny models' tokenizer (the packaged GGUF's, models._tokenizer_cache)
    with a truncated tokenizer.json."""
    import shutil

    real = models.resolve_model(models.TINY_MODEL)  # this machine's cache: made once, in a second or two
    cache = tmp_path / "cache"
    monkeypatch.setenv("RLVR_CACHE", str(cache))
    folder = cache / real.name
    shutil.copytree(real, folder)
    text = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(text[: len(text) // 2])
    assert models.resolve_model(models.TINY_MODEL) == folder
    return folder


def test_a_damaged_tokenizer_cache_is_named_moved_aside_and_rebuilt(tmp_path, monkeypatch, capsys):
    folder = _damaged_cache(tmp_path, monkeypatch)
    tok = models.load_tokenizer(models.TINY_MODEL)
    assert tok.pad_token_id is not None and len(tok("How many apples?")["input_ids"]) > 0
    out = capsys.readouterr().out
    assert f"the cached conversion {folder} is damaged" in out, out
    (aside,) = folder.parent.glob(f"{folder.name}.damaged-*")
    assert len((aside / "tokenizer.json").read_bytes()) < len((folder / "tokenizer.json").read_bytes()), "not rebuilt"


def test_a_cache_still_damaged_after_the_rebuild_is_refused_with_the_command_that_clears_it(tmp_path, monkeypatch):
    folder = _damaged_cache(tmp_path, monkeypatch)
    damaged = tmp_path / "copy"
    import shutil

    shutil.copytree(folder, damaged)

    def rebuild_damaged(gguf):  # a conversion that comes out damaged again (say, the disk is full)
        if not folder.exists():
            shutil.copytree(damaged, folder)
        return folder

    monkeypatch.setattr(models, "_tokenizer_cache", rebuild_damaged)
    with pytest.raises(errors.UserError, match=f"clear the cache with: rm -rf {tmp_path / 'cache'}"):
        models.load_tokenizer(models.TINY_MODEL)
