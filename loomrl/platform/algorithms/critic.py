"""PPO's value model, in one of two forms:

- value_head: a scalar head on the policy's final hidden states (shared backbone; the
  value loss is added to the policy loss and trained by the policy's optimizer);
- separate:   a second VLM built like the policy (initialised from its weights) with a
  scalar head, trained with its own optimizer.

Values are aligned with the log-probs: position t holds V of the prefix input_ids[:, :t+1],
the state in which token t+1 is chosen, so `mask` selects the completion's states.
"""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """hidden [B, T, H] -> values [B, T-1] (the last position predicts nothing)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)  # V = 0 at the start: the first advantages are the rewards
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden[:, :-1].float()).squeeze(-1)


class Critic(nn.Module):
    """A separate value model: `body` (a VLM like the policy) + a ValueHead."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.head = ValueHead(body.cfg.hidden_size)

    def forward(self, mb) -> torch.Tensor:
        """Values [B, T-1] of a loomrl.platform.trajectory.batch.MicroBatch."""
        _, _, hidden = self.body.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, return_hidden=True)
        return self.head(hidden)


def build_critic(policy: nn.Module, build) -> Critic:
    """A critic whose body is `build()` (a fresh VLM of the policy's config) loaded with
    the policy's current weights, so it starts from the policy's representation."""
    body = build()
    body.load_state_dict(policy.state_dict())  # the load hook clears its encoding cache
    return Critic(body)
