"""A step's rewards -> the advantages of its micro-batches, for GRPO or PPO.

Runs after the micro-batches are laid out and their reference log-probs (and, for
PPO, the critic's values) are filled, because the KL-in-reward and GAE need them.
"""
from __future__ import annotations

import torch

from loomrl.platform.algorithms.grpo import group_advantages
from loomrl.platform.algorithms.ppo import gae, token_rewards, whiten
from loomrl.platform.placement import to_device


def _rollout_kl(mb) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi_rollout || ref) on the sampled tokens."""
    return (mb.rollout_logp - mb.ref_logp) * mb.loss_mask


def assign_advantages(algorithm, group_size: int, rewards: torch.Tensor, trajs: list, mbs: list) -> dict[str, float]:
    """Set mb.advantages ([B] for GRPO, [B, T-1] for PPO; PPO also mb.returns) and each
    trajectory's `advantage` (GRPO). rewards[i] belongs to trajs[i]. Returns step metrics."""
    a = algorithm
    index = {id(t): i for i, t in enumerate(trajs)}
    kl_in_reward = a.kl_placement == "reward" and a.kl_coef > 0
    if kl_in_reward and any(mb.ref_logp is None for mb in mbs):
        raise ValueError("kl_placement 'reward' needs the reference log-probs filled")
    stats: dict[str, float] = {}
    if a.name == "grpo":
        seq_rewards = rewards.clone().float()
        if kl_in_reward:
            kl = torch.zeros_like(seq_rewards)
            for mb in mbs:
                for t, k in zip(mb.trajectories, _rollout_kl(mb).sum(-1)):
                    kl[index[id(t)]] = k
            seq_rewards = seq_rewards - a.kl_coef * kl
            admitted = [index[id(t)] for mb in mbs for t in mb.trajectories]  # groups may be dropped
            stats["kl_reward_mean"] = float(kl[admitted].mean())
        adv = group_advantages(seq_rewards, group_size, a.scale_rewards)
        for t, v in zip(trajs, adv.tolist()):
            t.advantage = v
        for mb in mbs:
            mb.advantages = to_device(torch.tensor([t.advantage for t in mb.trajectories], dtype=torch.float32),
                                      mb.loss_mask.device)
        return stats
    if a.name != "ppo":
        raise ValueError(f"unknown algorithm {a.name!r}")
    p = a.ppo
    advs, kl_sum = [], 0.0
    for mb in mbs:
        if mb.values is None:
            raise ValueError("PPO needs the critic's values filled before the advantages")
        r = to_device(torch.stack([rewards[index[id(t)]] for t in mb.trajectories]).float(), mb.loss_mask.device)
        kl = _rollout_kl(mb) if kl_in_reward else None
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
