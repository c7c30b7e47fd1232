"""Qwen2-Audio (Whisper-style) audio tower and its log-mel front end.

The log-mel spectrogram is Whisper's: 25 ms Hann window (n_fft 400), 10 ms hop,
Slaney mel filters, power spectrum, log10 clamped at 1e-10, floored at
(max - 8), then (x + 4) / 4; computed with torchaudio's MelSpectrogram. Clips
are padded with zeros or cut to `clip_seconds`, which fixes the encoder's
position count (2 mel frames per conv output, then a 2x average pool).
"""

from __future__ import annotations

import numpy as np
import torch

from loomrl.encoders.config import AudioConfig

HOP = 160
N_FFT = 400


def num_frames(cfg: AudioConfig) -> int:
    """Mel frames per clip (even: the encoder's second conv has stride 2)."""
    frames = int(round(cfg.clip_seconds * cfg.sample_rate / HOP))
    return frames + frames % 2


def num_audio_tokens(cfg: AudioConfig) -> int:
    return num_frames(cfg) // 4  # conv stride 2, then avg-pool 2


def preprocess_settings(cfg: AudioConfig) -> dict:
    """Everything that decides a clip's log-mel features: part of its encoding-cache key."""
    return {
        "kind": "audio",
        "sample_rate": cfg.sample_rate,
        "num_mel_bins": cfg.num_mel_bins,
        "frames": num_frames(cfg),
        "n_fft": N_FFT,
        "hop": HOP,
        "log_mel": "whisper",
    }


_MEL: dict[tuple[int, int], torch.nn.Module] = {}


def log_mel(wave: np.ndarray | torch.Tensor, cfg: AudioConfig) -> torch.Tensor:
    """[num_mel_bins, num_frames] Whisper-style log-mel features of a mono clip at cfg.sample_rate."""
    import torchaudio

    key = (cfg.sample_rate, cfg.num_mel_bins)
    if key not in _MEL:
        _MEL[key] = torchaudio.transforms.MelSpectrogram(
            sample_rate=cfg.sample_rate,
            n_fft=N_FFT,
            hop_length=HOP,
            n_mels=cfg.num_mel_bins,
            mel_scale="slaney",
            norm="slaney",
            power=2.0,
            center=True,
            pad_mode="reflect",
        )
    wave = torch.as_tensor(wave, dtype=torch.float32).flatten()
    n = num_frames(cfg) * HOP
    wave = torch.nn.functional.pad(wave[:n], (0, max(0, n - wave.numel())))
    mel = _MEL[key](wave)[:, :-1]  # Whisper drops the last STFT frame
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, logm.max() - 8.0)
    return (logm + 4.0) / 4.0


def build_audio_tower(cfg: AudioConfig, init_std: float):
    from transformers.models.qwen2_audio.configuration_qwen2_audio import Qwen2AudioEncoderConfig
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    hf = Qwen2AudioEncoderConfig(
        d_model=cfg.d_model,
        encoder_layers=cfg.layers,
        encoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.ffn_dim,
        num_mel_bins=cfg.num_mel_bins,
        max_source_positions=num_frames(cfg) // 2,
        init_std=init_std,
    )
    hf._attn_implementation = "sdpa"
    tower = Qwen2AudioEncoder._from_config(hf)
    # transformers initialises the conv stem with N(0, init_std); at 0.02 that makes the
    # mel signal ~50x smaller than the fixed sinusoidal positions added after it, and a
    # randomly initialised tower barely sees its input. Trained checkpoints never look like
    # that: start the stem at PyTorch's fan-in scaled default instead.
    tower.conv1.reset_parameters()
    tower.conv2.reset_parameters()
    return tower


def encode_audio(tower, features: torch.Tensor) -> torch.Tensor:
    """[B, tokens, d_model] for log-mel features [B, mel, frames]."""
    return tower(features.to(tower.conv1.weight.dtype)).last_hidden_state
