"""Hugging Face checkpoint folders in and out of loomrl's model.

Import: a local folder (`config.json` + `model.safetensors`, or shards listed by
`model.safetensors.index.json`) of Qwen2ForCausalLM, Qwen2-VL, Qwen2.5-VL or
Qwen2-Audio. The language model goes into a `Decoder` (its parameter names are
Qwen2ForCausalLM's); the vision / audio towers go through
`loomrl.encoders.hf_checkpoint`. Nothing is downloaded, nothing unpickled.

Export: the same folder layouts, in the *hub* key layout that transformers and
vLLM both load (`model.*` + `lm_head.weight` for Qwen2 / Qwen2-VL / Qwen2.5-VL,
`language_model.model.*` + `language_model.lm_head.weight` for Qwen2-Audio;
not the `language_model.model.model.*` that transformers 5.19 itself writes for
Qwen2-Audio, which vLLM rejects). With tied embeddings `lm_head.weight` is left
out and `tie_word_embeddings: true` written, as transformers does, so every
loader ties the head to the embedding it reads. A folder is written next to
its destination and renamed into place, so a crash never leaves a half folder.
A decoder with LoRA adapters (`lora.py`) is written merged: the plain layout, no lora_* keys.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from loomrl.config.schema import RecipeError, show
from loomrl.encoders.hf_checkpoint import attach_towers, read_config, read_tensors
from loomrl.platform.backbone.decoder import Decoder, DecoderConfig
from loomrl.platform.backbone.hf_bounds import number, size
from loomrl.platform.backbone.lora import merged_state_dict

SUPPORTED = ("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen2_audio", "qwen3_vl")
"""Model types a policy starts from (`model.init_from`)."""
QWEN3 = ("qwen3_vl",)  # head_dim of its own, attention_bias, q/k norm, interleaved M-RoPE
DEFAULT_MAX_SHARD_BYTES = 4 << 30

# Prefixes under which checkpoints keep the language model, mapped to Qwen2ForCausalLM's.
# The longest match wins (Qwen2-Audio as transformers 5.19 writes it nests `model.model.`).
_LM_PREFIXES = {
    "language_model.model.model.": "model.",  # Qwen2-Audio, transformers 5.19's save_pretrained
    "language_model.model.": "model.",  # Qwen2-Audio, hub layout
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",  # Qwen2-VL family, transformers 5 module names
    "model.": "model.",  # Qwen2, Qwen2-VL family hub layout
    "lm_head.": "lm_head.",
}
_NOT_LM = ("model.visual.", "model.audio_tower.", "model.multi_modal_projector.")


def decoder_config(cfg: dict, where: str = "config.json") -> DecoderConfig:
    """A DecoderConfig from a Hugging Face config.json dict of a supported model type."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: {list(SUPPORTED)})")
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"{where}: text_config is not a mapping")
    t = {**cfg, **text}
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: rope_parameters is not a mapping")
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise ValueError(f"{where}: rope type {rope.get('rope_type')!r} is not supported (default RoPE / M-RoPE)")
    if t.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported")
    hidden, heads = size(t, "hidden_size", where), size(t, "num_attention_heads", where)
    kv_heads = size(t, "num_key_value_heads", where, heads)
    qwen3 = model_type in QWEN3
    head_size = size(t, "head_dim", where) if qwen3 and t.get("head_dim") is not None else None
    if (head_size is None and hidden % heads) or heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads {heads} must divide hidden_size {hidden}, and "
            f"num_key_value_heads {kv_heads} must divide num_attention_heads"
        )
    if not qwen3 and t.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"{where}: head_dim {t['head_dim']!r} != hidden_size / num_attention_heads")
    if head_size == hidden // heads:
        head_size = None
    if (head_size or hidden // heads) % 2:
        raise ValueError(f"{where}: head_dim {head_size or hidden // heads} must be even (RoPE)")
    bias = t.get("attention_bias", False)
    if qwen3 and not isinstance(bias, bool):
        raise ValueError(f"{where}: attention_bias {show(bias, 40)} is not true or false")
    # Untied unless the top level (or else the text config) says tie_word_embeddings: true,
    # transformers' default for these families when the key is missing.
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    mrope = rope.get("mrope_section")
    if mrope is not None and (
        not isinstance(mrope, list) or len(mrope) > 8 or not all(type(x) is int and 0 <= x <= 4096 for x in mrope)
    ):
        raise ValueError(f"{where}: mrope_section {str(mrope)[:60]} is not a short list of sizes")
    return DecoderConfig(
        vocab_size=size(t, "vocab_size", where),
        hidden_size=hidden,
        num_layers=size(t, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=size(t, "intermediate_size", where),
        rope_theta=number(rope, "rope_theta", where, number(t, "rope_theta", where, 10000.0)),
        rms_norm_eps=number(t, "rms_norm_eps", where, 1e-6),
        tie_word_embeddings=bool(tie),
        mrope_section=list(mrope) if mrope is not None else None,
        max_position_embeddings=size(t, "max_position_embeddings", where, 32768),
        # Qwen3-VL: transformers interleaves M-RoPE whatever `mrope_interleaved` says, and so does vLLM
        mrope_interleaved=qwen3 and mrope is not None,
        head_size=head_size,
        qkv_bias=bias if qwen3 else True,
        o_bias=bias if qwen3 else False,
        qk_norm=qwen3,
    )


def checkpoint_decoder(init_from: Optional[str]) -> Optional[DecoderConfig]:
    """The language model of model.init_from's config.json; None without one on this machine, or
    when it cannot be read (`fill_from_checkpoint` names that problem)."""
    if init_from is None or not (Path(init_from) / "config.json").is_file():
        return None
    try:
        return decoder_config(read_config(init_from), f"{init_from}/config.json")
    except (ValueError, TypeError, AttributeError):
        return None


def refuse_qwen3(r, what: str) -> None:
    """A RecipeError for a part that does not take Qwen3-VL's language model yet (its q/k norms,
    head width and DeepStack): `what` names the part and the recipe key to change."""
    d = checkpoint_decoder(r.model.init_from)
    if d is not None and d.qk_norm:
        raise RecipeError(
            f"model.init_from: {r.model.init_from} is a Qwen3-VL checkpoint, which {what} does not take yet "
            f"(q/k norms, its own head width, DeepStack); the built-in engines do"
        )


def lm_name(key: str) -> Optional[str]:
    """A checkpoint tensor's name under Qwen2ForCausalLM's names; None: not the language model's."""
    if key.startswith(_NOT_LM):
        return None
    prefix = max((p for p in _LM_PREFIXES if key.startswith(p)), key=len, default=None)
    return None if prefix is None else _LM_PREFIXES[prefix] + key[len(prefix) :]


def language_model_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The language model's tensors of a checkpoint folder, under Qwen2ForCausalLM names."""
    tensors = read_tensors(folder, ("",))
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        name = lm_name(key)
        if name is None:
            continue  # a tower, a projector: not the language model's
        if name in out:
            raise ValueError(f"{folder}: tensor {name} appears under two prefixes")
        out[name] = value
    return out


def load_language_model(folder: str | Path, dtype: Optional[torch.dtype] = None) -> Decoder:
    """A Decoder holding the language model of a local checkpoint folder.

    dtype: cast to this; None keeps the checkpoint's dtype."""
    cfg = decoder_config(read_config(folder), f"{folder}/config.json")
    state = language_model_state(folder)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the head is the embedding, whatever a file adds
    decoder = Decoder(cfg)
    missing, unexpected = decoder.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{folder}: language model tensors do not fit config.json: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    if dtype is None:
        dtype = state["model.embed_tokens.weight"].dtype
    return decoder.to(dtype).eval()


def load_policy(model, folder: str | Path) -> None:
    """Load a checkpoint folder into a loomrl VLM: the language model always, the vision tower
    (Qwen2-VL / Qwen2.5-VL) or the audio tower + projector (Qwen2-Audio) when the folder has it.
    The folder's language model must have the VLM's shapes (vocabulary included)."""

    src = load_language_model(folder, next(model.parameters()).dtype)
    dst = model.language_model
    # the recipe key of each size (vocab_size: the checkpoint's own config, read when the VLM was built)
    keys = {
        "vocab_size": "vocab_size",
        "hidden_size": "model.hidden_size",
        "num_layers": "model.num_layers",
        "num_heads": "model.num_heads",
        "num_kv_heads": "model.num_kv_heads",
        "intermediate_size": "model.intermediate_size",
        "tie_word_embeddings": "model.tie_word_embeddings",
    }
    differ = [
        f"{key} {getattr(dst.cfg, name)!r} (checkpoint: {getattr(src.cfg, name)!r})"
        for name, key in keys.items()
        if getattr(src.cfg, name) != getattr(dst.cfg, name)
    ]
    if differ:
        raise ValueError(
            f"{folder}/config.json: the checkpoint's language model does not fit the recipe's: "
            f"{', '.join(differ)}; leave these keys out of the recipe to take the checkpoint's"
        )
    for name in ("rope_theta", "rms_norm_eps", "mrope_section"):
        setattr(dst.cfg, name, getattr(src.cfg, name))
    for m in dst.modules():  # the norms copied their epsilon when built
        if hasattr(m, "eps"):
            m.eps = src.cfg.rms_norm_eps
    dst.load_state_dict(src.state_dict())
    model_type = read_config(folder)["model_type"]
    attach_towers(
        model,
        vision_folder=folder if model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl") else None,
        audio_folder=folder if model_type == "qwen2_audio" else None,
    )


# --------------------------------------------------------------------------- export


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def text_config(cfg: DecoderConfig, dtype: torch.dtype) -> dict:
    """Qwen2 language-model settings as transformers' config.json spells them."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.mrope_section is not None:
        rope["mrope_section"] = list(cfg.mrope_section)
    qwen3 = {}
    if cfg.qk_norm:  # Qwen3-VL's text config
        rope["mrope_interleaved"] = cfg.mrope_interleaved
        qwen3 = {"model_type": "qwen3_vl_text", "head_dim": cfg.head_dim, "attention_bias": cfg.qkv_bias}
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
        **qwen3,
    }


def decoder_tensors(
    decoder: Decoder,
    prefix_model: str = "model.",
    prefix_head: str = "lm_head.",
    dtype: Optional[torch.dtype] = None,
    tied_head: bool = False,
) -> dict[str, torch.Tensor]:
    """The decoder's tensors under checkpoint names; `lm_head.weight` only when untied, or when
    tied_head asks for it too. LoRA adapters are merged into their weights (`lora.merged_state_dict`:
    a plain Qwen2 layout, no lora_* keys), so every export and vLLM sync sees W + B @ A * scale."""

    out = {}
    for name, t in merged_state_dict(decoder).items():
        if name == "lm_head.weight" and decoder.cfg.tie_word_embeddings and not tied_head:
            continue
        key = (
            prefix_head + name[len("lm_head.") :]
            if name.startswith("lm_head.")
            else prefix_model + name[len("model.") :]
        )
        out[key] = t.detach().to(dtype or t.dtype).contiguous()
        if name == "lm_head.weight" and decoder.cfg.tie_word_embeddings:
            out[key] = out[key].clone()  # safetensors refuses two names for one storage
    return out


def write_folder(
    folder: str | Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write config.json + safetensors (sharded with an index past `max_shard_bytes`) into
    `folder`, atomically: filled beside it, fsynced, then renamed into place. An existing
    folder is refused unless `overwrite`."""

    folder = Path(folder)
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder}: already exists (refusing to overwrite an export)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata=metadata)
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for p in tmp.iterdir():
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    else:
        os.replace(tmp, folder)
    return folder


def export_language_model(
    decoder: Decoder,
    folder: str | Path,
    dtype: Optional[torch.dtype] = None,
    token_ids: Optional[dict] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write `decoder` as a Qwen2ForCausalLM folder (Qwen3-VL's language model: Qwen3ForCausalLM)
    (config.json + safetensors, no tokenizer) that transformers and vLLM load.

    dtype: the tensors' dtype (None: the decoder's). token_ids: optional `bos_token_id`,
    `eos_token_id`, `pad_token_id` for config.json. A decoder with M-RoPE is written without
    `mrope_section` (a text-only Qwen2 model has none; for text positions it is the same RoPE)."""
    dtype = dtype or next(decoder.parameters()).dtype
    qwen3 = decoder.cfg.qk_norm  # Qwen3-VL's language model is a Qwen3ForCausalLM for text
    cfg = {
        **text_config(decoder.cfg, dtype),
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"],
        "model_type": "qwen3" if qwen3 else "qwen2",
        **(token_ids or {}),
    }
    cfg["rope_parameters"].pop("mrope_section", None)
    cfg["rope_parameters"].pop("mrope_interleaved", None)
    return write_folder(folder, cfg, decoder_tensors(decoder, dtype=dtype), max_shard_bytes, overwrite)


_IMAGE_FAMILIES = {  # vision tower config model_type -> (model_type, architecture)
    "qwen2_vl": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "qwen2_vl_vision": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl_vision": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_vision": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
}


def _image_family(tower_type) -> tuple[str, str]:
    """(model_type, architecture) of the HF model a vision tower of this config type exports as."""
    if tower_type not in _IMAGE_FAMILIES:
        raise ValueError(f"vision tower of type {tower_type!r} has no HF model to export to")
    return _IMAGE_FAMILIES[tower_type]


def export_policy(
    model,
    folder: str | Path,
    modality: str,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a loomrl VLM as the HF model of one modality: "image" -> Qwen2-VL, Qwen2.5-VL or Qwen3-VL
    (by the vision tower's type; language model + `visual.*`; Qwen3-VL: `model.language_model.*` +
    `model.visual.*`, the names vLLM's Qwen3-VL reads), "audio" -> Qwen2-Audio (language
    model + `audio_tower.*` + `multi_modal_projector.linear.*`), "text" -> Qwen2ForCausalLM."""
    lm = model.language_model
    dtype = dtype or next(model.parameters()).dtype
    if modality == "text":
        return export_language_model(lm, folder, dtype, None, max_shard_bytes, overwrite)
    text = {**text_config(lm.cfg, dtype), "eos_token_id": model.eos_token_id, "pad_token_id": model.pad_token_id}

    def tower_tensors(module, prefix):
        return {prefix + k: v.detach().to(dtype).contiguous() for k, v in module.state_dict().items()}

    towers = {"image": model.visual, "audio": model.audio_tower}
    if modality in towers and towers[modality] is None:
        can = [m for m, t in towers.items() if t is not None] + ["text"]
        raise ValueError(
            f"the policy has no {'vision' if modality == 'image' else 'audio'} tower to export as "
            f"modality {modality!r} (model.init_from={model.cfg.init_from!r}); it exports as "
            f"{' or '.join(can)}"
        )
    if modality == "image":
        vision = model.visual.config.to_dict()
        model_type, arch = _image_family(vision.get("model_type"))
        if lm.cfg.mrope_section is None:  # Qwen2-VL needs one; text positions make it plain RoPE
            half = lm.cfg.head_dim // 2
            text["rope_parameters"]["mrope_section"] = [half - 2 * (half // 4), half // 4, half // 4]
        config = {
            "architectures": [arch],
            "model_type": model_type,
            "text_config": dict(text),
            "vision_config": vision,
            "image_token_id": model.image_token_id,
            "tie_word_embeddings": lm.cfg.tie_word_embeddings,
            "torch_dtype": text["dtype"],
            "dtype": text["dtype"],
        }
        if model_type == "qwen3_vl":  # vLLM's Qwen3-VL reads these names only (no `model.` fallback)
            lm_tensors = decoder_tensors(lm, "model.language_model.", dtype=dtype)
            tensors = {**lm_tensors, **tower_tensors(model.visual, "model.visual.")}
        else:
            tensors = {**decoder_tensors(lm, dtype=dtype), **tower_tensors(model.visual, "visual.")}
    elif modality == "audio":
        config = {
            "architectures": ["Qwen2AudioForConditionalGeneration"],
            "model_type": "qwen2_audio",
            "text_config": {"model_type": "qwen2", **text},
            "audio_config": model.audio_tower.config.to_dict(),
            "audio_token_index": model.audio_token_id,
            "tie_word_embeddings": lm.cfg.tie_word_embeddings,
            "torch_dtype": text["dtype"],
            "dtype": text["dtype"],
        }
        # transformers 5.19 does not re-tie Qwen2-Audio's head on load (it stays random): always write it
        tensors = {
            **decoder_tensors(lm, "language_model.model.", "language_model.lm_head.", dtype, tied_head=True),
            **tower_tensors(model.audio_tower, "audio_tower."),
            **tower_tensors(model.audio_projector, "multi_modal_projector.linear."),
        }
    else:
        raise ValueError(f"modality {modality!r}: expected 'text', 'image' or 'audio'")
    return write_folder(folder, config, tensors, max_shard_bytes, overwrite)
