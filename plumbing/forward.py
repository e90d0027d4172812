"""The training forward: per-token log-probs, entropies and values of given tokens, in micro-batches.

Holds: PolicyForward (the policy's trunk run once; the LM head turns response positions into log-probs in chunks,
a custom autograd function recomputing each chunk in the backward, so that the [tokens x vocab] fp32 logits never
exist whole; a critic head reads the same hidden states), the head GEMM in the compute dtype with fp32 output,
padding trimmed per micro-batch, length-sorted micro-batches, and a rollout's log-probs under another model.
Does not hold: generation (generation.py), the critics (critics.py), the losses (common.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing import distributed
from plumbing.rollout import Rollout, position_ids_from_mask, round_up

# ======================================================================================================
# The training forward: per-token log-probs of given tokens, in micro-batches
# ======================================================================================================


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
    keep_p = min(P, round_up(max(P - first, 1), multiple))
    keep_t = min(T, round_up(max(longest, 1), multiple))
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
        with distributed.autocast_ctx(ro.input_ids.device):
            lp = fwd(ro.input_ids[rows], ro.attention_mask[rows], ro.prompt_ids.shape[1], temperature)[0]
        out[rows] = lp.float()
    return out
