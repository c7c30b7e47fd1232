"""A step's rewards -> the advantages of its micro-batches, by the algorithm's registered
estimator (algorithms/base.py): a group estimator (GRPO, RLOO) on sequence rewards, or PPO's GAE.

Runs after the micro-batches are laid out and their reference log-probs (and, for
PPO, the critic's values) are filled, because the KL-in-reward and GAE need them.
"""

from __future__ import annotations

import torch

from loomrl.platform.algorithms.base import ALGORITHMS
from loomrl.platform.algorithms.ppo import rollout_kl as _rollout_kl
from loomrl.platform.placement import to_device


def assign_advantages(algorithm, group_size: int, rewards: torch.Tensor, trajs: list, mbs: list) -> dict[str, float]:
    """Set mb.advantages ([B] for a group estimator, [B, T-1] for PPO; PPO also mb.returns) and each
    trajectory's `advantage` (group estimators). rewards[i] belongs to trajs[i]. Returns step metrics."""
    a = algorithm
    index = {id(t): i for i, t in enumerate(trajs)}
    kl_in_reward = a.kl_placement == "reward" and a.kl_coef > 0
    if kl_in_reward and any(mb.ref_logp is None for mb in mbs):
        raise ValueError("kl_placement 'reward' needs the reference log-probs filled")
    stats: dict[str, float] = {}
    entry = ALGORITHMS.get(a.name)
    if entry.trait("advantages") == "critic":
        return entry.obj(a, rewards, index, mbs, kl_in_reward)
    if entry.trait("advantages") == "group":
        seq_rewards = rewards.clone().float()
        if kl_in_reward:
            kl = torch.zeros_like(seq_rewards)
            for mb in mbs:
                for t, k in zip(mb.trajectories, _rollout_kl(mb).sum(-1)):
                    kl[index[id(t)]] = k
            seq_rewards = seq_rewards - a.kl_coef * kl
            admitted = [index[id(t)] for mb in mbs for t in mb.trajectories]  # groups may be dropped
            stats["kl_reward_mean"] = float(kl[admitted].mean())
        adv = entry.obj(seq_rewards, group_size, a)
        for t, v in zip(trajs, adv.tolist()):
            t.advantage = v
        for mb in mbs:
            mb.advantages = to_device(
                torch.tensor([t.advantage for t in mb.trajectories], dtype=torch.float32), mb.loss_mask.device
            )
        return stats
    raise ValueError(f"algorithm {a.name!r} computes no advantages (it has no rollouts)")
