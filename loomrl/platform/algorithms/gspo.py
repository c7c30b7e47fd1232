"""GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): GRPO's group-relative advantages
with a sequence-level importance ratio and sequence-level clipping,

    s_i = exp( (1/|y_i|) sum_t [log pi(y_i,t) - log pi_old(y_i,t)] )
    loss_i = -min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i )

the length-normalised log-ratio of the whole response, so one token's large ratio cannot dominate
its sequence (the instability of token-level ratios on long responses and MoE models that GSPO
was made for). Its clip range is per sequence and much narrower than a token ratio's:
`algorithm.clip_eps_low` / `clip_eps_high`, default the paper's 3e-4 / 4e-4 (`algorithm.clip_eps`
is the token-level range and does not apply). The entry's traits say so (`ratio`, `clip`); the
shared policy loss (`grpo.policy_loss`, `ratio_level="sequence"`) computes it.
"""

from __future__ import annotations

import torch

from loomrl.platform.algorithms.base import ALGORITHMS
from loomrl.platform.algorithms.grpo import group_advantages


@ALGORITHMS.register("gspo", advantages="group", min_samples=2, ratio="sequence", clip=(3e-4, 4e-4))
def gspo_advantages(rewards: torch.Tensor, group_size: int, algorithm) -> torch.Tensor:
    """GSPO's estimator: GRPO's group-relative advantages (std-scaled unless `scale_rewards` is false)."""
    return group_advantages(rewards, group_size, algorithm.scale_rewards)
