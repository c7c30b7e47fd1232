"""Shards under hostile input and faults (issue 17, items 4 and 6-8): a long clip is
refused from its header by every reader, a bad sample mid-training is skipped,
counted, named and moved past, a full disk during `shards make` leaves nothing
behind, and no --out pattern overwrites an existing shard or rejected.jsonl."""
import errno
import io
import json
import os
import random
import tarfile

import numpy as np
import pytest
import soundfile as sf

from loomrl.datasets.cli import main
from loomrl.datasets.demo import make_sample
from loomrl.datasets.shards import write_shards


def silent_flac(seconds: float, rate: int = 8000, unknown_length: bool = False) -> bytes:
    """A FLAC of silence: a few KB that decode to `seconds` of audio. With
    unknown_length the header's sample count is 0 ("unknown"), as a streaming encoder writes it."""
    buf = io.BytesIO()
    block = np.zeros(rate * 60, dtype=np.int16)
    with sf.SoundFile(buf, "w", samplerate=rate, channels=1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(int(seconds // 60)):
            f.write(block)
        f.write(block[: int(seconds % 60 * rate)])
    data = bytearray(buf.getvalue())
    if unknown_length:  # STREAMINFO follows "fLaC" and a 4-byte block header; total samples: 36 bits at 13.5
        data[8 + 13] &= 0xF0
        data[8 + 14: 8 + 18] = b"\0\0\0\0"
    return bytes(data)


def demo(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [make_sample(i, rng) for i in range(n)]


def source_over(files, model, tokenizer, **kw):
    from loomrl.datasets.source import PromptSource
    from loomrl.datasets.stream import ShardStream
    from loomrl.platform.recipe import ModelConfig

    return PromptSource(ShardStream(files, shuffle_buffer=0, **kw), model, tokenizer, ModelConfig())


# --------------------------------------------------------------------------- item 4: audio bombs at read time


def test_a_long_clip_is_refused_from_its_header_by_verify_and_training(tmp_path, model, tokenizer, capsys,
                                                                       loomrl_log):
    """10 minutes of silence is 14 KB of FLAC: `shards make` refuses it, and so must the
    readers of shards someone else made (verify, training), before decoding it."""
    samples = demo(3)
    samples[1]["media"] = [("audio", "aud0.flac", silent_flac(600))]  # demo-000001 is an audio sample
    files = write_shards(samples, str(tmp_path / "s-%d.tar"), maxcount=10)
    assert main(["verify", *files]) == 1
    err = capsys.readouterr().err
    assert "s-0.tar:demo-000001: member aud0.flac" in err and "600.0 s is over the limit of 60 s" in err
    assert "Traceback" not in err
    source = source_over(files, model, tokenizer)
    assert [s.id for s in source.next(2)] == ["demo-000000", "demo-000002"]
    assert source.state()["skipped"] == 1
    assert "demo-000001" in loomrl_log.text and "over the limit" in loomrl_log.text


# --------------------------------------------------------------------------- item 6: a bad sample mid-training


def corrupt(shard: str, member: str) -> None:
    """Overwrite 8 bytes in the middle of a member's data, in place (its sha256 no longer matches)."""
    with tarfile.open(shard) as t:
        ti = t.getmember(member)
    with open(shard, "r+b") as f:
        f.seek(ti.offset_data + ti.size // 2)
        f.write(b"\xa5" * 8)


def test_a_corrupt_sample_mid_training_is_skipped_counted_named_and_moved_past(tmp_path, model, tokenizer,
                                                                                loomrl_log):
    files = write_shards(demo(9), str(tmp_path / "s-%06d.tar"), maxcount=4)
    corrupt(files[1], "demo-000005.aud0.wav")
    good = [f"demo-{i:06d}" for i in range(9) if i != 5]

    run = source_over(files, model, tokenizer)
    assert [s.id for s in run.next(5)] == good[:5]
    assert [s.id for s in run.next(1)] == ["demo-000006"]  # reads demo-000005, skips it, goes on
    state = run.state()
    assert state["skipped"] == 1 and state["index"] == 7  # the position counts the bad sample as read
    (msg,) = [r.getMessage() for r in loomrl_log.records if "demo-000005" in r.getMessage()]
    assert "s-000001.tar:demo-000005" in msg and "aud0.wav does not match its sha256" in msg
    assert "Traceback" not in loomrl_log.text

    # a checkpoint taken after the bad sample never meets it again; one taken before skips it again
    loomrl_log.clear()
    later = source_over(files, model, tokenizer)
    later.load_state(state)
    assert [s.id for s in later.next(2)] == good[6:]
    assert later.state()["skipped"] == 1 and later.skipped == [] and loomrl_log.records == []
    early = source_over(files, model, tokenizer)
    early.next(4)
    again = source_over(files, model, tokenizer)
    again.load_state(early.state())
    assert [s.id for s in again.next(4)] == good[4:] and again.state()["skipped"] == 1


def text_tar(path, names):
    """A tar of text-only sample headers, written with tarfile (bypassing our writer)."""
    with tarfile.open(path, "w") as t:
        for name in names:
            data = json.dumps({"id": name.split(".")[0], "prompt": "say hello"}).encode()
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    return str(path)


def test_a_shard_damaged_mid_way_loses_only_its_rest(tmp_path):
    from loomrl.datasets.stream import ShardStream

    bad = text_tar(tmp_path / "a-0.tar", ["a.json", "b.json", "a.json", "c.json"])  # a reappears: a fault
    ok = text_tar(tmp_path / "a-1.tar", ["d.json", "e.json"])
    records = list(ShardStream([bad, ok], shuffle_buffer=0, epochs=1))
    assert [r.get("id") for r in records] == ["a", "b", None, "d", "e"]
    assert "reappears after other samples" in records[2]["error"] and records[2]["source"] == f"{bad}:a"
    assert [r["position"] for r in records] == [(0, i) for i in range(5)]
    # ranks split the fault like any sample: exactly one rank sees it
    split = [list(ShardStream([bad, ok], shuffle_buffer=0, epochs=1, rank=k, world_size=2)) for k in (0, 1)]
    assert sum("error" in r for part in split for r in part) == 1


def test_a_source_with_no_usable_sample_stops_instead_of_spinning(tmp_path, model, tokenizer):
    files = write_shards(demo(2), str(tmp_path / "s-%d.tar"), maxcount=4)
    corrupt(files[0], "demo-000000.img0.png")
    corrupt(files[0], "demo-000001.aud0.wav")
    from loomrl.platform.recipe import RecipeError

    with pytest.raises(RecipeError, match="data.shards: no usable sample in a whole epoch"):  # exit 2, a message
        source_over(files, model, tokenizer).next(1)


# --------------------------------------------------------------------------- item 7: disk full during make


def text_manifest(path, n: int, bad: int = 1) -> str:
    lines = [json.dumps({"id": f"t{i}", "prompt": f"text prompt number {i}", "answer": "x"}) for i in range(n)]
    lines += ["{not json"] * bad
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_disk_full_during_make_is_a_clean_error_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    manifest = text_manifest(tmp_path / "m.jsonl", 12)
    out = tmp_path / "out"
    written = [0]

    class FullDisk(io.FileIO):
        """A file on a disk that fills up after 25 KB (two shards in): every later write fails, the close's too."""

        def write(self, b):
            if written[0] + len(b) > 25_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written[0] += len(b)
            return super().write(b)

    monkeypatch.setattr(tarfile, "bltn_open", lambda name, mode="r", *a, **k: FullDisk(name, mode))
    argv = ["make", manifest, "--out", f"{out}/s-%04d.tar", "--maxcount", "3", "--workers", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(out) in err and "Traceback" not in err
    assert sorted(os.listdir(out)) == []  # no .tmp, no shard, no rejected.jsonl: a rerun is not blocked
    monkeypatch.undo()

    # the same when the disk fills up under rejected.jsonl (the manifest's last line is rejected)
    import loomrl.datasets.prepare as prepare

    written[0] = 25_000
    monkeypatch.setattr(prepare, "open", lambda name, mode, buffering=-1: io.TextIOWrapper(
        io.BufferedWriter(FullDisk(name, mode)), line_buffering=True), raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out}/rejected.jsonl: No space left on device" in err and "Traceback" not in err
    assert sorted(os.listdir(out)) == []
    monkeypatch.undo()

    assert main(argv) == 0
    assert sorted(os.listdir(out)) == ["rejected.jsonl"] + [f"s-{i:04d}.tar" for i in range(4)]


# --------------------------------------------------------------------------- item 8: nothing is overwritten


@pytest.mark.parametrize("pattern, existing", [
    ("s-%s.tar", "s-0.tar"),      # a string field
    ("s-%5d.tar", "s-    0.tar"),  # a padded field
    ("s-%+d.tar", "s-+0.tar"),    # a signed field
    ("s-%e.tar", "s-0.000000e+00.tar"),
    ("s-%%-%d.tar", "s-%-0.tar"),  # a literal percent
])
def test_no_out_pattern_overwrites_an_existing_shard(tmp_path, capsys, pattern, existing):
    manifest = text_manifest(tmp_path / "m.jsonl", 2, bad=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / existing).write_bytes(b"precious")
    assert main(["make", manifest, "--out", f"{out}/{pattern}"]) == 2
    assert "--out" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == [existing] and (out / existing).read_bytes() == b"precious"


def test_the_writer_itself_never_replaces_a_shard(tmp_path):
    """Even past the command's check (another job, a race): the last step refuses, and rolls back."""
    (tmp_path / "s-1.tar").write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="s-1.tar"):
        write_shards(demo(4), str(tmp_path / "s-%d.tar"), maxcount=2)
    assert sorted(os.listdir(tmp_path)) == ["s-1.tar"] and (tmp_path / "s-1.tar").read_bytes() == b"precious"


def test_rejected_jsonl_of_an_earlier_make_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["make", text_manifest(tmp_path / "a.jsonl", 2), "--out", f"{out}/train-%d.tar"]) == 0
    first = (out / "rejected.jsonl").read_text()
    assert "bad-line" in first
    assert main(["make", text_manifest(tmp_path / "b.jsonl", 2, bad=0), "--out", f"{out}/val-%d.tar"]) == 2
    assert "rejected.jsonl" in capsys.readouterr().err
    assert (out / "rejected.jsonl").read_text() == first and not list(out.glob("val-*"))
