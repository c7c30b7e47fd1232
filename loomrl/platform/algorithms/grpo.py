"""GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages and the
PPO-clipped policy objective (also PPO's), with an optional k3 KL penalty to a
reference, asymmetric clipping and three loss normalisations.

Shapes: B trajectories, T token positions. `mask` is 1 on completion tokens.
"""

from __future__ import annotations

import torch

from loomrl.platform.algorithms.base import ALGORITHMS


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std(group) + eps); rewards are ordered group by group.
    With scale=False only the mean is subtracted (Dr. GRPO, Liu et al. 2025)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)  # unbiased std, as TRL and verl
    return adv.flatten()


@ALGORITHMS.register("grpo", advantages="group", min_samples=2)
def grpo_advantages(rewards: torch.Tensor, group_size: int, algorithm) -> torch.Tensor:
    """GRPO's estimator: group-relative advantages, divided by the group's std unless
    `algorithm.scale_rewards` is false."""
    return group_advantages(rewards, group_size, algorithm.scale_rewards)


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: float) -> torch.Tensor:
    """Masked per-token losses -> this micro-batch's share of the mini-batch loss.

    token:    sum over tokens / `normaliser` = the mini-batch's token count (every token
              weighs the same; DAPO, Yu et al. 2025).
    sequence: each sequence's token mean, summed / `normaliser` = the mini-batch's sequence
              count (every sequence weighs the same; GRPO as in Shao et al. 2024).
    constant: sum over tokens / `normaliser` = sequences x max_new_tokens (no length
              bias; Dr. GRPO, Liu et al. 2025).
    """
    summed = per_token * mask
    if mode == "sequence":
        return (summed.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    if mode in ("token", "constant"):
        return summed.sum() / normaliser
    raise ValueError(f"unknown loss normalisation {mode!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    normaliser: float,
    *,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    clip_eps_high: float | None = None,
    weights: torch.Tensor | None = None,
    loss_norm: str = "token",
    ratio_level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate: per token
    -w * min(rho * A, clip(rho, 1-eps_low, 1+eps_high) * A) + kl_coef * KL_k3,
    reduced by `reduce_tokens` (token mode: divided by `normaliser`, the token count of
    the whole mini-batch, so micro-batch losses add up to it).

    advantages: [B] (one per sequence, GRPO) or [B, T] (per token, PPO/GAE).
    clip_eps is the lower clip range; clip_eps_high (None: the same) the upper one
    ("clip-higher", DAPO). weights: per-token importance weights for the rollout/trainer
    mismatch (loomrl.platform.algorithms.importance), applied to the surrogate only.

    ratio_level "sequence" (GSPO): every token of a sequence takes the sequence's ratio, the exp of
    its mean log-ratio over its completion tokens, and is clipped with it.

    Returns the loss and sums (not means) of diagnostics over this micro-batch's tokens.
    """
    mask = mask.float()
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logp - old_logp
    if ratio_level == "sequence":
        seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = seq[:, None].expand_as(logp)
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r}")
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv)
    per_token = -surr if weights is None else -surr * weights.detach()
    outside = (ratio < 1 - clip_eps) | (ratio > 1 + high)
    stats = {
        "clipped_tokens": float((outside.float() * mask).sum()),
        "ratio_sum": float((ratio.detach() * mask).sum()),
    }
    if ref_logp is not None and kl_coef > 0:
        # k3 estimator (Schulman): exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased for KL(pi || ref).
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
        stats["kl_sum"] = float((kl.detach() * mask).sum())
    loss = reduce_tokens(per_token, mask, loss_norm, normaliser)
    return loss, stats
