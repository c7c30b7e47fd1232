"""`model.init_from` is the source of truth: load_recipe takes the model's sizes, its towers and its
tokenizer from the checkpoint folder; a recipe value that disagrees is an error naming the key, both
values and the file (also from `loomrl run --dry-run`); the policy has exactly the checkpoint's towers."""

import json
import random
import shutil

import pytest
import torch
from qwen_checkpoints import SPECIAL, _qwen2_vl, _tokenizer

from loomrl.cli import main
from loomrl.datasets.demo import make_sample, write_demo_shards
from loomrl.datasets.shards import write_shards
from loomrl.encoders.media import Medium
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.recipe import AudioConfig, RecipeError, load_recipe

DEMO = "recipes/demo.yaml"


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """A tiny Qwen2-VL folder (config.json, safetensors, tokenizer, preprocessor_config.json) and
    transformers' model it was saved from."""
    folder = tmp_path_factory.mktemp("qwen2-vl")
    return folder, _qwen2_vl(str(folder), "qwen2_vl")


def test_load_recipe_takes_the_sizes_from_config_json(qwen2_vl):
    folder, _ = qwen2_vl
    cfg = json.loads((folder / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    m = load_recipe(DEMO, [f"model.init_from={folder}"]).model
    # the checkpoint's values, not the demo's defaults (heads 4, kv heads 2, tied, eps 1e-6, depth 2)
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size) == (64, 2, 2, 1, 128)
    assert (m.hidden_size, m.num_heads, m.num_kv_heads) == (
        text["hidden_size"],
        text["num_attention_heads"],
        text["num_key_value_heads"],
    )
    assert m.rms_norm_eps == text["rms_norm_eps"] == 1e-5 and m.tie_word_embeddings is False
    assert m.rope_theta == text["rope_parameters"]["rope_theta"] == 10000.0
    assert (
        (m.vision.depth, m.vision.embed_dim, m.vision.num_heads)
        == (vision["depth"], vision["embed_dim"], 2)
        == (1, 64, 2)
    )
    # preprocessor_config.json: 56x56 .. 112x112 pixels
    assert (m.vision.min_pixels, m.vision.max_pixels) == (56 * 56, 112 * 112)
    assert m.audio == AudioConfig()  # no audio tower in the checkpoint: nothing taken for it
    assert m.tokenizer == str(folder)  # left at `demo`, the folder has tokenizer files
    # restating the checkpoint's values is allowed; the image size bounds are the recipe's to choose
    m = load_recipe(
        DEMO,
        [
            f"model.init_from={folder}",
            "model.hidden_size=64",
            "model.vision.depth=1",
            "model.rms_norm_eps=1.0e-5",
            "model.vision.max_pixels=50176",
            "model.tokenizer=demo",
        ],
    ).model
    assert (m.hidden_size, m.vision.depth, m.vision.max_pixels, m.tokenizer) == (64, 1, 50176, "demo")


def test_video_sampling_comes_from_video_preprocessor_config(qwen2_vl, tmp_path):
    folder = tmp_path / "with-video"
    shutil.copytree(qwen2_vl[0], folder)
    video = {"fps": 1.0, "min_frames": 2, "max_frames": 8, "size": {"shortest_edge": 3136, "longest_edge": 6272}}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    v = load_recipe(DEMO, [f"model.init_from={folder}"]).model.vision
    assert (v.video_fps, v.video_min_frames, v.video_max_frames) == (1.0, 2, 8)
    assert (v.video_min_pixels, v.video_max_pixels) == (3136, 6272)
    # not strict: the recipe may sample otherwise
    v = load_recipe(DEMO, [f"model.init_from={folder}", "model.vision.video_max_frames=16"]).model.vision
    assert v.video_max_frames == 16 and v.video_fps == 1.0
    # without the file, loomrl's defaults
    assert load_recipe(DEMO, [f"model.init_from={qwen2_vl[0]}"]).model.vision.video_max_frames == 32


def test_policy_has_the_checkpoints_parameters_and_towers(qwen2_vl):
    folder, hf = qwen2_vl
    r = load_recipe(DEMO, [f"model.init_from={folder}"])
    tokenizer = load_tokenizer(r.model.tokenizer)
    policy = build_policy(r.model, tokenizer, seed=0)
    assert policy.visual is not None and policy.audio_tower is None and policy.audio_projector is None
    assert type(policy.visual) is type(hf.model.visual)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in policy.parameters()) == n_hf
    for k, v in hf.model.visual.state_dict().items():  # the tower holds the checkpoint's weights
        assert torch.equal(policy.visual.state_dict()[k], v), k
    # an <audio> prompt is refused by name, at the prompt and at the encoder
    clip = Medium("audio", "h", torch.zeros(80, 100), None, "p")
    with pytest.raises(ValueError, match="the prompt has audio but the model has no audio token"):
        policy.prompt_ids(tokenizer, "w1 <audio>", [clip])
    with pytest.raises(ValueError, match="no audio tower"):
        policy.encode_media([clip])


@pytest.mark.parametrize(
    "override, key, says",
    [
        ("model.hidden_size=128", "model.hidden_size: 128", "(hidden_size: 64)"),
        ("model.tie_word_embeddings=true", "model.tie_word_embeddings: True", "(tie_word_embeddings: False)"),
        ("model.vision.depth=3", "model.vision.depth: 3", "(vision_config.depth: 1)"),
    ],
)
def test_a_recipe_value_that_disagrees_is_an_error(qwen2_vl, override, key, says):
    folder, _ = qwen2_vl
    with pytest.raises(RecipeError) as e:
        load_recipe(DEMO, [f"model.init_from={folder}", override])
    assert str(e.value) == (f"{key} conflicts with {folder}/config.json {says}; leave it out to take the checkpoint's")


def test_dry_run_reports_a_conflict_and_accepts_the_clean_recipe(qwen2_vl, tmp_path, capsys):
    folder, _ = qwen2_vl
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: mine\nmodel:\n  init_from: {folder}\n  num_heads: 4\n")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"model.num_heads: 4 conflicts with {folder}/config.json (num_attention_heads: 2)" in err
    assert "Traceback" not in err and "recipe OK" not in err
    # demo shards named (made when a run starts): no note about data missing on this machine
    recipe.write_text(f"name: mine\nmodel:\n  init_from: {folder}\ndata:\n  shards: {tmp_path}/d-*.tar\n  demo: {{}}\n")
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "recipe OK" in err and "note:" not in err
    assert "  num_heads: 2\n" in out and "  num_kv_heads: 1\n" in out and f"  tokenizer: {folder}\n" in out
    assert main(["run", str(recipe), "--dry-run", "model.hidden_size=32"]) == 2
    assert "model.hidden_size: 32 conflicts with" in capsys.readouterr().err


def test_dry_run_counts_and_names_samples_the_model_cannot_read(qwen2_vl, tmp_path, capsys):
    """Audio on a vision-only checkpoint: counted at --dry-run (a run skips them), not met mid-run;
    a split with no readable sample is refused."""
    folder, _ = qwen2_vl
    write_demo_shards(str(tmp_path / "mixed"), 6, 3, 0)  # image, audio, both, image, audio, both
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: mine\nmodel:\n  init_from: {folder}\ndata:\n  shards: {tmp_path}/mixed/*.tar\n")
    assert main(["run", str(recipe), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "recipe OK" in err
    assert "note: data.shards: 4 of 6 samples will be skipped: 4 with audio, which the model" in err, err
    assert "(it reads: image, video); first: " in err and "mixed/demo-000000.tar:" in err
    # the demo policy reads both: no note
    assert main(["run", DEMO, "--dry-run", f"data.shards={tmp_path}/mixed/*.tar"]) == 0
    assert "will be skipped" not in capsys.readouterr().err
    # a split with audio only: nothing left to train on, refused before the run
    rng = random.Random(0)
    clips = [x for x in (make_sample(i, rng) for i in range(6)) if [k for k, _, _ in x["media"]] == ["audio"]]
    (tmp_path / "audio").mkdir()
    write_shards(clips, str(tmp_path / "audio" / "a-%06d.tar"), 10)
    recipe.write_text(f"name: mine\nmodel:\n  init_from: {folder}\ndata:\n  shards: {tmp_path}/audio/*.tar\n")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "data.shards: none of its" in err and "with audio" in err and "recipe OK" not in err


def test_unreadable_or_unbuildable_checkpoints_name_the_file(qwen2_vl, tmp_path, capsys):
    folder, _ = qwen2_vl
    cfg = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    cases = [
        ("{not json", "cannot read it as JSON"),
        (json.dumps({**cfg, "model_type": "llama"}), "model_type 'llama' is not supported"),
        (
            json.dumps({**cfg, "vision_config": {**cfg["vision_config"], "model_type": "siglip_vision_model"}}),
            "a vision tower of kind 'siglip_vision_model', which loomrl cannot build",
        ),
        (
            json.dumps({**cfg, "text_config": {**cfg["text_config"], "num_key_value_heads": "1"}}),
            "num_key_value_heads '1' is not an integer",
        ),
        (
            json.dumps({**cfg, "vision_config": {**cfg["vision_config"], "depth": 0}}),
            "vision_config.depth 0 is out of range",
        ),
        (
            json.dumps({**cfg, "text_config": {**cfg["text_config"], "hidden_size": "64"}}),
            "hidden_size '64' is not an integer",
        ),
    ]
    for text, why in cases:
        (bad / "config.json").write_text(text)
        with pytest.raises(RecipeError, match=why) as e:
            load_recipe(DEMO, [f"model.init_from={bad}"])
        assert f"{bad}/config.json" in str(e.value)
        assert main(["run", DEMO, "--dry-run", f"model.init_from={bad}"]) == 2
        err = capsys.readouterr().err
        assert why.split("'")[0] in err and "Traceback" not in err


def test_a_checkpoint_not_on_this_machine_fills_nothing(tmp_path, qwen2_vl):
    r = load_recipe(DEMO, [f"model.init_from={tmp_path}/on-the-cluster", "model.hidden_size=128"], files=False)
    assert (r.model.hidden_size, r.model.num_heads, r.model.tokenizer) == (128, 2, "demo")
    with pytest.raises(RecipeError, match="model.init_from: .* is not a local HF checkpoint folder"):
        load_recipe(DEMO, [f"model.init_from={tmp_path}/on-the-cluster"])
    # a folder with config.json but no tokenizer files keeps the demo tokenizer
    folder, _ = qwen2_vl
    (tmp_path / "weights").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "weights")
    assert load_recipe(DEMO, [f"model.init_from={tmp_path}/weights"], files=False).model.tokenizer == "demo"


def test_qwen2_audio_gives_the_audio_tower_only(tmp_path):
    import transformers as T

    tok = _tokenizer(str(tmp_path))
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    torch.manual_seed(0)
    cfg = T.Qwen2AudioConfig(
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
        ),
        audio_config=dict(
            d_model=32,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=48,
            num_mel_bins=80,
            max_source_positions=25,
        ),
        audio_token_index=ids["<|AUDIO|>"],
    )
    hf = T.Qwen2AudioForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    m = load_recipe(DEMO, [f"model.init_from={tmp_path}"]).model
    a = m.audio
    assert (a.layers, a.d_model, a.num_heads, a.ffn_dim, a.num_mel_bins) == (1, 32, 2, 48, 80)
    assert a.clip_seconds == 0.5  # 25 positions = 50 mel frames of 10 ms
    assert (m.hidden_size, m.num_layers) == (32, 1)
    with pytest.raises(RecipeError, match=r"model.audio.clip_seconds: 1.0 conflicts with .*max_source_positions: 25"):
        load_recipe(DEMO, [f"model.init_from={tmp_path}", "model.audio.clip_seconds=1.0"])
    policy = build_policy(m, load_tokenizer(m.tokenizer), seed=0)
    assert policy.visual is None and policy.audio_tower is not None
    assert sum(p.numel() for p in policy.parameters()) == sum(p.numel() for p in hf.parameters())
    assert torch.equal(policy.audio_projector.weight, hf.model.multi_modal_projector.linear.weight)
    image = Medium("image", "h", torch.zeros(4, 3 * 2 * 14 * 14), torch.tensor([1, 2, 2]), "p")
    with pytest.raises(ValueError, match="the prompt has image but the model has no image token"):
        policy.prompt_ids(load_tokenizer(m.tokenizer), "<image> w1", [image])
