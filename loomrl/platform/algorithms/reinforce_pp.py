"""REINFORCE++ (Hu et al. 2025): no critic and no per-prompt std; the advantages are the rewards
(KL-in-reward already subtracted) whitened over the whole batch they are assigned with,

    reinforce++            A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)
    reinforce++-baseline   r'_i = r_i - mean(group of i), then A_i = (r'_i - mean_batch(r')) / (std_batch(r') + eps)

the batch being the trajectories assigned together (a step's, or one admitted mini-batch's).
Global normalisation keeps the scale of the advantages stable without dividing each prompt's
group by its own (often tiny) spread, GRPO's bias on easy and hard prompts; the baseline variant
removes each prompt's difficulty first. A batch whose rewards are all equal gets zero advantages.
Trained with the same clipped policy loss as GRPO.
"""

from __future__ import annotations

import torch

from loomrl.platform.algorithms.base import ALGORITHMS

EPS = 1e-6


def whiten(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """(x - mean) / (std + eps) over all of x (unbiased std; 0 for a single value)."""
    x = x.float()
    if x.numel() < 2:
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std() + eps)


@ALGORITHMS.register("reinforce++", advantages="group", min_samples=1)
def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, algorithm=None) -> torch.Tensor:
    """REINFORCE++'s advantages of `rewards` [B]: whitened over the batch."""
    return whiten(rewards)


@ALGORITHMS.register("reinforce++-baseline", advantages="group", min_samples=2)
def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_size: int, algorithm=None) -> torch.Tensor:
    """REINFORCE++-baseline's advantages of `rewards` [B] (ordered group by group): each group's
    mean subtracted, then whitened over the batch."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} >= 2")
    r = rewards.float().view(-1, group_size)
    return whiten((r - r.mean(dim=1, keepdim=True)).flatten())
