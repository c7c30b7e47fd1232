"""Load the vision or audio tower of a local Hugging Face checkpoint folder.

A folder holds `config.json` and one or more `*.safetensors` files of a whole
Qwen2-VL / Qwen2.5-VL / Qwen2-Audio model. Only the tower's tensors are read
(safetensors reads by key, so a 7B checkpoint costs the tower's bytes, not the
model's), into transformers' own tower classes, so parameter names are the
checkpoint's. Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

# Where each model family keeps its tower: the hub layout first, then the nested
# `model.` layout some transformers versions write.
VISION_PREFIXES = ("visual.", "model.visual.")
AUDIO_PREFIXES = ("audio_tower.", "model.audio_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.linear.", "model.multi_modal_projector.linear.")


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (a Hugging Face checkpoint folder has config.json)")
    return json.loads(path.read_text())


def safetensors_files(folder: str | Path) -> list[Path]:
    """The weight files of a folder: the shards `model.safetensors.index.json` lists, if there is
    one (each must exist), else every `*.safetensors`."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        for n in names:  # plain file names only: an index must not point outside its folder
            if Path(n).name != n or not (folder / n).is_file():
                raise FileNotFoundError(f"{index}: lists {n!r}, which is not a file in {folder}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def read_tensors(folder: str | Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors under the first of `prefixes` that the folder's safetensors files use, prefix removed."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    for prefix in prefixes:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    if k.startswith(prefix):
                        out[k[len(prefix):]] = st.get_tensor(k)
        if out:
            return out
    raise KeyError(f"{folder}: no tensors under any of {list(prefixes)}")


def _load_into(module: nn.Module, tensors: dict[str, torch.Tensor], what: str,
               dtype: Optional[torch.dtype]) -> nn.Module:
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype
    return module.to(dtype).eval()


def load_vision_tower(folder: str | Path, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The vision tower (with its merger) of a Qwen2-VL or Qwen2.5-VL checkpoint folder.

    dtype: cast to this; None keeps the checkpoint's dtype."""
    model_type = read_config(folder).get("model_type")
    if model_type == "qwen2_vl":
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower

        cfg = Qwen2VLConfig.from_pretrained(str(folder), local_files_only=True).vision_config
    elif model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )

        cfg = Qwen2_5_VLConfig.from_pretrained(str(folder), local_files_only=True).vision_config
    else:
        raise ValueError(f"{folder}: model_type {model_type!r} has no supported vision tower "
                         "(qwen2_vl, qwen2_5_vl)")
    cfg._attn_implementation = "sdpa"
    tower = Tower._from_config(cfg)
    return _load_into(tower, read_tensors(folder, VISION_PREFIXES), f"{folder}: vision tower", dtype)


def load_audio_tower(folder: str | Path, dtype: Optional[torch.dtype] = None) -> tuple[nn.Module, nn.Linear]:
    """The audio encoder and its projector (audio width -> LM width) of a Qwen2-Audio checkpoint folder.

    dtype: cast to this; None keeps the checkpoint's dtype."""
    model_type = read_config(folder).get("model_type")
    if model_type != "qwen2_audio":
        raise ValueError(f"{folder}: model_type {model_type!r} has no supported audio tower (qwen2_audio)")
    from transformers import Qwen2AudioConfig
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    cfg = Qwen2AudioConfig.from_pretrained(str(folder), local_files_only=True)
    audio_cfg = cfg.audio_config
    audio_cfg._attn_implementation = "sdpa"
    tower = _load_into(Qwen2AudioEncoder._from_config(audio_cfg), read_tensors(folder, AUDIO_PREFIXES),
                       f"{folder}: audio tower", dtype)
    projector = nn.Linear(audio_cfg.d_model, cfg.text_config.hidden_size)
    projector = _load_into(projector, read_tensors(folder, PROJECTOR_PREFIXES), f"{folder}: audio projector",
                           dtype)
    return tower, projector


def attach_towers(model, vision_folder: Optional[str | Path] = None,
                  audio_folder: Optional[str | Path] = None) -> None:
    """Replace a VLM's vision tower and/or audio tower + projector with a checkpoint's,
    after checking they fit the model's config (patching, mel bins, clip length, widths)."""
    cfg = model.cfg
    dtype = next(model.parameters()).dtype
    if vision_folder is not None:
        tower = load_vision_tower(vision_folder, dtype)
        c, v = tower.config, cfg.vision
        have = (c.patch_size, c.temporal_patch_size, c.spatial_merge_size, tower.merger.mlp[-1].out_features)
        want = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size, cfg.hidden_size)
        if have != want:
            raise ValueError(f"{vision_folder}: vision tower (patch, temporal patch, merge, out width) {have} "
                             f"does not fit model.vision / model.hidden_size {want}")
        model.visual = tower
    if audio_folder is not None:
        from loomrl.encoders.audio import num_frames

        tower, projector = load_audio_tower(audio_folder, dtype)
        c, a = tower.config, cfg.audio
        have = (c.num_mel_bins, c.max_source_positions, c.d_model, projector.out_features)
        want = (a.num_mel_bins, num_frames(a) // 2, a.d_model, cfg.hidden_size)
        if have != want:
            raise ValueError(f"{audio_folder}: audio tower (mel bins, positions, width, projector out) {have} "
                             f"does not fit model.audio / model.hidden_size {want}")
        model.audio_tower, model.audio_projector = tower, projector
    if cfg.encoders.frozen:
        model.visual.requires_grad_(False)
        model.audio_tower.requires_grad_(False)
    model.train(model.training)  # the loaded towers come in eval mode; follow the model
    model.encoding_cache.clear()  # other weights, fresh version counters
