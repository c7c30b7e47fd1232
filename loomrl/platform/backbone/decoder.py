"""A Qwen2-family causal decoder in plain torch.

Parameter names map one-to-one onto transformers' `Qwen2ForCausalLM`
(`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ..., `model.norm`,
`lm_head`), so HF state dicts load with `load_state_dict(strict=True)`.

One forward serves prefill, incremental decoding and training: it takes
input embeddings (so media encodings can be spliced in), explicit position
ids and a key padding mask, and optionally a KV cache (a list of (k, v) per
layer) that it extends and returns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the input dtype (as Qwen2RMSNorm does).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, T, head_dim] for integer positions [B, T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # broadcast over heads
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=True)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, past=None):
        b, t, _ = x.shape
        d, h, kv = self.cfg.head_dim, self.cfg.num_heads, self.cfg.num_kv_heads
        q = self.q_proj(x).view(b, t, h, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, kv, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, kv, d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        rep = h // kv
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * d)), present


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, past=None):
        a, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class _Body(nn.Module):
    """Holds the `model.*` parameters (HF's Qwen2Model)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """Qwen2ForCausalLM-compatible decoder."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        key_mask: torch.Tensor,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """Logits [B, T, V] and the extended KV cache.

        key_mask: bool [B, S_past + T], True where a key is a real token (False
        for padding). Queries attend causally to real keys.
        """
        b, t, _ = inputs_embeds.shape
        s = key_mask.shape[1]
        causal = torch.ones(t, s, dtype=torch.bool, device=key_mask.device).tril(s - t)
        mask = causal[None, None] & key_mask[:, None, None, :]
        # A padded query row with no visible key would give NaN; let it see itself.
        pos_q = torch.arange(t, device=mask.device)[:, None] + (s - t)
        mask = mask | (torch.arange(s, device=mask.device)[None, :] == pos_q)[None, None]
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta)
        x = inputs_embeds
        new_cache: KVCache = []
        for i, layer in enumerate(self.model.layers):
            x, present = layer(x, cos, sin, mask, None if cache is None else cache[i])
            new_cache.append(present)
        return self.lm_head(self.model.norm(x)), new_cache
