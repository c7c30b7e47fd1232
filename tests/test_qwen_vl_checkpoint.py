"""A real Qwen2-VL / Qwen2.5-VL checkpoint (tiny, built from configs with transformers) as the
policy through `model.init_from`: the checkpoint's media tokens, its padded vocabulary and
M-RoPE positions, checked against transformers' forward, the rollout engine and a `loomrl run`."""

import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_checkpoints import VOCAB, _qwen2_vl, two_step_run

from loomrl.encoders.base import load_medium
from loomrl.platform.backbone.mrope import rope_index
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.recipe import ModelConfig, VisionConfig

PADDED = VOCAB + 16  # embedding rows; the tokenizer has VOCAB tokens
# the tiny checkpoints' sizes; images 56x56 .. 112x112 pixels (4 .. 16 image tokens)
MODEL = ModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    tie_word_embeddings=False,
    vision=VisionConfig(min_pixels=56 * 56, max_pixels=112 * 112),
)
OVERRIDES = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=128",
    "model.tie_word_embeddings=false",
    f"model.vision.min_pixels={56 * 56}",
    f"model.vision.max_pixels={112 * 112}",
]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _qwen2_vl(str(folder), request.param, vocab_size=PADDED)
    cfg = dataclasses.replace(MODEL, tokenizer=str(folder), init_from=str(folder))
    tokenizer = load_tokenizer(str(folder))
    return folder, hf, tokenizer, build_policy(cfg, tokenizer, seed=0).eval()


def _png(seed, h, w):
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def _hf_inputs(hf, policy, ids, media):
    images = [m for m in media if m.kind == "image"]
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == hf.config.image_token_id).long(),
        pixel_values=torch.cat([m.features for m in images]),
        image_grid_thw=torch.stack([m.grid for m in images]),
    )


def test_media_tokens_and_vocabulary_come_from_the_checkpoint(checkpoint):
    folder, hf, tok, policy = checkpoint
    assert len(tok) == VOCAB and policy.language_model.cfg.vocab_size == PADDED
    assert policy.image_token_id == hf.config.image_token_id and policy.audio_token_id is None
    media = [load_medium("image", _png(0, 60, 80), MODEL)]  # 56x84 pixels -> 2x3 merged tokens
    ids = policy.prompt_ids(tok, "w1 <image> w2", media)
    c = hf.config
    assert ids == [
        tok.convert_tokens_to_ids("w1"),
        c.vision_start_token_id,
        *[c.image_token_id] * 6,
        c.vision_end_token_id,
        tok.convert_tokens_to_ids("w2"),
    ]
    # a medium the checkpoint cannot read is refused by name
    with pytest.raises(ValueError, match="has audio but the model has no audio token"):
        policy.prompt_ids(tok, "<image> <audio>", media + [dataclasses.replace(media[0], kind="audio")])
    # padded rows are never sampled nor scored
    logp = policy.token_logprobs(torch.randn(2, PADDED), 1.0)
    assert torch.isinf(logp[:, VOCAB:]).all() and torch.isfinite(logp[:, 1 : VOCAB - 10]).all()


def test_vocabulary_smaller_than_the_tokenizer_names_the_config(tmp_path):
    folder = tmp_path / "small"
    _qwen2_vl(str(folder), "qwen2_vl", vocab_size=VOCAB - 4)
    cfg = dataclasses.replace(MODEL, tokenizer=str(folder), init_from=str(folder))
    with pytest.raises(ValueError, match=r"config.json: vocab_size 60 is smaller than the tokenizer"):
        build_policy(cfg, load_tokenizer(str(folder)), seed=0)


def test_image_preprocessing_matches_the_hf_processor(checkpoint):
    # the PIL backend (the torchvision one needs torchvision)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2, merge_size=2
    )  # CLIP mean / std, as loomrl
    for seed, (h, w) in enumerate([(60, 80), (100, 120), (40, 200)]):
        data = _png(seed, h, w)
        m = load_medium("image", data, MODEL)
        want = proc(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
        assert torch.equal(m.grid, want["image_grid_thw"][0])
        assert torch.allclose(m.features, want["pixel_values"], atol=2e-2), (h, w)  # resampling differs slightly


def test_rope_index_matches_transformers(checkpoint):
    folder, hf, tok, policy = checkpoint
    media = [load_medium("image", _png(1, 60, 80), MODEL), load_medium("image", _png(2, 100, 120), MODEL)]
    ids = torch.tensor([policy.prompt_ids(tok, "w1 w2 <image> w3 <image> w4 w5", media)])
    inputs = _hf_inputs(hf, policy, ids, media)
    want, want_delta = hf.model.get_rope_index(
        ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"], attention_mask=inputs["attention_mask"]
    )
    # left padding moves nothing
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1)
    got, delta = rope_index(padded, mask, [[(m.grid, 1.0) for m in media]], {policy.image_token_id}, 2)
    assert torch.equal(got[:, :, 3:], want) and delta.tolist() == want_delta.flatten().tolist()
    assert int(delta[0]) < 0  # images take fewer positions than tokens: the check is not trivial


def test_logprobs_equal_transformers_forward(checkpoint):
    folder, hf, tok, policy = checkpoint
    media = [load_medium("image", _png(3, 60, 80), MODEL), load_medium("image", _png(4, 100, 120), MODEL)]
    prompt = policy.prompt_ids(tok, "w1 w2 <image> w3 <image> w4", media)
    completion = tok("w5 w6 w7 w8 w9 w10", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        got, _ = policy.sequence_logprobs(ids, torch.ones_like(ids), [media])
        logits = hf(**_hf_inputs(hf, policy, ids, media)).logits[0, :-1]
    logits[:, policy.banned_token_ids] = float("-inf")
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    scored = ~torch.isin(ids[0, 1:], policy.banned_token_ids)
    assert scored[-len(completion) :].all()
    assert torch.allclose(got[0][scored], want[scored], atol=1e-4), (got[0][scored] - want[scored]).abs().max()
    # the same tokens with plain 1-D positions score differently: M-RoPE is what made them equal
    with torch.no_grad():
        flat, _ = policy.forward_embeds(policy.embed(ids, [media], policy.encode_media(media)), torch.ones_like(ids))
    flat_logp = policy.token_logprobs(flat[0, :-1], 1.0).gather(-1, ids[0, 1:, None])[:, 0]
    assert (flat_logp[scored] - want[scored]).abs().max() > 1e-3


def test_rollouts_continue_m_rope_and_agree_with_the_trainer(checkpoint):
    from loomrl.platform.rollout.base import Prompt, SamplingParams
    from loomrl.platform.rollout.torch_engine import TorchRolloutEngine

    folder, hf, tok, policy = checkpoint
    media = [[load_medium("image", _png(5, 60, 80), MODEL)], [load_medium("image", _png(6, 100, 120), MODEL)]]
    texts = ["w1 <image> w2", "w3 w4 w5 <image>"]  # different lengths: left padding
    prompts = [Prompt(f"p{i}", policy.prompt_ids(tok, t, m), m) for i, (t, m) in enumerate(zip(texts, media))]
    res = TorchRolloutEngine(policy).generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8), torch.Generator().manual_seed(0)
    )
    for r in res.rollouts:
        assert r.completion_ids and max(r.completion_ids) < len(tok)
        p = prompts[r.prompt_index]
        ids = torch.tensor([p.ids + r.completion_ids])
        with torch.no_grad():
            logp, _ = policy.sequence_logprobs(ids, torch.ones_like(ids), [p.media])
        assert torch.allclose(logp[0, -len(r.completion_ids) :], torch.tensor(r.logprobs), atol=1e-4)


def test_loomrl_run_from_a_qwen2_vl_checkpoint(tmp_path, capsys):
    from loomrl.cli import main

    folder = tmp_path / "qwen2-vl"
    _qwen2_vl(str(folder), "qwen2_vl", vocab_size=PADDED)
    out = tmp_path / "run"
    rc = main([*two_step_run(folder, tmp_path, out), *OVERRIDES])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["logp_mismatch"] < 1e-4 for r in rows)  # rollout and trainer agree (M-RoPE in both)
    # the demo's audio prompts are skipped, each named: this checkpoint has no audio tower
    assert "has audio but the model has no audio token" in capsys.readouterr().err
