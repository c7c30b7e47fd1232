import io

import numpy as np
import pytest
import torch
from PIL import Image

from loomrl.encoders.audio import log_mel, num_audio_tokens, num_frames
from loomrl.encoders.base import load_medium
from loomrl.encoders.media import decode_image
from loomrl.encoders.vision import num_image_tokens, preprocess_image, smart_resize
from loomrl.platform.recipe import AudioConfig, ModelConfig, VisionConfig


def test_smart_resize_rule():
    assert smart_resize(64, 64, 28, 56 * 56, 56 * 56) == (56, 56)
    h, w = smart_resize(480, 640, 28, 4 * 28 * 28, 1024 * 28 * 28)
    assert h % 28 == 0 and w % 28 == 0 and abs(h / w - 0.75) < 0.05


def test_image_patches_match_qwen2vl_layout():
    cfg = VisionConfig(min_pixels=56 * 112, max_pixels=56 * 112)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 112, 3), dtype=np.uint8))
    patches, grid = preprocess_image(img, cfg)
    assert grid.tolist() == [1, 4, 8]
    assert patches.shape == (32, 3 * 2 * 14 * 14)
    assert num_image_tokens(grid, cfg) == 8
    # the first patch is the top-left 14x14 block, both temporal copies identical
    p0 = patches[0].view(3, 2, 14, 14)
    torch.testing.assert_close(p0[:, 0], p0[:, 1])
    x = (np.asarray(img, dtype=np.float32)[:14, :14] / 255.0 - [0.48145466, 0.4578275, 0.40821073]) / [
        0.26862954,
        0.26130258,
        0.27577711,
    ]
    torch.testing.assert_close(p0[:, 0], torch.tensor(x.transpose(2, 0, 1), dtype=torch.float32))
    # merge order: patch 1 is the block right of patch 0 (2x2 groups are contiguous)
    x1 = (np.asarray(img, dtype=np.float32)[:14, 14:28, 0] / 255.0 - 0.48145466) / 0.26862954
    torch.testing.assert_close(patches[1].view(3, 2, 14, 14)[0, 0], torch.tensor(x1, dtype=torch.float32))


def test_log_mel_matches_whisper_feature_extractor():
    from transformers import WhisperFeatureExtractor

    cfg = AudioConfig(clip_seconds=1.0)
    t = np.arange(16000) / 16000
    wave = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.01 * np.random.default_rng(0).normal(size=t.size)).astype(np.float32)
    ours = log_mel(wave, cfg)
    fe = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, n_samples=16000, chunk_length=1)
    ref = fe(wave, sampling_rate=16000, return_tensors="np").input_features[0]
    assert ours.shape == (80, num_frames(cfg)) == ref.shape
    assert np.abs(ours.numpy() - ref).max() < 2e-3
    assert num_audio_tokens(cfg) == 25


@pytest.mark.parametrize("mel_bins,clip_seconds,duration", [(80, 1.0, 0.3), (80, 1.0, 1.4), (128, 2.0, 1.3)])
def test_log_mel_matches_whisper_for_padded_and_cut_clips(mel_bins, clip_seconds, duration):
    """Clips shorter than the clip length are zero-padded, longer ones cut, as Whisper's
    feature extractor does; Qwen2-Audio's 128 mel bins too. Measured max error ~1.5e-5."""
    from transformers import WhisperFeatureExtractor

    cfg = AudioConfig(num_mel_bins=mel_bins, clip_seconds=clip_seconds)
    n = int(16000 * duration)
    t = np.arange(n) / 16000
    wave = (0.3 * np.sin(2 * np.pi * 300 * t) + 0.01 * np.random.default_rng(1).normal(size=n)).astype(np.float32)
    fe = WhisperFeatureExtractor(
        feature_size=mel_bins, sampling_rate=16000, n_samples=int(16000 * clip_seconds), chunk_length=int(clip_seconds)
    )
    ref = fe(wave, sampling_rate=16000, return_tensors="np").input_features[0]
    ours = log_mel(wave, cfg).numpy()
    assert ours.shape == ref.shape == (mel_bins, num_frames(cfg))
    assert np.abs(ours - ref).max() < 1e-4


def test_image_pixel_limit_and_garbage_rejected():
    big = Image.new("RGB", (300, 300))
    buf = io.BytesIO()
    big.save(buf, format="PNG")
    with pytest.raises(ValueError, match="exceeds the limit"):
        decode_image(buf.getvalue(), max_pixels=10_000)
    with pytest.raises(Exception):
        load_medium("image", b"not an image at all", ModelConfig())


def test_audio_length_is_checked_before_decoding():
    """10 minutes of FLAC silence is a few KB; the reader refuses it from the header, never
    decoding it (and refuses a header that does not give the length)."""
    import soundfile as sf

    from loomrl.encoders.media import decode_audio

    def silent_flac(seconds, unknown_length=False):
        buf = io.BytesIO()
        with sf.SoundFile(buf, "w", samplerate=8000, channels=1, format="FLAC", subtype="PCM_16") as f:
            for _ in range(int(seconds // 60)):
                f.write(np.zeros(8000 * 60, dtype=np.int16))
        data = bytearray(buf.getvalue())
        if unknown_length:  # STREAMINFO's 36-bit total sample count set to 0: "unknown"
            data[8 + 13] &= 0xF0
            data[8 + 14 : 8 + 18] = b"\0\0\0\0"
        return bytes(data)

    bomb = silent_flac(600)
    assert len(bomb) < 50_000
    with pytest.raises(ValueError, match="clip of 600.0 s is over the limit of 60 s"):
        decode_audio(bomb, 16000)
    with pytest.raises(ValueError, match="header does not give its length"):
        decode_audio(silent_flac(60, unknown_length=True), 16000)
    with pytest.raises(ValueError, match="over the limit of 60 s"):
        load_medium("audio", bomb, ModelConfig())
    assert decode_audio(bomb, 8000, max_seconds=600).shape == (600 * 8000,)
    assert decode_audio(silent_flac(60), 8000).shape == (60 * 8000,)


def test_resampling_cost_is_bounded_by_the_rates():
    """torchaudio's kernel grows with the rates' reduced ratio: a 10 ms WAV whose header says
    44101 Hz needs 12 GB to go to 16 kHz. Such rate pairs are refused; common ones are not."""
    import soundfile as sf

    from loomrl.encoders.media import decode_audio

    def wav(rate):
        buf = io.BytesIO()
        sf.write(buf, np.zeros(rate // 100, dtype=np.float32), rate, format="WAV", subtype="PCM_16")
        return buf.getvalue()

    with pytest.raises(ValueError, match="1001 Hz cannot be resampled to 8000 Hz"):
        decode_audio(wav(1001), 8000)  # before the bound: a 8-million-value kernel, ~0.3 GB
    with pytest.raises(ValueError, match="44101 Hz cannot be resampled to 16000 Hz"):
        decode_audio(wav(44101), 16000)
    for rate in (8000, 11025, 22050, 44100, 48000, 96000):
        assert decode_audio(wav(rate), 16000).shape == (160,)
