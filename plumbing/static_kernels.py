"""The static engine's pure pieces: which models it runs, the layer functions, the fp32 sampler, row groups.

Holds: static_engine_unsupported (why a model is refused), the Llama/Qwen2 layer functions before and after
attention (RMSNorm, RoPE, q/k/v with Qwen2's biases, SwiGLU), the decode step's head-and-sampler piece
(decode_sample: the LM head, the two-level fp32 inverse CDF, the step's bookkeeping), the row groups that bound a
decode step's KV reads (row_group_bounds, group_widths), and the CUDA generator's snapshot for graph capture.
Each is a function of tensors, so that torch.compile traces it and the tests compare it with a plain loop.
Does not hold: the engine's buffers, graphs and fallbacks (static_engine.py). Imports rollout.py and forward.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing.forward import matmul_fp32_out
from plumbing.rollout import round_up, sample_tokens

STATIC_MODEL_TYPES = ("llama", "qwen2")  # what StaticEngine runs: SmolLM2 (Llama) and Qwen2 / Qwen2.5


def static_engine_unsupported(lm: nn.Module) -> str | None:
    """Why StaticEngine cannot run this model (None when it can). It runs the Llama and Qwen2 families: RMSNorm,
    RoPE of fixed frequencies, grouped-query attention over every earlier token, a SwiGLU MLP; q/k/v biases
    (Qwen2's) or none; tied or untied embeddings. Refused: an output-projection or MLP bias, another
    activation, sliding-window layers, a rotary embedding that changes with the sequence length."""
    cfg = getattr(lm, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in STATIC_MODEL_TYPES:
        return f"this model is {model_type!r}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act is {cfg.hidden_act!r}"
    kinds = getattr(cfg, "layer_types", None) or ()
    sliding = [i for i, kind in enumerate(kinds) if kind != "full_attention"]
    if sliding or (not kinds and getattr(cfg, "use_sliding_window", False)):
        return f"layers {sliding or 'all'} use sliding-window attention (window {getattr(cfg, 'sliding_window', None)})"
    for i, layer in enumerate(lm.model.layers):
        a, mlp = layer.self_attn, layer.mlp
        qkv_bias = [getattr(a, f"{x}_proj").bias is not None for x in "qkv"]
        if any(qkv_bias) and not all(qkv_bias):
            return f"layer {i} has a bias on some of q/k/v only"
        if a.o_proj.bias is not None:
            return f"layer {i} has an output-projection bias"
        if any(getattr(mlp, f"{x}_proj").bias is not None for x in ("gate", "up", "down")):
            return f"layer {i} has an MLP bias"
    rotary = getattr(getattr(lm, "model", None), "rotary_emb", None)
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if rotary is None or not hasattr(rotary, "inv_freq") or "dynamic" in rope_type or rope_type == "longrope":
        return f"its rotary embedding ({rope_type}) changes with the sequence length"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama_pre_attention(
    x: torch.Tensor,
    ln_w: torch.Tensor,
    qkv_w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    n_heads: int,
    n_kv: int,
    qkv_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, the fused q/k/v projection (with its fused bias: Qwen2's; None for Llama) and RoPE.
    x fp32 [n, S, H], cos/sin fp32 [n, S, 1, d], qkv_b [(heads + 2 kv_heads) d] or None
    -> q [n, S, heads, d] and kv [2, n, kv_heads, S, d] (keys and values, as the cache holds them), in the
    weights' dtype.

    The dtypes follow what training's bf16 autocast does in transformers' Llama: the residual stream and the
    norm in fp32, the projection in the compute dtype, RoPE in fp32 on the projection's output."""
    d = cos.shape[-1]
    h = F.rms_norm(x, (x.shape[-1],), ln_w, eps).to(qkv_w.dtype)
    qkv = F.linear(h, qkv_w, qkv_b)  # [n, S, (heads + 2 kv_heads) d]; the bias in the compute dtype, as autocast
    qk = qkv[..., : (n_heads + n_kv) * d].unflatten(-1, (n_heads + n_kv, d)).float()
    qk = (qk * cos + _rotate_half(qk) * sin).to(qkv.dtype)
    v = qkv[..., (n_heads + n_kv) * d :].unflatten(-1, (n_kv, d))
    return qk[..., :n_heads, :], torch.stack((qk[..., n_heads:, :], v)).transpose(2, 3)


def llama_post_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    o_w: torch.Tensor,
    ln_w: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The output projection, the residual, RMSNorm, the SwiGLU MLP and its residual.  fp32 [n, S, H] -> same"""
    x = x + F.linear(attn, o_w)  # fp32 + compute dtype -> fp32
    h = F.rms_norm(x, (x.shape[-1],), ln_w, eps).to(gate_up_w.dtype)
    gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w)


def prefill_pre_attention(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """llama_pre_attention for prefill: its own code object, so that torch.compile keeps the prefill's shapes
    (dynamic) apart from the decode step's (static) and neither uses up the other's recompile budget."""
    return llama_pre_attention(*args)


def prefill_post_attention(*args: Any) -> torch.Tensor:
    """llama_post_attention for prefill (see prefill_pre_attention)."""
    return llama_post_attention(*args)


CDF_BLOCK = 256  # the preferred tokens per block of the two-level CDF (SmolLM2's 49,152 = 192 blocks)


@functools.cache
def cdf_block(K: int) -> int:
    """Tokens per block of the two-level CDF over K weights: the divisor of K nearest CDF_BLOCK within
    [CDF_BLOCK / 2, 2 CDF_BLOCK] (Qwen's 151,936 = 1,187 x 128; SmolLM2's 49,152 = 192 x 256), so that the
    blocks tile the row without a padded copy; CDF_BLOCK itself when no divisor lies there (a prime vocabulary:
    the last block is padded with zero weights); K itself when K <= CDF_BLOCK (one block)."""
    if K <= CDF_BLOCK:
        return K
    near = [b for b in range(CDF_BLOCK // 2, 2 * CDF_BLOCK + 1) if K % b == 0]
    return min(near, key=lambda b: (abs(b - CDF_BLOCK), b)) if near else CDF_BLOCK


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index where u (in [0, 1)) lands in the CDF of the unnormalised weights p, in two levels: block sums,
    then a cumulative sum inside the one chosen block (blocks of cdf_block(K) tokens). fp32 throughout; every op
    is row-wise, so a row's index depends on its own weights and uniform only, not on the batch.
    p fp32 [B, K] >= 0, u [B] -> [B] long

    Token i is chosen when cdf[i - 1] <= u * total < cdf[i]; a rounding overshoot never picks a zero-weight
    token: the block and the index are clamped to the ones with weight."""
    B, K = p.shape
    bs = cdf_block(K)
    if K % bs:  # no divisor near CDF_BLOCK: a ragged last block, padded with zero weights
        p = F.pad(p, (0, bs - K % bs))
    blocks = p.view(B, -1, bs)  # [B, nb, bs]
    sums = blocks.sum(-1)  # [B, nb]
    cdf = sums.cumsum(-1)  # [B, nb]
    total = cdf[:, -1:]  # [B, 1]
    target = u.to(torch.float32)[:, None] * total  # [B, 1]
    last_block = (cdf < total).sum(-1, keepdim=True)  # the first block that reaches the total
    j = torch.searchsorted(cdf, target, right=True).minimum(last_block)  # [B, 1]: the first cdf > target
    before = cdf.gather(1, j) - sums.gather(1, j)  # [B, 1]: the mass of the blocks before j
    within = blocks.gather(1, j[..., None].expand(B, 1, bs))[:, 0].cumsum(-1)  # [B, bs]
    first = (within <= 0).sum(-1, keepdim=True)  # the block's first token with weight
    last = (within < within[:, -1:]).sum(-1, keepdim=True)  # and its last
    i = torch.searchsorted(within, target - before, right=True).clamp(min=first).minimum(last)  # [B, 1]
    return (j * bs + i)[:, 0]


def sample_tokens_fp32(
    logits: torch.Tensor, u: torch.Tensor | None, temperature: float, top_p: float, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine's sampler: sample_tokens' distribution, in fp32 with a two-level CDF (no [B, V] fp64 copy, no
    full sort).  logits fp32 [B, V], u [B] -> token [B], log-prob [B], short [B] bool

    No divide at temperature 1. top_p < 1 first keeps the top_k most likely tokens (0: all V) and applies top-p
    inside them: exact whenever those hold at least top_p of the mass; `short` marks the rows where they did
    not (the caller reports them). The log-prob is under softmax(logits / temperature), as sample_tokens'."""
    x = logits if temperature == 1.0 else logits / max(temperature, 1e-6)
    logp = torch.log_softmax(x, dim=-1)  # [B, V]
    short = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if u is None:
        token = logits.argmax(-1)
    elif top_p < 1.0:
        k = logits.shape[-1] if top_k <= 0 else min(top_k, logits.shape[-1])
        top, order = logp.topk(k, dim=-1)  # [B, k], descending
        p = top.exp()
        before = p.cumsum(-1) - p
        p = p * (before < top_p)  # the first token is always kept
        token = order.gather(-1, inverse_cdf(p, u)[:, None])[:, 0]
        if k < logits.shape[-1]:
            short = (before[:, -1] + p[:, -1]) < top_p
    else:
        token = inverse_cdf(logp.exp(), u)
    return token, logp.gather(-1, token[:, None])[:, 0], short


def rope_at(pos: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [n, S, 1, head_dim] at positions [n, S], as transformers' rotary embedding computes them."""
    freqs = pos[..., None].float() * inv_freq  # [n, S, d / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale)[:, :, None], (emb.sin() * scale)[:, :, None]


def decode_sample(
    h: torch.Tensor,
    head: torch.Tensor,
    embed: torch.Tensor,
    u_table: torch.Tensor | None,
    t: torch.Tensor,
    pos0: torch.Tensor,
    fin: torch.Tensor,
    out_tokens: torch.Tensor,
    out_logp: torch.Tensor,
    out_mask: torch.Tensor,
    out_hidden: torch.Tensor | None,
    short_rows: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    temperature: float,
    top_p: float,
    top_k: int,
    eos_id: int,
    pad_id: int,
    fp64_cdf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode step outside the layers, as one function (StaticEngine compiles it like the layer pieces): the
    LM head, sample_tokens_fp32 (fp64_cdf: rollout.sample_tokens, the CPU's, whose fp64 CDF keeps a row's token
    where last-bit differences between two batchings would move an fp32 boundary), the step's bookkeeping, and
    the next input (the token's embedding and RoPE).
    h fp32 [n, H] (the state s_t), head [V, H] in the compute dtype, embed fp32 [V, H], u_table [n, T] (fp32;
    fp64 with fp64_cdf) or None (greedy), t [1] long (the step, on the device), pos0 [n] (prompt lengths),
    fin [n] bool -> x fp32 [n, 1, H], cos and sin fp32 [n, 1, 1, d], pos [n] (the slot the token enters at).

    Written in place: out_hidden[:, t] (when given), out_tokens / out_logp / out_mask [:, t] (pad, 0 and 0 on
    rows already finished), fin (|= the token is EOS), short_rows [1] (+= rows the top-k prefilter cut short)."""
    if out_hidden is not None:
        out_hidden.index_copy_(1, t, h[:, None])
    logits = F.linear(h, head) if head.dtype == torch.float32 else matmul_fp32_out(h.to(head.dtype), head.t())
    u = None if u_table is None else u_table.index_select(1, t)[:, 0]  # [n]
    if fp64_cdf:
        token, logp = sample_tokens(logits, u, temperature, top_p)
        short = torch.zeros_like(fin)
    else:
        token, logp, short = sample_tokens_fp32(logits, u, temperature, top_p, top_k)
    short_rows += (short & ~fin).sum()
    token = torch.where(fin, torch.full_like(token, pad_id), token)
    out_tokens.index_copy_(1, t, token[:, None])
    out_logp.index_copy_(1, t, torch.where(fin, torch.zeros_like(logp), logp)[:, None])
    out_mask.index_copy_(1, t, (~fin).float()[:, None])
    fin |= token == eos_id
    # the token enters the model at slot = position = prompt length + t; its hidden state is the next state
    pos = pos0 + t  # [n]
    x = F.embedding(token[:, None], embed)  # fp32 [n, 1, H]
    cos, sin = rope_at(pos[:, None], inv_freq, rope_scale)
    return x, cos, sin, pos


BATCH_BUCKETS = (64, 256, 512, 1024)
# On the CPU nothing is captured or compiled per shape, so the prompt and KV widths are rounded only a little:
# prefill pads each prompt to a multiple of CPU_PROMPT_BUCKET tokens (64 on a GPU), and the decode attention
# reads the slots up to the longest row's position rounded to CPU_KV_CHUNK (64 on a GPU). The organism's
# prompts (21-29 tokens) were padded to 64, twice the prefill's work, and its attention read 128 slots for ~60.
CPU_PROMPT_BUCKET = 8
CPU_KV_CHUNK = 16
# The CPU's GEMMs give a row the same bits whatever the other rows from about 16 rows on (MKL picks other kernels
# for fewer: measured 2026-12-04 on the decode step's shapes); below that, a batch split over two ranks sampled
# other tokens than one process. A smaller batch runs with extra rows that start finished.
CPU_MIN_ROWS = 16


def causal_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill's causal attention as two batched matmuls and a masked softmax (the CPU's). Unlike the CPU's flash
    kernel, whose blocks follow the sequence length, a row's result does not depend on the padded width S: the
    masked slots add exact zeros. The query heads of a kv head are stacked along the queries (rep of them).
    q [n, kv, rep S, d] (head-major), k/v [n, kv, S, d] -> [n, kv, rep S, d]"""
    S = k.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [n, kv, rep S, S]
    pos = torch.arange(S, device=q.device)
    future = (pos[None, :] > pos[:, None]).repeat(q.shape[2] // S, 1)  # [rep S, S]: key after query
    return torch.matmul(torch.softmax(s.masked_fill_(future, float("-inf")), dim=-1), v)


def decode_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float):
    """One decode step's attention as two batched matmuls and a softmax (the CPU's: its flash kernel spends
    ~1 ms a call on a single query per row, and more when the other core is busy).
    q [n, kv, rep, d], k/v [n, kv, Lk, d], bias [n, 1, 1, Lk] (length_bias) -> [n, kv, rep, d]"""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale + bias  # [n, kv, rep, Lk]
    return torch.matmul(torch.softmax(s, dim=-1), v)


def length_bias(slots: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The decode attention's additive mask: 0 on each row's slots [0, position], -inf after (what SDPA makes of
    the boolean mask slot <= position, made once a step instead of in every layer's call).
    slots [Lk] long, pos [n] -> [n, 1, 1, Lk] in dtype"""
    valid = slots <= pos[:, None]  # [n, Lk]
    return torch.zeros(valid.shape, dtype=dtype, device=pos.device).masked_fill_(~valid, float("-inf"))[:, None, None]


def row_group_bounds(n: int, groups: int) -> list[int]:
    """The first row of each of `groups` contiguous row groups of n rows (sorted longest first), and n:
    [0, ..., n]. The first group holds the longest eighth (at least one row), the others split the rest as
    evenly as integers allow: prompt lengths have a long right tail (of the first 512 GSM8K prompts, the
    longest has 235 tokens, the 64th longest 144, the median 117), and a small group for the tail keeps it
    from widening many short rows. Depends on n and groups only (1 <= groups <= n), so a group's row count is
    part of the graph's shape, never of the batch's lengths."""
    if groups == 1:
        return [0, n]
    head = max(1, min(n // 8, n - groups + 1))  # leaves a row or more for each other group
    return [0] + [head + (n - head) * g // (groups - 1) for g in range(groups)]


def group_widths(lengths: Sequence[int], groups: int, t: int, kv_chunk: int, cap: int) -> tuple[int, ...]:
    """The KV slots each row group's decode attention reads at step t: its longest row's length (prompt + t + 1:
    the slots [0, position]) rounded up to kv_chunk, at most cap.  lengths [n] (the engine's row order),
    groups <= n -> (Lk_0, ..., Lk_{groups - 1})"""
    b = row_group_bounds(len(lengths), groups)
    return tuple(min(cap, round_up(max(lengths[b[g] : b[g + 1]]) + t + 1, kv_chunk)) for g in range(groups))


def unique_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in order of first appearance, and the index among them of each prompt:
    prefill runs each distinct prompt once.  n prompts -> (u distinct, [n] indices in [0, u))"""
    first: dict[tuple[int, ...], int] = {}
    rows = [first.setdefault(tuple(p), len(first)) for p in prompts]
    return [list(p) for p in first], rows


def tokens_dynamic(*xs: torch.Tensor) -> None:
    """Mark dimension 1 (the prefill's tokens) of each tensor dynamic for torch.compile (a no-op when eager)."""
    for x in xs:
        torch._dynamo.maybe_mark_dynamic(x, 1)


def generator_snapshot(device: torch.device) -> tuple | None:
    """The device's default CUDA generator and a copy of its state (not in capture mode), or None."""
    try:
        gen = torch.cuda.default_generators[device.index or 0]
        return gen, gen.clone_state()
    except Exception:  # no such API on this torch: nothing to restore
        return None


def generator_restore(snapshot: tuple | None) -> None:
    """Put the generator back on its pre-capture state: a capture that failed before its epilogue leaves it
    in capture mode, and every later CUDA random call or replay then raises 'Offset increment outside graph
    capture encountered unexpectedly' (bench/probe_rng.py checks this on the GPU's torch)."""
    if snapshot is not None:
        gen, state = snapshot
        gen.graphsafe_set_state(state)


FLEX_BLOCK = 128  # KV slots per block of attention="flex" (the cache's slots are a multiple of 256)
