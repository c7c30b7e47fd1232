"""RLOO (REINFORCE Leave-One-Out; Kool et al. 2019, Ahmadian et al. 2024): each sample's
baseline is the mean reward of the other samples of its prompt, A_i = r_i - mean_{j != i} r_j
= G / (G - 1) x (r_i - mean(group)). Unbiased (the baseline does not depend on the sample's own
reward) and not divided by the group's spread; trained with the same clipped policy loss as GRPO."""

from __future__ import annotations

import torch

from loomrl.platform.algorithms.base import ALGORITHMS


@ALGORITHMS.register("rloo", advantages="group", min_samples=2)
def rloo_advantages(rewards: torch.Tensor, group_size: int, algorithm=None) -> torch.Tensor:
    """Leave-one-out advantages of `rewards` [B], ordered group by group (groups of `group_size` >= 2)."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} >= 2")
    r = rewards.float().view(-1, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).flatten()
