import math

import pytest
import torch

from loomrl.platform.algorithms.grpo import group_advantages, policy_loss


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(r, 4, scale=True, eps=1e-6)
    s = math.sqrt(1 / 3) + 1e-6  # unbiased std of [1, 0, 0, 1]; a constant group gets 0, not NaN
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected))
    torch.testing.assert_close(group_advantages(r, 4, scale=False), torch.tensor([.5, -.5, -.5, .5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="do not split"):
        group_advantages(r, 3)


def test_policy_loss_by_hand():
    # two sequences, three positions; the last position of row 1 is padding
    logp = torch.log(torch.tensor([[0.5, 0.6, 0.9], [0.2, 0.3, 0.1]]))
    old = torch.log(torch.tensor([[0.5, 0.4, 0.6], [0.4, 0.3, 0.1]]))
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2, normaliser=5.0)
    # ratios: row0 1.0, 1.5, 1.5 (A>0: min(r, 1.2) -> 1, 1.2, 1.2); row1 0.5, 1.0 (A<0: max(r, 0.8) -> 0.8, 1)
    terms = [-(2 * 1.0), -(2 * 1.2), -(2 * 1.2), 1 * 0.8, 1 * 1.0]
    assert loss.item() == pytest.approx(sum(terms) / 5, rel=1e-6)
    assert stats["clipped_tokens"] == 3


def test_policy_loss_gradient_is_advantage_weighted_when_on_policy():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([3.0]), torch.ones(1, 2), 0.2, normaliser=2.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -1.5]]))


def test_k3_kl_penalty():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    loss, stats = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, 1.0, ref_logp=ref, kl_coef=0.1)
    k3 = 0.5 - math.log(0.5) - 1  # exp(ref - logp) - (ref - logp) - 1
    assert stats["kl_sum"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3)
