"""What a Hugging Face checkpoint folder (`model.init_from`) decides of the `model` section: its
config.json's sizes and towers (with transformers' defaults for a key left out) and its
preprocessor's pixel bounds, filled into the recipe or checked against what it sets."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

from loomrl.config.schema import RecipeError, convert, cut, is_file, show
from loomrl.encoders.base import checkpoint_towers
from loomrl.encoders.config import HOP
from loomrl.encoders.hf_checkpoint import VISION_KINDS, read_json_file
from loomrl.platform.backbone.config import ModelConfig
from loomrl.platform.backbone.hf_bounds import check_towers
from loomrl.platform.backbone.hf_io import decoder_config

Row = tuple[str, Any, Path, str, bool]
"""(key under `model`, value, file, what the file says, strict)."""


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file as a mapping (`hf_checkpoint.read_json_file`: a regular file, its
    size bounded); RecipeError naming it otherwise."""
    try:
        data = read_json_file(path)
    except ValueError as e:
        raise RecipeError(f"model.init_from: {cut(str(e), 300)}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"model.init_from: {path}: not a JSON object")
    return data


def section(cfg: dict, key: str, path: Path) -> dict:
    """config.json's `key` sub-mapping (missing: empty)."""
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise RecipeError(f"model.init_from: {path}: {key} is not a mapping")
    return value


def checkpoint_settings(folder: str, sample_rate: int = 16000) -> list[Row]:
    """What a local checkpoint folder (model.init_from) decides of the `model` section, as rows
    (key under `model`, value, file, what the file says, strict). From config.json: the language
    model's sizes (`text_config` over top-level keys, as hf_io.decoder_config reads them); the
    vision tower's (Qwen2-VL / Qwen2.5-VL) or the audio tower's (Qwen2-Audio; its positions fix
    `audio.clip_seconds` at `sample_rate`). From preprocessor_config.json, when present:
    `vision.min_pixels` / `max_pixels`, not strict (the recipe may resize images otherwise; the
    tower takes any size). A key config.json leaves out has transformers' default. RecipeError
    naming the file when a file cannot be read, or describes a model loomrl cannot build."""

    path = Path(folder) / "config.json"
    cfg = read_json(path)
    try:
        check_towers(cfg, str(path))
        d = decoder_config(cfg, str(path))
    except (ValueError, TypeError, AttributeError, ZeroDivisionError) as e:  # a value of the wrong type
        text = str(e) if str(path) in str(e) else f"{path}: {type(e).__name__}: {e}"
        raise RecipeError(f"model.init_from: {cut(text, 300)}") from None
    rows = [
        (key, value, path, f"{hf_key}: {show(value)}", True)
        for key, hf_key, value in (
            ("hidden_size", "hidden_size", d.hidden_size),
            ("num_layers", "num_hidden_layers", d.num_layers),
            ("num_heads", "num_attention_heads", d.num_heads),
            ("num_kv_heads", "num_key_value_heads", d.num_kv_heads),
            ("intermediate_size", "intermediate_size", d.intermediate_size),
            ("rope_theta", "rope_theta", d.rope_theta),
            ("rms_norm_eps", "rms_norm_eps", d.rms_norm_eps),
            ("tie_word_embeddings", "tie_word_embeddings", d.tie_word_embeddings),
        )
    ]
    if d.head_size is not None:  # Qwen3: a head width of its own
        rows.append(("head_dim", d.head_size, path, f"head_dim: {d.head_size}", True))
    model_type = cfg["model_type"]  # decoder_config accepted it
    towers = checkpoint_towers(cfg, str(path))
    if "image" in towers:
        rows += vision_rows(Path(folder), cfg, model_type, d.hidden_size)
    if "audio" in towers:
        rows += audio_rows(path, section(cfg, "audio_config", path), sample_rate)
    return rows


def vision_rows(folder: Path, cfg: dict, model_type: str, hidden_size: int) -> list[Row]:
    """The vision tower's sizes (Qwen2-VL / Qwen2.5-VL / Qwen3-VL config.json) and the preprocessor's
    pixel bounds and normalisation."""

    path = folder / "config.json"
    vc = section(cfg, "vision_config", path)
    kind = vc.get("model_type")
    if kind is not None and kind not in VISION_KINDS[model_type]:
        raise RecipeError(
            f"model.init_from: {path}: a vision tower of kind {show(kind)}, which loomrl cannot "
            f"build for model_type {model_type} (it builds {', '.join(VISION_KINDS[model_type])})"
        )
    qwen2, qwen3 = model_type == "qwen2_vl", model_type == "qwen3_vl"
    # transformers 5.19's Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig / Qwen3VLVisionConfig defaults
    # for a key left out
    width, out = ("embed_dim", "hidden_size") if qwen2 else ("hidden_size", "out_hidden_size")
    rows = []
    for key, hf_key, default in (
        ("depth", "depth", 27 if qwen3 else 32),
        ("embed_dim", width, 1280 if qwen2 else 1152 if qwen3 else 3584),
        ("num_heads", "num_heads", 16),
        ("patch_size", "patch_size", 16 if qwen3 else 14),
        ("temporal_patch_size", "temporal_patch_size", 2),
        ("spatial_merge_size", "spatial_merge_size", 2),
    ):
        value = vc.get(hf_key, default)
        rows.append((f"vision.{key}", value, path, f"vision_config.{hf_key}: {show(value)}", True))
    if vc.get(out, 3584) != hidden_size:
        raise RecipeError(
            f"model.init_from: {path}: vision_config.{out} {show(vc.get(out, 3584))} is not the "
            f"language model's hidden_size {show(hidden_size)} (the vision merger's output "
            f"is spliced into the language model)"
        )
    pre_path = folder / "preprocessor_config.json"
    if is_file(str(pre_path)):
        pre = read_json(pre_path)
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if key in pre:
                rows.append((f"vision.{key}", pre[key], pre_path, f"{key}: {show(pre[key])}", False))
            elif edge in size:  # what newer transformers write
                rows.append((f"vision.{key}", size[edge], pre_path, f"size.{edge}: {show(size[edge])}", False))
        for key in ("image_mean", "image_std"):
            if key in pre:
                rows.append((f"vision.{key}", pre[key], pre_path, f"{key}: {show(pre[key])}", False))
    video_path = folder / "video_preprocessor_config.json"
    if is_file(str(video_path)):  # what transformers 5 writes for the video processor
        pre = read_json(video_path)
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        for key, hf_key in (
            ("video_fps", "fps"),
            ("video_min_frames", "min_frames"),
            ("video_max_frames", "max_frames"),
        ):
            if pre.get(hf_key) is not None:
                rows.append((f"vision.{key}", pre[hf_key], video_path, f"{hf_key}: {show(pre[hf_key])}", False))
        for key, hf_key, edge in (
            ("video_min_pixels", "min_pixels", "shortest_edge"),
            ("video_max_pixels", "max_pixels", "longest_edge"),
        ):
            if pre.get(hf_key) is not None:
                rows.append((f"vision.{key}", pre[hf_key], video_path, f"{hf_key}: {show(pre[hf_key])}", False))
            elif size.get(edge) is not None:
                rows.append((f"vision.{key}", size[edge], video_path, f"size.{edge}: {show(size[edge])}", False))
    return rows


def audio_rows(path: Path, ac: dict, sample_rate: int) -> list[Row]:
    """The audio tower's sizes (Qwen2-Audio config.json's audio_config); its positions fix the clip length."""

    rows: list[Row] = []
    # transformers 5.19's Qwen2AudioEncoderConfig defaults for a key left out
    for key, hf_key, default in (
        ("layers", "encoder_layers", 32),
        ("d_model", "d_model", 1280),
        ("num_heads", "encoder_attention_heads", 20),
        ("ffn_dim", "encoder_ffn_dim", 5120),
        ("num_mel_bins", "num_mel_bins", 128),
    ):
        value = ac.get(hf_key, default)
        rows.append((f"audio.{key}", value, path, f"audio_config.{hf_key}: {show(value)}", True))
    positions = ac.get("max_source_positions", 1500)
    if isinstance(positions, bool) or not isinstance(positions, int) or not 1 <= positions <= 10**7:
        raise RecipeError(
            f"model.init_from: {path}: audio_config.max_source_positions {show(positions)} is not a positive integer"
        )
    clip = positions * 2 * HOP / sample_rate  # 2 mel frames per position, one frame per HOP samples
    says = f"audio_config.max_source_positions: {positions}, {clip:g} s at model.audio.sample_rate {sample_rate} Hz"
    rows.append(("audio.clip_seconds", clip, path, says, True))
    return rows


def fill_from_checkpoint(m: ModelConfig, given: Any) -> None:
    """Take the model's settings from its model.init_from checkpoint, in place (`checkpoint_settings`).
    given: the recipe's raw `model` mapping (file and overrides), which says what the recipe set. A
    key it left out takes the checkpoint's value; a strict key it set to another value is a
    RecipeError naming the key, both values and the file. `tokenizer` left out (`demo`) becomes
    the folder when that has tokenizer files. Nothing is filled without init_from or when its
    config.json is not on this machine (a recipe for a cluster; `file_problems` names it)."""
    if m.init_from is None or not is_file(str(Path(m.init_from) / "config.json")):
        return
    given = given if isinstance(given, dict) else {}
    for key, value, path, says, strict in checkpoint_settings(m.init_from, m.audio.sample_rate):
        *parents, name = key.split(".")
        target, raw = m, given
        for part in parents:
            target, raw = getattr(target, part), raw.get(part) if isinstance(raw, dict) else None
        f = {f.name: f for f in dataclasses.fields(target)}[name]
        try:
            value = convert(value, typing.get_type_hints(type(target))[name], f"model.{key}", f.metadata.get("range"))
        except RecipeError as e:
            raise RecipeError(f"model.init_from: {path} ({says}) is not a value loomrl can use: {e}") from None
        if not (isinstance(raw, dict) and name in raw):
            setattr(target, name, value)
            continue
        mine = getattr(target, name)
        same = math.isclose(mine, value, rel_tol=1e-6) if isinstance(value, float) else mine == value
        if strict and not same:
            raise RecipeError(
                f"model.{key}: {show(mine)} conflicts with {path} ({says}); leave it out to take the checkpoint's"
            )
    folder = Path(m.init_from)
    if (
        "tokenizer" not in given
        and m.tokenizer == "demo"
        and any(is_file(str(folder / name)) for name in ("tokenizer.json", "tokenizer_config.json"))
    ):
        m.tokenizer = m.init_from
