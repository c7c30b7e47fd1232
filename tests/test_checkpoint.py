import pytest
import torch

from loomrl.platform.checkpoint import load_checkpoint, save_checkpoint
from loomrl.platform.engines.torch_engine import TorchTrainEngine
from loomrl.platform.recipe import TrainingConfig


def test_checkpoint_round_trip_keep_last_and_corruption(tmp_path, model, tokenizer):
    from loomrl.platform.backbone.vlm import build_policy
    from loomrl.platform.recipe import ModelConfig

    engine = TorchTrainEngine(model, TrainingConfig())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    engine.optimizer.step()
    paths = [save_checkpoint(tmp_path, s, model, engine.state_dict(), {"step": s}, keep_last=2) for s in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]

    other = build_policy(ModelConfig(), tokenizer, seed=5)
    engine_state, state = load_checkpoint(paths[-1], other)
    assert state == {"step": 3}
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    assert other.language_model.lm_head.weight is other.language_model.model.embed_tokens.weight
    TorchTrainEngine(other, TrainingConfig()).load_state_dict(engine_state)

    (paths[-1] / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors: missing or corrupt"):
        load_checkpoint(paths[-1], other)
    (paths[1] / "manifest.json").write_text("{}")  # a manifest that vouches for nothing
    with pytest.raises(ValueError, match="does not list model.safetensors"):
        load_checkpoint(paths[1], other)
    (paths[1] / "manifest.json").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        load_checkpoint(paths[1], other)
