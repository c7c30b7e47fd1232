"""PPO's critic side (Schulman et al. 2017): per-token rewards, generalised advantage
estimation (GAE, Schulman et al. 2016), advantage whitening and the clipped value loss.
The policy side is the clipped surrogate in grpo.policy_loss, shared with GRPO.

Shapes: B sequences, T token positions; `mask` is 1 where a position predicts a
completion token, and each row's completion positions are contiguous.
"""

from __future__ import annotations

import torch

from loomrl.platform.algorithms.base import ALGORITHMS
from loomrl.platform.placement import to_device


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """[B, T] rewards: the sequence reward on each row's last completion token, minus
    kl_coef * kl on every completion token (kl: a per-token estimate such as
    logp_rollout - logp_ref; InstructGPT's KL-in-reward, Ouyang et al. 2022)."""
    mask = mask.float()
    if (mask.sum(-1) == 0).any():
        raise ValueError("a sequence without completion tokens has no position for its reward")
    t = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * t).argmax(-1)  # index of the last completion position per row
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0], device=mask.device), last] = rewards.to(out)
    if kl is not None and kl_coef:
        out = out - kl_coef * kl * mask
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, [B, T], zero off the mask.

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, with
    V = 0 after a row's last completion token (the completion ends the episode), and
    returns R_t = A_t + V_t (the value targets)."""
    mask = mask.float()
    values = values.detach() * mask
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        # off the mask (padding, prompt) carry the next completion position's state through
        next_adv = m * a + (1 - m) * next_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        adv[:, t] = m * a
    return adv, (adv + values) * mask


def whiten(xs: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """(x - mean) / std over the masked entries of all the tensors at once (a step's
    micro-batches have different widths), zero off the mask."""
    masks = [m.float() for m in masks]
    n = sum(m.sum() for m in masks)
    if n < 2:
        raise ValueError("whitening needs at least two tokens")
    mean = sum((x * m).sum() for x, m in zip(xs, masks)) / n
    var = sum((((x - mean) * m) ** 2).sum() for x, m in zip(xs, masks)) / (n - 1)
    return [(x - mean) * torch.rsqrt(var + eps) * m for x, m in zip(xs, masks)]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    normaliser: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 * max((V - R)^2, (V_clip - R)^2) per token with V_clip = V_old + clip(V - V_old,
    -clip, clip) (clip = 0: unclipped), summed over the mask / normaliser."""
    mask = mask.float()
    err = (values - returns) ** 2
    clipped_frac = 0.0
    if clip > 0:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clip = (v_clip - returns) ** 2
        clipped_frac = float(((err_clip > err).float() * mask).sum())
        err = torch.maximum(err, err_clip)
    loss = 0.5 * (err * mask).sum() / normaliser
    stats = {
        "value_loss_sum": float((0.5 * err.detach() * mask).sum()),
        "value_clipped_tokens": clipped_frac,
        "value_sum": float((values.detach() * mask).sum()),
    }
    return loss, stats


def rollout_kl(mb) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi_rollout || ref) on the sampled tokens."""
    return (mb.rollout_logp - mb.ref_logp) * mb.loss_mask


@ALGORITHMS.register("ppo", advantages="critic")
def ppo_advantages(a, rewards: torch.Tensor, index: dict, mbs: list, kl_in_reward: bool) -> dict[str, float]:
    """PPO's estimator: token rewards (the sequence reward on the last token, the KL-in-reward on
    every token), GAE over the critic's values, optionally whitened; sets mb.advantages and
    mb.returns. rewards[index[id(t)]] belongs to trajectory t. Returns step metrics."""
    stats: dict[str, float] = {}
    p = a.ppo
    advs, kl_sum = [], 0.0
    for mb in mbs:
        if mb.values is None:
            raise ValueError("PPO needs the critic's values filled before the advantages")
        r = to_device(torch.stack([rewards[index[id(t)]] for t in mb.trajectories]).float(), mb.loss_mask.device)
        kl = rollout_kl(mb) if kl_in_reward else None
        if kl is not None:
            kl_sum += float(kl.sum())
        adv, mb.returns = gae(token_rewards(r, mb.loss_mask, kl, a.kl_coef), mb.values, mb.loss_mask, p.gamma, p.lam)
        advs.append(adv)
    masks = [mb.loss_mask for mb in mbs]
    tokens = float(sum(m.sum() for m in masks))
    stats["advantage_mean"] = float(sum((x * m).sum() for x, m in zip(advs, masks))) / tokens
    stats["value_mean"] = float(sum((mb.values * mb.loss_mask).sum() for mb in mbs)) / tokens
    stats["return_mean"] = float(sum((mb.returns * mb.loss_mask).sum() for mb in mbs)) / tokens
    if kl_in_reward:
        stats["kl_reward_mean"] = kl_sum / sum(len(mb.trajectories) for mb in mbs)  # admitted ones
    if p.whiten_advantages:
        advs = whiten(advs, masks)
    for mb, adv in zip(mbs, advs):
        mb.advantages = adv
    return stats
