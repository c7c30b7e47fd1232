"""Video through Qwen2-VL and Qwen2.5-VL checkpoints (tiny, built from configs with transformers) on
real clips encoded with PyAV: the sampling, the patches, M-RoPE with absolute time, the logits
against transformers' forward, the encoder's dedup, and the guards against hostile clips."""

import dataclasses
import json
import re
import struct
import tarfile

import pytest
import torch
from qwen_checkpoints import VOCAB, _qwen2_vl, clip

from loomrl.encoders.base import load_medium
from loomrl.encoders.config import VisionConfig
from loomrl.encoders.video import read_video, sample_indices
from loomrl.platform.backbone.mrope import rope_index
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.recipe import ModelConfig

MODEL = ModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    tie_word_embeddings=False,
    vision=VisionConfig(min_pixels=56 * 56, max_pixels=112 * 112, video_min_pixels=56 * 56, video_max_pixels=112 * 112),
)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _qwen2_vl(str(folder), request.param, vocab_size=VOCAB + 16)
    cfg = dataclasses.replace(MODEL, tokenizer=str(folder), init_from=str(folder))
    tokenizer = load_tokenizer(str(folder))
    return request.param, hf, tokenizer, build_policy(cfg, tokenizer, seed=0).eval()


def _hf_logits(hf, ids, media, position_ids=None):
    videos = [m for m in media if m.kind == "video"]
    images = [m for m in media if m.kind == "image"]
    kw = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == hf.config.image_token_id).long() + 2 * (ids == hf.config.video_token_id).long(),
        pixel_values_videos=torch.cat([m.features for m in videos]),
        video_grid_thw=torch.stack([m.grid for m in videos]),
    )
    if images:
        kw.update(
            pixel_values=torch.cat([m.features for m in images]), image_grid_thw=torch.stack([m.grid for m in images])
        )
    if hf.config.model_type == "qwen2_5_vl":
        kw["second_per_grid_ts"] = torch.tensor([m.seconds_per_grid for m in videos])
    if position_ids is not None:
        kw["position_ids"] = position_ids
    with torch.no_grad():
        return hf(**kw).logits[0, :-1]


def test_frames_are_sampled_as_qwen_vl_utils_does():
    cfg = VisionConfig(video_fps=2.0, video_min_frames=4, video_max_frames=32)
    # 8 s at 30 fps: 2 per second = 16 frames, evenly from the first to the last
    idx = sample_indices(240, 30.0, cfg)
    assert len(idx) == 16 and idx[0] == 0 and idx[-1] == 239
    assert len(sample_indices(30, 30.0, cfg)) == 4  # 1 s: 2 frames, raised to video_min_frames
    assert sample_indices(7, 30.0, cfg) == [0, 2, 4, 6]  # 0.23 s: raised to video_min_frames
    assert sample_indices(3, 30.0, cfg) == [0, 2]  # fewer frames than min_frames: its own, rounded down
    assert sample_indices(1, 30.0, cfg) == [0]  # one frame: repeated to fill the temporal patch later
    assert len(sample_indices(3000, 30.0, cfg)) == 32  # video_max_frames
    frames, times, fps = read_video(clip(frames=12, fps=4), cfg)  # 3 s -> 6 frames, 2 a second
    assert frames.shape == (6, 64, 80, 3) and fps == pytest.approx(2.0)
    assert times == pytest.approx([0, 0.5, 1.0, 1.75, 2.25, 2.75])  # frames 0, 2, 4, 7, 9, 11 at 4 fps


def test_video_logits_equal_transformers(checkpoint):
    kind, hf, tok, policy = checkpoint
    # 1 s at 8 fps: 4 frames (video_min_frames) -> 2 temporal patches of 0.5 s; short enough that
    # transformers' rule for the text after a clip agrees with loomrl's (see test_video_positions_follow_time)
    video = load_medium("video", clip(seed=1, frames=8, fps=8), policy.cfg)
    assert video.grid.tolist() == [2, 4, 6] and video.seconds_per_grid == pytest.approx(0.5)
    image = load_medium("image", _png(), policy.cfg)
    media = [video, image]
    prompt = policy.prompt_ids(tok, "w1 <video> w2 <image> w3", media)
    assert prompt.count(hf.config.video_token_id) == 2 * 4 * 6 // 4
    completion = tok("w5 w6 w7 w8", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        got, _ = policy.sequence_logprobs(ids, torch.ones_like(ids), [media])
    logits = _hf_logits(hf, ids, media)
    logits[:, policy.banned_token_ids] = float("-inf")
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    scored = ~torch.isin(ids[0, 1:], policy.banned_token_ids)
    assert torch.allclose(got[0][scored], want[scored], atol=1e-4), (got[0][scored] - want[scored]).abs().max()
    # the clip's frames matter: another clip's tokens score differently
    other = load_medium("video", clip(seed=2, frames=8, fps=8), policy.cfg)
    with torch.no_grad():
        moved, _ = policy.sequence_logprobs(ids, torch.ones_like(ids), [[other, image]])
    assert (moved[0][scored] - got[0][scored]).abs().max() > 1e-4


def test_video_positions_follow_time(checkpoint):
    kind, hf, tok, policy = checkpoint
    # 12 s at 2 frames a second: 12 temporal patches, more than the frame's 2 x 3 merged grid
    video = load_medium("video", clip(seed=3, frames=48, fps=4), policy.cfg)
    assert int(video.grid[0]) == 12
    ids = torch.tensor([policy.prompt_ids(tok, "w1 <video> w2 w3", [video])])
    positions, _ = policy.position_ids(ids, torch.ones_like(ids), [[video]])
    t = positions[0, 0]
    is_video = ids[0] == hf.config.video_token_id
    interval = 4 * video.seconds_per_grid if kind == "qwen2_5_vl" else 1  # vision_config.tokens_per_second = 4
    assert t[is_video].max() - t[is_video].min() == int(11 * interval)
    # the text after the clip continues at its largest position + 1 (vLLM's rule; transformers 5.19
    # continues at start + max(h, w) and overlaps the clip's temporal positions here)
    after = int(is_video.nonzero().max()) + 2  # past <|vision_end|>
    assert int(positions[0, 0, after]) == int(positions[:, 0, : after - 1].max()) + 2
    mm = (ids == hf.config.video_token_id).long() * 2
    kw = {"second_per_grid_ts": torch.tensor([video.seconds_per_grid])} if kind == "qwen2_5_vl" else {}
    theirs, _ = hf.model.get_rope_index(ids, mm, None, video.grid[None], attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(theirs[:, :, : after - 1], positions[:, :, : after - 1])  # the clip itself agrees
    assert int(theirs[0, 0, after]) < int(positions[0, 0, after])
    # with loomrl's positions, transformers' forward gives loomrl's log-probs on this long clip too
    completion = tok("w5 w6 w7", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ids[0].tolist() + completion])
    positions, _ = policy.position_ids(ids, torch.ones_like(ids), [[video]])
    with torch.no_grad():
        got, _ = policy.sequence_logprobs(ids, torch.ones_like(ids), [[video]])
    logits = _hf_logits(hf, ids, [video], position_ids=positions)
    logits[:, policy.banned_token_ids] = float("-inf")
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    scored = ~torch.isin(ids[0, 1:], policy.banned_token_ids)
    assert torch.allclose(got[0][scored], want[scored], atol=1e-4), (got[0][scored] - want[scored]).abs().max()


def test_a_repeated_clip_is_encoded_once(checkpoint):
    kind, hf, tok, policy = checkpoint
    data = clip(seed=4, frames=8, fps=4)
    rows = [[load_medium("video", data, policy.cfg)], [load_medium("video", data, policy.cfg)]]
    policy.encoding_cache.clear()
    with torch.no_grad():
        enc, stats = policy.encode([m for row in rows for m in row])
    assert stats.calls == 1 and stats.media_total == 2 and len(enc) == 1
    with torch.no_grad():
        naive, naive_stats = policy.encode([m for row in rows for m in row], dedup=False)
    assert naive_stats.calls == 2 and torch.equal(naive[0], next(iter(enc.values())))


def test_rope_index_refuses_media_that_do_not_fit():
    ids = torch.tensor([[1, 9, 9, 9, 9, 2]])
    with pytest.raises(ValueError, match="more media placeholders than media"):
        rope_index(ids, torch.ones_like(ids), [[]], {9}, 2)
    with pytest.raises(ValueError, match="cut off"):
        rope_index(ids, torch.ones_like(ids), [[(torch.tensor([2, 4, 4]), 1.0)]], {9}, 2)


def _png():
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(60, 80, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def _avi(width, height, frames=4, claim_frames=None):
    """A real raw-video AVI of 16x16 frames whose headers then claim width x height frames (the
    size of raw video is the container's) and, optionally, `claim_frames` frames."""
    data = bytearray(clip(frames=frames, height=16, width=16, container="avi", codec="rawvideo"))
    strf, avih, strh = data.index(b"strf") + 8, data.index(b"avih") + 8, data.index(b"strh") + 8
    data[strf + 4 : strf + 12] = struct.pack("<ii", width, height)  # BITMAPINFOHEADER biWidth, biHeight
    data[avih + 32 : avih + 40] = struct.pack("<II", width, height)  # dwWidth, dwHeight
    if claim_frames is not None:
        data[avih + 16 : avih + 20] = struct.pack("<I", claim_frames)  # dwTotalFrames
        data[strh + 32 : strh + 36] = struct.pack("<I", claim_frames)  # dwLength
    return bytes(data)


def hostile_clips() -> dict[str, tuple[bytes, str, str]]:
    """name -> (bytes, the rejection code `shards make` gives, a piece of its reason)."""
    faststart = clip(seed=5, frames=8, options={"movflags": "faststart"})  # the header first: a cut shows
    return {
        "truncated.mp4": (faststart[: len(faststart) // 2], "bad-video", "truncated: the header says 8 frames"),
        "cut_index.mp4": (clip(seed=5, frames=8)[:-300], "not-a-video", "not a video FFmpeg can open"),
        "billion.avi": (_avi(16, 16, claim_frames=10**9), "video-too-long", "claims 1000000000 frames"),
        "huge.avi": (_avi(30000, 30000), "bad-video", "no frame size FFmpeg can use"),
        "large.avi": (_avi(10000, 10000), "video-too-large", "10000x10000 pixels exceed the limit"),
        "picture.mp4": (_png(), "not-a-video", "not a video container"),
        "text.mp4": (b"this is not a video, just text with an .mp4 name\n" * 20, "not-a-video", "FFmpeg can open"),
    }


def test_hostile_clips_never_reach_training(checkpoint):
    kind, hf, tok, policy = checkpoint
    for name, (data, _, reason) in hostile_clips().items():
        with pytest.raises(ValueError, match=re.escape(reason)):
            load_medium("video", data, policy.cfg)
    with pytest.raises(ValueError, match="over the limit of 1 s"):  # vision.max_video_seconds
        load_medium(
            "video",
            clip(frames=12, fps=4),
            dataclasses.replace(policy.cfg, vision=dataclasses.replace(policy.cfg.vision, max_video_seconds=1.0)),
        )


def test_shards_make_rejects_hostile_clips_with_their_reason(tmp_path, capsys):
    from loomrl.datasets.cli import main
    from loomrl.datasets.shards import read_shards

    media = tmp_path / "media"
    media.mkdir()
    (media / "good.mp4").write_bytes(clip(seed=6, frames=8))
    (media / "good.mkv").write_bytes(clip(seed=7, frames=6, container="matroska"))
    rows = [
        {"id": "good", "prompt": "<video> what moves ?", "answer": "noise", "videos": ["media/good.mp4"]},
        {
            "id": "chat",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "video", "video": "media/good.mkv"}, {"type": "text", "text": "and here ?"}],
                }
            ],
        },
    ]
    hostile = hostile_clips()
    for name, (data, _, _) in hostile.items():
        (media / name).write_bytes(data)
        rows.append({"id": name.split(".")[0], "prompt": "<video> what moves ?", "videos": [f"media/{name}"]})
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "shards"
    assert main(["make", str(tmp_path / "train.jsonl"), "--out", f"{out}/train-%06d.tar"]) == 0
    rejected = {r["id"]: r for r in map(json.loads, (out / "train-rejected.jsonl").read_text().splitlines())}
    assert sorted(rejected) == sorted(name.split(".")[0] for name in hostile)
    for name, (_, code, reason) in hostile.items():
        r = rejected[name.split(".")[0]]
        assert (r["code"], r["file"].endswith(name)) == (code, True) and reason in r["reason"], r
    samples = list(read_shards(sorted(str(p) for p in out.glob("*.tar"))))
    assert sorted(s["id"] for s in samples) == ["chat", "good"]
    stored = {s["id"]: s["media"][0] for s in samples}
    assert stored["good"][0] == stored["chat"][0] == "video"
    assert stored["good"][2] == (media / "good.mp4").read_bytes()  # stored as it came, not re-encoded
    with tarfile.open(next(out.glob("*.tar"))) as tar:
        assert {"good.vid0.mp4", "chat.vid0.mkv"} <= set(tar.getnames())
    assert f"rejected {len(hostile)}:" in capsys.readouterr().out
    assert main(["verify", f"{out}/train-*.tar"]) == 0
