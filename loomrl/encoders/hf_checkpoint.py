"""Load the vision or audio tower of a local Hugging Face checkpoint folder.

A folder holds `config.json` and one or more `*.safetensors` files of a whole
Qwen2-VL / Qwen2.5-VL / Qwen2-Audio model. Only the tower's tensors are read
(safetensors reads by key, so a 7B checkpoint costs the tower's bytes, not the
model's), into transformers' own tower classes, so parameter names are the
checkpoint's. Nothing is downloaded.

Which towers a checkpoint has is its model type's (`base.checkpoint_towers`, from each
modality's `checkpoint_types`): Qwen2-VL and Qwen2.5-VL a vision tower, Qwen2-Audio an audio
tower + projector, Qwen2 none. A policy started from it builds exactly those (`vision_tower_of` /
`audio_tower_of`, from config.json, the checkpoint's own classes), so it has the checkpoint's
parameters and no others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from torch import nn

from loomrl.datasets.files import open_regular
from loomrl.encoders.config import num_frames
from loomrl.encoders.safetensors_check import WeightsError, read_header

# Where each model family keeps its tower: the hub layout first, then the nested
# `model.` layout some transformers versions write.
VISION_PREFIXES = ("visual.", "model.visual.")
AUDIO_PREFIXES = ("audio_tower.", "model.audio_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.linear.", "model.multi_modal_projector.linear.")
# model_type -> the vision_config model types its tower class builds (transformers 5 writes the
# second; older configs may carry the first or none)
VISION_KINDS = {
    "qwen2_vl": ("qwen2_vl", "qwen2_vl_vision"),
    "qwen2_5_vl": ("qwen2_5_vl", "qwen2_5_vl_vision"),
    "qwen3_vl": ("qwen3_vl", "qwen3_vl_vision"),
}


JSON_LIMIT = 64 << 20
"""The largest config.json / index / preprocessor file read (real ones are kilobytes)."""


def read_json_file(path: str | Path) -> Any:
    """A checkpoint's JSON file: a regular file (`open_regular`: a FIFO is refused, not waited on)
    of at most JSON_LIMIT bytes; a ValueError naming it otherwise."""
    try:
        with open_regular(str(path)) as fh:
            text = fh.read(JSON_LIMIT + 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    if len(text) > JSON_LIMIT:
        raise ValueError(f"{path}: over {JSON_LIMIT >> 20} MB, not a checkpoint's JSON file")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deeply
        raise ValueError(f"{path}: cannot read it as JSON: {str(e)[:200]}") from None


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (a Hugging Face checkpoint folder has config.json)")
    cfg = read_json_file(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    return cfg


def safetensors_files(folder: str | Path) -> list[Path]:
    """The weight files of a folder: the shards `model.safetensors.index.json` lists, if there is
    one (each must exist), else every `*.safetensors`."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(read_json_file(index)["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        for n in names:  # plain file names only: an index must not point outside its folder
            if Path(n).name != n or not (folder / n).is_file():
                raise FileNotFoundError(f"{index}: lists {n!r}, which is not a file in {folder}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (a checkpoint folder holds its weights)")
    return files


def weight_headers(folder: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """{tensor name: (its file, its shape)} over a folder's weight files, each file's header
    checked against the file (`safetensors_check.read_header`: a WeightsError naming it);
    a name in two files is refused too."""
    out: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in safetensors_files(folder):
        for name, (_, shape) in read_header(f).items():
            if name in out:
                raise WeightsError(f"{f}: tensor {name!r} is in {out[name][0].name} too")
            out[name] = (f, shape)
    return out


def read_tensors(folder: str | Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors under the first of `prefixes` that the folder's safetensors files use, prefix removed."""

    files = safetensors_files(folder)
    for f in files:  # regular files whose headers fit them, before the library reads them
        read_header(f)
    for prefix in prefixes:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    if k.startswith(prefix):
                        out[k[len(prefix) :]] = st.get_tensor(k)
        if out:
            return out
    raise KeyError(f"{folder}: no tensors under any of {list(prefixes)}")


def _load_into(
    module: nn.Module, tensors: dict[str, torch.Tensor], what: str, dtype: Optional[torch.dtype]
) -> nn.Module:
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype
    return module.to(dtype).eval()


def _vision_spec(hf_config: dict, where: str) -> tuple[type, Any]:
    """(tower class, its transformers config) of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL config.json."""
    model_type = hf_config.get("model_type")
    if model_type == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower
    elif model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    elif model_type == "qwen3_vl":
        from transformers import Qwen3VLConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    else:
        raise ValueError(
            f"{where}: model_type {model_type!r} has no supported vision tower ({', '.join(VISION_KINDS)})"
        )
    vision = hf_config.get("vision_config") or {}
    kind = vision.get("model_type") if isinstance(vision, dict) else None
    if kind is not None and kind not in VISION_KINDS[model_type]:
        raise ValueError(
            f"{where}: vision_config.model_type {kind!r}: loomrl builds the {model_type} vision "
            f"tower only ({', '.join(VISION_KINDS[model_type])})"
        )
    cfg = Config.from_dict(hf_config).vision_config
    cfg._attn_implementation = "sdpa"
    return Tower, cfg


def vision_tower_of(hf_config: dict, where: str = "config.json") -> nn.Module:
    """A randomly initialised vision tower (with its merger) of the class and config a Qwen2-VL /
    Qwen2.5-VL config.json describes: the module its tensors load into."""
    tower_cls, cfg = _vision_spec(hf_config, where)
    return tower_cls._from_config(cfg)


def _audio_spec(hf_config: dict, where: str) -> tuple[Any, int]:
    """(the audio encoder's transformers config, the language model's width) of a Qwen2-Audio config.json."""
    if hf_config.get("model_type") != "qwen2_audio":
        raise ValueError(
            f"{where}: model_type {hf_config.get('model_type')!r} has no supported audio tower (qwen2_audio)"
        )
    from transformers import Qwen2AudioConfig

    cfg = Qwen2AudioConfig.from_dict(hf_config)
    audio_cfg = cfg.audio_config
    audio_cfg._attn_implementation = "sdpa"
    return audio_cfg, cfg.text_config.hidden_size


def audio_tower_of(hf_config: dict, where: str = "config.json") -> tuple[nn.Module, nn.Linear]:
    """A randomly initialised audio encoder and projector (audio width -> language model width)
    as a Qwen2-Audio config.json describes them: the modules its tensors load into."""
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    audio_cfg, width = _audio_spec(hf_config, where)
    return Qwen2AudioEncoder._from_config(audio_cfg), nn.Linear(audio_cfg.d_model, width)


def load_vision_tower(folder: str | Path, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The vision tower (with its merger) of a Qwen2-VL or Qwen2.5-VL checkpoint folder.

    dtype: cast to this; None keeps the checkpoint's dtype."""
    tower = vision_tower_of(read_config(folder), f"{folder}/config.json")
    return _load_into(tower, read_tensors(folder, VISION_PREFIXES), f"{folder}: vision tower", dtype)


def load_audio_tower(folder: str | Path, dtype: Optional[torch.dtype] = None) -> tuple[nn.Module, nn.Linear]:
    """The audio encoder and its projector (audio width -> LM width) of a Qwen2-Audio checkpoint folder.

    dtype: cast to this; None keeps the checkpoint's dtype."""
    tower, projector = audio_tower_of(read_config(folder), f"{folder}/config.json")
    tower = _load_into(tower, read_tensors(folder, AUDIO_PREFIXES), f"{folder}: audio tower", dtype)
    projector = _load_into(projector, read_tensors(folder, PROJECTOR_PREFIXES), f"{folder}: audio projector", dtype)
    return tower, projector


def merger_width(tower: nn.Module) -> int:
    """The width a vision tower's merger writes (the language model's): Qwen2-VL / Qwen2.5-VL's
    `merger.mlp`, Qwen3-VL's `merger.linear_fc2`."""
    merger = tower.merger
    return (merger.linear_fc2 if hasattr(merger, "linear_fc2") else merger.mlp[-1]).out_features


def deepstack_levels(tower: Optional[nn.Module]) -> int:
    """How many DeepStack feature levels a vision tower adds to the first decoder layers (Qwen3-VL; else 0)."""
    return len(getattr(tower, "deepstack_merger_list", ())) if tower is not None else 0


def _is_built_as(module: Optional[nn.Module], cls: type, config) -> bool:
    """Whether `module` is a `cls` built from `config` (same settings): a checkpoint's tensors
    then load into it in place, instead of into a second, newly built tower."""
    return type(module) is cls and module.config.to_dict() == config.to_dict()


def attach_towers(model, vision_folder: Optional[str | Path] = None, audio_folder: Optional[str | Path] = None) -> None:
    """Put a checkpoint's vision tower and/or audio tower + projector into a VLM, after checking
    they fit the model's config (patching, mel bins, clip length, widths). A tower the model
    already has, built from the same config (`VLM` from model.init_from), is loaded in place;
    otherwise the checkpoint's replaces it (or is added where the model had none)."""
    cfg = model.cfg
    dtype = next(model.parameters()).dtype
    if vision_folder is not None:
        where = f"{vision_folder}/config.json"
        tower_cls, vision_cfg = _vision_spec(read_config(vision_folder), where)
        tower = (
            model.visual if _is_built_as(model.visual, tower_cls, vision_cfg) else tower_cls._from_config(vision_cfg)
        )
        c, v = tower.config, cfg.vision
        have = (c.patch_size, c.temporal_patch_size, c.spatial_merge_size, merger_width(tower))
        want = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size, cfg.hidden_size)
        if have != want:
            raise ValueError(
                f"{vision_folder}: vision tower (patch, temporal patch, merge, out width) {have} "
                f"does not fit model.vision / model.hidden_size {want}"
            )
        model.visual = _load_into(
            tower, read_tensors(vision_folder, VISION_PREFIXES), f"{vision_folder}: vision tower", dtype
        )
    if audio_folder is not None:
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

        audio_cfg, width = _audio_spec(read_config(audio_folder), f"{audio_folder}/config.json")
        if (
            _is_built_as(model.audio_tower, Qwen2AudioEncoder, audio_cfg)
            and model.audio_projector is not None
            and model.audio_projector.weight.shape == (width, audio_cfg.d_model)
        ):
            tower, projector = model.audio_tower, model.audio_projector
        else:
            tower, projector = Qwen2AudioEncoder._from_config(audio_cfg), nn.Linear(audio_cfg.d_model, width)
        c, a = tower.config, cfg.audio
        have = (c.num_mel_bins, c.max_source_positions, c.d_model, projector.out_features)
        want = (a.num_mel_bins, num_frames(a) // 2, a.d_model, cfg.hidden_size)
        if have != want:
            raise ValueError(
                f"{audio_folder}: audio tower (mel bins, positions, width, projector out) {have} "
                f"does not fit model.audio / model.hidden_size {want}"
            )
        model.audio_tower = _load_into(
            tower, read_tensors(audio_folder, AUDIO_PREFIXES), f"{audio_folder}: audio tower", dtype
        )
        model.audio_projector = _load_into(
            projector, read_tensors(audio_folder, PROJECTOR_PREFIXES), f"{audio_folder}: audio projector", dtype
        )
    # model.encoders.frozen (and parts frozen by name) on the new towers, which come in eval mode:
    # apply_frozen puts them back in the model's mode (eval for a tower frozen whole)
    model.apply_frozen()
    model.encoding_cache.clear()  # other weights, fresh version counters
