"""Manifests as people have them, through `loomrl shards make` (the top-level CLI entry):
prompts without `<image>` / `<audio>` markers (the media are placed before the text),
the common field names (question / image / numeric answer, `--field NAME=KEY`), missing
ids, ambiguous keys, and media paths that leave the manifest's folder (`..`, absolute,
symbolic links: `path-outside-source` unless `--allow-outside`).

Real photos: scikit-image's astronaut, coffee and chelsea, downscaled and saved here as
PNG / JPEG. Without scikit-image these tests skip, saying why; with
LOOMRL_REQUIRE_REAL_MEDIA=1 (CI) they fail instead. Shards are read back with the
training reader, `ShardStream`.
"""

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from loomrl.cli import main as loomrl_main
from loomrl.datasets.stream import ShardStream

REQUIRE = os.environ.get("LOOMRL_REQUIRE_REAL_MEDIA") == "1"
try:
    import skimage.data as skdata
except ImportError:
    skdata = None
needs_photos = pytest.mark.skipif(
    skdata is None and not REQUIRE, reason="scikit-image missing (pip install scikit-image; it is in the dev extra)"
)


def make(*argv: str) -> int:
    return loomrl_main(["shards", "make", *map(str, argv)])


def write_manifest(path: Path, lines: list) -> Path:
    """JSON objects as lines; a str is written as it is (a blank line, broken JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_back(folder: Path) -> list[dict]:
    """The samples of folder/*.tar in write order, through the training reader."""
    stream = ShardStream(str(folder / "*.tar"), shuffle_buffer=0, epochs=1, rank=0, world_size=1)
    records = list(stream)
    assert not [r for r in records if "error" in r]
    return records


def rejections(folder: Path) -> dict:
    rows = [json.loads(x) for x in (folder / "s-rejected.jsonl").read_text().splitlines()]
    return {r["id"] if r["id"] is not None else r["line"]: r for r in rows}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """tmp/src/media/{astronaut.png, coffee.jpg, chelsea.png, tone.wav, notes.jpg}, and outside
    the manifest folder tmp/outside/coffee.png; manifests go in tmp/src."""
    if skdata is None:
        pytest.fail("scikit-image missing and LOOMRL_REQUIRE_REAL_MEDIA=1 says it must be here")
    from PIL import Image

    base = tmp_path_factory.mktemp("formats")
    media = base / "src" / "media"
    media.mkdir(parents=True)
    (base / "outside").mkdir()
    Image.fromarray(skdata.astronaut()).resize((64, 64)).save(media / "astronaut.png")
    Image.fromarray(skdata.coffee()).resize((60, 40)).save(media / "coffee.jpg", quality=90)
    Image.fromarray(skdata.chelsea()).resize((45, 30)).save(media / "chelsea.png")
    Image.fromarray(skdata.coffee()).resize((30, 20)).save(base / "outside" / "coffee.png")
    t = np.arange(8000) / 16000
    sf.write(media / "tone.wav", (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, subtype="PCM_16")
    (media / "notes.jpg").write_text("a text file with an image's name\n")
    return base


# --------------------------------------------------------------------------- markers


@needs_photos
def test_a_marker_free_manifest_writes_exactly_the_good_samples(root, capsys):
    src, media = root / "src", root / "src" / "media"
    escape = os.path.join("..", "outside", "coffee.png")  # a valid photo, outside src
    manifest = write_manifest(
        src / "vqa.jsonl",
        [
            {"question": "what is in the photo ?", "image": "media/astronaut.png", "answer": 7},  # id vqa-1
            {
                "id": "two",
                "prompt": "compare them .",
                "images": ["media/coffee.jpg", "media/chelsea.png"],
                "audio": ["media/tone.wav"],
                "answer": ["a cup", "coffee"],
                "split": "val",
            },
            {"id": "missing", "question": "where ?", "image": "media/nope.png"},  # missing-file
            "",
            {"id": "escape", "question": "where ?", "image": escape},  # outside
            {"id": "short", "prompt": "<image> which ?", "images": ["media/coffee.jpg", "media/chelsea.png"]},
            {"id": "text", "query": "say hi", "answer": 2.5},  # text only
            {"id": "marked", "prompt": "look: <image> ok ?", "image": "media/chelsea.png"},  # kept as is
            {"question": "and this ?", "image": "media/notes.jpg"},  # not-an-image
            {"id": "two", "question": "again ?", "image": "media/astronaut.png"},  # duplicate-id
        ],
    )
    out = root / "o1"
    assert make(manifest, "--out", f"{out}/s-%03d.tar", "--maxcount", "3") == 0
    captured = capsys.readouterr()
    assert "wrote 4 samples (4 images, 1 clips" in captured.out
    assert "markers placed before the text in 2;" in captured.out  # vqa-1 and two; not text, not marked
    assert "rejected 5:" in captured.out

    samples = read_back(out)
    assert [s["id"] for s in samples] == ["vqa-1", "two", "text", "marked"]
    s = {x["id"]: x for x in samples}
    assert s["vqa-1"]["prompt"] == "<image>what is in the photo ?" and s["vqa-1"]["answer"] == "7"
    assert s["two"]["prompt"] == "<image><image><audio>compare them ."
    assert [(k, d) for k, _, d in s["two"]["media"][:2]] == [
        ("image", (media / "coffee.jpg").read_bytes()),
        ("image", (media / "chelsea.png").read_bytes()),
    ]
    kind, _, wav = s["two"]["media"][2]
    assert kind == "audio" and sf.info(io.BytesIO(wav)).frames == 8000
    assert s["two"]["answer"] == "a cup" and s["two"]["meta"] == {"answers": ["a cup", "coffee"], "split": "val"}
    assert s["text"]["prompt"] == "say hi" and s["text"]["answer"] == "2.5" and s["text"]["media"] == []
    assert s["marked"]["prompt"] == "look: <image> ok ?"
    assert s["vqa-1"]["media"][0][2] == (media / "astronaut.png").read_bytes()

    rej = rejections(out)
    codes = {k: r["code"] for k, r in rej.items()}
    assert codes == {
        "missing": "missing-file",
        "escape": "path-outside-source",
        "short": "marker-mismatch",
        "vqa-9": "not-an-image",
        "two": "duplicate-id",
    }
    assert rej["two"]["line"] == f"{manifest}:10" and "already used at" in rej["two"]["reason"]
    assert "put one marker where each medium goes" in rej["short"]["reason"]


@needs_photos
def test_summary_as_json_counts_placed_markers(root, capsys):
    manifest = write_manifest(
        root / "src" / "j.jsonl",
        [
            {"question": "who ?", "image": "media/astronaut.png"},
            {"prompt": "<image> who ?", "image": "media/astronaut.png"},
            {"prompt": "<image> <image> who ?", "image": "media/astronaut.png"},
        ],
    )
    out = root / "o-json"
    assert make(manifest, "--out", f"{out}/s-%03d.tar", "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["written"] == 2 and summary["markers_placed"] == 1 and summary["images"] == 2
    assert summary["rejected"] == 1 and summary["rejected_by_code"] == {"marker-mismatch": 1}
    assert summary["shards"] == [f"{out}/s-000.tar"] and summary["rejected_file"] == f"{out}/s-rejected.jsonl"
    assert summary["shard_bytes"] == os.path.getsize(f"{out}/s-000.tar")


@needs_photos
def test_require_markers_restores_the_strict_rule(root, capsys):
    manifest = write_manifest(
        root / "src" / "strict.jsonl",
        [
            {"id": "free", "question": "who ?", "image": "media/astronaut.png"},
            {"id": "marked", "prompt": "<image> who ?", "image": "media/astronaut.png"},
            {"id": "text", "prompt": "no media, no marker"},
        ],
    )
    out = root / "o-strict"
    assert make(manifest, "--out", f"{out}/s-%03d.tar", "--require-markers") == 0
    assert "markers placed" not in capsys.readouterr().out
    assert [s["id"] for s in read_back(out)] == ["marked", "text"]
    (row,) = rejections(out).values()
    assert row["id"] == "free" and row["code"] == "marker-mismatch" and "--require-markers" in row["reason"]


# --------------------------------------------------------------------------- paths


@needs_photos
def test_paths_outside_the_manifest_folder_are_refused_before_they_are_opened(root, capsys, monkeypatch):
    import loomrl.datasets.prepare as prepare

    src = root / "src"
    outside_png = root / "outside" / "coffee.png"
    link = src / "media" / "link.png"
    if not link.exists():
        link.symlink_to(outside_png)  # inside the folder, pointing outside
    inner = src / "media" / "inner.png"
    if not inner.exists():
        inner.symlink_to(src / "media" / "chelsea.png")  # a link that stays inside is fine
    passwd = os.path.relpath("/etc/passwd", src)  # ../../../(...)/etc/passwd
    assert passwd.startswith("..")
    manifest = write_manifest(
        src / "paths.jsonl",
        [
            {"id": "passwd", "question": "read ?", "image": passwd},
            {"id": "dotdot", "question": "what ?", "image": os.path.join("..", "outside", "coffee.png")},
            {"id": "absolute", "question": "what ?", "image": str(outside_png)},
            {"id": "symlink", "question": "what ?", "image": "media/link.png"},
            {"id": "clip", "question": "what ?", "audio": os.path.join("media", "..", "..", "outside", "x.wav")},
            {
                "id": "inside",
                "question": "what ?",
                "images": ["media/../media/astronaut.png", "media/inner.png", str(src / "media" / "coffee.jpg")],
            },
        ],
    )
    opened = []
    real_open = prepare.open_regular
    monkeypatch.setattr(prepare, "open_regular", lambda p: opened.append(os.path.realpath(p)) or real_open(p))
    out = root / "o-paths"
    assert make(manifest, "--out", f"{out}/s-%03d.tar") == 0
    err = capsys.readouterr().err
    assert [s["id"] for s in read_back(out)] == ["inside"]
    rej = rejections(out)
    assert {k: r["code"] for k, r in rej.items()} == {
        k: "path-outside-source" for k in ("passwd", "dotdot", "absolute", "symlink", "clip")
    }
    real_src, real_passwd = os.path.realpath(src), os.path.realpath("/etc/passwd")
    assert rej["passwd"]["reason"] == (
        f"{passwd!r} resolves to {real_passwd}, outside the manifest's folder "
        f"{real_src}; --allow-outside allows it (trusted manifests only)"
    )
    assert f"resolves to {os.path.realpath(outside_png)}, outside" in rej["symlink"]["reason"]
    assert rej["absolute"]["file"] == str(outside_png)
    assert "rejected id=passwd" in err and "path-outside-source" in err
    assert sorted(opened) == sorted(
        os.path.realpath(src / "media" / n) for n in ("astronaut.png", "chelsea.png", "coffee.jpg")
    )  # nothing outside

    opened.clear()
    out = root / "o-paths-allowed"
    assert make(manifest, "--out", f"{out}/s-%03d.tar", "--allow-outside") == 0
    capsys.readouterr()
    samples = {s["id"]: s for s in read_back(out)}
    assert list(samples) == ["dotdot", "absolute", "symlink", "inside"]
    for sid in ("dotdot", "absolute", "symlink"):
        assert samples[sid]["media"][0][2] == outside_png.read_bytes()
    rej = rejections(out)
    assert rej["passwd"]["code"] in ("not-an-image", "missing-file", "unreadable-file")  # read, not refused
    assert rej["clip"]["code"] == "missing-file"
    assert os.path.realpath(outside_png) in opened


# --------------------------------------------------------------------------- fields and ids


@needs_photos
def test_field_mapping_with_field_flags(root, capsys):
    manifest = write_manifest(
        root / "src" / "custom.jsonl",
        [
            {
                "qid": 17,
                "text": "what animal ?",
                "img_paths": ["media/chelsea.png"],
                "label": "cat",
                "question": "kept in meta",
                "answer": "kept too",
            },
            {"qid": "b", "text": "and here ?", "img_paths": "media/coffee.jpg", "label": 3},
        ],
    )
    out = root / "o-fields"
    assert (
        make(
            manifest,
            "--out",
            f"{out}/s-%03d.tar",
            "--field",
            "prompt=text",
            "--field",
            "id=qid",
            "--field",
            "images=img_paths",
            "--field",
            "answer=label",
            "--strict",
        )
        == 0
    )
    capsys.readouterr()
    a, b = read_back(out)
    assert (a["id"], a["prompt"], a["answer"]) == ("17", "<image>what animal ?", "cat")
    assert a["meta"] == {"question": "kept in meta", "answer": "kept too"}  # mapped away: plain metadata
    assert a["media"][0][2] == (root / "src" / "media" / "chelsea.png").read_bytes()
    assert (b["id"], b["prompt"], b["answer"], b["meta"]) == ("b", "<image>and here ?", "3", {})

    # without the mapping, the default keys are read: line 1 is the question (no id: custom-1, no media),
    # line 2 has no prompt key -> a bad-line naming the keys looked for
    out = root / "o-fields-default"
    assert make(manifest, "--out", f"{out}/s-%03d.tar") == 0
    (c,) = read_back(out)
    assert (c["id"], c["prompt"], c["answer"], c["media"]) == ("custom-1", "kept in meta", "kept too", [])
    assert c["meta"] == {"qid": 17, "text": "what animal ?", "img_paths": ["media/chelsea.png"], "label": "cat"}
    (row,) = rejections(out).values()
    assert (row["id"], row["code"], row["line"]) == ("custom-2", "bad-line", f"{manifest}:2")
    assert row["reason"] == "the prompt, field 'prompt' or 'question' or 'query' or 'instruction', is missing"
    # a missing mapped key is named with its --field
    out = root / "o-fields-missing"
    assert make(manifest, "--out", f"{out}/s-%03d.tar", "--field", "prompt=caption") == 1
    row = next(iter(rejections(out).values()))
    assert (row["code"], row["reason"]) == ("missing-field", "--field prompt=caption: the line has no 'caption' key")
    # so is one of a field that may be left out (images, answer): the real keys never slip into meta
    for flag in ("images=nokey", "answer=nokey"):
        out = root / f"o-{flag.replace('=', '-')}"
        assert make(manifest, "--out", f"{out}/s-%03d.tar", "--field", flag) == 1
        codes = {r["code"] for r in rejections(out).values()}
        assert codes == {"missing-field"}, (flag, codes)
    capsys.readouterr()


def test_field_flag_errors_are_clean_cli_errors(tmp_path, capsys):
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": "a", "prompt": "hi"}])
    with pytest.raises(SystemExit) as e:
        make(manifest, "--out", f"{tmp_path}/o/s-%d.tar", "--field", "promt=question")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown field 'promt'" in err and "id, prompt, answer, images, audio" in err
    with pytest.raises(SystemExit):
        make(manifest, "--out", f"{tmp_path}/o/s-%d.tar", "--field", "prompt")
    assert "is not NAME=KEY" in capsys.readouterr().err
    assert make(manifest, "--out", f"{tmp_path}/o/s-%d.tar", "--field", "prompt=a", "--field", "prompt=b") == 2
    assert "prompt given twice" in capsys.readouterr().err
    assert make(manifest, "--out", f"{tmp_path}/o/s-%d.tar", "--field", "prompt=x", "--field", "answer=x") == 2
    assert "['x'] mapped to more than one field" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_missing_ids_are_made_from_file_stem_and_line(tmp_path, capsys):
    folder = tmp_path / "parts"
    write_manifest(folder / "a.jsonl", [{"prompt": "one"}, "", {"prompt": "three"}, {"id": "a-1", "prompt": "x"}])
    write_manifest(folder / "b.jsonl", [{"instruction": "first of b"}, {"id": 5, "prompt": "five"}])
    out = tmp_path / "o"
    assert make(folder, "--out", f"{out}/s-%d.tar") == 0
    capsys.readouterr()
    records = read_back(out)
    assert [(r["id"], r["prompt"]) for r in records] == [
        ("a-1", "one"),
        ("a-3", "three"),
        ("b-1", "first of b"),
        ("5", "five"),
    ]
    (row,) = rejections(out).values()  # the explicit id a-1 comes after the made one: a duplicate
    assert row["id"] == "a-1" and row["code"] == "duplicate-id" and row["line"] == f"{folder}/a.jsonl:4"


def test_ambiguous_keys_and_bad_values_are_bad_lines(tmp_path, capsys):
    manifest = write_manifest(
        tmp_path / "m.jsonl",
        [
            {"id": "both", "prompt": "a", "question": "b"},
            {"id": "imgs", "prompt": "a", "image": "x.png", "images": ["y.png"]},
            {"id": "bool", "prompt": "a", "answer": True},
            {"id": "empty-list", "prompt": "a", "answer": []},
            {"id": "mixed-list", "prompt": "a", "answer": ["x", 1]},
            {"id": "clash", "prompt": "a", "answer": ["x", "y"], "answers": ["z"]},
            {"id": "nul", "prompt": "a", "image": "a\0b.png"},  # os calls raise ValueError on it, not OSError
            {"id": "ok", "prompt": "a", "image": None, "audios": [], "answer": 0},
            '{"id": "digits", "prompt": "a", "n": 1' + "0" * 5000 + "}",  # json: ValueError, not JSONDecodeError
            '{"id": "deep", "prompt": "a", "n": ' + "[" * 100_000 + "]" * 100_000 + "}",  # json: RecursionError
        ],
    )
    out = tmp_path / "o"
    assert make(manifest, "--out", f"{out}/s-%d.tar") == 0
    capsys.readouterr()
    (ok,) = read_back(out)
    assert (ok["id"], ok["prompt"], ok["answer"], ok["media"]) == ("ok", "a", "0", [])
    rej = rejections(out)
    assert {k: r["code"] for k, r in rej.items()} == {
        k: "bad-line"
        for k in ("both", "imgs", "bool", "empty-list", "mixed-list", "clash", "nul", f"{manifest}:9", f"{manifest}:10")
    }
    assert "4300 digits" in rej[f"{manifest}:9"]["reason"]
    assert rej[f"{manifest}:10"]["reason"] == "JSON nested deeper than the limit of 64"
    assert rej["both"]["reason"] == (
        "keys 'prompt' and 'question' both give the prompt; keep one, or choose with --field prompt=KEY"
    )
    assert "keys 'images' and 'image' both give the images" in rej["imgs"]["reason"]
    assert "already has an 'answers' key" in rej["clash"]["reason"]
    assert rej["nul"]["reason"] == "field 'image': a file path cannot contain a NUL character"


def test_progress_without_a_terminal_is_a_line_every_few_seconds(tmp_path, capsys, monkeypatch):
    import loomrl.datasets.prepare as prepare

    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": f"t{i}", "prompt": "hi"} for i in range(3)])
    monkeypatch.setattr(prepare, "PROGRESS_SECONDS", 0.0)  # every sample, instead of every 5 s
    assert make(manifest, "--out", f"{tmp_path}/o/s-%d.tar", "--json") == 0
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.startswith("shards make: ")]
    assert lines[-1].startswith("shards make: 3 read, 3 written, 0 rejected"), captured.err
    assert json.loads(captured.out)["written"] == 3  # stdout stays the JSON alone
