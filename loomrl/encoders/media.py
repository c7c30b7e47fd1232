"""A medium (image or audio clip) as the model consumes it: its content hash,
the fingerprint of the preprocessing that made its features, and the features."""
from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from loomrl.platform.recipe import ModelConfig


@dataclass
class Medium:
    kind: str                   # "image" or "audio"
    hash: str                   # sha256 of the stored bytes (with prep: the encoding cache's key)
    features: torch.Tensor      # image: patches [N, C*T*P*P]; audio: log-mel [mel, frames]
    grid: Optional[torch.Tensor] = None  # image: grid_thw [3]
    prep: str = ""              # fingerprint of the preprocessing settings (see settings_fingerprint)

    @property
    def nbytes(self) -> int:
        return self.features.numel() * self.features.element_size()

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the features: the same bytes preprocessed differently are different inputs."""
        return self.hash, self.prep


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def settings_fingerprint(settings: dict) -> str:
    """Short stable hash of a JSON-able settings dict (preprocessing, encoder config)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def decode_image(data: bytes, max_pixels: int = 50_000_000):
    """PIL image from bytes, refusing decompression bombs (pixel limit) and non-images."""
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:
        raise ValueError(str(e)) from None
    with im:
        if im.width * im.height > max_pixels:
            raise ValueError(f"image of {im.width}x{im.height} pixels exceeds the limit {max_pixels}")
        im.load()
        return im.convert("RGB")


def decode_audio(data: bytes, sample_rate: int) -> np.ndarray:
    """Mono float32 waveform at `sample_rate` from WAV/FLAC bytes."""
    import soundfile as sf

    wave, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    wave = wave.mean(axis=1)
    if wave.size == 0:
        raise ValueError("empty audio clip")
    if sr != sample_rate:
        import torchaudio.functional as AF

        wave = AF.resample(torch.from_numpy(wave), sr, sample_rate).numpy()
    return wave


def load_medium(kind: str, data: bytes, cfg: ModelConfig) -> Medium:
    """Decode and preprocess stored bytes into a Medium."""
    if kind == "image":
        from loomrl.encoders.vision import preprocess_image, preprocess_settings

        patches, grid = preprocess_image(decode_image(data), cfg.vision)
        return Medium("image", content_hash(data), patches, grid,
                      settings_fingerprint(preprocess_settings(cfg.vision)))
    if kind == "audio":
        from loomrl.encoders.audio import log_mel, preprocess_settings

        features = log_mel(decode_audio(data, cfg.audio.sample_rate), cfg.audio)
        return Medium("audio", content_hash(data), features, None,
                      settings_fingerprint(preprocess_settings(cfg.audio)))
    raise ValueError(f"unknown medium kind {kind!r}")
