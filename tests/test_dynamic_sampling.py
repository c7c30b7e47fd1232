"""DAPO's dynamic sampling (`algorithm.dynamic_sampling`): which groups a step keeps, by hand; the
recipe's rules; and real runs, colocated (extra generation rounds, resumed to equal an uninterrupted
run) and disaggregated with mini-batch admission (the books balance with the dropped groups)."""

import json

import pytest
from test_compose import check_composes, cli, rows

from loomrl.config import RecipeError
from loomrl.platform import recipe as R
from loomrl.platform.algorithms.config import DynamicSamplingConfig
from loomrl.platform.algorithms.dynamic_sampling import (
    DynamicBooks,
    informative,
    next_round_prompts,
    split_groups,
)
from loomrl.platform.trajectory.admission import admit_step
from loomrl.platform.trajectory.batch import Trajectory
from loomrl.platform.trajectory.store import TrajectoryStore

CFG = DynamicSamplingConfig(enabled=True, max_rounds=2)
GROUPS = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.5]]  # 1 and 3 have a spread


def test_a_group_is_informative_when_its_rewards_spread():
    assert [informative(g, CFG) for g in GROUPS] == [False, True, False, True, False]
    assert not informative([0.7], CFG)  # one sample: no spread to learn from
    wide = DynamicSamplingConfig(enabled=True, min_reward_std=0.5)  # std of [0, 1] is 0.5: not above it
    assert not informative([0.0, 1.0], wide) and informative([0.0, 2.0], wide)


def test_the_next_round_draws_the_deficit_over_the_share_kept():
    assert next_round_prompts(8, 0, 8) == 8  # nothing kept yet: a whole step
    assert next_round_prompts(8, 4, 8) == 8  # half kept: 4 missing / 0.5
    assert next_round_prompts(8, 6, 8) == 3  # 2 missing / 0.75 = 2.67 -> 3
    assert next_round_prompts(8, 7, 20) == 3  # 1 missing / 0.35
    assert next_round_prompts(8, 1, 100) == 8  # never more than a step


def test_the_step_keeps_spread_groups_and_tops_up_with_the_earliest_flat_ones():
    books = DynamicBooks()
    kept, drops = split_groups(GROUPS, CFG, 2, books)
    assert kept == [1, 3] and drops == {0: "zero_variance", 2: "zero_variance", 4: "zero_variance"}
    kept, drops = split_groups(GROUPS, CFG, 3, books)  # only two spread: the first flat one fills
    assert kept == [0, 1, 3] and drops == {2: "zero_variance", 4: "zero_variance"}
    kept, drops = split_groups(GROUPS, CFG, 1, books)  # more spread groups than the step needs
    assert kept == [1] and drops == {0: "zero_variance", 2: "zero_variance", 3: "surplus", 4: "zero_variance"}
    row = books.row()
    assert row == {
        "dynamic_groups": 15,
        "dynamic_dropped": 3 + 2 + 3,
        "dynamic_dropped_frac": 8 / 15,
        "dynamic_extra_rounds": 0.0,
        "dynamic_zero_var_trained": 1,
    }
    assert books.row()["dynamic_groups"] == 0  # a row starts the next step's counts


def test_dropped_groups_are_counted_in_the_books():
    recipe = R.load_recipe(
        "recipes/demo.yaml", ["training.prompts_per_step=2", "training.mini_batches=1", "rollout.n=2"], files=False
    )
    trajs = [
        Trajectory(f"p{g}", g, [1], [2, 3], [], [0.0, 0.0], reward, 0) for g, rs in enumerate(GROUPS) for reward in rs
    ]
    kept, drops = split_groups(GROUPS, CFG, 2, DynamicBooks())
    store = TrajectoryStore(2)
    admitted = admit_step(store, recipe, trajs, 0, drops)
    assert [[t.group for g in mb for t in g.trajectories] for mb in admitted] == [[1, 1, 3, 3]]
    for mb in admitted:
        store.mark_trained(mb)
    assert store.accounting() == {
        "generated": 10,
        "trained": 4,
        "dropped": 6,
        "pending": 0,
        "dropped_by_reason": {"zero_variance": 6},
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        (["algorithm.name=ppo"], "needs a group-advantage algorithm \\(not ppo\\)"),
        (["algorithm.name=reinforce++", "rollout.n=1"], "rollout.n >= 2 \\(got 1\\)"),
    ],
)
def test_the_recipe_refuses_what_cannot_be_filtered(extra, message):
    with pytest.raises(RecipeError, match="algorithm.dynamic_sampling.enabled: .*" + message):
        R.load_recipe("recipes/demo.yaml", ["algorithm.dynamic_sampling.enabled=true", *extra], files=False)


DYNAMIC = ["algorithm.dynamic_sampling.enabled=true", "algorithm.reward=rewards_for_tests:half_flat"]


@pytest.mark.slow
def test_colocated_rounds_fill_the_step_and_resume_exactly(tmp_path, demo_shards):
    """About half the groups have no spread: the step draws extra rounds until it holds 4 groups with
    one, trains exactly 4 x 4 trajectories, and a run resumed at step 3 equals an uninterrupted one."""
    d, _ = demo_shards
    want = check_composes(tmp_path, d, DYNAMIC)
    assert all(r["trajectories_admitted"] == 16 for r in want)
    assert all(r["dynamic_dropped"] > 0 and r["dynamic_extra_rounds"] >= 1 for r in want), want
    assert all(r["dynamic_zero_var_trained"] == 0 for r in want)  # the rounds sufficed
    assert all(r["dynamic_dropped_frac"] == r["dynamic_dropped"] / r["dynamic_groups"] for r in want)
    assert all(r["reward_std"] > 0 for r in want)
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    books = summary["trajectories"]
    assert books["generated"] == books["trained"] + books["dropped"] + books["pending"]
    assert books["dropped_by_reason"]["zero_variance"] == 4 * sum(r["dynamic_dropped"] for r in want)


@pytest.mark.slow
def test_disaggregated_mini_batch_admission_drops_flat_groups_and_balances(tmp_path, demo_shards):
    d, _ = demo_shards
    run = cli(
        tmp_path / "run",
        d,
        DYNAMIC + ["pipeline.mode=disaggregated", "pipeline.rollout_workers=1", "pipeline.admission=mini_batch"],
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    got = rows(tmp_path / "run")
    assert len(got) == 4 and sum(r["dynamic_dropped"] for r in got) > 0, got
    for r in got:
        assert r["trajectories_generated"] == (
            r["trajectories_trained"] + r["trajectories_dropped"] + r["trajectories_pending"]
        )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trajectories"]["dropped_by_reason"]["zero_variance"] > 0
