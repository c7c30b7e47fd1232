"""The recipe: the single source of truth for a run.

A recipe is a YAML file mapped onto the typed dataclasses below, plus
`key.path=value` overrides from the command line. Every field is documented
where it is declared. Anything wrong (unknown key, wrong type, value outside
the allowed set, missing file) raises `RecipeError` naming the key path, before
any work starts.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the key path or file."""


# --------------------------------------------------------------------------- model


@dataclass
class VisionConfig:
    """Qwen2-VL vision tower (transformers' Qwen2VisionTransformerPretrainedModel)."""

    depth: int = 2
    """Transformer blocks in the vision tower."""
    embed_dim: int = 64
    """Width of the vision transformer."""
    num_heads: int = 4
    """Attention heads in the vision tower."""
    patch_size: int = 14
    """Spatial patch size in pixels (Qwen2-VL: 14)."""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated to fill it (Qwen2-VL: 2)."""
    spatial_merge_size: int = 2
    """Patches merged per side into one language token by the merger (Qwen2-VL: 2)."""
    min_pixels: int = 56 * 56
    """Lower bound on resized image area (Qwen2-VL's smart_resize)."""
    max_pixels: int = 56 * 56
    """Upper bound on resized image area; the demo keeps images at 56x56 = 4 tokens."""


@dataclass
class AudioConfig:
    """Qwen2-Audio (Whisper-style) audio tower and its log-mel front end."""

    layers: int = 2
    """Transformer layers in the audio encoder."""
    d_model: int = 64
    """Width of the audio encoder."""
    num_heads: int = 4
    """Attention heads in the audio encoder."""
    ffn_dim: int = 128
    """Feed-forward width in the audio encoder."""
    num_mel_bins: int = 80
    """Mel bins of the log-mel spectrogram (Whisper: 80, Qwen2-Audio: 128)."""
    sample_rate: int = 16000
    """Audio is resampled to this rate, mono."""
    clip_seconds: float = 1.0
    """Clips are padded or cut to this length; it fixes the encoder's positions
    (100 mel frames per second, 4 frames per output token)."""


@dataclass
class EncoderConfig:
    """How the vision and audio towers are run and cached."""

    frozen: bool = False
    """Freeze both towers (no gradients); their encodings are then cached across
    steps in a bounded LRU keyed by content hash + encoder identity."""
    cache_size: int = 4096
    """Encodings kept by the cross-step LRU when `frozen` (0 = no cross-step cache)."""
    dedup: bool = True
    """Encode each distinct medium once per mini-batch and route its gradient from
    every micro-batch that uses it (false: encode every copy, the naive path)."""


@dataclass
class RoundingConfig:
    """Rounding location per backbone region (loomrl/platform/backbone/rounding.py). `aligned`:
    FP32 inside the region, one rounding to the working dtype (BF16) at its output, as vLLM's
    fused kernels do; `native`: round where transformers' Qwen2 does. FP32 models compute the
    same numbers either way; `loomrl doctor` measures what each choice does in BF16."""

    rope: Literal["native", "aligned"] = "aligned"
    """RoPE: native rounds cos/sin, x*cos, rotate_half(x)*sin and their sum; aligned rounds the sum once."""
    swiglu: Literal["native", "aligned"] = "aligned"
    """SwiGLU: native rounds silu(gate) and then silu(gate)*up; aligned rounds the product once."""
    rmsnorm: Literal["native", "aligned"] = "aligned"
    """Residual add + RMSNorm: native rounds the sum, the normalised value and its product with
    the weight; aligned rounds the sum (new residual stream) and the output once each."""


@dataclass
class ModelConfig:
    """A Qwen-VL-style model: vision + audio towers, projectors, Qwen2 decoder."""

    tokenizer: str = "demo"
    """`demo` builds the demo task's word-level tokenizer; otherwise a local
    Hugging Face tokenizer folder (nothing is downloaded)."""
    hidden_size: int = 64
    """Width of the language backbone."""
    num_layers: int = 2
    """Decoder layers of the language backbone."""
    num_heads: int = 4
    """Query heads of the backbone attention."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 128
    """SwiGLU MLP width."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the RMSNorms."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the LM head (as small Qwen2 models do)."""
    init_from: Optional[str] = None
    """A local HF checkpoint folder (Qwen2, Qwen2-VL, Qwen2.5-VL or Qwen2-Audio; safetensors) the
    policy starts from: its language model, and its vision or audio tower when it has one. The
    sizes above must match its config.json. null: random initialisation (the demo)."""
    init_std: float = 0.02
    """Std of the random initialisation (models are built from config)."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """The vision tower."""
    audio: AudioConfig = field(default_factory=AudioConfig)
    """The audio tower."""
    encoders: EncoderConfig = field(default_factory=EncoderConfig)
    """Encoder execution and the content-hashed encoding cache."""
    rounding: RoundingConfig = field(default_factory=RoundingConfig)
    """Where the language backbone rounds to its working dtype, per region."""


# --------------------------------------------------------------------------- data


@dataclass
class DemoDataConfig:
    """Procedural demo shards, written when `data.shards` matches nothing."""

    samples: int = 768
    """Samples to generate."""
    samples_per_shard: int = 256
    """Samples per tar shard."""
    seed: int = 1234
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
    seed: int = 0
    """Seed of the epoch shuffle of prompts."""
    shuffle_buffer: int = 1000
    """Samples held by the streaming reader's shuffle buffer (0 = shard order)."""


# --------------------------------------------------------------------------- rollout


@dataclass
class DrafterConfig:
    """NgramRL: speculative decoding with a per-prompt history drafter."""

    enabled: bool = True
    """Draft tokens from earlier completions of the same prompt; the target verifies
    them exactly: the committed tokens are distributed as without drafting."""
    k: int = 8
    """Most tokens drafted per target forward."""
    max_history: int = 16
    """Finished completions kept per prompt (oldest evicted first)."""
    max_history_tokens: int = 8192
    """Token cap of one prompt's history."""
    max_prompts: int = 4096
    """Prompts whose histories are kept (least recently used evicted)."""
    global_history: int = 256
    """Recent completions of any prompt kept as a weaker, cross-prompt draft source
    (0 = per-prompt histories only)."""
    prefetch_budget: int = 16
    """Candidate (accepted length, bonus token) outcomes the prefetcher prepares per
    sequence while the target verifies (0 = no prefetch, plain lookups)."""
    compare_every: int = 0
    """Every N RL steps also generate the same batch without drafting (same weights,
    timing only, discarded) and log the speed-up measured side by side (0 = never)."""


@dataclass
class VLLMConfig:
    """The vLLM rollout engine (`rollout.engine: vllm`)."""

    kv_cache_gib: int = 1
    """KV-cache size in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE, unless the environment sets it)."""
    enforce_eager: bool = True
    """Run eagerly (no graph capture/compilation): starts in seconds."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype inside vLLM (float32 matches the trainer to ~1e-6)."""
    multiprocessing: bool = False
    """Run vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING); off
    runs it in this process, so nothing can be orphaned."""
    max_model_len: int = 512
    """Longest prompt + completion vLLM accepts."""
    health_every: int = 0
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
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are reported for logits / temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    max_new_tokens: int = 20
    """Completion length cap."""
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    """NgramRL speculative decoding."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Settings of the vLLM engine (used when `engine` is `vllm`)."""


# --------------------------------------------------------------------------- algorithm


@dataclass
class RewardSourceConfig:
    """One reward source: a callable or a learned reward model, with its weight."""

    fn: Optional[str] = None
    """A reward callable: registry name or `module:function` (set this or `model`)."""
    model: Optional[str] = None
    """A local folder of a transformers sequence-classification model (safetensors
    weights + tokenizer; nothing is downloaded), run on the trainer's device."""
    weight: float = 1.0
    """Weight of this source in the summed reward."""
    name: Optional[str] = None
    """Name in the metrics (`reward_<name>_mean`); default: the function or folder name."""
    batch_size: int = 32
    """Completions per reward-model forward."""
    max_length: int = 512
    """Reward-model input tokens (prompt + completion, truncated)."""
    label: int = 0
    """Which logit of the reward model's head is the reward."""
    with_prompt: bool = True
    """Score the (prompt text, completion) pair; false: the completion alone."""

    def source_name(self) -> str:
        """The name in the metrics: `name`, else the function's or the folder's name."""
        if self.name:
            return self.name
        return self.fn.split(":")[-1] if self.fn else Path(self.model).resolve().name


@dataclass
class ImportanceConfig:
    """Importance correction for the rollout/trainer mismatch, per token:
    ratio = exp(trainer's old logp - rollout engine's logp)."""

    mode: Literal["none", "truncate", "mask"] = "none"
    """`none`: weight 1 (the ratio is still reported); `truncate`: weight min(ratio, cap)
    (TIS, Yao et al. 2025); `mask`: weight ratio inside [low, high], tokens outside dropped
    (masked IS, as IcePop, Ling Team 2025)."""
    cap: float = 2.0
    """Truncation cap of the ratio (`truncate`)."""
    low: float = 0.5
    """Lower edge of the kept band (`mask`)."""
    high: float = 2.0
    """Upper edge of the kept band (`mask`)."""


@dataclass
class PPOConfig:
    """PPO's critic and advantages (used when algorithm.name is `ppo`)."""

    critic: Literal["value_head", "separate"] = "value_head"
    """`value_head`: a scalar head on the policy's final hidden states, trained with the
    policy's optimizer; `separate`: a second model built like the policy (starting from
    its weights) with a scalar head and its own optimizer."""
    critic_lr: Optional[float] = None
    """Learning rate of the separate critic (null: training.lr)."""
    gamma: float = 1.0
    """Discount of GAE (Schulman et al. 2016)."""
    lam: float = 0.95
    """GAE lambda: 1 = Monte Carlo returns, 0 = one-step TD."""
    value_clip: float = 0.2
    """Clip range of the value update around the old values (0 = off)."""
    value_coef: float = 0.5
    """Weight of the value loss added to the policy loss (`value_head` only)."""
    whiten_advantages: bool = True
    """Normalise the step's token advantages to mean 0, std 1."""


@dataclass
class AlgorithmConfig:
    """The RL objective."""

    name: Literal["grpo", "ppo"] = "grpo"
    """Algorithm. `grpo`: group-relative advantages, PPO-clipped ratio (Shao et al. 2024).
    `ppo`: a critic and GAE advantages, PPO-clipped ratio (Schulman et al. 2017); see `ppo`."""
    reward: str = "slot_match"
    """Reward callable: a registry name (see loomrl.platform.rewards) or
    `module:function`. Called as fn(completion: str, sample: dict) -> float."""
    rewards: list[RewardSourceConfig] = field(default_factory=list)
    """Weighted reward sources (callables and reward models); when given, the reward
    is their weighted sum and `reward` is not used."""
    clip_eps: float = 0.2
    """PPO clip range of the probability ratio."""
    clip_eps_low: Optional[float] = None
    """Lower clip range, ratio >= 1 - clip_eps_low (null: clip_eps)."""
    clip_eps_high: Optional[float] = None
    """Upper clip range, ratio <= 1 + clip_eps_high (null: clip_eps); larger than the
    lower one is DAPO's "clip-higher" (Yu et al. 2025)."""
    loss_norm: Literal["token", "sequence", "constant"] = "token"
    """How token losses are averaged: `token` over all tokens of the mini-batch (DAPO),
    `sequence` per sequence then over sequences (GRPO as published), `constant` sum /
    (sequences x max_new_tokens), no length bias (Dr. GRPO, Liu et al. 2025)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (the policy at the start of
    RL); 0 disables it and the reference model."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """`loss`: k3 KL estimator added to the loss (GRPO); `reward`: kl_coef x (logp_rollout -
    logp_ref) subtracted from the reward, per token for PPO, summed per sequence for GRPO
    (InstructGPT, Ouyang et al. 2022)."""
    scale_rewards: bool = True
    """Divide group advantages by the group's reward std (GRPO); false keeps
    only the mean subtraction (Dr. GRPO)."""
    epochs: int = 1
    """Passes over each step's rollouts (PPO epochs)."""
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)
    """Rollout/trainer importance correction; its ratio is reported every step."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO's critic and GAE."""


# --------------------------------------------------------------------------- training


@dataclass
class WarmupConfig:
    """Optional supervised warm-up before RL."""

    steps: int = 0
    """SFT optimizer steps before RL (0 = none)."""
    batch_size: int = 32
    """Samples per warm-up step."""
    lr: float = 3e-3
    """Learning rate of the warm-up."""
    target: Literal["answer", "format"] = "format"
    """`answer`: imitate the reference answers. `format`: imitate answers whose
    slot words are drawn at random from their choices, teaching the sentence
    format but not the content (samples need `template`/`choices` metadata);
    RL then has to learn the content from the reward alone."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO (used when `training.engine` is `deepspeed`)."""

    zero_stage: int = 2
    """ZeRO stage: 0 plain data parallel, 1 partitions optimizer states, 2 also gradients,
    3 also parameters."""
    bf16: bool = False
    """Train in BF16 with FP32 master weights (needs zero_stage >= 1); false: FP32."""
    offload_optimizer: bool = False
    """Keep optimizer states and the update on the CPU (ZeRO stage >= 1; torch AdamW)."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient-reduction bucket."""


@dataclass
class MegatronConfig:
    """Megatron-core (used when `training.engine` is `megatron`)."""

    tensor_parallel: int = 1
    """Tensor-parallel ranks of the language model; must divide training.nproc (the rest are
    data-parallel replicas), num_heads, num_kv_heads and intermediate_size."""


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    engine: Literal["torch", "deepspeed", "megatron"] = "torch"
    """Training engine. `torch`: single process, the embedded default. `deepspeed`: ZeRO
    (see `deepspeed`). `megatron`: megatron-core tensor + data parallel language model
    (see `megatron`). Rollouts run on a full HF-layout copy synced after every step."""
    steps: int = 100
    """RL steps (one rollout batch and one or more optimizer steps each)."""
    prompts_per_step: int = 8
    """Prompts per RL step; each is sampled `rollout.n` times."""
    mini_batches: int = 1
    """Optimizer steps per RL step per epoch (the batch is split into this many)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    lr_warmup_steps: int = 0
    """Ramp the RL learning rate linearly from lr / N to lr over the first N RL steps (0 = off):
    Adam's first updates move every weight by about lr whatever the gradient's size."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    seed: int = 0
    """Seed of model init and sampling."""
    deterministic: bool = True
    """Deterministic torch algorithms (bit-identical CPU runs for a seed)."""
    threads: int = 0
    """torch intra-op threads (0 = torch's default)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up stage."""
    nproc: int = 1
    """Training processes. Above 1, `loomrl run` launches itself under torchrun with this many
    ranks (gloo on CPU, NCCL on GPU); every rank runs the loop, rank 0 writes the run folder."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """DeepSpeed settings."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Megatron-core settings."""


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
    max_staleness: int = -1
    """Most optimizer steps a trajectory may lag the trainer when it is trained; staler
    groups are dropped (counted, reason `stale`). -1 = no limit."""
    tokens_per_mini_batch: int = 0
    """Token budget (prompt + completion) of one mini-batch; admission never exceeds it,
    a group that alone exceeds it is dropped (reason `over_token_budget`). 0 = no budget."""
    tokens_per_micro_batch: int = 0
    """Padded-token budget of one micro-batch in the layout (rows x longest row); 0 = only
    `training.micro_batch_size` rows per micro-batch."""
    rollout_workers: int = 2
    """Rollout processes in disaggregated mode (beside the `training.nproc` trainer processes)."""
    prompts_per_request: int = 1
    """Prompts a rollout worker generates per request (disaggregated mode)."""
    on_worker_death: Literal["continue", "stop"] = "stop"
    """When a rollout worker dies: `continue` with the others (its in-flight prompts are
    re-queued) or `stop` with a checkpoint and a clear error."""
    worker_timeout_s: float = 300.0
    """A rollout worker silent this long with work in flight is declared dead."""


@dataclass
class LoggingConfig:
    """What a run writes and shows."""

    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    progress: bool = True
    """Show a progress bar with the live reward."""
    mismatch_every: int = 0
    """Every N RL steps, recompute the step's log-probs with a BF16 copy of the policy under each
    rounding setting (as `loomrl doctor` does) and log the mismatch to the rollout log-probs as
    `mismatch_<setting>_{mean,max,kl}` (0 = off)."""


@dataclass
class CheckpointConfig:
    """Checkpoints: safetensors weights + optimizer state, written atomically."""

    every: int = 0
    """Write a checkpoint every N RL steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep the newest K checkpoints."""


@dataclass
class GoalConfig:
    """A pass/fail check of the reward curve, printed in the run summary."""

    first_steps: int = 5
    """Baseline: mean reward over the first N RL steps."""
    last_steps: int = 10
    """Result: mean reward over the last N RL steps."""
    min_final: float = 0.8
    """The result must reach this."""
    min_gain: float = 0.3
    """The result must exceed the baseline by this."""


@dataclass
class Recipe:
    """A whole run."""

    name: str = "run"
    """Name of the run (used for the default output folder)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """KnitTrans trajectory pipeline: colocated or disaggregated roles, admission policy."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    goal: Optional[GoalConfig] = None
    """If set, the summary checks the reward curve and `loomrl run` exits 3 when it misses."""


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _show(value: Any, limit: int = 120) -> str:
    """A value as a message quotes it: repr'd with bounded effort (a few levels and items)
    and cut to `limit` characters, whatever the recipe held."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, limit, limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = 8
    return _cut(r.repr(value), limit)


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


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
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
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{path}: expected a number, got {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{path}: expected a string, got {_show(value)}")
        return value
    raise RecipeError(f"{path}: unsupported field type {tp}")  # a bug in this file, not the recipe


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise RecipeError(f"{_cut(where)}: unknown key; allowed keys here: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in data:
            where = f"{prefix}.{name}" if prefix else name
            kwargs[name] = _convert(data[name], hints[name], where)
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """Apply one `key.path=value` (value parsed as YAML) to a raw recipe dict."""
    if "=" not in override:
        raise RecipeError(f"override {_show(override)}: expected key.path=value")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"override {_cut(key)}: cannot parse value {_show(raw)}: {e}") from None
    except RecursionError:
        raise RecipeError(f"override {_cut(key)}: value nested too deeply") from None
    _check_aliases(value, f"override {_cut(key)}")
    parts = key.strip().split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise RecipeError(f"override {key}: {'.'.join(parts[:i + 1])} is not a mapping")
        node = child
    node[parts[-1]] = value


def expand_pattern(pattern: str) -> list[str]:
    """Shard files matched by a glob or brace range, sorted; only existing files."""
    from braceexpand import braceexpand  # webdataset's dependency

    files: set[str] = set()
    for p in braceexpand(pattern):
        files.update(glob.glob(p))
    return sorted(files)


def resolve_callable(spec: str, key: str = "algorithm.reward") -> Any:
    """A reward (or other) function from a registry name or `module:function`; errors name `key`."""
    from loomrl.platform.rewards import REGISTRY

    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" not in spec:
        raise RecipeError(f"{key}: {spec!r} is neither a registered reward "
                          f"({', '.join(sorted(REGISTRY))}) nor module:function")
    mod, fn = spec.split(":", 1)
    try:
        obj = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise RecipeError(f"{key}: cannot load {spec!r}: {e}") from None
    if not callable(obj):
        raise RecipeError(f"{key}: {spec!r} is not callable")
    return obj


def validate_algorithm(a: AlgorithmConfig) -> None:
    """Checks of the algorithm section: clip ranges, KL, PPO, importance band, reward sources."""
    for key, v in (("clip_eps", a.clip_eps), ("clip_eps_low", a.clip_eps_low), ("clip_eps_high", a.clip_eps_high)):
        if v is not None and v <= 0:
            raise RecipeError(f"algorithm.{key}: must be > 0, got {v}")
    if a.clip_eps_low is not None and a.clip_eps_low >= 1:
        raise RecipeError(f"algorithm.clip_eps_low: must be < 1 (ratio >= 1 - clip_eps_low), got {a.clip_eps_low}")
    if a.kl_coef < 0:
        raise RecipeError(f"algorithm.kl_coef: must be >= 0, got {a.kl_coef}")
    p = a.ppo
    for key, v in (("gamma", p.gamma), ("lam", p.lam)):
        if not 0 <= v <= 1:
            raise RecipeError(f"algorithm.ppo.{key}: must be in [0, 1], got {v}")
    if p.value_clip < 0 or p.value_coef < 0:
        raise RecipeError("algorithm.ppo.value_clip and value_coef: must be >= 0")
    if p.critic_lr is not None and p.critic_lr <= 0:
        raise RecipeError(f"algorithm.ppo.critic_lr: must be > 0, got {p.critic_lr}")
    im = a.importance
    if im.cap < 1:
        raise RecipeError(f"algorithm.importance.cap: must be >= 1, got {im.cap}")
    if not 0 <= im.low <= 1 <= im.high:
        raise RecipeError(f"algorithm.importance: the band [low, high] must contain 1, got [{im.low}, {im.high}]")
    names = set()
    for i, r in enumerate(a.rewards):
        key = f"algorithm.rewards[{i}]"
        if (r.fn is None) == (r.model is None):
            raise RecipeError(f"{key}: set exactly one of fn (a callable) and model (a reward-model folder)")
        if r.fn is not None:
            resolve_callable(r.fn, f"{key}.fn")
        elif not (Path(r.model) / "config.json").is_file():
            raise RecipeError(f"{key}.model: {r.model!r} is not a local transformers model folder (no config.json)")
        if r.batch_size <= 0 or r.max_length <= 0:
            raise RecipeError(f"{key}: batch_size and max_length must be positive")
        name = r.source_name()
        if name in names:
            raise RecipeError(f"{key}: a second source named {name!r}; give each a distinct `name`")
        names.add(name)


def validate(r: Recipe) -> None:
    """Checks across fields and against the file system."""
    positive = {
        "rollout.n": r.rollout.n, "rollout.max_new_tokens": r.rollout.max_new_tokens,
        "training.prompts_per_step": r.training.prompts_per_step,
        "training.mini_batches": r.training.mini_batches,
        "training.micro_batch_size": r.training.micro_batch_size,
        "algorithm.epochs": r.algorithm.epochs, "model.hidden_size": r.model.hidden_size,
        "checkpoint.keep_last": r.checkpoint.keep_last,
    }
    for key, v in positive.items():
        if v <= 0:
            raise RecipeError(f"{key}: must be positive, got {v}")
    t = r.training
    if t.nproc < 1:
        raise RecipeError(f"training.nproc: must be >= 1, got {t.nproc}")
    if t.engine == "torch" and t.nproc != 1:
        raise RecipeError("training.nproc: the torch engine runs in one process; use training.engine "
                          "deepspeed or megatron for more")
    if t.engine != "torch" and r.algorithm.name == "ppo":
        raise RecipeError(f"algorithm.name: ppo trains a value model (value head or separate critic) with the "
                          f"torch engine only; training.engine={t.engine!r} trains the policy alone "
                          f"(use grpo, or training.engine=torch)")
    if t.deepspeed.zero_stage not in (0, 1, 2, 3):
        raise RecipeError(f"training.deepspeed.zero_stage: must be 0, 1, 2 or 3, got {t.deepspeed.zero_stage}")
    if t.deepspeed.zero_stage == 0 and (t.deepspeed.bf16 or t.deepspeed.offload_optimizer):
        raise RecipeError("training.deepspeed.zero_stage: bf16 and offload_optimizer need zero_stage >= 1")
    tp = t.megatron.tensor_parallel
    if tp < 1 or t.nproc % tp:
        raise RecipeError(f"training.megatron.tensor_parallel: {tp} must be >= 1 and divide training.nproc={t.nproc}")
    if t.engine == "megatron" and (r.model.num_kv_heads % tp or r.model.intermediate_size % tp):
        raise RecipeError(f"training.megatron.tensor_parallel: {tp} must divide model.num_kv_heads="
                          f"{r.model.num_kv_heads} and model.intermediate_size={r.model.intermediate_size}")
    if r.training.lr_warmup_steps < 0:
        raise RecipeError(f"training.lr_warmup_steps: must be >= 0, got {r.training.lr_warmup_steps}")
    if r.training.steps < 0:
        raise RecipeError(f"training.steps: must be >= 0, got {r.training.steps}")
    if r.logging.mismatch_every < 0:
        raise RecipeError(f"logging.mismatch_every: must be >= 0, got {r.logging.mismatch_every}")
    if r.rollout.temperature <= 0:
        raise RecipeError("rollout.temperature: must be > 0 (log-probs are of logits / temperature)")
    if not 0 < r.rollout.top_p <= 1:
        raise RecipeError(f"rollout.top_p: must be in (0, 1], got {r.rollout.top_p}")
    if r.model.num_heads % r.model.num_kv_heads or r.model.hidden_size % r.model.num_heads:
        raise RecipeError("model.num_heads: hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    d = r.rollout.drafter
    for key, v, low in (("k", d.k, 1), ("max_history", d.max_history, 1),
                        ("max_history_tokens", d.max_history_tokens, 1), ("max_prompts", d.max_prompts, 1),
                        ("global_history", d.global_history, 0), ("prefetch_budget", d.prefetch_budget, 0),
                        ("compare_every", d.compare_every, 0)):
        if v < low:
            raise RecipeError(f"rollout.drafter.{key}: must be >= {low}, got {v}")
    v = r.rollout.vllm
    if v.kv_cache_gib <= 0 or v.max_model_len <= 0 or v.health_every < 0:
        raise RecipeError("rollout.vllm: kv_cache_gib and max_model_len must be > 0, health_every >= 0")
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
    pl = r.pipeline
    for key, v, low in (("max_staleness", pl.max_staleness, -1), ("tokens_per_mini_batch", pl.tokens_per_mini_batch, 0),
                        ("tokens_per_micro_batch", pl.tokens_per_micro_batch, 0),
                        ("rollout_workers", pl.rollout_workers, 1), ("prompts_per_request", pl.prompts_per_request, 1)):
        if v < low:
            raise RecipeError(f"pipeline.{key}: must be >= {low}, got {v}")
    if pl.worker_timeout_s <= 0:
        raise RecipeError(f"pipeline.worker_timeout_s: must be > 0, got {pl.worker_timeout_s}")
    resolve_callable(r.algorithm.reward)
    validate_algorithm(r.algorithm)


def file_problems(r: Recipe) -> list[str]:
    """What this machine's file system lacks for the recipe: the shards, the tokenizer and the
    checkpoint the policy starts from. `loomrl run --dry-run` reports these as notes, so a recipe
    for another machine (a GPU cluster) still validates here."""
    problems = []
    if r.data.demo is None and not expand_pattern(r.data.shards):
        problems.append(f"data.shards: no files match {_show(r.data.shards)} (and data.demo is null, "
                        f"so none will be generated)")
    if r.model.tokenizer != "demo" and not Path(r.model.tokenizer).is_dir():
        problems.append(f"model.tokenizer: {_show(r.model.tokenizer)} is not 'demo' nor a tokenizer folder")
    if r.model.init_from is not None and not (Path(r.model.init_from) / "config.json").is_file():
        problems.append(f"model.init_from: {_show(r.model.init_from)} is not a local HF checkpoint folder "
                        f"(no config.json)")
    return problems


def load_recipe(path: str | Path | None, overrides: list[str] = (), files: bool = True) -> Recipe:
    """Read a YAML recipe, apply overrides, type-check and validate it (files=False: skip the
    checks against this machine's file system, see `file_problems`)."""
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
        _check_aliases(data, str(path))
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: the top level must be a mapping")
    for o in overrides:
        apply_override(data, o)
    recipe = _build(Recipe, data)
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
            rows.append((key, _type_name(tp), repr(default), docs.get(f.name, "")))
    return rows
