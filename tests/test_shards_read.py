"""The shard writer's guarantees and the reader's guards against hostile or damaged tars."""

import gzip
import io
import json
import os
import pickle
import tarfile

import pytest
import webdataset as wds

from loomrl.datasets.cli import main
from loomrl.datasets.demo import make_sample
from loomrl.datasets.shards import ShardError, read_shards, shard_key, write_shards


def tar_with(path, members):
    """A tar of (TarInfo or name, bytes) written with tarfile, bypassing our writer."""
    with tarfile.open(path, "w") as t:
        for m, data in members:
            ti = m if isinstance(m, tarfile.TarInfo) else tarfile.TarInfo(m)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    return str(path)


def header(sample_id, media=()):
    return json.dumps({"id": sample_id, "prompt": "<image> x", "media": list(media)}).encode()


@pytest.fixture()
def demo_samples():
    import random

    rng = random.Random(5)
    return [make_sample(i, rng) for i in range(6)]


def test_writer_is_deterministic_and_bounds_shard_bytes(demo_samples, tmp_path):
    a = write_shards(demo_samples, str(tmp_path / "a" / "s-%04d.tar"), maxcount=100, maxsize=40_000)
    b = write_shards(demo_samples, str(tmp_path / "b" / "s-%04d.tar"), maxcount=100, maxsize=40_000)
    assert len(a) > 1
    assert [open(f, "rb").read() for f in a] == [open(f, "rb").read() for f in b]  # same samples, same bytes
    for f in a:
        n = sum(1 for _ in read_shards([f]))
        assert os.path.getsize(f) <= 40_000 or n == 1
    assert [s["id"] for s in read_shards(a)] == [s["id"] for s in demo_samples]


def test_writer_refuses_bad_input_and_leaves_no_shard(demo_samples, tmp_path):
    with pytest.raises(ValueError, match="printf number field"):
        write_shards(demo_samples, str(tmp_path / "x.tar"), maxcount=2)
    with pytest.raises(ValueError, match="duplicate sample key"):
        write_shards(demo_samples + demo_samples[:1], str(tmp_path / "d-%d.tar"), maxcount=2)
    with pytest.raises(ValueError, match="bad member name"):
        write_shards(
            [{"id": "a", "prompt": "p", "media": [("image", "../x.png", b"1")]}], str(tmp_path / "m-%d.tar"), maxcount=2
        )
    assert os.listdir(tmp_path) == []  # nothing left behind, not even .tmp files


def test_unsafe_ids_get_safe_keys_that_stock_webdataset_reads(tmp_path):
    ids = ["a.b/c", "__meta__", "x" * 300, "ok-id_1"]
    files = write_shards([{"id": i, "prompt": "p", "media": []} for i in ids], str(tmp_path / "k-%d.tar"), 10)
    assert [s["id"] for s in read_shards(files)] == ids
    stock = list(wds.WebDataset(files, shardshuffle=False, empty_check=False))
    assert [json.loads(r["json"])["id"] for r in stock] == ids
    assert shard_key("ok-id_1") == "ok-id_1" and shard_key("a.b/c") != shard_key("a_b_c")


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("../evil.json", header("evil"), r"member '\.\./evil\.json' has a '\.\.' path component"),
        ("x/../../evil.json", header("evil"), r"member 'x/\.\./\.\./evil\.json' has a '\.\.' path component"),
        ("/etc/evil.json", header("evil"), r"member '/etc/evil\.json' has an absolute path"),
        ("noext", b"1", r"member noext has no extension"),
    ],
)
def test_hostile_names_are_refused_naming_shard_and_member(tmp_path, name, data, message, capsys):
    f = tar_with(tmp_path / "hostile.tar", [("good.json", header("good")), (name, data)])
    with pytest.raises(ShardError, match=r"hostile\.tar: " + message):
        list(read_shards([f]))
    assert main(["verify", f]) == 1
    assert "hostile.tar" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kind, message",
    [
        (tarfile.SYMTYPE, "is a link"),
        (tarfile.LNKTYPE, "is a link"),
        (tarfile.CHRTYPE, "is not a regular file"),
        (tarfile.FIFOTYPE, "is not a regular file"),
    ],
)
def test_links_and_devices_are_refused(tmp_path, kind, message):
    ti = tarfile.TarInfo("s.img0.png")
    ti.type, ti.linkname = kind, "/etc/passwd"
    f = tar_with(tmp_path / "links.tar", [("s.json", header("s")), (ti, b"")])
    with pytest.raises(ShardError, match=f"links.tar: member s.img0.png {message}"):
        list(read_shards([f]))


def test_member_size_is_bounded_before_reading(tmp_path):
    f = tar_with(tmp_path / "big.tar", [("s.json", header("s")), ("s.img0.png", b"\0" * 5000)])
    with pytest.raises(ShardError, match="member s.img0.png is 5000 bytes, over the limit of 4096"):
        list(read_shards([f], max_member_bytes=4096))
    assert len(list(read_shards([f]))) == 1  # the default limit is far higher
    assert main(["verify", f, "--max-member-bytes", "4KiB"]) == 1


def test_nothing_is_unpickled(tmp_path, demo_samples):
    """A .pyd member holding a pickle that would create a file when loaded is never loaded."""
    proof = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(proof), "w"))

    f = write_shards(demo_samples[:1], str(tmp_path / "p-%d.tar"), 10)[0]
    key = demo_samples[0]["id"]
    with tarfile.open(f) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    f = tar_with(tmp_path / "pickle.tar", members + [(f"{key}.pyd", pickle.dumps(Payload()))])
    (s,) = list(read_shards([f]))
    assert s["id"] == key
    from loomrl.datasets.stream import ShardStream

    assert [r["id"] for r in ShardStream(f, epochs=1)] == [key]
    assert main(["verify", f]) == 0 and main(["inspect", f]) == 0
    assert not proof.exists()


def test_damaged_shards_name_the_fault(tmp_path, demo_samples, capsys):
    f = write_shards(demo_samples, str(tmp_path / "ok-%d.tar"), 10)[0]
    raw = open(f, "rb").read()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(raw[: len(raw) // 2 + 100])
    with pytest.raises(ShardError, match="cut.tar"):
        list(read_shards([str(cut)]))
    gz = tmp_path / "gz.tar"
    gz.write_bytes(gzip.compress(raw))
    with pytest.raises(ShardError, match="gz.tar: is not a readable uncompressed tar"):
        list(read_shards([str(gz)]))
    with pytest.raises(ShardError, match="nope.tar: does not exist"):
        list(read_shards([str(tmp_path / "nope.tar")]))
    assert main(["verify", str(cut), str(gz)]) == 1
    err = capsys.readouterr().err
    assert "FAULT" in err and "cut.tar: is damaged after" in err and "gz.tar: is not a readable" in err
    assert main(["verify", f]) == 0


def test_verify_reports_every_fault_and_goes_on(tmp_path, demo_samples, capsys):
    bad_media = [
        {"id": "not-image", "prompt": "<image> x", "media": [("image", "img0.png", b"not a png")]},
        {"id": "not-audio", "prompt": "<audio> x", "media": [("audio", "aud0.wav", b"RIFF....")]},
    ]
    files = write_shards(demo_samples[:2] + bad_media, str(tmp_path / "v-%d.tar"), 10)
    files += write_shards(demo_samples[:1], str(tmp_path / "w-%d.tar"), 10)  # a duplicate id in another shard
    # a member listed in the header but missing, and one whose bytes were altered
    key = demo_samples[0]["id"]
    with tarfile.open(files[0]) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    altered = []
    for m, data in members:
        if m.name == f"{key}.img0.png":
            continue  # drop it
        if m.name.startswith(demo_samples[1]["id"] + ".") and not m.name.endswith(".json"):
            data = data[:-4] + b"\0\0\0\0"
        altered.append((m, data))
    files.append(tar_with(tmp_path / "x-0.tar", altered))
    assert main(["verify", *files]) == 1
    err = capsys.readouterr().err
    assert "v-0.tar:not-image: member img0.png does not decode as image" in err
    assert "v-0.tar:not-audio: member aud0.wav does not decode as audio" in err
    assert f"w-0.tar:{key}: duplicate sample key, first seen at" in err
    assert f"x-0.tar:{key}: member img0.png is missing" in err
    assert f"x-0.tar:{demo_samples[1]['id']}: member" in err and "does not match its sha256" in err
    assert main(["verify", files[1]]) == 0


def test_verify_and_inspect_usage(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "none-*.tar")]) == 2
    assert main(["inspect", str(tmp_path / "none-*.tar")]) == 2
    assert "no shards match" in capsys.readouterr().err
