"""model.init_from (start the policy from a local HF folder) and dry runs of the real-job recipes."""

import dataclasses

import pytest
import torch

from loomrl.cli import main
from loomrl.platform.backbone.hf_io import export_policy
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.recipe import ModelConfig

REAL_JOBS = [
    "recipes/qwen2.5-vl-3b-grpo-zero3.yaml",
    "recipes/qwen2.5-vl-3b-grpo-megatron-tp2.yaml",
    "recipes/qwen2.5-vl-7b-grpo-fsdp2.yaml",
]


def test_policy_starts_from_an_exported_checkpoint(tmp_path, tokenizer):
    source = build_policy(ModelConfig(), tokenizer, seed=1)
    folder = export_policy(source, tmp_path / "qwen2-vl", "image")
    cfg = dataclasses.replace(ModelConfig(), init_from=str(folder))
    loaded = build_policy(cfg, tokenizer, seed=2)
    fresh = build_policy(ModelConfig(), tokenizer, seed=2)
    for part in ("language_model", "visual"):
        want, got = getattr(source, part).state_dict(), getattr(loaded, part).state_dict()
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), f"{part}.{k}"
    # the folder (Qwen2-VL) has no audio tower: the policy has none either, not a random one
    assert fresh.audio_tower is not None and fresh.audio_projector is not None  # the demo has both
    assert loaded.audio_tower is None and loaded.audio_projector is None
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in source.parameters()) - sum(
        p.numel() for m in (source.audio_tower, source.audio_projector) for p in m.parameters()
    )


def test_init_from_with_other_sizes_names_the_folder(tmp_path, tokenizer):
    folder = export_policy(build_policy(ModelConfig(), tokenizer, seed=1), tmp_path / "lm", "text")
    cfg = dataclasses.replace(ModelConfig(), hidden_size=128, init_from=str(folder))
    with pytest.raises(ValueError, match=str(folder)):
        build_policy(cfg, tokenizer, seed=0)


@pytest.mark.parametrize("recipe", REAL_JOBS)
def test_real_job_recipes_validate_in_a_dry_run(recipe, capsys):
    assert main(["run", recipe, "--dry-run"]) == 0
    err = capsys.readouterr().err
    # paths that exist only on the cluster are notes here, each named
    for key in ("data.shards", "model.tokenizer", "model.init_from"):
        assert f"not on this machine: {key}" in err
    assert "recipe OK" in err
    # a real run refuses them
    assert main(["run", recipe, "--out", "/nonexistent/never-written"]) == 2


@pytest.mark.parametrize("modality", ["image", "audio"])
def test_transformers_loads_exported_policy_with_its_head(tmp_path, tokenizer, modality):
    """The tied head must arrive: transformers 5.19 leaves Qwen2-Audio's lm_head random unless written."""
    import transformers

    policy = build_policy(ModelConfig(), tokenizer, seed=3)
    folder = export_policy(policy, tmp_path / modality, modality)
    cls = (
        transformers.Qwen2VLForConditionalGeneration
        if modality == "image"
        else transformers.Qwen2AudioForConditionalGeneration
    )
    hf = cls.from_pretrained(folder)
    assert torch.equal(hf.get_output_embeddings().weight, policy.language_model.lm_head.weight)
    assert torch.equal(hf.get_input_embeddings().weight, policy.language_model.model.embed_tokens.weight)
