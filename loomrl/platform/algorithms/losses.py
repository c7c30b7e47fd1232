"""The micro-batch loss functions the training engines run: the policy's (GRPO or PPO,
with importance correction and an optional value head), a separate critic's, and the
supervised (SFT) loss of the warm-up stage. Each returns (loss already scaled to its share
of the mini-batch, summed stats)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from loomrl.platform.algorithms.base import ALGORITHMS
from loomrl.platform.algorithms.critic import Critic, ValueHead
from loomrl.platform.algorithms.grpo import policy_loss
from loomrl.platform.algorithms.importance import importance_weights
from loomrl.platform.algorithms.ppo import value_loss

if TYPE_CHECKING:  # annotations only: the recipe composes this package's config, not the other way
    from loomrl.platform import recipe as R


@ALGORITHMS.register("sft", advantages=None, supervised=True)
def sft_loss(model, mb) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the completion tokens, per token of the mini-batch."""
    logp, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
    n = float(mb.loss_mask.sum())
    return -(logp * mb.loss_mask).sum() / mb.normaliser, {"tokens": n}


def policy_loss_fn(recipe: R.Recipe, shared=None, value_head: Optional[ValueHead] = None):
    """The policy's micro-batch loss (GRPO or PPO). shared: a loomrl.encoders.cache.SharedEncodings
    whose encodings of the current mini-batch every micro-batch uses (None: encode per micro-batch).
    value_head: PPO's head on the policy; its value loss is added. The largest importance ratio
    seen is kept in loss_fn.maxima (the engine sums stats)."""
    a, temperature, im = recipe.algorithm, recipe.rollout.temperature, recipe.algorithm.importance
    top_p = recipe.rollout.top_p if temperature > 0 else 1.0  # the nucleus the rollouts were sampled from
    entry = ALGORITHMS.get(a.name)
    level = entry.trait("ratio", "token")  # GSPO: "sequence"
    low_default, high_default = entry.trait("clip", (a.clip_eps, a.clip_eps))  # GSPO's own range
    low = low_default if a.clip_eps_low is None else a.clip_eps_low
    high = high_default if a.clip_eps_high is None else a.clip_eps_high
    kl_coef = a.kl_coef if a.kl_placement == "loss" else 0.0
    maxima = {"is_ratio_max": 0.0}

    def loss_fn(model, mb):
        encodings = shared.encodings if shared is not None else None
        out = model.sequence_logprobs(
            mb.input_ids,
            mb.attention_mask,
            mb.media,
            temperature,
            encodings,
            return_hidden=value_head is not None,
            top_p=top_p if mb.old_logp is None else 1.0,
        )
        logp, entropy = out[0], out[1]
        old = mb.old_logp if mb.old_logp is not None else logp.detach()
        old_nucleus = mb.old_nucleus if mb.old_logp is not None else (out[-1] if top_p < 1.0 else None)
        # pi_old under the trainer vs the rollout engine that sampled the tokens
        weights, is_stats = importance_weights(
            old, mb.rollout_logp, mb.loss_mask, im.mode, cap=im.cap, low=im.low, high=im.high
        )
        maxima["is_ratio_max"] = max(maxima["is_ratio_max"], is_stats.pop("is_ratio_max"))
        normaliser = {
            "token": mb.normaliser,
            "sequence": mb.sequences,
            "constant": mb.sequences * recipe.rollout.max_new_tokens,
        }[a.loss_norm]
        loss, stats = policy_loss(
            logp,
            old,
            mb.advantages,
            mb.loss_mask,
            low,
            normaliser,
            ref_logp=mb.ref_logp,
            kl_coef=kl_coef,
            clip_eps_high=high,
            weights=None if im.mode == "none" else weights,
            loss_norm=a.loss_norm,
            ratio_level=level,
        )
        stats.update(is_stats)
        if value_head is not None:
            vloss, vstats = value_loss(
                value_head(out[2]), mb.values, mb.returns, mb.loss_mask, a.ppo.value_clip, mb.normaliser
            )
            loss = loss + a.ppo.value_coef * vloss
            stats.update(vstats)
        m = mb.loss_mask
        floor = a.entropy_floor
        if floor.target > 0:  # entropy bonus below the floor (algorithm.entropy_floor)
            tokens = m.sum()
            below = torch.relu(floor.target - (entropy * m).sum() / tokens.clamp(min=1))
            loss = loss + floor.coef * below * tokens / mb.normaliser  # the micro-batch's share of tokens
            stats["entropy_floor_sum"] = float(below.detach()) * float(tokens)  # token-weighted
        stats["entropy_sum"] = float((entropy.detach() * m).sum())
        # rollout-vs-trainer mismatch of the same tokens under the same weights: pi_old (the policy
        # before this step's updates; the policy itself with one mini-batch), not the policy after
        # mini-batch 1 has moved it; with top_p < 1 both under their nucleus (the rollout's log-probs
        # are the nucleus's), so it measures arithmetic, not the truncation
        trainer = old.detach() if old_nucleus is None else old.detach() - old_nucleus
        stats["mismatch_sum"] = float(((mb.rollout_logp - trainer).abs() * m).sum())
        stats["tokens"] = float(m.sum())
        return loss, stats

    loss_fn.maxima = maxima
    return loss_fn


def critic_loss_fn(recipe: R.Recipe):
    """The separate critic's micro-batch loss: the clipped value loss."""
    clip = recipe.algorithm.ppo.value_clip

    def loss_fn(critic: Critic, mb):
        return value_loss(critic(mb), mb.values, mb.returns, mb.loss_mask, clip, mb.normaliser)

    return loss_fn
