"""Each loss and statistic against a plain Python loop (fixed seeds, several shapes, masks with padding)."""

import math
import statistics

import pytest
import torch

import common
from plumbing import errors, forward


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] in fp32: the plain reference for the chunked LM head.  [..., V], [...] -> [...]"""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


SHAPES = [(1, 1), (3, 7), (4, 16), (8, 5)]


def _mask(B, T, seed, min_len=1):
    """Right-padded mask from random lengths in [min_len, T]; one row is always full."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, T + 1, (B,), generator=g)
    lengths[0] = T
    return (torch.arange(T)[None, :] < lengths[:, None]).float(), lengths.tolist()


def _masked_values(x, mask):
    return [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t] > 0]


# ---------------------------------------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("B,T", SHAPES)
def test_masked_mean_and_var(B, T):
    torch.manual_seed(B * 100 + T)
    x = torch.randn(B, T) * 3 + 1
    mask, _ = _mask(B, T, seed=T)
    vals = _masked_values(x, mask)
    assert common.masked_mean(x, mask).item() == pytest.approx(statistics.fmean(vals), rel=1e-5, abs=1e-6)
    assert common.masked_mean(x, mask, global_=True).item() == pytest.approx(statistics.fmean(vals), rel=1e-5)
    expected_var = statistics.variance(vals) if len(vals) > 1 else 0.0
    assert common.masked_var(x, mask).item() == pytest.approx(expected_var, rel=1e-5, abs=1e-6)


def test_masked_var_of_one_value_is_zero():
    x, mask = torch.tensor([[3.0, 5.0, 7.0]]), torch.tensor([[1.0, 0.0, 0.0]])
    assert common.masked_var(x, mask).item() == 0.0
    assert common.masked_var(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_has_no_fp32_cancellation():
    # a large mean and a small spread: E[x^2] - E[x]^2 in fp32 would give 0 here
    torch.manual_seed(0)
    x = (1000 + 0.01 * torch.randn(4, 250)).float()
    mask = torch.ones_like(x)
    expected = statistics.variance(x.double().flatten().tolist())
    assert common.masked_var(x, mask).item() == pytest.approx(expected, rel=1e-3)


def test_masked_mean_gradient():
    x = torch.randn(3, 4, requires_grad=True)
    mask, _ = _mask(3, 4, seed=1)
    common.masked_mean(x, mask).backward()
    assert torch.allclose(x.grad, mask / mask.sum())


@pytest.mark.parametrize("B,T", SHAPES[1:])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten(B, T, shift_mean):
    torch.manual_seed(B + T)
    x = torch.randn(B, T) * 5 + 2
    mask, _ = _mask(B, T, seed=B, min_len=2)
    x_before = x.clone()
    out = common.masked_whiten(x, mask, shift_mean=shift_mean)
    assert torch.equal(x, x_before)  # the input is not mutated
    assert torch.all(out[mask == 0] == 0)  # padding stays 0
    vals = _masked_values(out, mask)
    mean, sd = statistics.fmean(_masked_values(x, mask)), statistics.stdev(_masked_values(x, mask))
    assert statistics.stdev(vals) == pytest.approx(1.0, abs=1e-4)
    assert statistics.fmean(vals) == pytest.approx(0.0 if shift_mean else mean, abs=1e-4)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                expected = (float(x[b, t]) - mean) / sd + (0.0 if shift_mean else mean)
                assert float(out[b, t]) == pytest.approx(expected, abs=1e-4)


# ---------------------------------------------------------------------------------------------- chunked log-probs


@pytest.mark.parametrize("N,H,V,chunk,temperature", [(37, 8, 50, 8, 0.7), (10, 4, 13, 3, 1.0), (5, 6, 20, 64, 1.5)])
def test_token_logprobs_from_hidden(N, H, V, chunk, temperature):
    torch.manual_seed(N)
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    targets[:2] = targets[0]  # a repeated target
    upstream = torch.randn(N)  # an arbitrary gradient arriving at the log-probs

    logp, ent = forward.token_logprobs_from_hidden(hidden, weight, targets, temperature, chunk)
    (logp * upstream).sum().backward()
    grad_h, grad_w = hidden.grad.clone(), weight.grad.clone()

    h2, w2 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    full = torch.log_softmax((h2 @ w2.T) / temperature, dim=-1)  # [N, V]
    ref_logp = full[torch.arange(N), targets]
    ref_ent = -(full.exp() * full).sum(-1)
    (ref_logp * upstream).sum().backward()

    assert logp.shape == ent.shape == (N,)
    assert torch.allclose(logp, ref_logp.detach(), atol=1e-5)
    assert torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    assert torch.allclose(grad_h, h2.grad, atol=1e-5)
    assert torch.allclose(grad_w, w2.grad, atol=1e-5)
    assert not ent.requires_grad
    # also the logits path used elsewhere
    assert torch.allclose(
        token_logprobs_from_logits(h2.detach() @ w2.detach().T, targets, temperature),
        ref_logp.detach(),
        atol=1e-5,
    )


def test_token_logprobs_from_hidden_grad_wrt_hidden_only():
    torch.manual_seed(1)
    hidden, weight = torch.randn(9, 4, requires_grad=True), torch.randn(11, 4)
    targets = torch.randint(0, 11, (9,))
    forward.token_logprobs_from_hidden(hidden, weight, targets, 1.0, 4)[0].sum().backward()
    h2 = hidden.detach().clone().requires_grad_(True)
    torch.log_softmax(h2 @ weight.T, -1)[torch.arange(9), targets].sum().backward()
    assert torch.allclose(hidden.grad, h2.grad, atol=1e-5)


# ---------------------------------------------------------------------------------------------- PPO surrogate, KL


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, None), (0.2, 0.28), (0.1, 0.3)])
def test_clipped_surrogate(eps_low, eps_high):
    torch.manual_seed(7)
    logp, old_logp = torch.randn(6, 9) * 0.3, torch.randn(6, 9) * 0.3
    adv = torch.randn(6, 9)
    loss, clipped = common.clipped_surrogate(logp, old_logp, adv, eps_low, eps_high)
    hi = eps_low if eps_high is None else eps_high
    n_clipped = 0
    for b in range(6):
        for t in range(9):
            r = math.exp(float(logp[b, t]) - float(old_logp[b, t]))
            a = float(adv[b, t])
            rc = min(max(r, 1 - eps_low), 1 + hi)
            assert float(loss[b, t]) == pytest.approx(max(-a * r, -a * rc), rel=1e-5, abs=1e-6)
            # the clip is active where the clipped term wins: ratio beyond the bound in the advantage's direction
            active = (a > 0 and r > 1 + hi) or (a < 0 and r < 1 - eps_low)
            assert float(clipped[b, t]) == float(active)
            n_clipped += active
    assert n_clipped > 0  # the case is exercised


def test_clipped_surrogate_gradient_is_zero_where_clipped():
    logp = torch.tensor([0.5, 0.5, -0.5, 0.05], requires_grad=True)
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss, clipped = common.clipped_surrogate(logp, old, adv, 0.2)
    loss.sum().backward()
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert logp.grad[0] == 0 and logp.grad[2] == 0
    assert logp.grad[1] != 0 and logp.grad[3] != 0


def test_kl_estimators_per_token():
    torch.manual_seed(3)
    logp, ref = torch.randn(5, 4), torch.randn(5, 4)
    k1, k2, k3 = (common.kl_estimate(logp, ref, k) for k in ("k1", "k2", "k3"))
    for b in range(5):
        for t in range(4):
            lr = float(logp[b, t] - ref[b, t])
            assert float(k1[b, t]) == pytest.approx(lr, abs=1e-6)
            assert float(k2[b, t]) == pytest.approx(lr * lr / 2, abs=1e-6)
            assert float(k3[b, t]) == pytest.approx(math.exp(-lr) - 1 + lr, abs=1e-5)
    assert torch.all(k3 >= 0) and torch.all(k2 >= 0)
    with pytest.raises(ValueError):
        common.kl_estimate(logp, ref, "k4")


def test_kl_estimators_agree_in_expectation():
    # pi and ref: two close categoricals over 6 outcomes; exact KL(pi || ref) by a sum over outcomes
    g = torch.Generator().manual_seed(0)
    pi_logits = torch.randn(6, generator=g, dtype=torch.float64)
    ref_logits = pi_logits + 0.2 * torch.randn(6, generator=g, dtype=torch.float64)
    pi, ref = torch.softmax(pi_logits, 0), torch.softmax(ref_logits, 0)
    kl = sum(float(pi[i] * math.log(pi[i] / ref[i])) for i in range(6))
    assert kl > 0
    # exact expectations: k1 and k3 are unbiased
    for kind in ("k1", "k3"):
        est = common.kl_estimate(pi.log(), ref.log(), kind)
        assert float((pi * est).sum()) == pytest.approx(kl, rel=1e-9)
    # Monte Carlo over samples of pi: all three close to the KL (k2 is biased, but only at third order)
    x = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    for kind in ("k1", "k2", "k3"):
        est = common.kl_estimate(pi.log()[x], ref.log()[x], kind).mean().item()
        assert est == pytest.approx(kl, rel=0.15), kind


# ---------------------------------------------------------------------------------------------- GAE


def _gae_loop(rewards, values, lengths, gamma, lam):
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        L = lengths[b]
        running = 0.0
        for t in reversed(range(L)):
            next_v = float(values[b, t + 1]) if t + 1 < L else 0.0  # the episode ends after the last token
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b][t] = running
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("B,T", [(1, 1), (3, 6), (5, 11)])
def test_gae_against_loop(gamma, lam, B, T):
    torch.manual_seed(B * T)
    mask, lengths = _mask(B, T, seed=T + B)
    rewards, values = torch.randn(B, T), torch.randn(B, T)  # garbage on padding too: it must not leak in
    adv, ret = common.gae(rewards, values, mask, gamma, lam)
    expected = _gae_loop(rewards, values, lengths, gamma, lam)
    for b in range(B):
        for t in range(T):
            if t < lengths[b]:
                assert float(adv[b, t]) == pytest.approx(expected[b][t], abs=1e-5)
                assert float(ret[b, t]) == pytest.approx(expected[b][t] + float(values[b, t]), abs=1e-5)
            else:
                assert float(adv[b, t]) == 0 and float(ret[b, t]) == 0


def test_gae_terminal_reward_gamma_lambda_one():
    # gamma = lambda = 1, reward only at the last token: A_t = R - V(s_t)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 9.0], [0.5, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv, ret = common.gae(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.6, 0.4, 0.0], [-0.5, -0.5, -0.5, -0.5]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def _random_batch(B, T, seed):
    torch.manual_seed(seed)
    mask, lengths = _mask(B, T, seed=seed)
    return torch.randn(B, T), torch.randn(B, T), mask, lengths  # rewards at every token, garbage on padding


@pytest.mark.parametrize("lam", [1.0, 0.95, 0.5, 0.0])
def test_critic_lambda_one_targets_are_the_monte_carlo_returns(lam):
    """gamma = critic_lam = 1: the value target of token t is the sum of the rewards from t on, whatever the critic
    predicts and whatever the policy's lambda (VC-PPO's lambda_critic = 1)."""
    rewards, values, mask, lengths = _random_batch(4, 9, seed=3)
    _, ret = common.gae_decoupled(rewards, values, mask, 1.0, lam, 1.0)
    for b in range(4):
        for t in range(9):
            expected = sum(float(rewards[b, u]) for u in range(t, lengths[b])) if t < lengths[b] else 0.0
            assert float(ret[b, t]) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_each_lambda_changes_its_own_quantity_only(gamma):
    """--critic-lam moves the value targets and not the advantages; --lam the advantages and not the targets; each
    is gae() at its own lambda."""
    rewards, values, mask, _ = _random_batch(5, 11, seed=7)
    adv, ret = common.gae_decoupled(rewards, values, mask, gamma, 0.95, 1.0)
    adv_c, ret_c = common.gae_decoupled(rewards, values, mask, gamma, 0.95, 0.8)  # the critic's lambda moved
    assert torch.equal(adv_c, adv) and not torch.allclose(ret_c, ret)
    adv_p, ret_p = common.gae_decoupled(rewards, values, mask, gamma, 0.7, 1.0)  # the policy's lambda moved
    assert torch.equal(ret_p, ret) and not torch.allclose(adv_p, adv)
    assert torch.equal(adv_c, common.gae(rewards, values, mask, gamma, 0.95)[0])
    assert torch.equal(ret_c, common.gae(rewards, values, mask, gamma, 0.8)[1])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8)])
def test_equal_lambdas_compute_exactly_what_gae_did(gamma, lam):
    """lam == critic_lam (the defaults, 1 and 1: every committed run): bit for bit gae()'s advantages and returns."""
    rewards, values, mask, _ = _random_batch(6, 13, seed=11)
    adv, ret = common.gae_decoupled(rewards, values, mask, gamma, lam, lam)
    adv0, ret0 = common.gae(rewards, values, mask, gamma, lam)
    assert torch.equal(adv, adv0) and torch.equal(ret, ret0)


# ---------------------------------------------------------------------------------------------- GRPO, DPO


@pytest.mark.parametrize("G", [2, 4, 5])
@pytest.mark.parametrize("scale", ["group", "none"])
@pytest.mark.parametrize("baseline", ["mean", "loo"])
def test_group_advantages(G, scale, baseline):
    torch.manual_seed(G)
    groups = 3
    rewards = (torch.rand(groups * G) > 0.5).float() + 0.1 * torch.randn(groups * G)
    rewards[:G] = 1.0  # a group with no spread
    adv = common.group_advantages(rewards, G, scale, baseline)
    assert adv.shape == rewards.shape
    for g in range(groups):
        r = [float(v) for v in rewards[g * G : (g + 1) * G]]
        sd = statistics.stdev(r)
        for i in range(G):
            if baseline == "mean":
                a = r[i] - sum(r) / G
            else:
                a = r[i] - sum(r[j] for j in range(G) if j != i) / (G - 1)
            if scale == "group":
                a = a / (sd + 1e-4)
            assert float(adv[g * G + i]) == pytest.approx(a, abs=1e-4)
    assert torch.all(adv[:G] == 0)


def test_group_advantages_unknown():
    with pytest.raises(ValueError):
        common.group_advantages(torch.zeros(4), 2, baseline="median")
    with pytest.raises(ValueError):
        common.group_advantages(torch.zeros(4), 2, scale="batch")


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss(beta):
    torch.manual_seed(11)
    pc, pr, rc, rr = (torch.randn(7) * 3 for _ in range(4))
    sig, margin = common.dpo_loss(pc, pr, rc, rr, beta, "sigmoid")
    ipo, margin2 = common.dpo_loss(pc, pr, rc, rr, beta, "ipo")
    for i in range(7):
        h = (float(pc[i]) - float(rc[i])) - (float(pr[i]) - float(rr[i]))
        assert float(margin[i]) == pytest.approx(h, abs=1e-5) and float(margin2[i]) == pytest.approx(h, abs=1e-5)
        assert float(sig[i]) == pytest.approx(math.log1p(math.exp(-beta * h)), abs=1e-5)
        assert float(ipo[i]) == pytest.approx((h - 1 / (2 * beta)) ** 2, rel=1e-5)
    with pytest.raises(ValueError):
        common.dpo_loss(pc, pr, rc, rr, beta, "hinge")


# ---------------------------------------------------------------------------------------------- schedule


def test_lr_factor_warmup():
    assert [common.lr_factor(s, 4, 100, "constant") for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert common.lr_factor(0, 4, 100, "cosine") == 0.25


@pytest.mark.parametrize("warmup", [0, 10])
def test_lr_factor_endpoints(warmup):
    total = warmup + 100
    for schedule in ("constant", "linear", "cosine"):
        assert common.lr_factor(warmup, warmup, total, schedule) == pytest.approx(1.0)
    assert common.lr_factor(total, warmup, total, "constant") == 1.0
    assert common.lr_factor(total, warmup, total, "linear") == pytest.approx(0.0, abs=1e-12)
    assert common.lr_factor(total, warmup, total, "cosine") == pytest.approx(0.0, abs=1e-12)
    mid = warmup + (total - warmup) // 2
    assert common.lr_factor(mid, warmup, total, "linear") == pytest.approx(0.5)
    assert common.lr_factor(mid, warmup, total, "cosine") == pytest.approx(0.5)
    quarter = warmup + (total - warmup) // 4
    assert common.lr_factor(quarter, warmup, total, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert common.lr_factor(total + 50, warmup, total, "linear") == pytest.approx(0.0, abs=1e-12)  # stays at 0


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_schedule_that_follows_a_budget_is_the_step_schedule_of_the_steps_the_budget_takes(schedule):
    """--token-budget: the decay reads the share of the budget spent (common.BudgetProgress), not the optimiser step
    over --total-steps. With the same tokens every step it is the step schedule of the steps the budget takes, however
    large the step cap; with fewer tokens a step it stretches over more steps and ends where the budget does."""
    J, steps, per_step = 8, 5, 100.0  # optimiser steps a training step; the budget: 5 steps of 100 tokens
    budget = common.BudgetProgress(int(steps * per_step), J)
    factor = common.lr_schedule(schedule, 0, 10 * steps * J, budget)  # the schedule's own length: the step cap
    got = [factor(0)]
    for s in range(steps):
        budget.start_step(s * per_step, per_step, s * J)
        got += [factor(k) for k in range(s * J + 1, (s + 1) * J + 1)]  # LambdaLR: after each optimiser step
    want = [common.lr_factor(k, 0, steps * J, schedule) for k in range(steps * J + 1)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[-1] == pytest.approx(0.0, abs=1e-12) and common.lr_factor(steps * J, 0, 10 * steps * J, schedule) > 0.8
    half = common.BudgetProgress(int(steps * per_step), J)  # half the tokens a step: twice the steps, same ends
    half.start_step(4.5 * per_step, per_step / 2, 9 * J)
    assert common.lr_schedule(schedule, 0, 10 * steps * J, half)(10 * J) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("step", [0, 5, 50])
def test_lr_factor_unknown_schedule_fails_at_any_step(step):
    # LambdaLR calls the factor at step 0: a mistyped schedule must fail there, not after warmup
    with pytest.raises(errors.UserError, match="lr-schedule"):
        common.lr_schedule("cosin", 10, 100)(step)
