"""Tiny Qwen2-VL / Qwen2.5-VL checkpoints for tests, built offline from configs: a word-level
tokenizer with the special tokens the Qwen processors look up, random weights saved in the
hub layout, and a preprocessor config. Shared by test_vllm_multimodal and
test_qwen_vl_checkpoint."""

import io
import json
import os
import tempfile

import numpy as np
import torch

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
]
VOCAB = 64
# what Qwen3-VL's "<1.2 seconds>" timestamps split into under the Whitespace pre-tokenizer
TIME_WORDS = ("<", ">", ".", "seconds", *"0123456789")
# vLLM-CPU's attention needs head sizes that are multiples of 32 (64 / 2 heads); a large init
# makes the output depend clearly on the media (see the "can fail" checks below).
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    max_position_embeddings=512,
    initializer_range=0.2,
)


# Qwen2-VL's chat template, without its tool and video branches: a default system turn, then
# `<|im_start|>role\ncontent<|im_end|>\n` per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(folder, words=(), chat_template=None):
    """A word-level tokenizer with the special tokens the Qwen processors look up; `words` come
    first in the vocabulary (then w0, w1, ... fill it), `chat_template` is saved with it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    plain = list(words) + [f"w{i}" for i in range(VOCAB - 1 - len(SPECIAL) - len(words))]
    words = ["<unk>"] + plain + SPECIAL
    assert len(words) == VOCAB, "too many words for the tiny vocabulary"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


def two_step_run(folder, tmp_path, out) -> list[str]:
    """`loomrl run` arguments: the demo recipe for two small GRPO steps from checkpoint `folder`."""
    return [
        "run",
        "recipes/demo.yaml",
        "--out",
        str(out),
        f"data.shards={tmp_path}/shards/demo-*.tar",
        "data.demo.samples=12",
        "training.steps=2",
        "training.warmup.steps=0",
        "training.mini_batches=1",
        "training.prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "training.micro_batch_size=4",
        "checkpoint.every=100",
        "goal=null",
        f"model.init_from={folder}",
        f"model.tokenizer={folder}",
    ]


def _preprocessor(folder, processor: str, patch: int, **bounds) -> None:
    """preprocessor_config.json: the processor, patch size, pixel bounds, mean / std 0.5."""
    pre = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor,
        **bounds,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    }
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f)


def png(seed: int, h: int, w: int) -> bytes:
    """A random h x w RGB image, PNG-encoded."""

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def _qwen2_vl(folder, kind="qwen2_vl", vocab_size=VOCAB, words=(), chat_template=None):
    """vocab_size: embedding rows; more than the tokenizer's VOCAB tokens pads the vocabulary.
    words, chat_template: see `_tokenizer`."""
    import transformers as T

    tok = _tokenizer(folder, words, chat_template)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    eos = ids["<|endoftext|>"]
    torch.manual_seed(0)
    if kind == "qwen2_vl":
        config_cls, model_cls = T.Qwen2VLConfig, T.Qwen2VLForConditionalGeneration
        vision = dict(depth=1, embed_dim=64, hidden_size=64, num_heads=2, mlp_ratio=2)
    else:  # Qwen2.5-VL: a windowed block and a full-attention block
        config_cls, model_cls = T.Qwen2_5_VLConfig, T.Qwen2_5_VLForConditionalGeneration
        vision = dict(
            depth=2,
            hidden_size=64,
            num_heads=2,
            intermediate_size=128,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            window_size=56,
        )
    cfg = config_cls(
        text_config={
            **TEXT,
            "vocab_size": vocab_size,
            "bos_token_id": eos,
            "eos_token_id": eos,
            "pad_token_id": eos,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4]},
        },
        vision_config={**vision, "initializer_range": 0.2},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos,
    )
    model = model_cls(cfg).eval()
    model.save_pretrained(folder)  # transformers 5.19 writes the Qwen2-VL family in the hub layout
    # small images: 56x56 .. 112x112 pixels -> 4 .. 16 image tokens
    _preprocessor(folder, "Qwen2VLProcessor", 14, min_pixels=56 * 56, max_pixels=112 * 112)
    return model


# Qwen3-VL: a head width of its own (64, not 96 / 2 = 48; a head size vLLM-CPU takes), no attention
# biases, q/k norms, interleaved M-RoPE (sections sum to 64 / 2), two DeepStack levels.
QWEN3_TEXT = dict(
    TEXT,
    hidden_size=96,
    num_hidden_layers=3,
    head_dim=64,
    attention_bias=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [12, 10, 10],
        "mrope_interleaved": True,
    },
)
QWEN3_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=96,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1],
    initializer_range=0.2,
)


def _qwen3_vl(folder, words=(), chat_template=None):
    """A tiny random Qwen3-VL (dense) checkpoint in the hub layout, with the tokenizer of `_tokenizer`."""
    import transformers as T

    tok = _tokenizer(folder, words, chat_template)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    eos = ids["<|endoftext|>"]
    torch.manual_seed(0)
    cfg = T.Qwen3VLConfig(
        text_config={**QWEN3_TEXT, "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos},
        vision_config=QWEN3_VISION,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos,
    )
    model = T.Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms start at ones: other weights, so a norm in the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    # 64x64 .. 128x128 pixels -> 2x2 .. 4x4 merged tokens (patch 16, merge 2)
    _preprocessor(folder, "Qwen3VLProcessor", 16, size={"shortest_edge": 64 * 64, "longest_edge": 128 * 128})
    return model


def clip(seed=0, frames=8, height=64, width=80, fps=4, container="mp4", codec="mpeg4", options=None):
    """A real short video's bytes, encoded with PyAV (FFmpeg): moving coloured noise, `frames` frames
    of height x width at `fps` frames per second. options: the muxer's (e.g. movflags=faststart)."""
    import av

    rng = np.random.RandomState(seed)
    base = (rng.rand(height, width, 3) * 255).astype("uint8")
    handle, path = tempfile.mkstemp(suffix="." + container)  # a file: faststart rewrites it in a second pass
    os.close(handle)
    with av.open(path, mode="w", format=container, options=options or {}) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 3 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    try:
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.remove(path)
