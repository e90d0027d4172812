"""StaticEngine's compile and capture paths on the CPU: the prefill compiles once whatever the lengths, and
every fallback leaves a working engine, says why, and is on the record (generation.rollout_record).

- Compiles are counted with dynamo's CompileCounter as the backend (graphs traced, run eagerly: cheap).
- Failures are simulated: a backend that raises (a compile failure, or an out-of-memory error), and
  tests/test_engine_preflight.py's stand-in CUDA graphs, with a generator that a capture puts in capture
  mode and only a successful capture_end takes out of it, as the CUDA generator behaves.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from test_engine_preflight import FakeCuda, graph_engine, make_prompts, sample
from torch._dynamo.testing import CompileCounter

from plumbing import generation, models, runtime, static_engine, static_kernels


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer(models.TINY_MODEL)


@pytest.fixture(scope="module")
def lm(tok):
    return models.load_model(models.TINY_MODEL, tok, seed=0).eval()


@pytest.fixture(autouse=True)
def fresh_record():
    torch._dynamo.reset()
    runtime.begin_run()  # each test sees its own notices and record (and leaves none for the next file's tests)
    yield
    torch._dynamo.reset()
    runtime.begin_run()


def test_prefill_compiles_once_over_varied_lengths(lm, tok):
    """Rows x prompt widths that include 1 row, rows = width and a width equal to the hidden size (64)."""
    counter = CompileCounter()
    eng = static_engine.StaticEngine(lm, compile=True, compile_backend=counter)
    eng._pre, eng._post = (
        static_kernels.llama_pre_attention,
        static_kernels.llama_post_attention,
    )  # count the prefill only
    eng._sample = static_kernels.decode_sample
    ref = static_engine.StaticEngine(lm)
    g = torch.Generator().manual_seed(1)
    for rows, length in [(3, 10), (5, 70), (64, 30), (2, 130), (1, 5), (7, 200), (64, 64)]:
        prompts = [torch.randint(3, 500, (length,), generator=g).tolist() for _ in range(rows)]
        got = eng.generate(prompts, max_new_tokens=2, eos_id=-1, pad_id=tok.pad_token_id)
        want = ref.generate(prompts, max_new_tokens=2, eos_id=-1, pad_id=tok.pad_token_id)
        assert torch.equal(got.response_ids, want.response_ids)
    assert counter.frame_count == 2, f"{counter.frame_count} graphs: the prefill recompiled"  # pre + post
    assert eng.fallbacks == []


def _failing_backend(exc: Exception, times: int = 10**9):
    calls = {"n": 0}

    def backend(gm, example_inputs):
        calls["n"] += 1
        if calls["n"] <= times:
            raise exc
        return gm.forward

    return backend


def test_compile_failure_without_graphs_falls_back_to_eager_prefill_and_decode(lm, tok, capsys):
    boom = RuntimeError("simulated inductor failure: triton missing")
    eng = static_engine.StaticEngine(lm, compile=True, cuda_graph=False, compile_backend=_failing_backend(boom))
    prompts, pad = make_prompts((3, 41, 17)), tok.pad_token_id
    got = sample(eng, prompts, 8, pad)
    want = sample(static_engine.StaticEngine(lm), prompts, 8, pad)
    assert torch.equal(got.response_ids, want.response_ids)
    assert not eng.compile and not eng._prefill_compiled  # the decode step failed first: prefill eager too
    [fb] = eng.fallbacks
    assert fb["what"] == "compile" and "triton missing" in fb["reason"] and fb["kind"] == "error", fb
    assert "TORCHDYNAMO_VERBOSE" not in fb["reason"]  # dynamo's hint dropped
    assert "triton missing" in capsys.readouterr().err  # the cause in the notice
    again = sample(eng, prompts, 8, pad)  # the eager engine keeps working, nothing new on the record
    assert torch.equal(again.response_ids, want.response_ids) and len(eng.fallbacks) == 1


def test_prefill_compile_failure_falls_back_to_eager_prefill(lm, tok):
    eng = static_engine.StaticEngine(lm, compile=True, cuda_graph=False, compile_backend="eager")
    boom = RuntimeError("simulated: prefill shape guard failed")
    eng._prefill_pre = torch.compile(static_kernels.prefill_pre_attention, backend=_failing_backend(boom))
    prompts, pad = make_prompts((3, 41, 17)), tok.pad_token_id
    got = sample(eng, prompts, 8, pad)
    assert torch.equal(got.response_ids, sample(static_engine.StaticEngine(lm), prompts, 8, pad).response_ids)
    assert [f["what"] for f in eng.fallbacks] == ["prefill_compile"] and "shape guard" in eng.fallbacks[0]["reason"]
    assert eng.compile and not eng._prefill_compiled  # the decode step stays compiled


def test_out_of_memory_while_compiling_is_raised_and_compile_stays_on(lm, tok):
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    eng = static_engine.StaticEngine(lm, compile=True, cuda_graph=False, compile_backend=_failing_backend(oom, times=1))
    prompts, pad = make_prompts((3, 41, 17)), tok.pad_token_id
    with pytest.raises(Exception, match="out of memory"):
        sample(eng, prompts, 8, pad)
    assert eng.compile and eng.fallbacks == []  # not taken for a compile failure
    got = sample(eng, prompts, 8, pad)  # the next call (memory back) compiles and runs
    assert torch.equal(got.response_ids, sample(static_engine.StaticEngine(lm), prompts, 8, pad).response_ids)
    assert eng.compile and eng.fallbacks == []


@pytest.mark.parametrize("where", ["begin", "step"])
def test_failed_capture_ends_it_restores_the_generator_and_names_the_cause(lm, tok, monkeypatch, capsys, where):
    """begin: capture_begin raises after putting the generator in capture mode; step: an op inside the capture
    raises, and capture_end then raises its own generic error (the cause must be the step's)."""
    fake = FakeCuda(fail_capture=where == "begin", fail_step=where == "step")
    fake.install(monkeypatch)
    prompts, pad = make_prompts((3, 41, 17)), tok.pad_token_id
    eng = graph_engine(lm, fake)
    got = sample(eng, prompts, 12, pad)
    assert not fake.generator.capturing, "the generator was left in capture mode"
    assert fake.stack == [fake.default] and not fake.open_captures, "a capture was left open"
    assert torch.equal(got.response_ids, sample(static_engine.StaticEngine(lm), prompts, 12, pad).response_ids)
    assert not eng.cuda_graph and eng.graphs == {}
    cause = "not permitted when stream is capturing" if where == "begin" else "simulated: aten op inside capture"
    [fb] = eng.fallbacks
    assert fb["what"] == "cuda_graph" and cause in fb["reason"] and "generic" not in fb["reason"], fb
    assert cause in capsys.readouterr().err
    rec = generation.rollout_record()
    assert rec["rollout_backend"] is None  # generation.generate was not called: only the engine's own record
    assert rec["rollout_fallbacks"] == [fb]


def test_failed_capture_of_a_later_width_runs_every_step_eagerly(lm, tok, monkeypatch):
    """The widths captured before the failure are not replayed beside eager steps."""
    fake = FakeCuda(fail_after=1)  # the first capture succeeds, the second fails
    fake.install(monkeypatch)
    prompts, pad = make_prompts((3, 60, 17)), tok.pad_token_id  # widths 64 and 128 over 12 steps
    eng = graph_engine(lm, fake, kv_chunk=64)
    replays = []
    monkeypatch.setattr(fake, "on_replay", lambda: replays.append(1))
    got = sample(eng, prompts, 12, pad)
    assert fake.captures == 2 and replays == [] and not eng.cuda_graph
    assert torch.equal(got.response_ids, sample(static_engine.StaticEngine(lm), prompts, 12, pad).response_ids)


def test_flex_fallback_drops_the_compiled_flex_attention(lm, tok):
    calls = []

    def broken_flex(*a, **k):
        calls.append(1)
        raise RuntimeError("simulated: flex_attention compile failed")

    eng = static_engine.StaticEngine(lm, attention="flex", compile=True, cuda_graph=False, compile_backend="eager")
    eng._flex, eng._flex_compiled = broken_flex, True
    prompts, pad = make_prompts((3, 41, 17)), tok.pad_token_id
    got = sample(eng, prompts, 6, pad)
    assert eng._flex is not broken_flex and not eng._flex_compiled
    ref = sample(static_engine.StaticEngine(lm, attention="flex"), prompts, 6, pad)
    assert torch.equal(got.response_ids, ref.response_ids)
    assert [f["what"] for f in eng.fallbacks] == ["compile"] and "flex_attention" in eng.fallbacks[0]["reason"]


def test_generate_records_the_backend_it_ran(lm, tok):
    prompts, pad = make_prompts((3, 41)), tok.pad_token_id
    generation.generate(lm, prompts, max_new_tokens=3, eos_id=-1, pad_id=pad, backend="hf")
    generation.generate(lm, prompts, max_new_tokens=3, eos_id=-1, pad_id=pad, backend="static")
    rec = generation.rollout_record()
    assert rec == {"rollout_backend": "hf, static", "rollout_fallbacks": []}
    assert static_engine.StaticEngine(lm).backend_name == "static"


def test_the_head_sampler_and_bookkeeping_compile_and_give_the_eager_tokens(lm, tok):
    """decode_sample (the LM head, the sampler, the step's bookkeeping) goes through the compile backend with the
    layer pieces: the backend sees a graph with the sampler and the in-place writes, and the compiled engine
    (aot_eager: the in-place writes functionalised, as inductor sees them) gives the eager engine's rollout."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs: list[str] = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return lookup_backend("aot_eager")(gm, example_inputs)

    eng = static_engine.StaticEngine(lm, compile=True, cuda_graph=False, compile_backend=recording)
    prompts, pad = make_prompts((3, 41, 17)), tok.pad_token_id
    for kw in (dict(), dict(top_p=0.9, return_hidden=True)):
        got = sample(eng, prompts, 8, pad, **kw)
        want = sample(static_engine.StaticEngine(lm), prompts, 8, pad, **kw)
        assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
        if got.hidden is not None:
            torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=0)
    greedy = dict(max_new_tokens=8, eos_id=-1, pad_id=pad)  # no uniforms: argmax
    got, want = eng.generate(prompts, **greedy), static_engine.StaticEngine(lm).generate(prompts, **greedy)
    assert torch.equal(got.response_ids, want.response_ids)
    sampler = [g for g in graphs if "log_softmax" in g and "index_copy" in g and "searchsorted" in g]
    assert len(sampler) == 2, f"{len(sampler)} sampler graphs of {len(graphs)}"  # one per sampler setting
    assert any("argmax" in g and "index_copy" in g and "searchsorted" not in g for g in graphs)  # greedy
    assert eng.compile and eng.fallbacks == []


def test_a_sampler_compile_failure_falls_back_to_eager_with_its_reason(lm, tok, capsys):
    boom = RuntimeError("simulated: sampler lowering failed")
    eng = static_engine.StaticEngine(lm, compile=True, cuda_graph=False, compile_backend="eager")
    eng._sample = torch.compile(static_kernels.decode_sample, dynamic=False, backend=_failing_backend(boom))
    prompts, pad = make_prompts((3, 41, 17)), tok.pad_token_id
    got = sample(eng, prompts, 8, pad)
    assert torch.equal(got.response_ids, sample(static_engine.StaticEngine(lm), prompts, 8, pad).response_ids)
    [fb] = eng.fallbacks
    assert fb["what"] == "compile" and "sampler lowering failed" in fb["reason"], fb
    assert "sampler lowering failed" in capsys.readouterr().err
    assert not eng.compile and eng._sample is static_kernels.decode_sample  # eager from now on, layers included
    assert generation.rollout_record()["rollout_fallbacks"] == [fb]
