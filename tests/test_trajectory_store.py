"""The trajectory store's accounting and media, the dispatcher under worker deaths, and
the role-to-role message format."""

import pytest
import torch

from loomrl.commands.bench_staleness import Workload, simulate
from loomrl.encoders.media import Medium
from loomrl.platform.trajectory.batch import Trajectory
from loomrl.platform.trajectory.dispatch import Dispatcher, Job
from loomrl.platform.trajectory.store import TrajectoryStore
from loomrl.platform.trajectory.transport import DTYPES, MediaLedger, pack, unpack, unpack_media

torch.set_num_threads(1)


def medium(h: str, n: int = 10) -> Medium:
    return Medium("image", h, torch.arange(n, dtype=torch.float32), torch.tensor([1, 2, 2]), "prep")


def test_media_are_stored_once_per_content_key_and_released_after_training():
    store = TrajectoryStore(3)
    img = medium("img")
    for i in range(3):
        copy = Medium("image", "img", img.features.clone(), img.grid, "prep")  # same content, another object
        store.put(Trajectory("p", 0, [1], [2, 3], [copy], [0.0, 0.0], 1.0, 0), "p")
    (g,) = store.ready
    assert len(store.media) == 1 and len({id(t.media[0]) for t in g.trajectories}) == 1
    assert store.media_bytes_naive == 3 * store.media_bytes_stored == 3 * 40
    store.take([g])
    store.mark_trained([g])
    assert store.media == {} and store.accounting() == {
        "generated": 3,
        "trained": 3,
        "dropped": 0,
        "pending": 0,
        "dropped_by_reason": {},
    }


def test_a_complete_group_cannot_grow_and_imbalance_is_caught():
    store = TrajectoryStore(1)
    store.put(Trajectory("p", 0, [1], [2], [], [0.0], 0.0, 0), "p")
    with pytest.raises(ValueError, match="already complete"):
        store.put(Trajectory("p", 0, [1], [2], [], [0.0], 0.0, 0), "p")
    store.trained += 1  # a trajectory counted twice
    with pytest.raises(AssertionError, match="does not balance"):
        store.check()


@pytest.mark.parametrize("policy", ["train_batch", "mini_batch"])
def test_accounting_balances_after_injected_worker_deaths(policy):
    w = Workload(workers=4, groups_per_mini_batch=4, mini_batches=2, train_batches=6, n=4, median_len=30, max_len=400)
    res = simulate(policy, w, seed=3, deaths={1: 500.0, 3: 1500.0})
    store, disp = res["store"], res["dispatcher"]
    assert set(disp.dead) == {1, 3}
    assert disp.requeue_count >= 1  # each died with a prompt in flight
    store.check()
    disp.check()
    a = store.accounting()
    assert a["generated"] == a["trained"] + a["dropped"] + a["pending"]
    assert a["trained"] == res["optimizer_steps"] * w.groups_per_mini_batch * w.n
    # no prompt is lost with its worker: each is done once, in flight, or waiting to be re-sent
    assert res["prompts_created"] == disp.completed + disp.outstanding + len(disp.requeued)


def test_dispatcher_requeues_a_dead_workers_prompts_first():
    d = Dispatcher()
    fresh_ids = iter(range(100))
    fresh = lambda k: [Job(f"p{next(fresh_ids)}", None) for _ in range(k)]  # noqa: E731
    d.assign(0, d.next_jobs(2, fresh))
    d.assign(1, d.next_jobs(1, fresh))
    d.complete(0, "p0")
    lost = d.worker_died(0, "killed")
    assert [j.key for j in lost] == ["p1"]
    again = d.next_jobs(2, fresh)
    assert [j.key for j in again] == ["p1", "p3"] and again[0].attempts == 1
    d.assign(1, again)
    assert again[0].attempts == 2
    d.check()
    with pytest.raises(ValueError, match="dead"):
        d.assign(0, fresh(1))
    with pytest.raises(ValueError, match="not given"):
        d.complete(1, "p0")


def test_messages_round_trip_without_pickle():
    tensors = {
        name: (torch.randn(3, 2) * 100).to(dt) if dt.is_floating_point else torch.arange(6).to(dt).view(3, 2)
        for name, dt in DTYPES.items()
    }
    tensors["empty"] = torch.zeros(0, 4)
    meta = {"kind": "result", "ids": [1, 2, 3], "logp": [-0.1234567890123, -2.5]}
    got_meta, got = unpack(pack(meta, tensors))
    assert got_meta == meta
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    bad = pack({"x": 1}, {"t": torch.zeros(2)})
    bad[:8] = torch.tensor([10**9], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(ValueError, match="header length"):
        unpack(bad)


def test_media_cross_once_per_peer():
    ledger, known = MediaLedger(), {}
    a, b = medium("a"), medium("b", 20)
    refs, tensors = ledger.pack_media(1, [a, b, a])
    assert len(tensors) == 4  # features + grid of a and b once
    first = unpack_media(refs, *unpack(pack({}, tensors))[1:], known)
    assert [m.hash for m in first] == ["a", "b", "a"] and torch.equal(first[1].features, b.features)
    refs2, tensors2 = ledger.pack_media(1, [b])
    assert tensors2 == {}  # the peer has it
    assert unpack_media(refs2, {}, known)[0] is first[1]
    assert ledger.pack_media(2, [b])[1]  # another peer gets the bytes
    with pytest.raises(ValueError, match="never sent"):
        unpack_media([{"kind": "image", "hash": "zz", "prep": "p"}], {}, {})
