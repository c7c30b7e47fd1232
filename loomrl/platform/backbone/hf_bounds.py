"""Bounds on the sizes a checkpoint's config.json gives, checked before anything is built.

A config.json (`model.init_from`) is outside input: `num_hidden_layers: 1000000`, `vocab_size:
1000000000`, `vocab_size: -1`, `hidden_size: "64"` or `num_attention_heads: 0` would otherwise
become a model of tens of GB being allocated, or a TypeError / ZeroDivisionError deep in a
constructor. Every size key that a model is built from (the language model's, the vision and
audio towers') must be an integer (not a bool, not a string) within [1, its limit]; the
limits are far above any released Qwen2 family model (80 layers, hidden 8192, vocabulary
152064) and keep a model that is built on the meta device to count its parameters fast. A
size out of range is a ValueError naming the key and the file; the parameter budget against
this machine's memory is `hf_weights.check_checkpoint`'s.
"""

from __future__ import annotations

from typing import Any

LIMITS = {
    # the language model (text_config over top-level keys)
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "intermediate_size": 1 << 20,
    "max_position_embeddings": 1 << 24,
    "head_dim": 1 << 12,
    # vision_config (Qwen2-VL / Qwen2.5-VL)
    "depth": 1024,
    "embed_dim": 1 << 16,
    "out_hidden_size": 1 << 16,
    "num_heads": 1024,
    "patch_size": 1024,
    "temporal_patch_size": 64,
    "spatial_merge_size": 64,
    "in_channels": 64,
    "in_chans": 64,
    "window_size": 1 << 16,
    "num_position_embeddings": 1 << 20,  # Qwen3-VL's learned position grid (a square)
    # audio_config (Qwen2-Audio)
    "encoder_layers": 1024,
    "d_model": 1 << 16,
    "encoder_attention_heads": 1024,
    "encoder_ffn_dim": 1 << 20,
    "num_mel_bins": 1024,
    "max_source_positions": 10**7,
}
VISION_KEYS = (
    "depth",
    "embed_dim",
    "hidden_size",
    "out_hidden_size",
    "intermediate_size",
    "num_heads",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "in_channels",
    "in_chans",
    "window_size",
    "num_position_embeddings",
)
AUDIO_KEYS = (
    "encoder_layers",
    "d_model",
    "encoder_attention_heads",
    "encoder_ffn_dim",
    "num_mel_bins",
    "max_source_positions",
)
_MISSING = object()


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def size(t: dict, key: str, where: str, default: Any = _MISSING, name: str = "") -> int:
    """`t[key]` (or `default` when missing) as a size: an integer in [1, LIMITS[key]]. A
    ValueError naming the file and the key (`name`, default `key`) otherwise."""
    name = name or key
    if key not in t or t[key] is None:
        if default is _MISSING:
            raise ValueError(f"{where}: missing key {name!r}")
        return default
    value, top = t[key], LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} {_show(value)} is not an integer (a {type(value).__name__})")
    if not 1 <= value <= top:
        raise ValueError(f"{where}: {name} {_show(value)} is out of range: a size must lie in [1, {top}]")
    return value


def number(t: dict, key: str, where: str, default: float) -> float:
    """`t[key]` (or `default`) as a finite number > 0 (rope_theta, rms_norm_eps, mlp_ratio)."""
    value = t.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
        raise ValueError(f"{where}: {key} {_show(value)} is not a finite number > 0")
    return float(value)


def check_section(section: Any, prefix: str, keys: tuple[str, ...], where: str) -> None:
    """Every size key of a tower's config section that it sets (vision_config, audio_config)."""
    if section is None:
        return
    if not isinstance(section, dict):
        raise ValueError(f"{where}: {prefix} is not a mapping")
    for key in keys:
        if section.get(key) is not None:
            size(section, key, where, name=f"{prefix}.{key}")
    if "mlp_ratio" in section:
        ratio = number(section, "mlp_ratio", where, 4.0)
        if ratio > 64:
            raise ValueError(f"{where}: {prefix}.mlp_ratio {ratio:g} is out of range: it must lie in (0, 64]")


def check_towers(cfg: dict, where: str) -> None:
    """The size keys of config.json's vision_config and audio_config, where it has them."""
    check_section(cfg.get("vision_config"), "vision_config", VISION_KEYS, where)
    check_section(cfg.get("audio_config"), "audio_config", AUDIO_KEYS, where)
    vision = cfg.get("vision_config")
    if isinstance(vision, dict) and "deepstack_visual_indexes" in vision:  # Qwen3-VL
        levels, depth = vision["deepstack_visual_indexes"], vision.get("depth", 27)
        if not (
            isinstance(levels, list)
            and len(levels) <= 64
            and all(type(i) is int and 0 <= i < depth for i in levels)
            and len(set(levels)) == len(levels)
        ):
            raise ValueError(
                f"{where}: vision_config.deepstack_visual_indexes {_show(levels)} is not a short list of "
                f"distinct tower depths below depth {_show(depth)}"
            )
