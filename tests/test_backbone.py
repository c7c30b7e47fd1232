import torch

from loomrl.platform.backbone.decoder import Decoder, DecoderConfig


def test_decoder_matches_transformers_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = DecoderConfig(
        vocab_size=50,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    hf_cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(hf_cfg).eval()
    ours = Decoder(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)
    ids = torch.randint(0, 50, (2, 9))
    ref = hf(input_ids=ids).logits
    mask = torch.ones(2, 9, dtype=torch.bool)
    pos = torch.arange(9).expand(2, 9)
    got, _ = ours(ours.embed(ids), pos, mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_kv_cache_decoding_equals_full_forward_with_left_padding():
    torch.manual_seed(0)
    dec = Decoder(DecoderConfig(vocab_size=30, hidden_size=32, num_heads=4, num_kv_heads=2))
    ids = torch.randint(1, 30, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :3] = False  # row 1 is left-padded by 3
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    full, _ = dec(dec.embed(ids), pos, mask)
    logits, cache = dec(dec.embed(ids[:, :5]), pos[:, :5], mask[:, :5])
    steps = [logits[:, -1]]
    for t in range(5, 8):
        logits, cache = dec(dec.embed(ids[:, t : t + 1]), pos[:, t : t + 1], mask[:, : t + 1], cache)
        steps.append(logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:8], atol=1e-5, rtol=1e-5)
    # left padding does not change a row's logits
    alone, _ = dec(dec.embed(ids[1:, 3:]), torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool))
    torch.testing.assert_close(full[1:, 3:], alone, atol=1e-5, rtol=1e-5)
