"""The algorithm seam: `ALGORITHMS`, the RL (and supervised) algorithms by the name
`algorithm.name` takes, each registered in its own module with its traits:

    advantages     "group": the entry's object maps a step's sequence rewards [B] (ordered group
                   by group, KL-in-reward already subtracted) to sequence advantages [B]:
                   fn(rewards, group_size, algorithm_config) -> Tensor (GRPO, RLOO);
                   "critic": the object fills token-level advantages and returns from a value
                   model: fn(algorithm_config, rewards, index, mbs, kl_in_reward) -> stats (PPO);
                   None: no rollouts, no advantages (SFT)
    min_samples    samples per prompt it needs (`rollout.n`), default 1
    supervised     trains on the samples' answers, no rollouts (SFT, DPO)
    preference     trains on preference pairs (`chosen` / `rejected`) against a frozen reference;
                   the object builds the micro-batch loss from `algorithm.dpo` (DPO)

Every RL algorithm trains with the same clipped policy loss (`grpo.policy_loss`); what differs is
the advantage. A new estimator is one file that registers one function (docs/extending.md).
"""

from __future__ import annotations

from loomrl.config.registry import Registry

ALGORITHMS: Registry = Registry("algorithm", key="algorithm.name")
