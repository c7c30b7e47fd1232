"""Overlong responses (DAPO, Yu et al. 2025, section 3.4): a soft length penalty over the last
`algorithm.overlong.buffer` tokens before `rollout.max_new_tokens`, and filtering of truncated
responses from the loss.

    L_max = rollout.max_new_tokens, L_cache = buffer, |y| the response's tokens
    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = penalty x ((L_max - L_cache) - |y|) / L_cache    if L_max - L_cache < |y| <= L_max

added to the reward before the advantages (and kept as the reward part `overlong`). `filter`: a
response cut at L_max without its stop token (`finish_reason: length`) keeps its place in its
group's advantages but none of its tokens is trained (its completion mask is all zero), so the
policy is not taught to ramble by answers that were never finished.
"""

from __future__ import annotations

from loomrl.platform.algorithms.config import OverlongConfig
from loomrl.platform.trajectory.batch import Trajectory


def length_penalty(length: int, max_new_tokens: int, cfg: OverlongConfig) -> float:
    """R_length of a response of `length` tokens (0 without a buffer)."""
    start = max_new_tokens - cfg.buffer
    if cfg.buffer == 0 or length <= start:
        return 0.0
    return cfg.penalty * (start - min(length, max_new_tokens)) / cfg.buffer


def apply_overlong(traj: Trajectory, finish_reason: str, max_new_tokens: int, cfg: OverlongConfig) -> None:
    """Shape `traj`'s reward by its length and, with `filter`, mask it from the loss when truncated."""
    if cfg.buffer:
        shaping = length_penalty(len(traj.completion_ids), max_new_tokens, cfg)
        traj.reward += shaping
        traj.reward_parts = {**traj.reward_parts, "overlong": shaping}
    if cfg.filter and finish_reason == "length":
        traj.completion_mask = [0] * len(traj.completion_ids)
