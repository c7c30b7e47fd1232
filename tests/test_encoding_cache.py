"""The content-hashed encoding cache: encode each distinct medium once per mini-batch,
keep every micro-batch's gradient, never serve an encoding made by other weights or
other preprocessing; and loading towers from Hugging Face checkpoint folders."""

import io
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from loomrl.cli import main
from loomrl.encoders.base import load_medium
from loomrl.encoders.cache import EncodingCache, SharedEncodings
from loomrl.encoders.media import Medium
from loomrl.platform.algorithms.losses import policy_loss_fn
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.engines.torch_engine import TorchTrainEngine
from loomrl.platform.recipe import EncoderConfig, ModelConfig, Recipe, TrainingConfig, VisionConfig
from loomrl.platform.trajectory.batch import Trajectory, micro_batches

ROOT = Path(__file__).resolve().parent.parent
# Images of three sizes: smart_resize keeps 56x56 (4 tokens), 56x112 (8) and 112x112 (16).
VISION = VisionConfig(min_pixels=56 * 56, max_pixels=112 * 112)


def png(h: int, w: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float, hz: float) -> bytes:
    """A tone of `seconds` at 16 kHz; the encoder pads every clip to its 1 s clip length."""
    import soundfile as sf

    t = np.arange(int(16000 * seconds)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * math.pi * hz * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def make_model(tokenizer, dtype=torch.float32, **encoders):
    cfg = ModelConfig(vision=VISION, encoders=EncoderConfig(**encoders))
    return build_policy(cfg, tokenizer, seed=0).to(dtype)


def groups_of_media(cfg: ModelConfig) -> list[tuple[str, list[Medium]]]:
    """Four prompts: both media, image only, audio only, both; images of three sizes,
    clips of 0.3 s, 0.6 s and 1.0 s (padded to the clip length)."""
    img = [load_medium("image", png(h, w, i), cfg) for i, (h, w) in enumerate([(56, 56), (60, 120), (112, 112)])]
    aud = [load_medium("audio", wav(s, hz), cfg) for s, hz in [(0.3, 300.0), (0.6, 900.0), (1.0, 2000.0)]]
    both = "<image> <audio> describe the picture and the sound ."
    return [
        (both, [img[0], aud[0]]),
        ("<image> describe the picture .", [img[1]]),
        ("<audio> describe the sound .", [aud[1]]),
        (both, [img[2], aud[2]]),
    ]


def mini_batch(model, tokenizer, n: int, micro_batch_size: int, seed: int = 0):
    """Micro-batches of a GRPO mini-batch: each prompt sampled n times, random completions
    and advantages; micro-batches cut across groups so shared media span several."""
    rng = random.Random(seed)
    words = [i for i in range(len(tokenizer)) if i not in set(model.banned_token_ids.tolist())]
    trajs = []
    for g, (text, media) in enumerate(groups_of_media(model.cfg)):
        ids = model.prompt_ids(tokenizer, text, media)
        for _ in range(n):
            completion = [rng.choice(words) for _ in range(rng.randint(3, 8))]
            trajs.append(
                Trajectory(
                    f"p{g}", g, ids, completion, media, [0.0] * len(completion), 0.0, 0, advantage=rng.gauss(0.0, 1.0)
                )
            )
    return micro_batches(trajs, model.pad_token_id, micro_batch_size)


def grads_of_one_step(model, mbs, dedup: bool) -> dict[str, torch.Tensor]:
    """Gradients the real training engine hands its optimizer (captured at step time)."""
    model.cfg.encoders.dedup = dedup
    engine = TorchTrainEngine(model, TrainingConfig(grad_clip=0.0))
    captured = {}

    def capture():
        captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    engine.optimizer.step = capture
    shared = SharedEncodings(model) if dedup else None
    engine.train_mini_batch(mbs, policy_loss_fn(Recipe(), shared), shared)
    return captured


def media_spread(mbs) -> int:
    """How many distinct media appear in more than one micro-batch."""
    seen: dict = {}
    for i, mb in enumerate(mbs):
        for m in {m.key for row in mb.media for m in row}:
            seen.setdefault(m, set()).add(i)
    return sum(len(v) > 1 for v in seen.values())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
def test_dedup_gradients_equal_encoding_every_copy(tokenizer, dtype, tol):
    model = make_model(tokenizer, dtype)
    mbs = mini_batch(model, tokenizer, n=4, micro_batch_size=3)
    assert len(mbs) == 6 and media_spread(mbs) == 6  # every medium is split across micro-batches
    naive = grads_of_one_step(model, mbs, dedup=False)
    dedup = grads_of_one_step(model, mbs, dedup=True)
    assert naive.keys() == dedup.keys()
    towers = [n for n in naive if n.startswith(("visual.", "audio_tower.", "audio_projector."))]
    assert len(towers) > 20 and all(naive[n].abs().max() > 0 for n in towers if "embed_positions" not in n)
    for name in naive:
        scale = max(1.0, float(naive[name].abs().max()))
        err = float((naive[name] - dedup[name]).abs().max()) / scale
        assert err <= tol, f"{name}: {err:.2e}"


def test_a_wrong_gradient_would_be_caught(tokenizer):
    """The equality above is not vacuous: dropping one micro-batch's encoder gradient shows."""
    model = make_model(tokenizer, torch.float64)
    mbs = mini_batch(model, tokenizer, n=4, micro_batch_size=3)
    full = grads_of_one_step(model, mbs, dedup=True)
    model.cfg.encoders.dedup = True
    shared = SharedEncodings(model)
    shared.begin(mbs)
    loss_fn = policy_loss_fn(Recipe(), shared)
    model.zero_grad(set_to_none=True)
    for i, mb in enumerate(mbs):
        loss, _ = loss_fn(model, mb)
        loss.backward()
        if i == 0:
            for leaf in shared.encodings.values():
                leaf.grad = None  # lose micro-batch 0's contribution to the encoders
    shared.finish()
    g = model.visual.patch_embed.proj.weight.grad
    assert float((g - full["visual.patch_embed.proj.weight"]).abs().max()) > 1e-6


def count_tower_inputs(model) -> dict[str, int]:
    counts = {"image": 0, "audio": 0}
    model.visual.register_forward_pre_hook(
        lambda mod, args, kwargs: counts.__setitem__("image", counts["image"] + len(kwargs["grid_thw"])),
        with_kwargs=True,
    )
    model.audio_tower.register_forward_pre_hook(
        lambda mod, args: counts.__setitem__("audio", counts["audio"] + args[0].shape[0])
    )
    return counts


def count_tower_backwards(model) -> dict[str, int]:
    """Backward passes through each tower, seen as gradients of its first layer's weight."""
    counts = {"image": 0, "audio": 0}
    model.visual.patch_embed.proj.weight.register_hook(lambda g: counts.__setitem__("image", counts["image"] + 1))
    model.audio_tower.conv1.weight.register_hook(lambda g: counts.__setitem__("audio", counts["audio"] + 1))
    return counts


def test_encoder_calls_equal_unique_media(tokenizer):
    model = make_model(tokenizer)
    counts, backwards = count_tower_inputs(model), count_tower_backwards(model)
    mbs = mini_batch(model, tokenizer, n=8, micro_batch_size=5)
    placements = [m for mb in mbs for row in mb.media for m in row]
    assert len(placements) == 8 * 6 and len(mbs) == 7
    grads_of_one_step(model, mbs, dedup=True)
    assert counts == {"image": 3, "audio": 3}
    assert backwards == {"image": 1, "audio": 1}  # one encoder backward for the whole mini-batch
    stats = model.encode_totals
    assert (stats.calls, stats.media_unique, stats.media_total) == (6, 6, 48)
    assert stats.bytes_naive == sum(m.nbytes for m in placements)
    assert stats.bytes_moved == sum(m.nbytes for m in {m.key: m for m in placements}.values())
    assert stats.backward_s > 0 and stats.cache_hits == 0  # trainable towers: no cache in the grad path

    counts.update(image=0, audio=0)
    backwards.update(image=0, audio=0)
    grads_of_one_step(model, mbs, dedup=False)
    assert counts == {"image": 8 * 3, "audio": 8 * 3}
    holding = {k: sum(any(m.kind == k for row in mb.media for m in row) for mb in mbs) for k in counts}
    assert backwards == holding and min(holding.values()) >= 6  # once per micro-batch holding that kind


def test_cache_serves_only_the_same_weights_and_preprocessing(tokenizer):
    model = make_model(tokenizer, cache_size=16).eval()
    counts = count_tower_inputs(model)
    cfg = model.cfg
    image = load_medium("image", png(56, 56, 0), cfg)
    clip = load_medium("audio", wav(0.5, 440.0), cfg)
    with torch.no_grad():
        first = model.encode_media([image, clip])
        again = model.encode_media([image, clip, image])
        assert counts == {"image": 1, "audio": 1} and model.encoding_cache.hits == 2
        torch.testing.assert_close(again[image.key], first[image.key], rtol=0, atol=0)

        # other preprocessing of the same bytes: same content hash, a different key
        other = load_medium(
            "image", png(56, 56, 0), ModelConfig(vision=VisionConfig(min_pixels=112 * 112, max_pixels=112 * 112))
        )
        assert other.hash == image.hash and other.prep != image.prep
        model.encode_media([other])
        assert counts["image"] == 2
        relabelled = Medium("image", image.hash, image.features, image.grid, prep="other-settings")
        model.encode_media([relabelled])
        assert counts["image"] == 3

        # the projector is applied after the cache: a new projector, the same tower outputs
        model.audio_projector.weight.add_(0.05)
        projected = model.encode_media([image, clip])
        assert counts == {"image": 3, "audio": 1}
        assert not torch.allclose(projected[clip.key], first[clip.key])

        # new tower weights (an optimizer step or a load writes them in place): never the old encodings
        model.visual.patch_embed.proj.weight.add_(0.05)
        fresh = model.encode_media([image, clip])
        assert counts == {"image": 4, "audio": 2}
        assert not torch.allclose(fresh[image.key], first[image.key])
        model.encoding_cache.clear()
        recomputed = model.encode_media([image, clip])
        assert counts == {"image": 5, "audio": 3}
        for k in (image.key, clip.key):
            torch.testing.assert_close(recomputed[k], fresh[k], rtol=0, atol=0)
        torch.testing.assert_close(recomputed[clip.key], projected[clip.key], rtol=0, atol=0)

        # another dtype is another encoder
        model.double()
        model.encode_media([image])
        assert counts["image"] == 6


def test_trainable_encoders_never_reuse_across_an_optimizer_step(tokenizer):
    model = make_model(tokenizer)
    counts = count_tower_inputs(model)
    mbs = mini_batch(model, tokenizer, n=2, micro_batch_size=4)
    media = [m for mb in mbs for row in mb.media for m in row]
    model.eval()
    with torch.no_grad():  # a rollout: no gradient, so the cache may serve it within this version
        model.encode_media(media)
        model.encode_media(media)
    assert counts == {"image": 3, "audio": 3} and model.encoding_cache.hits == 6
    engine = TorchTrainEngine(model, TrainingConfig())
    shared = SharedEncodings(model)
    engine.train_mini_batch(mbs, policy_loss_fn(Recipe(), shared), shared)
    assert counts == {"image": 6, "audio": 6}  # the training pass needs a graph: never from the cache
    model.eval()
    with torch.no_grad():
        model.encode_media(media)
    assert counts == {"image": 9, "audio": 9} and model.encoding_cache.hits == 6


def test_frozen_encoders_cached_across_steps(tokenizer):
    model = make_model(tokenizer, frozen=True, cache_size=8)
    counts = count_tower_inputs(model)
    engine = TorchTrainEngine(model, TrainingConfig())
    assert not any(p.requires_grad for p in model.visual.parameters())
    assert model.audio_projector.weight.requires_grad
    before = model.audio_projector.weight.detach().clone()
    mbs = mini_batch(model, tokenizer, n=2, micro_batch_size=3)
    for step in range(3):
        shared = SharedEncodings(model)
        engine.train_mini_batch(mbs, policy_loss_fn(Recipe(), shared), shared)
        assert not model.visual.training  # frozen towers stay in eval mode
    assert counts == {"image": 3, "audio": 3}  # encoded in step 0 only
    assert (model.encoding_cache.hits, model.encoding_cache.misses) == (12, 6)
    assert len(model.encoding_cache) == 6
    assert not torch.equal(before, model.audio_projector.weight)  # the projector still trains


def test_frozen_encodings_do_not_depend_on_what_was_encoded_with_them(tokenizer):
    """Cached across steps, a frozen tower's encoding must be the one a resumed run (empty cache)
    computes, whatever media shared the first tower call: each miss is encoded alone."""
    together, apart = make_model(tokenizer, frozen=True), make_model(tokenizer, frozen=True)
    media = [m for _, ms in groups_of_media(together.cfg) for m in ms]
    counts = count_tower_inputs(apart)
    with torch.no_grad():
        want = together.encode(media)[0]
        got = {}
        for m in reversed(media):  # one at a time, in another order
            got.update(apart.encode([m])[0])
    assert counts == {"image": 3, "audio": 3}
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_lru_evicts_the_least_recently_used_and_forgets_old_weights():
    cache = EncodingCache(2)
    for k in "abc":
        cache.put(k, 0, torch.zeros(1))
        assert cache.get("a", 0) is not None
    assert list(cache.entries) == ["c", "a"] and (cache.hits, cache.misses) == (3, 0)
    assert cache.get("c", 1) is None and len(cache) == 0  # other weights: everything dropped
    cache.put("c", 1, torch.ones(1))
    assert cache.get("c", 0) is None and cache.misses == 2
    empty = EncodingCache(0)
    empty.put("a", 0, torch.zeros(1))
    assert len(empty) == 0


def length_reward(text: str, record: dict) -> float:
    """Varies within every group from the first step on (slot_match needs a warm-up)."""
    return len(text.split()) / 16


def test_run_reports_encoder_metrics(tmp_path):
    def run(out, *extra):
        assert (
            main(
                [
                    "run",
                    str(ROOT / "recipes" / "demo.yaml"),
                    "--out",
                    str(tmp_path / out),
                    f"data.shards={tmp_path}/shards/demo-*.tar",
                    "data.demo.samples=24",
                    f"algorithm.reward={__name__}:length_reward",
                    "model.encoders.frozen=false",  # the towers train: their gradients go through the dedup
                    "training.steps=2",
                    "training.warmup.steps=0",
                    "training.mini_batches=1",
                    "training.prompts_per_step=3",
                    "training.micro_batch_size=5",
                    "rollout.n=4",
                    "checkpoint.every=0",
                    "goal=null",
                    *extra,
                ]
            )
            == 0
        )
        return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    dedup, naive = run("dedup"), run("naive", "model.encoders.dedup=false")
    # same weights and rollouts in step 0: the same loss and gradient norm either way
    assert naive[0]["grad_norm"] > 0
    assert abs(dedup[0]["loss"] - naive[0]["loss"]) < 1e-6
    assert abs(dedup[0]["grad_norm"] - naive[0]["grad_norm"]) < 1e-5 * naive[0]["grad_norm"]
    for d, n in zip(dedup, naive):
        assert d["enc_media_total"] == n["enc_media_total"] == d["media_total"]
        assert d["enc_calls"] == d["enc_media_unique"] == d["media_unique"]
        assert n["enc_calls"] == n["enc_media_total"] == 4 * n["media_unique"]
        assert d["enc_bytes_moved"] * 4 == d["enc_bytes_naive"] == n["enc_bytes_moved"]
        assert d["logp_mismatch"] < 1e-4 and n["logp_mismatch"] < 1e-4
        assert d["enc_backward_s"] > 0 and n["enc_backward_s"] == 0


def test_bench_encoders_json(capsys):
    assert (
        main(["bench", "encoders", "--groups", "3", "--n", "4", "--micro-batch", "5", "--repeats", "1", "--json"]) == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert "encoder forward+backward" in "\n".join(out[:-1])
    assert (r["calls_naive"], r["calls_dedup"], r["calls_ratio"]) == (16, 4, 4.0)  # samples 0-2: image, audio, both
    assert r["bytes_naive"] == 4 * r["bytes_dedup"] and r["micro_batches"] == 3
    assert r["encoder_grad_max_rel_diff"] < 1e-5
    assert r["encoder_s_naive"] > 0 and r["encoder_s_dedup"] > 0 and r["target_encoder_speedup"] == 3.2


# --------------------------------------------------------------------------- HF checkpoints

TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def save_tiny(kind: str, folder: Path):
    import transformers as T

    torch.manual_seed(0)
    if kind == "qwen2_vl":
        cfg = T.Qwen2VLConfig(
            text_config=TEXT, vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)
        )
        model = T.Qwen2VLForConditionalGeneration(cfg)
    elif kind == "qwen2_5_vl":
        cfg = T.Qwen2_5_VLConfig(
            text_config=TEXT,
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=48,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[1],
                window_size=56,
            ),
        )
        model = T.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        cfg = T.Qwen2AudioConfig(
            text_config=dict(model_type="qwen2", **TEXT),
            audio_config=dict(
                d_model=32,
                encoder_layers=1,
                encoder_attention_heads=2,
                encoder_ffn_dim=64,
                num_mel_bins=80,
                max_source_positions=50,
            ),
        )
        model = T.Qwen2AudioForConditionalGeneration(cfg)
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_tower_loads_from_a_checkpoint_folder(tmp_path, kind):
    from loomrl.encoders.hf_checkpoint import load_vision_tower
    from loomrl.encoders.vision import encode_images, preprocess_image

    hf = save_tiny(kind, tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    tower = load_vision_tower(tmp_path)
    assert type(tower) is type(hf.model.visual)
    hf_state = hf.model.visual.state_dict()
    assert tower.state_dict().keys() == hf_state.keys()
    for k, v in tower.state_dict().items():
        assert torch.equal(v, hf_state[k]), k
    cfg = VisionConfig(min_pixels=56 * 112, max_pixels=112 * 112)
    pics = [preprocess_image(Image.open(io.BytesIO(png(h, w, 1))), cfg) for h, w in [(56, 112), (112, 112)]]
    patches, grids = torch.cat([p for p, _ in pics]), torch.stack([g for _, g in pics])
    with torch.no_grad():
        ours = encode_images(tower, patches, grids)
        ref = hf.model.visual(patches, grid_thw=grids).pooler_output
    assert ours.shape == (8 + 16, 32)  # 4x8 and 8x8 patches, 2x2 merged
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_attach_towers_puts_checkpoint_weights_in_the_policy(tmp_path, tokenizer):
    from loomrl.encoders.hf_checkpoint import attach_towers
    from loomrl.platform.recipe import AudioConfig

    vl, audio = save_tiny("qwen2_vl", tmp_path / "vl"), save_tiny("qwen2_audio", tmp_path / "audio")
    cfg = ModelConfig(hidden_size=32, vision=VISION, audio=AudioConfig(d_model=32, num_heads=2))
    model = build_policy(cfg, tokenizer, seed=0)
    image, clip = load_medium("image", png(56, 112, 3), cfg), load_medium("audio", wav(0.5, 440.0), cfg)
    model.eval()
    with torch.no_grad():
        before = model.encode_media([image, clip])
        attach_towers(model, tmp_path / "vl", tmp_path / "audio")
        after = model.encode_media([image, clip])
        ref_image = vl.model.visual(image.features, grid_thw=image.grid[None]).pooler_output
        ref_clip = audio.model.multi_modal_projector(audio.model.audio_tower(clip.features[None]).last_hidden_state)[0]
    assert model.encoding_cache.misses == 4  # nothing served from before the swap
    torch.testing.assert_close(after[image.key], ref_image, rtol=0, atol=0)
    torch.testing.assert_close(after[clip.key], ref_clip, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(before[image.key], after[image.key])
    with pytest.raises(ValueError, match="does not fit"):
        attach_towers(build_policy(ModelConfig(), tokenizer, seed=0), vision_folder=tmp_path / "vl")


def test_audio_tower_loads_from_a_checkpoint_folder(tmp_path):
    from loomrl.encoders.audio import encode_audio
    from loomrl.encoders.hf_checkpoint import load_audio_tower, load_vision_tower

    hf = save_tiny("qwen2_audio", tmp_path)
    tower, projector = load_audio_tower(tmp_path, dtype=torch.float64)
    assert tower.conv1.weight.dtype == torch.float64
    features = torch.randn(2, 80, 100)
    with torch.no_grad():
        ours = projector(encode_audio(tower, features))
        ref = hf.model.multi_modal_projector(hf.model.audio_tower(features).last_hidden_state)
    assert ours.shape == (2, 25, 32)
    torch.testing.assert_close(ours.float(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no supported vision tower"):
        load_vision_tower(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_audio_tower(tmp_path / "missing")
