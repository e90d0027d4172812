"""Value pretraining (critics.py, study/pretrain_critic.py) and ppo.py --critic-init: the fit regresses every response
state on its rollout's reward and leaves the policy as it was; a critic saved and loaded gives the same values; a
stopped pretraining resumes with only what is missing; ppo.py loads the file, records its cost apart and spends it
from the budget when asked; bad values and foreign files are one `error:` line."""

from __future__ import annotations

import ast
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import REPO, check_ok, check_one_error_line, cli, run_here, step_rows

import critics
from critics import build_critic
from plumbing import errors, models, rollout

TOOL = "study.pretrain_critic"
# The tool on the tiny model: a few seconds (toy reward: a target token appears)
TOOL_TINY = ["--model", "tiny", "--task", "toy", "--max-new-tokens", "8", "--holdout", "16", "--chunk", "16",
             "--no-progress"]  # fmt: skip
# ppo.py with the same sampling (the critic file refuses another --max-new-tokens, --task or --prompt-format)
PPO_TINY = dict(task="toy", max_new_tokens=8, eval_max_new_tokens=8, total_steps=1, mc_every=0)


def tool(out: Path, *flags: str) -> list[str]:
    return [*TOOL_TINY, "--out", str(out), *flags]


def tiny_policy(seed: int = 1):
    tok = models.load_tokenizer("tiny")
    return models.load_model("tiny", tok, seed).requires_grad_(False), tok


def fake_rollouts(tok, n: int = 12, seed: int = 0):
    """Token lists of the tiny tokenizer's vocabulary and 0/1 scores: what a fit reads, without sampling."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(tok)
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]  # fmt: skip
    responses = [torch.randint(3, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]  # fmt: skip
    scores = (torch.rand(n, generator=g) < 0.5).double().tolist()
    return prompts, responses, scores


def values_of(policy, critic, tok, prompts, responses) -> torch.Tensor:
    ids, mask, P = rollout.join_prompt_response(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        return critics.critic_values(policy, critic, ids, mask, P)


# ------------------------------------------------------------------------------------------------------
# the fit and the file (critics.py)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", ["small", "full"])
def test_the_values_fitted_are_the_ones_ppos_training_forward_reads(capacity):
    """critic_values: V(s_t) at the same states as forward.PolicyForward's values (position P + t - 1), so that a
    critic pretrained here predicts, in ppo.py, what it was fitted to predict."""
    from plumbing import forward

    policy, tok = tiny_policy()
    prompts, responses, _ = fake_rollouts(tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        critic = build_critic(capacity, policy.config.hidden_size, policy)
        for p in critic.parameters():  # the zero-initialised output layer would make any two readings agree
            torch.nn.init.normal_(p, std=0.1)
    ids, mask, P = rollout.join_prompt_response(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        trained = forward.PolicyForward(policy, critic)(ids, mask, P)[2]
    # the same fp32 sums over other padding widths (PolicyForward trims to a multiple of 8): last bits only
    torch.testing.assert_close(values_of(policy, critic, tok, prompts, responses), trained, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("capacity", ["small", "full"])
def test_the_first_loss_is_every_state_regressed_on_its_rollouts_reward(capacity):
    """One step on all rollouts from a zero-initialised critic (V = 0): the loss is 0.5 R^2 averaged over every
    response token, each token's target its own rollout's score (the PPO way, a plain loop here); then it falls."""
    policy, tok = tiny_policy()
    prompts, responses, scores = fake_rollouts(tok)
    lr = 1e-3 if capacity == "full" else 1e-2
    critic, report = critics.build_and_fit(
        capacity, policy, 1, prompts=prompts, responses=responses, scores=scores, lr=lr, epochs=6,
        batch_size=len(prompts), pad_id=tok.pad_token_id, micro=5,
    )  # fmt: skip
    tokens = sum(len(r) for r in responses)
    expected = sum(0.5 * s * s * len(r) for r, s in zip(responses, scores)) / tokens
    assert report["losses"][0] == pytest.approx(expected, rel=1e-5)
    assert report["final_loss"] < report["losses"][0]
    assert report["trained_tokens"] == tokens * 6


@pytest.mark.parametrize("capacity", ["small", "full"])
def test_pretraining_leaves_the_policy_bitwise_unchanged(capacity):
    policy, tok = tiny_policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    fingerprint = critics.model_fingerprint(policy)
    prompts, responses, scores = fake_rollouts(tok)
    critics.build_and_fit(capacity, policy, 1, prompts=prompts, responses=responses, scores=scores, lr=1e-2,
                           epochs=2, batch_size=4, pad_id=tok.pad_token_id)  # fmt: skip
    assert critics.model_fingerprint(policy) == fingerprint
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def test_the_fingerprint_tells_one_bit_apart():
    policy, _ = tiny_policy()
    fingerprint = critics.model_fingerprint(policy)
    with torch.no_grad():
        w = next(policy.parameters())
        w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))
    assert critics.model_fingerprint(policy) != fingerprint


@pytest.mark.parametrize("capacity", ["small", "large", "full"])
def test_a_pretrained_critic_saved_and_loaded_gives_the_same_values(tmp_path, capacity):
    policy, tok = tiny_policy()
    prompts, responses, scores = fake_rollouts(tok)
    critic, _ = critics.build_and_fit(capacity, policy, 1, prompts=prompts, responses=responses, scores=scores,
                                       lr=1e-2, epochs=2, batch_size=4, pad_id=tok.pad_token_id)  # fmt: skip
    path = tmp_path / "critic.safetensors"
    written = critics.save_critic_file(path, critic, {"capacity": capacity, "rollouts": 12})
    assert critics.read_critic_record(path) == written and written["capacity"] == capacity
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(99)  # another init: the file's weights must replace it
        fresh = build_critic(capacity, policy.config.hidden_size, policy)
    assert not torch.equal(values_of(policy, fresh, tok, prompts, responses),
                           values_of(policy, critic, tok, prompts, responses))  # fmt: skip
    critics.load_critic_file(path, fresh)
    assert torch.equal(values_of(policy, fresh, tok, prompts, responses),
                       values_of(policy, critic, tok, prompts, responses))  # fmt: skip
    assert not list(tmp_path.glob(".*tmp*")), "the atomic write left its temporary file"


def test_a_critic_file_with_a_changed_weight_is_damage(tmp_path):
    policy, _ = tiny_policy()
    critic = build_critic("small", policy.config.hidden_size)
    path = tmp_path / "critic.safetensors"
    critics.save_critic_file(path, critic, {"capacity": "small"})
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a bit of the last tensor's data; the header still parses
    path.write_bytes(bytes(data))
    with pytest.raises(errors.UserError, match="damaged: its weights are not the ones"):
        critics.load_critic_file(path, build_critic("small", policy.config.hidden_size))


# ------------------------------------------------------------------------------------------------------
# the tool (study/pretrain_critic.py)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--rollouts", "-5"], "--rollouts -5"),
        (["--rollouts", "0"], "--rollouts 0"),
        (["--critics", "huge"], "huge"),
        (["--critics", "none"], "none"),
        (["--epochs", "0"], "--epochs"),
        (["--holdout", "-1"], "--holdout"),
        (["--measure", "--mc-samples", "1"], "--mc-samples"),
        (["--measure", "--mc-prompts", "32"], "--mc-prompts 32"),
    ],
)
def test_the_tool_refuses_bad_values_in_one_line_and_writes_nothing(tmp_path, flags, named):
    line = check_one_error_line(run_here(TOOL, tool(tmp_path / "out", "--rollouts", "16", *flags)))
    assert named in line
    assert not (tmp_path / "out").exists()


def test_the_tool_refuses_a_prompt_format_the_organism_cannot_read_before_building_it(tmp_path, monkeypatch):
    """As the trainers do (runtime.cli): organism-large is not built (minutes) for a pretraining that would refuse it."""
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    flags = ["--model", "organism-large", "--prompt-format", "chat", "--out", str(tmp_path / "out"), "--no-progress"]
    proc = run_here(TOOL, flags)
    assert "--prompt-format chat: the organism learned the question alone" in check_one_error_line(proc)
    assert "building" not in proc.stdout and not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_the_tool_imports_the_method_and_never_a_trainer():
    tree = ast.parse((REPO / "study" / "pretrain_critic.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "critics" in names and "measure" in names
    assert not names & {"ppo", "grpo", "dpo", "preflight", "report", "sweep_runner"}


def test_a_stopped_pretraining_resumes_with_only_what_is_missing(tmp_path, monkeypatch):
    """SIGTERM after the second of three chunks: the run stops with those two saved; the same command again makes the
    third alone, then the critic, which is bit for bit an uninterrupted run's; a third time makes nothing."""
    import study.pretrain_critic as tool_module

    calls: list[int] = []
    real_sample, real_fit = tool_module.Work.sample, critics.fit_critic
    fits: list[int] = []

    def sample(self, idx, stream, step):
        calls.append(step)
        out = real_sample(self, idx, stream, step)
        if stop_after and len(calls) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # the tool's handler sets its flag; it stops after saving
        return out

    def fit(*a, **kw):
        fits.append(1)
        return real_fit(*a, **kw)

    monkeypatch.setattr(tool_module.Work, "sample", sample)
    monkeypatch.setattr(critics, "fit_critic", fit)
    flags = ("--rollouts", "40", "--critics", "small", "--epochs", "2")
    stop_after = 2
    first = run_here(TOOL, tool(tmp_path / "out", *flags))
    check_ok(first)
    assert "stopped by SIGTERM" in first.stdout and calls == [0, 1] and not fits
    assert sorted(p.name for p in (tmp_path / "out" / "rollouts").glob("chunk-*")) == [
        "chunk-00000.pt",
        "chunk-00001.pt",
    ]
    assert not (tmp_path / "out" / "critic-small-n40.safetensors").exists()

    stop_after, calls[:] = 0, []
    second = run_here(TOOL, tool(tmp_path / "out", *flags))
    check_ok(second)
    assert calls == [2] and len(fits) == 1, "only the missing chunk and the fit"
    assert "(1 chunk made now, 2 reused)" in second.stdout

    calls[:], fits[:] = [], []
    check_ok(run_here(TOOL, tool(tmp_path / "straight", *flags)))  # the same work, never stopped
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / run / "critic-small-n40.safetensors")) for run in ("out", "straight"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (
        critics.read_critic_record(tmp_path / run / "critic-small-n40.safetensors") for run in ("out", "straight")
    )
    assert {k: v for k, v in ra.items() if k != "fit_seconds"} == {k: v for k, v in rb.items() if k != "fit_seconds"}

    calls[:], fits[:] = [], []
    check_ok(run_here(TOOL, tool(tmp_path / "out", *flags)))
    assert calls == [] and fits == [], "everything was there: nothing made again"


def test_a_folder_of_other_settings_is_refused(tmp_path):
    check_ok(run_here(TOOL, tool(tmp_path / "out", "--rollouts", "16", "--epochs", "1")))
    line = check_one_error_line(run_here(TOOL, tool(tmp_path / "out", "--rollouts", "16", "--temperature", "0.5")))
    assert "temperature" in line and "choose another --out" in line
    line = check_one_error_line(run_here(TOOL, tool(tmp_path / "out", "--rollouts", "16", "--epochs", "2")))
    assert "critic-small-n16" in line


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A small critic pretrained on 32 rollouts of the tiny model (seed 1), and the held-out curve beside it. Made in
    this process, after whatever tests its worker ran before: a run leaves nothing to the next
    (test_in_process.py's test_a_runs_memory_check_is_not_the_next_runs)."""
    out = tmp_path_factory.mktemp("pretrained") / "out"
    flags = ("--rollouts", "16", "32", "--critics", "small", "--measure", "--mc-prompts", "8", "--mc-chunk", "4",
             "--mc-samples", "5")  # fmt: skip
    check_ok(run_here(TOOL, tool(out, *flags)))
    return out


POOLED = ("--critics", "small", "--measure", "--mc-prompts", "8", "--mc-chunk", "4", "--mc-samples", "5")


def test_pool_from_reuses_the_rollouts_and_targets_and_makes_only_the_fits(pretrained, tmp_path, monkeypatch):
    """--pool-from: another fit's settings on the pool and held-out Monte Carlo of `pretrained`, linked, none of it
    sampled again; its constant rows (the pool's mean, no fit) equal the source's, its critic's fit is its own."""
    import study.pretrain_critic as tool_module

    sampled: list[int] = []
    real_sample = tool_module.Work.sample
    monkeypatch.setattr(tool_module.Work, "sample", lambda self, *a: sampled.append(1) or real_sample(self, *a))
    out = tmp_path / "other-fit"
    proc = run_here(TOOL, tool(out, "--rollouts", "32", "--lr", "3e-3", "--epochs", "2", "--pool-from",
                               str(pretrained), *POOLED))  # fmt: skip
    check_ok(proc)
    assert sampled == [], "a rollout or a Monte Carlo sample was made again"
    assert "chunks of rollouts and held-out Monte Carlo linked" in proc.stdout
    mine, source = (json.loads((d / "curve.json").read_text()) for d in (out, pretrained))
    rows = lambda c: {(r["capacity"], r["rollouts"]): r for r in c["rows"]}  # noqa: E731
    assert rows(mine)["constant", 32]["prompt"] == rows(source)["constant", 32]["prompt"]
    record = critics.read_critic_record(out / "critic-small-n32.safetensors")
    assert (record["lr"], record["epochs"]) == (3e-3, 2)
    assert rows(mine)["small", 32]["prompt"]["nmse"] != rows(source)["small", 32]["prompt"]["nmse"]
    assert (pretrained / "rollouts" / "chunk-00000.pt").stat().st_ino == (
        out / "rollouts" / "chunk-00000.pt"
    ).stat().st_ino


@pytest.mark.parametrize("case", ["other sampling", "missing", "itself"])
def test_pool_from_refuses_in_one_line_and_links_nothing(pretrained, tmp_path, case):
    out = tmp_path / "out"
    flags = {
        "other sampling": ("--pool-from", str(pretrained), "--temperature", "0.5"),
        "missing": ("--pool-from", str(tmp_path / "nowhere")),
        "itself": ("--pool-from", str(out)),
    }[case]
    if case == "itself":
        out.mkdir()
    line = check_one_error_line(run_here(TOOL, tool(out, "--rollouts", "32", *POOLED, *flags)))
    assert "--pool-from" in line and ("temperature" in line if case == "other sampling" else True)
    assert not (out / "rollouts").exists() and not (out / "heldout").exists()


def test_the_record_says_what_the_critic_was_fitted_on(pretrained):
    record = critics.read_critic_record(pretrained / "critic-small-n32.safetensors")
    chunks = [torch.load(p, weights_only=True) for p in sorted((pretrained / "rollouts").glob("chunk-*.pt"))]
    assert record["rollouts"] == 32 and record["tokens"] == sum(int(c["response_len"].sum()) for c in chunks)
    held = record["holdout"]
    assert record["prompts"] and max(record["prompts"]) < held["first"], "a held-out prompt was pretrained on"
    assert record["model"]["fingerprint"] == critics.model_fingerprint(tiny_policy(1)[0])
    assert record["sampling"] == {"task": "toy", "temperature": 1.0, "max_new_tokens": 8, "prompt_format": "chat"}
    assert record["lr"] == 1e-3 and record["epochs"] == 4 and record["seed"] == 1
    assert len(record["losses"]) == 4 and record["final_loss"] == record["losses"][-1]


def test_the_curve_holds_each_critic_and_its_g_star(pretrained):
    curve = json.loads((pretrained / "curve.json").read_text())
    rows = {(r["capacity"], r["rollouts"]): r for r in curve["rows"]}
    assert set(rows) == {("constant", 16), ("constant", 32), ("small", 16), ("small", 32), ("linear", None)}
    linear = rows.pop(("linear", None))  # the ceiling: no pretraining rollouts, fitted on held-out Monte Carlo
    assert linear["folds"] == 8 and linear["prompt"]["states"] == 8 and set(linear["penalties"]) <= {"prompt", "inside"}
    assert curve["heldout"]["prompts"] == 8 and curve["grpo_prompt_nmse"]["8"] == pytest.approx(1 / 7)
    measured = curve["grpo_prompt_measured"]  # K = 5 measures the groups of 2 and 4 (K >= G + 1), on every prompt
    assert set(measured) == {"2", "4"} and all(m["prompts"] == 8 for m in measured.values())
    for r in rows.values():
        p = r["prompt"]
        assert p["states"] == 8
        if p["nmse"] is not None and p["nmse"] > 0:
            assert p["g_star"][0] == pytest.approx(1 + 1 / p["nmse"])
    assert rows["constant", 32]["value_explained_variance"] == pytest.approx(0, abs=1e-6)  # a constant explains none
    lines = (pretrained / "curve.csv").read_text().splitlines()
    assert len(lines) == 2 + len(rows) and lines[0].startswith("capacity,rollouts,tokens")  # and the linear row
    for (capacity, n), r in rows.items():  # paired differences: centred on the two pooled nmse's difference
        for part in ("prompt", "all"):
            against = {"vs_linear": linear[part]["nmse"]}
            if capacity != "constant":
                against["vs_constant"] = rows["constant", n][part]["nmse"]
            assert set(k for k in r[part] if k.startswith("vs_")) == set(against)
            for key, ref in against.items():
                d = r[part][key][0]
                if d is not None and ref is not None and r[part]["nmse"] is not None:
                    assert d == pytest.approx(r[part]["nmse"] - ref, rel=1e-9, abs=1e-12)
    assert "vs_linear" not in linear["prompt"] and "vs_constant" not in linear["prompt"]


def test_a_paired_difference_cancels_the_noise_the_prompts_share():
    """Two baselines on the same held-out prompts: the prompts' own noise moves both, so the difference's interval
    is far narrower than either one's; a critic 0.05 below the constant on every prompt is told apart (its paired
    interval below 0) while the two rows' own intervals overlap."""
    import intervals
    from study import pretrain_critic as pc

    g = torch.Generator().manual_seed(0)
    signal = (0.1 + torch.rand(64, generator=g)).tolist()  # each prompt's E[p(1-p)] sum
    noisy = [s * (0.3 + 0.5 * torch.rand(1, generator=g).item()) for s in signal]  # the constant's error sums
    closer = [e - 0.05 * s + 0.002 * torch.randn(1, generator=g).item() for e, s in zip(noisy, signal)]
    rows = [
        {"capacity": "constant", "rollouts": 8, "prompt": {}},
        {"capacity": "small", "rollouts": 8, "prompt": {}},
        {"capacity": "small", "rollouts": 16, "prompt": {}},
        {"capacity": "linear", "rollouts": None, "prompt": {}},
    ]
    units = [{"prompt": (noisy, signal)}, {"prompt": (closer, signal)}, {"prompt": (closer, signal)},
             {"prompt": (noisy, signal)}]  # fmt: skip
    pc.paired_differences(rows, units)
    d, lo, hi = rows[1]["prompt"]["vs_constant"]
    assert d == pytest.approx(sum(closer) / sum(signal) - sum(noisy) / sum(signal)) and lo < d < hi < 0
    assert d == pytest.approx(-0.05, abs=0.002)
    _, c_lo, c_hi = intervals.ratio_interval(noisy, signal)
    _, s_lo, s_hi = intervals.ratio_interval(closer, signal)
    assert s_hi > c_lo  # unpaired, the two rows' intervals overlap: only the pairing tells them apart
    assert (hi - lo) < (c_hi - c_lo) / 5
    assert "vs_constant" not in rows[2]["prompt"]  # no constant at 16 rollouts: nothing to pair with
    assert "vs_constant" not in rows[0]["prompt"] and rows[0]["prompt"]["vs_linear"][0] == pytest.approx(0)
    assert "vs_linear" not in rows[3]["prompt"] and "vs_constant" not in rows[3]["prompt"]


def test_the_ridge_reads_a_linear_target_and_its_penalty_grows_with_the_noise():
    from study import readout

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10, 0.1, 1, 1, 1])  # scales differ
    beta = torch.tensor([0.5, -0.02, 3.0, 0.0, 0.1, 0.0], dtype=torch.float64)
    y = 0.3 + x @ beta
    clean = readout.choose_penalty(x, y)
    assert clean == min(readout.PENALTIES)
    assert torch.allclose(readout.ridge(x, y, clean)(x), y, atol=0.05)  # a linear target read back
    noise = torch.randn(200, generator=g, dtype=torch.float64)
    assert readout.choose_penalty(x, noise) > 100 * clean  # nothing to read: the fit shrinks towards the mean


def test_the_linear_read_out_is_cross_fitted_a_prompts_values_from_the_fold_that_never_saw_it(monkeypatch):
    """Changing one prompt's Monte Carlo targets moves the values of the other fold's completions only: no completion's
    read-out was fitted on its own prompt's targets (an honest ceiling, not an in-sample one)."""
    from types import SimpleNamespace

    from study import pretrain_critic as pc

    g = torch.Generator().manual_seed(1)
    n, length, hidden = 12, 5, 4
    states = [torch.randn(length, hidden, generator=g) for _ in range(n)]
    monkeypatch.setattr(pc.critics, "response_states", lambda *a, **k: states)
    row = torch.arange(n).repeat_interleave(2)
    t = torch.tensor([0, 3] * n)
    mc = torch.stack([states[j][s] for j, s in zip(row.tolist(), t.tolist())]) @ torch.ones(hidden) / 10 + 0.5
    held = {"prompts": [[1]] * n, "responses": [[2] * length] * n, "row": row, "t": t, "mc": mc.double()}
    me = SimpleNamespace(
        policy=None, tokenizer=SimpleNamespace(pad_token_id=0), args=SimpleNamespace(micro_batch_size=4)
    )
    before, penalties = pc.Work.linear_values(me, held)
    assert set(penalties) == {"prompt", "inside"} and all(len(v) == pc.FOLDS for v in penalties.values())
    changed = dict(held, mc=held["mc"].clone())
    changed["mc"][row == 0] += 1.0  # prompt 0, fold 0
    after, _ = pc.Work.linear_values(me, changed)
    fold = torch.arange(n) % pc.FOLDS
    assert torch.equal(after[fold == 0], before[fold == 0])  # fold 0's values come from the fit on the others
    assert all(not torch.equal(after[fold == f], before[fold == f]) for f in range(1, pc.FOLDS))
    assert (before[:, 1:] != 0).all() and (before != 0).all()  # every state read, the prompt's and inside


# ------------------------------------------------------------------------------------------------------
# ppo.py --critic-init
# ------------------------------------------------------------------------------------------------------


def test_ppo_loads_the_critic_and_records_its_pretraining_apart(pretrained, tmp_path, monkeypatch):
    """The critic ppo.py trains from is the file's, bit for bit; results.json's critic_init and every metrics row say
    the pretraining's rollouts and tokens, apart from the training's generated_tokens."""
    path = pretrained / "critic-small-n32.safetensors"
    loaded = []
    real = critics.load_critic_init

    def watched(args, critic, policy):
        out = real(args, critic, policy)
        loaded.append({k: v.clone() for k, v in critic.state_dict().items()})
        return out

    monkeypatch.setattr(critics, "load_critic_init", watched)
    run_dir = tmp_path / "run"
    check_ok(run_here("ppo.py", cli(run_dir, **PPO_TINY, critic="small", critic_init=path)))
    from safetensors.torch import load_file

    assert all(torch.equal(loaded[0][k], v) for k, v in load_file(str(path)).items())
    results = json.loads((run_dir / "results.json").read_text())
    record = critics.read_critic_record(path)
    init = results["critic_init"]
    assert init["rollouts"] == 32 and init["tokens"] == record["tokens"] and init["paid"] is False
    assert init["critic_sha256"] == record["tensors_sha256"]
    rows = step_rows(run_dir)
    assert results["generated_tokens"] == rows[-1]["generated_tokens"] <= 8 * 8, "one step of 8 rollouts, no more"
    assert all(r["critic_init/tokens"] == record["tokens"] and r["critic_init/rollouts"] == 32 for r in rows)


def test_paid_pretraining_is_spent_from_the_token_budget(pretrained, tmp_path):
    """--count-critic-init-tokens: training gets the budget less the pretraining's tokens, and stops there (one step);
    amortised, the same budget trains on (three steps, the cap, under it)."""
    path = pretrained / "critic-small-n32.safetensors"
    tokens = critics.read_critic_record(path)["tokens"]
    budget = tokens + 40  # a step of 8 rollouts writes at most 64 tokens: paid, one step
    assert budget > 3 * 64, "the amortised run must not reach the budget in its three steps"
    steps = {}
    for paid in (True, False):
        run_dir = tmp_path / f"paid-{paid}"
        flags = dict(PPO_TINY, total_steps=3, token_budget=budget, count_critic_init_tokens=paid or None)
        check_ok(run_here("ppo.py", cli(run_dir, **flags, critic="small", critic_init=path)))
        results = json.loads((run_dir / "results.json").read_text())
        steps[paid] = results["steps"]
        assert results["critic_init"]["paid"] is paid
        if paid:
            assert results["args"]["token_budget"] == 40 and results["critic_init"]["token_budget"] == budget
            assert 40 <= results["generated_tokens"] < 40 + 64
        else:
            assert results["args"]["token_budget"] == budget and "token_budget" not in results["critic_init"]
    assert steps == {True: 1, False: 3}


def test_a_paid_run_continued_without_the_flag_ends_where_the_amortised_run_ends(pretrained, tmp_path):
    """The sweep's fork (study/twins.py): a paid run is the amortised run stopped early, so its last checkpoint,
    copied by the runner and resumed without --count-critic-init-tokens, takes the amortised run's remaining steps and
    ends bitwise where the straight amortised run ends: each step's numbers, the weights, the test answers, and no
    metrics row set aside. Any other change of the budget on a resume is refused (amortised to paid, another
    --token-budget)."""
    from safetensors.torch import load_file

    from study import sweep_runner, twins

    path = pretrained / "critic-small-n32.safetensors"
    budget = critics.read_critic_record(path)["tokens"] + 40  # paid: one step of the three (the test above)

    def flags(paid: bool) -> dict:
        return dict(PPO_TINY, total_steps=3, token_budget=budget, count_critic_init_tokens=paid or None,
                    critic="small", critic_init=path, eval_every=1)  # fmt: skip

    straight, paid, forked = tmp_path / "straight", tmp_path / "paid", tmp_path / "forked"
    check_ok(run_here("ppo.py", cli(straight, **flags(False))))
    argv = cli(paid, **flags(True))
    check_ok(run_here("ppo.py", argv))
    paid_flags = argv[2:]  # after --run-dir: the flags the two runs share, and the paid one's own
    (tmp_path / "paid.log").write_text(f"=== 2026-12-07 10:00:00 python ppo.py {' '.join(paid_flags)}\n")  # its start
    twin = sweep_runner.Run("x", "paid", 1, "ppo.py", paid_flags, paid)
    mine = [f for f in paid_flags if f != twins.PAID]
    run = sweep_runner.Run("x", "amortised", 1, "ppo.py", mine, forked, continues=twin)
    note = twins.fork(run, ["python", "ppo.py", *paid_flags], tmp_path / "paid.log")
    assert note == " (continuing x/paid's 1 steps)", note
    check_ok(run_here("ppo.py", cli(forked, **flags(False), resume=True)))
    timing = ("time/", "tokens_per_s", "/seconds")
    rows = [[{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in step_rows(d)]
            for d in (straight, forked)]  # fmt: skip
    assert len(rows[0]) == 3 and rows[0] == rows[1], "the continued run logs the straight run's steps, once each"
    results = [json.loads((d / "results.json").read_text()) for d in (straight, forked)]
    assert results[0]["steps"] == results[1]["steps"] == 3 and results[1]["critic_init"]["paid"] is False
    assert results[0]["test"]["correct"] == results[1]["test"]["correct"]
    weights = [load_file(str(d / "checkpoint" / "policy" / "model.safetensors")) for d in (straight, forked)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not list(forked.glob("metrics.jsonl.discarded-*")), "the fork copies the rows its checkpoint counts"

    # only from paid to amortised: an amortised checkpoint resumed as paid, or at another budget, is refused (and
    # under a decaying learning rate, which follows the budget: the test below)
    (straight / "results.json").unlink()  # a run killed after its last save
    for other in (flags(True), dict(flags(False), token_budget=budget + 8)):
        line = check_one_error_line(run_here("ppo.py", cli(straight, **other, resume=True)))
        assert "essential arguments differ" in line and "token_budget" in line


@pytest.mark.parametrize(
    ("saved", "now", "allowed"),
    [
        (dict(count_critic_init_tokens=True, lr_schedule="constant"), dict(count_critic_init_tokens=False), True),
        (dict(count_critic_init_tokens=True, lr_schedule="linear"), dict(count_critic_init_tokens=False), False),
        (dict(count_critic_init_tokens=True, lr_schedule="cosine"), dict(count_critic_init_tokens=False), False),
        (dict(count_critic_init_tokens=False, lr_schedule="constant"), dict(count_critic_init_tokens=True), False),
        (dict(count_critic_init_tokens=False, lr_schedule="constant"), dict(count_critic_init_tokens=False), False),
        (dict(lr_schedule="constant"), dict(), False),  # grpo.py, dpo.py: no such flag
    ],
)
def test_only_a_paid_save_resumed_as_amortised_under_a_constant_learning_rate_may_change_its_budget(
    saved, now, allowed
):
    """checkpoint.may_differ: a decaying learning rate follows the budget, so a paid run's first step already had
    another learning rate than its amortised twin's; the other direction would train an amortised run's steps under
    the paid price."""
    from plumbing import checkpoint

    now = {"lr_schedule": saved["lr_schedule"], **now}
    saved, now = {**saved, "token_budget": 100}, {**now, "token_budget": 150}
    assert checkpoint.may_differ("token_budget", saved, now) is allowed
    assert checkpoint.may_differ("count_critic_init_tokens", saved, now) is allowed
    assert not checkpoint.may_differ("lr", {**saved, "lr": 1.0}, {**now, "lr": 2.0})


@pytest.mark.parametrize("case", ["critic none", "another capacity", "another model", "another sampling", "missing",
                                  "damaged", "budget spent", "no budget", "count without a file"])  # fmt: skip
def test_ppo_refuses_a_critic_file_it_cannot_use_in_one_line(pretrained, tmp_path, case):
    path = pretrained / "critic-small-n32.safetensors"
    tokens = critics.read_critic_record(path)["tokens"]
    if case == "damaged":
        (tmp_path / "damaged.safetensors").write_bytes(path.read_bytes()[:200])
    flags = {
        "critic none": dict(critic="none", critic_init=path),
        "another capacity": dict(critic="medium", critic_init=path),
        "another model": dict(critic="small", critic_init=path, seed=2),  # the tiny model's weights are seeded
        "another sampling": dict(critic="small", critic_init=path, max_new_tokens=16),
        "missing": dict(critic="small", critic_init=tmp_path / "nope.safetensors"),
        "damaged": dict(critic="small", critic_init=tmp_path / "damaged.safetensors"),
        "budget spent": dict(critic="small", critic_init=path, token_budget=tokens, count_critic_init_tokens=True),
        "no budget": dict(critic="small", critic_init=path, count_critic_init_tokens=True),
        "count without a file": dict(critic="small", count_critic_init_tokens=True),
    }[case]
    line = check_one_error_line(run_here("ppo.py", cli(tmp_path / "run", **{**PPO_TINY, **flags})))
    assert "--critic-init" in line or "--count-critic-init-tokens" in line
    named = {"another model": "another policy", "another sampling": "--max-new-tokens 8", "damaged": "damaged",
             "budget spent": "nothing would be left", "missing": "no such file"}  # fmt: skip
    assert named.get(case, "") in line
    assert not (tmp_path / "run").exists(), "a refused run leaves no folder"
