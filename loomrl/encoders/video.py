"""Video clips for the Qwen2-VL / Qwen2.5-VL vision tower: decoding with bounds, frame sampling and
the processor's patches.

A clip is decoded with PyAV (FFmpeg), guarded like images and audio before anything big is
made: the container must be a video container (mp4/mov, mkv/webm, avi, mpeg, mpeg-ts, ogg, flv;
a PNG renamed .mp4 is refused, though FFmpeg would open it as a one-frame stream), its header's
duration and frame count are checked against `vision.max_video_seconds` (a clip claiming 10^9
frames is refused before one is decoded), its packets are counted with the same bound (a header
that lies cannot make the reader walk forever), each decoded frame's size is checked against the
image pixel limit before it becomes an array, and a file that holds fewer frames than its header
promises (truncated) is refused.

Frames are sampled as qwen-vl-utils (the reference the Qwen-VL models were trained with) does:
`video_fps` frames per second of the clip, bounded by `video_min_frames` / `video_max_frames`,
rounded down to a multiple of the temporal patch, at `linspace(0, total - 1, n).round()`. Each
frame is resized with smart_resize under `video_min_pixels` / `video_max_pixels` (one size for
the clip), normalised like an image, and the clip is patched exactly as an image is, temporal
patches being pairs of consecutive sampled frames (a clip with an odd count repeats its last
frame): `vision.patchify`. The medium carries `seconds_per_grid` (temporal patch / sampling
rate), which Qwen2.5-VL's M-RoPE turns into absolute time (`mrope.py`).

A clip is a medium like an image: `<video>` in prompts, `videos` in manifests, `vidN.mp4` in
shards, the content hash of its bytes as its encoding-cache key, and the policy's vision tower
(`visual`, owned by the image modality) encodes it. Qwen3-VL's video layout (a timestamp text
before each temporal patch) is not built: its checkpoints read images only.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import av
import numpy as np
import torch
from PIL import Image
from torch import nn

from loomrl.encoders.base import MediaTokens, Modality, register
from loomrl.encoders.config import VisionConfig
from loomrl.encoders.media import Medium, content_hash, settings_fingerprint
from loomrl.encoders.vision import encode_images, normalised, patchify, smart_resize

if TYPE_CHECKING:
    from loomrl.platform.backbone.config import ModelConfig

VIDEO_CONTAINERS = frozenset({"mov", "mp4", "m4a", "3gp", "3g2", "mj2", "matroska", "webm", "avi", "mpeg", "mpegts"})
VIDEO_CONTAINERS |= {"ogg", "flv"}
"""FFmpeg demuxer names (a demuxer may carry several, "mov,mp4,m4a,...") of the containers read."""
MAX_FPS = 240
"""The most frames per second a clip may hold: with `max_video_seconds`, the bound on the frames
(packets) counted and decoded from one clip."""
DEFAULT_MAX_PIXELS = 50_000_000
"""A decoded frame's area limit (`shards make --max-pixels`' default, as for images)."""


class VideoTooLong(ValueError):
    """A clip over the length (or frame) limit, found before it was decoded."""


class VideoTooLarge(ValueError):
    """A clip whose frames are over the pixel limit, found before they became arrays."""


@dataclass
class VideoInfo:
    """What a clip's container says, checked: frames (counted), frames per second, size."""

    frames: int
    fps: float
    width: int
    height: int


def _open(data: bytes):
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.FFmpegError as e:
        raise ValueError(f"not a video FFmpeg can open ({e})") from None
    names = set(container.format.name.split(","))
    if not names & VIDEO_CONTAINERS:
        container.close()
        raise ValueError(
            f"a {container.format.name!r} file, not a video container ({', '.join(sorted(VIDEO_CONTAINERS))})"
        )
    if not container.streams.video:
        container.close()
        raise ValueError("the container has no video stream")
    return container


def probe_video(container, max_seconds: float, max_pixels: int) -> VideoInfo:
    """The checked facts of a clip's first video stream; ValueError naming the bound it breaks.
    Reads packets (no decoding) to count the frames, at most max_seconds x MAX_FPS of them."""
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:  # FFmpeg drops a size it refuses (over 2^28 pixels) and reads none
        raise ValueError(
            f"the video stream has no frame size FFmpeg can use ({width}x{height}; it refuses frames of "
            "over 2^28 pixels)"
        )
    if width * height > max_pixels:
        raise VideoTooLarge(f"frames of {width}x{height} pixels exceed the limit {max_pixels}")
    budget = math.ceil(max_seconds * MAX_FPS)
    if stream.frames > budget:
        raise VideoTooLong(
            f"the container claims {stream.frames} frames, over the {budget} a clip of at most "
            f"{max_seconds:g} s may have ({MAX_FPS} per second)"
        )
    seconds = None
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / 1_000_000
    if seconds is not None and seconds > max_seconds:
        raise VideoTooLong(f"clip of {seconds:.1f} s is over the limit of {max_seconds:g} s")
    frames, last = 0, 0.0
    for packet in container.demux(stream):
        if packet.size == 0:  # the demuxer's end-of-stream flush
            continue
        frames += 1
        if packet.pts is not None and packet.time_base is not None:
            last = max(last, float(packet.pts * packet.time_base))
        if frames > budget or last > max_seconds:
            raise VideoTooLong(f"clip holds more than {max_seconds:g} s of frames (over the limit)")
    if frames == 0:
        raise ValueError("the video stream has no frames")
    if stream.frames and frames < stream.frames:
        raise ValueError(f"truncated: the header says {stream.frames} frames, the file holds {frames}")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else (frames / seconds if seconds else 0.0)
    if not 0 < fps <= MAX_FPS:
        raise ValueError(f"the clip's frame rate {fps:g} is not within (0, {MAX_FPS}]")
    return VideoInfo(frames, fps, width, height)


def sample_indices(total: int, video_fps: float, cfg: VisionConfig) -> list[int]:
    """Which of a clip's `total` frames are sampled (qwen-vl-utils' smart_nframes): `cfg.video_fps`
    per second, within [video_min_frames, video_max_frames] and the clip's own count, rounded down
    to a multiple of the temporal patch; all of them when the clip is shorter than one patch."""
    factor = cfg.temporal_patch_size
    if total < factor:
        return list(range(total))
    lo = math.ceil(cfg.video_min_frames / factor) * factor
    hi = max(factor, math.floor(min(cfg.video_max_frames, total) / factor) * factor)
    n = min(max(total / video_fps * cfg.video_fps, lo), hi, total)
    n = max(factor, math.floor(n / factor) * factor)
    return torch.linspace(0, total - 1, n).round().long().tolist()


def _decode(data: bytes, info: VideoInfo, wanted: set[int], max_pixels: int) -> dict[int, np.ndarray]:
    """Decode a clip's first video stream up to its last wanted frame; the wanted frames as RGB arrays.
    Every decoded frame's size is checked first; fewer frames than the probe counted is truncation."""
    frames: dict[int, np.ndarray] = {}
    last = max(wanted) if wanted else info.frames - 1
    decoded = 0
    try:
        with _open(data) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i > last:
                    break
                decoded = i + 1
                if frame.width * frame.height > max_pixels:
                    raise VideoTooLarge(
                        f"frame {i} of {frame.width}x{frame.height} pixels exceeds the limit {max_pixels}"
                    )
                if i in wanted:
                    frames[i] = frame.to_ndarray(format="rgb24")
    except av.FFmpegError as e:
        raise ValueError(f"cannot decode the clip ({e})") from None
    if decoded <= last:
        raise ValueError(f"truncated: {decoded} of the {info.frames} frames the container holds decode")
    return frames


def _probe(data: bytes, max_seconds: float, max_pixels: int) -> tuple[VideoInfo, str]:
    try:
        with _open(data) as container:
            return probe_video(container, max_seconds, max_pixels), container.format.name
    except av.FFmpegError as e:
        raise ValueError(f"cannot read the clip ({e})") from None


# container (FFmpeg demuxer name) -> the extension a shard stores the clip under
EXTENSIONS = {"mov": "mp4", "matroska": "mkv", "avi": "avi", "mpeg": "mpg", "mpegts": "ts", "ogg": "ogv", "flv": "flv"}


def check_video(data: bytes, max_seconds: float, max_pixels: int) -> tuple[str, VideoInfo]:
    """(the extension to store it under, its facts) of a clip that decodes whole within the bounds:
    what `shards make` and `shards verify` accept. VideoTooLong / VideoTooLarge / ValueError."""
    info, fmt = _probe(data, max_seconds, max_pixels)
    _decode(data, info, set(), max_pixels)
    ext = next((e for name, e in EXTENSIONS.items() if name in fmt.split(",")), "mp4")
    return ext, info


def read_video(
    data: bytes, cfg: VisionConfig, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[np.ndarray, list[float], float]:
    """(sampled frames [T, H, W, 3] uint8, each one's time in the clip in seconds, the sampling rate
    in frames per second: qwen-vl-utils' sampled / total x the clip's rate) of a clip's bytes;
    ValueError (naming the bound, or FFmpeg's reason) for anything that is not a readable clip
    within `cfg.max_video_seconds` and `max_pixels` per frame."""
    info, _ = _probe(data, cfg.max_video_seconds, max_pixels)
    wanted = sample_indices(info.frames, info.fps, cfg)
    frames = _decode(data, info, set(wanted), max_pixels)
    sample_fps = len(wanted) / info.frames * info.fps
    return np.stack([frames[i] for i in wanted]), [i / info.fps for i in wanted], sample_fps


def patch_times(times: list[float], temporal_patch: int) -> tuple[float, ...]:
    """Each temporal patch's time: the mean of its first and last frame's (a short last patch repeats
    its last frame), as Qwen3-VL's processor stamps them (`_calculate_timestamps`)."""
    times = times + times[-1:] * (-len(times) % temporal_patch)
    return tuple((times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch))


def preprocess_settings(cfg: VisionConfig) -> dict:
    """Everything that decides a clip's patches: part of its encoding-cache key."""
    return {
        "kind": "video",
        "patch_size": cfg.patch_size,
        "temporal_patch_size": cfg.temporal_patch_size,
        "spatial_merge_size": cfg.spatial_merge_size,
        "fps": cfg.video_fps,
        "min_frames": cfg.video_min_frames,
        "max_frames": cfg.video_max_frames,
        "min_pixels": cfg.video_min_pixels,
        "max_pixels": cfg.video_max_pixels,
        "resample": "bicubic",
        "mean": list(cfg.image_mean),
        "std": list(cfg.image_std),
    }


def preprocess_video(frames: np.ndarray, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches [N, C*T*P*P], grid_thw [3]) of sampled frames [T, H, W, 3] uint8: each frame resized
    to the clip's smart_resize size (bicubic, as images), normalised, then patched (`patchify`)."""
    factor = cfg.patch_size * cfg.spatial_merge_size
    height, width = frames.shape[1:3]
    h, w = smart_resize(height, width, factor, cfg.video_min_pixels, cfg.video_max_pixels)
    out = []
    for f in frames:
        im = Image.fromarray(f)
        if (h, w) != (height, width):
            im = im.resize((w, h), Image.BICUBIC)
        out.append(normalised(im, cfg))
    return patchify(np.stack(out), cfg)


def num_video_tokens(grid_thw: torch.Tensor, cfg: VisionConfig) -> int:
    return int(grid_thw.prod()) // (cfg.spatial_merge_size**2)


@register("video")
class VideoModality(Modality):
    """Video clips: `<video>` in prompts, `videos` in manifests; the vision tower encodes them (it is
    the image modality's: this one adds no module and no freeze part)."""

    order, marker, manifest_keys, file_prefix = 2, "<video>", ("videos", "video"), "vid"
    noun, tower_name, tower_attrs = "video", "vision", ()
    checkpoint_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

    @classmethod
    def load(cls, data: bytes, cfg: ModelConfig) -> Medium:
        frames, times, fps = read_video(data, cfg.vision)
        patches, grid = preprocess_video(frames, cfg.vision)
        prep = settings_fingerprint(preprocess_settings(cfg.vision))
        tps = cfg.vision.temporal_patch_size
        return Medium("video", content_hash(data), patches, grid, prep, tps / fps, patch_times(times, tps))

    @classmethod
    def num_tokens(cls, medium: Medium, cfg: ModelConfig) -> int:
        return num_video_tokens(medium.grid, cfg.vision)

    @classmethod
    def prompt_tokens(cls, medium: Medium, spec: MediaTokens, tokenizer, cfg: ModelConfig) -> list[int]:
        if not spec.per_frame:
            return super().prompt_tokens(medium, spec, tokenizer, cfg)
        per_patch = num_video_tokens(medium.grid, cfg.vision) // int(medium.grid[0])
        out: list[int] = []
        for t in medium.times:  # Qwen3-VL: "<1.2 seconds>" then the patch's own framed placeholders
            out += tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False)["input_ids"]
            out += [*spec.before, *[spec.placeholder] * per_patch, *spec.after]
        return out

    @classmethod
    def rope_grids(cls, medium: Medium, spec: MediaTokens) -> list[tuple[torch.Tensor, Optional[float]]]:
        if spec.per_frame:  # each temporal patch is its own run, with text between
            one = medium.grid.clone()
            one[0] = 1
            return [(one, None)] * int(medium.grid[0])
        return [(medium.grid, medium.seconds_per_grid)]

    @classmethod
    def build_demo(cls, model: nn.Module, cfg: ModelConfig) -> None:
        pass  # the image modality builds the vision tower

    @classmethod
    def build_from_checkpoint(cls, model: nn.Module, hf_config: dict, where: str) -> None:
        pass

    @classmethod
    def tower(cls, model: nn.Module) -> Optional[nn.Module]:
        return model.visual

    @classmethod
    def parameter_parts(cls, model: nn.Module) -> dict[str, list[nn.Parameter]]:
        return {}  # the vision tower's parts are the image modality's

    @classmethod
    def batch(cls, media: list[Medium]) -> tuple[torch.Tensor, ...]:
        return torch.cat([m.features for m in media]), torch.stack([m.grid for m in media])

    @classmethod
    def encode(cls, tower: nn.Module, inputs: tuple, media: list[Medium], cfg: ModelConfig) -> list[torch.Tensor]:
        return list(encode_images(tower, *inputs).split([cls.num_tokens(m, cfg) for m in media]))

    @classmethod
    def checkpoint_tokens(cls, tokenizer, hf_config: dict, checked) -> Optional[MediaTokens]:
        if "video_token_id" not in hf_config or hf_config.get("model_type") not in cls.checkpoint_types:
            return None
        return MediaTokens(
            checked("video_token_id", hf_config["video_token_id"]),
            tuple(checked(k, hf_config[k]) for k in ("vision_start_token_id",) if k in hf_config),
            tuple(checked(k, hf_config[k]) for k in ("vision_end_token_id",) if k in hf_config),
            per_frame=hf_config["model_type"] == "qwen3_vl",
        )
