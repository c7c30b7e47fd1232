import io
import json
import tarfile

import pytest

from loomrl.datasets.shards import read_shards
from loomrl.platform.rewards import exact_match, slot_match


def test_demo_shards_round_trip(demo_shards):
    d, files = demo_shards
    assert [f.rsplit("/", 1)[1] for f in files] == ["demo-000000.tar", "demo-000001.tar", "demo-000002.tar"]
    assert not list(d.glob("*.tmp"))
    samples = list(read_shards(files))
    assert len(samples) == 24
    kinds = {s["meta"]["task"]: [k for k, _, _ in s["media"]] for s in samples}
    assert kinds == {"image": ["image"], "audio": ["audio"], "both": ["image", "audio"]}
    for s in samples:
        assert len(s["answer"].split()) >= 8
        assert slot_match(s["answer"], s) == 1.0 and exact_match(s["answer"], s) == 1.0


def test_tampered_member_is_named(demo_shards, tmp_path):
    _, files = demo_shards
    bad = tmp_path / "bad.tar"
    with tarfile.open(files[0]) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name.endswith(".png"):
                data = data[:-10] + b"0123456789"
            m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    with pytest.raises(ValueError, match=r"bad.tar:demo-000000: member img0.png does not match its sha256"):
        list(read_shards([str(bad)]))


def test_slot_match_scores():
    s = {
        "meta": {
            "template": "a {size} {color} shape is shown while a {pitch} tone plays .",
            "slots": {"size": "small", "color": "red", "pitch": "low"},
        },
        "answer": "",
    }
    assert slot_match("a small red shape is shown while a low tone plays .", s) == 1.0
    assert slot_match("a large red shape is shown while a high tone plays .", s) == pytest.approx(1 / 3)
    assert slot_match("a small red shape is shown while a low tone .", s) == 0.0
    assert slot_match("a small red thing is shown while a low tone plays .", s) == 0.0
    json.dumps(s)


def test_demo_shards_are_shards_make_shards(demo_shards, capsys):
    """The demo goes through the same writer as `loomrl shards make`: verify and inspect accept it."""
    from loomrl.datasets.cli import main

    _, files = demo_shards
    assert main(["verify", *files]) == 0
    assert main(["inspect", "--json", *files]) == 0
    stats = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    samples = list(read_shards(files))
    assert stats["samples"] == len(samples) == 24
    assert stats["media_total"] == sum(len(s["media"]) for s in samples)
