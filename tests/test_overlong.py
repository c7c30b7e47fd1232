"""DAPO's overlong shaping and filtering (`algorithm.overlong`), checked by hand: the soft length
penalty over the buffer before `rollout.max_new_tokens`, the truncated response masked from the
loss (and the mask surviving the transport between ranks), a mini-batch of only truncated
responses training nothing without a NaN, and the recipe's rule on the buffer."""

import pytest
import torch

from loomrl.config import RecipeError
from loomrl.platform import recipe as R
from loomrl.platform.algorithms.config import OverlongConfig
from loomrl.platform.algorithms.grpo import policy_loss
from loomrl.platform.algorithms.overlong import apply_overlong, length_penalty
from loomrl.platform.trajectory.batch import Trajectory, micro_batches
from loomrl.platform.trajectory.sources import pack_batches, unpack_batches


def test_the_soft_penalty_is_linear_over_the_buffer():
    cfg = OverlongConfig(buffer=4, penalty=0.5)  # L_max 10: no penalty up to 6, -0.5 at 10
    assert [length_penalty(n, 10, cfg) for n in (3, 6, 7, 8, 10)] == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert length_penalty(10, 10, OverlongConfig()) == 0.0  # buffer 0: off


def traj(n: int, reward: float = 1.0) -> Trajectory:
    return Trajectory("p", 0, [1, 2], list(range(3, 3 + n)), [], [0.0] * n, reward, 0, reward_parts={"reward": reward})


def test_truncated_responses_are_shaped_and_filtered():
    cfg = OverlongConfig(buffer=4, penalty=1.0, filter=True)
    done, cut = traj(7), traj(10)
    apply_overlong(done, "stop", 10, cfg)
    apply_overlong(cut, "length", 10, cfg)
    assert (done.reward, done.completion_mask) == (1.0 - 0.25, None)
    assert (cut.reward, cut.reward_parts["overlong"], cut.completion_mask) == (0.0, -1.0, [0] * 10)
    (mb,) = micro_batches([done, cut], pad_id=0, micro_batch_size=2)
    assert mb.loss_mask[0].sum() == 7 and mb.loss_mask[1].sum() == 0 and mb.normaliser == 7
    (back,), _ = unpack_batches(pack_batches([[done, cut]]))  # disaggregated ranks get the same mask
    assert [t.completion_mask for t in back] == [None, [0] * 10]


def test_a_mini_batch_of_only_truncated_responses_trains_nothing():
    cut = [traj(5), traj(5)]
    for t in cut:
        apply_overlong(t, "length", 5, OverlongConfig(filter=True))
    (mb,) = micro_batches(cut, pad_id=0, micro_batch_size=2)
    logp = torch.zeros_like(mb.loss_mask, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mb.loss_mask, 0.2, mb.normaliser)
    loss.backward()
    assert loss.item() == 0.0 and not torch.isnan(logp.grad).any() and logp.grad.abs().sum() == 0


def test_the_buffer_must_fit_under_the_cap():
    with pytest.raises(RecipeError, match="algorithm.overlong.buffer: 16 must be below rollout.max_new_tokens"):
        R.load_recipe("recipes/demo.yaml", ["algorithm.overlong.buffer=16", "rollout.max_new_tokens=16"], files=False)
    r = R.load_recipe(
        "recipes/demo.yaml", ["algorithm.overlong.buffer=4", "algorithm.overlong.filter=true"], files=False
    )
    assert (r.algorithm.overlong.buffer, r.algorithm.overlong.filter) == (4, True)


@pytest.mark.slow
def test_a_run_shapes_and_filters_its_rollouts(tmp_path, demo_shards):
    """The demo with a buffer as long as most of its responses and the filter on: the rows carry
    the shaping (reward_overlong_mean, never below -penalty) and the run trains."""
    import json

    from loomrl.cli import main

    folder, _ = demo_shards
    argv = ["run", "recipes/demo.yaml", "--out", str(tmp_path / "run"), f"data.shards={folder}/*.tar"]
    argv += ["training.warmup.steps=0", "training.steps=2", "training.prompts_per_step=4", "training.mini_batches=1"]
    argv += [
        "rollout.n=4",
        "rollout.max_new_tokens=12",
        "algorithm.overlong.buffer=8",
        "algorithm.overlong.penalty=0.5",
    ]
    argv += ["algorithm.overlong.filter=true", "goal=null", "logging.tensorboard=false"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(-0.5 <= r["reward_overlong_mean"] <= 0 for r in rows), rows
    assert any(r["reward_overlong_mean"] < 0 for r in rows)  # the untrained policy runs into the buffer
