"""HF checkpoint folders in and out: FP32 logits equal transformers' (Qwen2, Qwen2.5-VL text part with
M-RoPE), import then export round-trips bit for bit, transformers loads the export."""

import json

import pytest
import torch

from loomrl.encoders.hf_checkpoint import read_tensors
from loomrl.platform.backbone.hf_io import export_language_model, load_language_model

TEXT = dict(
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
)


def _run(dec, ids, pos):
    return dec(dec.embed(ids), pos, torch.ones(ids.shape, dtype=torch.bool))[0]


@pytest.mark.parametrize("tie", [True, False])
def test_qwen2_import_logits_and_bit_exact_round_trip(tmp_path, tie):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(
        Qwen2Config(**TEXT, tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ).eval()
    hf.save_pretrained(tmp_path / "src", max_shard_size="20KB")  # sharded, with an index
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    dec = load_language_model(tmp_path / "src")
    ids = torch.randint(0, 50, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(_run(dec, ids, pos), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    export_language_model(dec, tmp_path / "out", max_shard_bytes=30_000)
    src, out = read_tensors(tmp_path / "src", ("",)), read_tensors(tmp_path / "out", ("",))
    assert sorted(src) == sorted(out) and ("lm_head.weight" in out) == (not tie)
    assert all(torch.equal(src[k], out[k]) and src[k].dtype == out[k].dtype for k in src)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tie and cfg["torch_dtype"] == "float32"
    back = Qwen2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)
    with pytest.raises(FileExistsError):
        export_language_model(dec, tmp_path / "out")


def test_qwen2_5_vl_text_part_with_mrope(tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        text_config={
            **TEXT,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
        },
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32),
        image_token_id=45,
        video_token_id=46,
        vision_start_token_id=47,
    )
    hf = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path / "vl")
    dec = load_language_model(tmp_path / "vl")
    assert dec.cfg.mrope_section == [1, 1, 2] and not dec.cfg.tie_word_embeddings
    ids = torch.randint(0, 40, (2, 8))
    t = torch.arange(8).expand(2, 8)
    pos = torch.stack([t, t // 2 + (t % 2), 7 - t])  # three different position rows, as for image tokens
    with torch.no_grad():
        hidden = hf.model.language_model(inputs_embeds=dec.embed(ids), position_ids=pos).last_hidden_state
        torch.testing.assert_close(_run(dec, ids, pos), hf.lm_head(hidden), atol=1e-5, rtol=1e-5)
        # M-RoPE really differs from 1-D RoPE here (the check above can fail)
        assert (_run(dec, ids, pos) - _run(dec, ids, t)).abs().max() > 1e-5  # above the tolerance used
    export_language_model(dec, tmp_path / "lm")
    src, out = read_tensors(tmp_path / "vl", ("",)), read_tensors(tmp_path / "lm", ("",))
    assert sorted(out) == sorted(k for k in src if not k.startswith("visual."))
    assert all(torch.equal(src[k], out[k]) for k in out)


def test_qwen2_audio_nested_layout_imports(tmp_path):
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2AudioConfig(
        text_config={"model_type": "qwen2", **TEXT},
        audio_config=dict(
            d_model=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            num_mel_bins=80,
            max_source_positions=50,
        ),
    )
    hf = Qwen2AudioForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path / "a")  # transformers 5.19 writes language_model.model.model.*
    dec = load_language_model(tmp_path / "a")
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        torch.testing.assert_close(_run(dec, ids, torch.arange(6)[None]), want, atol=1e-5, rtol=1e-5)


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_language_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="llama"):
        load_language_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **TEXT}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="x.safetensors"):
        load_language_model(tmp_path)
