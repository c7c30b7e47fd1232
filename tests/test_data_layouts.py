"""`loomrl shards make` on data as public VQA / RL sets ship it, without a converter: the
layouts (vqa, llava / ShareGPT, OpenAI / HF chat, verl, EasyR1) in every source (JSONL, a .json
list, parquet, a `datasets` save_to_disk folder, a folder of data files as `load_dataset` finds
them), each written here with its real library, and media as paths, file:// URLs, data: URIs
and bytes in a column, next to broken samples of each kind.

Every run goes through the top-level CLI entry (`loomrl.cli.main`); shards are read back with
the project's reader (`read_shards`): prompts, markers, answers, meta and media bytes.

Real media: scikit-image's photos (downscaled here) and Debian alsa-utils' spoken clip. Without
them these tests skip, saying why; with LOOMRL_REQUIRE_REAL_MEDIA=1 (CI) they fail instead.
"""

import base64
import datetime
import io
import json
import os
import shutil
import struct
import zlib
from pathlib import Path
from urllib.request import pathname2url

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from loomrl.cli import main as loomrl_main
from loomrl.datasets.inline import Inline, decoded_size, resolve
from loomrl.datasets.shards import read_shards

ALSA = Path("/usr/share/sounds/alsa")
REQUIRE = os.environ.get("LOOMRL_REQUIRE_REAL_MEDIA") == "1"


def skimage_data() -> Path | None:
    try:
        import skimage
    except ImportError:
        return None
    d = Path(skimage.__file__).parent / "data"
    return d if (d / "astronaut.png").exists() else None


MISSING = [
    what
    for what, there in (
        ("scikit-image's photos (pip install scikit-image; it is in the dev extra)", skimage_data() is not None),
        (f"{ALSA}/Front_Center.wav (apt-get install -y alsa-utils)", (ALSA / "Front_Center.wav").exists()),
    )
    if not there
]
needs_real_media = pytest.mark.skipif(
    bool(MISSING) and not REQUIRE, reason="real test media missing: " + "; ".join(MISSING)
)


def make(*argv: object) -> int:
    return loomrl_main(["shards", "make", *map(str, argv)])


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over a tiny body: a decompression bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b"")
    )


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def file_url(path: Path) -> str:
    return "file://" + pathname2url(str(path))


def samples(out: Path) -> dict[str, dict]:
    """The samples of out/*.tar, by id, in write order, through the project's reader."""
    return {s["id"]: s for s in read_shards(sorted(str(p) for p in out.glob("*.tar")))}


def rejections(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "s-rejected.jsonl").read_text().splitlines()]
    return {r["id"] if r["id"] is not None else r["line"]: r for r in rows}


def summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """tmp/src/media: astronaut.png, coffee.jpg, chelsea.png, camera.png (downscaled real photos),
    speech.wav (a real spoken clip), long.wav (it four times), notes.png (text); tmp/outside/rocket.png."""
    if MISSING:
        pytest.fail("real test media missing: " + "; ".join(MISSING) + " and LOOMRL_REQUIRE_REAL_MEDIA=1")
    from PIL import Image

    real = skimage_data()
    base = tmp_path_factory.mktemp("layouts")
    media = base / "src" / "media"
    media.mkdir(parents=True)
    (base / "outside").mkdir()
    Image.open(real / "astronaut.png").resize((64, 64)).save(media / "astronaut.png")
    Image.open(real / "coffee.png").resize((60, 40)).convert("RGB").save(media / "coffee.jpg", quality=90)
    Image.open(real / "chelsea.png").resize((45, 30)).save(media / "chelsea.png")
    Image.open(real / "camera.png").resize((48, 48)).save(media / "camera.png")
    Image.open(real / "rocket.jpg").resize((40, 60)).save(base / "outside" / "rocket.png")
    shutil.copy(ALSA / "Front_Center.wav", media / "speech.wav")
    speech, sr = sf.read(media / "speech.wav", dtype="float32")
    sf.write(media / "long.wav", np.tile(speech, 4), sr, subtype="PCM_16")  # ~5.7 s
    (media / "notes.png").write_text("a text file with an image's name\n")
    return base


def media_bytes(root: Path, name: str) -> bytes:
    return (root / "src" / "media" / name).read_bytes()


def frames(wav: bytes) -> int:
    info = sf.info(io.BytesIO(wav))
    assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
    return info.frames


# --------------------------------------------------------------------------- llava in a .json list


@needs_real_media
def test_llava_json_list_single_and_multi_turn(root, capsys):
    src = root / "src"
    conv = [{"from": "human", "value": "<image>\nWho is this?"}, {"from": "gpt", "value": "An astronaut."}]
    records = [
        {"id": "single", "image": "media/astronaut.png", "conversations": conv},
        {
            "id": "multi",
            "images": ["media/coffee.jpg", "media/chelsea.png"],
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "<image>\nWhat drink?"},
                {"from": "gpt", "value": "Coffee."},
                {"from": "human", "value": "And this <image> animal?"},
                {"from": "gpt", "value": "A cat."},
            ],
            "source": "coco",
        },
        {
            "id": "no-marker",
            "image": "media/camera.png",
            "conversations": [{"from": "user", "value": "Describe."}, {"from": "assistant", "value": "A man."}],
        },
        {"id": "no-user", "image": "media/camera.png", "conversations": [{"from": "gpt", "value": "Hello."}]},
        {"id": "outside", "image": file_url(root / "outside" / "rocket.png"), "conversations": conv},
        {"id": "role", "conversations": [{"from": "bot", "value": "hi"}]},
        {"id": "file-url", "image": file_url(src / "media" / "chelsea.png"), "conversations": conv[:1]},
        {"id": "two-after", "conversations": conv + [{"from": "gpt", "value": "Really."}]},
        {"id": "answer-image", "conversations": [conv[0], {"from": "gpt", "value": "<image> this"}]},
        {"id": "both-keys", "image": "media/camera.png", "images": ["media/camera.png"], "conversations": conv},
        {
            "id": "clash",
            "conversation": "mine",
            "image": "media/camera.png",
            "conversations": [{"from": "system", "value": "x"}, *conv],
        },
    ]
    (src / "llava.json").write_text(json.dumps(records))
    out = root / "o-llava"
    assert make(src / "llava.json", "--out", f"{out}/s-%03d.tar", "--json") == 0
    got = summary(capsys)
    assert got["written"] == 4 and got["layouts"] == {"llava": 11} and got["markers_placed"] == 1

    s = samples(out)
    assert list(s) == ["single", "multi", "no-marker", "file-url"]
    assert (s["single"]["prompt"], s["single"]["answer"]) == ("<image>\nWho is this?", "An astronaut.")
    assert "conversation" not in s["single"]["meta"]
    assert [d for _, _, d in s["single"]["media"]] == [media_bytes(root, "astronaut.png")]
    multi = s["multi"]
    assert (multi["prompt"], multi["answer"]) == ("And this <image> animal?", "A cat.")
    assert multi["meta"] == {
        "source": "coco",
        "conversation": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "<image>\nWhat drink?"},
            {"role": "assistant", "content": "Coffee."},
        ],
    }
    # the earlier turn's medium first, then the prompt's, in marker order
    assert [d for _, _, d in multi["media"]] == [media_bytes(root, "coffee.jpg"), media_bytes(root, "chelsea.png")]
    assert s["no-marker"]["prompt"] == "<image>Describe."
    assert s["file-url"]["media"][0][2] == media_bytes(root, "chelsea.png") and "answer" not in s["file-url"]

    rej = rejections(out)
    assert {k: r["code"] for k, r in rej.items()} == {
        "no-user": "bad-line",
        "outside": "path-outside-source",
        "role": "bad-line",
        "two-after": "bad-line",
        "answer-image": "bad-line",
        "both-keys": "bad-line",
        "clash": "bad-line",
    }
    assert rej["no-user"]["reason"] == "field 'conversations' has no user turn: nothing to prompt with"
    assert rej["no-user"]["line"] == f"{src / 'llava.json'}:[3]"
    assert rej["outside"]["file"] == str(root / "outside" / "rocket.png")
    assert f"resolves to {os.path.realpath(root / 'outside' / 'rocket.png')}, outside" in rej["outside"]["reason"]
    assert rej["role"]["reason"].startswith("field 'conversations[0].from': 'bot' is not one of 'human', 'user'")
    assert "at most one assistant turn, the answer, may follow it" in rej["two-after"]["reason"]
    assert rej["answer-image"]["reason"] == (
        "field 'conversations[1]': the answer turn holds a medium; only text can be an answer"
    )
    assert rej["both-keys"]["reason"] == "keys 'images' and 'image' both give the images; keep one"
    assert rej["clash"]["reason"].startswith("key 'conversation' is where the earlier turns")


# --------------------------------------------------------------------------- chat with inline media


@needs_real_media
def test_chat_jsonl_with_data_uris_file_urls_and_input_audio(root, capsys, monkeypatch):
    import loomrl.datasets.prepare as prepare

    src = root / "src"
    astronaut, speech = media_bytes(root, "astronaut.png"), media_bytes(root, "speech.wav")
    big = np.random.default_rng(0).bytes(200_000)  # over --max-file-bytes 150000 once decoded

    def user(*parts):
        return {"role": "user", "content": list(parts)}

    def text(t):
        return {"type": "text", "text": t}

    records = [
        {
            "id": "data-uri",
            "messages": [
                user({"type": "image", "image": data_uri(astronaut)}, text("Who?")),
                {"role": "assistant", "content": "An astronaut."},
            ],
        },
        {
            "id": "image-url",
            "messages": [
                user(
                    text("Drink: "), {"type": "image_url", "image_url": {"url": file_url(src / "media" / "coffee.jpg")}}
                )
            ],
        },
        {
            "id": "audio",
            "messages": [
                user(
                    {
                        "type": "input_audio",
                        "input_audio": {"data": base64.b64encode(speech).decode(), "format": "wav"},
                    },
                    text("What is said?"),
                ),
                {"role": "assistant", "content": [text("front center")]},
            ],
        },
        {
            "id": "trl",
            "images": ["media/chelsea.png"],
            "messages": [user({"type": "image"}, text("Animal?")), {"role": "assistant", "content": "cat"}],
        },
        {
            "id": "multi",
            "messages": [
                {"role": "system", "content": "Be brief."},
                user({"type": "image", "image": data_uri(media_bytes(root, "camera.png"))}, text("Who?")),
                {"role": "assistant", "content": "A man."},
                user(text("Holding what?")),
                {"role": "assistant", "content": "A camera."},
            ],
        },
        {
            "id": "bad-b64",
            "messages": [
                user(
                    {"type": "image", "image": "data:image/png;base64,*" + base64.b64encode(astronaut).decode()},
                    text("x"),
                )
            ],
        },
        {
            "id": "not-image",
            "messages": [user({"type": "image", "image": data_uri(b"plain text, no image")}, text("x"))],
        },
        {"id": "too-big", "messages": [user({"type": "image_url", "image_url": {"url": data_uri(big)}}, text("x"))]},
        {
            "id": "remote",
            "messages": [user({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, text("x"))],
        },
        {"id": "video", "messages": [user({"type": "video", "video": "media/clip.mp4"}, text("x"))]},  # no such file
        {"id": "point-cloud", "messages": [user({"type": "point_cloud", "point_cloud": "media/a.ply"}, text("x"))]},
        {"id": "vqa", "question": "What is it?", "image": "media/astronaut.png", "messages": ["kept", "as meta"]},
    ]
    (src / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    opened, decoded = [], []
    real_open, real_decode = prepare.open_regular, prepare.base64.b64decode
    monkeypatch.setattr(prepare, "open_regular", lambda p: opened.append(os.path.basename(p)) or real_open(p))
    monkeypatch.setattr(prepare.base64, "b64decode", lambda s, **kw: decoded.append(len(s)) or real_decode(s, **kw))
    out = root / "o-chat"
    assert make(src / "chat.jsonl", "--out", f"{out}/s-%03d.tar", "--max-file-bytes", "150000") == 0
    text_out = capsys.readouterr().out
    assert "wrote 6 samples (5 images, 1 clips" in text_out and "read as 11 chat, 1 vqa" in text_out
    assert sorted(opened) == ["astronaut.png", "chelsea.png", "clip.mp4", "coffee.jpg"]  # inline media touch no file
    assert len(base64.b64encode(big)) not in decoded  # the 200 kB data URI was refused before it was decoded
    assert len(base64.b64encode(speech)) in decoded

    s = samples(out)
    assert list(s) == ["data-uri", "image-url", "audio", "trl", "multi", "vqa"]
    assert (s["data-uri"]["prompt"], s["data-uri"]["answer"]) == ("<image>Who?", "An astronaut.")
    assert s["data-uri"]["media"][0][2] == astronaut
    assert s["image-url"]["prompt"] == "Drink: <image>" and "answer" not in s["image-url"]
    assert s["image-url"]["media"][0][2] == media_bytes(root, "coffee.jpg")
    assert (s["audio"]["prompt"], s["audio"]["answer"]) == ("<audio>What is said?", "front center")
    ((kind, _, wav),) = s["audio"]["media"]
    assert kind == "audio" and abs(frames(wav) - sf.info(src / "media" / "speech.wav").duration * 16000) <= 1
    assert (s["trl"]["prompt"], s["trl"]["media"][0][2]) == ("<image>Animal?", media_bytes(root, "chelsea.png"))
    assert (s["multi"]["prompt"], s["multi"]["answer"]) == ("Holding what?", "A camera.")
    assert s["multi"]["meta"]["conversation"][1] == {"role": "user", "content": "<image>Who?"}
    assert s["multi"]["media"][0][2] == media_bytes(root, "camera.png")
    assert s["vqa"]["meta"] == {"messages": ["kept", "as meta"]} and s["vqa"]["prompt"] == "<image>What is it?"

    rej = rejections(out)
    assert {k: r["code"] for k, r in rej.items()} == {
        "bad-b64": "bad-base64",
        "not-image": "not-an-image",
        "too-big": "file-too-large",
        "remote": "bad-line",
        "video": "missing-file",
        "point-cloud": "bad-line",
    }
    assert rej["bad-b64"]["reason"].startswith(
        "field 'messages[0].content[0].image' (a data:image/png URI): not valid base64"
    )
    assert rej["not-image"]["reason"] == (
        "field 'messages[0].content[0].image' (a data:image/png URI): not an image Pillow can identify"
    )
    assert rej["not-image"]["file"] is None
    assert rej["too-big"]["reason"] == (
        "field 'messages[0].content[0].image_url' (a data:image/png URI): decodes to 200000 bytes, over the "
        "limit of 150000 (refused before decoding)"
    )
    assert "'https://example.com/cat.png' is a remote URL; nothing is downloaded" in rej["remote"]["reason"]
    assert rej["video"]["file"].endswith("media/clip.mp4")  # a video part is read like an image part
    assert rej["point-cloud"]["reason"].startswith(
        "field 'messages[0].content[0].type': 'point_cloud' is not a content part"
    )


# --------------------------------------------------------------------------- verl parquet


@needs_real_media
def test_verl_parquet_with_image_bytes(root, capsys):
    src = root / "src"
    struct_ = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("images", pa.list_(struct_)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
            ("created", pa.timestamp("s")),
        ]
    )

    def row(i, prompt, images, truth):
        return {
            "data_source": "geo3k",
            "prompt": prompt,
            "images": [{"bytes": b, "path": f"{i}.png"} for b in images],
            "ability": "math",
            "reward_model": {"ground_truth": truth, "style": "rule"},
            "extra_info": {"split": "train", "index": i},
            "created": datetime.datetime(2025, 1, 2, 3, 4, 5),
        }

    coffee, chelsea = media_bytes(root, "coffee.jpg"), media_bytes(root, "chelsea.png")
    rows = [
        row(0, [{"role": "user", "content": "<image>How many people?"}], [media_bytes(root, "astronaut.png")], "1"),
        row(
            1,
            [
                {"role": "system", "content": "Think step by step."},
                {"role": "user", "content": "<image>What is this?"},
                {"role": "assistant", "content": "A cup."},
                {"role": "user", "content": "And <image> this?"},
            ],
            [coffee, chelsea],
            "a cat",
        ),
        row(2, [{"role": "user", "content": "<image>Describe."}], [media_bytes(root, "camera.png")], None),
        row(3, [{"role": "user", "content": "<image>x"}], [b"GIF? no: plain text"], "0"),
        row(4, [{"role": "user", "content": "<image>x"}], [bomb_png(100_000, 100_000)], "0"),
        row(5, [{"role": "user", "content": "x" * 1_100_000}], [], "0"),
        row(6, [{"role": "assistant", "content": "no question"}], [], "0"),
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), src / "verl.parquet", row_group_size=3)
    out = root / "o-verl"
    assert make(src / "verl.parquet", "--out", f"{out}/s-%03d.tar", "--json") == 0
    got = summary(capsys)
    assert got["written"] == 3 and got["images"] == 4
    assert got["layouts"] == {"verl": 6}  # the row over the text bound is refused before its layout is read

    s = samples(out)
    assert list(s) == ["verl-0", "verl-1", "verl-2"]
    assert (s["verl-0"]["prompt"], s["verl-0"]["answer"]) == ("<image>How many people?", "1")
    assert s["verl-0"]["meta"] == {
        "data_source": "geo3k",
        "ability": "math",
        "reward_model": {"style": "rule"},
        "extra_info": {"split": "train", "index": 0},
        "created": "2025-01-02T03:04:05",  # a timestamp column, stored as its ISO string
    }
    assert s["verl-0"]["media"][0][2] == media_bytes(root, "astronaut.png")
    assert (s["verl-1"]["prompt"], s["verl-1"]["answer"]) == ("And <image> this?", "a cat")
    assert [t["role"] for t in s["verl-1"]["meta"]["conversation"]] == ["system", "user", "assistant"]
    assert [d for _, _, d in s["verl-1"]["media"]] == [coffee, chelsea]
    assert "answer" not in s["verl-2"]  # no ground truth: kept, without an answer (as a JSONL line without one)

    rej = rejections(out)
    assert {k: r["code"] for k, r in rej.items()} == {
        "verl-3": "not-an-image",
        "verl-4": "image-too-large",
        "verl-5": "bad-line",
        "verl-6": "bad-line",
    }
    assert (
        rej["verl-3"]["reason"] == "field 'images'[0] (inline bytes (path '3.png')): not an image Pillow can identify"
    )
    assert rej["verl-3"]["line"] == f"{src / 'verl.parquet'}:row 3"
    assert rej["verl-4"]["reason"].startswith("field 'images'[0] (inline bytes (path '4.png')): ")
    assert "characters of text (media bytes and data: URIs not counted) is over the limit" in rej["verl-5"]["reason"]
    assert rej["verl-6"]["reason"] == "field 'prompt' has no user turn: nothing to prompt with"


# --------------------------------------------------------------------------- datasets save_to_disk


@needs_real_media
def test_datasets_save_to_disk_folders(root, capsys):
    src, m = root / "src", root / "src" / "media"
    train = datasets.Dataset.from_dict(
        {
            "question": ["Who is this?", "What animal?", "What is written?"],
            "image": [str(m / "astronaut.png"), str(m / "chelsea.png"), str(m / "notes.png")],
            "audio": [str(m / "speech.wav"), None, None],
            "answer": ["an astronaut", "a cat", "nothing"],
        }
    )
    test = datasets.Dataset.from_dict(
        {
            "question": ["What is said?"],
            "image": [str(m / "camera.png")],
            "audio": [str(m / "long.wav")],
            "answer": ["x"],
        }
    )
    dd = datasets.DatasetDict({"train": train, "test": test})
    dd = dd.cast_column("image", datasets.Image()).cast_column("audio", datasets.Audio())
    folder = src / "hf-vqa"
    dd.save_to_disk(str(folder))
    out = root / "o-hf"
    assert make(folder, "--out", f"{out}/s-%03d.tar", "--max-audio-seconds", "3", "--json") == 0
    got = summary(capsys)
    assert got["written"] == 2 and got["layouts"] == {"vqa": 4} and got["clips"] == 1

    s = samples(out)
    assert list(s) == ["train-0", "train-1"]
    assert s["train-0"]["prompt"] == "<image><audio>Who is this?" and s["train-0"]["answer"] == "an astronaut"
    (_, _, img), (_, _, wav) = s["train-0"]["media"]
    assert (
        img == media_bytes(root, "astronaut.png") and abs(frames(wav) - sf.info(m / "speech.wav").duration * 16000) <= 1
    )
    assert s["train-1"]["media"][0][2] == media_bytes(root, "chelsea.png")
    rej = rejections(out)
    assert {k: r["code"] for k, r in rej.items()} == {"train-2": "not-an-image", "test-0": "audio-too-long"}
    assert (
        rej["train-2"]["reason"] == "field 'image' (inline bytes (path 'notes.png')): not an image Pillow can identify"
    )
    assert rej["train-2"]["line"] == f"{folder}/train:row 2"
    assert rej["test-0"]["reason"].startswith("field 'audio' (inline bytes (path 'long.wav')): ")
    # one split: its own folder (save_to_disk writes each split as a dataset folder)
    assert make(folder / "train", "--out", f"{root}/o-hf-train/s-%03d.tar") == 0
    assert "read as 3 vqa" in capsys.readouterr().out
    assert list(samples(root / "o-hf-train")) == ["train-0", "train-1"]

    # EasyR1 as a plain Dataset, its images a list of Image features
    easy = datasets.Dataset.from_dict(
        {
            "problem": ["<image>How many people?", "<image> and <image>: same drink?"],
            "images": [[str(m / "astronaut.png")], [str(m / "coffee.jpg")]],
            "answer": ["1", "yes"],
        }
    ).cast_column("images", datasets.List(datasets.Image()))
    easy.save_to_disk(str(src / "hf-easyr1"))
    before = sorted(os.listdir(src / "hf-easyr1"))
    out = root / "o-easyr1"
    assert make(src / "hf-easyr1", "--out", f"{out}/s-%03d.tar") == 0
    assert "read as 2 easyr1" in capsys.readouterr().out
    assert sorted(os.listdir(src / "hf-easyr1")) == before  # nothing written into the user's folder (no cache file)
    (only,) = samples(out).values()
    assert (only["id"], only["prompt"], only["answer"]) == ("hf-easyr1-0", "<image>How many people?", "1")
    assert only["media"][0][2] == media_bytes(root, "astronaut.png")
    (row,) = rejections(out).values()
    assert row["code"] == "marker-mismatch" and row["reason"].startswith("prompt has 2 <image> and 0 <audio>")


# --------------------------------------------------------------------------- a folder of data files


@needs_real_media
def test_a_folder_of_data_files_as_load_dataset_finds_them(root, capsys):
    folder = root / "src" / "hub"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("# a dataset card, not data\n")
    img = {"bytes": media_bytes(root, "camera.png"), "path": "camera.png"}
    for i, q in enumerate(["first", "second"]):
        table = pa.Table.from_pylist([{"id": f"{q}-{j}", "question": f"{q} {j}?", "image": img} for j in range(2)])
        pq.write_table(table, folder / "data" / f"train-{i:05d}-of-00002.parquet")
    (folder / "extra.jsonl").write_text(json.dumps({"id": "extra", "prompt": "text only"}) + "\n")
    out = root / "o-hub"
    assert make(folder, "--out", f"{out}/s-%03d.tar", "--strict") == 0
    capsys.readouterr()
    s = samples(out)
    assert list(s) == ["first-0", "first-1", "second-0", "second-1", "extra"]  # data/... before extra.jsonl
    assert s["second-1"]["prompt"] == "<image>second 1?" and s["second-1"]["media"][0][2] == img["bytes"]


# --------------------------------------------------------------------------- refused sources, --format


def test_sources_that_cannot_be_read_are_refused_naming_the_file(tmp_path, capsys, monkeypatch):
    import loomrl.datasets.sources as sources

    out = f"{tmp_path}/o/s-%d.tar"
    (tmp_path / "data.csv").write_text("id,prompt\na,hi\n")
    assert make(tmp_path / "data.csv", "--out", out) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path}/data.csv: not a source shards make reads; it reads .jsonl" in err
    assert ".parquet" in err and "save_to_disk" in err
    (tmp_path / "fake.parquet").write_text('{"prompt": "JSON with a parquet name"}\n')
    assert make(tmp_path / "fake.parquet", "--out", out) == 2
    assert f"{tmp_path}/fake.parquet: not a parquet file pyarrow can read" in capsys.readouterr().err
    (tmp_path / "obj.json").write_text('{"prompt": "an object, not a list"}')
    assert make(tmp_path / "obj.json", "--out", out) == 2
    assert f"{tmp_path}/obj.json: a .json source must hold a list of objects" in capsys.readouterr().err
    (tmp_path / "list.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b" * 200}, "not an object"]))
    monkeypatch.setattr(sources, "MAX_JSON_BYTES", 100)
    assert make(tmp_path / "list.json", "--out", out) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/list.json: a .json source is loaded whole and this one has" in err
    assert "over the limit of 100; convert it to JSONL" in err and "jq -c '.[]' list.json > list.jsonl" in err
    monkeypatch.undo()
    if hasattr(os, "mkfifo"):  # a FIFO inside a datasets folder is refused before load_from_disk opens anything
        datasets.Dataset.from_dict({"prompt": ["hi"]}).save_to_disk(str(tmp_path / "hf"))
        os.mkfifo(tmp_path / "hf" / "extra.arrow")
        assert make(tmp_path / "hf", "--out", out) == 2
        assert f"error: {tmp_path}/hf/extra.arrow: is a FIFO (named pipe)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert make(tmp_path / "empty", "--out", out) == 2
    assert "folder has no .jsonl, .json or .parquet files" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")
    # within the limit: the list is read, its bad element a bad-line naming its index
    assert make(tmp_path / "list.json", "--out", out) == 0
    (row,) = rejections(tmp_path / "o").values()
    assert (row["line"], row["code"]) == (f"{tmp_path}/list.json:[2]", "bad-line")
    assert row["reason"] == "a record must be an object, got str"
    capsys.readouterr()


def test_format_forces_a_layout_and_records_of_no_layout_are_bad_lines(tmp_path, capsys):
    lines = [
        {"id": "ll", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "none", "text": "no layout has this"},
        {"id": "easy", "problem": "2 + 2 ?", "answer": 4},
    ]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert make(tmp_path / "m.jsonl", "--out", f"{tmp_path}/a/s-%d.tar", "--json") == 0
    got = summary(capsys)
    assert got["layouts"] == {"llava": 1, "vqa": 1, "easyr1": 1} and got["written"] == 2
    s = samples(tmp_path / "a")
    assert (s["ll"]["prompt"], s["ll"]["answer"], s["easy"]["prompt"], s["easy"]["answer"]) == (
        "hi",
        "hello",
        "2 + 2 ?",
        "4",
    )
    (row,) = rejections(tmp_path / "a").values()
    assert row["id"] == "none" and row["code"] == "bad-line"
    assert row["reason"] == "the prompt, field 'prompt' or 'question' or 'query' or 'instruction', is missing"

    assert make(tmp_path / "m.jsonl", "--out", f"{tmp_path}/b/s-%d.tar", "--format", "chat", "--json") == 1
    assert summary(capsys)["layouts"] == {"chat": 3}
    rej = rejections(tmp_path / "b")
    assert {r["reason"] for r in rej.values()} == {"field 'messages' must be a non-empty list of turns"}
    with pytest.raises(SystemExit):
        make(tmp_path / "m.jsonl", "--out", f"{tmp_path}/c/s-%d.tar", "--format", "alpaca")
    assert "invalid choice: 'alpaca'" in capsys.readouterr().err


# --------------------------------------------------------------------------- the pieces


def test_decoded_size_is_counted_exactly_without_decoding():
    for n in range(40):
        data = bytes(range(n))
        for text in (base64.b64encode(data).decode(), base64.encodebytes(data).decode()):  # with line breaks too
            inline = resolve(f"data:application/octet-stream;base64,{text}", "'x'")
            assert isinstance(inline, Inline) and decoded_size(inline) == n


def test_media_values_resolve_to_paths_or_inline_bytes():
    assert resolve("file:///data/a%20b.png", "'f'") == "/data/a b.png"
    assert resolve("file://localhost/data/a.png", "'f'") == "/data/a.png"
    assert resolve("file:rel/a.png", "'f'") == "rel/a.png"
    assert resolve({"bytes": None, "path": "img/a.png"}, "'f'") == "img/a.png"
    assert resolve({"bytes": b"x", "path": "a.png"}, "'f'") == Inline("'f'", "inline bytes (path 'a.png')", data=b"x")
    assert resolve("data:,a%20b", "'f'") == Inline("'f'", "a data:text/plain URI", encoded="a%20b")
    for bad, reason in (
        ("file://server/share/a.png", "names the host 'server'"),
        ("s3://bucket/a.png", "is a remote URL"),
        ("data:image/png;base64", "is not a data: URI"),
        ({"bytes": "text", "path": None}, "'bytes' must be binary data or null"),
        ({"bytes": None, "path": None}, "has neither bytes nor a path"),
    ):
        with pytest.raises(ValueError, match=reason):
            resolve(bad, "'f'")
