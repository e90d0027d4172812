"""StaticEngine: rollouts of a Llama or Qwen2 model over a preallocated KV cache, one CUDA graph a decode step.

The class's docstring says how: its own weight copies refreshed every call, the left-aligned cache, decode
attention in row groups, the graphs and their keys, capture on a side stream with an eager fallback, compiled
layer pieces. A row's tokens depend only on its own prompt and uniforms (tests/test_engine*.py).
Does not hold: the layer and sampler functions (static_kernels.py), generate() and the choice of backend
(generation.py). Imports rollout.py, forward.py (the fp32-output head GEMM), static_kernels.py and runtime.py.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing import distributed, runtime
from plumbing.forward import matmul_fp32_out
from plumbing.rollout import Rollout, left_pad, round_up
from plumbing.static_kernels import (
    BATCH_BUCKETS,
    CPU_KV_CHUNK,
    CPU_MIN_ROWS,
    CPU_PROMPT_BUCKET,
    FLEX_BLOCK,
    causal_attention_math,
    decode_attention_math,
    decode_sample,
    generator_restore,
    generator_snapshot,
    group_widths,
    length_bias,
    llama_post_attention,
    llama_pre_attention,
    prefill_post_attention,
    prefill_pre_attention,
    rope_at,
    row_group_bounds,
    static_engine_unsupported,
    tokens_dynamic,
    unique_prompts,
)


def _is_oom(e: BaseException) -> bool:
    """An out-of-memory error (possibly wrapped by dynamo): not a compile failure, so not a reason to fall back."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class StaticEngine:
    """Rollouts of a Llama- or Qwen2-family model (static_engine_unsupported says which run) over a static KV
    cache; on a GPU the decode step is one CUDA graph.

    - Weights. The engine keeps its own copies: the embedding, norms and residual stream in fp32, the
      matrices in the compute dtype (bf16 on a GPU, as under training's autocast; fp32 on the CPU), q/k/v
      (with Qwen2's q/k/v biases, also in the compute dtype) and gate/up fused. `refresh()` copies the live
      parameters into them at the start of every generate() call. The CUDA graphs read only these copies, whose
      addresses never change, so a graph never runs stale weights, whatever the optimiser did in between (and a
      replaced parameter tensor is picked up too).
    - KV cache: [layers, 2 (k, v), rows, kv_heads, slots, head_dim], left-aligned: slot = position, so each
      row's valid slots are [0, its length), contiguous. Response token t of a row with a prompt of length p
      goes to slot p + t.
    - Decode attention, in row groups. With more than one group (groups_for: 2 on a GPU from 256 rows, 1 on
      the CPU unless row_groups says), the engine's rows are the prompts sorted longest first (prompts and
      their uniforms permuted on the way in, every output put back in the caller's order), split into
      contiguous groups (row_group_bounds: the longest eighth, then the rest evenly); each group's attention
      reads the first Lk_g slots, Lk_g its own longest row's length rounded up to kv_chunk (group_widths),
      with a per-row additive length mask (slot <= position) built once a step, the query heads of a kv head
      packed together (grouped-query attention without repeating the cache). At 512 GSM8K rows x 256 tokens,
      2 groups read 3.72 GB of KV a step instead of 4.66 (bench/throughput.py's decode_floor). A row's tokens
      still depend only on its own prompt and uniforms (on the CPU in fp32 they are bitwise the ungrouped ones).
    - One graph per (rows, group widths, sampler settings): the prompt width does not enter the decode step,
      so prompt buckets 192 and 256 share their graphs. A group's width steps up at most ceil((T - 1) /
      kv_chunk) times in a call of T tokens, so a call needs at most 1 + groups x ceil((T - 1) / kv_chunk)
      graphs (5 with one group at T = 256 and kv_chunk 64, 9 with two; 18 over ten GSM8K batches of 512 with
      two), and an engine at most as many as there are non-increasing tuples of `groups` widths out of the
      W = max_l / kv_chunk widths, C(W + groups - 1, groups) per (rows, settings) (36 for W = 8 and two
      groups). The widths enter no compiled piece: a new tuple costs a capture, not a compile.
    - Buffers are sized for the largest shape seen or reserved (reserve()): rows rounded to BATCH_BUCKETS on
      a GPU, slots to 256, steps to 64. Growing them releases every graph and takes a new graph pool (the
      old pool may still hold the cuBLAS workspace of the first capture: capturing into it again trips the
      allocator's assertion). Call reserve() with the run's largest shape (its evaluation) to capture once.
    - Capture runs on a side stream entered by this code, not by torch.cuda.graph: a failed capture leaves
      the process on its own stream, prints one notice and runs the eager step from then on.
    - The decode step reads and writes static buffers only (the state h, a step counter on the device, the
      uniforms, the finished flags, the outputs), never syncs with the host, and traces with
      torch.compile(fullgraph=True) (tests/test_engine_preflight.py). Whether every row has finished is read
      every `check_every` steps.
    - Prefill: prompts right-padded to a multiple of prompt_bucket, positions 0.., plain causal attention (the
      SDPA backend pinned: flash or memory-efficient on a GPU, never cuDNN); padding queries only write slots
      that a later token overwrites or the length mask hides. With compile=True the layer pieces of both
      prefill and decode go through torch.compile, and so does the rest of the decode step: decode_sample
      (the LM head, the sampler, the step's bookkeeping and the next token's embedding and RoPE), so that on a
      GPU those fuse instead of launching dozens of small kernels. A failure of any compiled piece falls back
      to eager for all of them (engine.fallbacks says why).
    - Sampling: sample_tokens_fp32 (fp32, two-level CDF, top-k prefilter before top-p), the LM head in the
      compute dtype with fp32 output (matmul_fp32_out), as the training forward's _TokenLogProbs.
    """

    _by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its engine (StaticEngine.of)

    def __init__(
        self,
        lm: nn.Module,
        *,
        cuda_graph: bool | None = None,
        compile: bool | None = None,
        compile_backend: Any = "inductor",
        batch_multiple: int | None = None,
        batch_buckets: Sequence[int] | None = None,
        prompt_bucket: int | None = None,
        kv_chunk: int | None = None,
        check_every: int | None = None,
        top_k: int | None = None,
        attention: str = "sdpa",
        row_groups: int | None = None,
    ) -> None:
        reason = static_engine_unsupported(lm)
        if reason is not None:
            raise ValueError(f"StaticEngine cannot run this model: {reason}")
        self._lm = weakref.ref(lm)  # no strong reference: the engine cache must not keep a model alive
        p = next(lm.parameters())
        self.device = p.device
        cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.cuda_graph = cuda if cuda_graph is None else (cuda_graph and cuda)
        self.compile = cuda if compile is None else compile
        self.compile_backend = compile_backend
        # rows: a multiple when given, else the buckets (on a GPU), else exactly what is asked (the CPU)
        self.batch_multiple = batch_multiple
        self.batch_buckets = tuple(batch_buckets) if batch_buckets is not None else (BATCH_BUCKETS if cuda else ())
        # on a GPU, buckets keep the graphs and compiled shapes few; on the CPU (no graphs) they are only padding
        self.prompt_bucket = prompt_bucket or (64 if cuda else CPU_PROMPT_BUCKET)
        self.kv_chunk = kv_chunk or (64 if cuda else CPU_KV_CHUNK)
        self.slot_multiple = 256 if cuda else CPU_KV_CHUNK  # the cache's slots: few sizes on a GPU, compact on the CPU
        # the CPU samples as transformers' path does (rollout.sample_tokens, fp64 CDF and uniforms): a row's token
        # then stays put when two batchings differ in the last bits of its logits (N ranks equal one process)
        self.fp64_cdf = not cuda
        self.check_every = check_every or (16 if cuda else 1)
        self.top_k = (1024 if cuda else 0) if top_k is None else top_k  # the top-p prefilter (0: none)
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be sdpa or flex, not {attention!r}")
        self.attention = attention
        self.row_groups = row_groups  # None: groups_for's rule (2 on a GPU from 256 rows, 1 on the CPU)
        self._flex: Callable | None = None
        self._flex_compiled = False
        if attention == "flex":  # compiled on a GPU (the eager flex_attention is a slow reference)
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
            self._flex_compiled = cuda
        self.fallbacks: list[dict[str, str]] = []  # every fallback of this engine: {"what", "kind", "reason"}
        self._warmed: set[tuple] = set()  # step keys run once with compile on and no graph (_step_fns)
        self._block_masks: dict[int, Any] = {}

        cfg, m = lm.config, lm.model
        attn = m.layers[0].self_attn
        self.n_layers = len(m.layers)
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.rep = self.n_heads // self.n_kv
        self.scale = float(attn.scaling)
        self.eps = float(cfg.rms_norm_eps)
        self.hidden_size = cfg.hidden_size
        self.inter = m.layers[0].mlp.gate_proj.weight.shape[0]
        self.vocab = m.embed_tokens.weight.shape[0]
        self.inv_freq = m.rotary_emb.inv_freq.detach().float().clone().to(self.device)
        self.rope_scale = float(getattr(m.rotary_emb, "attention_scaling", 1.0))

        L, H, inter, d = self.n_layers, self.hidden_size, self.inter, self.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv) * d
        f32, dt, dev = torch.float32, self.dtype, self.device
        self.embed = torch.empty(self.vocab, H, dtype=f32, device=dev)
        self.tied = lm.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
        self.head = self.embed if (self.tied and dt == f32) else torch.empty(self.vocab, H, dtype=dt, device=dev)
        self.norm_w = torch.empty(H, dtype=f32, device=dev)
        self.ln1 = torch.empty(L, H, dtype=f32, device=dev)
        self.ln2 = torch.empty(L, H, dtype=f32, device=dev)
        self.qkv = torch.empty(L, qkv_out, H, dtype=dt, device=dev)
        has_bias = m.layers[0].self_attn.q_proj.bias is not None  # Qwen2: q/k/v biases, fused like the weights
        self.qkv_b = torch.empty(L, qkv_out, dtype=dt, device=dev) if has_bias else None
        self.o = torch.empty(L, H, self.n_heads * d, dtype=dt, device=dev)
        self.gate_up = torch.empty(L, 2 * inter, H, dtype=dt, device=dev)
        self.down = torch.empty(L, H, inter, dtype=dt, device=dev)

        self.max_b = self.max_l = self.max_t = 0
        self.with_hidden = False
        self.graphs: dict[tuple, Callable] = {}  # (rows, group widths, sampler settings, hidden) -> graph.replay
        self.pool: Any = None  # the graph pool of self.graphs; a new one after every release
        self.short_rows = torch.zeros(1, dtype=torch.long, device=dev)  # rows the top-k prefilter cut short
        if dt != f32:  # matmul_fp32_out's probe runs here, eagerly: the compiled decode_sample never traces it
            matmul_fp32_out(torch.zeros(1, 8, dtype=dt, device=dev), torch.zeros(8, 1, dtype=dt, device=dev))
        self._set_layer_fns(self.compile)
        self.compile_seconds = 0.0  # time spent in warm-up and capture (compilation included), for benchmarks
        self.captures = 0
        self.timing = False  # benchmarks: sync and time prefill and the decode loop of each call (last_timing)
        self.last_timing: dict[str, float] = {}

    @classmethod
    def of(cls, lm: nn.Module) -> StaticEngine:
        """The engine of a model, made on first use and kept (with its buffers and graphs) while the model lives."""
        lm = distributed.unwrap(lm)
        eng = cls._by_model.get(lm)
        device = next(lm.parameters()).device
        if eng is None or eng.device != device or eng.vocab != lm.model.embed_tokens.weight.shape[0]:
            eng = cls._by_model[lm] = cls(lm)
        return eng

    # ---- weights -------------------------------------------------------------------------------------

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's current parameters into the engine's weight buffers (every generate() does this)."""
        lm = self._lm()
        if lm is None:
            raise RuntimeError("the model of this StaticEngine no longer exists")
        m, q, k = lm.model, self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.embed.copy_(m.embed_tokens.weight)
        if self.head is not self.embed:
            self.head.copy_(lm.lm_head.weight)
        self.norm_w.copy_(m.norm.weight)
        for i, layer in enumerate(m.layers):
            a, mlp = layer.self_attn, layer.mlp
            self.ln1[i].copy_(layer.input_layernorm.weight)
            self.ln2[i].copy_(layer.post_attention_layernorm.weight)
            self.qkv[i, :q].copy_(a.q_proj.weight)
            self.qkv[i, q : q + k].copy_(a.k_proj.weight)
            self.qkv[i, q + k :].copy_(a.v_proj.weight)
            if self.qkv_b is not None:
                self.qkv_b[i, :q].copy_(a.q_proj.bias)
                self.qkv_b[i, q : q + k].copy_(a.k_proj.bias)
                self.qkv_b[i, q + k :].copy_(a.v_proj.bias)
            self.o[i].copy_(a.o_proj.weight)
            self.gate_up[i, : self.inter].copy_(mlp.gate_proj.weight)
            self.gate_up[i, self.inter :].copy_(mlp.up_proj.weight)
            self.down[i].copy_(mlp.down_proj.weight)

    @property
    def backend_name(self) -> str:
        """What the decode steps run as now: "static + CUDA graphs" or "static" (eager or compiled layers)."""
        return "static + CUDA graphs" if self.cuda_graph else "static"

    def _fall_back(self, what: str, message: str, e: BaseException) -> None:
        """Record a fallback (on this engine and in rollout_record) and say it once, with the real cause."""
        cause = f"{type(e).__name__}: {e}".split("Set TORCHDYNAMO_VERBOSE")[0].strip().splitlines()
        reason = " | ".join(line.strip() for line in cause if line.strip())[:600]
        entry = {"what": what, "kind": "error", "reason": f"{message}: {reason}"}
        self.fallbacks.append(entry)
        runtime.RUN.fallbacks.append(entry)
        runtime.notice_once(f"{message} ({reason})")

    def _compile_off(self) -> None:
        """Eager layers from now on, the compiled flex_attention dropped too (its retry would fail the same way)."""
        self.compile = False
        self._set_layer_fns(False)
        if self._flex_compiled:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex, self._flex_compiled = flex_attention, False

    def _bias(self, i: int) -> torch.Tensor | None:
        """Layer i's fused q/k/v bias [(heads + 2 kv_heads) d], or None (Llama)."""
        return None if self.qkv_b is None else self.qkv_b[i]

    def _set_layer_fns(self, compile: bool) -> None:
        """The layer pieces of decode (static shapes) and prefill (dynamic), and the decode step's head, sampler
        and bookkeeping (decode_sample, static), compiled or eager."""
        self._prefill_compiled = compile
        if not compile:
            self._pre = self._prefill_pre = llama_pre_attention
            self._post = self._prefill_post = llama_post_attention
            self._sample = decode_sample
            return
        be = self.compile_backend
        self._pre = torch.compile(llama_pre_attention, dynamic=False, backend=be)
        self._post = torch.compile(llama_post_attention, dynamic=False, backend=be)
        self._sample = torch.compile(decode_sample, dynamic=False, backend=be)
        # prefill: only the token count is dynamic (marked in _prefill); the weights' sizes stay static
        self._prefill_pre = torch.compile(prefill_pre_attention, dynamic=None, backend=be)
        self._prefill_post = torch.compile(prefill_post_attention, dynamic=None, backend=be)

    # ---- buffers -------------------------------------------------------------------------------------

    def rows_for(self, b: int) -> int:
        """The rows a batch of b runs with: a multiple of batch_multiple, else the smallest bucket that holds it;
        on the CPU at least CPU_MIN_ROWS (extra rows start finished)."""
        if self.batch_multiple:
            return round_up(b, self.batch_multiple)
        for bucket in self.batch_buckets:
            if b <= bucket:
                return bucket
        if self.batch_buckets:
            return round_up(b, self.batch_buckets[-1])
        return b if self.device.type == "cuda" else max(b, CPU_MIN_ROWS)

    def reserve(self, rows: int, prompt_tokens: int, new_tokens: int, return_hidden: bool = False) -> None:
        """Size the buffers for the largest call a run will make (rows, longest prompt, new tokens), so that
        later calls capture each graph once and never reallocate."""
        n, P = self.rows_for(rows), round_up(max(prompt_tokens, 1), self.prompt_bucket)
        self._ensure_buffers(n, max(P, prompt_tokens + new_tokens), new_tokens, return_hidden)

    def release_graphs(self) -> None:
        """Drop every captured graph, and with them their pool: the next capture takes a new pool handle."""
        self.graphs.clear()
        self.pool = None

    def _ensure_buffers(self, n: int, length: int, steps: int, hidden: bool) -> None:
        """Grow-only state buffers; growing them releases the captured graphs (they point at the old ones)."""
        if n <= self.max_b and length <= self.max_l and steps <= self.max_t and (self.with_hidden or not hidden):
            return
        self.release_graphs()
        self.max_b = max(n, self.max_b)
        self.max_l = max(round_up(length, self.slot_multiple), self.max_l)
        self.max_t = max(round_up(steps, 64), self.max_t)
        self.with_hidden = self.with_hidden or hidden
        B, Lm, T, dev = self.max_b, self.max_l, self.max_t, self.device
        self.kv = None  # free the old cache before allocating the new one
        # zeros, not empty: masked slots enter attention as 0 * value, and 0 * NaN garbage would be NaN
        self.kv = torch.zeros(self.n_layers, 2, B, self.n_kv, Lm, self.head_dim, dtype=self.dtype, device=dev)
        self.slot_ids = torch.arange(Lm, device=dev)
        self.pos0 = torch.zeros(B, dtype=torch.long, device=dev)  # prompt length = slot of response token 0
        self.h = torch.zeros(B, self.hidden_size, device=dev)  # final-norm hidden state of the current state
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.u = torch.zeros(B, T, device=dev, dtype=torch.float64 if self.fp64_cdf else torch.float32)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self.out_tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.out_logp = torch.zeros(B, T, device=dev)
        self.out_mask = torch.zeros(B, T, device=dev)
        self.out_hidden = torch.zeros(B, T, self.hidden_size, device=dev) if self.with_hidden else None
        if self.attention == "flex":  # the block mask's per-row state, updated in place by each step
            nb = Lm // FLEX_BLOCK
            self.flex_pos = torch.zeros(B, dtype=torch.long, device=dev)
            self.flex_blocks = torch.zeros(B, 1, 1, dtype=torch.int32, device=dev)
            self.flex_indices = torch.arange(nb, dtype=torch.int32, device=dev).expand(B, 1, 1, nb).contiguous()
            self._block_masks.clear()

    # ---- the model -----------------------------------------------------------------------------------

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin fp32 [n, S, 1, head_dim] at positions [n, S] (rope_at with this model's frequencies)."""
        return rope_at(pos, self.inv_freq, self.rope_scale)

    def _sdpa_backends(self, prefill: bool) -> list:
        """The SDPA kernels allowed: prefill (causal, no mask) flash then memory-efficient; decode (a length
        mask) memory-efficient; the math kernel last; never cuDNN. The CPU has its own."""
        from torch.nn.attention import SDPBackend

        if self.device.type != "cuda":
            return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
        if prefill:
            return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def _decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """One query per row over its valid slots, the query heads of a kv head packed as that head's queries.
        q [n, 1, heads, d], k/v [n, kv_heads, Lk, d], bias [n, 1, 1, Lk] (length_bias) -> [n, 1, heads d]"""
        from torch.nn.attention import sdpa_kernel

        n = q.shape[0]
        qg = q[:, 0].unflatten(1, (self.n_kv, self.rep))  # [n, kv, rep, d]: head h reads kv head h // rep
        if self.device.type == "cpu":  # two matmuls: faster than the CPU's SDPA kernels for one query a row
            return decode_attention_math(qg, k, v, bias, self.scale).reshape(n, 1, self.n_heads * self.head_dim)
        with sdpa_kernel(self._sdpa_backends(prefill=False)):
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=self.scale)
        return o.reshape(n, 1, self.n_heads * self.head_dim)

    def _block_mask(self, n: int) -> Any:
        """flex_attention's BlockMask for n rows over all slots: row b reads its first flex_blocks[b] blocks of
        FLEX_BLOCK slots, and inside them the slots <= flex_pos[b]. Both tensors are buffers that the decode
        step rewrites in place, so one mask (and one graph) serves every step."""
        if n not in self._block_masks:
            from torch.nn.attention.flex_attention import BlockMask

            pos = self.flex_pos

            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= pos[b]

            self._block_masks[n] = BlockMask.from_kv_blocks(
                self.flex_blocks[:n],
                self.flex_indices[:n],
                BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
                mask_mod=mask_mod,
                seq_lengths=(1, self.max_l),
            )
        return self._block_masks[n]

    def _flex_decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        """The decode attention of attention="flex": only each row's valid blocks are read (flex decoding with
        grouped-query heads).  q [n, 1, heads, d], k/v [n, kv_heads, L, d] -> [n, 1, heads d]"""
        n = q.shape[0]
        o = self._flex(q.transpose(1, 2), k, v, block_mask=mask, enable_gqa=True, scale=self.scale)  # [n, h, 1, d]
        return o.transpose(1, 2).reshape(n, 1, self.n_heads * self.head_dim)

    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over right-padded prompts.  q [n, S, heads, d], k/v [n, kv_heads, S, d] -> [n, S, heads d]"""
        from torch.nn.attention import sdpa_kernel

        n, S = q.shape[:2]
        if self.device.type == "cpu":  # a row's result then does not depend on the batch's width S
            qg = q.transpose(1, 2).unflatten(1, (self.n_kv, self.rep)).flatten(2, 3)  # [n, kv, rep S, d]
            o = causal_attention_math(qg, k, v, self.scale)  # [n, kv, rep S, d]
            return o.unflatten(2, (self.rep, S)).flatten(1, 2).transpose(1, 2).reshape(n, S, -1)
        k, v = (x.repeat_interleave(self.rep, dim=1) for x in (k, v))  # [n, heads, S, d]
        with sdpa_kernel(self._sdpa_backends(prefill=True)):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=self.scale)
        return o.transpose(1, 2).reshape(n, S, self.n_heads * self.head_dim)

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Right-padded prompts [u, P] into cache slots [0, P) (slot = position); self.h gets each row's state
        before its first response token (the final-norm hidden state at slot length - 1).  lengths [u] >= 1

        rows [n] (or None: u = n, row i is prompt i): the prompt of each engine row, when rows share prompts
        (GRPO's G completions of a prompt): each distinct prompt runs once and its keys, values and state are
        copied to every row that holds it (unique_prompts).
        The layer pieces see the u * P tokens as one row [1, N, H] with N marked dynamic: one dynamic size
        (a multiple of prompt_bucket, never 0 or 1), the weights' sizes static, so no (rows, width) pair
        recompiles them, not even one whose size equals a model dimension."""
        u, P = ids.shape
        n = u if rows is None else rows.shape[0]
        N, H, d = u * P, self.hidden_size, self.head_dim
        pos = self.slot_ids[:P].expand(u, P)
        x = F.embedding(ids, self.embed).view(1, N, H)  # fp32 [1, N, H]
        cos, sin = (c.reshape(1, N, 1, d) for c in self._rope(pos))
        for i in range(self.n_layers):
            tokens_dynamic(x, cos, sin)
            q, kv = self._prefill_pre(
                x, self.ln1[i], self.qkv[i], cos, sin, self.eps, self.n_heads, self.n_kv, self._bias(i)
            )
            kv = kv.view(2, self.n_kv, u, P, d).transpose(1, 2)  # [2, u, kv_heads, P, d]
            self.kv[i, :, :n, :, :P] = kv if rows is None else kv.index_select(1, rows)
            o = self._prefill_attention(q.view(u, P, self.n_heads, d), kv[0], kv[1]).view(1, N, -1)
            tokens_dynamic(x, o)
            x = self._prefill_post(x, o, self.o[i], self.ln2[i], self.gate_up[i], self.down[i], self.eps)
        last = x.view(u, P, H)[torch.arange(u, device=ids.device), lengths - 1]  # [u, H]
        if rows is not None:
            last = last.index_select(0, rows)  # [n, H]
        self.h[:n] = F.rms_norm(last, (self.hidden_size,), self.norm_w, self.eps)

    def _decode_step(
        self,
        n: int,
        widths: tuple[int, ...],
        greedy: bool,
        temperature: float,
        top_p: float,
        eos_id: int,
        pad_id: int,
        hidden: bool,
    ) -> None:
        """One token for every row, reading and writing static buffers only (so it can be a CUDA graph).
        widths: the KV slots each row group's attention reads (group_widths; one group: every row reads widths[0])."""
        t = self.step  # [1], on the device
        x, cos, sin, pos = self._sample(
            self.h[:n],
            self.head,
            self.embed,
            None if greedy else self.u[:n],
            t,
            self.pos0[:n],
            self.finished[:n],
            self.out_tokens[:n],
            self.out_logp[:n],
            self.out_mask[:n],
            self.out_hidden[:n] if hidden else None,
            self.short_rows,
            self.inv_freq,
            self.rope_scale,
            temperature,
            top_p,
            self.top_k,
            eos_id,
            pad_id,
            self.fp64_cdf,
        )
        bounds = row_group_bounds(n, len(widths))
        groups = list(zip(bounds, bounds[1:], widths))  # (first row, end row, Lk) of each group
        # SDPA's additive masks, once a step (a boolean mask would be converted in every layer's call); flex: none
        sdpa = self._flex is None
        bias = [length_bias(self.slot_ids[:Lk], pos[r0:r1], self.dtype) for r0, r1, Lk in groups if sdpa]
        where = pos.view(1, n, 1, 1, 1).expand(2, n, self.n_kv, 1, self.head_dim)
        mask = None
        if self._flex is not None:
            self.flex_pos[:n] = pos
            self.flex_blocks[:n, 0, 0] = (pos // FLEX_BLOCK + 1).to(torch.int32)
            mask = self._block_mask(n)
        for i in range(self.n_layers):
            q, kv = self._pre(x, self.ln1[i], self.qkv[i], cos, sin, self.eps, self.n_heads, self.n_kv, self._bias(i))
            cache = self.kv[i, :, :n]  # [2, n, kv_heads, L, d]
            cache.scatter_(3, where, kv)
            if mask is not None:
                o = self._flex_decode_attention(q, cache[0], cache[1], mask)
            elif len(groups) == 1:
                Lk = widths[0]
                o = self._decode_attention(q, cache[0, :, :, :Lk], cache[1, :, :, :Lk], bias[0])
            else:  # each group reads its own width: the rows are sorted by length, so most read far fewer slots
                o = torch.cat(
                    [
                        self._decode_attention(q[r0:r1], cache[0, r0:r1, :, :Lk], cache[1, r0:r1, :, :Lk], v)
                        for (r0, r1, Lk), v in zip(groups, bias)
                    ]
                )  # [n, 1, heads d]
            x = self._post(x, o, self.o[i], self.ln2[i], self.gate_up[i], self.down[i], self.eps)
        self.h[:n] = F.rms_norm(x[:, -1], (self.hidden_size,), self.norm_w, self.eps)
        self.step.add_(1)

    # ---- graphs --------------------------------------------------------------------------------------

    def groups_for(self, n: int) -> int:
        """The row groups a batch of n rows decodes in: row_groups when given, else 2 on a GPU from 256 rows
        and 1 below and on the CPU; never more than n; 1 with flex attention (its block mask already bounds
        each row). Why 2: a second group adds an attention call and a concatenation a layer (64 eager ops a step
        for SmolLM2-135M; each further group 34), and at 512 GSM8K rows 2 groups (64 + 448 rows) read 3.72 GB
        of KV a step, 4 groups 3.51 GB, 1 group 4.66 (arithmetic: docs/throughput.md)."""
        if self._flex is not None:
            return 1
        cuda = self.device.type == "cuda"
        groups = self.row_groups if self.row_groups is not None else (2 if cuda and n >= 256 else 1)
        return max(1, min(groups, n))

    def _widths(self, lengths: Sequence[int], T: int, groups: int) -> list[tuple[int, ...]]:
        """The group widths of each step t (group_widths over the rows in engine order, capped at the cache's
        slots). With flex attention the block mask bounds each row: one width (one graph) for all steps."""
        if self._flex is not None:
            return [(self.max_l,)] * T
        return [group_widths(lengths, groups, t, self.kv_chunk, self.max_l) for t in range(T)]

    def _safe_state(self, n: int) -> None:
        """A state that warm-up and capture may run on: step 0, slot 0 (they scribble; generate resets after)."""
        self.step.zero_()
        self.pos0[:n].zero_()
        self.finished[:n].zero_()

    def _step_fns(self, settings: tuple, n: int, widths: Sequence[tuple[int, ...]]) -> dict[tuple, Callable]:
        """{group widths: a callable that runs one decode step}: CUDA graph replays on a GPU, eager calls
        elsewhere. Captures the graphs this call needs and does not have yet (before the call sets its state)."""
        fns = {w: functools.partial(self._decode_step, n, w, *settings) for w in sorted(set(widths))}
        t0 = time.perf_counter()
        if not self.cuda_graph:
            for w, fn in fns.items():  # compiled layers without graphs: compile here, where a failure is caught
                key = (n, w, *settings)
                if (self.compile or self._flex_compiled) and key not in self._warmed:
                    self._warm_up(fn, n, reps=1)
                    self._warmed.add(key)
            self.compile_seconds += time.perf_counter() - t0
            return fns
        replays = {}
        for w, fn in fns.items():
            key = (n, w, *settings)
            if key not in self.graphs:
                replay = self._capture(fn, n)
                if replay is None:  # the capture failed: every step of this call (and later ones) eager
                    return fns
                self.graphs[key] = replay
            replays[w] = self.graphs[key]
        self.compile_seconds += time.perf_counter() - t0
        return replays

    def _warm_up(self, fn: Callable, n: int, reps: int = 3) -> None:
        """Run a step a few times (compiles, lets libraries allocate); a compile failure falls back to eager
        layers (and eager flex_attention). An out-of-memory error is raised as it is: memory, not the compiler."""
        try:
            for _ in range(reps):
                self._safe_state(n)
                fn()
        except Exception as e:  # an inductor or triton failure must not stop training: run the eager layers
            if not (self.compile or self._flex_compiled) or _is_oom(e):
                raise
            self._fall_back("compile", "torch.compile of the decode step failed; using eager layers", e)
            self._compile_off()
            self._safe_state(n)
            fn()

    def _capture(self, fn: Callable, n: int) -> Callable | None:
        """Warm up and capture one decode step on a side stream; its replay, or None (with one notice) when the
        capture fails. The stream is entered here and always left, whatever capture_begin or the step raise."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        rng = generator_snapshot(self.device)
        try:
            with torch.cuda.stream(side):
                self._warm_up(fn, n)
                self._safe_state(n)
                torch.cuda.synchronize(self.device)  # as torch.cuda.graph does: nothing pending enters the capture
                graph.capture_begin(pool=self.pool)
                try:
                    fn()
                except BaseException:  # end the capture; its own (generic) error must not hide the cause
                    try:
                        graph.capture_end()
                    except Exception:
                        pass
                    raise
                graph.capture_end()
        except Exception as e:
            current.wait_stream(side)
            generator_restore(rng)  # a capture that never reached its epilogue leaves it in capture mode
            del graph
            self.release_graphs()
            if _is_oom(e):  # memory, not the graph: raised as it is, the graph path kept for a later call
                raise
            self._fall_back("cuda_graph", "CUDA graph capture of the decode step failed; running it eagerly", e)
            self.cuda_graph = False
            return None
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.captures += 1
        return graph.replay

    def _prefill_or_eager(self, ids: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """_prefill; a failure of its compiled layer pieces (not out-of-memory) falls back to the eager ones."""
        try:
            self._prefill(ids, lens, rows)
        except Exception as e:
            if not self._prefill_compiled or _is_oom(e):
                raise
            self._fall_back("prefill_compile", "torch.compile of the prefill failed; using eager prefill", e)
            self._prefill_pre, self._prefill_post = llama_pre_attention, llama_post_attention
            self._prefill_compiled = False
            self._prefill(ids, lens, rows)

    def _clock(self) -> float:
        if self.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def attention_backends(self, rows: int, Lk: int, prompt_width: int) -> dict[str, str]:
        """The SDPA kernel PyTorch picks, under this engine's pinned backends, for a decode step over Lk slots
        and a prefill of prompt_width tokens, at `rows` rows (dummy tensors of those shapes, nothing cached)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {int(v): k for k, v in SDPBackend.__members__.items()}
        d, dev, dt = self.head_dim, self.device, self.dtype
        q = torch.zeros(rows, self.n_kv, self.rep, d, dtype=dt, device=dev)
        k = torch.zeros(rows, self.n_kv, Lk, d, dtype=dt, device=dev)
        mask = torch.zeros(rows, 1, 1, Lk, dtype=dt, device=dev)  # the additive mask the decode step passes
        qp = torch.zeros(rows, self.n_heads, prompt_width, d, dtype=dt, device=dev)
        out = {}
        for name, args, causal, prefill in (
            ("decode", (q, k, k, mask), False, False),
            ("prefill", (qp, qp, qp, None), True, True),
        ):
            with sdpa_kernel(self._sdpa_backends(prefill=prefill)):
                try:
                    choice = torch._fused_sdp_choice(*args, dropout_p=0.0, is_causal=causal, scale=self.scale)
                    out[name] = names.get(int(choice), str(choice))
                except Exception as e:  # a private API: report, do not fail
                    out[name] = f"unknown ({type(e).__name__}: {e})"
        out["allowed_decode"] = ",".join(b.name for b in self._sdpa_backends(prefill=False))
        out["allowed_prefill"] = ",".join(b.name for b in self._sdpa_backends(prefill=True))
        return out

    # ---- generation ----------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        eos_id: int,
        pad_id: int,
        uniforms: torch.Tensor | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        return_hidden: bool = False,
        prompt_multiple: int = 1,
    ) -> Rollout:
        """What generation.generate returns, computed over the static cache. Arguments as generation.generate."""
        with torch.inference_mode(False), torch.autocast(self.device.type, enabled=False):
            return self._generate(
                prompts, max_new_tokens, eos_id, pad_id, uniforms, temperature, top_p, return_hidden, prompt_multiple
            )

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        T: int,
        eos_id: int,
        pad_id: int,
        uniforms: torch.Tensor | None,
        temperature: float,
        top_p: float,
        return_hidden: bool,
        prompt_multiple: int,
    ) -> Rollout:
        dev = self.device
        prompt_ids, prompt_mask = left_pad(prompts, pad_id, prompt_multiple)  # what the Rollout reports
        b = prompt_ids.shape[0]
        n = self.rows_for(b)
        groups = self.groups_for(n)
        # row groups: the engine's rows are the prompts longest first (a stable sort), undone on every output
        order = sorted(range(b), key=lambda i: -len(prompts[i])) if groups > 1 else None
        if order is not None:
            prompts = [prompts[i] for i in order]
        lengths = [max(1, len(s)) for s in prompts] + [1] * (n - b)  # an extra row: one pad token, last
        longest = max(lengths)
        self.reserve(n, longest, T, return_hidden)
        self.refresh()
        settings = (uniforms is None, float(temperature), float(top_p), int(eos_id), int(pad_id), return_hidden)
        widths = self._widths(lengths, T, groups)
        step_fns = self._step_fns(settings, n, widths)  # captures before the state is set: warm-up scribbles

        # the state: prompts right-padded (slot = position), extra rows finished from the start (one pad token);
        # each distinct prompt is prefilled once (GRPO's G completions of a prompt share it)
        P = round_up(longest, self.prompt_bucket)
        distinct, rows = unique_prompts([list(s) for s in prompts] + [[pad_id]] * (n - b))
        ids = torch.full((len(distinct), P), pad_id, dtype=torch.long)
        for i, s in enumerate(distinct):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        ids = ids.to(dev)
        lens = torch.tensor(lengths, device=dev)
        distinct_lens = torch.tensor([max(1, len(s)) for s in distinct], device=dev)
        rows_t = None if len(distinct) == n else torch.tensor(rows, device=dev)
        self.pos0[:n] = lens
        self.finished[:n] = torch.arange(n, device=dev) >= b
        self.step.zero_()
        self.short_rows.zero_()
        self.u[:n].zero_()
        if uniforms is not None:
            rows = slice(None) if order is None else torch.tensor(order, device=uniforms.device)
            self.u[:b, :T] = uniforms[rows, :T].to(device=dev, dtype=self.u.dtype)
        self.out_tokens[:n].fill_(pad_id)
        self.out_logp[:n].zero_()
        self.out_mask[:n].zero_()
        if return_hidden:
            self.out_hidden[:n].zero_()

        t0 = self._clock()
        self._prefill_or_eager(ids, distinct_lens, rows_t)
        t1 = self._clock()
        steps = 0
        for t in range(T):
            runtime.check_stop()  # a stop signal during an evaluation or a measurement: at once
            step_fns[widths[t]]()
            steps += 1
            if (t + 1) % self.check_every == 0 and t + 1 < T and bool(self.finished[:n].all()):
                break
        if self.timing:
            self.last_timing = {"prefill_s": t1 - t0, "decode_s": self._clock() - t1, "steps": steps, "rows": n}
        t_used = max(1, int(self.out_mask[:b].sum(-1).max().item()))
        if self.top_k and top_p < 1.0 and int(self.short_rows.item()):
            runtime.notice_once(
                f"top-p {top_p}: the {self.top_k} most likely tokens held less than top_p of the mass in some rows "
                f"(sampled among those {self.top_k}); StaticEngine(top_k=0) samples exactly"
            )
        back = None if order is None else torch.tensor(order, device=dev).argsort()  # engine row of each prompt

        def caller_order(x: torch.Tensor) -> torch.Tensor:  # a copy, rows in the caller's order
            return x.clone() if back is None else x[back]

        return Rollout(
            prompt_ids=prompt_ids.to(dev),
            prompt_mask=prompt_mask.to(dev),
            response_ids=caller_order(self.out_tokens[:b, :t_used]),
            response_mask=caller_order(self.out_mask[:b, :t_used]),
            logprobs=caller_order(self.out_logp[:b, :t_used]),
            hidden=caller_order(self.out_hidden[:b, :t_used]) if return_hidden else None,
        )
