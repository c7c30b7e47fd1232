"""The streaming reader: shuffle buffer, rank/worker split, resumable position."""

import hashlib
import itertools
import json

import pytest
import torch

from loomrl.datasets.demo import write_demo_shards
from loomrl.datasets.shards import read_shards
from loomrl.datasets.stream import ShardStream

N = 45


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    files = write_demo_shards(str(d), samples=N, samples_per_shard=7, seed=3)  # 7 shards, the last one short
    return str(d / "demo-*.tar"), files, [s["id"] for s in read_shards(files)]


def ids(records):
    return [r["id"] for r in records]


def test_epochs_cover_every_sample_once_in_a_shuffled_order(shards):
    pattern, files, in_order = shards
    full = ids(ShardStream(pattern, shuffle_buffer=10, seed=1, epochs=2))
    first, second = full[:N], full[N:]
    assert len(full) == 2 * N and sorted(first) == sorted(second) == sorted(in_order)
    assert first != in_order and second != first  # shuffled, and differently each epoch
    assert ids(ShardStream(files, shuffle_buffer=0, epochs=1)) == in_order  # 0 = shard order
    assert ids(ShardStream(pattern, shuffle_buffer=10, seed=1, epochs=2)) == full  # deterministic
    assert ids(ShardStream(pattern, shuffle_buffer=10, seed=2, epochs=1)) != first
    # a buffer larger than the data: the end-of-epoch flush alone must shuffle
    one = ids(ShardStream(files[:1], shuffle_buffer=100, seed=1, epochs=1))
    assert sorted(one) == sorted(in_order[:7]) and one != in_order[:7]


def test_records_have_the_reader_shape_and_verified_media(shards):
    pattern, _, _ = shards
    for r in itertools.islice(ShardStream(pattern, shuffle_buffer=10), 5):
        assert set(r) == {"id", "prompt", "answer", "meta", "media", "source", "position"}
        for kind, sha, data in r["media"]:
            assert kind in ("image", "audio") and hashlib.sha256(data).hexdigest() == sha


@pytest.mark.parametrize("cut", [0, 1, 9, 23, N - 1, N, N + 16, 2 * N - 1])
def test_resume_yields_exactly_the_unseen_samples_in_order(shards, cut):
    pattern, _, _ = shards
    settings = dict(shuffle_buffer=10, seed=1, epochs=2)
    full = ids(ShardStream(pattern, **settings))
    first = ShardStream(pattern, **settings)
    seen = ids(itertools.islice(first, cut))
    state = json.loads(json.dumps(first.state()))  # what a checkpoint stores
    assert set(state) == {"epoch", "index", "fingerprint"}
    resumed = ShardStream(pattern, **settings)
    resumed.load_state(state)
    assert seen + ids(resumed) == full


def test_ranks_split_the_data_evenly_and_disjointly(shards):
    pattern, _, in_order = shards
    parts = [ids(ShardStream(pattern, shuffle_buffer=5, seed=4, rank=r, world_size=3, epochs=1)) for r in range(3)]
    assert sorted(sum(parts, [])) == sorted(in_order)
    assert [len(p) for p in parts] == [15, 15, 15]
    with pytest.raises(ValueError, match="rank 3 is not in 0..2"):
        ShardStream(pattern, rank=3, world_size=3)


def test_dataloader_workers_keep_the_order_and_resume(shards):
    pattern, _, _ = shards
    settings = dict(shuffle_buffer=10, seed=1, epochs=2)
    full = ids(ShardStream(pattern, **settings))

    def loader(stream):
        return torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)

    assert ids(loader(ShardStream(pattern, **settings))) == full
    stream = ShardStream(pattern, **settings)
    seen = []
    for r in loader(stream):
        seen.append(r["id"])
        if len(seen) == 31:
            state = stream.state_after(r)  # workers' copies are out of reach: the record carries its position
            break
    resumed = ShardStream(pattern, **settings)
    resumed.load_state(state)
    assert seen + ids(loader(resumed)) == full


def test_a_position_only_fits_the_same_shards_and_settings(shards):
    pattern, files, _ = shards
    state = ShardStream(pattern, shuffle_buffer=10, seed=1).state()
    for other in (
        ShardStream(pattern, shuffle_buffer=20, seed=1),
        ShardStream(pattern, shuffle_buffer=10, seed=2),
        ShardStream(files[:-1], shuffle_buffer=10, seed=1),
        ShardStream(pattern, shuffle_buffer=10, seed=1, rank=1, world_size=2),
    ):
        with pytest.raises(ValueError, match="does not fit"):
            other.load_state(state)
    with pytest.raises(FileNotFoundError, match="no shards match"):
        ShardStream(pattern + ".nothing")


def test_prompt_source_skips_and_counts_bad_samples_and_resumes(tmp_path, tokenizer, model, loomrl_log):
    """The runner's source: a sample whose media do not decode is skipped and counted;
    a source resumed from its state serves exactly the samples an uninterrupted one would."""
    import random as _random

    from loomrl.datasets.demo import make_sample
    from loomrl.datasets.shards import write_shards
    from loomrl.datasets.source import PromptSource
    from loomrl.datasets.stream import ShardStream
    from loomrl.platform.recipe import ModelConfig

    rng = _random.Random(0)
    samples = [make_sample(i, rng) for i in range(12)]
    kind, member, _ = samples[3]["media"][0]
    samples[3]["media"][0] = (kind, member, b"these bytes are no picture")
    files = write_shards(samples, str(tmp_path / "s-%06d.tar"), maxcount=5)

    def source():
        return PromptSource(ShardStream(files, shuffle_buffer=4, seed=3), model, tokenizer, ModelConfig())

    full = source()
    ids = [s.id for s in full.next(11) + full.next(11)]
    assert len(full.skipped) == 2 and "demo-000003" in full.skipped[0][0]  # once per epoch
    assert "skipping" in loomrl_log.text and ids.count("demo-000003") == 0
    first = source()
    head = [s.id for s in first.next(7)]
    resumed = source()
    resumed.load_state(first.state())
    assert head + [s.id for s in resumed.next(15)] == ids
