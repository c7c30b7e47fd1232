"""Settings of the training engines (`training`): the optimiser, precision, placement, DeepSpeed,
Megatron, FSDP2, freezing and the supervised warm-up."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Iterable, Literal

from loomrl.config.schema import SEED_MAX, choice, ranged
from loomrl.platform.engines.base import TRAINING_ENGINES


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


@dataclass
class FSDP2Config:
    """PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`; used when `training.engine` is `fsdp2`)."""

    mixed_precision: bool = False
    """BF16 parameters in compute: each FSDP unit all-gathers BF16 copies of its FP32 master
    shards and reduce-scatters its gradients in FP32 (MixedPrecisionPolicy); needs
    training.precision bf16. False with precision bf16: autocast over FP32 weights, as the
    torch engine does."""
    cpu_offload: bool = False
    """Keep the parameter shards, their gradients and the optimizer state in host memory
    (CPUOffloadPolicy); each unit is copied to the device for its forward and backward, and
    AdamW steps on the CPU."""
    reshard_after_forward: bool = True
    """Free each decoder layer's gathered weights after its forward and gather them again in
    the backward (ZeRO-3 like); false keeps them until the backward (ZeRO-2 like: fewer
    all-gathers, more memory)."""


FreezePart = Literal["vision", "merger", "audio", "audio_projector", "language_model", "embeddings"]
"""A part of the policy that `training.freeze` can name."""
FREEZE_PARTS: tuple[str, ...] = typing.get_args(FreezePart)
ENCODER_PARTS = ("vision", "merger", "audio")
"""What `model.encoders.frozen` freezes: both towers, the vision merger included (the audio
projector, applied after the encoding cache, still trains)."""


def frozen_parts(freeze: Iterable[str], encoders_frozen: bool) -> set[str]:
    """The parts a recipe freezes: those `training.freeze` names, and with `model.encoders.frozen`
    the towers (ENCODER_PARTS)."""
    return set(freeze) | (set(ENCODER_PARTS) if encoders_frozen else set())


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    engine: str = choice(TRAINING_ENGINES, "torch")
    """Training engine. `torch`: single process, the embedded default. `deepspeed`: ZeRO
    (see `deepspeed`). `megatron`: megatron-core tensor + data parallel language model
    (see `megatron`). `fsdp2`: PyTorch FSDP2, every decoder layer its own sharded unit (see
    `fsdp2`). Rollouts run on a full HF-layout copy synced after every step."""
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
    precision: Literal["fp32", "bf16", "bf16_params"] = "fp32"
    """Training arithmetic. `fp32`: everything in FP32. `bf16` (mixed precision, engine torch):
    FP32 master weights, gradients and AdamW state; every training forward (the loss's, and the
    old / reference log-probs of `prepare`, so the importance ratio and the KL compare like with
    like) runs under `torch.autocast(bfloat16)` on the model's device, so matmuls and attention
    compute in BF16 while the log-softmax and the loss stay FP32; the backward runs outside
    autocast. Rollouts, validation and `loomrl doctor` are unchanged (the built-in rollout engine
    samples in FP32: expect a larger `logp_mismatch`, see docs/engines.md). Under autocast the
    `model.rounding` regions round to BF16 where their input is a BF16 matmul output (see
    docs/rounding.md). Engine deepspeed: BF16 is `training.deepspeed.bf16`, and `bf16` here needs
    it true; engine megatron has no autocast (use `bf16_params`); engine fsdp2: the same autocast over
    its FP32 shards, and with `training.fsdp2.mixed_precision` BF16 gathered weights. `bf16_params`
    (engines torch, deepspeed with `training.deepspeed.bf16`, megatron): BF16 compute as Megatron and
    DeepSpeed do it: the policy's weights are BF16 (the rollouts of the built-in engine, the old /
    reference log-probs and the loss all run on them, `model.rounding` deciding each region's
    rounding), AdamW steps FP32 master copies, and each micro-batch's gradient is accumulated in FP32
    (`engines/torch_engine.py` MasterWeights; DeepSpeed's `grad_accum_dtype: fp32`)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up stage."""
    nproc: int = ranged(1, ge=1)
    """Training processes. Above 1, `loomrl run` launches itself under torchrun with this many
    ranks (gloo on CPU, NCCL on GPU); every rank runs the loop, rank 0 writes the run folder."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """DeepSpeed settings."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Megatron-core settings."""
    fsdp2: FSDP2Config = field(default_factory=FSDP2Config)
    """FSDP2 settings."""
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
