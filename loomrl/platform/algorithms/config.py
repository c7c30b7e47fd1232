"""Settings of the RL algorithm (`algorithm`): GRPO / PPO / SFT / DPO, clipping, KL, importance correction,
the reward sources; `validate_algorithm` checks the reward sources."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from loomrl.config.schema import RecipeError, choice, cut, is_file, ranged, show
from loomrl.platform.algorithms.base import ALGORITHMS
from loomrl.platform.rewards.config import RewardSourceConfig, check_parameters, resolve_callable
from loomrl.platform.rewards.remote import check_url


@dataclass
class ImportanceConfig:
    """Importance correction for the rollout/trainer mismatch, per token:
    ratio = exp(trainer's old logp - rollout engine's logp)."""

    mode: Literal["none", "truncate", "mask"] = "none"
    """`none`: weight 1 (the ratio is still reported); `truncate`: weight min(ratio, cap)
    (TIS, Yao et al. 2025); `mask`: weight ratio inside [low, high], tokens outside dropped
    (masked IS, as IcePop, Ling Team 2025)."""
    cap: float = ranged(2.0, ge=1)
    """Truncation cap of the ratio (`truncate`)."""
    low: float = ranged(0.5, ge=0, le=1)
    """Lower edge of the kept band (`mask`)."""
    high: float = ranged(2.0, ge=1)
    """Upper edge of the kept band (`mask`)."""


@dataclass
class PPOConfig:
    """PPO's critic and advantages (used when algorithm.name is `ppo`)."""

    critic: Literal["value_head", "separate"] = "value_head"
    """`value_head`: a scalar head on the policy's final hidden states, trained with the
    policy's optimizer; `separate`: a second model built like the policy (starting from
    its weights) with a scalar head and its own optimizer."""
    critic_lr: Optional[float] = ranged(None, gt=0)
    """Learning rate of the separate critic (null: training.lr)."""
    gamma: float = ranged(1.0, ge=0, le=1)
    """Discount of GAE (Schulman et al. 2016)."""
    lam: float = ranged(0.95, ge=0, le=1)
    """GAE lambda: 1 = Monte Carlo returns, 0 = one-step TD."""
    value_clip: float = ranged(0.2, ge=0)
    """Clip range of the value update around the old values (0 = off)."""
    value_coef: float = ranged(0.5, ge=0)
    """Weight of the value loss added to the policy loss (`value_head` only)."""
    whiten_advantages: bool = True
    """Normalise the step's token advantages to mean 0, std 1."""


@dataclass
class OverlongConfig:
    """Overlong responses (DAPO): a soft length penalty before `rollout.max_new_tokens`, and
    truncated responses filtered from the loss (algorithms/overlong.py)."""

    buffer: int = ranged(0, ge=0)
    """Tokens before rollout.max_new_tokens over which the reward is lowered linearly, to -penalty
    at the cap (DAPO's L_cache; 0 = off)."""
    penalty: float = ranged(1.0, ge=0)
    """The reward taken off a response that reaches rollout.max_new_tokens."""
    filter: bool = False
    """Truncated responses (cut at rollout.max_new_tokens without their stop token) train no token."""


@dataclass
class EntropyFloorConfig:
    """An entropy floor (algorithms/losses.py): while a micro-batch's mean token entropy is below
    `target`, its loss gains coef x (target - entropy), an entropy bonus that switches itself off
    above the floor. Stateless (a resumed run computes the same loss)."""

    target: float = ranged(0.0, ge=0)
    """Mean token entropy (nats) under which the bonus applies; 0 = off."""
    coef: float = ranged(0.01, ge=0)
    """The bonus's weight per nat below the target (the entropy gradient's scale, weighted by the
    micro-batch's share of the mini-batch's tokens)."""


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (algorithms/dynamic_sampling.py): groups whose rewards are all alike
    train on zero advantage, so they are dropped and more prompts are drawn until the step is full."""

    enabled: bool = False
    """Drop groups whose reward spread is at most min_reward_std and generate more prompts in their
    place (a group-advantage algorithm with rollout.n >= 2)."""
    max_rounds: int = ranged(4, ge=1)
    """Extra generation rounds a step may take (disaggregated: extra prompts up to max_rounds x
    training.prompts_per_step); when they are spent, the step is filled with the dropped groups
    generated first (counted as `dynamic_zero_var_trained`)."""
    min_reward_std: float = ranged(0.0, ge=0)
    """A group is dropped when the standard deviation of its rewards is at most this (0: all equal)."""


@dataclass
class DPOConfig:
    """DPO's objective on preference pairs (used when algorithm.name is `dpo`; algorithms/dpo.py)."""

    beta: float = ranged(0.1, gt=0)
    """Strength of the implicit KL to the frozen reference: the loss reads beta x the log-ratio
    margin h = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected)), summed
    log-probs of the answer tokens; IPO's target margin is 1 / (2 beta)."""
    label_smoothing: float = ranged(0.0, ge=0, lt=0.5)
    """Conservative DPO (cDPO): the share eps of pairs taken as mislabelled, loss -(1 - eps) log
    sigmoid(beta h) - eps log sigmoid(-beta h) (`sigmoid` only)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """`sigmoid`: -log sigmoid(beta h) (Rafailov et al. 2023); `ipo`: (h - 1 / (2 beta))^2 (Azar et al.
    2023), on the summed log-probs."""


@dataclass
class AlgorithmConfig:
    """The RL objective."""

    name: str = choice(ALGORITHMS, "grpo")
    """Algorithm. `grpo`: group-relative advantages, PPO-clipped ratio (Shao et al. 2024).
    `ppo`: a critic and GAE advantages, PPO-clipped ratio (Schulman et al. 2017); see `ppo`.
    `rloo`: leave-one-out baselines, A_i = r_i - mean of the group's other rewards (Ahmadian et
    al. 2024), the same clipped ratio, no std scaling.
    `gspo`: GRPO's advantages with a sequence-level ratio (the exp of the mean token log-ratio)
    clipped per sequence, by clip_eps_low / clip_eps_high (default 3e-4 / 4e-4; Zheng et al. 2025).
    `reinforce++`: rewards whitened over the batch (Hu et al. 2025); `reinforce++-baseline`:
    each group's mean subtracted first.
    `sft`: supervised fine-tuning on the samples' answers (loss on answer tokens only, the chat
    template's end-of-turn included), `training.prompts_per_step` samples per step; no rollouts
    (the reward is used by validation only).
    `dpo`: direct preference optimisation on pairs of answers (`chosen` / `rejected`) against a
    frozen reference (the policy at the start), `training.prompts_per_step` pairs per step and
    `training.micro_batch_size` pairs per forward; no rollouts; see `dpo` (Rafailov et al. 2023)."""
    reward: str = "slot_match"
    """Reward callable: a registry name (see loomrl.platform.rewards) or
    `module:function`. Called as fn(completion: str, sample: dict) -> float."""
    rewards: list[RewardSourceConfig] = field(default_factory=list)
    """Weighted reward sources (callables, reward models, remote reward servers); when given, the reward
    is their weighted sum and `reward` is not used."""
    clip_eps: float = ranged(0.2, gt=0)
    """PPO clip range of the probability ratio."""
    clip_eps_low: Optional[float] = ranged(None, gt=0, lt=1)
    """Lower clip range, ratio >= 1 - clip_eps_low (null: clip_eps; gspo: 3e-4)."""
    clip_eps_high: Optional[float] = ranged(None, gt=0)
    """Upper clip range, ratio <= 1 + clip_eps_high (null: clip_eps; gspo: 4e-4); larger than the
    lower one is DAPO's "clip-higher" (Yu et al. 2025)."""
    loss_norm: Literal["token", "sequence", "constant"] = "token"
    """How token losses are averaged: `token` over all tokens of the mini-batch (DAPO),
    `sequence` per sequence then over sequences (GRPO as published), `constant` sum /
    (sequences x max_new_tokens), no length bias (Dr. GRPO, Liu et al. 2025)."""
    kl_coef: float = ranged(0.0, ge=0)
    """Weight of the KL penalty to the reference policy (the policy at the start of
    RL); 0 disables it and the reference model."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """`loss`: k3 KL estimator added to the loss (GRPO); `reward`: kl_coef x (logp_rollout -
    logp_ref) subtracted from the reward, per token for PPO, summed per sequence for GRPO
    (InstructGPT, Ouyang et al. 2022)."""
    scale_rewards: bool = True
    """Divide group advantages by the group's reward std (GRPO); false keeps
    only the mean subtraction (Dr. GRPO)."""
    epochs: int = ranged(1, ge=1)
    """Passes over each step's rollouts (PPO epochs)."""
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)
    """Rollout/trainer importance correction; its ratio is reported every step."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """Overlong shaping and filtering (DAPO)."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """Dynamic sampling (DAPO): zero-variance groups dropped, more prompts drawn."""
    entropy_floor: EntropyFloorConfig = field(default_factory=EntropyFloorConfig)
    """An entropy bonus below a target entropy (off by default)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO's critic and GAE."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """DPO's beta, label smoothing and loss."""


def validate_algorithm(a: AlgorithmConfig) -> None:
    """Checks of the reward sources and of DPO's loss settings (each field's range, the importance
    band's included, is checked at load)."""

    if a.name == "dpo" and a.dpo.loss == "ipo" and a.dpo.label_smoothing:
        raise RecipeError(
            f"algorithm.dpo.label_smoothing: {a.dpo.label_smoothing} smooths the sigmoid loss; "
            "algorithm.dpo.loss=ipo has no labels to smooth (set it to 0, or use loss sigmoid)"
        )
    names = set()
    for i, r in enumerate(a.rewards):
        key = f"algorithm.rewards[{i}]"
        if sum(x is not None for x in (r.fn, r.model, r.url)) != 1:
            raise RecipeError(
                f"{key}: set exactly one of fn (a callable), model (a reward-model folder) and url (a reward server)"
            )
        check_parameters(r, key)
        if r.fn is not None:
            resolve_callable(r.fn, f"{key}.fn", r)
        elif r.url is not None:
            try:
                check_url(r.url)
            except ValueError as e:
                raise RecipeError(f"{key}.url: {cut(str(e), 300)}") from None
        elif not is_file(str(Path(r.model) / "config.json")):
            raise RecipeError(f"{key}.model: {show(r.model)} is not a local transformers model folder (no config.json)")
        name = r.source_name()
        if name in names:
            raise RecipeError(f"{key}: a second source named {show(name)}; give each a distinct `name`")
        names.add(name)
