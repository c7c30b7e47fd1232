"""Memory tools: activation checkpointing (`training.activation_checkpointing`) recomputes
each decoder layer and each block of a trained tower in the backward and gives the plain
path's gradients, while rollouts run as before; per-part freezing (`training.freeze`)
keeps a part's weights bit-identical through training and out of the optimizer, with
errors that name the key; `model.encoders.frozen` is the same mechanism for the towers."""

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loomrl.cli import main
from loomrl.encoders.base import load_medium
from loomrl.platform import recipe as R
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.recipe import EncoderConfig, ModelConfig
from loomrl.platform.rollout.base import Prompt, SamplingParams
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine
from loomrl.platform.trainer import Trainer
from loomrl.platform.trajectory.batch import Trajectory, micro_batches

ROOT = Path(__file__).resolve().parent.parent
from test_encoding_cache import VISION, png, wav  # noqa: E402 (tests/ on the path: media of the encoder tests)


def prompts_of(model, tokenizer, audio: bool = True) -> list[Prompt]:
    """Three prompts: image + clip, image, text only (no audio without `audio`)."""
    cfg = model.cfg
    img = [load_medium("image", png(56, 56, 0), cfg), load_medium("image", png(60, 120, 1), cfg)]
    out = [Prompt("a", [], [img[0]]), Prompt("b", [], [img[1]]), Prompt("c", [], [])]
    texts = ["<image> what is this ?", "<image> describe it .", "say something ."]
    if audio:
        out[0].media.append(load_medium("audio", wav(0.5, 440.0), cfg))
        texts[0] = "<image> <audio> what is this ?"
    for p, text in zip(out, texts):
        p.ids = model.prompt_ids(tokenizer, text, p.media)
    return out


def batch_of(model, tokenizer, audio: bool = True):
    """Micro-batches: each prompt twice with random completions (some rows padded)."""
    rng = random.Random(0)
    words = [i for i in range(len(tokenizer)) if i not in set(model.banned_token_ids.tolist())]
    trajs = []
    for g, p in enumerate(prompts_of(model, tokenizer, audio)):
        for _ in range(2):
            completion = [rng.choice(words) for _ in range(rng.randint(2, 6))]
            trajs.append(Trajectory(p.id, g, p.ids, completion, p.media, [0.0] * len(completion), 0.0, 0))
    return micro_batches(trajs, model.pad_token_id, 4)


def count_calls(modules) -> list[int]:
    """Forward calls of each module (a recomputed layer runs twice per forward + backward). Seen
    before the forward: a recomputation stops as soon as it has what the backward needs."""
    counts = [0] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def with_media(mbs, kind: str) -> int:
    """Micro-batches with a medium of `kind` (each runs that tower once per forward)."""
    return sum(1 for mb in mbs if any(m.kind == kind for row in mb.media for m in row))


def distinct_media(mbs, kind: str) -> int:
    """Distinct media of `kind` in all of `mbs` (frozen towers: each encoded alone, once, then cached)."""
    return len({m.hash for mb in mbs for row in mb.media for m in row if m.kind == kind})


def gradients(model, mbs, checkpointing: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Every parameter's gradient after one backward per micro-batch, and how often the first
    decoder layer, the first vision block and the first audio layer ran."""
    model = copy.deepcopy(model)
    model.set_activation_checkpointing(checkpointing)
    model.train()
    calls = count_calls(
        [
            model.language_model.model.layers[0],
            model.visual.blocks[0],
            *([model.audio_tower.layers[0]] if model.audio_tower is not None else []),
        ]
    )
    for mb in mbs:
        logp, entropy = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
        (logp.sum() + 0.1 * entropy.sum()).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, calls


def assert_same_gradients(plain: dict, recomputed: dict) -> None:
    assert plain.keys() == recomputed.keys()
    for name, g in plain.items():
        torch.testing.assert_close(recomputed[name], g, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def demo_model():
    return build_policy(ModelConfig(vision=VISION), load_tokenizer("demo"), seed=0)


def test_checkpointing_recomputes_and_keeps_every_gradient(demo_model, tokenizer):
    mbs = batch_of(demo_model, tokenizer)
    plain, plain_calls = gradients(demo_model, mbs, checkpointing=False)
    recomputed, calls = gradients(demo_model, mbs, checkpointing=True)
    trainable = {n for n, p in demo_model.named_parameters() if p.requires_grad}
    assert plain.keys() == trainable  # the towers train: every weight has a gradient
    once = [len(mbs), with_media(mbs, "image"), with_media(mbs, "audio")]
    assert plain_calls == once and min(once) > 0
    # decoder layer, vision block, audio layer: each ran again in the backward
    assert calls == [2 * n for n in once]
    assert_same_gradients(plain, recomputed)


def test_checkpointing_with_frozen_embeddings_and_towers(demo_model, tokenizer):
    # embeddings and towers frozen: in the text-only micro-batch no input of a layer requires
    # grad, and the layers must still get their gradients (a reentrant checkpoint gives none)
    model = copy.deepcopy(demo_model)
    model.freeze(["embeddings", "vision", "merger", "audio"])
    mbs = batch_of(model, tokenizer)
    assert any(not any(mb.media) for mb in mbs) and any(any(mb.media) for mb in mbs)
    plain, _ = gradients(model, mbs, checkpointing=False)
    recomputed, calls = gradients(model, mbs, checkpointing=True)
    lm = [n for n in plain if n.startswith("language_model.")]
    assert len(lm) == sum(1 for _ in model.language_model.parameters()) - 1  # all but the embedding
    assert set(plain) - set(lm) == {"audio_projector.weight", "audio_projector.bias"}
    # decoder layers recomputed; the frozen towers run in eval mode and never recompute, each
    # medium encoded alone on its cache miss (VLM.encode) and served from the cache after that
    assert calls == [2 * len(mbs), distinct_media(mbs, "image"), distinct_media(mbs, "audio")]
    assert_same_gradients(plain, recomputed)


def test_qwen2_5_vl_vision_tower_checkpoints(tmp_path, tokenizer):
    # a checkpoint's own tower class (Qwen2.5-VL: windowed + full-attention blocks) through
    # transformers' gradient checkpointing, with our calls
    from qwen_checkpoints import _qwen2_vl

    _qwen2_vl(str(tmp_path), "qwen2_5_vl")
    cfg = ModelConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        tie_word_embeddings=False,
        vision=VISION,
        tokenizer=str(tmp_path),
        init_from=str(tmp_path),
    )
    tok = load_tokenizer(str(tmp_path))
    model = build_policy(cfg, tok, seed=0)
    assert model.audio_tower is None
    model.set_activation_checkpointing(True)
    assert model.visual.gradient_checkpointing and all(b.gradient_checkpointing for b in model.visual.blocks)
    model.set_activation_checkpointing(False)
    mbs = batch_of(model, tok, audio=False)
    plain, _ = gradients(model, mbs, checkpointing=False)
    recomputed, calls = gradients(model, mbs, checkpointing=True)
    assert any(n.startswith("visual.blocks.1.") for n in plain)
    assert calls == [2 * len(mbs), 2 * with_media(mbs, "image")]
    assert_same_gradients(plain, recomputed)


def test_rollouts_and_no_grad_forwards_are_unchanged(demo_model, tokenizer):
    def rollout(checkpointing: bool):
        model = copy.deepcopy(demo_model)
        model.set_activation_checkpointing(checkpointing)
        model.train()  # as in the trainer: generate switches to eval and back
        calls = count_calls([model.language_model.model.layers[0]])
        result = TorchRolloutEngine(model).generate(
            prompts_of(model, tokenizer), SamplingParams(n=2, max_new_tokens=5), torch.Generator().manual_seed(3)
        )
        assert model.training
        # a train-mode forward without grad (old log-probs) keeps its KV cache and recomputes nothing
        ids = torch.tensor([prompts_of(model, tokenizer)[2].ids])
        with torch.no_grad():
            logits, cache = model.forward_embeds(model.embed(ids, [[]], {}), torch.ones_like(ids))
        assert len(cache) == model.cfg.num_layers
        return [(r.completion_ids, r.logprobs) for r in result.rollouts], calls[0], result.forwards, logits

    plain, ran, forwards, logits = rollout(False)
    same, ran_ckpt, forwards_ckpt, logits_ckpt = rollout(True)
    assert same == plain and len(plain) == 6
    assert ran_ckpt == ran == forwards + 1  # one call per forward: nothing recomputed
    torch.testing.assert_close(logits_ckpt, logits, rtol=0, atol=0)


def test_parts_hold_every_parameter_once(tokenizer):
    for tied in (True, False):
        model = build_policy(ModelConfig(tie_word_embeddings=tied), tokenizer, seed=0)
        parts = model.parameter_parts()
        assert list(parts) == ["vision", "merger", "audio", "audio_projector", "language_model", "embeddings"]
        ids = [id(p) for params in parts.values() for p in params]
        assert len(ids) == len(set(ids)) == len(list(model.parameters()))
        vocab, hidden = model.language_model.cfg.vocab_size, model.cfg.hidden_size
        assert sum(p.numel() for p in parts["embeddings"]) == vocab * hidden * (1 if tied else 2)
        assert all(p is not model.visual.merger.mlp[0].weight for p in parts["vision"])
        assert parts["audio_projector"] == [model.audio_projector.weight, model.audio_projector.bias]


def test_frozen_vision_with_a_trainable_merger_is_never_cached(tokenizer):
    model = build_policy(ModelConfig(vision=VISION, encoders=EncoderConfig(cache_size=8)), tokenizer, seed=0)
    model.freeze(["vision", "audio"])
    model.train()
    assert model.visual.training and not model.audio_tower.training  # the merger trains: not an inference tower
    assert not any(p.requires_grad for p in model.parameter_parts()["vision"])
    image, clip = prompts_of(model, tokenizer)[0].media
    calls = count_calls([model.visual, model.audio_tower])
    for _ in range(2):
        enc = model.encode_media([image, clip])
    assert calls == [2, 1]  # the merger's output is recomputed; the frozen audio tower's served from the cache
    assert model.encoding_cache.hits == 1
    enc[image.key].sum().backward()
    assert model.visual.merger.mlp[0].weight.grad is not None
    assert model.visual.patch_embed.proj.weight.grad is None


def test_encoders_frozen_is_freezing_the_towers(tokenizer):
    frozen = build_policy(ModelConfig(encoders=EncoderConfig(frozen=True)), tokenizer, seed=0)
    named = build_policy(ModelConfig(), tokenizer, seed=0)
    named.freeze(["vision", "merger", "audio"])
    for model in (frozen, named):
        model.train()
        counts = model.part_counts()
        for part in ("vision", "merger", "audio"):
            assert counts[part][0] == 0 and counts[part][1] > 0, part
        for part in ("audio_projector", "language_model", "embeddings"):
            assert counts[part][1] == 0 and counts[part][0] > 0, part
        assert not model.visual.training and not model.audio_tower.training
    assert frozen.part_counts() == named.part_counts()
    assert frozen.frozen == set() and named.frozen == {"vision", "merger", "audio"}


def test_freeze_errors_name_the_key(tmp_path, tokenizer):
    def refused(*overrides: str) -> str:
        with pytest.raises(R.RecipeError) as e:
            R.load_recipe(None, list(overrides), files=False)
        return str(e.value)

    msg = refused("training.freeze=[vision,decoder]")
    assert msg.startswith("training.freeze[1]: 'decoder' is not allowed")
    assert "'vision', 'merger', 'audio', 'audio_projector', 'language_model', 'embeddings'" in msg
    assert refused("training.freeze=[merger,merger]") == "training.freeze[1]: 'merger' is listed twice"
    assert "every part of the policy is frozen" in refused(
        "training.freeze=[vision,merger,audio,audio_projector,language_model,embeddings]"
    )
    assert "with model.encoders.frozen" in refused(
        "model.encoders.frozen=true", "training.freeze=[audio_projector,language_model,embeddings]"
    )
    assert refused("training.freeze=[language_model,embeddings]", "training.warmup.steps=3").startswith(
        "training.warmup.target:"
    )
    assert R.load_recipe(None, ["training.freeze=[language_model,embeddings]"], files=False).training.freeze == [
        "language_model",
        "embeddings",
    ]

    # at start: a part the model does not have, and nothing left to train
    model = build_policy(ModelConfig(), tokenizer, seed=0)
    model.audio_tower = model.audio_projector = None  # as a Qwen2-VL checkpoint builds it
    recipe = R.load_recipe(None, ["training.freeze=[audio]"], files=False)
    with pytest.raises(R.RecipeError, match=r"training.freeze: the model has no 'audio' to freeze"):
        Trainer(recipe, tmp_path).freeze_parts(model)
    recipe = R.load_recipe(None, ["training.freeze=[vision,merger,language_model,embeddings]"], files=False)
    with pytest.raises(
        R.RecipeError,
        match=r"freezes every part this model has \(vision, merger, "
        r"language_model, embeddings\); nothing would train",
    ):
        Trainer(recipe, tmp_path).freeze_parts(model)


def test_short_run_keeps_frozen_parts_bit_identical(tmp_path, loomrl_log):
    out = tmp_path / "run"
    overrides = [
        f"data.shards={tmp_path}/shards/demo-*.tar",
        "data.demo.samples=24",
        "algorithm.reward=rewards_for_tests:varied",
        "training.steps=3",
        "training.warmup.steps=0",
        "training.mini_batches=1",
        "training.prompts_per_step=3",
        "training.micro_batch_size=6",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "rollout.drafter.enabled=false",
        "checkpoint.every=0",
        "goal=null",
        "training.freeze=[vision,merger]",
        "model.encoders.frozen=false",  # the audio tower trains (the demo recipe freezes both towers)
        "training.activation_checkpointing=true",
    ]
    assert main(["run", str(ROOT / "recipes" / "demo.yaml"), "--out", str(out), *overrides]) == 0
    recipe = R.load_recipe(ROOT / "recipes" / "demo.yaml", overrides, files=False)
    start = build_policy(recipe.model, load_tokenizer("demo"), recipe.training.seed)
    before = start.state_dict()
    (ckpt,) = (out / "checkpoints").iterdir()
    after = load_file(ckpt / "model.safetensors")
    frozen = {n for n in before if n.startswith("visual.")}
    assert any(n.startswith("visual.merger.") for n in frozen) and any(n.startswith("visual.blocks.") for n in frozen)
    for name in frozen:
        assert torch.equal(after[name], before[name]), name
    changed = {n.split(".")[0] for n in after if n not in frozen and not torch.equal(after[n], before[n])}
    assert changed == {"language_model", "audio_tower", "audio_projector"}

    # the optimizer state holds exactly the trainable weights, in order (frozen ones absent)
    trainable = [
        p for p in start.parameters() if not any(p is q for q in start.visual.parameters()) and p.requires_grad
    ]
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)["engine"]["optimizer"]
    (group,) = opt["param_groups"]
    assert len(group["params"]) == len(trainable) < len(list(start.parameters()))
    assert [tuple(opt["state"][i]["exp_avg"].shape) for i in group["params"]] == [tuple(p.shape) for p in trainable]
    lines = [r.getMessage() for r in loomrl_log.records if "trainable/frozen params" in r.getMessage()]
    assert len(lines) == 1 and "vision 0/" in lines[0] and "merger 0/" in lines[0], lines
    assert lines[0].endswith("activation checkpointing")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["grad_norm"] > 0
