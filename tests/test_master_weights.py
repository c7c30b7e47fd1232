"""`training.precision: bf16_params`, BF16 training as Megatron and DeepSpeed do it: the policy's
weights are BF16 (every forward runs on them), AdamW steps FP32 master copies, each micro-batch's
gradient is accumulated in FP32, the weights are the masters rounded after each step, the masters
survive a stage change and a checkpoint, and engines without master weights refuse the setting."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from loomrl.cli import main
from loomrl.platform.algorithms.losses import sft_loss
from loomrl.platform.engines.torch_engine import TorchTrainEngine
from loomrl.platform.recipe import RecipeError, TrainingConfig, load_recipe
from loomrl.platform.trajectory.batch import Trajectory, micro_batches

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def batch(model, samples, tokenizer):
    """Two micro-batches of 3 rows each: the prompt, then a target sentence."""
    trajs = []
    for i, s in enumerate(samples[:6]):
        ids = tokenizer(f"a red circle and tone {i}", add_special_tokens=False)["input_ids"] + [model.eos_token_id]
        trajs.append(Trajectory(s.id, 0, s.ids, ids, s.media, [0.0] * len(ids), 0.0, 0))
    return micro_batches(trajs, model.pad_token_id, 3)


def test_weights_are_bf16_roundings_of_fp32_masters(model, batch):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = TorchTrainEngine(model, TrainingConfig(precision="bf16_params", lr=1e-3))
    masters = engine.masters.fp32
    # the masters start as the FP32 weights themselves, not their BF16 roundings
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(torch.equal(m, before[n]) for n, m in zip(trained, masters))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in masters)  # BF16 drops bits
    stats = engine.train_mini_batch(batch, sft_loss)
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    moved = 0
    for name, p, m in zip(trained, engine.params, masters):
        assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))  # the model holds the masters, rounded
        moved += not torch.equal(m.detach(), before[name])
    assert moved > len(masters) // 2
    state = engine.optimizer.state_dict()["state"]
    assert state and all(v.dtype == torch.float32 for s in state.values() for k, v in s.items() if k != "step")


def test_gradients_accumulate_in_fp32(model, batch):
    """The masters' gradient is the FP32 sum of the micro-batches' BF16 gradients, not a BF16 sum."""
    engine = TorchTrainEngine(model, TrainingConfig(precision="bf16_params", lr=0.0, grad_clip=0.0))
    grads = []
    for mb in batch:  # each micro-batch's BF16 gradient alone, on the same BF16 weights
        model.zero_grad(set_to_none=True)
        loss, _ = sft_loss(model, mb)
        loss.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in engine.params])
    model.zero_grad(set_to_none=True)
    engine.optimizer.step = lambda: None  # keep the gradients to look at
    engine.masters.publish = lambda: None
    engine.train_mini_batch(batch, sft_loss)
    fp32_sum = bf16_sum = 0
    for k, m in enumerate(engine.masters.fp32):
        g = [x[k] for x in grads if x[k] is not None]
        if not g:
            continue
        want = sum(x.float() for x in g)
        assert torch.equal(m.grad, want)
        fp32_sum += 1
        bf16_sum += not torch.equal(sum(g).float(), want)  # a BF16 sum would round
    assert fp32_sum > 10 and bf16_sum > 0


def test_masters_survive_a_stage_change_and_a_checkpoint(model, batch):
    warm = TorchTrainEngine(model, TrainingConfig(precision="bf16_params", lr=1e-3))
    warm.train_mini_batch(batch, sft_loss)
    kept = [m.detach().clone() for m in warm.masters.fp32]
    rl = TorchTrainEngine(model, TrainingConfig(precision="bf16_params", lr=1e-3))  # the next stage's engine
    assert all(torch.equal(a, b) for a, b in zip(rl.masters.fp32, kept))  # not the BF16 weights re-widened
    rl.train_mini_batch(batch, sft_loss)
    state = copy.deepcopy(rl.state_dict())
    after_one = [m.detach().clone() for m in rl.masters.fp32]
    rl.train_mini_batch(batch, sft_loss)
    want = [m.detach().clone() for m in rl.masters.fp32]
    # a resumed engine on a fresh model holding only the BF16 weights: the masters come from the state
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.master = None
    with torch.no_grad():
        for p, a in zip([p for p in other.parameters() if p.requires_grad], after_one):
            p.copy_(a.to(torch.bfloat16))
    resumed = TorchTrainEngine(other, TrainingConfig(precision="bf16_params", lr=1e-3))
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.masters.fp32, after_one))
    resumed.train_mini_batch(batch, sft_loss)
    assert all(torch.equal(a, b) for a, b in zip(resumed.masters.fp32, want))


def test_engines_without_master_weights_refuse_it():
    able = "runs on training.engine=deepspeed or megatron or torch;"
    with pytest.raises(RecipeError, match=f"training.precision: bf16_params .* {able}"):
        load_recipe("recipes/demo.yaml", ["training.precision=bf16_params", "training.engine=fsdp2"])
    with pytest.raises(RecipeError, match="training.precision: bf16_params with training.engine=deepspeed"):
        load_recipe("recipes/demo.yaml", ["training.precision=bf16_params", "training.engine=deepspeed"])
    for engine in ("megatron", "deepspeed training.deepspeed.bf16=true"):  # their own BF16 modes
        r = load_recipe("recipes/demo.yaml", ["training.precision=bf16_params", *f"training.engine={engine}".split()])
        assert r.training.precision == "bf16_params"


def test_short_bf16_params_run_through_the_cli(tmp_path):
    out = tmp_path / "run"
    rc = main(
        [
            "run",
            str(ROOT / "recipes" / "demo.yaml"),
            "--out",
            str(out),
            f"data.shards={tmp_path}/shards/demo-*.tar",
            "data.demo.samples=24",
            "rollout.max_new_tokens=8",
            "training.precision=bf16_params",
            "training.warmup.steps=0",  # the policy is still FP32 when the reference is copied from it
            "training.steps=3",
            "training.mini_batches=1",
            "training.prompts_per_step=4",
            "rollout.n=4",
            "goal=null",
            "logging.tensorboard=false",
            "logging.progress=false",
            "algorithm.kl_coef=0.01",
            "algorithm.reward=rewards_for_tests:distinct_words",
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        # the built-in engine samples on the same BF16 weights the trainer scores with: the rollout's
        # log-probs are the trainer's old ones (the FP32-rollout, autocast-trainer run: ~6e-4)
        assert r["logp_mismatch"] < 1e-5, r["logp_mismatch"]
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0.0  # the reference is BF16 like the policy
