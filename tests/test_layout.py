"""The layout's micro-batches hold exactly the admitted tokens, within the budgets."""

import random

import pytest
import torch

from loomrl.encoders.media import Medium
from loomrl.platform.trajectory.batch import Trajectory, micro_batches
from loomrl.platform.trajectory.layout import layout, media_transfer, plan

torch.set_num_threads(1)
PAD = 0


def random_trajs(seed: int, count: int = 23) -> list[Trajectory]:
    rng = random.Random(seed)
    media = [Medium("image", f"h{i}", torch.zeros(5 + i)) for i in range(3)]
    out = []
    for i in range(count):
        p, c = rng.randint(1, 9), rng.randint(1, 15)
        out.append(
            Trajectory(
                f"p{i // 4}",
                i // 4,
                [rng.randint(1, 50) for _ in range(p)],
                [rng.randint(1, 50) for _ in range(c)],
                [media[i % 3]],
                [rng.uniform(-3, 0) for _ in range(c)],
                0.0,
                0,
                advantage=rng.uniform(-1, 1),
            )
        )
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [0, 40, 100])
def test_micro_batches_hold_exactly_the_admitted_tokens(seed, budget):
    trajs = random_trajs(seed)
    mbs = layout(trajs, PAD, micro_batch_size=5, tokens_per_micro_batch=budget)
    assert [t for mb in mbs for t in mb.trajectories] == trajs  # each once, admitted order
    for mb in mbs:
        b, width = mb.input_ids.shape
        assert b <= 5
        assert budget == 0 or b == 1 or b * width <= budget
        for i, t in enumerate(mb.trajectories):
            seq = t.prompt_ids + t.completion_ids
            assert mb.input_ids[i, : len(seq)].tolist() == seq and int(mb.attention_mask[i].sum()) == len(seq)
            assert int(mb.loss_mask[i].sum()) == len(t.completion_ids)
            got = mb.rollout_logp[i][mb.loss_mask[i].bool()]
            assert torch.allclose(got, torch.tensor(t.rollout_logprobs))
    completion = sum(len(t.completion_ids) for t in trajs)
    assert sum(int(mb.loss_mask.sum()) for mb in mbs) == completion
    assert all(mb.normaliser == completion for mb in mbs)


def test_no_budget_is_the_plain_split():
    trajs = random_trajs(7)
    for a, b in zip(layout(trajs, PAD, 4), micro_batches(trajs, PAD, 4), strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.normaliser == b.normaliser


def test_plan_closes_a_micro_batch_at_the_padded_budget():
    assert plan([3, 3, 3, 10, 2], micro_batch_size=8, tokens_per_micro_batch=10) == [[0, 1, 2], [3], [4]]
    assert plan([12, 1], micro_batch_size=8, tokens_per_micro_batch=10) == [[0], [1]]  # never cut a row
    assert plan([1] * 5, micro_batch_size=2) == [[0, 1], [2, 3], [4]]


def test_media_moved_once_per_distinct_medium():
    trajs = random_trajs(1, count=9)
    mt = media_transfer(trajs)
    assert (mt.total, mt.unique) == (9, 3)
    assert mt.bytes_dedup == (5 + 6 + 7) * 4 and mt.bytes_naive == 3 * mt.bytes_dedup
