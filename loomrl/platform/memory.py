"""What an engine holds in memory per rank: the plain data of the engines' `memory` traits.

`loomrl plan` (loomrl/commands/plan_bytes.py) estimates the bytes each training rank holds
before a GPU is rented. What an engine keeps is the engine's own business, so each registered
engine brings its own memory model as a trait, a function in its own module:

    TRAINING_ENGINES entry  memory(sizes, precision, training, *, dp, tp) -> TrainingMemory
                            (its weights, gradients and optimizer per rank, as it shards them)
    ROLLOUT_ENGINES entry   memory(sizes, rollout, *, seq_len, rollouts) -> MemoryTerm
                            (what it holds on a trainer rank when colocated)

Their inputs and results are the plain dataclasses below: parameter counts and model sizes
(`ModelSizes`, counted by the plan without allocating the model), bytes per number (`Precision`),
and the engine's config section as the recipe has it. Each result says its bytes and how they
were reckoned (`MemoryTerm.how`, the `how` column of the plan's table), so a new engine's plan
reads as the others'. This module imports nothing from loomrl: the engines and the plan both
use it, and the library never imports the commands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30


def ceil_div(a: float, b: int) -> int:
    """a / b rounded up: a share of `a` bytes over `b` ranks."""
    return int(math.ceil(a / b))


@dataclass(frozen=True)
class MemoryTerm:
    """One kind's bytes per rank, and how they were reckoned (the plan table's `how` column)."""

    bytes: int
    how: str


@dataclass(frozen=True)
class ModelSizes:
    """The policy's sizes as the engines' memory models read them (plain counts, no tensors)."""

    params: int
    """P: every parameter, LoRA adapters included."""
    trainable: int
    """T: the parameters that train."""
    language_model: int
    """The language model's parameters (what a separate rollout engine serves)."""
    tp_split: int
    """Of `params`, the language model's linear weights and biases, embedding and head: what
    tensor parallelism splits (norms, towers and projector are replicated)."""
    tp_split_trainable: int
    """Of `trainable`, the part within `tp_split`."""
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    tied: bool
    """The embedding and the LM head are one matrix."""
    head_dim: int = 0
    """A head's width; 0: hidden_size // num_heads (Qwen3's is its own)."""


@dataclass(frozen=True)
class Precision:
    """Bytes per number, by what holds it."""

    weight: int
    """w: bytes per weight and per gradient (2 when the engine keeps bf16 weights, else 4)."""
    activation: int
    """Bytes per activation: 2 under any bf16, the torch engine's autocast included."""
    optimizer: int
    """Optimizer state per trainable parameter."""
    optimizer_what: str
    dtype: str
    """The weights' dtype as the plan shows it."""


@dataclass(frozen=True)
class TrainingMemory:
    """Weights, gradients and optimizer state per rank, as a training engine shards them."""

    weights: MemoryTerm
    gradients: MemoryTerm
    optimizer: MemoryTerm
    cpu_bytes: int
    """The optimizer offloaded to host memory (0 when it is on the GPU)."""
    desc: str
    """The engine as the plan describes it (`deepspeed ZeRO-3`, ...)."""
    policy_copy: bool
    """The engine trains its own copy, so the trainer also keeps the full float32 policy the
    rollouts use (reloaded from the engine after each step)."""
