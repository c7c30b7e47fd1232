"""A Qwen2 decoder forward written out by hand, in the working dtype of its inputs, with every
rounding region (RoPE, SwiGLU, residual add + RMSNorm, attention) computed in FP32 and rounded once at its
output: the documented meaning of `aligned`, written independently of the backbone's code."""

import torch
import torch.nn.functional as F


def aligned_logits(dec, embeds: torch.Tensor, position_ids: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    cfg, p, dt = dec.cfg, dict(dec.named_parameters()), embeds.dtype
    b, t, _ = embeds.shape
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def linear(x, name):
        return F.linear(x, p[name + ".weight"], p.get(name + ".bias"))

    def add_norm(x, residual, weight):
        s = x.float() if residual is None else residual.float() + x.float()
        out = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight.float()
        return out.to(dt), (x if residual is None else s.to(dt))

    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = position_ids.float()[..., None] * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]

    def rope(x):
        xf = x.float()
        rotated = torch.cat((-xf[..., d // 2 :], xf[..., : d // 2]), -1)
        return (xf * cos + rotated * sin).to(dt)

    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & key_mask[:, None, None, :]
    mask = mask | torch.eye(t, dtype=torch.bool)[None, None]
    x, residual = embeds, None
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        y, residual = add_norm(x, residual, p[pre + "input_layernorm.weight"])
        q = rope(linear(y, pre + "self_attn.q_proj").view(b, t, h, d).transpose(1, 2))
        k = rope(linear(y, pre + "self_attn.k_proj").view(b, t, kv, d).transpose(1, 2))
        v = linear(y, pre + "self_attn.v_proj").view(b, t, kv, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(
            q.float(), k.repeat_interleave(h // kv, 1).float(), v.repeat_interleave(h // kv, 1).float(), attn_mask=mask
        ).to(dt)
        a = linear(a.transpose(1, 2).reshape(b, t, h * d), pre + "self_attn.o_proj")
        y, residual = add_norm(a, residual, p[pre + "post_attention_layernorm.weight"])
        gate, up = linear(y, pre + "mlp.gate_proj"), linear(y, pre + "mlp.up_proj")
        x = linear((F.silu(gate.float()) * up.float()).to(dt), pre + "mlp.down_proj")
    y, _ = add_norm(x, residual, p["model.norm.weight"])
    return F.linear(y, p["model.embed_tokens.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"])
