"""A user's own task, end to end through the CLI: a tiny Qwen2-VL (and Qwen3-VL) checkpoint whose tokenizer has a
chat template, a marker-free manifest of real photos (scikit-image) with question / answer pairs (and a
Qwen2.5-VL checkpoint with a video manifest: a clip of each photo panning, encoded with PyAV),
`shards make`, SFT with validation, `loomrl export`, GRPO from the export with a verifiable reward
and validation, `loomrl export` again, and transformers loading that export with the trainer's
logits (FP32, 1e-5)."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_checkpoints import CHAT_TEMPLATE, _qwen2_vl, _qwen3_vl

from loomrl.cli import main

PHOTOS = ["astronaut", "coffee", "chelsea", "rocket"]
TRAIN_QUESTIONS = ["what is in the picture ?", "what is this ?", "name this picture ?"]
VAL_QUESTION = "name what is in this ?"  # a wording SFT never saw
WORDS = [
    "system",
    "user",
    "assistant",
    "You",
    "are",
    "a",
    "helpful",
    ".",
    "what",
    "is",
    "in",
    "the",
    "picture",
    "?",
    "this",
    "name",
    *PHOTOS,
]


def _photos(folder):
    import skimage.data

    folder.mkdir()
    for name in PHOTOS:
        pixels = getattr(skimage.data, name)()
        Image.fromarray(pixels).convert("RGB").resize((56, 56), Image.BICUBIC).save(folder / f"{name}.png")


def _manifest(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _recipe(path, text):
    path.write_text(text)
    return str(path)


def _run(argv):
    code = main(argv)
    assert code == 0, f"loomrl {' '.join(argv)} exited {code}"


def _val(run):
    return json.loads((run / "summary.json").read_text())["validation"]


def _clips(folder):
    """A 1 s clip (8 frames at 8 fps: 4 sampled, 2 temporal patches) of each photo panning across."""
    import av

    folder.mkdir()
    for name in PHOTOS:
        pixels = np.asarray(Image.open(folder.parent / "img" / f"{name}.png"))
        with av.open(str(folder / f"{name}.mp4"), mode="w") as out:
            stream = out.add_stream("mpeg4", rate=8)
            stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
            for i in range(8):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(np.roll(pixels, 2 * i, axis=1)), format="rgb24")
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)


FAMILIES = {
    "qwen2_vl": (_qwen2_vl, "Qwen2VLForConditionalGeneration", "image"),
    "qwen3_vl": (_qwen3_vl, "Qwen3VLForConditionalGeneration", "image"),
    # a video QA set: the same task with a clip of each photo instead of the photo
    "qwen2_5_vl-video": (
        lambda folder, **kw: _qwen2_vl(folder, "qwen2_5_vl", **kw),
        "Qwen2_5_VLForConditionalGeneration",
        "video",
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_grpo_and_export_of_a_users_own_task(tmp_path, monkeypatch, family):
    monkeypatch.chdir(tmp_path)
    build, hf_class, medium = FAMILIES[family]
    build(str(tmp_path / "base"), words=WORDS, chat_template=CHAT_TEMPLATE)
    _photos(tmp_path / "img")
    folder, ext = ("img", "png") if medium == "image" else ("vid", "mp4")
    if medium == "video":
        _clips(tmp_path / "vid")
    # marker-free, as public VQA sets are: `question` / `image` (`video`) / `answer`, no ids
    train = [{"question": q, medium: f"{folder}/{p}.{ext}", "answer": p} for q in TRAIN_QUESTIONS for p in PHOTOS]
    train += [
        {"question": "what is this ?", medium: f"{folder}/missing.{ext}", "answer": "rocket"},
        {"question": "what is this ?", medium: os.path.relpath("/etc/passwd", tmp_path), "answer": "rocket"},
    ]
    _manifest(tmp_path / "train.jsonl", train)
    _manifest(
        tmp_path / "val.jsonl",
        [{"question": VAL_QUESTION, medium: f"{folder}/{p}.{ext}", "answer": p} for p in PHOTOS],
    )
    _run(["shards", "make", "train.jsonl", "--out", "shards/train-%06d.tar"])  # the good 12 written, 2 rejected
    rejected = [json.loads(line) for line in (tmp_path / "shards" / "train-rejected.jsonl").read_text().splitlines()]
    assert sorted(r["code"] for r in rejected) == ["missing-file", "path-outside-source"]
    _run(["shards", "make", "val.jsonl", "--out", "val/val-%06d.tar"])

    common = """
validation: {shards: val/val-*.tar, every: 10, samples: 4, max_new_tokens: 3}
logging: {tensorboard: false, progress: false}
"""
    # --- SFT: sizes, tokenizer and chat template all come from the checkpoint
    sft = _recipe(
        tmp_path / "sft.yaml",
        f"""
name: sft
model: {{init_from: base}}
data: {{shards: shards/train-*.tar, shuffle_buffer: 12}}
algorithm: {{name: sft, reward: exact}}
training: {{steps: 30, prompts_per_step: 12, micro_batch_size: 12, lr: 0.003, threads: 1}}
rollout: {{max_new_tokens: 3}}
goal: {{metric: val_reward_mean, min_final: 0.75, min_gain: 0.5}}
{common}""",
    )
    _run(["run", sft, "--dry-run"])
    _run(["run", sft, "--out", "runs/sft"])
    val = _val(tmp_path / "runs/sft")
    assert val[0]["step"] == 0 and val[-1]["step"] == 30
    assert val[0]["val_reward_mean"] <= 0.25 and val[-1]["val_reward_mean"] >= 0.75, val
    rows = [json.loads(line) for line in (tmp_path / "runs/sft/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] / 4
    _run(["export", "runs/sft/checkpoints/step-000030", "--out", "sft-hf"])

    # --- GRPO from the SFT export, with a verifiable reward
    grpo = _recipe(
        tmp_path / "grpo.yaml",
        f"""
name: grpo
model: {{init_from: sft-hf}}
data: {{shards: shards/train-*.tar, shuffle_buffer: 12}}
algorithm: {{name: grpo, reward: exact}}
training: {{steps: 4, prompts_per_step: 4, micro_batch_size: 16, lr: 0.0001, threads: 1}}
rollout: {{n: 4, max_new_tokens: 3}}
{common.replace("every: 10", "every: 2")}""",
    )
    _run(["run", grpo, "--out", "runs/grpo"])
    gval = _val(tmp_path / "runs/grpo")
    assert [v["step"] for v in gval] == [0, 2, 4]
    # the export carried the SFT policy exactly: the same greedy completions, the same score
    assert gval[0]["val_reward_mean"] == val[-1]["val_reward_mean"]
    grows = [json.loads(line) for line in (tmp_path / "runs/grpo/metrics.jsonl").read_text().splitlines()]
    assert len(grows) == 4 and all(0.0 <= r["reward_mean"] <= 1.0 for r in grows)
    _run(["export", "runs/grpo/checkpoints/step-000004", "--out", "final-hf"])

    # --- transformers loads the final export; its logits are the trainer's
    check_export(tmp_path, "runs/grpo", "step-000004", "final-hf", hf_class, medium)


def check_export(tmp_path, run, step, export, hf_class="Qwen2VLForConditionalGeneration", medium="image"):
    """transformers loads the export of `run`'s checkpoint `step`: its logits are the trainer's
    (FP32, 1e-5) on an image (or video) prompt, and its weights moved from the base checkpoint."""
    import transformers as T

    from loomrl.encoders.base import load_medium
    from loomrl.platform.checkpoint import load_checkpoint
    from loomrl.platform.parts import build_policy_parts
    from loomrl.platform.recipe import load_recipe

    recipe = load_recipe(tmp_path / run / "recipe.yaml")
    tok, chat, policy = build_policy_parts(recipe)
    load_checkpoint(tmp_path / run / "checkpoints" / step, policy)
    policy.eval()
    cls = getattr(T, hf_class)
    hf = cls.from_pretrained(tmp_path / export, dtype=torch.float32).eval()
    exported_tok = T.AutoTokenizer.from_pretrained(tmp_path / export, local_files_only=True)
    assert exported_tok.chat_template == CHAT_TEMPLATE
    path = "img/chelsea.png" if medium == "image" else "vid/chelsea.mp4"
    image = load_medium(medium, (tmp_path / path).read_bytes(), policy.cfg)
    ids = torch.tensor([policy.prompt_ids(tok, chat.render(f"<{medium}>" + VAL_QUESTION), [image])])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        positions, _ = policy.position_ids(ids, mask, [[image]])
        embeds, deepstack = policy.embed_inputs(ids, [[image]], policy.encode_media([image]))
        ours, _ = policy.forward_embeds(embeds, mask, positions=positions, deepstack=deepstack)
        if medium == "image":
            pixels = dict(pixel_values=image.features, image_grid_thw=image.grid[None])
            types = (ids == hf.config.image_token_id).long()
        else:
            pixels = dict(pixel_values_videos=image.features, video_grid_thw=image.grid[None])
            pixels["second_per_grid_ts"] = torch.tensor([image.seconds_per_grid])
            # the positions vLLM and loomrl give the text after a clip (max + 1); transformers 5.19's
            # own rule (start + max(h, w)) differs for this clip (mrope.py, tests/test_video.py)
            pixels["position_ids"] = positions
            types = 2 * (ids == hf.config.video_token_id).long()
        theirs = hf(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, **pixels).logits
    # Qwen3-VL: 1e-4, the bar (its q/k norms and DeepStack round in another order; ~5e-6 measured)
    tol = 1e-4 if "Qwen3" in hf_class else 1e-5
    assert torch.allclose(ours, theirs, atol=tol, rtol=0), (ours - theirs).abs().max()
    # and the weights moved from the base checkpoint
    base = cls.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert not torch.equal(base.model.language_model.embed_tokens.weight, hf.model.language_model.embed_tokens.weight)
    np.testing.assert_equal(hf.config.image_token_id, base.config.image_token_id)
