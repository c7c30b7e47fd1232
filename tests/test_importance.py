"""Importance correction for the rollout/trainer mismatch: exact identity when the two
log-probs agree, clipped and masked shares that match a known perturbation, and the same
figures through the runner's real loss function on a real model."""

import math

import pytest
import torch

from loomrl.platform.algorithms.grpo import policy_loss
from loomrl.platform.algorithms.importance import importance_weights


@pytest.mark.parametrize("mode", ["none", "truncate", "mask"])
def test_identical_logprobs_give_weight_one_and_the_uncorrected_loss(mode):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 7, generator=g) * 3
    old = logp + 0.3 * torch.randn(3, 7, generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.2).float()
    adv = torch.randn(3, generator=g)
    w, stats = importance_weights(old, old.clone(), mask, mode, cap=2.0, low=0.5, high=2.0)
    assert torch.equal(w, mask)  # exactly 1 on every token (0 off the mask)
    assert stats["is_clipped"] == stats["is_masked"] == stats["is_outside"] == 0 and stats["is_ratio_max"] == 1.0
    assert stats["is_ratio_sum"] == float(mask.sum()) and stats["is_kl"] == 0.0
    plain, _ = policy_loss(logp, old, adv, mask, 0.2, float(mask.sum()))
    corrected, _ = policy_loss(logp, old, adv, mask, 0.2, float(mask.sum()), weights=w)
    assert torch.equal(plain, corrected)


RATIOS = torch.tensor([[1.0, 3.0, 0.25, 1.5, 2.5], [0.4, 1.0, 1.0, 10.0, 0.01]])
MASK = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # the two last ratios are on padding


def perturbed():
    old = torch.log(torch.full((2, 5), 0.3))
    return old, old - torch.log(RATIOS)  # rollout log-probs whose ratios are RATIOS


def test_truncate_clips_the_known_share():
    old, rollout = perturbed()
    w, stats = importance_weights(old, rollout, MASK, "truncate", cap=2.0)
    assert stats["is_clipped"] == 2  # 3.0 and 2.5; the 10.0 is padding
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.25, 1.5, 2.0], [0.4, 1, 1, 0, 0]]))
    assert stats["is_ratio_max"] == pytest.approx(3.0)
    assert stats["is_ratio_sum"] == pytest.approx(1 + 3 + 0.25 + 1.5 + 2.5 + 0.4 + 1 + 1)


@pytest.mark.parametrize("mode", ["none", "truncate", "mask"])
def test_every_mode_reports_the_kl_and_the_share_outside_the_band(mode):
    old, rollout = perturbed()
    _, stats = importance_weights(old, rollout, MASK, mode, cap=2.0, low=0.5, high=2.0)
    assert stats["is_outside"] == 4  # 3.0, 0.25, 2.5, 0.4 (the 10.0 and 0.01 are padding)
    on = [1.0, 3.0, 0.25, 1.5, 2.5, 0.4, 1.0, 1.0]
    assert stats["is_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in on), rel=1e-6)


def test_mask_drops_the_known_share():
    old, rollout = perturbed()
    w, stats = importance_weights(old, rollout, MASK, "mask", low=0.5, high=2.0)
    assert stats["is_masked"] == 4  # 3.0, 0.25, 2.5, 0.4
    torch.testing.assert_close(w, torch.tensor([[1.0, 0, 0, 1.5, 0], [0, 1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="unknown importance correction mode"):
        importance_weights(old, rollout, MASK, "clip")


def test_weights_scale_the_surrogate_not_the_kl():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]])
    w = torch.tensor([[2.0, 0.0]])
    loss, _ = policy_loss(
        logp, logp, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 2.0, ref_logp=ref, kl_coef=0.1, weights=w
    )
    k3 = 0.5 - math.log(0.5) - 1
    assert loss.item() == pytest.approx((-2.0 - 0.0 + 2 * 0.1 * k3) / 2)


@pytest.mark.parametrize("mode, key, expected", [("truncate", "is_clipped", 2), ("mask", "is_masked", 3)])
def test_runner_loss_reports_the_known_shares(model, samples, mode, key, expected):
    from loomrl.platform.algorithms.losses import policy_loss_fn
    from loomrl.platform.recipe import Recipe
    from loomrl.platform.trajectory.batch import Trajectory, collate

    trajs = [
        Trajectory(s.id, i, s.ids, [5, 6, 7], s.media, [0.0] * 3, 0.0, 0, advantage=a)
        for i, (s, a) in enumerate(zip(samples[:2], [1.0, -1.0]))
    ]
    mb = collate(trajs, model.pad_token_id)
    mb.normaliser = float(mb.loss_mask.sum())
    with torch.no_grad():
        trainer, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
    recipe = Recipe()
    loss_fn = policy_loss_fn(recipe, None)
    mb.rollout_logp = trainer.clone()
    plain, _ = loss_fn(model, mb)  # same log-probs: ratio exactly 1, nothing clipped or masked
    recipe.algorithm.importance.mode = mode
    mb.rollout_logp = trainer.clone()
    same, stats = policy_loss_fn(recipe, None)(model, mb)
    assert torch.equal(plain, same) and stats["is_clipped"] == stats["is_masked"] == 0
    # perturb the rollout log-probs of three completion tokens: ratios 4 (clipped, masked),
    # 3 (clipped, masked), 0.25 (masked only)
    pos = mb.loss_mask.nonzero()[:3]
    for (b, t), r in zip(pos.tolist(), [4.0, 3.0, 0.25]):
        mb.rollout_logp[b, t] -= math.log(r)
    _, stats = policy_loss_fn(recipe, None)(model, mb)
    assert stats[key] == expected
    tokens = float(mb.loss_mask.sum())
    assert stats["is_ratio_sum"] == pytest.approx(tokens - 3 + 4 + 3 + 0.25, rel=1e-5)
