"""What a rollout is, and how one token is drawn: the Rollout, padding, the per-row uniforms, the sampler.

Holds: Rollout (prompts left-padded, responses right-padded, masks from lengths, the log-probs and hidden states
of each response state), left and prompt/response padding, positions that ignore padding, step_uniforms (one
uniform per global row and decode step, so that a row samples the same tokens on one rank or N), sample_tokens
(inverse-CDF sampling in fp64, greedy without uniforms), and decode_responses.
Does not hold: a model or a forward (generation.py, static_engine.py, forward.py). Imports nothing of the project.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
    width = round_up(max(len(s) for s in seqs), multiple)
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


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def decode_responses(tokenizer: Any, rollout: Rollout) -> tuple[list[str], list[list[int]]]:
    """Response texts (special tokens dropped) and token id lists, cut at each response's length."""
    ids = [row[:n].tolist() for row, n in zip(rollout.response_ids.cpu(), rollout.lengths.cpu().tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids
