"""The bytes each training rank holds under `loomrl plan`, by kind, from the parameter counts.

The other half of `loomrl plan`: plan_params.py counts the parameters; this module turns the counts
into bytes per rank, one kind at a time, each a `MemoryTerm` (its bytes and the line saying how they
were reckoned); loomrl/commands/plan.py runs the phases in order and adds the kinds up into a `Plan`.
The phases, each a function of the recipe and what the earlier ones found: `ranks_of` (world, tp,
dp), `precision_of` (bytes per weight, activation and optimizer entry), `vocab_rows`,
`training_state` (weights, gradients, optimizer, as the engine shards them), `micro_batch_of` and
`activations`, `rollout_term`, `kept_copies` (the policy copy, the reference), `plan_notes`.

What depends on the engine is read from its registry entry, never from its name (the functions in
the engine's own module; loomrl/platform/memory.py holds the plain data they take and return): a
training engine's `memory` (weights, gradients, optimizer per rank, and whether the trainer keeps a
policy copy beside it), `tensor_parallel` (tp of its config), `padded_vocab`, `bf16` (its own BF16
switch) and `autocast` (its bf16 keeps fp32 weights); a rollout engine's `sequence_length` (the
tokens it bounds a sequence to) and `memory` (what it holds on a trainer rank). The formulas below
are the registered engines'.

Bytes per rank (P: parameters, T: trainable ones, w: 2 bytes in bf16, else 4 for fp32; the torch
engine's `training.precision: bf16` is autocast: its weights, gradients and optimizer stay fp32, only
the activations take 2 bytes;
world = training.nproc, tp = training.megatron.tensor_parallel for Megatron else 1,
dp = world / tp):
- weights: P * w. DeepSpeed ZeRO-3 divides by dp. Megatron divides the language model's
  linear weights and biases and its (vocab-parallel, padded to a multiple of tp) embedding
  and head by tp; norms, towers and projector are replicated.
- gradients: T * w. ZeRO-2/3 divide by dp; Megatron shards T as it shards P.
- optimizer (AdamW): T * (8 + 4 in bf16): two fp32 moments, plus an fp32 master copy when
  the weights are bf16. ZeRO-1/2/3 divide by dp; `training.deepspeed.offload_optimizer`
  moves it to host memory (reported as cpu bytes, not GPU).
- activations, one micro-batch of b = training.micro_batch_size sequences of s tokens
  (s = rollout.vllm.max_model_len with vLLM rollouts, else rollout.max_new_tokens + 512
  prompt tokens; `--seq-len` overrides), hidden size h, a heads, L decoder layers, vocab v,
  after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", tensor parallel without sequence parallelism, as loomrl's Megatron engine runs):
      per layer  s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) bytes in 16-bit
                 (34 + 5 a s / h at tp = 1), times w / 2 for fp32;
      layers     L * per layer; with activation checkpointing (`training.
                 activation_checkpointing`, when a recipe has it) L * w * s * b * h (each
                 layer's input) + one layer's full activations;
      logits     (w + 4) * s * b * v: the logits and their fp32 log-softmax, which backward
                 keeps (Megatron gathers the full vocabulary: not divided by tp).
  The 5 a s / h term is the attention score matrix; a fused attention kernel (SDPA's
  memory-efficient or flash kernels on a GPU) stores none of it, so the output names it
  separately and `--fused-attention` plans without it. The towers' activations are not
  counted.
- rollout, colocated: vLLM holds its own copy of the language model (rollout.vllm.dtype)
  plus its KV cache (rollout.vllm.kv_cache_gib); the built-in engine holds a KV cache for
  one step's share of rollouts (2 * L * kv_heads * head_dim * s * rows * 4 bytes, rows =
  ceil(prompts_per_step / world) * rollout.n). Disaggregated rollouts hold nothing on the
  trainer ranks.
- policy_copy: DeepSpeed and Megatron train their own copy; the trainer keeps the full
  policy in float32 (P * 4) for the rollouts (its towers encode the media) and loads the
  engine's weights into it after each step. None with the torch engine.
- reference: the frozen reference policy of a KL penalty (algorithm.kl_coef > 0), P * 4.
total = the sum. These are estimates of the tensors loomrl keeps; allocator fragmentation,
CUDA context (~0.5-1 GiB), communication buffers and temporary copies come on top, so a
plan with little headroom may still not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from loomrl.commands.plan_params import Counts, PlanError
from loomrl.config.registry import Registry
from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.engines.base import TRAINING_ENGINES
from loomrl.platform.memory import GIB, MemoryTerm, ModelSizes, Precision, TrainingMemory
from loomrl.platform.rollout.base import ROLLOUT_ENGINES


@dataclass(frozen=True)
class Ranks:
    """How the recipe's training ranks split the work."""

    engine: str
    world: int
    """training.nproc"""
    tp: int
    """The engine's tensor parallelism (its `tensor_parallel` trait; 1 without one)."""
    dp: int

    def as_dict(self) -> dict:
        return {"world": self.world, "dp": self.dp, "tp": self.tp}


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of training: what its activations depend on besides the model."""

    seq_len: int
    seq_len_from: str
    size: int
    checkpointing: bool
    fused_attention: bool


@dataclass(frozen=True)
class Activations:
    """`activation_bytes`' figures for a micro-batch, and the formula that gave them."""

    bytes: dict
    how: str


def _trait(registry: Registry, name: str, trait: str) -> Any:
    """The `trait` of the part registered as `name`; a PlanError when it has none (a memory model
    the plan cannot do without)."""
    value = registry.get(name).trait(trait)
    if value is None:
        raise PlanError(f"{registry.key}: the {registry.kind} {name!r} has no `{trait}` trait for `loomrl plan`")
    return value


def sizes_of(c: Counts) -> ModelSizes:
    """The counts as the engines' memory models read them (P counts the LoRA adapters)."""
    return ModelSizes(
        params=c.total + c.lora,
        trainable=c.trainable,
        language_model=c.language_model,
        tp_split=c.lm_tp,
        tp_split_trainable=c.trainable_tp,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        num_layers=c.num_layers,
        tied=c.tied,
        head_dim=c.head_dim,
    )


def _bf16(recipe: R.Recipe) -> bool:
    t = recipe.training
    precision = str(getattr(t, "precision", "") or "").lower()
    if precision in ("bf16", "bfloat16"):
        return True
    switch = TRAINING_ENGINES.get(t.engine).trait("bf16")
    return bool(switch(t)) if switch is not None else False


def sequence_length(recipe: R.Recipe, override: Optional[int] = None) -> tuple[int, str]:
    """(tokens per trained sequence, where that figure comes from): the rollout engine's
    `sequence_length` trait."""
    if override is not None:
        return override, "--seq-len"
    return _trait(ROLLOUT_ENGINES, recipe.rollout.engine, "sequence_length")(recipe.rollout)


def activation_bytes(
    c: Counts,
    s: int,
    b: int,
    tp: int,
    w: int,
    checkpointing: bool,
    *,
    vocab_rows: Optional[int] = None,
    fused_attention: bool = False,
) -> dict:
    """{"layers", "attention_scores", "logits", "total"} for one micro-batch (formulas: module docstring);
    fused_attention: the attention kernel stores no score matrix (the 5 a s / h term is 0)."""
    h, a, L = c.hidden_size, c.num_heads, c.num_layers
    v = vocab_rows or c.vocab_size
    scores = 0 if fused_attention else 5 * a * s * s * b / tp * w / 2
    per_layer = s * b * h * (10 + 24 / tp) * w / 2 + scores
    if checkpointing:  # each layer's input kept, one layer's activations recomputed at a time
        layers = L * w * s * b * h + per_layer
    else:
        layers, scores = L * per_layer, L * scores
    logits = (w + 4) * s * b * v
    out = {"layers": int(layers), "attention_scores": int(scores), "logits": int(logits)}
    out["total"] = out["layers"] + out["logits"]
    return out


def ranks_of(recipe: R.Recipe) -> Ranks:
    """world = training.nproc, tp = the engine's `tensor_parallel` trait (Megatron's
    training.megatron.tensor_parallel) else 1, dp = world / tp."""
    t = recipe.training
    tp_of = TRAINING_ENGINES.get(t.engine).trait("tensor_parallel")
    tp = tp_of(t) if tp_of is not None else 1
    return Ranks(engine=t.engine, world=t.nproc, tp=tp, dp=t.nproc // tp)


def precision_of(recipe: R.Recipe, engine: str) -> Precision:
    """Bytes per weight, activation and optimizer entry under the recipe's precision and engine."""
    if recipe.training.precision == "bf16_params":  # BF16 weights and gradients; FP32 masters and their gradients
        return Precision(
            weight=2,
            activation=2,
            optimizer=16,
            optimizer_what="fp32 master, its fp32 gradient sum, 2 fp32 moments",
            dtype="bf16, fp32 masters",
        )
    bf16 = _bf16(recipe)
    # an `autocast` engine's bf16 (torch's) is autocast: FP32 weights, gradients and optimizer, BF16 activations;
    # the others (DeepSpeed's) keep BF16 weights and gradients beside an FP32 master copy
    bf16_weights = bf16 and not TRAINING_ENGINES.get(engine).trait("autocast", False)
    return Precision(
        weight=2 if bf16_weights else 4,
        activation=2 if bf16 else 4,
        optimizer=8 + (4 if bf16_weights else 0),
        optimizer_what="fp32 master + 2 fp32 moments" if bf16_weights else "2 fp32 moments",
        dtype="bf16" if bf16_weights else ("fp32, bf16 autocast" if bf16 else "fp32"),
    )


def vocab_rows(c: Counts, ranks: Ranks) -> int:
    """The vocabulary's rows as the engine holds them: its `padded_vocab` trait pads them (Megatron: to
    a multiple of tp)."""
    pad = TRAINING_ENGINES.get(ranks.engine).trait("padded_vocab")
    return pad(c.vocab_size, ranks.tp) if pad is not None else c.vocab_size


def training_state(c: Counts, recipe: R.Recipe, ranks: Ranks, prec: Precision) -> TrainingMemory:
    """Weights, gradients and optimizer per rank, as the engine's `memory` trait reckons them (ZeRO
    shards them over dp, Megatron over tp, torch not at all)."""
    memory = _trait(TRAINING_ENGINES, ranks.engine, "memory")
    return memory(sizes_of(c), prec, recipe.training, dp=ranks.dp, tp=ranks.tp)


def micro_batch_of(recipe: R.Recipe, seq_len: Optional[int], fused_attention: bool) -> MicroBatch:
    """The trained micro-batch: its sequences' length (seq_len: `--seq-len`), their number, the settings."""
    s, s_from = sequence_length(recipe, seq_len)
    t = recipe.training
    return MicroBatch(
        seq_len=s,
        seq_len_from=s_from,
        size=t.micro_batch_size,
        checkpointing=bool(getattr(t, "activation_checkpointing", False)),
        fused_attention=fused_attention,
    )


def activations(c: Counts, mb: MicroBatch, prec: Precision, *, tp: int, vocab: int) -> Activations:
    """The micro-batch's activation bytes (`activation_bytes`) and the formula, as the table shows it."""
    s, b, checkpointing, act_w = mb.seq_len, mb.size, mb.checkpointing, prec.activation
    act = activation_bytes(c, s, b, tp, act_w, checkpointing, vocab_rows=vocab, fused_attention=mb.fused_attention)
    terms = ["10 + 24/tp" if tp > 1 else "34"] + (
        [] if mb.fused_attention else ["5*a*s/(h*tp)" if tp > 1 else "5*a*s/h"]
    )
    layer_formula = " + ".join(terms)
    scale = "" if act_w == 2 else " x 2 (fp32)"
    layer = "s*b*h x " + (f"({layer_formula})" if "+" in layer_formula else layer_formula) + scale
    how = (
        f"{f'{c.num_layers} x w*s*b*h + 1 x {layer}' if checkpointing else f'{c.num_layers} x {layer}'}"
        f" + ({act_w}+4)*s*b*v logits; s={s}, b={b}, h={c.hidden_size}, a={c.num_heads}, "
        f"v={vocab}"
    )
    return Activations(bytes=act, how=how)


def rollout_term(c: Counts, recipe: R.Recipe, *, world: int, seq_len: int) -> MemoryTerm:
    """What a colocated rollout engine holds on a trainer rank, as its `memory` trait reckons it for one
    step's share of rollouts (nothing when disaggregated)."""
    r = recipe.rollout
    if recipe.pipeline.mode == "disaggregated":
        return MemoryTerm(0, "disaggregated: the rollout workers hold the rollout engine, not the trainer ranks")
    rows = math.ceil(recipe.training.prompts_per_step / world) * r.n
    return _trait(ROLLOUT_ENGINES, r.engine, "memory")(sizes_of(c), r, seq_len=seq_len, rollouts=rows)


def kept_copies(c: Counts, recipe: R.Recipe, *, policy_copy: bool) -> dict[str, MemoryTerm]:
    """The policies kept beside the engine's (float32; bfloat16 under bf16_params): the trainer's copy for
    the rollouts (policy_copy: the engine trains its own, as DeepSpeed and Megatron do), the frozen
    reference of a KL penalty or of DPO."""
    out = {}
    w, dtype = (2, "bfloat16") if recipe.training.precision == "bf16_params" else (4, "float32")
    if policy_copy:
        out["policy_copy"] = MemoryTerm(
            c.total * w,
            f"{c.total:,} params x {w} B: the trainer's {dtype} policy the rollouts use "
            f"(reloaded from the engine after each step)",
        )
    entry = ALGORITHMS.get(recipe.algorithm.name)
    if entry.trait("preference") or (recipe.algorithm.kl_coef > 0 and not entry.trait("supervised")):
        why = f"algorithm.name={recipe.algorithm.name}" if entry.trait("preference") else "algorithm.kl_coef > 0"
        out["reference"] = MemoryTerm(c.total * w, f"{c.total:,} params x {w} B: the frozen reference policy ({why})")
    return out


def plan_notes(act: dict, fused_attention: bool) -> list[str]:
    """The notes under the table: the attention scores' share of the activations, what is not counted."""
    notes: list[str] = []
    if fused_attention:
        notes.append(
            "--fused-attention: no attention score matrix is stored (SDPA's memory-efficient or flash kernel on a GPU)"
        )
    elif act["attention_scores"] > act["total"] / 2:
        notes.append(
            f"most activation bytes are attention scores ({act['attention_scores'] / GIB:.1f} GiB), which "
            f"a fused attention kernel does not store (--fused-attention plans with one); activation "
            f"checkpointing, a smaller training.micro_batch_size or shorter sequences also cut them"
        )
    notes.append(
        "the towers' activations, the CUDA context, communication buffers and allocator fragmentation are not counted"
    )
    return notes
