"""Qwen2 decoder weights between the Hugging Face layout and Megatron-core's GPTModel.

The HF layout (loomrl's backbone/decoder.py, transformers' Qwen2ForCausalLM, what
vLLM serves) keeps q/k/v and gate/up as separate matrices; Megatron fuses them and
splits every fused matrix across tensor-parallel (TP) ranks:

- `linear_qkv` rows are grouped per key/value head g: [q heads of g, k_g, v_g]
  (so a TP rank's contiguous slice of rows is whole groups);
- `linear_fc1` is [gate; up] *per TP rank* (rank r holds [gate_r; up_r]);
- column-parallel layers (qkv, fc1, embedding, output layer) split rows, row-parallel
  layers (linear_proj, fc2) split columns, norms are replicated;
- the vocabulary is padded to a multiple of the TP size (extra rows are zero and are
  dropped on the way back).

Every function is a pure reshuffle of tensors (no arithmetic), so HF -> Megatron ->
HF gives back bit-identical tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Dims:
    """What the layout depends on (read from loomrl's DecoderConfig)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def of(cls, cfg) -> "Dims":
        return cls(
            cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings
        )


def padded_vocab(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """Vocabulary rows Megatron holds: a multiple of tp_size * multiple."""
    m = tp_size * multiple
    return (vocab_size + m - 1) // m * m


def _rows(t: Tensor, rank: int, size: int) -> Tensor:
    return t.chunk(size, dim=0)[rank].clone()


def _cols(t: Tensor, rank: int, size: int) -> Tensor:
    return t.chunk(size, dim=1)[rank].clone()


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, d: Dims) -> Tensor:
    """[q; k; v] (HF) -> rows grouped per kv head, as Megatron's linear_qkv."""
    rep = d.num_heads // d.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(d.num_kv_heads, rep * d.head_dim, *rest)
    k = k.reshape(d.num_kv_heads, d.head_dim, *rest)
    v = v.reshape(d.num_kv_heads, d.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, d: Dims) -> tuple[Tensor, Tensor, Tensor]:
    rep = d.num_heads // d.num_kv_heads
    rest = qkv.shape[1:]
    g = qkv.reshape(d.num_kv_heads, (rep + 2) * d.head_dim, *rest)
    q, k, v = g.split([rep * d.head_dim, d.head_dim, d.head_dim], dim=1)
    return (q.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone())


def _pad_vocab(w: Tensor, rows: int) -> Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def hf_to_megatron(hf: dict[str, Tensor], d: Dims, tp_rank: int = 0, tp_size: int = 1) -> dict[str, Tensor]:
    """The state dict of TP rank `tp_rank` of a GPTModel from an HF-layout decoder state dict
    (keys `model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`, ...)."""
    if d.num_kv_heads % tp_size or d.num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel={tp_size} must divide num_heads={d.num_heads} and num_kv_heads={d.num_kv_heads}"
        )
    r, n = tp_rank, tp_size
    vocab = padded_vocab(d.vocab_size, n)
    out = {"embedding.word_embeddings.weight": _rows(_pad_vocab(hf["model.embed_tokens.weight"], vocab), r, n)}
    for i in range(d.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        for kind in ("weight", "bias"):
            qkv = _fuse_qkv(*(hf[f"{h}self_attn.{p}_proj.{kind}"] for p in "qkv"), d)
            out[f"{m}self_attention.linear_qkv.{kind}"] = _rows(qkv, r, n)
        out[m + "self_attention.linear_proj.weight"] = _cols(hf[h + "self_attn.o_proj.weight"], r, n)
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_rows(gate, r, n), _rows(up, r, n)])
        out[m + "mlp.linear_fc2.weight"] = _cols(hf[h + "mlp.down_proj.weight"], r, n)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if not d.tie_word_embeddings:
        out["output_layer.weight"] = _rows(_pad_vocab(hf["lm_head.weight"], vocab), r, n)
    return out


def megatron_to_hf(shards: list[dict[str, Tensor]], d: Dims) -> dict[str, Tensor]:
    """An HF-layout decoder state dict from the state dicts of all TP ranks (in rank order).
    With tied embeddings `lm_head.weight` is the embedding tensor itself (as in the HF model)."""

    def rows(key):
        return torch.cat([s[key] for s in shards], dim=0)

    def cols(key):
        return torch.cat([s[key] for s in shards], dim=1)

    hf = {"model.embed_tokens.weight": rows("embedding.word_embeddings.weight")[: d.vocab_size].clone()}
    for i in range(d.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        hf[h + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"].clone()
        hf[h + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"].clone()
        for kind in ("weight", "bias"):
            q, k, v = _split_qkv(rows(f"{m}self_attention.linear_qkv.{kind}"), d)
            hf[f"{h}self_attn.q_proj.{kind}"], hf[f"{h}self_attn.k_proj.{kind}"] = q, k
            hf[f"{h}self_attn.v_proj.{kind}"] = v
        hf[h + "self_attn.o_proj.weight"] = cols(m + "self_attention.linear_proj.weight")
        fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
        hf[h + "mlp.down_proj.weight"] = cols(m + "mlp.linear_fc2.weight")
    hf["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    if d.tie_word_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    else:
        hf["lm_head.weight"] = rows("output_layer.weight")[: d.vocab_size].clone()
    return hf
