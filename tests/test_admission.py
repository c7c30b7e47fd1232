"""Admission keeps every quota: whole GRPO groups, groups per mini-batch, token budget,
staleness; train_batch waits for a whole train batch; drops are counted with a reason."""

import random

import pytest
import torch

from loomrl.commands.bench_staleness import Workload, simulate
from loomrl.commands.bench_staleness import main as bench_main
from loomrl.platform.trajectory.admission import Quota, admit, staleness
from loomrl.platform.trajectory.batch import Trajectory
from loomrl.platform.trajectory.store import TrajectoryStore

torch.set_num_threads(1)


def traj(key: str, length: int, version: int) -> Trajectory:
    return Trajectory(key, 0, [1, 2], [3] * length, [], [0.0] * length, 0.0, version)


@pytest.mark.parametrize("policy", ["train_batch", "mini_batch"])
@pytest.mark.parametrize("seed", range(6))
def test_admission_never_splits_a_group_nor_breaks_a_quota(policy, seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4])
    quota = Quota(
        groups=rng.choice([1, 2, 3]),
        mini_batches=rng.choice([1, 2, 3]),
        max_tokens=rng.choice([0, 60, 120]),
        max_staleness=rng.choice([-1, 0, 2]),
    )
    store = TrajectoryStore(n)
    version, admitted_keys = 0, set()
    # samples of many groups arrive interleaved and out of order, from several versions
    arrivals = [
        (f"g{i}", rng.randint(1, 12), rng.randint(max(0, i // 4 - 3), i // 4)) for i in range(40) for _ in range(n)
    ]
    rng.shuffle(arrivals)
    for key, length, v in arrivals:
        store.put(traj(key, length, v), key)
        batches = admit(store, policy, quota, version)
        if batches:
            assert len(batches) == (quota.mini_batches if policy == "train_batch" else 1)
        for k, groups in enumerate(batches):
            assert len(groups) == quota.groups
            for g in groups:
                assert len(g.trajectories) == n and {t.prompt_id for t in g.trajectories} == {g.key}
                assert g.key not in admitted_keys
                admitted_keys.add(g.key)
            if quota.max_tokens:
                assert sum(g.tokens for g in groups) <= quota.max_tokens
            if quota.max_staleness >= 0:
                assert max(staleness(groups, version)) <= quota.max_staleness
            store.mark_trained(groups)
            version += 1
        store.check()
    a = store.accounting()
    assert a["trained"] == len(admitted_keys) * n > 0
    assert a["generated"] == a["trained"] + a["dropped"] + a["pending"] == 40 * n
    assert all(len(g.trajectories) < n for g in store.partial.values())


def test_train_batch_waits_for_the_whole_batch_mini_batch_does_not():
    for policy, expect in (("train_batch", 0), ("mini_batch", 1)):
        store = TrajectoryStore(2)
        for key in ("a", "b", "c"):  # 3 complete groups; a train batch needs 2 x 2
            for _ in range(2):
                store.put(traj(key, 3, 0), key)
        got = admit(store, policy, Quota(groups=2, mini_batches=2), 0)
        assert len(got) == expect
        assert len(store.ready) == 3 - 2 * expect  # nothing is taken while waiting


def test_unadmittable_groups_are_dropped_with_a_reason():
    store = TrajectoryStore(2)
    for key, length, v in (("old", 2, 0), ("huge", 50, 5), ("ok1", 2, 5), ("ok2", 2, 5)):
        for _ in range(2):
            store.put(traj(key, length, v), key)
    got = admit(store, "mini_batch", Quota(groups=2, max_tokens=20, max_staleness=1), trainer_version=5)
    assert [g.key for g in got[0]] == ["ok1", "ok2"]
    assert store.dropped == {"stale": 2, "over_token_budget": 2}
    store.mark_trained(got[0])
    store.check()
    assert store.accounting()["pending"] == 0


def test_train_batch_mini_batch_k_is_at_least_k_stale_in_the_simulation():
    w = Workload(workers=2, groups_per_mini_batch=4, mini_batches=4, train_batches=2, n=2, median_len=20, max_len=200)
    tb, mb = simulate("train_batch", w, seed=1), simulate("mini_batch", w, seed=1)
    assert tb["mean_staleness"] >= (w.mini_batches - 1) / 2
    assert mb["mean_staleness"] < tb["mean_staleness"]
    for r in (tb, mb):
        r["store"].check()
        r["dispatcher"].check()


def test_bench_prints_the_json_line(capsys):
    assert (
        bench_main(
            [
                "--json",
                "--workers",
                "2",
                "--groups-per-mini-batch",
                "4",
                "--mini-batches",
                "4",
                "--train-batches",
                "1",
                "--n",
                "2",
                "--median-len",
                "20",
            ]
        )
        == 0
    )
    import json

    line = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(line)
    assert set(out) >= {"train_batch", "mini_batch", "staleness_reduction", "bytes_per_mini_batch"}
    assert set(out["mini_batch"]) >= {"mean_staleness", "trainer_idle_frac"}
    assert out["bytes_per_mini_batch"]["no_dedup"] > out["bytes_per_mini_batch"]["dedup"]
