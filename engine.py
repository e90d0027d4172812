"""The language model run fast: generation (a static-cache Llama engine, HF generate() as the fallback) and the
training forward that gives per-token log-probs of given tokens.

Holds: the rollout record, left padding, the per-row uniforms that make sampling independent of the batch, the
sampler, generate(), the static engine (its Llama/Qwen2 layer functions, the decode step's head-and-sampler
piece, the row groups that bound its KV reads), decoding, and the training forward (PolicyForward, chunked
log-probs, padding trim, length-sorted micro-batches).
Does not hold: anything about GSM8K, prompts or rewards (common.py), nor loading (models.py), distributed setup or
checkpoints (runtime.py). It works on token ids and tensors only.
"""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import runtime

# ======================================================================================================
# Generation: batched, left-padded sampling with per-token log-probs and a mask built from lengths
# ======================================================================================================


@dataclass
class Rollout:
    """A batch of prompts and sampled responses. Prompts are left-padded, responses right-padded."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long
    response_ids: torch.Tensor  # [B, T] long, pad after each response's end
    response_mask: torch.Tensor  # [B, T] float, 1 on generated tokens (EOS included), from the lengths
    logprobs: torch.Tensor  # [B, T] float, log pi(token) at the sampling temperature; 0 on padding
    hidden: torch.Tensor | None  # [B, T, H] last hidden state at each response state s_t, or None

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return self.response_mask.sum(-1).long()

    @property
    def input_ids(self) -> torch.Tensor:  # [B, P + T]
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # [B, P + T]
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to a common length (rounded up to `multiple`): ids [B, P], mask [B, P]."""
    width = _round_up(max(len(s) for s in seqs), multiple)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def join_prompt_response(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompts left-padded, responses right-padded, side by side: ids [B, P + T], mask [B, P + T], and P.

    The same layout as a Rollout's input_ids, for responses that were not just sampled (DPO's pairs).
    """
    p_ids, p_mask = left_pad(prompts, pad_id)
    width = max(1, max(len(r) for r in responses))
    r_ids = torch.full((len(responses), width), pad_id, dtype=torch.long)
    r_mask = torch.zeros((len(responses), width), dtype=torch.long)
    for i, r in enumerate(responses):
        r_ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        r_mask[i, : len(r)] = 1
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), p_ids.shape[1]


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: 0 at each sequence's first real token.  [B, L] -> [B, L]"""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def step_uniforms(seed: int, step: int, stream: int, rows: int, steps: int, device: torch.device) -> torch.Tensor:
    """One uniform per (global row, decode step) from a generator seeded by (seed, step, stream).

    Every rank draws the same [rows, steps] table and takes its own rows, so a rollout's uniforms depend on
    its global index, not on the rank or the batch it lands in. The tokens are then the same on one rank or N
    as long as the logits are: bitwise in fp32 on the CPU when each prompt is padded to the same width; with
    other padding, or bf16 kernels that depend on the batch size, a last-bit difference now and then moves a
    token across a boundary of the CDF, and the runs are equal in distribution rather than token for token.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + step * 7_919 + stream * 104_729) % 2**63)
    return torch.rand(rows, steps, generator=g, dtype=torch.float64).to(device)


def sample_tokens(
    logits: torch.Tensor, u: torch.Tensor | None, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling with one uniform per row; greedy when u is None.  logits [B, V], u [B] -> [B], [B]

    Returns the token and its log-prob under softmax(logits / temperature) (top-p only narrows the choice).
    """
    logits = logits.float()
    logp = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)  # [B, V]
    if u is None:
        token = logits.argmax(-1)
    else:
        # fp64 CDF: two batchings of the same row differ in the last bits of their logits; in fp64 the token
        # boundaries barely move, so a row samples the same token whatever batch or rank it lands in.
        probs = logp.double().exp()
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the first token is always kept
            sorted_p = sorted_p * keep
            cdf = sorted_p.cumsum(-1)
            idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.dtype)).clamp(max=cdf.shape[-1] - 1)
            token = order.gather(-1, idx).squeeze(-1)
        else:
            cdf = probs.cumsum(-1)
            idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.dtype))
            token = idx.squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


@functools.cache
def _cache_kwarg_of(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_kwarg(model: nn.Module) -> str:
    """The name transformers gives the KV-cache argument: `past_key_values`, or `cache` from 5.2x on."""
    return _cache_kwarg_of(type(runtime.unwrap(model).model))


GENERATION_BACKENDS = ("auto", "static", "hf")

# What this process's rollouts ran on: the backends generate() used, in order of first use ("static + CUDA
# graphs", "static", "hf"), and every fallback of a StaticEngine with its reason. Trainers write it to
# results.json and metrics.jsonl's first line, the benchmark per variant: a slow run is never read as a slow method.
_RECORD: dict[str, list] = {"backends": [], "fallbacks": []}


def reset_rollout_record() -> None:
    _RECORD["backends"].clear()
    _RECORD["fallbacks"].clear()


def rollout_record() -> dict[str, Any]:
    """{"rollout_backend": "static + CUDA graphs" (several joined by ", " in order of first use; None before
    any generate()), "rollout_fallbacks": [{"what", "kind", "reason"}, ...]}"""
    return {
        "rollout_backend": ", ".join(_RECORD["backends"]) or None,
        "rollout_fallbacks": [dict(f) for f in _RECORD["fallbacks"]],
    }


def _record_backend(name: str) -> None:
    if name not in _RECORD["backends"]:
        _RECORD["backends"].append(name)


def _is_oom(e: BaseException) -> bool:
    """An out-of-memory error (possibly wrapped by dynamo): not a compile failure, so not a reason to fall back."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


@torch.no_grad()
def generate(
    model: nn.Module,
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
    backend: str = "auto",
) -> Rollout:
    """Sample (uniforms [B, >= max_new_tokens]) or decode greedily (uniforms None) a batch of prompts.

    backend: "static" runs StaticEngine (a preallocated KV cache; on a GPU each decode step replays a CUDA
    graph), "hf" the transformers model with its dynamic cache, "auto" the first on a GPU and the second on
    the CPU. Both sample with sample_tokens and one uniform per (row, step), stop once every sequence has
    emitted EOS, and return the same Rollout. Each decode step also yields the final hidden state, so a
    critic head can read V(s_t) without another forward.
    """
    if backend not in GENERATION_BACKENDS:
        raise runtime.UserError(f"unknown generation backend {backend!r}: use {', '.join(GENERATION_BACKENDS)}")
    lm = runtime.unwrap(model)
    device = next(lm.parameters()).device
    if backend == "auto":
        backend = "static" if device.type == "cuda" else "hf"
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=pad_id,
        uniforms=uniforms,
        temperature=temperature,
        top_p=top_p,
        return_hidden=return_hidden,
        prompt_multiple=prompt_multiple,
    )
    if backend == "static":
        reason = static_engine_unsupported(lm)
        if reason is None:
            eng = StaticEngine.of(lm)
            with torch.inference_mode(False):  # the backend's buffers outlive this call: no inference tensors
                out = eng.generate(prompts, **kwargs)
            _record_backend(eng.backend_name)
            return out
        runtime._notice_once(
            f"the static rollout backend runs Llama and Qwen2 models only ({reason}): using transformers' generation"
        )
    _record_backend("hf")
    return _generate_hf(lm, prompts, **kwargs)


def _generate_hf(
    lm: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    uniforms: torch.Tensor | None,
    temperature: float,
    top_p: float,
    return_hidden: bool,
    prompt_multiple: int,
) -> Rollout:
    """The plain path: the transformers model with its dynamic KV cache, one host sync per token."""
    from transformers import DynamicCache

    device = next(lm.parameters()).device
    ids, mask = left_pad(prompts, pad_id, prompt_multiple)
    ids, mask = ids.to(device), mask.to(device)
    B, T = ids.shape[0], max_new_tokens
    pos = position_ids_from_mask(mask)
    cache_kw = _cache_kwarg(lm)
    cache = DynamicCache(config=lm.config) if "config" in inspect.signature(DynamicCache).parameters else DynamicCache()
    out_tokens = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((B, T), device=device)
    out_mask = torch.zeros((B, T), device=device)
    hidden_steps: list[torch.Tensor] = []
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    next_pos = pos[:, -1:] + 1
    lm_was_training = lm.training
    lm.eval()
    with runtime.autocast_ctx(device):
        out = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
        h = out.last_hidden_state[:, -1]  # [B, H]: the state before the first response token
        t_used = 0
        for t in range(T):
            runtime.check_stop()  # a stop signal during an evaluation or a measurement: at once
            if return_hidden:
                hidden_steps.append(h.float())
            logits = lm.lm_head(h)  # [B, V]
            token, logp = sample_tokens(logits, None if uniforms is None else uniforms[:, t], temperature, top_p)
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            out_tokens[:, t] = token
            out_logp[:, t] = torch.where(finished, torch.zeros_like(logp), logp)
            out_mask[:, t] = (~finished).float()
            finished = finished | (token == eos_id)
            t_used = t + 1
            if bool(finished.all()) or t == T - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
            out = lm.model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                use_cache=True,
                **{cache_kw: cache},
            )
            h = out.last_hidden_state[:, -1]
            next_pos = next_pos + 1
    lm.train(lm_was_training)
    hidden = torch.stack(hidden_steps, dim=1) if return_hidden else None  # [B, T, H]
    return Rollout(
        prompt_ids=ids,
        prompt_mask=mask[:, : ids.shape[1]],
        response_ids=out_tokens[:, :t_used],
        response_mask=out_mask[:, :t_used],
        logprobs=out_logp[:, :t_used],
        hidden=hidden,
    )


# ------------------------------------------------------------------------------------------------------
# The static rollout engine: a small, explicit Llama / Qwen2 decode path over a preallocated KV cache
# ------------------------------------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


def _llama_pre_attention(
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


def _llama_post_attention(
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


def _prefill_pre_attention(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """_llama_pre_attention for prefill: its own code object, so that torch.compile keeps the prefill's shapes
    (dynamic) apart from the decode step's (static) and neither uses up the other's recompile budget."""
    return _llama_pre_attention(*args)


def _prefill_post_attention(*args: Any) -> torch.Tensor:
    """_llama_post_attention for prefill (see _prefill_pre_attention)."""
    return _llama_post_attention(*args)


_MM_FP32_OUT: dict[tuple, bool] = {}


def matmul_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of low-precision inputs (bf16) with fp32 accumulation and an fp32 result: no rounding of the
    product to bf16. torch.mm(out_dtype=float32) where it runs (recent CUDA builds); elsewhere the same
    numbers from an fp32 GEMM of the (already rounded) inputs.  [n, k] @ [k, m] -> fp32 [n, m]"""
    if a.dtype == torch.float32:
        return a @ b
    key = (a.device.type, a.dtype)
    if key not in _MM_FP32_OUT:
        try:
            probe = torch.ones(2, 8, dtype=a.dtype, device=a.device)
            _MM_FP32_OUT[key] = torch.mm(probe, probe.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError):
            _MM_FP32_OUT[key] = False
    if _MM_FP32_OUT[key]:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


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


def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
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
        token = order.gather(-1, _inverse_cdf(p, u)[:, None])[:, 0]
        if k < logits.shape[-1]:
            short = (before[:, -1] + p[:, -1]) < top_p
    else:
        token = _inverse_cdf(logp.exp(), u)
    return token, logp.gather(-1, token[:, None])[:, 0], short


def _rope_at(pos: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [n, S, 1, head_dim] at positions [n, S], as transformers' rotary embedding computes them."""
    freqs = pos[..., None].float() * inv_freq  # [n, S, d / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale)[:, :, None], (emb.sin() * scale)[:, :, None]


def _decode_sample(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode step outside the layers, as one function (StaticEngine compiles it like the layer pieces): the
    LM head, sample_tokens_fp32, the step's bookkeeping, and the next input (the token's embedding and RoPE).
    h fp32 [n, H] (the state s_t), head [V, H] in the compute dtype, embed fp32 [V, H], u_table fp32 [n, T] or
    None (greedy), t [1] long (the step, on the device), pos0 [n] (prompt lengths), fin [n] bool
    -> x fp32 [n, 1, H], cos and sin fp32 [n, 1, 1, d], pos [n] (the slot the token enters at).

    Written in place: out_hidden[:, t] (when given), out_tokens / out_logp / out_mask [:, t] (pad, 0 and 0 on
    rows already finished), fin (|= the token is EOS), short_rows [1] (+= rows the top-k prefilter cut short)."""
    if out_hidden is not None:
        out_hidden.index_copy_(1, t, h[:, None])
    logits = F.linear(h, head) if head.dtype == torch.float32 else matmul_fp32_out(h.to(head.dtype), head.t())
    u = None if u_table is None else u_table.index_select(1, t)[:, 0]  # [n]
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
    cos, sin = _rope_at(pos[:, None], inv_freq, rope_scale)
    return x, cos, sin, pos


BATCH_BUCKETS = (64, 256, 512, 1024)


def _length_bias(slots: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
    return tuple(min(cap, _round_up(max(lengths[b[g] : b[g + 1]]) + t + 1, kv_chunk)) for g in range(groups))


def _tokens_dynamic(*xs: torch.Tensor) -> None:
    """Mark dimension 1 (the prefill's tokens) of each tensor dynamic for torch.compile (a no-op when eager)."""
    for x in xs:
        torch._dynamo.maybe_mark_dynamic(x, 1)


def _generator_snapshot(device: torch.device) -> tuple | None:
    """The device's default CUDA generator and a copy of its state (not in capture mode), or None."""
    try:
        gen = torch.cuda.default_generators[device.index or 0]
        return gen, gen.clone_state()
    except Exception:  # no such API on this torch: nothing to restore
        return None


def _generator_restore(snapshot: tuple | None) -> None:
    """Put the generator back on its pre-capture state: a capture that failed before its epilogue leaves it
    in capture mode, and every later CUDA random call or replay then raises 'Offset increment outside graph
    capture encountered unexpectedly' (bench/probe_rng.py checks this on the GPU's torch)."""
    if snapshot is not None:
        gen, state = snapshot
        gen.graphsafe_set_state(state)


FLEX_BLOCK = 128  # KV slots per block of attention="flex" (the cache's slots are a multiple of 256)


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
      prefill and decode go through torch.compile, and so does the rest of the decode step: _decode_sample
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
        prompt_bucket: int = 64,
        kv_chunk: int = 64,
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
        self.prompt_bucket, self.kv_chunk = prompt_bucket, kv_chunk
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
        if dt != f32:  # matmul_fp32_out's probe runs here, eagerly: the compiled _decode_sample never traces it
            matmul_fp32_out(torch.zeros(1, 8, dtype=dt, device=dev), torch.zeros(8, 1, dtype=dt, device=dev))
        self._set_layer_fns(self.compile)
        self.compile_seconds = 0.0  # time spent in warm-up and capture (compilation included), for benchmarks
        self.captures = 0
        self.timing = False  # benchmarks: sync and time prefill and the decode loop of each call (last_timing)
        self.last_timing: dict[str, float] = {}

    @classmethod
    def of(cls, lm: nn.Module) -> StaticEngine:
        """The engine of a model, made on first use and kept (with its buffers and graphs) while the model lives."""
        lm = runtime.unwrap(lm)
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
        _RECORD["fallbacks"].append(entry)
        runtime._notice_once(f"{message} ({reason})")

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
        and bookkeeping (_decode_sample, static), compiled or eager."""
        self._prefill_compiled = compile
        if not compile:
            self._pre = self._prefill_pre = _llama_pre_attention
            self._post = self._prefill_post = _llama_post_attention
            self._sample = _decode_sample
            return
        be = self.compile_backend
        self._pre = torch.compile(_llama_pre_attention, dynamic=False, backend=be)
        self._post = torch.compile(_llama_post_attention, dynamic=False, backend=be)
        self._sample = torch.compile(_decode_sample, dynamic=False, backend=be)
        # prefill: only the token count is dynamic (marked in _prefill); the weights' sizes stay static
        self._prefill_pre = torch.compile(_prefill_pre_attention, dynamic=None, backend=be)
        self._prefill_post = torch.compile(_prefill_post_attention, dynamic=None, backend=be)

    # ---- buffers -------------------------------------------------------------------------------------

    def rows_for(self, b: int) -> int:
        """The rows a batch of b runs with: a multiple of batch_multiple, else the smallest bucket that holds it."""
        if self.batch_multiple:
            return _round_up(b, self.batch_multiple)
        for bucket in self.batch_buckets:
            if b <= bucket:
                return bucket
        return _round_up(b, self.batch_buckets[-1]) if self.batch_buckets else b

    def reserve(self, rows: int, prompt_tokens: int, new_tokens: int, return_hidden: bool = False) -> None:
        """Size the buffers for the largest call a run will make (rows, longest prompt, new tokens), so that
        later calls capture each graph once and never reallocate."""
        n, P = self.rows_for(rows), _round_up(max(prompt_tokens, 1), self.prompt_bucket)
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
        self.max_l = max(_round_up(length, 256), self.max_l)
        self.max_t = max(_round_up(steps, 64), self.max_t)
        self.with_hidden = self.with_hidden or hidden
        B, Lm, T, dev = self.max_b, self.max_l, self.max_t, self.device
        self.kv = None  # free the old cache before allocating the new one
        # zeros, not empty: masked slots enter attention as 0 * value, and 0 * NaN garbage would be NaN
        self.kv = torch.zeros(self.n_layers, 2, B, self.n_kv, Lm, self.head_dim, dtype=self.dtype, device=dev)
        self.slot_ids = torch.arange(Lm, device=dev)
        self.pos0 = torch.zeros(B, dtype=torch.long, device=dev)  # prompt length = slot of response token 0
        self.h = torch.zeros(B, self.hidden_size, device=dev)  # final-norm hidden state of the current state
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.u = torch.zeros(B, T, device=dev)  # fp32: what the sampler reads
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
        """cos, sin fp32 [n, S, 1, head_dim] at positions [n, S] (_rope_at with this model's frequencies)."""
        return _rope_at(pos, self.inv_freq, self.rope_scale)

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
        q [n, 1, heads, d], k/v [n, kv_heads, Lk, d], bias [n, 1, 1, Lk] (_length_bias) -> [n, 1, heads d]"""
        from torch.nn.attention import sdpa_kernel

        n = q.shape[0]
        qg = q[:, 0].unflatten(1, (self.n_kv, self.rep))  # [n, kv, rep, d]: head h reads kv head h // rep
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
        k, v = (x.repeat_interleave(self.rep, dim=1) for x in (k, v))  # [n, heads, S, d]
        with sdpa_kernel(self._sdpa_backends(prefill=True)):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=self.scale)
        return o.transpose(1, 2).reshape(n, S, self.n_heads * self.head_dim)

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Right-padded prompts [n, P] into cache slots [0, P) (slot = position); self.h gets each row's state
        before its first response token (the final-norm hidden state at slot length - 1).  lengths [n] >= 1

        The layer pieces see the n * P tokens as one row [1, N, H] with N marked dynamic: one dynamic size
        (a multiple of prompt_bucket, never 0 or 1), the weights' sizes static, so no (rows, width) pair
        recompiles them, not even one whose size equals a model dimension."""
        n, P = ids.shape
        N, H, d = n * P, self.hidden_size, self.head_dim
        pos = self.slot_ids[:P].expand(n, P)
        x = F.embedding(ids, self.embed).view(1, N, H)  # fp32 [1, N, H]
        cos, sin = (c.reshape(1, N, 1, d) for c in self._rope(pos))
        for i in range(self.n_layers):
            _tokens_dynamic(x, cos, sin)
            q, kv = self._prefill_pre(
                x, self.ln1[i], self.qkv[i], cos, sin, self.eps, self.n_heads, self.n_kv, self._bias(i)
            )
            kv = kv.view(2, self.n_kv, n, P, d).transpose(1, 2)  # [2, n, kv_heads, P, d]
            self.kv[i, :, :n, :, :P] = kv
            o = self._prefill_attention(q.view(n, P, self.n_heads, d), kv[0], kv[1]).view(1, N, -1)
            _tokens_dynamic(x, o)
            x = self._prefill_post(x, o, self.o[i], self.ln2[i], self.gate_up[i], self.down[i], self.eps)
        last = x.view(n, P, H)[torch.arange(n, device=ids.device), lengths - 1]  # [n, H]
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
        )
        bounds = row_group_bounds(n, len(widths))
        groups = list(zip(bounds, bounds[1:], widths))  # (first row, end row, Lk) of each group
        # SDPA's additive masks, once a step (a boolean mask would be converted in every layer's call); flex: none
        sdpa = self._flex is None
        bias = [_length_bias(self.slot_ids[:Lk], pos[r0:r1], self.dtype) for r0, r1, Lk in groups if sdpa]
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
        rng = _generator_snapshot(self.device)
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
            _generator_restore(rng)  # a capture that never reached its epilogue leaves it in capture mode
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

    def _prefill_or_eager(self, ids: torch.Tensor, lens: torch.Tensor) -> None:
        """_prefill; a failure of its compiled layer pieces (not out-of-memory) falls back to the eager ones."""
        try:
            self._prefill(ids, lens)
        except Exception as e:
            if not self._prefill_compiled or _is_oom(e):
                raise
            self._fall_back("prefill_compile", "torch.compile of the prefill failed; using eager prefill", e)
            self._prefill_pre, self._prefill_post = _llama_pre_attention, _llama_post_attention
            self._prefill_compiled = False
            self._prefill(ids, lens)

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
        """What engine.generate returns, computed over the static cache. Arguments as engine.generate."""
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

        # the state: prompts right-padded (slot = position), extra rows finished from the start
        P = _round_up(longest, self.prompt_bucket)
        ids = torch.full((n, P), pad_id, dtype=torch.long)
        for i, s in enumerate(prompts):
            ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        ids, lens = ids.to(dev), torch.tensor(lengths, device=dev)
        self.pos0[:n] = lens
        self.finished[:n] = torch.arange(n, device=dev) >= b
        self.step.zero_()
        self.short_rows.zero_()
        self.u[:n].zero_()
        if uniforms is not None:
            rows = slice(None) if order is None else torch.tensor(order, device=uniforms.device)
            self.u[:b, :T] = uniforms[rows, :T].to(device=dev, dtype=torch.float32)
        self.out_tokens[:n].fill_(pad_id)
        self.out_logp[:n].zero_()
        self.out_mask[:n].zero_()
        if return_hidden:
            self.out_hidden[:n].zero_()

        t0 = self._clock()
        self._prefill_or_eager(ids, lens)
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
            runtime._notice_once(
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


# ======================================================================================================
# Decoding and the training forward: per-token log-probs of given tokens, in micro-batches
# ======================================================================================================


def decode_responses(tokenizer: Any, rollout: Rollout) -> tuple[list[str], list[list[int]]]:
    """Response texts (special tokens dropped) and token id lists, cut at each response's length."""
    ids = [row[:n].tolist() for row, n in zip(rollout.response_ids.cpu(), rollout.lengths.cpu().tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(h W^T / temperature)[target], in chunks: the [N, V] fp32 logits never exist whole.

    The GEMMs run in `dtype` with fp32 accumulation and fp32 results (matmul_fp32_out): bf16 under a GPU's
    autocast, as the engine's LM head, so that rollout and training log-probs differ by the trunk's kernels
    only; the hidden states' own dtype elsewhere (fp32 on the CPU: the same ops as before, bit for bit). The
    softmax is fp32 either way. The backward recomputes each chunk's logits (grad wrt logits =
    (onehot - p) * g / temperature); grad_w accumulates in fp32 over the chunks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, dtype: torch.dtype):  # [N, H], [V, H]
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        ent = torch.empty_like(out)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for i in range(0, hidden.shape[0], chunk):
                logits = _head_logits(hidden[i : i + chunk], w, dtype) / temperature  # fp32 [n, V]
                logp = torch.log_softmax(logits, dim=-1)
                out[i : i + chunk] = logp.gather(-1, targets[i : i + chunk, None]).squeeze(-1)
                ent[i : i + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):
        hidden, weight, targets = ctx.saved_tensors
        dtype = ctx.dtype
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for i in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[i : i + ctx.chunk]
                logits = _head_logits(h, w, dtype) / ctx.temperature
                g = -torch.softmax(logits, dim=-1)
                g.scatter_add_(-1, targets[i : i + ctx.chunk, None], torch.ones_like(g[:, :1]))
                g = g * (grad_out[i : i + ctx.chunk, None] / ctx.temperature)  # [n, V] grad wrt logits
                if dtype == hidden.dtype:  # the hidden states' own dtype (fp32 on the CPU): unchanged
                    if grad_h is not None:
                        grad_h[i : i + ctx.chunk] = (g.to(h.dtype) @ w).to(grad_h.dtype)
                    if grad_w is not None:
                        grad_w += g.T @ h.float()
                else:  # low-precision inputs, fp32 accumulation and results
                    g_low = g.to(dtype)
                    if grad_h is not None:
                        grad_h[i : i + ctx.chunk] = matmul_fp32_out(g_low, w).to(grad_h.dtype)
                    if grad_w is not None:
                        grad_w += matmul_fp32_out(g_low.T, h.to(dtype))
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def _head_logits(h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits of hidden states h [n, H] under the head w [V, H] (already in `dtype`) -> [n, V]"""
    if dtype == h.dtype:
        return (h @ w.T).float()  # the same op as always
    return matmul_fp32_out(h.to(dtype), w.T)


def head_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The LM head's GEMM dtype in the training forward: autocast's (bf16) on a GPU under autocast, else the
    hidden states' own (fp32 on the CPU)."""
    if hidden.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return hidden.dtype


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies from hidden states and the LM head.  [N, H], [V, H], [N] -> [N], [N]

    dtype: of the head's GEMMs (default head_dtype(hidden)); accumulation and the softmax are fp32."""
    dtype = head_dtype(hidden) if dtype is None else dtype
    return _TokenLogProbs.apply(hidden, weight, targets, float(temperature), int(chunk), dtype)


def trim_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, n_prompt: int, multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Drop the columns that are padding in every row: left of the prompts, right of the responses.

    [B, P + T] ids and mask -> [B, P' + T'] ids and mask, P', T'. Widths stay multiples of `multiple`
    (fewer distinct shapes for torch.compile) and never grow. Costs one host sync.
    """
    P, T = n_prompt, input_ids.shape[1] - n_prompt
    used = attention_mask.bool().any(0)  # [P + T]
    cols = torch.arange(P + T, device=used.device)
    first = torch.where(used[:P], cols[:P], P).min()  # the first prompt column any row uses
    longest = torch.where(used[P:], cols[P:] - P + 1, 0).max()  # the longest response
    first, longest = torch.stack([first, longest]).tolist()
    keep_p = min(P, _round_up(max(P - first, 1), multiple))
    keep_t = min(T, _round_up(max(longest, 1), multiple))
    cut = slice(P - keep_p, P + keep_t)
    return input_ids[:, cut], attention_mask[:, cut], keep_p, keep_t


def length_sorted_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, micro: int) -> list[torch.Tensor]:
    """Split `rows` into micro-batches of `micro` rows of similar length, longest first, so that trim_padding
    removes most of the padding. The rows are the same; only which rows share a forward changes (gradients
    accumulate over all of them).  rows [N] long, lengths [B] (tokens per sequence) -> list of [<= micro]"""
    rows = torch.as_tensor(rows).cpu()
    order = torch.sort(lengths.detach().cpu()[rows], descending=True, stable=True).indices
    return list(rows[order].split(micro))


class PolicyForward(nn.Module):
    """The training forward: the policy's token log-probs and (for PPO) the critic's values, from ONE pass.

    The LM trunk runs once; the LM head turns the response positions into log-probs (chunked, see
    _TokenLogProbs); a critic head reads the same final hidden states (detached unless critic_grad). A
    `full` critic brings its own trunk. Wrapping this module in DDP makes the whole update data-parallel.
    Columns that are padding in every row are trimmed first (trim_padding; outputs keep the input's width);
    compile=True runs the trunk through torch.compile (the LM head and the loss stay eager).
    """

    def __init__(
        self,
        lm: nn.Module,
        critic: nn.Module | None = None,
        critic_grad: bool = False,
        compile: bool = False,
        pad_multiple: int | None = None,
    ) -> None:
        super().__init__()
        self.lm, self.critic, self.critic_grad = lm, critic, critic_grad
        self.pad_multiple = (64 if compile else 8) if pad_multiple is None else pad_multiple  # 0: no trimming
        # kept in a list so that the compiled wrapper is not registered as a submodule (no '_orig_mod.' keys)
        self._compiled_trunk = [torch.compile(lm.model)] if compile else []

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_prompt: int, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[B, P + T] ids and mask -> log-probs [B, T], entropies [B, T], values [B, T] or None.

        Position P + t - 1 predicts response token t; its hidden state is the state s_t the critic values.
        Padding positions (mask 0) give 0.
        """
        width = input_ids.shape[1] - n_prompt
        if self.pad_multiple:
            input_ids, attention_mask, n_prompt, _ = trim_padding(
                input_ids, attention_mask, n_prompt, self.pad_multiple
            )
        pos = position_ids_from_mask(attention_mask)
        trunk = self._compiled_trunk[0] if self._compiled_trunk else self.lm.model
        hidden = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).last_hidden_state
        state = hidden[:, n_prompt - 1 : -1]  # [B, T, H]
        targets = input_ids[:, n_prompt:]  # [B, T]
        rmask = attention_mask[:, n_prompt:].bool()  # [B, T]
        logp = torch.zeros(rmask.shape, device=hidden.device)
        ent = torch.zeros(rmask.shape, device=hidden.device)
        lp, en = token_logprobs_from_hidden(state[rmask], self.lm.lm_head.weight, targets[rmask], temperature)
        logp = logp.masked_scatter(rmask, lp)
        ent = ent.masked_scatter(rmask, en)
        values = None
        if self.critic is not None:
            if getattr(self.critic, "needs_trunk", False):
                values = self.critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos)
                values = values[:, n_prompt - 1 : -1]
            else:
                values = self.critic(state if self.critic_grad else state.detach())
            values = values.float() * rmask
        pad = width - rmask.shape[1]  # back to the caller's width (trimmed columns are padding: 0)
        if pad:
            logp, ent = F.pad(logp, (0, pad)), F.pad(ent, (0, pad))
            values = None if values is None else F.pad(values, (0, pad))
        return logp, ent, values


@torch.no_grad()
def rollout_logprobs(fwd: nn.Module, ro: Rollout, micro: int, temperature: float = 1.0) -> torch.Tensor:
    """The log-probs of a rollout's responses under a training forward (the reference's, say), without gradient,
    in length-sorted micro-batches of `micro` rows.  -> [B, T] float32, 0 on padding"""
    out = torch.zeros_like(ro.logprobs)
    lengths = ro.attention_mask.sum(-1).cpu()
    for rows in length_sorted_micro_batches(torch.arange(len(lengths)), lengths, micro):
        with runtime.autocast_ctx(ro.input_ids.device):
            lp = fwd(ro.input_ids[rows], ro.attention_mask[rows], ro.prompt_ids.shape[1], temperature)[0]
        out[rows] = lp.float()
    return out
