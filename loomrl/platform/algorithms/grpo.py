"""GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages and the
PPO-clipped policy objective, with an optional k3 KL penalty to a reference.

Shapes: B trajectories, T token positions. `mask` is 1 on completion tokens.
"""
from __future__ import annotations

import torch


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


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    normaliser: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped surrogate: sum over tokens of
    -min(rho * A, clip(rho, 1-eps, 1+eps) * A) + kl_coef * KL_k3, divided by `normaliser`
    (the token count of the whole mini-batch, so micro-batch losses add up to it).

    Returns the loss and sums (not means) of diagnostics over this micro-batch's tokens.
    """
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surr
    stats = {
        "clipped_tokens": float((((ratio - 1).abs() > clip_eps).float() * mask).sum()),
        "ratio_sum": float((ratio.detach() * mask).sum()),
    }
    if ref_logp is not None and kl_coef > 0:
        # k3 estimator (Schulman): exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased for KL(pi || ref).
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
        stats["kl_sum"] = float((kl.detach() * mask).sum())
    loss = (per_token * mask).sum() / normaliser
    return loss, stats
