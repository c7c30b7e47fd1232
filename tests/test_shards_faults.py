"""Shards under hostile input and faults (issue 17, items 4 and 6-8): a long clip is
refused from its header by every reader, a bad sample mid-training is skipped,
counted, named and moved past, a full disk during `shards make` leaves nothing
behind, no --out pattern overwrites an existing shard, and each split has its own rejection list."""

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
        data[8 + 14 : 8 + 18] = b"\0\0\0\0"
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


def test_a_long_clip_is_refused_from_its_header_by_verify_and_training(tmp_path, model, tokenizer, capsys, loomrl_log):
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


def test_a_corrupt_sample_mid_training_is_skipped_counted_named_and_moved_past(tmp_path, model, tokenizer, loomrl_log):
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
    assert sorted(os.listdir(out)) == []  # no .tmp, no shard, no rejection list: a rerun is not blocked
    monkeypatch.undo()

    # the same when the disk fills up under the rejection list (the manifest's last line is rejected)
    import loomrl.datasets.prepare as prepare

    written[0] = 25_000
    monkeypatch.setattr(
        prepare,
        "open",
        lambda name, mode, buffering=-1: io.TextIOWrapper(io.BufferedWriter(FullDisk(name, mode)), line_buffering=True),
        raising=False,
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out}/s-rejected.jsonl: No space left on device" in err and "Traceback" not in err
    assert sorted(os.listdir(out)) == []
    monkeypatch.undo()

    assert main(argv) == 0
    assert sorted(os.listdir(out)) == [f"s-{i:04d}.tar" for i in range(4)] + ["s-rejected.jsonl"]


# --------------------------------------------------------------------------- item 8: nothing is overwritten


@pytest.mark.parametrize(
    "pattern, existing",
    [
        ("s-%s.tar", "s-0.tar"),  # a string field
        ("s-%5d.tar", "s-    0.tar"),  # a padded field
        ("s-%+d.tar", "s-+0.tar"),  # a signed field
        ("s-%e.tar", "s-0.000000e+00.tar"),
        ("s-%%-%d.tar", "s-%-0.tar"),  # a literal percent
    ],
)
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


def test_splits_share_a_folder_and_a_failed_make_can_be_retried(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["make", text_manifest(tmp_path / "a.jsonl", 2), "--out", f"{out}/train-%d.tar"]) == 0
    first = (out / "train-rejected.jsonl").read_text()
    assert "bad-line" in first
    # a second split into the same folder (the README's second command): its own rejection list
    assert main(["make", text_manifest(tmp_path / "b.jsonl", 2, bad=0), "--out", f"{out}/val-%d.tar"]) == 0
    assert (out / "train-rejected.jsonl").read_text() == first and (out / "val-rejected.jsonl").read_text() == ""
    assert list(out.glob("val-*.tar"))
    # a make that writes nothing (every line bad) leaves its list; the retry replaces it and runs
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["make", str(bad), "--out", f"{out}/test-%d.tar"]) == 1
    assert "bad-line" in (out / "test-rejected.jsonl").read_text()
    assert main(["make", text_manifest(tmp_path / "c.jsonl", 2, bad=0), "--out", f"{out}/test-%d.tar"]) == 0
    assert "replacing" in capsys.readouterr().err
    assert (out / "test-rejected.jsonl").read_text() == "" and list(out.glob("test-*.tar"))
    assert main(["make", text_manifest(tmp_path / "d.jsonl", 2, bad=0), "--out", f"{out}/test-%d.tar"]) == 2
    assert "already match" in capsys.readouterr().err  # shards written: never overwritten


# --------------------------------------------------------------------------- item 11: `shards make` option values


@pytest.mark.parametrize(
    "option, value",
    [
        ("--maxcount", "0"),
        ("--maxcount", "-3"),
        ("--sample-rate", "0"),
        ("--sample-rate", "-16000"),
        ("--max-pixels", "0"),
        ("--max-audio-seconds", "0"),
        ("--max-audio-seconds", "nan"),
        ("--max-audio-seconds", "inf"),
        ("--maxsize", "0"),
        ("--maxsize", "1e999"),
        ("--max-file-bytes", "0"),
        ("--workers", "0"),
        ("--workers", "100000"),
    ],
)
def test_make_refuses_option_values_it_cannot_work_with(tmp_path, capsys, option, value):
    """Before: --maxcount 0 was a ValueError traceback, --sample-rate 0 a ZeroDivisionError one,
    --maxsize 1e999 an OverflowError one; the others ran with the value meaning something else."""
    manifest = text_manifest(tmp_path / "m.jsonl", 2, bad=0)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["make", manifest, "--out", f"{out}/s-%d.tar", option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and "Traceback" not in err
    assert not out.exists()


def test_verify_refuses_option_values_it_cannot_work_with(tmp_path, capsys):
    for option, value in (
        ("--sample-rate", "0"),
        ("--max-pixels", "-1"),
        ("--max-member-bytes", "0"),
        ("--max-audio-seconds", "nan"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["verify", str(tmp_path / "x.tar"), option, value])
        assert exit_.value.code == 2 and f"argument {option}:" in capsys.readouterr().err


def test_make_into_a_read_only_or_unlistable_folder_is_a_clean_error(tmp_path):
    """Real permissions: run as a user they apply to (as root, without the capabilities that
    bypass them). Before: an unlistable folder was a PermissionError traceback (exit 1) from
    the check for existing shards; a read-only one already gave exit 2."""
    import shutil
    import subprocess
    import sys

    manifest = text_manifest(tmp_path / "m.jsonl", 2, bad=0)
    (tmp_path / "ro").mkdir(mode=0o555)
    (tmp_path / "nolist").mkdir(mode=0o311)
    os.chmod(tmp_path / "ro", 0o555)
    os.chmod(tmp_path / "nolist", 0o311)
    cases = {
        "ro": f"{tmp_path}/ro/s-%d.tar",
        "ro-sub": f"{tmp_path}/ro/sub/s-%d.tar",
        "nolist": f"{tmp_path}/nolist/s-%d.tar",
    }
    script = (
        "import json, os, sys\n"
        "from loomrl.datasets.cli import main\n"
        "if os.access(sys.argv[2], os.W_OK): print('PERMISSIONS-NOT-APPLIED'); sys.exit()\n"
        "cases = json.loads(sys.argv[3])\n"
        "print(json.dumps({k: main(['make', sys.argv[1], '--out', v]) for k, v in cases.items()}))\n"
    )
    cmd = [sys.executable, "-c", script, manifest, str(tmp_path / "ro"), json.dumps(cases)]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: permissions cannot be applied")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *cmd]
    try:
        run = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    finally:
        os.chmod(tmp_path / "ro", 0o755)
        os.chmod(tmp_path / "nolist", 0o755)
    if "PERMISSIONS-NOT-APPLIED" in run.stdout or "Operation not permitted" in run.stderr:
        pytest.skip("cannot drop the permission-bypassing capabilities here")
    assert "Traceback" not in run.stderr, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"ro": 2, "ro-sub": 2, "nolist": 2}
    assert f"{tmp_path}/ro/s-rejected.jsonl: Permission denied" in run.stderr
    assert f"{tmp_path}/ro/sub: Permission denied" in run.stderr
    assert f"cannot look for existing shards in {tmp_path}/nolist: Permission denied" in run.stderr
    assert os.listdir(tmp_path / "ro") == [] and os.listdir(tmp_path / "nolist") == []


# --------------------------------------------------------------------------- item 13: damaged tars pass verify


def _tar_ends(path) -> tuple[bytes, list[int], list[int]]:
    """(bytes, header offsets of each sample's first member, header offsets of every member)."""
    raw = open(path, "rb").read()
    with tarfile.open(path) as t:
        members = t.getmembers()
    return raw, [m.offset for m in members if m.name.endswith(".json")], [m.offset for m in members]


def test_a_damaged_tar_is_never_ok(tmp_path, capsys):
    """tarfile ends an archive without a word at the end of the file, at a header cut short and
    at a damaged header, and opens a file of zeros as an empty archive. Before: a shard cut at a
    sample boundary, cut before its end-of-archive blocks, with a sample's header overwritten,
    or all zeros verified "OK" (exit 0), and training read the shorter shard as whole."""
    from loomrl.datasets.shards import ShardError, read_shards
    from loomrl.datasets.stream import ShardStream

    (good,) = write_shards(demo(3), str(tmp_path / "good-%d.tar"), maxcount=10)
    raw, sample_starts, _ = _tar_ends(good)
    last_data_end = len(raw.rstrip(b"\0"))
    last_data_end += -last_data_end % 512
    damaged = {
        "cut-at-sample": (raw[: sample_starts[2]], "ends at byte"),
        "no-end-blocks": (raw[:last_data_end], "without the two zero blocks"),
        "one-end-block": (raw[: last_data_end + 512], "without the two zero blocks"),
        "header-overwritten": (
            raw[: sample_starts[1]] + b"\xff" * 512 + raw[sample_starts[1] + 512 :],
            f"damaged tar header at byte {sample_starts[1]}",
        ),
        "zeros": (bytes(10240), "has no samples"),
    }
    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    paths = {"empty": (str(tmp_path / "empty.tar"), "has no samples")}
    for name, (data, _) in damaged.items():
        (tmp_path / f"{name}.tar").write_bytes(data)
        paths[name] = (str(tmp_path / f"{name}.tar"), damaged[name][1])

    for name, (path, message) in paths.items():
        assert main(["verify", path]) == 1, name
        err = capsys.readouterr().err
        assert f"FAULT {path}: " in err and message in err and "Traceback" not in err, (name, err)
        with pytest.raises(ShardError, match=message):
            list(read_shards([path]))
        records = list(ShardStream([path], shuffle_buffer=0, epochs=1))
        assert "error" in records[-1] and message in records[-1]["error"], name
        assert records[-1]["source"] == path
    # the good samples before the damage still come, and a whole shard is still whole
    assert len(list(ShardStream([paths["cut-at-sample"][0]], shuffle_buffer=0, epochs=1))) == 2
    assert main(["verify", good]) == 0 and "3 samples in 1 shard(s): OK" in capsys.readouterr().out


def test_tar_headers_cannot_make_the_reader_read_unbounded(tmp_path):
    """A damaged size field of a pax header asks tarfile to read gigabytes (or, negative, the
    whole rest); a negative member size would make it seek backwards and read headers again."""
    from loomrl.datasets.shards import ShardError, read_shards

    long = "x" * 200 + ".json"  # a name over 100 characters: tarfile writes a pax header for it
    data = json.dumps({"id": "x", "prompt": "p"}).encode()
    ti = tarfile.TarInfo(long)
    ti.size = len(data)
    with tarfile.open(tmp_path / "pax.tar", "w", format=tarfile.PAX_FORMAT) as t:
        t.addfile(ti, io.BytesIO(data))
    raw = bytearray((tmp_path / "pax.tar").read_bytes())
    assert raw[156:157] == b"x"  # the first header is the pax header

    def with_size(field: bytes) -> str:
        out = bytearray(raw)
        out[124:136] = field
        out[148:156] = b" " * 8  # the checksum is computed over spaces in its own field
        out[148:156] = b"%06o\0 " % sum(out[:512])
        path = tmp_path / f"size-{field.hex()}.tar"
        path.write_bytes(out)
        return str(path)

    huge = with_size(b"\x80" + b"\0" * 3 + b"\x7f" * 8)  # base-256: about 2**63 bytes
    negative = with_size(b"\xff" + b"\0" * 11)  # base-256: -(2**88): "read everything"
    for path in (huge, negative):
        with pytest.raises(ShardError, match="a header asks to read"):
            list(read_shards([path]))
        assert main(["verify", path]) == 1


def test_a_deeply_nested_sample_header_is_a_fault_not_a_recursion_error(tmp_path, capsys):
    """Before: json.loads raised RecursionError, which no reader caught (a verify traceback)."""
    from loomrl.datasets.shards import ShardError, read_shards

    f = text_tar(tmp_path / "deep.tar", [])
    with tarfile.open(f, "w") as t:
        data = b"[" * 100_000
        ti = tarfile.TarInfo("s.json")
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
    with pytest.raises(ShardError, match="deep.tar:s: member json is JSON nested too deeply"):
        list(read_shards([f]))
    assert main(["verify", f]) == 1 and "nested too deeply" in capsys.readouterr().err


# --------------------------------------------------------------------------- item 14: FIFOs and devices


@pytest.fixture()
def fifos(tmp_path):
    """make(name) -> the path of a new FIFO. A reader that blocks on one (the defect) is
    released after 3 s by a writer that opens and closes it, and the test then fails on
    `released` instead of hanging the suite."""
    import threading

    made, released, stop = [], [], threading.Event()

    def release():
        if stop.wait(3.0):
            return
        while not stop.wait(0.05):
            for p in made:
                try:
                    fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)  # fails (ENXIO) unless a reader waits
                except OSError:
                    continue
                os.close(fd)
                released.append(p)

    def make(name: str) -> str:
        p = str(tmp_path / name)
        os.mkfifo(p)
        made.append(p)
        return p

    make.released = released
    watcher = threading.Thread(target=release, daemon=True)
    watcher.start()
    yield make
    stop.set()
    watcher.join()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_fifos_are_refused_by_verify_inspect_and_training_without_blocking(
    tmp_path, fifos, capsys, model, tokenizer, loomrl_log
):
    """Before: each of these blocked in open() until a writer came (forever; a SIGTERM handler
    that only sets a flag did not end it): here the fixture's writer released them after 3 s."""
    from loomrl.datasets.shards import ShardError, read_shards

    files = write_shards(demo(2), str(tmp_path / "s-%d.tar"), maxcount=10)
    fifo = fifos("s-9.tar")
    assert main(["verify", fifo, *files]) == 1
    err = capsys.readouterr().err
    assert f"FAULT {fifo}: is a FIFO (named pipe), not a regular file; only regular files are read" in err
    assert main(["inspect", fifo]) == 1
    assert f"{fifo}: is a FIFO" in capsys.readouterr().err
    with pytest.raises(ShardError, match="is a FIFO"):
        list(read_shards([fifo]))
    # training: the FIFO is named and skipped like a damaged shard; the good samples come
    source = source_over(sorted([fifo, *files]), model, tokenizer)
    assert [s.id for s in source.next(3)] == ["demo-000000", "demo-000001", "demo-000000"]
    assert source.state()["skipped"] >= 1 and f"skipping {fifo}: is a FIFO" in loomrl_log.text
    assert fifos.released == []
    if os.path.exists("/dev/zero"):  # a device: endless zeros, read before as an empty archive ("OK")
        assert main(["verify", "/dev/zero"]) == 1
        assert "/dev/zero: is a character device, not a regular file" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_fifos_are_refused_by_make_as_manifest_or_medium(tmp_path, fifos, capsys):
    """Before: a FIFO manifest was "no such manifest" (misleading); one in a manifest folder, or
    a FIFO medium, blocked the job in open() (a medium: then rejected as an empty file)."""
    out = tmp_path / "out"
    manifest = fifos("m.jsonl")
    assert main(["make", manifest, "--out", f"{out}/s-%d.tar"]) == 2
    assert f"error: {manifest}: is a FIFO (named pipe), not a regular file" in capsys.readouterr().err

    folder = tmp_path / "manifests"
    folder.mkdir()
    text_manifest(folder / "a.jsonl", 2, bad=0)
    fifos("manifests/b.jsonl")
    assert main(["make", str(folder), "--out", f"{out}/s-%d.tar"]) == 2
    assert f"error: {folder}/b.jsonl: is a FIFO (named pipe)" in capsys.readouterr().err
    assert not out.exists() or os.listdir(out) == []

    medium = fifos("clip.wav")
    lines = [{"id": "a", "prompt": "<audio> hi", "audio": ["clip.wav"]}, {"id": "b", "prompt": "text only"}]
    if os.path.exists("/dev/zero"):
        lines.append({"id": "c", "prompt": "<image> hi", "images": ["/dev/zero"]})
    (tmp_path / "media.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["make", str(tmp_path / "media.jsonl"), "--out", f"{out}/m-%d.tar"]) == 0
    err = capsys.readouterr().err
    assert "rejected id=a (" in err and f"file={medium}: unreadable-file: is a FIFO (named pipe)" in err
    if len(lines) == 3:  # outside the manifest's folder: refused before it is opened
        assert "file=/dev/zero: path-outside-source: '/dev/zero' resolves to /dev/zero" in err
        # allowed outside, the device is still never read
        assert main(["make", str(tmp_path / "media.jsonl"), "--out", f"{out}2/n-%d.tar", "--allow-outside"]) == 0
        err += capsys.readouterr().err
        assert "file=/dev/zero: unreadable-file: is a character device" in err
    assert "Traceback" not in err and fifos.released == []
