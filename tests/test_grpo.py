"""grpo.py end to end on the CPU: every advantage and loss mode runs two steps, reward rises on the toy task,
bad input is one line; in process, the advantages the loss sees match numbers worked by hand, the loss is
normalised over the right counts, and the group mean is measured against K fresh Monte Carlo rollouts."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_rises,
    check_checkpoint,
    check_ok,
    check_one_error_line,
    check_results,
    cli,
    is_finite,
    read_metrics,
    run_here,
    run_in_process,
    step_rows,
)

import common
import gsm8k
import measure
from plumbing import errors, forward, generation, models

# Two prompts x four completions of up to 8 tokens, the MC measurement on one prompt with K = 2: seconds.
GRPO_TINY = {
    "model": "tiny",
    "batch-size": 2,
    "group-size": 4,
    "max-new-tokens": 8,
    "micro-batch-size": 4,
    "num-minibatches": 2,
    "mc-every": 1,
    "mc-prompts": 1,
    "mc-samples": 2,
    "eval-every": 0,
    "eval-size": 4,
    "test-size": 4,
    "eval-max-new-tokens": 8,
}

# Between them, every value of --scale-rewards, --loss-norm and --baseline, and --clip-eps-high.
MODES = {
    "grpo": dict(task="toy", scale_rewards="group", loss_norm="token", baseline="mean"),
    "dr-grpo clip-higher": dict(
        task="toy", scale_rewards="none", loss_norm="constant", baseline="mean", clip_eps_high=0.28
    ),
    "rloo sequence gsm8k": dict(task="gsm8k", scale_rewards="none", loss_norm="sequence", baseline="loo"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_runs_two_steps(tmp_path, mode):
    run_dir = tmp_path / "run"
    flags = dict(MODES[mode], total_steps=2)
    check_ok(run_here("grpo.py", cli(run_dir, GRPO_TINY, **flags)))

    results = check_results(run_dir, steps=2)
    variant = "group" if flags["scale_rewards"] == "group" else "group-unscaled"  # Dr. GRPO: no std division
    assert results["method"] == "grpo" and results["variant"] == variant and results["critic_params"] == 0
    assert results["mc_tokens"] > 0
    for key, value in flags.items():
        assert results["args"][key] == value

    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert is_finite(r["reward"]) and 0 <= r["reward"] <= 1
        assert is_finite(r["groups_all_equal"]) and 0 <= r["groups_all_equal"] <= 1
        for key in ("pg_loss", "entropy", "approx_kl", "clipfrac", "grad_norm", "kl_ref", "response_len"):
            assert is_finite(r[key]), f"{key} = {r.get(key)}"
        for name in ("group", "loo"):  # both baselines, whichever one trains
            for key in ("rmse", "bias", "sum_sq_err_nc", "sum_within_sq_nc"):
                assert is_finite(r[f"mc/{name}/{key}"]), f"mc/{name}/{key} = {r.get(f'mc/{name}/{key}')}"
            # scaled by the reward's variance at the states: none where every MC return is equal
            assert is_finite(r[f"mc/{name}/nmse"]) or r[f"mc/{name}/signal_fraction"] == 0
            # one measured prompt: its prompt state and up to --mc-states 2 states inside one completion
            assert 1 <= r[f"mc/{name}/n"] <= 3
        assert not any(k.startswith(("mc/value/", "mc/adv/", "mc/white/")) for k in r)
        assert r["mc/tokens"] > 0
    assert results["generated_tokens"] == rows[-1]["generated_tokens"] > 0
    assert "val/accuracy" in read_metrics(run_dir)[-1]
    check_checkpoint(run_dir, step=2)


@pytest.mark.slow
def test_reward_rises_on_the_toy_task(tmp_path):
    # Reward 1 when a completion of 4 tokens holds a token id divisible by 16 (~0.25 at the start). At this
    # learning rate seeds 1-12 all end at or near 1.0 by step 30 (most by step 20); at 3e-3 a third stay flat.
    flags = dict(
        seed=1,
        task="toy",
        total_steps=30,
        batch_size=4,
        group_size=8,
        max_new_tokens=4,
        lr=1e-2,
        kl_coef=0,
        micro_batch_size=32,
        num_minibatches=2,
        mc_every=0,
        eval_size=4,
        test_size=4,
        eval_max_new_tokens=4,
        scale="study",
    )
    check_ok(run_here("grpo.py", cli(tmp_path / "run", GRPO_TINY, **flags)))
    rewards = [r["reward"] for r in step_rows(tmp_path / "run")]
    assert len(rewards) == 30
    assert_rises(rewards, by=0.4, to=0.85)


# ------------------------------------------------------------------------------------------------------
# bad input: one line on stderr, starting 'error:', no traceback
# ------------------------------------------------------------------------------------------------------

BAD_INPUT = {
    "group of one": (dict(group_size=1), "--group-size"),
    "unknown loss norm": (dict(loss_norm="mean"), "--loss-norm"),
    "unknown baseline": (dict(baseline="median"), "--baseline"),
    "unknown reward scale": (dict(scale_rewards="batch"), "--scale-rewards"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line(tmp_path, case):
    flags, named = BAD_INPUT[case]
    line = check_one_error_line(run_here("grpo.py", cli(tmp_path / "run", GRPO_TINY, **flags)))
    assert named in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------------
# common.loss_weights against numbers worked by hand
# ------------------------------------------------------------------------------------------------------

LOSS_NORMS = ("token", "sequence", "constant")
# Two completions of 3 and 1 tokens, padded to 4.
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, n_tokens, n_seqs, expected",
    [
        # token: every token of the minibatch weighs 1 / (its tokens): 1/4 here
        ("token", 4, 2, [[1 / 4, 1 / 4, 1 / 4, 0], [1 / 4, 0, 0, 0]]),
        # sequence: 1 / (the sequence's length) / (sequences): 1/3/2 = 1/6 and 1/1/2 = 1/2
        ("sequence", 4, 2, [[1 / 6, 1 / 6, 1 / 6, 0], [1 / 2, 0, 0, 0]]),
        # constant: 1 / (sequences x max_len) = 1/(2 x 4) = 1/8, whatever the length
        ("constant", 4, 2, [[1 / 8, 1 / 8, 1 / 8, 0], [1 / 8, 0, 0, 0]]),
        # the same two rows as one micro-batch of a minibatch of 10 tokens in 4 sequences
        ("token", 10, 4, [[1 / 10, 1 / 10, 1 / 10, 0], [1 / 10, 0, 0, 0]]),
        ("sequence", 10, 4, [[1 / 12, 1 / 12, 1 / 12, 0], [1 / 4, 0, 0, 0]]),
        ("constant", 10, 4, [[1 / 16, 1 / 16, 1 / 16, 0], [1 / 16, 0, 0, 0]]),
    ],
)
def test_loss_weights_by_hand(mode, n_tokens, n_seqs, expected):
    w = common.loss_weights(MASK, mode, torch.tensor(float(n_tokens)), torch.tensor(float(n_seqs)), max_len=4)
    torch.testing.assert_close(w, torch.tensor(expected), atol=1e-7, rtol=0)


def test_loss_weights_of_a_whole_minibatch():
    """Summed over the minibatch: token and sequence weights make a mean (total 1); constant's total is the
    share of the budget the tokens used (4 of 2 x 4 here), so that shorter completions weigh less in all."""
    n_tok, n_seq = MASK.sum(), torch.tensor(2.0)
    totals = {mode: common.loss_weights(MASK, mode, n_tok, n_seq, 4).sum().item() for mode in LOSS_NORMS}
    assert totals == pytest.approx({"token": 1.0, "sequence": 1.0, "constant": 0.5})
    with pytest.raises(errors.UserError, match="--loss-norm"):
        common.loss_weights(MASK, "mean", n_tok, n_seq, 4)


# ------------------------------------------------------------------------------------------------------
# grpo.main() in process, with a hand-made reward vector
# ------------------------------------------------------------------------------------------------------

G = 4
# Three prompts x G completions. The third group is all equal: no learning signal, advantage 0.
HAND_REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
# Group 1: mean 1/4, sample std sqrt(((3/4)^2 + 3 (1/4)^2) / 3) = 1/2.
# Group 2: mean 1/2, sample std sqrt(4 (1/2)^2 / 3) = sqrt(1/3) = 0.57735.
# Leave-one-out: the mean of the other three: group 1: 1 - 0 = 1 and 0 - 1/3; group 2: 1 - 1/3 and 0 - 2/3.
S1, S2 = 0.5 + 1e-4, math.sqrt(1 / 3) + 1e-4  # grpo divides by std + 1e-4
HAND_ADVANTAGES = {
    ("none", "mean"): [3 / 4, -1 / 4, -1 / 4, -1 / 4, 1 / 2, 1 / 2, -1 / 2, -1 / 2, 0, 0, 0, 0],
    ("group", "mean"): [0.75 / S1, -0.25 / S1, -0.25 / S1, -0.25 / S1]
    + [0.5 / S2, 0.5 / S2, -0.5 / S2, -0.5 / S2]
    + [0] * 4,
    ("none", "loo"): [1, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3, 0, 0, 0, 0],
    ("group", "loo"): [1 / S1, -1 / 3 / S1, -1 / 3 / S1, -1 / 3 / S1]
    + [2 / 3 / S2, 2 / 3 / S2, -2 / 3 / S2, -2 / 3 / S2]
    + [0] * 4,
}
# The baseline each completion is compared with: the group mean, or the mean of the other three.
HAND_BASELINES = {
    "mean": [1 / 4] * 4 + [1 / 2] * 4 + [0] * 4,
    "loo": [0, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 0, 0, 0, 0],
}
# (scale, baseline, loss norm, clip_eps_high): the four advantage modes, each loss norm at least once
# where each watched function lives: the trainer calls it through that module, so the watch goes there
HOME = {
    "score": gsm8k,
    "generate": generation,
    "mc_values": measure,
    "baseline_error": measure,
    "length_sorted_micro_batches": forward,
    "clipped_surrogate": common,
    "loss_weights": common,
    "kl_estimate": common,
}
IN_PROCESS = {
    "group-mean": ("group", "mean", "token", None),
    "none-mean": ("none", "mean", "constant", 0.28),
    "group-loo": ("group", "loo", "sequence", None),
    "none-loo": ("none", "loo", "token", None),
}
MC_PROMPTS, MC_SAMPLES, MAX_NEW = 2, 3, 3


def watched_run(name: str, run_dir) -> dict:
    """One step of grpo.main() in process with the hand-made rewards, every call of interest recorded."""
    scale, baseline, norm, eps_high = IN_PROCESS[name]
    events: list[tuple] = []
    rec: dict = {"events": events, "generate": [], "mc_values": [], "baseline_error": [], "kl": []}
    real = {
        name: getattr(HOME[name], name)
        for name in (
            "score",
            "generate",
            "mc_values",
            "baseline_error",
            "length_sorted_micro_batches",
            "clipped_surrogate",
            "loss_weights",
            "kl_estimate",
        )
    }

    def kl_estimate(a, b, kind):
        rec["kl"].append((torch.is_grad_enabled(), kind, a.requires_grad, b.requires_grad))
        return real["kl_estimate"](a, b, kind)

    def score(task, texts, token_ids, golds):
        if len(texts) == len(HAND_REWARDS):  # the training batch; the MC rollouts and evaluation score truly
            return list(HAND_REWARDS)
        return real["score"](task, texts, token_ids, golds)

    def generate(model, prompts, **kw):
        ro = real["generate"](model, prompts, **kw)
        rec["generate"].append((len(prompts), kw.get("uniforms"), ro))
        return ro

    def mc_values(model, tokenizer, prompts, prefixes, golds, **kw):
        returns, used, generated = real["mc_values"](model, tokenizer, prompts, prefixes, golds, **kw)
        rec["mc_values"].append(
            dict(prompts=prompts, prefixes=prefixes, k=kw["k"], returns=returns.clone(), used=used, generated=generated)
        )
        return returns, used, generated

    def baseline_error(pred, mc, k, groups=None, weights=None, mc_var=None, signal_var=None):
        out = real["baseline_error"](pred, mc, k, groups, weights, mc_var, signal_var)
        rec["baseline_error"].append(dict(pred=pred, mc=mc, k=k, group=groups, weights=weights, out=out))
        return out

    def micro_batches(rows, lengths, micro):
        out = real["length_sorted_micro_batches"](rows, lengths, micro)
        events.append(("minibatch", [r.clone() for r in out]))
        return out

    def surrogate(logp, old_logp, adv, eps_low, eps_high=None):
        events.append(("surrogate", adv.detach().clone(), eps_low, eps_high))
        return real["clipped_surrogate"](logp, old_logp, adv, eps_low, eps_high)

    def loss_weights(mask, mode, n_tokens, n_seqs, max_len):
        events.append(("weights", mask.clone(), mode, float(n_tokens), float(n_seqs), max_len))
        return real["loss_weights"](mask, mode, n_tokens, n_seqs, max_len)

    flags = dict(
        task="toy",
        total_steps=1,
        batch_size=len(HAND_REWARDS) // G,
        group_size=G,
        max_new_tokens=MAX_NEW,
        micro_batch_size=3,  # two micro-batches per minibatch of 6
        num_minibatches=2,
        scale_rewards=scale,
        baseline=baseline,
        loss_norm=norm,
        clip_eps_high=eps_high,
        kl_coef=0,
        mc_every=1,
        mc_prompts=MC_PROMPTS,
        mc_samples=MC_SAMPLES,
        eval_size=1,
        test_size=1,
        no_test_before=True,  # the rollouts watched are the step's only
        eval_max_new_tokens=1,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gsm8k, "score", score)
        mp.setattr(generation, "generate", generate)
        mp.setattr(measure, "mc_values", mc_values)
        mp.setattr(measure, "baseline_error", baseline_error)
        mp.setattr(forward, "length_sorted_micro_batches", micro_batches)
        mp.setattr(common, "clipped_surrogate", surrogate)
        mp.setattr(common, "loss_weights", loss_weights)
        mp.setattr(common, "kl_estimate", kl_estimate)
        run_in_process("grpo", cli(run_dir, GRPO_TINY, **flags))
    rec["rows"] = step_rows(run_dir)
    rec["rollout"] = rec["generate"][0][2]  # the step's training rollout comes first
    return rec


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """watched(name): the recorded in-process run of IN_PROCESS[name], run once per module."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = watched_run(name, tmp_path_factory.mktemp(name) / "run")
        return cache[name]

    return get


def update_micro_batches(events: list[tuple]) -> list[dict]:
    """Pair every surrogate and loss_weights call with the rollout rows of its micro-batch and its minibatch.

    Each minibatch of the update calls length_sorted_micro_batches once, then the loss once per micro-batch;
    the reference pass before it calls length_sorted_micro_batches too, without a loss."""
    out, queue, minibatch = [], [], None
    for event in events:
        if event[0] == "minibatch":
            queue, minibatch = list(event[1]), torch.cat(event[1])
        elif event[0] == "surrogate":
            out.append(dict(rows=queue.pop(0), minibatch=minibatch, adv=event[1], eps=event[2:]))
        else:
            _, mask, mode, n_tok, n_seq, max_len = event
            out[-1].update(mask=mask, mode=mode, n_tok=n_tok, n_seq=n_seq, max_len=max_len)
    return out


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_the_loss_sees_the_hand_computed_advantages(watched, name):
    scale, baseline, norm, eps_high = IN_PROCESS[name]
    rec = watched(name)
    expected = torch.tensor(HAND_ADVANTAGES[(scale, baseline)])
    rmask = rec["rollout"].response_mask
    micro = update_micro_batches(rec["events"])
    assert len(micro) == 2 * 2 * 2  # update epochs x minibatches x micro-batches
    seen = torch.zeros(len(HAND_REWARDS), dtype=torch.long)
    for mb in micro:
        rows = mb["rows"]
        seen[rows] += 1
        assert torch.equal(mb["mask"], rmask[rows])
        # every token of a completion carries its completion's advantage; padding carries 0
        torch.testing.assert_close(mb["adv"], expected[rows, None] * rmask[rows], atol=1e-5, rtol=0)
        assert mb["eps"] == (0.2, eps_high)
    assert seen.tolist() == [2] * len(HAND_REWARDS), "every completion once per update epoch"
    row = rec["rows"][0]
    assert row["reward"] == pytest.approx(sum(HAND_REWARDS) / len(HAND_REWARDS))
    assert row["groups_all_equal"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_the_loss_is_normalised_over_the_whole_minibatch(watched, name):
    _, _, norm, _ = IN_PROCESS[name]
    rec = watched(name)
    rmask = rec["rollout"].response_mask
    for mb in update_micro_batches(rec["events"]):
        assert mb["mode"] == norm and mb["max_len"] == MAX_NEW
        assert mb["n_seq"] == len(mb["minibatch"]) == len(HAND_REWARDS) // 2  # the minibatch, not the micro-batch
        assert mb["n_tok"] == rmask[mb["minibatch"]].sum().item()


@pytest.mark.parametrize("name", ["group-mean", "group-loo"])
def test_the_baseline_is_measured_against_k_fresh_rollouts(watched, name):
    """Both baselines (the group mean and the leave-one-out mean, whichever one trains) are scored at the prompt
    and at token-weighted states inside one completion per measured group, against K fresh rollouts each."""
    rec = watched(name)
    ro = rec["rollout"]
    prompts = ro.prompt_ids  # the training prompts, left-padded, one row per completion
    pad = models.load_tokenizer("tiny").pad_token_id
    (mc,) = rec["mc_values"]
    assert mc["k"] == MC_SAMPLES
    # the measured completion of group j is row j * G: its prompt state first, then prefixes of its own tokens
    per_completion: list[list[int]] = [[] for _ in range(MC_PROMPTS)]
    j = -1
    for p, x in zip(mc["prompts"], mc["prefixes"]):
        if len(x) == 0:
            j += 1
        row = prompts[j * G]
        assert list(p) == row[row != pad].tolist()
        n = int(ro.lengths[j * G])
        assert list(x) == ro.response_ids[j * G, : len(x)].tolist() and len(x) < max(n, 1)
        per_completion[j].append(len(x))
    assert j == MC_PROMPTS - 1 and all(ts[0] == 0 for ts in per_completion)
    assert all(len(ts) == 1 + min(2, int(ro.lengths[j * G]) - 1) for j, ts in enumerate(per_completion))
    # K fresh rollouts per state, sampled with uniforms of their own (evaluation is greedy: no uniforms)
    fresh = [(n, u) for n, u, _ in rec["generate"][1:] if u is not None]
    assert sum(n for n, _ in fresh) == len(mc["prompts"]) * MC_SAMPLES
    assert not torch.equal(fresh[0][1][:, :MAX_NEW], rec["generate"][0][1][: fresh[0][0], :MAX_NEW])
    returns = mc["returns"]
    assert torch.equal(returns, returns.round()) and returns.shape == (len(mc["prompts"]), MC_SAMPLES)
    assert rec["rows"][0]["mc/tokens"] == mc["used"] > 0
    # no state writes past the completion's budget: T - t tokens from a state t tokens in
    assert mc["used"] <= sum(MC_SAMPLES * (MAX_NEW - len(x)) for x in mc["prefixes"])

    # in the order of measure.monte_carlo's baselines, each over every state, then its prompt states and inside ones
    assert len(rec["baseline_error"]) == 2 * len(measure.STATE_PARTS)
    group, loo = rec["baseline_error"][:: len(measure.STATE_PARTS)]
    for name, i in (("group", 1), ("loo", 1 + len(measure.STATE_PARTS))):
        prompt_states = rec["baseline_error"][i]
        assert prompt_states["out"]["n"] == MC_PROMPTS and rec["rows"][0][f"mc/{name}_prompt/n"] == MC_PROMPTS
    for report, base in ((group, "mean"), (loo, "loo")):
        assert report["k"] == MC_SAMPLES
        expected = [HAND_BASELINES[base][j * G] for j, ts in enumerate(per_completion) for _ in ts]
        torch.testing.assert_close(report["pred"], torch.tensor(expected).double(), atol=1e-6, rtol=0)
        torch.testing.assert_close(report["mc"], returns.mean(-1))
        # token weights: a completion's states weigh as many tokens as it has
        w = report["weights"].split([len(ts) for ts in per_completion])
        for j, wj in enumerate(w):
            assert wj.sum().item() == pytest.approx(max(1, int(ro.lengths[j * G])))
        assert report["group"].unique().numel() == MC_PROMPTS, "one id per measured prompt"
        # the bias by hand: the token-weighted mean of (baseline - p_hat)
        err = report["pred"] - report["mc"]
        bias = (report["weights"] * err).sum().item() / report["weights"].sum().item()
        assert report["out"]["bias"] == pytest.approx(bias)
    row = rec["rows"][0]
    assert row["mc/group/bias"] == pytest.approx(group["out"]["bias"])
    assert row["mc/loo/bias"] == pytest.approx(loo["out"]["bias"])
    assert not any(k.startswith(("mc/value/", "mc/adv/", "mc/white/")) for k in row)


def test_approx_kl_samples_the_old_policy(watched):
    """approx_kl estimates KL(old || new) from the rollout's samples of the old policy: kl_estimate(old_logp,
    logp, "k3"), the old (no gradient) first; it was the reverse, which estimates another quantity."""
    approx = [c for c in watched("group-mean")["kl"] if c[1] == "k3" and not c[0]]
    assert approx and all(not a_grad and b_grad for _, _, a_grad, b_grad in approx), approx
