"""A Qwen2-family causal decoder in plain torch (and Qwen3-VL's language model).

Parameter names map one-to-one onto transformers' `Qwen2ForCausalLM`
(`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ..., `model.norm`,
`lm_head`), so HF state dicts load with `load_state_dict(strict=True)`.

Qwen3-VL's language model is the same layer with four switches (`DecoderConfig`): a head width
of its own (`head_size`, 128 at hidden 2560 and 32 heads), no attention biases, an RMSNorm over
each head's q and k before RoPE (`q_norm`, `k_norm`: the `qknorm` rounding region), and M-RoPE
frequencies interleaved t, h, w, t, h, w, ... instead of in three blocks. Its DeepStack visual
features (the vision tower's intermediate layers, merged) are added at the media positions to the
hidden states after the first layers (`Decoder.forward(deepstack=...)`).

One forward serves prefill, incremental decoding and training: it takes
input embeddings (so media encodings can be spliced in), explicit position
ids and a key padding mask, and optionally a KV cache (a list of (k, v) per
layer) that it extends and returns.

Where the layers round to the working dtype is chosen per region (RoPE, SwiGLU,
residual add + RMSNorm, attention) by `cfg.rounding` (see `rounding.py`); the layer is
written the way vLLM writes it, carrying the residual stream into the next
norm, so the add + norm is one region. In FP32 every mode computes the same
numbers. Qwen2-VL / Qwen2.5-VL language models use M-RoPE (`mrope_section`):
position ids [3, B, T] (temporal, height, width) instead of [B, T].

Activation checkpointing (`Decoder.activation_checkpointing`, set from the recipe's
`training.activation_checkpointing`): in a forward that builds a graph in train mode without
a KV cache, each layer keeps only its inputs and runs again in the backward
(torch.utils.checkpoint, non-reentrant, so frozen embeddings need no input that requires
grad). The recomputation is the same code on the same inputs, so the gradients are the
plain path's; such a forward returns no KV cache (it would hold every layer's keys and
values until the end of the forward). Rollouts (no grad, eval mode) never checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loomrl.platform.backbone import rounding
from loomrl.platform.backbone.rounding import Regions


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    mrope_section: Optional[list[int]] = None  # M-RoPE: frequencies per (t, h, w); sums to head_dim // 2
    mrope_interleaved: bool = False  # Qwen3-VL: frequency i from row t, h or w by i % 3 (`rope_cos_sin`)
    head_size: Optional[int] = None  # a head's width when it is not hidden_size // num_heads (Qwen3)
    qkv_bias: bool = True  # q/k/v projection biases (Qwen2 family; Qwen3: attention_bias, false)
    o_bias: bool = False  # o_proj bias (Qwen3: attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k, before RoPE
    max_position_embeddings: int = 32768  # only written to exported configs
    rounding: Regions = field(default_factory=Regions)  # read at every forward: switchable in place

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads


KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        self.eps = cfg.rms_norm_eps
        self.cfg = cfg

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """(normed, new residual stream); with a residual, the add is part of the region."""
        return rounding.rms_norm(x, self.weight, self.eps, self.cfg.rounding.rmsnorm, residual)


class HeadNorm(nn.Module):
    """Qwen3's RMSNorm over each head of q or k ([..., heads, head_dim]): the `qknorm` region."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(cfg.head_dim))
        self.eps = cfg.rms_norm_eps
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rounding.rms_norm(x, self.weight, self.eps, self.cfg.rounding.qknorm)[0]


def rope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: Optional[list[int]] = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin of shape [B, T, head_dim] for integer positions [B, T], or [3, B, T]
    with `mrope_section`: band i of the sections takes its angles from position row i
    (transformers' Qwen2-VL / Qwen2.5-VL), or, `interleaved` (Qwen3-VL), frequency j takes
    row h where j % 3 == 1 and j < 3 * section[1], row w where j % 3 == 2 and j < 3 * section[2],
    row t otherwise."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if mrope_section is None:
        if position_ids.dim() != 2:
            raise ValueError(f"position ids must be [B, T] without mrope_section, got {list(position_ids.shape)}")
        freqs = position_ids.float()[..., None] * inv_freq
    else:
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim // 2 = {head_dim // 2}")
        if position_ids.dim() == 2:  # text only: the three rows are equal
            position_ids = position_ids[None].expand(3, -1, -1)
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"M-RoPE position ids must be [3, B, T], got {list(position_ids.shape)}")
        all_freqs = position_ids.float()[..., None] * inv_freq  # [3, B, T, head_dim // 2]
        if interleaved:
            j = torch.arange(head_dim // 2, device=position_ids.device)
            row = torch.zeros_like(j)
            row[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
            row[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
            freqs = all_freqs.gather(0, row.expand(*all_freqs.shape[1:])[None]).squeeze(0)
        else:
            bands = all_freqs.split(list(mrope_section), dim=-1)
            freqs = torch.cat([band[i % 3] for i, band in enumerate(bands)], dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RotaryEmbedding(nn.Module):
    """The RoPE region on q and k (no parameters: a module so that hooks see it, as vLLM's `rotary_emb`)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, q, k, cos, sin):
        mode, mrope = self.cfg.rounding.rope, self.cfg.mrope_section is not None
        return rounding.apply_rope(q, cos, sin, mode, mrope), rounding.apply_rope(k, cos, sin, mode, mrope)


class CoreAttention(nn.Module):
    """The attention region, softmax(q k^T) v (no parameters: a module so that hooks see it, as vLLM's `attn`)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, q, k, v, mask):
        return rounding.attention(q, k, v, mask, self.cfg.rounding.attention)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = HeadNorm(cfg), HeadNorm(cfg)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.attn = CoreAttention(cfg)

    def forward(self, x, cos, sin, mask, past=None):
        b, t, _ = x.shape
        d, h, kv = self.cfg.head_dim, self.cfg.num_heads, self.cfg.num_kv_heads
        q = self.q_proj(x).view(b, t, h, d)
        k = self.k_proj(x).view(b, t, kv, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, kv, d).transpose(1, 2)
        q, k = self.rotary_emb(q, k, cos[:, None], sin[:, None])  # cos/sin broadcast over heads
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        rep = h // kv
        out = self.attn(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * d)), present


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(rounding.swiglu(self.gate_proj(x), self.up_proj(x), self.cfg.rounding.swiglu))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, mask, past=None):
        """x: the previous layer's MLP output (or the embeddings, residual=None); returns this
        layer's MLP output and the residual stream, which the next norm adds first."""
        h, residual = self.input_layernorm(x, residual)
        a, present = self.self_attn(h, cos, sin, mask, past)
        h, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(h), residual, present


class _Body(nn.Module):
    """Holds the `model.*` parameters (HF's Qwen2Model)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg)


class Decoder(nn.Module):
    """Qwen2ForCausalLM-compatible decoder."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.activation_checkpointing = False  # recompute each layer in the backward (module docstring)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The vocabulary-sized weights: the input embedding and the LM head (one tensor when tied)."""
        head = self.lm_head.weight
        return [self.model.embed_tokens.weight] + ([] if head is self.model.embed_tokens.weight else [head])

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        key_mask: torch.Tensor,
        cache: KVCache | None = None,
        block_mask: Optional[torch.Tensor] = None,
        deepstack: Optional[tuple[torch.Tensor, list[torch.Tensor]]] = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """Logits [B, T, V] and the extended KV cache (empty after a checkpointed forward).

        position_ids: [B, T], or [3, B, T] with M-RoPE (`cfg.mrope_section`).
        key_mask: bool [B, S_past + T], True where a key is a real token (False
        for padding). Queries attend causally to real keys.
        block_mask: bool [B, T, T], which of the new tokens each new token sees, in place of
        causal order among them (a draft tree: each node sees its ancestors and itself).
        deepstack: (positions bool [B, T], [features [N, hidden] per level]): Qwen3-VL's DeepStack,
        level i added at the N media positions to the hidden states after layer i (`_deepstack`).
        """
        b, t, _ = inputs_embeds.shape
        s = key_mask.shape[1]
        if block_mask is None:
            causal = torch.ones(t, s, dtype=torch.bool, device=key_mask.device).tril(s - t)[None]
        else:
            past = torch.ones(b, t, s - t, dtype=torch.bool, device=key_mask.device)
            causal = torch.cat([past, block_mask], dim=2)
        mask = causal[:, None] & key_mask[:, None, None, :]
        # A padded query row with no visible key would give NaN; let it see itself.
        pos_q = torch.arange(t, device=mask.device)[:, None] + (s - t)
        mask = mask | (torch.arange(s, device=mask.device)[None, :] == pos_q)[None, None]
        cfg = self.cfg
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)
        x, residual = inputs_embeds, None
        new_cache: KVCache = []
        recompute = self.activation_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            if recompute:
                x, residual = checkpoint(_without_cache, layer, x, residual, cos, sin, mask, use_reentrant=False)
            else:
                x, residual, present = layer(x, residual, cos, sin, mask, None if cache is None else cache[i])
                new_cache.append(present)
            if deepstack is not None and i < len(deepstack[1]):
                x, residual = self._deepstack(x, residual, deepstack[0], deepstack[1][i])
        return self.lm_head(self.model.norm(x, residual)[0]), new_cache

    def _deepstack(self, x, residual, where: torch.Tensor, features: torch.Tensor):
        """One DeepStack level added at the media positions. The layer's hidden state is
        residual + x (the next norm adds them); `native` rounding adds the features to that sum as
        transformers does (the sum becomes the residual stream, x zero: the next add is exact),
        the other modes to x, the MLP output, as vLLM does."""
        features = features.to(x.dtype)
        if self.cfg.rounding.rmsnorm == "native":
            residual, x = residual + x, torch.zeros_like(x)
            return x, residual.masked_scatter(where[..., None], residual[where] + features)
        return x.masked_scatter(where[..., None], x[where] + features), residual


def _without_cache(layer: DecoderLayer, x, residual, cos, sin, mask):
    """One layer's (output, residual) without its keys and values (a checkpointed forward)."""
    out, residual, _ = layer(x, residual, cos, sin, mask)
    return out, residual
