"""Qwen3-VL's language model in loomrl's decoder: a tiny random Qwen3-VL checkpoint built by
transformers loads with `load_language_model`, and its logits equal transformers' (FP32) with
the four things Qwen3 adds over Qwen2: a head width of its own, no attention biases, q/k norms,
interleaved M-RoPE, and DeepStack features added after the first layers. Each check can fail:
the same forward without DeepStack, or with M-RoPE in blocks, gives other logits. In BF16 the
q/k norm's `native` region is transformers' module bit for bit."""

import pytest
import torch
from qwen_checkpoints import QWEN3_TEXT, _qwen3_vl

from loomrl.platform.backbone import rounding as R
from loomrl.platform.backbone.hf_io import decoder_config, load_language_model
from loomrl.platform.backbone.rounding import SETTINGS

B, T = 2, 11


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_vl")
    return folder, _qwen3_vl(folder)


def _inputs(hidden, levels=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(B, T, hidden, generator=g)
    # distinct t, h, w rows, as an image's positions are (text before and after: equal rows)
    t = torch.arange(T).expand(B, T)
    pos = torch.stack([t, t + torch.randint(0, 4, (B, T), generator=g), t + torch.randint(0, 4, (B, T), generator=g)])
    where = torch.zeros(B, T, dtype=torch.bool)
    where[:, 3:7] = True  # the media positions
    where[1, 4] = False
    deepstack = [torch.randn(int(where.sum()), hidden, generator=g) for _ in range(levels)]
    return embeds, pos, where, deepstack


def test_config_has_what_qwen3_adds(checkpoint):
    folder, hf = checkpoint
    cfg = decoder_config(hf.config.to_dict(), "config.json", ("qwen3_vl",))
    assert (cfg.head_dim, cfg.hidden_size // cfg.num_heads) == (64, 48)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.mrope_interleaved) == (False, False, True, True)
    assert cfg.mrope_section == QWEN3_TEXT["rope_parameters"]["mrope_section"]
    with pytest.raises(ValueError, match="only its language model loads so far"):
        decoder_config(hf.config.to_dict(), "config.json")  # not yet a policy


def test_logits_equal_transformers_with_deepstack_and_interleaved_mrope(checkpoint):
    folder, hf = checkpoint
    dec = load_language_model(folder).eval()
    embeds, pos, where, deepstack = _inputs(dec.cfg.hidden_size)
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        h = hf.model.language_model(
            inputs_embeds=embeds,
            position_ids=pos,
            attention_mask=mask.long(),
            visual_pos_masks=where,
            deepstack_visual_embeds=deepstack,
        ).last_hidden_state
        want = hf.lm_head(h)
        got = dec(embeds, pos, mask, deepstack=(where, deepstack))[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # the checks can fail: without DeepStack, or with M-RoPE in blocks, the logits differ
        assert (dec(embeds, pos, mask)[0] - want).abs().max() > 1e-2
        dec.cfg.mrope_interleaved = False
        assert (dec(embeds, pos, mask, deepstack=(where, deepstack))[0] - want).abs().max() > 1e-2
        dec.cfg.mrope_interleaved = True
        # text only (equal rows, no media): the same logits as transformers' text forward
        text = pos[0]
        want = hf.lm_head(
            hf.model.language_model(inputs_embeds=embeds, position_ids=text[None].expand(3, -1, -1)).last_hidden_state
        )
        torch.testing.assert_close(dec(embeds, text, mask)[0], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rmsnorm", ["native", "vllm"])
def test_deepstack_added_where_each_rounding_mode_adds_it(checkpoint, rmsnorm):
    """In FP32 the two places (the layer's sum, as transformers; the MLP output, as vLLM) agree to
    the last bits; each mode's place is what it says."""
    folder, _ = checkpoint
    dec = load_language_model(folder).eval()
    dec.cfg.rounding = SETTINGS[rmsnorm]
    embeds, pos, where, deepstack = _inputs(dec.cfg.hidden_size, seed=1)
    x, residual = torch.randn(B, T, 96), torch.randn(B, T, 96)
    out_x, out_res = dec._deepstack(x, residual, where, deepstack[0])
    if rmsnorm == "native":
        want = (residual + x).clone()
        want[where] += deepstack[0]
        assert torch.equal(out_res, want) and not out_x.any()
    else:
        want = x.clone()
        want[where] += deepstack[0]
        assert torch.equal(out_x, want) and torch.equal(out_res, residual)


def test_bf16_native_qk_norm_is_transformers_bit_for_bit():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 5, 3, 64, generator=g) * 4).to(torch.bfloat16)  # [B, T, heads, head_dim]
    norm = Qwen3VLTextRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
        assert torch.equal(R.rms_norm(x, norm.weight, 1e-6, "native")[0], norm(x))
        assert torch.equal(R.rms_norm(x, norm.weight, 1e-6, "vllm")[0], norm(x))  # vLLM's rms_norm: native
        assert not torch.equal(R.rms_norm(x, norm.weight, 1e-6, "aligned")[0], norm(x))
