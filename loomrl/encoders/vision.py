"""Qwen2-VL vision tower and its image preprocessing, without torchvision.

Preprocessing follows transformers' Qwen2-VL image processor: resize so both
sides are multiples of patch_size * merge_size (smart_resize), rescale to
[0, 1], normalise with `model.vision.image_mean/std` (CLIP's; Qwen3-VL: 0.5),
repeat the still frame to fill the temporal patch, and flatten into patches
ordered so the merger's 2x2 groups are contiguous. Returns (patches
[N, C*T*P*P], grid_thw [3]). Qwen2.5-VL and Qwen3-VL checkpoints bring their own
towers (`hf_checkpoint`); Qwen3-VL's also returns DeepStack features (`encode_images`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from PIL import Image
from torch import nn

from loomrl.encoders.base import MediaTokens, Modality, register
from loomrl.encoders.config import VisionConfig
from loomrl.encoders.hf_checkpoint import vision_tower_of
from loomrl.encoders.media import Medium, content_hash, decode_image, settings_fingerprint

if TYPE_CHECKING:
    from loomrl.platform.backbone.config import ModelConfig


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: multiples of `factor`, area within [min, max], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {height}x{width} is above 200")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def preprocess_settings(cfg: VisionConfig) -> dict:
    """Everything that decides an image's patches: part of its encoding-cache key."""
    return {
        "kind": "image",
        "patch_size": cfg.patch_size,
        "temporal_patch_size": cfg.temporal_patch_size,
        "spatial_merge_size": cfg.spatial_merge_size,
        "min_pixels": cfg.min_pixels,
        "max_pixels": cfg.max_pixels,
        "resample": "bicubic",
        "mean": list(cfg.image_mean),
        "std": list(cfg.image_std),
    }


def normalised(image: Image.Image, cfg: VisionConfig) -> np.ndarray:
    """[C, H, W] float32 of an RGB image: rescaled to [0, 1] and normalised with image_mean / image_std."""
    mean, std = np.array(cfg.image_mean, dtype=np.float32), np.array(cfg.image_std, dtype=np.float32)
    x = (np.asarray(image, dtype=np.float32) / 255.0 - mean) / std  # H, W, C
    return x.transpose(2, 0, 1)


def patchify(x: np.ndarray, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches [N, C*T*P*P], grid_thw [3]) of frames [T, C, H, W] (a still image: T = 1): T padded
    to a multiple of the temporal patch by repeating the last frame (a still image fills its
    patch), then flattened so the merger's groups are contiguous (transformers' Qwen2-VL
    processors: image and video alike)."""
    tps, ps, m = cfg.temporal_patch_size, cfg.patch_size, cfg.spatial_merge_size
    if pad := -x.shape[0] % tps:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    t, c, h, w = x.shape
    gt, gh, gw = t // tps, h // ps, w // ps
    x = x.reshape(gt, tps, c, gh // m, m, ps, gw // m, m, ps)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    patches = x.reshape(gt * gh * gw, c * tps * ps * ps)
    return torch.from_numpy(np.ascontiguousarray(patches)), torch.tensor([gt, gh, gw])


def preprocess_image(image: Image.Image, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    factor = cfg.patch_size * cfg.spatial_merge_size
    image = image.convert("RGB")
    h, w = smart_resize(image.height, image.width, factor, cfg.min_pixels, cfg.max_pixels)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), Image.BICUBIC)
    return patchify(normalised(image, cfg)[None], cfg)


def num_image_tokens(grid_thw: torch.Tensor, cfg: VisionConfig) -> int:
    return int(grid_thw.prod()) // (cfg.spatial_merge_size**2)


def build_vision_tower(cfg: VisionConfig, out_dim: int, init_std: float):
    """Qwen2-VL vision transformer; its merger projects into the backbone width."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    hf = Qwen2VLVisionConfig(
        depth=cfg.depth,
        embed_dim=cfg.embed_dim,
        hidden_size=out_dim,
        num_heads=cfg.num_heads,
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        spatial_merge_size=cfg.spatial_merge_size,
        initializer_range=init_std,
        in_channels=3,
    )
    hf._attn_implementation = "sdpa"
    return Qwen2VisionTransformerPretrainedModel._from_config(hf)


def encode_images(tower, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """Merged image tokens [sum(tokens), out_dim] for concatenated patches (Qwen2-VL and
    Qwen2.5-VL towers alike). A Qwen3-VL tower's DeepStack features (its intermediate blocks,
    merged) follow each token's in the same row: [sum(tokens), out_dim x (1 + levels)], the layout
    vLLM's Qwen3-VL takes as image embeddings; `VLM.embed_inputs` splits them off again. One
    tensor per medium, so the encoding cache and its dedup hold them like any encoding."""
    out = tower(patches.to(tower.dtype), grid_thw=grids)
    deepstack = getattr(out, "deepstack_features", None) or []
    return torch.cat([out.pooler_output, *deepstack], dim=-1) if deepstack else out.pooler_output


@register("image")
class ImageModality(Modality):
    """Images: `<image>` in prompts, `images` in manifests; the Qwen2-VL / Qwen2.5-VL / Qwen3-VL
    vision tower (the policy's `visual`, with its merger, whose output is already the backbone
    width; Qwen3-VL's DeepStack mergers count as its merger)."""

    order, marker, manifest_keys, file_prefix = 0, "<image>", ("images", "image"), "img"
    noun, tower_name, tower_attrs = "image", "vision", ("visual",)
    checkpoint_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

    @classmethod
    def load(cls, data: bytes, cfg: ModelConfig) -> Medium:
        patches, grid = preprocess_image(decode_image(data), cfg.vision)
        return Medium("image", content_hash(data), patches, grid, settings_fingerprint(preprocess_settings(cfg.vision)))

    @classmethod
    def num_tokens(cls, medium: Medium, cfg: ModelConfig) -> int:
        return num_image_tokens(medium.grid, cfg.vision)

    @classmethod
    def build_demo(cls, model: nn.Module, cfg: ModelConfig) -> None:
        model.visual = build_vision_tower(cfg.vision, cfg.hidden_size, cfg.init_std)

    @classmethod
    def build_from_checkpoint(cls, model: nn.Module, hf_config: dict, where: str) -> None:
        model.visual = vision_tower_of(hf_config, where)

    @classmethod
    def parameter_parts(cls, model: nn.Module) -> dict[str, list[nn.Parameter]]:
        if model.visual is None:
            return {}
        merger = list(model.visual.merger.parameters())
        merger += [p for m in getattr(model.visual, "deepstack_merger_list", ()) for p in m.parameters()]
        return {"vision": [p for p in model.visual.parameters() if not any(p is q for q in merger)], "merger": merger}

    @classmethod
    def batch(cls, media: list[Medium]) -> tuple[torch.Tensor, ...]:
        return torch.cat([m.features for m in media]), torch.stack([m.grid for m in media])

    @classmethod
    def encode(cls, tower: nn.Module, inputs: tuple, media: list[Medium], cfg: ModelConfig) -> list[torch.Tensor]:
        return list(encode_images(tower, *inputs).split([cls.num_tokens(m, cfg) for m in media]))

    @classmethod
    def checkpoint_tokens(cls, tokenizer, hf_config: dict, checked) -> Optional[MediaTokens]:
        if "image_token_id" not in hf_config:
            return None
        return MediaTokens(
            checked("image_token_id", hf_config["image_token_id"]),
            tuple(checked(k, hf_config[k]) for k in ("vision_start_token_id",) if k in hf_config),
            tuple(checked(k, hf_config[k]) for k in ("vision_end_token_id",) if k in hf_config),
        )
