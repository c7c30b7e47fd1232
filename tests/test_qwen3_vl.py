"""Qwen3-VL's language model in loomrl's decoder: a tiny random Qwen3-VL checkpoint built by
transformers loads with `load_language_model`, and its logits equal transformers' (FP32) with
the four things Qwen3 adds over Qwen2: a head width of its own, no attention biases, q/k norms,
interleaved M-RoPE, and DeepStack features added after the first layers. Each check can fail:
the same forward without DeepStack, or with M-RoPE in blocks, gives other logits. In BF16 the
q/k norm's `native` region is transformers' module bit for bit."""

import json

import pytest
import torch
from qwen_checkpoints import QWEN3_TEXT, TIME_WORDS, _qwen3_vl, png, two_step_run

from loomrl.platform.backbone import rounding as R
from loomrl.platform.backbone.hf_io import decoder_config, load_language_model
from loomrl.platform.backbone.rounding import SETTINGS

B, T = 2, 11


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_vl")
    return folder, _qwen3_vl(folder, words=TIME_WORDS)  # timestamps tokenize: a wrong one shows


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
    cfg = decoder_config(hf.config.to_dict(), "config.json")
    assert (cfg.head_dim, cfg.hidden_size // cfg.num_heads) == (64, 48)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.mrope_interleaved) == (False, False, True, True)
    assert cfg.mrope_section == QWEN3_TEXT["rope_parameters"]["mrope_section"]


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
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # the bar; measured 4.7e-6 at logits ~7
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
        torch.testing.assert_close(dec(embeds, text, mask)[0], want, rtol=0, atol=1e-4)


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


# --------------------------------------------------------------------------- the policy


@pytest.fixture(scope="module")
def policy(checkpoint):
    from loomrl.platform.backbone.hf_config import fill_from_checkpoint
    from loomrl.platform.backbone.tokenizer import load_tokenizer
    from loomrl.platform.backbone.vlm import build_policy
    from loomrl.platform.recipe import ModelConfig

    folder, hf = checkpoint
    m = ModelConfig(init_from=str(folder))
    fill_from_checkpoint(m, {"init_from": str(folder)})  # sizes, tower, pixel bounds, mean / std
    tok = load_tokenizer(str(folder))
    return m, tok, build_policy(m, tok, seed=0).eval()


PROMPTS = [
    ("w1 w2 w3", []),
    ("w1 <image> w2", [(0, 64, 96)]),
    ("w1 <image> w2 w3 <image> w4", [(1, 70, 120), (2, 128, 64)]),
]


@pytest.mark.parametrize("text, images", PROMPTS, ids=["text", "one-image", "two-images"])
def test_policy_logprobs_equal_transformers(checkpoint, policy, text, images):
    from loomrl.encoders.base import load_medium

    folder, hf = checkpoint
    m, tok, model = policy
    assert m.vision.image_mean == [0.5] * 3 and (m.vision.patch_size, m.vision.embed_dim) == (16, 32)
    media = [load_medium("image", png(seed, h, w), m) for seed, h, w in images]
    ids = torch.tensor([model.prompt_ids(tok, text, media) + tok("w5 w6 w7 w8", add_special_tokens=False)["input_ids"]])
    inputs = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == hf.config.image_token_id).long()
    )
    if media:
        inputs.update(
            pixel_values=torch.cat([x.features for x in media]), image_grid_thw=torch.stack([x.grid for x in media])
        )
    with torch.no_grad():
        got, _ = model.sequence_logprobs(ids, torch.ones_like(ids), [media])
        logits = hf(**inputs).logits[0, :-1]
    logits[:, model.banned_token_ids] = float("-inf")
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    scored = ~torch.isin(ids[0, 1:], model.banned_token_ids)
    assert (got[0][scored] - want[scored]).abs().max() < 1e-4
    if media:  # the check can fail: the same prompt without DeepStack scores differently
        encodings = model.encode_media(media)
        embeds, deepstack = model.embed_inputs(ids, [media], encodings)
        assert deepstack is not None and len(deepstack[1]) == 2
        positions, _ = model.position_ids(ids, torch.ones_like(ids), [media])
        with torch.no_grad():
            plain, _ = model.forward_embeds(embeds, torch.ones_like(ids), positions=positions)
        plain_logp = model.token_logprobs(plain[0, :-1], 1.0).gather(-1, ids[0, 1:, None])[:, 0]
        assert (plain_logp[scored] - want[scored]).abs().max() > 1e-3
        with pytest.raises(ValueError, match="DeepStack"):
            model.embed(ids, [media], encodings)  # a caller that would drop DeepStack is refused


def test_video_logprobs_equal_transformers(checkpoint, policy):
    """A clip and an image: each temporal patch of the clip framed alone after its `<t seconds>`
    text, M-RoPE per patch, DeepStack at the clip's tokens too; the logits are transformers'."""
    from qwen_checkpoints import clip

    from loomrl.encoders.base import load_medium

    folder, hf = checkpoint
    m, tok, model = policy
    video = load_medium("video", clip(seed=1, frames=12, fps=4), m)  # 3 s: 6 frames, 3 temporal patches
    image = load_medium("image", png(3, 64, 96), m)
    assert video.grid.tolist() == [3, 4, 4] and video.times == pytest.approx((0.25, 1.375, 2.5))
    prompt = model.prompt_ids(tok, "w1 <video> w2 <image> w3", [video, image])
    c = hf.config
    assert prompt.count(c.vision_start_token_id) == 4 and prompt.count(c.video_token_id) == 3 * 4
    first = tok.convert_ids_to_tokens(prompt[1 : prompt.index(c.vision_start_token_id)])
    assert first == ["<", "0", ".", "2", "seconds", ">"]  # "<0.2 seconds>" (0.25, as Python formats it)
    assert tok.unk_token_id not in prompt
    ids = torch.tensor([prompt + tok("w5 w6 w7 w8", add_special_tokens=False)["input_ids"]])
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == c.image_token_id).long() + 2 * (ids == c.video_token_id).long(),
        pixel_values=image.features,
        image_grid_thw=image.grid[None],
        pixel_values_videos=video.features,
        video_grid_thw=video.grid[None],
    )
    with torch.no_grad():
        got, _ = model.sequence_logprobs(ids, torch.ones_like(ids), [[video, image]])
        logits = hf(**inputs).logits[0, :-1]
    logits[:, model.banned_token_ids] = float("-inf")
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    scored = ~torch.isin(ids[0, 1:], model.banned_token_ids)
    assert (got[0][scored] - want[scored]).abs().max() < 1e-4
    # the check can fail: without DeepStack at the clip's tokens (the image's kept) it scores differently
    embeds, (mask, levels) = model.embed_inputs(ids, [[video, image]], model.encode_media([video, image]))
    image_rows = (ids[mask] == c.image_token_id)[:, None]
    positions, _ = model.position_ids(ids, torch.ones_like(ids), [[video, image]])
    with torch.no_grad():
        no_video, _ = model.forward_embeds(
            embeds, torch.ones_like(ids), positions=positions, deepstack=(mask, [x * image_rows for x in levels])
        )
    no_video_logp = model.token_logprobs(no_video[0, :-1], 1.0).gather(-1, ids[0, 1:, None])[:, 0]
    assert (no_video_logp[scored] - want[scored]).abs().max() > 1e-3


def test_rollouts_agree_with_the_trainer(policy):
    from loomrl.encoders.base import load_medium
    from loomrl.platform.rollout.base import Prompt, SamplingParams
    from loomrl.platform.rollout.torch_engine import TorchRolloutEngine

    m, tok, model = policy
    media = [[load_medium("image", png(5, 64, 96), m)], [load_medium("image", png(6, 100, 120), m)]]
    texts = ["w1 <image> w2", "w3 w4 w5 <image>"]  # different lengths: left padding
    prompts = [Prompt(f"p{i}", model.prompt_ids(tok, t, x), x) for i, (t, x) in enumerate(zip(texts, media))]
    res = TorchRolloutEngine(model).generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6), torch.Generator().manual_seed(0)
    )
    for r in res.rollouts:
        p = prompts[r.prompt_index]
        ids = torch.tensor([p.ids + r.completion_ids])
        with torch.no_grad():
            logp, _ = model.sequence_logprobs(ids, torch.ones_like(ids), [p.media])
        assert torch.allclose(logp[0, -len(r.completion_ids) :], torch.tensor(r.logprobs), atol=1e-4)


def test_export_loads_in_transformers_with_equal_logits(checkpoint, policy, tmp_path):
    import transformers as T

    from loomrl.encoders.base import load_medium
    from loomrl.platform.backbone.hf_io import export_language_model, export_policy

    folder, hf = checkpoint
    m, tok, model = policy
    out = export_policy(model, tmp_path / "export", "image")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3VLForConditionalGeneration"]
    back = T.Qwen3VLForConditionalGeneration.from_pretrained(str(out)).eval()
    media = [load_medium("image", png(7, 90, 64), m)]
    ids = torch.tensor([model.prompt_ids(tok, "w1 <image> w2 w3", media)])
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == hf.config.image_token_id).long(),
        pixel_values=media[0].features,
        image_grid_thw=media[0].grid[None],
    )
    with torch.no_grad():
        assert torch.equal(back(**inputs).logits, hf(**inputs).logits)  # the same weights, every one
    text = export_language_model(model.language_model, tmp_path / "text")  # a Qwen3ForCausalLM
    lm = T.AutoModelForCausalLM.from_pretrained(str(text)).eval()
    assert type(lm).__name__ == "Qwen3ForCausalLM"
    plain = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = model.language_model(
            model.language_model.embed(plain), torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool)
        )[0]
        assert (lm(input_ids=plain).logits - want).abs().max() < 1e-4


def test_parts_that_do_not_take_qwen3_vl_yet_refuse_it(checkpoint, tmp_path):
    from loomrl.platform import recipe as R

    folder, _ = checkpoint
    for override, name in (("training.engine=megatron", "training.engine=megatron"),):
        with pytest.raises(R.RecipeError, match=f"Qwen3-VL checkpoint, which {name}"):
            R.load_recipe("recipes/demo.yaml", [f"model.init_from={folder}", override])


def test_loomrl_run_from_a_qwen3_vl_checkpoint(tmp_path, capsys):
    """The demo's GRPO loop from a Qwen3-VL checkpoint (sizes, tower, preprocessing filled from the
    folder), the built-in rollout engine; rollout and trainer agree on every token; `loomrl export`
    writes a folder transformers loads."""
    from loomrl.cli import main

    folder = tmp_path / "qwen3-vl"
    _qwen3_vl(str(folder))
    out = tmp_path / "run"
    rc = main([*two_step_run(folder, tmp_path, out)])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["logp_mismatch"] < 1e-4 and r["enc_media_total"] > 0 for r in rows)
    # exported through the CLI: transformers loads it, with the run's image preprocessing
    import transformers as T

    assert main(["export", str(out), "--out", str(tmp_path / "exported")]) == 0
    back = T.Qwen3VLForConditionalGeneration.from_pretrained(str(tmp_path / "exported"))
    assert back.config.text_config.head_dim == 64 and back.model.visual.deepstack_visual_indexes == [0, 1]
    pre = json.loads((tmp_path / "exported" / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["image_mean"], pre["processor_class"]) == (16, [0.5] * 3, "Qwen3VLProcessor")
