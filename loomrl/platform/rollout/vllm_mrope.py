"""M-RoPE policies served by vLLM: how a policy whose decoder has `mrope_section` (a Qwen2-VL /
Qwen2.5-VL checkpoint via `model.init_from`) maps onto vLLM's own Qwen2-VL model, for the vLLM rollout
engine (`vllm_engine.py`): which policies take this path (`uses_mrope`), the folder vLLM loads
(`export_mrope_language_model`) and one prompt's request (`mrope_prompt`).

The language model is served as vLLM's own `Qwen2VLForConditionalGeneration` /
`Qwen2_5_VLForConditionalGeneration` (not as the `Qwen2ForCausalLM` fed prompt embeddings that other
policies get, `vllm_engine.py`), so vLLM computes the (t, h, w) positions itself
(`get_mrope_input_positions`, vllm/model_executor/models/qwen2_vl.py:1354, from each image's
placeholder offset and `image_grid_thw`; generated tokens continue at max + 1). The media still
come from the trainer's towers, as precomputed image embeddings (`multi_modal_data={"image":
{"image_embeds", "image_grid_thw"}}`, `enable_mm_embeds`); every image modality limit is 0, so
vLLM builds no tower (`_mark_tower_model`, models/interfaces.py:339) and the weights stay
language-model only (the same names, mapped by the model's `hf_to_vllm_mapper`). vLLM's processor
expands one placeholder per image to the grid's token count (qwen2_vl.py `_get_prompt_updates`),
so each prompt goes in with its placeholder runs collapsed and comes back checked against the
trainer's expanded ids. That processor needs the tokenizer: the export folder also holds the
policy's tokenizer and a preprocessor config (vLLM loads both while it starts).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loomrl.encoders.base import modality
from loomrl.encoders.hf_checkpoint import read_config
from loomrl.platform.backbone.hf_io import decoder_tensors, text_config, write_folder
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.placement import to_host
from loomrl.platform.rollout.base import Prompt


def uses_mrope(model) -> bool:
    """Whether the trainer gives `model` M-RoPE (t, h, w) positions (`VLM.position_ids`)."""
    return model.language_model.cfg.mrope_section is not None and model.image_token_id is not None


# vision tower type -> (model_type, vLLM architecture, HF processor class) served for M-RoPE policies
_MROPE_SERVED = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    "qwen2_vl_vision": ("qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    "qwen2_5_vl_vision": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
    "qwen3_vl_vision": ("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
}


def served_prefix(model) -> str:
    """The prefix vLLM's model class reads the language model's `model.*` tensors under: Qwen3-VL's
    only maps `model.language_model.*` (no `model.*` fallback as Qwen2-VL's has)."""
    return "model.language_model." if model.language_model.cfg.qk_norm else "model."


def export_mrope_language_model(model, folder: str, dtype: torch.dtype = torch.float32) -> None:
    """Write an M-RoPE policy's language model as a Qwen2-VL / Qwen2.5-VL folder vLLM serves with
    precomputed image embeddings: config.json with the vision config (for the merge size and the
    processor; no tower weights: vLLM builds no tower when every image limit is 0), the language
    model's tensors (hub names), the policy's tokenizer and a preprocessor config with its image
    sizes (vLLM sizes its encoder cache by `max_pixels`)."""
    lm, vcfg = model.language_model, model.cfg.vision
    if model.visual is None:
        raise ValueError(
            f"vLLM: an M-RoPE policy without a vision tower (model.init_from="
            f"{model.cfg.init_from!r}) has no image model to serve"
        )
    vision = model.visual.config.to_dict()
    served = _MROPE_SERVED.get(vision.get("model_type"))
    if served is None:
        raise ValueError(
            f"vLLM: an M-RoPE policy with a vision tower of type {vision.get('model_type')!r} "
            f"has no vLLM architecture (expected one of {sorted(_MROPE_SERVED)})"
        )
    model_type, arch, processor = served
    image = model.media_tokens_of["image"]
    text = {**text_config(lm.cfg, dtype), "eos_token_id": model.eos_token_id, "pad_token_id": model.pad_token_id}
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": image.placeholder,
        "tie_word_embeddings": lm.cfg.tie_word_embeddings,
        "eos_token_id": model.eos_token_id,
        "torch_dtype": text["dtype"],
        "dtype": text["dtype"],
    }
    if len(image.before) == 1 and len(image.after) == 1:
        config["vision_start_token_id"], config["vision_end_token_id"] = image.before[0], image.after[0]
    video = model.media_tokens_of.get("video")
    if video is not None:
        config["video_token_id"] = video.placeholder
    elif model.cfg.init_from is not None:  # an id vLLM's config reads even when the policy reads no video
        hf = read_config(model.cfg.init_from)
        config.update({k: hf[k] for k in ("video_token_id",) if k in hf})
    write_folder(folder, config, decoder_tensors(lm, served_prefix(model), dtype=dtype), overwrite=True)
    load_tokenizer(model.cfg.tokenizer).save_pretrained(folder)
    pre = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor,
        "min_pixels": vcfg.min_pixels,
        "max_pixels": vcfg.max_pixels,
        "patch_size": vcfg.patch_size,
        "temporal_patch_size": vcfg.temporal_patch_size,
        "merge_size": vcfg.spatial_merge_size,
        "image_mean": list(vcfg.image_mean),
        "image_std": list(vcfg.image_std),
    }
    Path(folder, "preprocessor_config.json").write_text(json.dumps(pre, indent=2))


def _find(ids: list[int], part: list[int], start: int) -> int:
    """The first index >= start where `part` sits in `ids`; -1 when it does not."""
    for j in range(start, len(ids) - len(part) + 1):
        if ids[j : j + len(part)] == part:
            return j
    return -1


def mrope_prompt(model, p: Prompt, encodings, tokenizer) -> dict:
    """A prompt for vLLM's Qwen2-VL family: token ids with each medium's tokens collapsed to what
    vLLM's processor expands again (an image's or clip's placeholder run to one placeholder, from
    image_grid_thw / video_grid_thw; a Qwen3-VL clip's timestamped patches to one bare video token,
    from its grid and `timestamps`, as vLLM does with transformers >= 5.10's processor) and the
    trainer's encodings as precomputed embeddings, in prompt order (Qwen3-VL's with their DeepStack
    features after each token's, the width vLLM's Qwen3-VL splits them off at); a Qwen2.5-VL clip
    also carries `second_per_grid_ts` (its time in M-RoPE). `tokenizer`: the policy's (timestamps)."""
    if any(m.kind not in ("image", "video") for m in p.media):
        raise ValueError(
            f"prompt {p.id}: vLLM serves this M-RoPE policy with images and videos only, "
            f"got {[m.kind for m in p.media]}"
        )
    ids, collapsed, i = list(p.ids), [], 0
    for m in p.media:
        spec = model.media_tokens_of[m.kind]
        expect = modality(m.kind).prompt_tokens(m, spec, tokenizer, model.cfg)
        j = _find(ids, expect, i)
        if j < 0:
            raise ValueError(f"prompt {p.id}: a {m.kind}'s {len(expect)} tokens are not where expected")
        collapsed += ids[i:j] + (
            [spec.placeholder] if spec.per_frame else [*spec.before, spec.placeholder, *spec.after]
        )
        i = j + len(expect)
    if set(ids[i:]) & set(model.placeholder_ids()):
        raise ValueError(f"prompt {p.id}: more media placeholders than media")
    inp: dict = {"prompt_token_ids": collapsed + ids[i:]}
    data: dict = {}
    for kind in ("image", "video"):
        media = [m for m in p.media if m.kind == kind]
        if media:
            data[kind] = {
                f"{kind}_embeds": to_host(torch.cat([encodings[m.key] for m in media]).to(torch.float32)),
                f"{kind}_grid_thw": torch.stack([m.grid for m in media]),
            }
    clips = [m for m in p.media if m.kind == "video"]
    if clips and model.media_tokens_of["video"].per_frame:
        data["video"]["timestamps"] = [torch.tensor(m.times) for m in clips]
    elif clips and hasattr(model.visual.config, "tokens_per_second"):
        data["video"]["second_per_grid_ts"] = torch.tensor([m.seconds_per_grid for m in clips])
    if data:
        inp["multi_modal_data"] = data
    return inp
