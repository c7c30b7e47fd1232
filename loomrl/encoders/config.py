"""Settings of the vision and audio towers and of the encoding cache (`model.vision`, `model.audio`,
`model.encoders`)."""

from __future__ import annotations

from dataclasses import dataclass

from loomrl.config.schema import ranged

HOP = 160  # samples between mel frames (10 ms at 16 kHz)
MAX_IMAGE_PIXELS = 8192 * 8192
"""The largest image area (`vision.min_pixels` / `max_pixels`, a recipe's or init_from's
preprocessor_config.json's) loomrl resizes to: 67M pixels, ~5x Qwen2-VL's default max_pixels
(12845056); beyond it one image's buffers alone would be gigabytes."""


MAX_VIDEO_FRAMES = 4096
"""The most frames loomrl samples from one clip (`vision.video_max_frames`): qwen-vl-utils' 768 with
room; each sampled frame is a resized image held in memory until the clip is patched."""
MAX_VIDEO_SECONDS = 3 * 3600
"""The longest clip a recipe may allow (`vision.max_video_seconds`)."""


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class VisionConfig:
    """Qwen2-VL vision tower (transformers' Qwen2VisionTransformerPretrainedModel). With a Qwen2-VL /
    Qwen2.5-VL `model.init_from`, the sizes are the checkpoint's (config.json's vision_config;
    min/max_pixels: preprocessor_config.json's unless the recipe sets them)."""

    depth: int = ranged(2, ge=1)
    """Transformer blocks in the vision tower."""
    embed_dim: int = ranged(64, ge=1)
    """Width of the vision transformer."""
    num_heads: int = ranged(4, ge=1)
    """Attention heads in the vision tower."""
    patch_size: int = ranged(14, ge=1)
    """Spatial patch size in pixels (Qwen2-VL: 14)."""
    temporal_patch_size: int = ranged(2, ge=1)
    """Frames per patch; a still image is repeated to fill it (Qwen2-VL: 2)."""
    spatial_merge_size: int = ranged(2, ge=1)
    """Patches merged per side into one language token by the merger (Qwen2-VL: 2)."""
    min_pixels: int = ranged(56 * 56, ge=1, le=MAX_IMAGE_PIXELS)
    """Lower bound on resized image area (Qwen2-VL's smart_resize)."""
    max_pixels: int = ranged(56 * 56, ge=1, le=MAX_IMAGE_PIXELS)
    """Upper bound on resized image area; the demo keeps images at 56x56 = 4 tokens."""
    image_mean: list[float] = ranged(list(CLIP_MEAN), ge=-10, le=10)
    """Per-channel (RGB) mean a pixel in [0, 1] is normalised with: CLIP's for Qwen2-VL / Qwen2.5-VL,
    0.5 for Qwen3-VL (preprocessor_config.json's `image_mean` with model.init_from)."""
    image_std: list[float] = ranged(list(CLIP_STD), gt=0, le=10)
    """Per-channel (RGB) standard deviation, likewise (`image_std`)."""
    video_fps: float = ranged(2.0, gt=0, le=240)
    """Frames per second sampled from a clip (qwen-vl-utils' FPS), before the bounds below; the count is
    rounded down to a multiple of `temporal_patch_size` (video_preprocessor_config.json's `fps`)."""
    video_min_frames: int = ranged(4, ge=1, le=MAX_VIDEO_FRAMES)
    """Fewest frames sampled from a clip (a clip with fewer frames gives all it has)."""
    video_max_frames: int = ranged(32, ge=1, le=MAX_VIDEO_FRAMES)
    """Most frames sampled from a clip (qwen-vl-utils: 768; kept small for CPU runs)."""
    video_min_pixels: int = ranged(56 * 56, ge=1, le=MAX_IMAGE_PIXELS)
    """Lower bound on a sampled frame's resized area (smart_resize, as for images)."""
    video_max_pixels: int = ranged(112 * 112, ge=1, le=MAX_IMAGE_PIXELS)
    """Upper bound on a sampled frame's resized area (the video processor's `size.longest_edge`)."""
    max_video_seconds: float = ranged(600.0, gt=0, le=MAX_VIDEO_SECONDS)
    """Longest clip read (from its header, before decoding); a longer one is refused."""


@dataclass
class AudioConfig:
    """Qwen2-Audio (Whisper-style) audio tower and its log-mel front end. With a Qwen2-Audio
    `model.init_from`, the sizes are the checkpoint's (config.json's audio_config; clip_seconds
    from its max_source_positions at sample_rate)."""

    layers: int = ranged(2, ge=1)
    """Transformer layers in the audio encoder."""
    d_model: int = ranged(64, ge=1)
    """Width of the audio encoder."""
    num_heads: int = ranged(4, ge=1)
    """Attention heads in the audio encoder."""
    ffn_dim: int = ranged(128, ge=1)
    """Feed-forward width in the audio encoder."""
    num_mel_bins: int = ranged(80, ge=1)
    """Mel bins of the log-mel spectrogram (Whisper: 80, Qwen2-Audio: 128)."""
    sample_rate: int = ranged(16000, ge=1000, le=384000)
    """Audio is resampled to this rate, mono."""
    clip_seconds: float = ranged(1.0, gt=0, le=3600)
    """Clips are padded or cut to this length; it fixes the encoder's positions
    (100 mel frames per second, 4 frames per output token)."""


@dataclass
class EncoderConfig:
    """How the vision and audio towers are run and cached."""

    frozen: bool = False
    """Freeze both towers (no gradients); their encodings are then cached across
    steps in a bounded LRU keyed by content hash + encoder identity."""
    cache_size: int = ranged(4096, ge=0)
    """Encodings kept by the cross-step LRU when `frozen` (0 = no cross-step cache)."""
    dedup: bool = True
    """Encode each distinct medium once per mini-batch and route its gradient from
    every micro-batch that uses it (false: encode every copy, the naive path)."""


def num_frames(cfg: AudioConfig) -> int:
    """Mel frames per clip (even: the encoder's second conv has stride 2)."""
    frames = int(round(cfg.clip_seconds * cfg.sample_rate / HOP))
    return frames + frames % 2
