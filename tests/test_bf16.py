"""BF16 mixed precision of the torch engine (`training.precision: bf16`): FP32 master weights
and optimizer state, forwards under BF16 autocast with an FP32 log-softmax and loss, a loss and
gradients close to FP32's on the same batch, a short CLI run, and the engine combinations the
recipe refuses."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from loomrl.cli import main
from loomrl.platform.algorithms.losses import sft_loss
from loomrl.platform.engines.torch_engine import TorchTrainEngine, autocast
from loomrl.platform.recipe import RecipeError, TrainingConfig, load_recipe
from loomrl.platform.trajectory.batch import Trajectory, micro_batches

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def batch(model, samples, tokenizer):
    """Two micro-batches of 3 rows each (image, audio and both media): the prompt, then a target sentence."""
    trajs = []
    for i, s in enumerate(samples[:6]):
        ids = tokenizer(f"a red circle and tone {i}", add_special_tokens=False)["input_ids"] + [model.eos_token_id]
        trajs.append(Trajectory(s.id, 0, s.ids, ids, s.media, [0.0] * len(ids), 0.0, 0))
    return micro_batches(trajs, model.pad_token_id, 3)


def loss_and_grad(model, mbs, precision):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        with autocast(precision, model):
            loss, _ = sft_loss(model, mb)
        assert loss.dtype == torch.float32
        loss.backward()
        total += float(loss.detach())
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return total, grad


def test_token_logprobs_upcast_bf16_logits_to_fp32(model):
    logits = torch.tensor(
        [[1.0, 2.0, 3.5, -1.0] + [0.0] * (model.language_model.cfg.vocab_size - 4)], dtype=torch.bfloat16
    )
    logp = model.token_logprobs(logits, 1.0)
    assert logp.dtype == torch.float32
    expected = logits.float().index_fill(-1, model.banned_token_ids, float("-inf")).log_softmax(-1)
    torch.testing.assert_close(logp, expected, rtol=0, atol=0)


def test_autocast_runs_the_decoder_matmuls_in_bf16(model, batch):
    mb = batch[0]
    seen = []
    hook = model.language_model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    with torch.no_grad():
        with autocast("bf16", model):
            logp, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
        fp32, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
    hook.remove()
    assert seen == [torch.bfloat16, torch.float32]  # the LM head's matmul ran in BF16 under autocast only
    assert logp.dtype == torch.float32
    assert not torch.equal(logp, fp32)  # BF16 arithmetic changed the numbers ...
    mask = mb.loss_mask.bool()
    assert float((logp - fp32)[mask].abs().max()) < 0.05  # ... by BF16 rounding, not more
    with autocast("fp32", model), torch.no_grad():
        again, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
    assert torch.equal(again, fp32)  # fp32 is no context at all
    with pytest.raises(ValueError, match="training.precision"):
        autocast("fp16", model)


def test_bf16_loss_and_gradients_close_to_fp32(model, batch):
    l32, g32 = loss_and_grad(model, batch, "fp32")
    l16, g16 = loss_and_grad(model, batch, "bf16")
    assert math.isfinite(l16) and l16 != l32  # BF16 really ran
    assert abs(l16 - l32) / abs(l32) < 2e-2
    assert torch.isfinite(g16).all() and g16.dtype == torch.float32
    assert float(torch.nn.functional.cosine_similarity(g32, g16, dim=0)) > 0.99
    assert not torch.equal(g16, g32)


def test_bf16_step_updates_fp32_master_weights_and_fp32_optimizer_state(model, batch):
    fp32 = copy.deepcopy(model)  # the same weights, for the same step in FP32
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = TorchTrainEngine(model, TrainingConfig(precision="bf16", lr=1e-3))
    stats = engine.train_mini_batch(batch, sft_loss)
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    changed = 0
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, n
        changed += not torch.equal(p.detach(), before[n])
    assert changed > len(before) // 2  # the update reached the FP32 weights (not a BF16 copy)
    state = engine.optimizer.state_dict()["state"]
    assert state and all(
        v.dtype == torch.float32 for s in state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
    )
    # the same step in FP32 moves the same weights nearly the same way
    TorchTrainEngine(fp32, TrainingConfig(precision="fp32", lr=1e-3)).train_mini_batch(batch, sft_loss)
    step16 = torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters()])
    step32 = torch.cat([(p.detach() - before[n]).flatten() for n, p in fp32.named_parameters()])
    assert float(torch.nn.functional.cosine_similarity(step16, step32, dim=0)) > 0.9


@pytest.mark.parametrize("frozen", ["true", "false"])
def test_short_bf16_run_through_the_cli(tmp_path, capsys, frozen):
    """`frozen`: frozen towers' encodings are cached across steps; one made without autocast (the
    rollout's) must not serve the autocast forwards, or the step-0 KL is not 0."""
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
            "training.precision=bf16",
            "training.warmup.steps=2",
            "training.warmup.batch_size=4",
            "training.steps=3",
            "training.mini_batches=1",
            "training.prompts_per_step=4",
            "rollout.n=4",
            "goal=null",
            "logging.tensorboard=false",
            "logging.progress=false",
            "algorithm.kl_coef=0.01",
            "algorithm.reward=rewards_for_tests:distinct_words",
            f"model.encoders.frozen={frozen}",
        ]
    )  # a reward that varies from the start
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        # FP32 rollouts vs the BF16 trainer forward: a mismatch of BF16's size (measured ~6e-4;
        # the same run in FP32 gives ~5e-8)
        assert 1e-5 < r["logp_mismatch"] < 0.05
    # the reference log-probs run under the same autocast as the loss: before the first RL update
    # the policy is the reference, so the KL is exactly 0 (an FP32 reference would give > 0)
    assert rows[0]["kl"] == 0.0
    assert rows[-1]["kl"] > 0.0
    warm = [json.loads(line) for line in (out / "warmup.jsonl").read_text().splitlines()]
    assert len(warm) == 2 and all(math.isfinite(w["loss"]) for w in warm)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["training.engine=deepspeed"], "training.precision: bf16 with training.engine=deepspeed"),
        (["training.engine=megatron"], "training.precision: training.engine=megatron has no autocast"),
    ],
)
def test_engine_combinations_are_refused_naming_the_key(overrides, needle):
    with pytest.raises(RecipeError) as e:
        load_recipe("recipes/demo.yaml", ["training.precision=bf16", *overrides])
    assert needle in str(e.value)


def test_accepted_combinations_and_bad_values():
    r = load_recipe(
        "recipes/demo.yaml", ["training.precision=bf16", "training.engine=deepspeed", "training.deepspeed.bf16=true"]
    )
    assert r.training.precision == "bf16" and r.training.deepspeed.bf16
    assert load_recipe("recipes/demo.yaml", ["training.engine=megatron"]).training.precision == "fp32"
    with pytest.raises(RecipeError, match="training.precision: 'fp16' is not allowed"):
        load_recipe("recipes/demo.yaml", ["training.precision=fp16"])


def test_activation_checkpointing_recomputes_under_the_same_autocast():
    """The checkpointed backward re-runs each layer in BF16 as its forward did: same gradients, bit for bit."""
    from loomrl.platform.backbone.decoder import Decoder, DecoderConfig

    torch.manual_seed(0)
    decoder = Decoder(DecoderConfig(vocab_size=50, num_layers=2)).train()
    x = torch.randn(2, 7, 64)
    positions, keys = torch.arange(7)[None].expand(2, -1), torch.ones(2, 7, dtype=torch.bool)

    def grads(checkpointing: bool) -> torch.Tensor:
        decoder.zero_grad(set_to_none=True)
        decoder.activation_checkpointing = checkpointing
        with autocast("bf16", decoder):
            logits, _ = decoder(x, positions, keys)
        assert logits.dtype == torch.bfloat16
        logits.float().log_softmax(-1)[..., 3].sum().backward()
        return torch.cat([p.grad.flatten() for p in decoder.parameters()])

    plain, recomputed = grads(False), grads(True)
    assert torch.equal(plain, recomputed) and plain.abs().sum() > 0
