"""A CPU pre-flight of the static engine's GPU path: what would crash or stall on the first GPU run.

- A simulated CUDA-graph lifecycle. Stand-ins for torch.cuda.CUDAGraph, torch.cuda.graph, graph_pool_handle and
  the stream calls apply the caching allocator's rule for graph pools: capturing into a pool id that the
  allocator still holds with a use count of 0 trips the internal assert in create_or_incref_pool. The first
  capture of a process leaves a live block (the cuBLAS workspace) in its pool, so that pool outlives its graphs.
  The stand-in graph records the ops its capture ran (a TorchDispatchMode tape) and replays them into the
  same tensors, as a CUDA graph replays kernels on fixed addresses: a step that read a Python value or
  allocated a buffer per call would give wrong tokens here, as it would on the GPU.
- A capture that fails must fall back to the eager step, say so once, and leave the process on its own stream.
- A dispatch-mode guard fails the decode step if it syncs with the host (item, nonzero, a copy to the CPU).
- torch.compile(fullgraph=True) of the decode step traces without a graph break, and dynamo compiles each
  shape once: no recompiles across steps, layers or calls.

    pytest tests/test_engine_preflight.py -q
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plumbing import models, rollout, static_engine

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer(models.TINY_MODEL)


@pytest.fixture(scope="module")
def lm(tok):
    return models.load_model(models.TINY_MODEL, tok, seed=0).eval()


def make_prompts(lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 5000, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------------------
# the simulated graph lifecycle
# ------------------------------------------------------------------------------------------------------


class _Tape(TorchDispatchMode):
    """Records every op run under it with its inputs and outputs; replay() reruns them into the same outputs."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.fail, self.failed = fail, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.fail:
            self.failed = True
            raise RuntimeError(f"simulated: aten op inside capture ({func})")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            returns = func._schema.returns
            aliased = [r.alias_info for r in returns if r.alias_info is not None]
            if aliased and not any(a.is_write for a in aliased):
                continue  # a view: it still aliases the storage that the ops before it refill
            new = func(*args, **kwargs)
            olds = out if isinstance(out, (tuple, list)) else (out,)
            news = new if isinstance(new, (tuple, list)) else (new,)
            for o, n in zip(olds, news):
                if isinstance(o, torch.Tensor) and o is not n:
                    o.copy_(n)


class FakeCuda:
    """torch.cuda's graph and stream calls, simulated on the CPU with the allocator's pool bookkeeping."""

    def __init__(self, fail_capture: bool = False, fail_step: bool = False, fail_after: int | None = None) -> None:
        """fail_capture: capture_begin raises; fail_after: it raises from the (fail_after + 1)-th capture on;
        fail_step: the first op inside a capture raises, and capture_end then raises its own generic error."""
        self.pools: dict[tuple, dict] = {}  # pool id -> {"uses": graphs alive in it, "pinned": a live block}
        self.ids = itertools.count(1)
        self.captures = 0
        self.fail_capture, self.fail_step, self.fail_after = fail_capture, fail_step, fail_after
        self.generator = FakeGenerator()  # torch.cuda.default_generators[0]
        self.open_captures = 0
        self.on_replay = lambda: None
        self.default = FakeStream(self)
        self.stack = [self.default]
        fake = self

        class CUDAGraph:
            def __init__(self) -> None:
                self.tape: _Tape | None = None
                self.pool: tuple | None = None

            def capture_begin(self, pool=None, capture_error_mode="global") -> None:
                fake.generator.capturing = True  # the generator's capture prologue runs before the stream's capture
                if fake.fail_capture or (fake.fail_after is not None and fake.captures >= fake.fail_after):
                    fake.captures += 1
                    raise RuntimeError("simulated: operation not permitted when stream is capturing")
                pool = tuple(pool) if pool is not None else (0, next(fake.ids))  # None: a private pool
                entry = fake.pools.get(pool)
                if entry is not None and entry["uses"] == 0:
                    raise RuntimeError(
                        "INTERNAL ASSERT FAILED in create_or_incref_pool: it->second->use_count > 0 (simulated)"
                    )
                if entry is None:
                    entry = fake.pools[pool] = {"uses": 0, "pinned": fake.captures == 0}  # the cuBLAS workspace
                entry["uses"] += 1
                fake.captures += 1
                self.pool = pool
                weakref.finalize(self, fake.release, pool)
                self.tape = _Tape(fail=fake.fail_step)
                self.tape.__enter__()
                fake.open_captures += 1

            def capture_end(self) -> None:
                if self.tape is not None:
                    self.tape.__exit__(None, None, None)
                    fake.open_captures -= 1
                    if self.tape.failed:  # the stream's capture was invalidated: no epilogue for the generator
                        raise RuntimeError("generic: operation failed due to a previous error during capture")
                    fake.generator.capturing = False

            def replay(self) -> None:
                fake.on_replay()
                self.tape.replay()

        class graph:  # torch.cuda.graph: enters the capture stream first, then begins the capture
            def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global") -> None:
                self.g, self.pool = cuda_graph, pool
                self.stream_ctx = fake.stream(stream or FakeStream(fake))

            def __enter__(self):
                gc.collect()
                self.stream_ctx.__enter__()
                self.g.capture_begin(pool=self.pool)

            def __exit__(self, *exc):
                self.g.capture_end()
                self.stream_ctx.__exit__(*exc)
                return False

        self.CUDAGraph, self.graph = CUDAGraph, graph

    def release(self, pool: tuple) -> None:
        entry = self.pools[pool]
        entry["uses"] -= 1
        if entry["uses"] == 0 and not entry["pinned"]:
            del self.pools[pool]  # no live block: the allocator frees the pool

    def graph_pool_handle(self) -> tuple:
        return (1, next(self.ids))

    @contextlib.contextmanager
    def stream(self, s):
        self.stack.append(s)
        try:
            yield
        finally:
            self.stack.pop()

    def current_stream(self, device=None):
        return self.stack[-1]

    def install(self, monkeypatch) -> None:
        for name in ("CUDAGraph", "graph", "graph_pool_handle", "stream", "current_stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: FakeStream(self))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "default_generators", (self.generator,))


class FakeGenerator:
    """The CUDA generator's graph state: in capture mode from a capture's prologue until its epilogue."""

    def __init__(self, capturing: bool = False) -> None:
        self.capturing = capturing

    def clone_state(self) -> FakeGenerator:
        return FakeGenerator()

    def graphsafe_set_state(self, state: FakeGenerator) -> None:
        self.capturing = state.capturing


class FakeStream:
    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


def graph_engine(lm, fake: FakeCuda, **kw) -> static_engine.StaticEngine:
    """A CPU engine forced onto its CUDA-graph path, with the stand-ins in place."""
    eng = static_engine.StaticEngine(lm, **kw)
    eng.cuda_graph = True
    eng.pool = fake.graph_pool_handle()
    return eng


def sample(eng, prompts, T, pad, seed=0, **kw):
    u = rollout.step_uniforms(seed, 0, 0, len(prompts), T, CPU)
    return eng.generate(prompts, max_new_tokens=T, eos_id=-1, pad_id=pad, uniforms=u, temperature=0.9, **kw)


def test_simulated_graphs_grow_without_the_pool_assert_and_replay_the_eager_tokens(lm, tok, monkeypatch):
    """One engine: T = 16 then 80, 6 rows then 70, prompt bucket 128 then 192 (what grpo.py and ppo.py's final
    evaluation do). Every call must equal a fresh eager engine's tokens, and no capture may hit the assert."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    pad = tok.pad_token_id
    eng = graph_engine(lm, fake, prompt_bucket=64)
    small = make_prompts((3, 41, 17, 120, 1, 64))  # longest 120: bucket 128
    big = make_prompts([180] + [3 + (7 * i) % 40 for i in range(69)])  # longest 180: bucket 192
    calls = [(small, 16), (small, 80), (big, 16), (small, 16)]
    for prompts, T in calls:
        got = sample(eng, prompts, T, pad)
        ref = sample(static_engine.StaticEngine(lm), prompts, T, pad)
        assert torch.equal(got.response_ids, ref.response_ids), f"{len(prompts)} rows, T = {T}"
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert fake.captures > 0, "the engine never took its graph path"
    assert fake.stack == [fake.default]


def test_simulated_graphs_of_row_groups_replay_the_ungrouped_tokens(lm, tok, monkeypatch, one_thread):
    """Row groups on the graph path: one graph per tuple of group widths (at most 1 + groups x ceil((T - 1) /
    kv_chunk) in a call), each replaying the ungrouped eager engine's tokens (bitwise on one thread:
    conftest.one_thread); a second call captures nothing."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    pad, T = tok.pad_token_id, 20
    eng = graph_engine(lm, fake, row_groups=3, kv_chunk=16)
    prompts = make_prompts((3, 120, 17, 60, 1, 90, 33))
    got = sample(eng, prompts, T, pad, return_hidden=True)
    ref = sample(static_engine.StaticEngine(lm), prompts, T, pad, return_hidden=True)
    assert torch.equal(got.response_ids, ref.response_ids) and torch.equal(got.hidden, ref.hidden)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    widths = {w for (_, w, *_) in eng.graphs}
    assert all(len(w) == 3 for w in widths) and len(widths) == fake.captures <= 1 + 3 * 2, widths
    assert all(w[0] > w[-1] for w in widths), "the shortest rows read the longest row's width"
    again = sample(eng, prompts, T, pad, return_hidden=True)
    assert torch.equal(again.response_ids, ref.response_ids) and fake.captures == len(widths)


def test_simulated_failed_capture_falls_back_to_the_eager_step_once(lm, tok, monkeypatch, capsys):
    fake = FakeCuda(fail_capture=True)
    fake.install(monkeypatch)
    pad = tok.pad_token_id
    prompts = make_prompts((3, 41, 17))
    eng = graph_engine(lm, fake)
    a = sample(eng, prompts, 12, pad)
    b = sample(eng, prompts, 20, pad)
    ref = static_engine.StaticEngine(lm)
    assert torch.equal(a.response_ids, sample(ref, prompts, 12, pad).response_ids)
    assert torch.equal(b.response_ids, sample(ref, prompts, 20, pad).response_ids)
    assert fake.stack == [fake.default], "the process was left on the capture stream"
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "graph" in err, err


# ------------------------------------------------------------------------------------------------------
# no host sync inside the decode step
# ------------------------------------------------------------------------------------------------------

SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "_assert_async"}


class NoHostSync(TorchDispatchMode):
    """Raises on any op that makes the host wait for the device: reading a value, a data-dependent shape,
    or a copy from a device tensor to the CPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in SYNCS:
            raise AssertionError(f"the decode step syncs with the host: aten.{name}")
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            raise AssertionError("the decode step syncs with the host: boolean indexing (a nonzero)")
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_cpu = (args[0].device.type == "cpu") if name == "copy_" else (kwargs.get("device") == CPU)
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_cpu:
                raise AssertionError(f"the decode step copies to the CPU: aten.{name}")
        return func(*args, **kwargs)


def test_guard_catches_a_sync():
    with pytest.raises(AssertionError, match="syncs"), NoHostSync():
        torch.ones(3).sum().item()
    with pytest.raises(AssertionError, match="syncs"), NoHostSync():
        torch.ones(3)[torch.ones(3) > 0]


@pytest.mark.parametrize("sampled,groups", [(False, 1), (True, 1), (True, 2)])
def test_decode_step_never_syncs_with_the_host(lm, tok, sampled, groups):
    eng = static_engine.StaticEngine(
        lm, check_every=1000, row_groups=groups
    )  # the finished-check: the one sync, outside
    calls = []
    step = eng._decode_step

    def guarded(*a, **k):
        calls.append(1)
        with NoHostSync():
            return step(*a, **k)

    eng._decode_step = guarded
    prompts = make_prompts((3, 41, 17))
    u = rollout.step_uniforms(0, 0, 0, 3, 10, CPU) if sampled else None
    eng.generate(prompts, max_new_tokens=10, eos_id=-1, pad_id=tok.pad_token_id, uniforms=u, top_p=0.9)
    assert len(calls) == 10


# ------------------------------------------------------------------------------------------------------
# torch.compile: one graph, no recompiles
# ------------------------------------------------------------------------------------------------------


def test_decode_step_compiles_fullgraph_once_per_shape(lm, tok, monkeypatch):
    """The whole decode step traces with fullgraph=True (no graph break, so nothing reads a device value on
    the host) and each step function compiles once: later steps, layers and calls reuse it."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()  # counts the graphs dynamo hands its backend; runs them eagerly (cheap)
    eng = static_engine.StaticEngine(lm, check_every=1000)
    step = eng._decode_step
    compiled: dict = {}

    def via_compile(*a):
        if a not in compiled:
            compiled[a] = torch.compile(functools.partial(step, *a), fullgraph=True, backend=counter)
        return compiled[a]()

    eng._decode_step = via_compile
    prompts, pad = make_prompts((3, 41, 17)), tok.pad_token_id
    u = rollout.step_uniforms(0, 0, 0, 3, 12, CPU)
    first = eng.generate(prompts, max_new_tokens=12, eos_id=-1, pad_id=pad, uniforms=u)
    shapes, graphs = len(compiled), counter.frame_count
    assert graphs == shapes >= 1, (graphs, shapes)
    again = eng.generate(prompts, max_new_tokens=12, eos_id=-1, pad_id=pad, uniforms=u)
    assert counter.frame_count == graphs, "a second call recompiled the step"
    assert torch.equal(first.response_ids, again.response_ids)
    ref = static_engine.StaticEngine(lm).generate(prompts, max_new_tokens=12, eos_id=-1, pad_id=pad, uniforms=u)
    assert torch.equal(first.response_ids, ref.response_ids)
    torch._dynamo.reset()
