"""Checkpoints: written atomically, loadable by plain transformers and torch.load(weights_only=True), refused
when damaged or mismatched (and then left untouched), and a SIGTERM + --resume that ends bitwise where a
straight run ends."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import (
    SMALL_RUN,
    check_ok,
    check_one_error_line,
    cli,
    copy_run,
    read_metrics,
    run_here,
    run_trainer,
    start_trainer,
    tree_digest,
    wait_for_first_step,
)

from critics import build_critic
from plumbing import checkpoint, errors, forward, models

# ------------------------------------------------------------------------------------------------------
# save_checkpoint in process
# ------------------------------------------------------------------------------------------------------


def tiny_training_state(seed: int = 0):
    tok = models.load_tokenizer("tiny")
    policy = models.load_model("tiny", tok, seed=seed)
    critic = build_critic("small", policy.config.hidden_size)
    opt = torch.optim.AdamW([{"params": policy.parameters()}, {"params": critic.parameters()}], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = torch.randint(3, 1000, (2, 6), generator=torch.Generator().manual_seed(seed))
    lp, _, values = forward.PolicyForward(policy, critic)(ids, torch.ones_like(ids), 3)
    (lp.sum() + values.pow(2).sum() - values.sum()).backward()
    opt.step()
    sched.step()
    return tok, policy, critic, opt, sched


def save(run_dir: Path, state, step: int) -> Path:
    tok, policy, critic, opt, sched = state
    return checkpoint.save_checkpoint(
        run_dir,
        policy=policy,
        tokenizer=tok,
        critic=critic,
        optimizer=opt,
        scheduler=sched,
        state={"counters": {"step": step}},
        args={"lr": 1e-3},
    )


def test_save_is_atomic_and_the_policy_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = tiny_training_state()
    tok, policy = state[0], state[1]
    for step in (1, 2):  # the second save replaces the first
        path = save(tmp_path, state, step)
        assert path == tmp_path / checkpoint.CHECKPOINT
        assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.CHECKPOINT], "a temporary folder was left"
        assert json.loads((path / "state.json").read_text())["counters"]["step"] == step
    manifest = json.loads((path / "manifest.json").read_text())
    files = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    assert set(manifest) == files - {"manifest.json"}
    assert {"policy/model.safetensors", "critic.safetensors", "optimizer.pt", "state.json", "args.json"} <= files
    checkpoint.verify_checkpoint(path)

    loaded = AutoModelForCausalLM.from_pretrained(path / "policy").eval()
    ids = torch.randint(3, len(tok), (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, policy.eval()(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(path / "policy").pad_token_id == tok.pad_token_id


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    state = tiny_training_state()
    path = save(tmp_path, state, 1)
    before = tree_digest(path)

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(errors.WriteFailed, match="disk full"):  # one line naming the path (run_main)
        save(tmp_path, state, 2)
    assert tree_digest(path) == before
    checkpoint.verify_checkpoint(path)


def test_the_run_folder_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    state = tiny_training_state()
    synced = []
    real_fsync = os.fsync

    def watched_fsync(fd):
        synced.append(os.fstat(fd).st_ino)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watched_fsync)
    save(tmp_path, state, 1)
    assert os.stat(tmp_path).st_ino in synced, "the folder holding the renamed checkpoint was not fsynced"


def test_every_pt_file_loads_with_weights_only(finished_run):
    pt_files = sorted((finished_run / checkpoint.CHECKPOINT).rglob("*.pt"))
    assert {p.name for p in pt_files} >= {"optimizer.pt", "scheduler.pt", "rng.pt"}
    for p in pt_files:
        torch.load(p, weights_only=True)


# ------------------------------------------------------------------------------------------------------
# refusals: one line on stderr, nothing touched
# ------------------------------------------------------------------------------------------------------


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def unlist(ckpt: Path, name: str) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest[name]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def overwrite_unlisted_optimizer(ckpt: Path) -> None:
    unlist(ckpt, "optimizer.pt")
    torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.pt")


DAMAGE = {
    "flipped policy weights": lambda ckpt: flip_byte(ckpt / "policy" / "model.safetensors"),
    "flipped critic weights": lambda ckpt: flip_byte(ckpt / "critic.safetensors"),
    "deleted optimizer.pt": lambda ckpt: (ckpt / "optimizer.pt").unlink(),
    "garbled manifest": lambda ckpt: (ckpt / "manifest.json").write_text("{not json"),
    "manifest a list": lambda ckpt: (ckpt / "manifest.json").write_text("[]"),
    "manifest empty": lambda ckpt: (ckpt / "manifest.json").write_text("{}"),
    "manifest digest not a string": lambda ckpt: (ckpt / "manifest.json").write_text('{"state.json": 1}'),
    "manifest path outside": lambda ckpt: (ckpt / "manifest.json").write_text('{"../results.json": "00"}'),
    "unlisted overwritten optimizer.pt": overwrite_unlisted_optimizer,
    "an unlisted extra file": lambda ckpt: (ckpt / "policy" / "extra.py").write_text("print('hi')\n"),
}
SUBPROCESS = ("garbled manifest",)  # the other refusals of a fresh process: test_validation.py


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_and_left_in_place(finished_run, tmp_path, damage):
    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "results.json").unlink()  # a run killed after its last save (a finished one is not resumed)
    ckpt = run_dir / checkpoint.CHECKPOINT
    DAMAGE[damage](ckpt)
    before = tree_digest(run_dir)
    args = cli(run_dir, **SMALL_RUN, resume=True)
    if damage in SUBPROCESS:  # a new interpreter for a few: stderr as a user sees it
        proc = run_trainer("ppo.py", args)
    else:
        proc = run_here("ppo.py", args)
    line = check_one_error_line(proc)
    assert str(ckpt) in line and "damaged" in line
    assert tree_digest(run_dir) == before


def test_resume_with_a_different_essential_argument_is_refused(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "results.json").unlink()
    before = tree_digest(run_dir)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **{**SMALL_RUN, "lr": 2e-3}, resume=True)))
    assert str(run_dir) in line and "lr" in line
    assert tree_digest(run_dir) == before


@pytest.mark.parametrize(
    ("flag", "value"), [("total_steps", 2), ("lr_schedule", "cosine"), ("warmup_steps", 1), ("token_budget", 10_000)]
)
def test_resume_with_a_different_schedule_argument_is_refused(finished_run, tmp_path, flag, value):
    """--total-steps and every argument the LR schedule depends on: a resume keeps the original horizon. The budget
    too, under the constant learning rate (only a paid PPO run continues as amortised: test_pretrain.py)."""
    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "results.json").unlink()  # a run killed after its last save
    before = tree_digest(run_dir)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **{**SMALL_RUN, flag: value}, resume=True)))
    assert str(run_dir) in line and flag in line
    assert tree_digest(run_dir) == before


def test_a_new_run_in_a_folder_with_a_checkpoint_is_refused(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path)
    before = tree_digest(run_dir)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **SMALL_RUN)))
    assert str(run_dir) in line and "--resume" in line
    assert tree_digest(run_dir) == before


def test_a_new_run_in_a_folder_with_metrics_of_another_run_is_refused(tmp_path):
    # A run that died before its first checkpoint leaves metrics.jsonl: a new run must not append to it.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    before = tree_digest(run_dir)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **SMALL_RUN)))
    assert str(run_dir) in line
    assert tree_digest(run_dir) == before


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    line = check_one_error_line(run_here("ppo.py", cli(tmp_path / "empty", **SMALL_RUN, resume=True)))
    assert "no checkpoint" in line


# ------------------------------------------------------------------------------------------------------
# SIGTERM mid-run, then --resume: bitwise the straight run
# ------------------------------------------------------------------------------------------------------

# Slow enough per step (~1 s on a CPU core) that SIGTERM lands mid-run; the toy task gives rewards that vary,
# so the policy, the critic and Adam's moments all move.
RESUME_RUN = dict(task="toy", critic="small", lr=1e-3, total_steps=4, batch_size=16, max_new_tokens=32)


def load_final(run_dir: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    ckpt = run_dir / checkpoint.CHECKPOINT
    return load_file(ckpt / "policy" / "model.safetensors"), load_file(ckpt / "critic.safetensors")


@pytest.mark.slow
def test_sigterm_then_resume_equals_a_straight_run(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    one = {"OMP_NUM_THREADS": "1"}  # every part on one torch thread (the runs below too): bitwise comparable
    with open(tmp_path / "split.log", "w") as log:
        proc = start_trainer("ppo.py", cli(split, **RESUME_RUN), log, one)  # a process: the signal is the point
        try:
            wait_for_first_step(proc, split)
            os.kill(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
    check_ok(run_here("ppo.py", cli(straight, **RESUME_RUN), threads=1))  # the straight run, in this process
    out = (tmp_path / "split.log").read_text()
    assert rc == 0, out[-3000:]
    stopped_at = json.loads((split / checkpoint.CHECKPOINT / "state.json").read_text())["counters"]["step"]
    assert f"stopped by SIGTERM after step {stopped_at}; checkpoint in {split / checkpoint.CHECKPOINT}" in out, out[
        -3000:
    ]
    assert 1 <= stopped_at < 4, f"the signal did not land mid-run (checkpoint at step {stopped_at})"
    assert not (split / "results.json").exists()

    check_ok(run_here("ppo.py", cli(split, **RESUME_RUN, resume=True), threads=1))

    (pol_a, crit_a), (pol_b, crit_b) = load_final(straight), load_final(split)
    assert pol_a.keys() == pol_b.keys() and crit_a.keys() == crit_b.keys()
    for k in pol_a:
        assert torch.equal(pol_a[k], pol_b[k]), f"policy {k} differs after resume"
    for k in crit_a:
        assert torch.equal(crit_a[k], crit_b[k]), f"critic {k} differs after resume"
    # and the runs were not trivial: the policy moved from its init, the critic from its zero output layer
    tok = models.load_tokenizer("tiny")
    init = models.load_model("tiny", tok, seed=1).state_dict()
    assert any(not torch.equal(init[k], pol_a[k]) for k in pol_a)
    assert crit_a["out.weight"].abs().sum() > 0

    # the resumed run continues the same curve: the same per-step numbers, each step logged once
    keys = ("reward", "pg_loss", "vf_loss", "entropy", "approx_kl", "generated_tokens")
    rows_a = [{k: r[k] for k in keys} for r in read_metrics(straight) if "reward" in r]
    rows_b = [{k: r[k] for k in keys} for r in read_metrics(split) if "reward" in r]
    assert rows_a == rows_b
    assert json.loads((split / "results.json").read_text())["steps"] == 4


# ------------------------------------------------------------------------------------------------------
# a crafted checkpoint cannot run code: torch.distributed.checkpoint's .metadata is a pickle
# ------------------------------------------------------------------------------------------------------


class _WritesAFile:
    """Unpickled, this writes `path`: what a hostile dcp/.metadata would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('pwned')",))


def rehash(ckpt: Path) -> None:
    """What anyone can do to an unsigned manifest: list every file with its new SHA-256."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    (ckpt / "manifest.json").write_text(json.dumps({str(p.relative_to(ckpt)): models.file_sha256(p) for p in files}))


@pytest.mark.parametrize("saved_with_fsdp", [False, True])
def test_a_crafted_dcp_metadata_pickle_is_refused_and_never_run(finished_run, tmp_path, saved_with_fsdp):
    import pickle

    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "results.json").unlink()
    ckpt = run_dir / checkpoint.CHECKPOINT
    marker = tmp_path / "written-by-the-pickle"
    (ckpt / "dcp").mkdir()
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_WritesAFile(str(marker))))
    if saved_with_fsdp:  # args.json edited to claim --fsdp; the manifest re-hashed to match
        args = json.loads((ckpt / "args.json").read_text())
        (ckpt / "args.json").write_text(json.dumps({**args, "fsdp": True}))
    rehash(ckpt)
    line = check_one_error_line(run_here("ppo.py", cli(run_dir, **SMALL_RUN, resume=True)))
    assert not marker.exists(), "the checkpoint ran code"
    assert str(ckpt) in line


def test_a_genuine_dcp_checkpoint_loads_through_the_restricted_reader(tmp_path):
    """What --fsdp saves (here in one process) still loads: weights and Adam's moments back bitwise."""
    _, policy, critic, opt, _ = tiny_training_state(seed=0)
    checkpoint._save_shards(tmp_path / "dcp", policy, critic, opt)
    _, policy2, critic2, opt2, _ = tiny_training_state(seed=1)
    checkpoint._load_shards(tmp_path / "dcp", policy2, critic2, opt2)
    for a, b in zip(list(policy.state_dict().values()) + list(critic.state_dict().values()),
                    list(policy2.state_dict().values()) + list(critic2.state_dict().values())):  # fmt: skip
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s1)
