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
    torch.testing.assert_close(group_advantages(r, 4, scale=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
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


# --------------------------------------------------------------------------- GRPO variants

from loomrl.platform.algorithms.grpo import reduce_tokens  # noqa: E402

LOGP = torch.log(torch.tensor([[0.5, 0.6, 0.9], [0.2, 0.3, 0.1]]))
OLD = torch.log(torch.tensor([[0.5, 0.4, 0.6], [0.4, 0.3, 0.1]]))
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
ADV = torch.tensor([2.0, -1.0])
TERMS = [[-(2 * 1.0), -(2 * 1.2), -(2 * 1.2)], [1 * 0.8, 1 * 1.0]]  # from test_policy_loss_by_hand


def test_clip_higher_by_hand():
    # eps_low .2, eps_high .6: row 0's ratio 1.5 is no longer clipped (A > 0: min(1.5, 1.6) = 1.5),
    # row 1's ratio .5 still is (A < 0: max(.5, .8) = .8)
    loss, stats = policy_loss(LOGP, OLD, ADV, MASK, 0.2, 5.0, clip_eps_high=0.6)
    assert loss.item() == pytest.approx((-2 - 3 - 3 + 0.8 + 1) / 5, rel=1e-6)
    assert stats["clipped_tokens"] == 1
    # a lower eps_low clips the A < 0 side less: max(.5, .6) = .6
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, 0.4, 5.0, clip_eps_high=0.2)
    assert loss.item() == pytest.approx((-2 - 2.4 - 2.4 + 0.6 + 1) / 5, rel=1e-6)


@pytest.mark.parametrize(
    "mode, normaliser, expected",
    [
        ("token", 5.0, (sum(TERMS[0]) + sum(TERMS[1])) / 5),
        ("sequence", 2.0, (sum(TERMS[0]) / 3 + sum(TERMS[1]) / 2) / 2),  # each sequence's mean, then the mean
        ("constant", 2 * 16.0, (sum(TERMS[0]) + sum(TERMS[1])) / 32),  # sequences x max_new_tokens
    ],
)
def test_loss_normalisations_by_hand(mode, normaliser, expected):
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, 0.2, normaliser, loss_norm=mode)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_sequence_norm_adds_up_over_micro_batches():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    whole = reduce_tokens(per_token, MASK, "sequence", 2.0)
    parts = reduce_tokens(per_token[:1], MASK[:1], "sequence", 2.0) + reduce_tokens(
        per_token[1:], MASK[1:], "sequence", 2.0
    )
    assert whole.item() == pytest.approx(parts.item()) == pytest.approx((2.0 + 4.5) / 2)
    with pytest.raises(ValueError, match="unknown loss normalisation"):
        reduce_tokens(per_token, MASK, "median", 1.0)


def test_kl_in_reward_for_grpo_by_hand():
    from types import SimpleNamespace

    from loomrl.platform.algorithms.advantages import assign_advantages
    from loomrl.platform.recipe import AlgorithmConfig

    trajs = [SimpleNamespace(advantage=0.0) for _ in range(4)]
    mask = torch.tensor([[0.0, 1, 1], [0, 1, 0]])
    # rollout - ref per token: row sums 0.5 + 0.25 = .75, 1.0 (off-mask entries ignored)
    mbs = [
        SimpleNamespace(
            trajectories=trajs[i : i + 2],
            loss_mask=mask,
            advantages=None,
            rollout_logp=torch.tensor([[9.0, 0.5, 0.25], [9.0, 1.0, 9.0]]),
            ref_logp=torch.zeros(2, 3),
        )
        for i in (0, 2)
    ]
    a = AlgorithmConfig(kl_coef=0.4, kl_placement="reward", scale_rewards=False)
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0])
    stats = assign_advantages(a, 2, rewards, trajs, mbs)
    # shaped r - 0.4 * KL: [.7, .6 | -.3, 1.6]; minus each group's mean (.65, .65)
    expected = torch.tensor([0.05, -0.05, -0.95, 0.95])
    torch.testing.assert_close(torch.tensor([t.advantage for t in trajs]), expected)
    torch.testing.assert_close(mbs[1].advantages, expected[2:])
    assert stats["kl_reward_mean"] == pytest.approx(0.875)
    # the same step with the KL in the loss leaves the rewards alone
    assign_advantages(AlgorithmConfig(kl_coef=0.4, scale_rewards=False), 2, rewards, trajs, mbs)
    torch.testing.assert_close(torch.tensor([t.advantage for t in trajs]), torch.tensor([0.0, 0.0, -1.0, 1.0]))
