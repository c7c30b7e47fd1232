"""Qwen2-Audio (Whisper-style) audio tower and its log-mel front end.

The log-mel spectrogram is Whisper's: 25 ms Hann window (n_fft 400), 10 ms hop,
Slaney mel filters, power spectrum, log10 clamped at 1e-10, floored at
(max - 8), then (x + 4) / 4; computed with torchaudio's MelSpectrogram. Clips
are padded with zeros or cut to `clip_seconds`, which fixes the encoder's
position count (2 mel frames per conv output, then a 2x average pool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from torch import nn

from loomrl.encoders.base import MediaTokens, Modality, register, token_id
from loomrl.encoders.config import HOP, AudioConfig, num_frames
from loomrl.encoders.hf_checkpoint import audio_tower_of
from loomrl.encoders.media import MAX_AUDIO_SECONDS, Medium, content_hash, decode_audio, settings_fingerprint

if TYPE_CHECKING:
    from loomrl.platform.backbone.config import ModelConfig

N_FFT = 400


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


@register("audio")
class AudioModality(Modality):
    """Audio clips: `<audio>` in prompts, `audio` in manifests; the Qwen2-Audio (Whisper-style)
    tower (the policy's `audio_tower`) and its projector to the backbone width
    (`audio_projector`, Qwen2-Audio's multi_modal_projector.linear), which the cache never holds."""

    order, marker, manifest_keys, file_prefix = 1, "<audio>", ("audio", "audios"), "aud"
    noun, tower_name, tower_attrs = "clip", "audio", ("audio_tower", "audio_projector")
    checkpoint_types = ("qwen2_audio",)

    @classmethod
    def load(cls, data: bytes, cfg: ModelConfig) -> Medium:
        # Clips are cut to clip_seconds; one over the readers' limit is refused before decoding.
        wave = decode_audio(data, cfg.audio.sample_rate, max(MAX_AUDIO_SECONDS, cfg.audio.clip_seconds))
        features = log_mel(wave, cfg.audio)
        return Medium("audio", content_hash(data), features, None, settings_fingerprint(preprocess_settings(cfg.audio)))

    @classmethod
    def num_tokens(cls, medium: Medium, cfg: ModelConfig) -> int:
        return num_audio_tokens(cfg.audio)

    @classmethod
    def build_demo(cls, model: nn.Module, cfg: ModelConfig) -> None:
        model.audio_tower = build_audio_tower(cfg.audio, cfg.init_std)
        model.audio_projector = nn.Linear(cfg.audio.d_model, cfg.hidden_size)

    @classmethod
    def build_from_checkpoint(cls, model: nn.Module, hf_config: dict, where: str) -> None:
        model.audio_tower, model.audio_projector = audio_tower_of(hf_config, where)

    @classmethod
    def parameter_parts(cls, model: nn.Module) -> dict[str, list[nn.Parameter]]:
        parts = {}
        if model.audio_tower is not None:
            parts["audio"] = list(model.audio_tower.parameters())
        if model.audio_projector is not None:
            parts["audio_projector"] = list(model.audio_projector.parameters())
        return parts

    @classmethod
    def reinitialised(cls, model: nn.Module) -> list[nn.Module]:
        return [model.audio_projector] if model.audio_projector is not None else []

    @classmethod
    def batch(cls, media: list[Medium]) -> tuple[torch.Tensor, ...]:
        return (torch.stack([m.features for m in media]),)

    @classmethod
    def encode(cls, tower: nn.Module, inputs: tuple, media: list[Medium], cfg: ModelConfig) -> list[torch.Tensor]:
        return list(encode_audio(tower, *inputs))

    @classmethod
    def project(cls, model: nn.Module, raw: list[torch.Tensor]) -> list[torch.Tensor]:
        if model.audio_projector is None:
            raise ValueError(f"the model has no audio projector (model.init_from={model.cfg.init_from!r})")
        return list(model.audio_projector(torch.stack(raw)))

    @classmethod
    def checkpoint_tokens(cls, tokenizer, hf_config: dict, checked) -> Optional[MediaTokens]:
        if "audio_token_index" not in hf_config:
            return None
        bos, eos = token_id(tokenizer, "<|audio_bos|>"), token_id(tokenizer, "<|audio_eos|>")
        return MediaTokens(
            checked("audio_token_index", hf_config["audio_token_index"]),
            () if bos is None else (bos,),
            () if eos is None else (eos,),
        )
