"""Where each rounding mode rounds: native == transformers' Qwen2 modules bit for bit in BF16;
aligned == a hand-written FP32 computation rounded once; FP32 identical in every mode (the vllm
attention formula, which FP32 does not run, equal to SDPA to 1e-6 with its gradients)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from rounding_reference import aligned_logits

from loomrl.platform.backbone import rounding as R
from loomrl.platform.backbone.decoder import Decoder, DecoderConfig, rope_cos_sin
from loomrl.platform.backbone.rounding import SETTINGS, Regions

BF16 = torch.bfloat16


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, 7, 16, generator=g) * 3).to(BF16)
    return x, g


def test_native_rmsnorm_with_residual_is_transformers_bit_for_bit():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    x, g = _inputs()
    residual = (torch.randn(x.shape, generator=g) * 5).to(BF16)
    norm = Qwen2RMSNorm(16, eps=1e-6).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    sum_hf = residual + x  # the decoder layer's residual add, in bf16
    out, res_out = R.rms_norm(x, norm.weight, 1e-6, "native", residual)
    assert torch.equal(out, norm(sum_hf)) and torch.equal(res_out, sum_hf)
    out, res_out = R.rms_norm(x, norm.weight, 1e-6, "native")
    assert torch.equal(out, norm(x)) and res_out is x


def test_native_swiglu_and_rope_are_transformers_bit_for_bit():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RotaryEmbedding, apply_rotary_pos_emb

    x, g = _inputs(1)
    cfg = Qwen2Config(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    mlp = Qwen2MLP(cfg).to(BF16)
    h = x[0]
    gate, up = mlp.gate_proj(h), mlp.up_proj(h)
    with torch.no_grad():
        assert torch.equal(mlp.down_proj(R.swiglu(gate, up, "native")), mlp(h))
    pos = torch.arange(40, 47).expand(2, 7)
    cos_hf, sin_hf = Qwen2RotaryEmbedding(cfg)(x, pos)  # fp32 math, cast to bf16
    q_hf, _ = apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(pos, 16, 10000.0)
    assert torch.equal(R.apply_rope(x, cos[:, None], sin[:, None], "native"), q_hf)


def test_aligned_regions_round_once_from_fp32():
    x, g = _inputs(2)
    residual = (torch.randn(x.shape, generator=g) * 5).to(BF16)
    w = torch.randn(16, generator=g).to(BF16)
    s = x.float() + residual.float()
    want = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    out, res_out = R.rms_norm(x, w, 1e-6, "aligned", residual)
    assert torch.equal(res_out, s.to(BF16))
    # FP32 reference (sqrt-divide instead of rsqrt-multiply may differ by one FP32 ulp; one
    # rounding to bf16 absorbs that except at ties) -- and exact with the same FP32 ops:
    assert (out.float() - want.to(BF16).float()).abs().max() <= 2**-7 * want.abs().max()
    assert torch.equal(out, (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(BF16))
    native, _ = R.rms_norm(x, w, 1e-6, "native", residual)
    assert not torch.equal(out, native)  # the modes really round differently

    gate, up = x, residual
    want = (gate.float() * torch.sigmoid(gate.float()) * up.float()).to(BF16)
    got = R.swiglu(gate, up, "aligned")
    assert (got.float() - want.float()).abs().le(want.float().abs() * 2**-7).all()
    assert torch.equal(got, (F.silu(gate.float()) * up.float()).to(BF16))
    assert not torch.equal(got, R.swiglu(gate, up, "native"))

    cos, sin = rope_cos_sin(torch.arange(100, 107).expand(2, 7), 16, 10000.0)
    cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    rotated = torch.cat((-xf[..., 8:], xf[..., :8]), -1)
    got = R.apply_rope(x, cos, sin, "aligned")
    assert torch.equal(got, (xf * cos + rotated * sin).to(BF16))
    assert not torch.equal(got, R.apply_rope(x, cos, sin, "native"))


def _attention_inputs(dtype, seed=0, t=11):
    """q [2, 4, t, 16], k/v the same (GQA already repeated), a causal mask with right padding."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(2, 4, t, 16, generator=g) * 2).to(dtype) for _ in range(3))
    key_mask = torch.ones(2, t, dtype=torch.bool)
    key_mask[1, -4:] = False
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & key_mask[:, None, None, :]
    return q, k, v, mask | torch.eye(t, dtype=torch.bool)[None, None]


def test_fp32_attention_modes_and_the_vllm_formula():
    """In FP32 every attention mode is torch's SDPA (bit-identical); the vllm formula itself, run in
    FP32, equals it to 1e-6 in the output and in the gradients of q, k and v (relative to their size)."""
    q, k, v, mask = _attention_inputs(torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for mode in ("native", "aligned", "vllm"):
        assert torch.equal(R.attention(q, k, v, mask, mode), want)
    grads = []
    for fn in (lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3]), R.vllm_attention):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = fn(*leaves, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([out.detach()] + [x.grad for x in leaves])
    (out, *grad), (vllm_out, *vllm_grad) = grads
    torch.testing.assert_close(vllm_out, out, atol=1e-6, rtol=0)
    for a, b in zip(grad, vllm_grad):  # a few FP32 ulps of the gradient's scale (~5)
        assert (b - a).abs().max() <= 1e-6 * a.abs().max()


def test_bf16_vllm_attention_has_a_gradient():
    q, k, v, mask = _attention_inputs(BF16, seed=1)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    R.attention(*leaves, mask, "vllm").float().pow(2).sum().backward()
    ref = [x.float().requires_grad_(True) for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, attn_mask=mask).pow(2).sum().backward()
    for x, r in zip(leaves, ref):  # the FP32 gradient up to BF16 rounding
        assert x.grad is not None and x.grad.dtype == BF16
        assert (x.grad.float() - r.grad).norm() <= 0.02 * r.grad.norm()


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="swiglu"):
        R.swiglu(torch.zeros(2), torch.zeros(2), "fast")
    with pytest.raises(ValueError, match="rope"):
        Regions(rope="bf16")
    with pytest.raises(ValueError, match="attention"):
        Regions(attention="flash")


def _decoder(seed=0, tie=True):
    torch.manual_seed(seed)
    dec = Decoder(
        DecoderConfig(
            vocab_size=61,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=64,
            tie_word_embeddings=tie,
        )
    )
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in dec.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    return dec


def _batch(t=9):
    ids = torch.randint(0, 61, (3, t), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, t, dtype=torch.bool)
    mask[2, -3:] = False  # right padding, as the trainer lays sequences out
    return ids, (mask.long().cumsum(-1) - 1).clamp(min=0), mask


def test_fp32_every_setting_gives_identical_logits():
    dec = _decoder()
    ids, pos, mask = _batch()
    outs = []
    for regions in SETTINGS.values():
        dec.cfg.rounding = regions
        outs.append(dec(dec.embed(ids), pos, mask)[0])
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("tie", [True, False])
def test_bf16_aligned_decoder_equals_hand_written_reference(tie):
    dec = _decoder(tie=tie).to(BF16)
    ids, pos, mask = _batch()
    dec.cfg.rounding = SETTINGS["aligned"]
    with torch.no_grad():
        got = dec(dec.embed(ids), pos, mask)[0]
        want = aligned_logits(dec, dec.embed(ids), pos, mask)
        assert torch.equal(got, want)
        dec.cfg.rounding = SETTINGS["native"]
        assert not torch.equal(dec(dec.embed(ids), pos, mask)[0], want)


@pytest.mark.parametrize("pad", [False, True])
def test_bf16_native_decoder_equals_transformers_bit_for_bit(tmp_path, pad):
    # Loaded the way users load it (from_pretrained in BF16): the rotary inv_freq buffer stays
    # FP32 there. (`model.to(bfloat16)` would round that buffer too, and then no stack that
    # computes RoPE angles in FP32, this decoder or vLLM, matches it.)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dec = _decoder()
    hf_cfg = Qwen2Config(
        vocab_size=61,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    hf = Qwen2ForCausalLM(hf_cfg)
    hf.load_state_dict(dec.state_dict())
    hf.save_pretrained(tmp_path)
    hf = Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=BF16, attn_implementation="sdpa").eval()
    dec = copy.deepcopy(dec).to(BF16)
    ids, pos, mask = _batch()
    if not pad:
        mask[:] = True
        pos = torch.arange(ids.shape[1])[None].expand(3, -1)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask.long()).logits[mask]
        dec.cfg.rounding = SETTINGS["native"]
        assert torch.equal(dec(dec.embed(ids), pos, mask)[0][mask], want)
        dec.cfg.rounding = SETTINGS["aligned"]  # the check can fail: aligned rounds elsewhere
        assert not torch.equal(dec(dec.embed(ids), pos, mask)[0][mask], want)
