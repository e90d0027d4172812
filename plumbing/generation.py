"""generate(): a batch of prompts sampled or decoded greedily, by the static engine or by transformers.

Holds: generate() (backend "static" on a GPU and on the CPU; a model the static engine cannot run falls back to
transformers with one notice), the transformers path (its dynamic KV cache, one host sync per token), and the
rollout record (which backend ran, every fallback with its reason) that results.json and the benchmark report.
Does not hold: the static engine itself (static_engine.py, static_kernels.py), the sampler and the Rollout
(rollout.py), the training forward (forward.py), anything about GSM8K or rewards (gsm8k.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from plumbing import distributed, errors, runtime
from plumbing.rollout import Rollout, left_pad, position_ids_from_mask, sample_tokens
from plumbing.static_engine import StaticEngine
from plumbing.static_kernels import static_engine_unsupported


@functools.cache
def _cache_kwarg_of(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_kwarg(model: nn.Module) -> str:
    """The name transformers gives the KV-cache argument: `past_key_values`, or `cache` from 5.2x on."""
    return _cache_kwarg_of(type(distributed.unwrap(model).model))


GENERATION_BACKENDS = ("auto", "static", "hf")

# What this run's rollouts ran on (runtime.RUN, begun afresh with each run): the backends generate() used, in
# order of first use ("static + CUDA graphs", "static", "hf"), and every fallback of a StaticEngine with its
# reason. Trainers write it to results.json and metrics.jsonl's first line, the benchmark per variant: a slow run
# is never read as a slow method.


def rollout_record() -> dict[str, Any]:
    """{"rollout_backend": "static + CUDA graphs" (several joined by ", " in order of first use; None before
    any generate()), "rollout_fallbacks": [{"what", "kind", "reason"}, ...]}"""
    return {
        "rollout_backend": ", ".join(runtime.RUN.backends) or None,
        "rollout_fallbacks": [dict(f) for f in runtime.RUN.fallbacks],
    }


def _record_backend(name: str) -> None:
    if name not in runtime.RUN.backends:
        runtime.RUN.backends.append(name)


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
    graph), "hf" the transformers model with its dynamic cache, "auto" the first for a model it runs (Llama,
    Qwen2), on a GPU and on the CPU alike, else the second with one notice. On 2 CPU cores the engine took 0.7x
    to 0.3x generate's time (docs/throughput.md: the organism, the tiny model, SmolLM2-135M). Both sample with
    one uniform per (row, step) (the engine with sample_tokens_fp32, transformers with sample_tokens' fp64
    CDF), stop once every sequence has emitted EOS, and return the same Rollout. Each decode step also yields
    the final hidden state, so a critic head can read V(s_t) without another forward.
    """
    if backend not in GENERATION_BACKENDS:
        raise errors.UserError(f"unknown generation backend {backend!r}: use {', '.join(GENERATION_BACKENDS)}")
    lm = distributed.unwrap(model)
    if backend == "auto":  # the static engine wherever it runs the model: faster on a GPU and on the CPU
        backend = "static"
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
        runtime.notice_once(
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
    with distributed.autocast_ctx(device):
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
