"""A medium (image, video or audio clip) as the model consumes it: its content hash,
the fingerprint of the preprocessing that made its features, and the features."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import soundfile as sf
import torch
from PIL import Image


@dataclass
class Medium:
    kind: str  # "image", "video" or "audio"
    hash: str  # sha256 of the stored bytes (with prep: the encoding cache's key)
    features: torch.Tensor  # image, video: patches [N, C*T*P*P]; audio: log-mel [mel, frames]
    grid: Optional[torch.Tensor] = None  # image, video: grid_thw [3]
    prep: str = ""  # fingerprint of the preprocessing settings (see settings_fingerprint)
    seconds_per_grid: float = 0.0  # video: seconds one temporal patch spans (Qwen2.5-VL's M-RoPE time)
    times: tuple[float, ...] = ()  # video: each temporal patch's time in the clip, s (Qwen3-VL's timestamps)

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


# What decoders and tokenisers raise on damaged or hostile data: Pillow (OSError, SyntaxError,
# ValueError, EOFError, zlib and struct errors), libsndfile (soundfile.LibsndfileError, a
# RuntimeError), loomrl's own refusals (ValueError). A bad sample with one of these is skipped
# and counted. Any other type (IndexError, AttributeError, TypeError, KeyError...) is a bug in
# the reading code: it is still skipped and counted in a run, so one sample never ends a job,
# but with LOOMRL_STRICT_DATA_ERRORS=1 (the tests set it) it is raised instead.
DATA_ERRORS = (OSError, ValueError, SyntaxError, EOFError, RuntimeError, zlib.error, struct.error)
STRICT_DATA_ERRORS = "LOOMRL_STRICT_DATA_ERRORS"


def data_error(e: Exception) -> str:
    """The reason to report for an exception met while decoding a sample ("Type: message");
    re-raises it under LOOMRL_STRICT_DATA_ERRORS=1 when it is not one of DATA_ERRORS."""
    if not isinstance(e, DATA_ERRORS) and os.environ.get(STRICT_DATA_ERRORS) == "1":
        raise e
    return f"{type(e).__name__}: {e}"


def decode_image(data: bytes, max_pixels: int = 50_000_000):
    """PIL image from bytes, refusing decompression bombs (pixel limit) and non-images."""

    try:
        im = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:
        raise ValueError(str(e)) from None
    with im:
        if im.width * im.height > max_pixels:
            raise ValueError(f"image of {im.width}x{im.height} pixels exceeds the limit {max_pixels}")
        im.load()
        return im.convert("RGB")


MAX_AUDIO_SECONDS = 60.0
"""Default longest clip a reader decodes (`loomrl shards make --max-audio-seconds`'s default)."""
MAX_AUDIO_VALUES_PER_SECOND = 8 * 48_000
"""Bound on decoded values (frames x channels) per second of the limit: 8 channels at 48 kHz."""
_UNKNOWN_FRAMES = 1 << 62  # libsndfile reports "length unknown" (e.g. a streamed FLAC) as a huge count
MAX_RESAMPLE_KERNEL = 4_000_000
"""Bound on the resampling kernel (values). torchaudio's sinc kernel has (target/g) x
(rate/g + filter) values, g = gcd(rate, target): tiny for common rates (44100 -> 16000:
76 thousand; the largest among 8-384 kHz standard rates is 3.3 million) but a 10 ms WAV
whose header says 44101 Hz would need 700 million (12 GB, a minute)."""


class AudioTooLong(ValueError):
    """A clip over the length limit, found before it was decoded."""


def read_audio(data: bytes, max_seconds: float = MAX_AUDIO_SECONDS) -> tuple[np.ndarray, int]:
    """([frames, channels] float32, sample rate) of WAV/FLAC/... bytes, refusing (AudioTooLong)
    before decoding anything a clip over `max_seconds`, from its header: a few KB of FLAC can
    hold hours of silence. A header without the length (a streamed FLAC) is refused too."""

    with sf.SoundFile(io.BytesIO(data)) as f:
        rate, channels, frames = f.samplerate, f.channels, f.frames
        if rate <= 0:
            raise ValueError(f"clip has a sample rate of {rate} Hz")
        if frames >= _UNKNOWN_FRAMES:
            raise AudioTooLong(
                f"clip's header does not give its length, so it could be over the limit of {max_seconds:g} s; refused"
            )
        if frames > max_seconds * rate:
            raise AudioTooLong(f"clip of {frames / rate:.1f} s is over the limit of {max_seconds:g} s")
        budget = int(max_seconds * MAX_AUDIO_VALUES_PER_SECOND)
        if channels * frames > budget:
            raise AudioTooLong(
                f"clip of {channels} channels at {rate} Hz is over the limit of {budget} decoded "
                f"values ({max_seconds:g} s of 8 channels at 48 kHz)"
            )
        return f.read(frames=frames, dtype="float32", always_2d=True), rate


def resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """A mono waveform from `rate` to `target` Hz with torchaudio's sinc resampler, refusing
    (ValueError) a pair of rates whose kernel would be over MAX_RESAMPLE_KERNEL."""
    if rate == target:
        return wave
    g = math.gcd(rate, target)
    o, n = rate // g, target // g
    width = math.ceil(6 * o / (min(o, n) * 0.99))  # torchaudio's defaults: lowpass_filter_width 6, rolloff 0.99
    if n * (2 * width + o) > MAX_RESAMPLE_KERNEL:
        raise ValueError(
            f"a sample rate of {rate} Hz cannot be resampled to {target} Hz at a bounded cost (the "
            f"rates share only a factor of {g}); convert the clip to a common rate, e.g. 48000 Hz"
        )
    import torchaudio.functional as AF

    return AF.resample(torch.from_numpy(np.ascontiguousarray(wave)), rate, target).numpy()


def decode_audio(data: bytes, sample_rate: int, max_seconds: float = MAX_AUDIO_SECONDS) -> np.ndarray:
    """Mono float32 waveform at `sample_rate` from WAV/FLAC bytes; a clip over `max_seconds`
    is refused (ValueError) before it is decoded (see `read_audio`)."""
    wave, sr = read_audio(data, max_seconds)
    wave = wave.mean(axis=1)
    if wave.size == 0:
        raise ValueError("empty audio clip")
    return resample(wave, sr, sample_rate)
