"""GSPO and REINFORCE++ (issue: the algorithms users expect), each one registered file, checked
against hand-computed values: REINFORCE++'s batch-whitened advantages (with and without the group
baseline, identical rewards, a single sample), GSPO's sequence-level ratio, clipping and gradient,
and the trainer's loss taking GSPO's ratio level and clip range from its registry entry."""

import math

import pytest
import torch

from loomrl.config import RecipeError
from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.algorithms.grpo import policy_loss
from loomrl.platform.algorithms.losses import policy_loss_fn
from loomrl.platform.algorithms.reinforce_pp import reinforce_pp_advantages, reinforce_pp_baseline_advantages
from loomrl.platform.trajectory.batch import MicroBatch

DEMO = "recipes/demo.yaml"


def test_reinforce_pp_whitens_rewards_over_the_batch():
    got = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    # mean 0.5, unbiased std sqrt(1/3): +-0.5 / 0.57735 = +-0.866025
    assert torch.allclose(got, torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)
    assert torch.equal(reinforce_pp_advantages(torch.tensor([0.7, 0.7, 0.7]), 3), torch.zeros(3))  # all equal
    assert torch.equal(reinforce_pp_advantages(torch.tensor([0.3]), 1), torch.zeros(1))  # one sample


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    # groups (1, 0) and (1, 1): r' = 0.5, -0.5, 0, 0; batch mean 0, unbiased std sqrt(0.5 / 3)
    got = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
    s = math.sqrt(0.5 / 3)
    assert torch.allclose(got, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]), atol=1e-5)
    with pytest.raises(ValueError, match="groups of 1"):
        reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(RecipeError, match="REINFORCE\\+\\+-BASELINE needs at least 2 samples"):
        R.load_recipe(DEMO, ["algorithm.name=reinforce++-baseline", "rollout.n=1"], files=False)
    R.load_recipe(DEMO, ["algorithm.name=reinforce++", "rollout.n=1"], files=False)  # no group needed


def gspo_case():
    """Two sequences: the first's token log-ratios 0.0002, 0.0004 (mean 0.0003: inside 1 + 4e-4),
    the second's -0.001, -0.001 and a padded position (mean -0.001: below 1 - 3e-4, clipped)."""
    old = torch.zeros(2, 3, dtype=torch.float64)  # fp64: the figures are differences of numbers near 1
    logp = torch.tensor([[0.0002, 0.0004, 0.0], [-0.001, -0.001, 5.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    return logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask


def test_gspo_ratio_is_per_sequence_and_clipped_per_sequence():
    logp, old, adv, mask = gspo_case()
    loss, stats = policy_loss(logp, old, adv, mask, 3e-4, 4.0, clip_eps_high=4e-4, ratio_level="sequence")
    s1, s2 = math.exp(0.0003), math.exp(-0.001)
    # seq 1: -s1 per token (unclipped); seq 2: A = -1, min(-s2, -(1 - 3e-4)) = -(0.9997): 0.9997 per token
    assert loss.item() == pytest.approx((-2 * s1 + 2 * 0.9997) / 4, rel=1e-6)
    assert stats["clipped_tokens"] == 2 and stats["ratio_sum"] == pytest.approx(2 * s1 + 2 * s2, rel=1e-6)
    loss.backward()
    # d/dlogp_t of the two tokens' -s1 each = -s1 / 2 per token per loss, two losses: -s1, over 4 tokens
    expected = torch.tensor([[-s1 / 4, -s1 / 4, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected, atol=1e-12), logp.grad
    # the same numbers at token level: token 2 of sequence 1 (ratio e^0.0004 = 1.0004 + 8e-8) is clipped
    _, token_stats = policy_loss(logp, old, adv, mask, 3e-4, 4.0, clip_eps_high=4e-4)
    assert token_stats["clipped_tokens"] == 3


class Fixed(torch.nn.Module):
    """A 'model' whose sequence log-probs are a fixed trainable tensor (the loss is all that runs)."""

    def __init__(self, logp):
        super().__init__()
        self.logp = torch.nn.Parameter(logp.detach().clone())

    def sequence_logprobs(self, ids, attention_mask, media, temperature=1.0, encodings=None, **_):
        return self.logp, torch.zeros_like(self.logp)


def test_the_trainer_loss_takes_gspo_ratio_and_clip_from_its_entry():
    assert ALGORITHMS.get("gspo").trait("ratio") == "sequence" and ALGORITHMS.get("gspo").trait("clip") == (3e-4, 4e-4)
    logp, old, adv, mask = gspo_case()
    mb = MicroBatch(
        torch.zeros(2, 4, dtype=torch.long),
        torch.ones(2, 4),
        mask,
        [[], []],
        adv,
        old.clone(),
        old_logp=old,
        normaliser=4.0,
    )
    recipe = R.load_recipe(DEMO, ["algorithm.name=gspo", "algorithm.importance.mode=none"], files=False)
    loss, stats = policy_loss_fn(recipe)(Fixed(logp), mb)
    expected, _ = policy_loss(logp.detach(), old, adv, mask, 3e-4, 4.0, clip_eps_high=4e-4, ratio_level="sequence")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-7) and stats["clipped_tokens"] == 2
    grpo = R.load_recipe(DEMO, ["algorithm.importance.mode=none"], files=False)  # token ratio, clip 0.2: none clipped
    assert policy_loss_fn(grpo)(Fixed(logp), mb)[1]["clipped_tokens"] == 0
    wide = R.load_recipe(
        DEMO, ["algorithm.name=gspo", "algorithm.clip_eps_low=0.2", "algorithm.importance.mode=none"], files=False
    )
    assert policy_loss_fn(wide)(Fixed(logp), mb)[1]["clipped_tokens"] == 0  # the recipe's range wins
