"""Generation against the training forward, on the CPU in fp32: the rollout must be what the update thinks it is.

A rollout's log-probs become PPO's old log-probs and its hidden states the critic's old values; its mask
decides which tokens enter the loss. Each of these is checked here against forward.PolicyForward (the
training forward) or against transformers' own generate().
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import gsm8k
from plumbing import forward, generation, models, rollout

CPU = torch.device("cpu")
QUESTIONS = [
    "What is 2 + 3?",
    "A farmer has 12 cows and buys 7 more, then sells half of all his cows. How many cows are left?",
    "Tom has 3 apples.",
]
# fp32 on the CPU. The same tokens through the same full forward, padded or not, agree to LOGP_SAME; the
# rollout's incremental (KV-cache) forward and the training forward's full one agree to LOGP_ROLLOUT on
# log-probs of magnitude up to ~12 (a relative error near 1e-5) and to HIDDEN on hidden states of size ~4.
LOGP_SAME = 1e-5
LOGP_ROLLOUT = 1e-4
HIDDEN = 1e-4


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer("tiny")


@pytest.fixture(scope="module")
def tiny_lm(tok):
    return models.load_model("tiny", tok, seed=0).eval()


@pytest.fixture(scope="module")
def prompts(tok):
    out = [gsm8k.encode_prompt(tok, q) for q in QUESTIONS]
    assert len({len(p) for p in out}) == len(out), "the prompts must differ in length to exercise left padding"
    return out


def sample(lm, tok, prompts, uniforms, **kw) -> rollout.Rollout:
    return generation.generate(
        lm, prompts, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, uniforms=uniforms, **{"max_new_tokens": 24, **kw}
    )


class RecordState(nn.Module):
    """A stand-in critic head for PolicyForward: keeps the hidden states it is given, returns their sum."""

    needs_trunk = False

    def forward(self, state: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T]
        self.state = state.detach().clone()
        return state.sum(-1)


def test_batched_forward_matches_each_sequence_alone(tiny_lm, tok, prompts):
    # Responses of different lengths after prompts of different lengths: left padding and right padding.
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (5, 9, 2)]
    ids, pmask = rollout.left_pad(prompts, tok.pad_token_id)
    T = max(len(r) for r in responses)
    rids = torch.full((len(prompts), T), tok.pad_token_id)
    rmask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, r in enumerate(responses):
        rids[i, : len(r)] = torch.tensor(r)
        rmask[i, : len(r)] = 1
    fwd = forward.PolicyForward(tiny_lm)
    with torch.no_grad():
        logp, ent, _ = fwd(torch.cat([ids, rids], 1), torch.cat([pmask, rmask], 1), ids.shape[1])
        for i, (p, r) in enumerate(zip(prompts, responses)):
            alone, alone_ent, _ = fwd(torch.tensor([p + r]), torch.ones(1, len(p) + len(r), dtype=torch.long), len(p))
            torch.testing.assert_close(logp[i, : len(r)], alone[0], atol=LOGP_SAME, rtol=0)
            torch.testing.assert_close(ent[i, : len(r)], alone_ent[0], atol=LOGP_SAME, rtol=0)
            assert torch.all(logp[i, len(r) :] == 0) and torch.all(ent[i, len(r) :] == 0), "padding must give 0"


def test_greedy_matches_transformers_generate(tiny_lm, tok, prompts):
    ro = generation.generate(tiny_lm, prompts, max_new_tokens=24, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    hf = tiny_lm.generate(
        input_ids=ro.prompt_ids,
        attention_mask=ro.prompt_mask,
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    assert torch.equal(hf[:, : ro.prompt_ids.shape[1]], ro.prompt_ids)
    assert torch.equal(hf[:, ro.prompt_ids.shape[1] :], ro.response_ids)


@pytest.mark.packaged
def test_greedy_matches_transformers_generate_smollm2():
    tok = models.load_tokenizer("smollm2")
    lm = models.load_model("smollm2", tok).eval()
    prompts = [gsm8k.encode_prompt(tok, q) for q in QUESTIONS]
    ro = generation.generate(lm, prompts, max_new_tokens=24, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    hf = lm.generate(
        input_ids=ro.prompt_ids,
        attention_mask=ro.prompt_mask,
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    assert torch.equal(hf[:, ro.prompt_ids.shape[1] :], ro.response_ids)
    assert ro.lengths.min() > 0 and tok.decode(ro.response_ids[0, : ro.lengths[0]]).strip(), "an empty answer"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_training_forward(tiny_lm, tok, prompts, temperature):
    u = rollout.step_uniforms(seed=3, step=0, stream=0, rows=len(prompts), steps=24, device=CPU)
    ro = sample(tiny_lm, tok, prompts, u, temperature=temperature)
    assert ro.response_mask.sum() > 10
    with torch.no_grad():
        logp, _, _ = forward.PolicyForward(tiny_lm)(
            ro.input_ids, ro.attention_mask, ro.prompt_ids.shape[1], temperature
        )
    torch.testing.assert_close(logp, ro.logprobs, atol=LOGP_ROLLOUT, rtol=0)
    if temperature != 1.0:  # the temperature must actually enter both: at T = 1 the log-probs differ
        with torch.no_grad():
            at_one, _, _ = forward.PolicyForward(tiny_lm)(ro.input_ids, ro.attention_mask, ro.prompt_ids.shape[1])
        assert (at_one - ro.logprobs).abs().max() > 100 * LOGP_ROLLOUT


def test_rollout_hidden_states_match_training_forward(tiny_lm, tok, prompts):
    u = rollout.step_uniforms(seed=4, step=0, stream=0, rows=len(prompts), steps=24, device=CPU)
    ro = sample(tiny_lm, tok, prompts, u, return_hidden=True)
    rec = RecordState()
    with torch.no_grad():
        _, _, values = forward.PolicyForward(tiny_lm, rec)(ro.input_ids, ro.attention_mask, ro.prompt_ids.shape[1])
    assert ro.hidden.shape == rec.state.shape  # [B, T, H]
    m = ro.response_mask.bool()
    torch.testing.assert_close(ro.hidden[m], rec.state[m], atol=HIDDEN, rtol=0)
    assert torch.all(values[~m] == 0)


class ForceEOS(nn.Module):
    """Wraps the LM head: on its n-th call (decode step n) the rows in force[n] put all mass on EOS."""

    def __init__(self, head: nn.Module, eos: int, force: dict[int, list[int]]) -> None:
        super().__init__()
        self.head, self.eos, self.force, self.calls = head, eos, force, 0
        self.weight = head.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)
        for row in self.force.get(self.calls, []):
            logits[row] = -1e9
            logits[row, self.eos] = 0.0
        self.calls += 1
        return logits


@contextlib.contextmanager
def forced_eos(lm: nn.Module, eos: int, force: dict[int, list[int]]):
    """Swap lm.lm_head for ForceEOS and back (pytest's monkeypatch would delete a submodule on undo)."""
    head = lm.lm_head
    lm.lm_head = ForceEOS(head, eos, force)
    try:
        yield
    finally:
        lm.lm_head = head


def test_response_mask_from_lengths_keeps_eos(tiny_lm, tok, prompts):
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert eos != pad
    # row 0 ends at step 1, row 1 at step 3, row 2 runs to max_new_tokens.
    u = rollout.step_uniforms(seed=5, step=0, stream=0, rows=3, steps=8, device=CPU)
    with forced_eos(tiny_lm, eos, {1: [0], 3: [1]}):
        ro = sample(tiny_lm, tok, prompts, u, max_new_tokens=8, backend="hf")  # the engine copies the head
    assert ro.lengths.tolist() == [2, 4, 8]
    for i, n in enumerate(ro.lengths.tolist()):
        assert torch.all(ro.response_mask[i, :n] == 1) and torch.all(ro.response_mask[i, n:] == 0)
        assert torch.all(ro.response_ids[i, n:] == pad) and torch.all(ro.logprobs[i, n:] == 0)
        assert torch.all(ro.response_ids[i, : n - 1] != eos)
    assert ro.response_ids[0, 1] == eos and ro.response_ids[1, 3] == eos  # EOS itself is inside the mask
    assert ro.logprobs[0, 1] == 0.0 and ro.logprobs[1, 3] == 0.0  # log 1: all mass was put on EOS
    assert torch.equal(ro.attention_mask[:, ro.prompt_ids.shape[1] :], ro.response_mask.long())
    texts, ids = rollout.decode_responses(tok, ro)
    assert [len(x) for x in ids] == [2, 4, 8] and ids[0][-1] == eos


def test_generation_stops_once_every_row_has_ended(tiny_lm, tok, prompts):
    with forced_eos(tiny_lm, tok.eos_token_id, {0: [1], 2: [0, 2]}):
        ro = sample(tiny_lm, tok, prompts, None, max_new_tokens=8, backend="hf")
    assert ro.response_ids.shape[1] == 3 and ro.lengths.tolist() == [3, 1, 3]


def test_step_uniforms_are_deterministic():
    a = rollout.step_uniforms(seed=1, step=7, stream=0, rows=4, steps=16, device=CPU)
    assert torch.equal(a, rollout.step_uniforms(seed=1, step=7, stream=0, rows=4, steps=16, device=CPU))
    for other in [dict(seed=2, step=7, stream=0), dict(seed=1, step=8, stream=0), dict(seed=1, step=7, stream=1)]:
        assert not torch.equal(a, rollout.step_uniforms(**other, rows=4, steps=16, device=CPU))
    assert a.dtype == torch.float64 and 0 <= a.min() and a.max() < 1


def test_sampling_is_deterministic(tiny_lm, tok, prompts):
    u = rollout.step_uniforms(seed=1, step=0, stream=0, rows=3, steps=24, device=CPU)
    a, b = sample(tiny_lm, tok, prompts, u), sample(tiny_lm, tok, prompts, u)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    c = sample(tiny_lm, tok, prompts, rollout.step_uniforms(seed=1, step=1, stream=0, rows=3, steps=24, device=CPU))
    assert not torch.equal(a.response_ids, c.response_ids)


def test_a_row_depends_only_on_its_own_uniforms(tiny_lm, tok, prompts):
    # The same batch, other rows' uniforms changed: row 0's rollout is bitwise the same.
    u = rollout.step_uniforms(seed=1, step=0, stream=0, rows=3, steps=24, device=CPU)
    v = u.clone()
    v[1:] = rollout.step_uniforms(seed=9, step=0, stream=0, rows=2, steps=24, device=CPU)
    a, b = sample(tiny_lm, tok, prompts, u), sample(tiny_lm, tok, prompts, v)
    assert not torch.equal(a.response_ids[1:], b.response_ids[1:])
    assert torch.equal(a.response_ids[0], b.response_ids[0]) and torch.equal(a.logprobs[0], b.logprobs[0])


def first_difference(x: torch.Tensor, y: torch.Tensor) -> int | None:
    diff = (x != y).nonzero()
    return int(diff[0]) if len(diff) else None


@pytest.mark.parametrize("row", [0, 1, 2])
def test_a_prompt_alone_samples_what_it_samples_in_a_batch(tiny_lm, tok, prompts, row):
    """Prompt `row` alone (no padding) versus inside the batch (left-padded, other rows beside it), same uniforms.

    The padded forward differs from the unpadded one by float rounding (~1e-6), and inverse-CDF sampling over
    ~49k tokens puts a CDF boundary every ~1e-5: about one token in a few hundred can land on the other side
    of a boundary, after which the two continuations differ. So the rollouts must agree token for token up to
    the first difference, if any, and that difference must be such a boundary case: with the batch's own
    logits, the uniform moved by 1e-6 either way reaches both tokens chosen. A rollout that read another
    row's uniforms would differ at a random place in the CDF and fail this.
    """
    T = 24
    u = rollout.step_uniforms(seed=2, step=0, stream=0, rows=3, steps=T, device=CPU)
    batch = sample(tiny_lm, tok, prompts, u, return_hidden=True)
    alone = sample(tiny_lm, tok, prompts[row : row + 1], u[row : row + 1], return_hidden=True)
    x, y = batch.response_ids[row], alone.response_ids[0]
    t = first_difference(x, y)
    n = T if t is None else t
    assert n > 0 or t == 0
    torch.testing.assert_close(batch.logprobs[row, :n], alone.logprobs[0, :n], atol=LOGP_ROLLOUT, rtol=0)
    if t is not None:
        logits = tiny_lm.lm_head(batch.hidden[row, t][None]).detach()  # [1, V]
        eps = 1e-6
        lo = rollout.sample_tokens(logits, u[row, t : t + 1] - eps, 1.0, 1.0)[0].item()
        hi = rollout.sample_tokens(logits, u[row, t : t + 1] + eps, 1.0, 1.0)[0].item()
        chosen = sorted([x[t].item(), y[t].item()])
        assert lo <= chosen[0] and chosen[1] <= hi, f"step {t}: alone {y[t].item()}, in the batch {x[t].item()}"
