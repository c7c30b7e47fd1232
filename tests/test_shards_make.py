"""`loomrl shards make | verify | inspect` on real photos and speech, mixed with
corrupt and hostile files made here.

Real media: scikit-image's bundled photos (the `dev` extra) and Debian
alsa-utils' spoken clips (/usr/share/sounds/alsa). Without them these tests
skip, saying why; with LOOMRL_REQUIRE_REAL_MEDIA=1 (CI) they fail instead.
"""

import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from loomrl.datasets.cli import main
from loomrl.datasets.shards import read_shards

ALSA = Path("/usr/share/sounds/alsa")
REQUIRE = os.environ.get("LOOMRL_REQUIRE_REAL_MEDIA") == "1"
MAX_AUDIO_SECONDS = 5.0


def skimage_data() -> Path | None:
    try:
        import skimage
    except ImportError:
        return None
    d = Path(skimage.__file__).parent / "data"
    return d if (d / "astronaut.png").exists() else None


def png(width: int, height: int, pixels: bytes = b"\0" * 1000) -> bytes:
    """A PNG whose header claims width x height but whose data is tiny: a decompression bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b"")


def missing_real_media() -> list[str]:
    missing = []
    if skimage_data() is None:
        missing.append("scikit-image's photos (pip install scikit-image; it is in the dev extra)")
    if not (ALSA / "Front_Center.wav").exists():
        missing.append(f"{ALSA}/*.wav (apt-get install -y alsa-utils)")
    return missing


MISSING = missing_real_media()
# Skipped only outside CI; with LOOMRL_REQUIRE_REAL_MEDIA=1 the `real` fixture fails instead.
needs_real_media = pytest.mark.skipif(
    bool(MISSING) and not REQUIRE, reason="real test media missing: " + "; ".join(MISSING)
)


@pytest.fixture(scope="module")
def real():
    if MISSING:
        pytest.fail(
            "real test media missing: " + "; ".join(MISSING) + " and LOOMRL_REQUIRE_REAL_MEDIA=1 says they must be here"
        )
    return skimage_data()


@pytest.fixture(scope="module")
def job(real, tmp_path_factory):
    """A manifest of good and bad samples, and `shards make` run on it once."""
    root = tmp_path_factory.mktemp("make")
    m = root / "media"
    m.mkdir()
    for name in ("astronaut.png", "camera.png", "rocket.jpg", "logo.png"):
        shutil.copy(real / name, m / name)
    from PIL import Image

    Image.open(real / "chelsea.png").save(m / "chelsea.bmp")
    shutil.copy(ALSA / "Front_Center.wav", m / "front_center.wav")
    shutil.copy(ALSA / "Front_Left.wav", m / "front_left.wav")
    left, sr = sf.read(ALSA / "Front_Right.wav", dtype="float32")
    right, _ = sf.read(ALSA / "Rear_Left.wav", dtype="float32")
    n = min(len(left), len(right))
    stereo = np.stack([left[:n], right[:n]], axis=1)
    import torch
    import torchaudio.functional as AF

    stereo44 = AF.resample(torch.from_numpy(stereo.T.copy()), sr, 44100).numpy().T
    sf.write(m / "stereo44k.wav", stereo44, 44100, subtype="PCM_16")
    # corrupt and hostile inputs
    (m / "truncated.png").write_bytes((real / "coffee.png").read_bytes()[:20000])
    (m / "text.jpg").write_text("this is not a JPEG, just text with a .jpg name\n")
    (m / "zero.wav").write_bytes(b"")
    sf.write(m / "no_frames.wav", np.zeros(0, dtype=np.float32), 16000)
    (m / "bomb.png").write_bytes(png(100_000, 100_000))  # Pillow's own bomb guard
    (m / "huge.png").write_bytes(png(8000, 8000))  # 64 Mpx: over our 50 Mpx limit
    (m / "folder.png").mkdir()
    speech, sr = sf.read(ALSA / "Front_Center.wav", dtype="float32")
    sf.write(m / "long.wav", np.tile(speech, 4), sr, subtype="PCM_16")  # ~5.7 s
    (m / "noise.wav").write_text("RIFF? no.")

    good = [
        {
            "id": "astronaut",
            "prompt": "<image> who is this ?",
            "answer": "an astronaut",
            "images": ["media/astronaut.png"],
            "license": "public domain",
            "split": "train",
        },
        {"id": "camera", "prompt": "<image> describe the photo .", "images": ["media/camera.png"]},
        {
            "id": "rocket",
            "prompt": "<image> what is launching ?",
            "answer": "a rocket",
            "images": ["media/rocket.jpg"],
            "meta": {"source": "nasa"},
        },
        {"id": "logo", "prompt": "<image> read the logo .", "images": ["media/logo.png"]},
        {"id": "cat.bmp/1", "prompt": "<image> what animal ?", "answer": "a cat", "images": ["media/chelsea.bmp"]},
        {
            "id": "speech",
            "prompt": "<audio> what is said ?",
            "answer": "front center",
            "audio": ["media/front_center.wav"],
        },
        {
            "id": "both",
            "prompt": "<audio> then <image> : match ?",
            "answer": "no",
            "images": ["media/astronaut.png"],
            "audio": ["media/front_left.wav"],
        },
        {"id": "stereo", "prompt": "<audio> which side ?", "audio": ["media/stereo44k.wav"]},
        {"id": 42, "prompt": "a text-only prompt", "answer": "fine"},
        {"id": "no-marker", "prompt": "describe", "images": ["media/camera.png"]},  # gets "<image>describe"
    ]
    bad = [
        ({"id": "truncated", "prompt": "<image> x", "images": ["media/truncated.png"]}, "bad-image"),
        ({"id": "text-jpg", "prompt": "<image> x", "images": ["media/text.jpg"]}, "not-an-image"),
        ({"id": "zero-wav", "prompt": "<audio> x", "audio": ["media/zero.wav"]}, "empty-file"),
        ({"id": "no-frames", "prompt": "<audio> x", "audio": ["media/no_frames.wav"]}, "empty-audio"),
        ({"id": "fake-wav", "prompt": "<audio> x", "audio": ["media/noise.wav"]}, "bad-audio"),
        ({"id": "missing", "prompt": "<image> x", "images": ["media/nope.png"]}, "missing-file"),
        ({"id": "folder", "prompt": "<image> x", "images": ["media/folder.png"]}, "unreadable-file"),
        ({"id": "bomb", "prompt": "<image> x", "images": ["media/bomb.png"]}, "image-too-large"),
        ({"id": "huge", "prompt": "<image> x", "images": ["media/huge.png"]}, "image-too-large"),
        ({"id": "long", "prompt": "<audio> x", "audio": ["media/long.wav"]}, "audio-too-long"),
        (
            {
                "id": "half-good",
                "prompt": "<image> <audio> x",
                "images": ["media/camera.png"],
                "audio": ["media/nope.wav"],
            },
            "missing-file",
        ),
        (
            {"id": "one-marker-short", "prompt": "<image> x", "images": ["media/camera.png", "media/logo.png"]},
            "marker-mismatch",
        ),
        ({"id": "bad-types", "prompt": "<image> x", "images": {"path": "media/camera.png"}}, "bad-line"),
        ({"id": "speech", "prompt": "<audio> again", "audio": ["media/front_center.wav"]}, "duplicate-id"),
        ({"id": "no-prompt", "answer": "an answer to nothing"}, "bad-line"),
    ]
    lines = [json.dumps(s) for s in good[:4]] + ["", "{not json"]
    lines += [json.dumps(s) for s, _ in bad[:8]] + [json.dumps(s) for s in good[4:]]
    lines += [json.dumps(s) for s, _ in bad[8:]]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "shards"
    return {
        "root": root,
        "good": good,
        "bad": bad,
        "out": out,
        "media": m,
        "argv": [
            "make",
            str(root / "train.jsonl"),
            "--out",
            f"{out}/train-%06d.tar",
            "--maxcount",
            "4",
            "--max-audio-seconds",
            str(MAX_AUDIO_SECONDS),
        ],
    }


@pytest.fixture(scope="module")
def made(job):
    import contextlib

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(job["argv"])
    files = sorted(str(p) for p in job["out"].glob("train-*.tar"))
    return {**job, "rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue(), "files": files}


@needs_real_media
def test_make_writes_exactly_the_good_samples(made):
    assert made["rc"] == 0, made["stderr"]
    samples = list(read_shards(made["files"]))
    assert [s["id"] for s in samples] == [str(g["id"]) for g in made["good"]]
    assert len(made["files"]) == 3  # 10 samples, 4 per shard
    assert not list(made["out"].glob("*.tmp"))


@needs_real_media
def test_every_rejection_is_reported_with_its_reason(made):
    rows = [json.loads(x) for x in (made["out"] / "train-rejected.jsonl").read_text().splitlines()]
    expected = [(s.get("id"), code) for s, code in made["bad"]] + [(None, "bad-line")]  # + the "{not json" line
    assert sorted(((r["id"], r["code"]) for r in rows), key=str) == sorted(expected, key=str)
    for r in rows:
        assert r["reason"] and r["line"].startswith(str(made["root"] / "train.jsonl") + ":")
        if r["code"] in (
            "missing-file",
            "bad-image",
            "not-an-image",
            "bad-audio",
            "empty-audio",
            "empty-file",
            "image-too-large",
            "audio-too-long",
            "unreadable-file",
        ):
            assert r["file"] and Path(r["file"]).name in json.dumps([s for s, _ in made["bad"]])
        if r["id"] is not None:  # and on stderr, naming the sample
            assert f"rejected id={r['id']} " in made["stderr"]
    by_id = {r["id"]: r for r in rows}
    assert "over the limit of 5 s" in by_id["long"]["reason"]
    assert by_id["half-good"]["file"].endswith("nope.wav")
    assert "already used at" in by_id["speech"]["reason"]
    assert f"rejected {len(rows)}:" in made["stdout"]
    assert "wrote 10 samples" in made["stdout"] and "markers placed before the text in 1;" in made["stdout"]


@needs_real_media
def test_strict_turns_a_rejection_into_failure_and_out_is_never_overwritten(made, capsys):
    argv = list(made["argv"])
    assert main(argv) == 2  # the same --out again: refused, nothing touched
    assert "already match" in capsys.readouterr().err
    argv[argv.index("--out") + 1] = str(made["root"] / "strict" / "s-%06d.tar")
    assert main(argv + ["--strict"]) == 1
    assert "--strict" in capsys.readouterr().err
    clean = made["root"] / "clean.jsonl"
    clean.write_text(json.dumps(made["good"][0]) + "\n")
    assert main(["make", str(clean), "--out", str(made["root"] / "c" / "c-%03d.tar"), "--strict"]) == 0
    assert (made["root"] / "c" / "c-rejected.jsonl").read_text() == ""


@needs_real_media
def test_round_trip_bytes_and_hashes(made):
    from PIL import Image

    samples = {s["id"]: s for s in read_shards(made["files"])}
    m = made["media"]
    for sid, name in (
        ("astronaut", "astronaut.png"),
        ("camera", "camera.png"),
        ("rocket", "rocket.jpg"),
        ("logo", "logo.png"),
    ):
        ((kind, sha, data),) = samples[sid]["media"]
        original = (m / name).read_bytes()
        assert kind == "image" and data == original  # PNG/JPEG kept as they are
        assert sha == hashlib.sha256(original).hexdigest()
    # BMP is stored as a lossless PNG of the same pixels
    ((_, sha, data),) = samples["cat.bmp/1"]["media"]
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and sha == hashlib.sha256(data).hexdigest()
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), np.asarray(Image.open(m / "chelsea.bmp")))
    # the two samples that show the astronaut share one hash
    assert samples["both"]["media"][1][1] == samples["astronaut"]["media"][0][1]
    assert [k for k, _, _ in samples["both"]["media"]] == ["audio", "image"]  # prompt-marker order
    # metadata: extra keys and meta merged; answer kept; text-only sample
    assert samples["astronaut"]["meta"] == {"license": "public domain", "split": "train"}
    assert samples["rocket"]["meta"] == {"source": "nasa"} and samples["rocket"]["answer"] == "a rocket"
    assert samples["42"]["media"] == [] and samples["42"]["answer"] == "fine"
    assert "answer" not in samples["camera"]
    assert samples["no-marker"]["prompt"] == "<image>describe"  # no marker: placed before the text
    assert samples["no-marker"]["media"][0][2] == (m / "camera.png").read_bytes()


@needs_real_media
def test_audio_is_mono_16k_pcm16_matching_an_independent_resampler(made):
    from scipy.signal import resample_poly

    samples = {s["id"]: s for s in read_shards(made["files"])}
    for sid, source, (up, down) in (
        ("speech", made["media"] / "front_center.wav", (1, 3)),
        ("stereo", made["media"] / "stereo44k.wav", (160, 441)),
    ):
        ((kind, sha, data),) = [x for x in samples[sid]["media"] if x[0] == "audio"]
        assert sha == hashlib.sha256(data).hexdigest()
        info = sf.info(io.BytesIO(data))
        assert (info.samplerate, info.channels, info.subtype, info.format) == (16000, 1, "PCM_16", "WAV")
        got, _ = sf.read(io.BytesIO(data), dtype="float32")
        src, _ = sf.read(source, dtype="float32", always_2d=True)
        want = resample_poly(src.mean(axis=1), up, down)
        assert abs(len(got) - len(want)) <= 1
        n = min(len(got), len(want))
        assert np.corrcoef(got[:n], want[:n])[0, 1] > 0.999
        assert np.abs(got[:n] - want[:n]).max() < 0.05


@needs_real_media
def test_stock_webdataset_and_tar_read_the_shards(made):
    import webdataset as wds

    ours = {s["source"].rsplit(":", 1)[1]: s for s in read_shards(made["files"])}
    theirs = list(wds.WebDataset(made["files"], shardshuffle=False, empty_check=False))
    assert [r["__key__"] for r in theirs] == list(ours)
    for r in theirs:
        header = json.loads(r["json"])
        s = ours[r["__key__"]]
        assert header["id"] == s["id"]
        for m, (kind, sha, data) in zip(header["media"], s["media"]):
            assert r[m["member"]] == data and m["sha256"] == sha
    tar = shutil.which("tar")
    assert tar, "the tar program is needed for this check"
    for f in made["files"]:
        listed = subprocess.run([tar, "-tf", f], check=True, capture_output=True, text=True).stdout.split()
        with tarfile.open(f) as t:
            assert listed == t.getnames()


@needs_real_media
def test_verify_and_inspect_on_made_shards(made, capsys):
    assert main(["verify", str(made["out"] / "train-*.tar")]) == 0
    assert "verified 10 samples in 3 shard(s): OK" in capsys.readouterr().out
    assert main(["inspect", str(made["out"] / "train-*.tar"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    samples = list(read_shards(made["files"]))
    media = [x for s in samples for x in s["media"]]
    assert stats["samples"] == 10 and stats["shards"] == 3
    assert stats["media_total"] == len(media) == 10
    assert stats["media_unique"] == len({sha for _, sha, _ in media}) == 8  # astronaut and camera twice
    assert stats["media_bytes"] == sum(len(d) for _, _, d in media)
    assert stats["modalities"] == {"audio": 2, "audio+image": 1, "image": 6, "text": 1}
    assert [s["bytes"] for s in stats["shard_sizes"]] == [os.path.getsize(f) for f in made["files"]]
    assert main(["inspect", str(made["out"] / "train-*.tar")]) == 0
    text = capsys.readouterr().out
    assert "unique media  8 by sha256" in text and "samples       10" in text


@needs_real_media
def test_make_reads_a_folder_of_manifests(made, capsys):
    folder = made["root"] / "parts"
    folder.mkdir()
    for i, g in enumerate(made["good"][:3]):
        g = {**g, "images": [str(made["media"] / Path(p).name) for p in g.get("images", [])]}  # absolute paths
        (folder / f"part-{i}.jsonl").write_text(json.dumps(g) + "\n")
    # absolute paths outside the manifests' folder: refused unless --allow-outside
    assert main(["make", str(folder), "--out", str(made["root"] / "q" / "q-%06d.tar")]) == 1
    rows = [json.loads(x) for x in (made["root"] / "q" / "q-rejected.jsonl").read_text().splitlines()]
    assert [(r["id"], r["code"]) for r in rows] == [(g["id"], "path-outside-source") for g in made["good"][:2]] + [
        ("rocket", "path-outside-source")
    ]
    capsys.readouterr()
    assert main(["make", str(folder), "--out", str(made["root"] / "p" / "p-%06d.tar"), "--allow-outside"]) == 0
    files = sorted(str(p) for p in (made["root"] / "p").glob("p-*.tar"))
    assert [s["id"] for s in read_shards(files)] == ["astronaut", "camera", "rocket"]


def test_make_usage_errors(tmp_path, capsys):
    assert main(["make", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o-%06d.tar")]) == 2
    assert "no such manifest" in capsys.readouterr().err
    (tmp_path / "m.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    assert main(["make", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "o.tar")]) == 2
    assert "printf number field" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("nonsense\n")
    assert main(["make", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "b" / "b-%d.tar")]) == 1
    assert "no sample passed validation" in capsys.readouterr().err
    assert not list((tmp_path / "b").glob("*.tar"))
    with pytest.raises(SystemExit):
        main(["make", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "x-%d.tar"), "--maxsize", "lots"])
