"""Critics of selectable capacity for ppo.py: `build_critic(name, hidden_size, policy=None)`.

A head reads the policy's final hidden state at every token (the same forward as the policy's log-probs,
detached by default so the value loss cannot move the policy) and gives one value per token, V(s_t).
`full` is a separate copy of the policy's transformer with a linear value head: the standard critic of
TRL, OpenRLHF and verl, and the far end of the sweep.

Shapes and trainable parameters (H = hidden size: Qwen2.5-0.5B, the study's model, H = 896; the packaged
SmolLM2-135M H = 576; the tiny test model H = 64). A head of width n has (H + 2) n + 1 parameters:

| name   | shape                               | H = 896     | H = 576     | H = 64    |
|--------|-------------------------------------|-------------|-------------|-----------|
| none   | no critic: REINFORCE, batch mean    | 0           | 0           | 0         |
| small  | MLP H -> 64 -> 1 (two layers)       | 57,473      | 36,993      | 4,225     |
| medium | MLP H -> 512 -> 1 (two layers)      | 459,777     | 295,937     | 33,793    |
| large  | MLP H -> 1024 -> 1 (two layers)     | 919,553     | 591,873     | 67,585    |
| full   | a copy of the policy trunk + H -> 1 | 494,033,665 | 134,515,585 | 3,219,841 |

small < medium < large strictly; large has twice medium's width at the same depth, so 2 x medium - 1 parameters
(591,873 = 2 x 295,937 - 1): every step up in the sweep is a step up in capacity. The last layer of every head
starts at zero, so the first values are 0 (the N implementation details of RLHF with PPO, Huang et al. 2022).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

CRITICS = ("none", "small", "medium", "large", "full")
HEAD_WIDTHS = {"small": 64, "medium": 512, "large": 1024}


class MLPHead(nn.Module):
    """Two-layer MLP value head: H -> width -> 1, GELU between, zero-initialised output layer."""

    needs_trunk = False

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden_size, width)
        self.out = nn.Linear(width, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T]
        return self.out(nn.functional.gelu(self.fc(hidden))).squeeze(-1)


class FullCritic(nn.Module):
    """A separate transformer trunk (a copy of the policy's, trained on its own) with a linear value head."""

    needs_trunk = True

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.trunk = copy.deepcopy(policy.model)  # the decoder without the LM head
        self.trunk.requires_grad_(True)
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.head(h).squeeze(-1)  # [B, L]


def build_critic(name: str, hidden_size: int, policy: nn.Module | None = None) -> nn.Module | None:
    """The critic for --critic NAME: None for `none`, a value head, or a full copy of the policy's trunk."""
    if name == "none":
        return None
    if name in HEAD_WIDTHS:
        return MLPHead(hidden_size, HEAD_WIDTHS[name])
    if name == "full":
        if policy is None:
            raise ValueError("the full critic copies the policy's trunk: pass policy=")
        return FullCritic(policy)
    raise ValueError(f"unknown critic {name!r}: choose one of {', '.join(CRITICS)}")
