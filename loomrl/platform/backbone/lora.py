"""LoRA (low-rank adapters) on the language model, in plain torch.

`apply_lora(decoder, cfg)` (recipe `model.lora`, rank > 0) turns each targeted nn.Linear of
every decoder layer (`q_proj` ... `down_proj`) into a `LoRALinear` in place and freezes the
language model's own weights (layers, norms, biases); the embeddings (input embedding and
LM head) keep whatever `requires_grad` they had, so the towers and embeddings train or not as
the recipe says. A LoRALinear computes

    y = x @ W^T + b + dropout(x) @ A^T @ B^T * (alpha / rank)

with A (rank x in) kaiming-uniform, as nn.Linear initialises its weight, and B (out x rank)
zero: at init the added term is exactly zero, so the policy starts *exactly* at the base
model (same logits, bit for bit).

Why not peft: its wrappers move a layer's weight to `q_proj.base_layer.weight` and prefix the
model's names, and loomrl reads the decoder's tensors by name in the checkpoint, export
(`hf_io.decoder_tensors`), vLLM weight sync and disaggregated weight messages. Here the layer
keeps its module path and its `weight` / `bias` (the very Parameter objects, so nothing that
holds them goes stale) and only gains `lora_A` / `lora_B` beside them: the state dict is the
plain one plus `*.lora_A` / `*.lora_B` keys, and LoRALinear is still an nn.Linear.

Where the weights go:
- `merged_state_dict(decoder)`: W + (B @ A) * alpha / rank under the plain names, no lora_*
  keys (computed in FP32 or wider, rounded once to W's dtype): what `hf_io.decoder_tensors`
  hands to `loomrl export` and to vLLM.
- `merged(decoder)`: a context manager with the adapters folded into the weights (the
  forward skips them); on exit the base weights are restored bit-exactly from a copy.
- `merge_into(decoder)`: fold the adapters in for good and put plain nn.Linear layers back
  (the decoder is then a plain Decoder, its state dict the merged one).
- Checkpoints, the built-in torch rollout engine (it shares the module) and the
  disaggregated weight messages (rollout workers build the same LoRA policy from the
  recipe) use the modules and the full state dict (base + adapters) as they are.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from loomrl.platform.backbone.config import LoRAConfig

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Linear):
    """An nn.Linear (the base layer's own weight and bias Parameters) plus a low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear's own weight
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False  # True inside `merged()`: the weight already holds the update

    def delta(self) -> torch.Tensor:
        """(B @ A) * alpha / rank, in FP32 (or wider), of the weight's shape."""
        dt = torch.promote_types(self.lora_A.dtype, torch.float32)
        return (self.lora_B.detach().to(dt) @ self.lora_A.detach().to(dt)) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.merged:
            return out
        return out + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scale

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora_rank={self.rank}, lora_alpha={self.alpha}"


def lora_layers(module: nn.Module) -> dict[str, LoRALinear]:
    """The LoRALinear layers of `module`, by module path."""
    return {name: m for name, m in module.named_modules() if isinstance(m, LoRALinear)}


def has_lora(module: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in module.modules())


def lora_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Every adapter weight (lora_A, lora_B) of `module`."""
    return [p for m in lora_layers(module).values() for p in (m.lora_A, m.lora_B)]


def apply_lora(decoder: nn.Module, cfg: LoRAConfig) -> list[nn.Parameter]:
    """Give each targeted linear layer of every decoder layer an adapter (in place) and freeze
    the language model's own weights, embeddings excepted; returns the adapter parameters.
    rank 0 changes nothing. A decoder that already has adapters is a ValueError."""
    if not cfg.rank:
        return []
    if has_lora(decoder):
        raise ValueError("apply_lora: the decoder already has LoRA adapters")
    embeddings = decoder.embedding_parameters()
    for p in decoder.parameters():
        if not any(p is e for e in embeddings):
            p.requires_grad_(False)
    targets = set(cfg.targets)
    for layer in decoder.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in (*ATTENTION, *MLP):
                base = getattr(parent, name, None)
                if name in targets and isinstance(base, nn.Linear):
                    setattr(parent, name, LoRALinear(base, cfg.rank, cfg.alpha, cfg.dropout))
    return lora_parameters(decoder)


def merged_state_dict(decoder: nn.Module, state: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """`decoder`'s state dict (or `state`, a dict under the decoder's names) with every adapter
    folded into its base weight: W + (B @ A) * alpha / rank (FP32 or wider, then W's dtype),
    no lora_* keys, the keys otherwise in their order. A decoder without adapters: unchanged."""
    state = dict(decoder.state_dict() if state is None else state)
    for name, m in lora_layers(decoder).items():
        missing = [k for k in (f"{name}.lora_A", f"{name}.lora_B", f"{name}.weight") if k not in state]
        if missing:
            raise ValueError(f"LoRA merge: {missing[0]} missing from the weights of a LoRA decoder")
        a, b = state.pop(f"{name}.lora_A"), state.pop(f"{name}.lora_B")
        if m.merged:  # inside `merged()`: the weight holds the update already
            continue
        w = state[f"{name}.weight"]
        dt = torch.promote_types(w.dtype, torch.float32)
        merged = w.detach().to(dt) + (b.detach().to(dt) @ a.detach().to(dt)) * m.scale
        state[f"{name}.weight"] = merged.to(w.dtype)
    return state


@contextlib.contextmanager
def merged(decoder: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every LoRALinear's weight holds W + (B @ A) * alpha / rank and its
    forward skips the adapter (same outputs up to rounding, one matmul per layer); on exit the
    base weights are put back exactly (from a copy) and the adapters run again."""
    layers = list(lora_layers(decoder).values())
    saved = [m.weight.detach().clone() for m in layers]
    try:
        with torch.no_grad():
            for m in layers:
                m.weight.copy_(_merged_weight(m))
                m.merged = True
        yield decoder
    finally:
        with torch.no_grad():
            for m, w in zip(layers, saved):
                m.weight.copy_(w)
                m.merged = False


def merge_into(decoder: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight for good and put a plain nn.Linear (holding the
    same weight and bias Parameters) in its place: the decoder becomes a plain one whose state
    dict is `merged_state_dict`'s. Returns the decoder."""
    for name, m in lora_layers(decoder).items():
        with torch.no_grad():
            m.weight.copy_(_merged_weight(m))
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight = m.weight
        plain.register_parameter("bias", m.bias)
        parent_name, _, attr = name.rpartition(".")
        setattr(decoder.get_submodule(parent_name) if parent_name else decoder, attr, plain)
    return decoder


def _merged_weight(m: LoRALinear) -> torch.Tensor:
    """W + (B @ A) * alpha / rank, summed in FP32 (or wider), in W's dtype."""
    delta = m.delta()
    return (m.weight.detach().to(delta.dtype) + delta).to(m.weight.dtype)
