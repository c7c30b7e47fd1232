"""DeepSpeed ZeRO-2 and ZeRO-3 with 2 processes (gloo) against the torch engine, and exact
resume; one torchrun launch (tests/engines_worker.py) for all of them."""

import importlib.util

import pytest
from _engine_runs import assert_bf16_matches, assert_frozen_and_checkpointed, assert_matches, run_worker

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed (optional dependency) is not installed"
)


@pytest.fixture(scope="module")
def results(demo_shards, tmp_path_factory):
    shard_dir, _ = demo_shards
    return run_worker("deepspeed", shard_dir, tmp_path_factory.mktemp("ds") / "out.json")


def test_training_moves_the_loss(results):
    losses = [r["loss"] for r in results["torch"]]
    assert len(set(losses)) == len(losses)  # a test that compares constants would prove nothing


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_matches_torch_engine(results, stage):
    # Tolerance: fp32, reductions in another order (2 ranks, flat buckets): |dloss| <= 1e-6,
    # grad norm and mismatch within 1e-5 relative (measured: ~6e-8 and ~1e-6).
    assert_matches(results["torch"], results[stage], loss_atol=1e-6, rel=1e-5)
    assert results[stage + "_weights_maxdiff"] < 1e-3  # exported full weights after 4 AdamW steps


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_resume_is_exact(results, stage):
    assert results[stage + "_resumed"] == results[stage]


def test_ranks_compare_their_rollouts(results):
    # the runner's per-step check, all-gathered between the 2 real ranks: equal trajectories
    # pass, one different completion token on rank 1 stops both ranks naming the step
    agreement = results["agreement"]
    assert agreement["same_checked"] == 1 and agreement["differing_refused"] == 1, agreement
    assert "rank(s) [1]" in agreement["error"]


def test_is_ratio_max_is_the_largest_over_ranks(results):
    assert results["max_over_ranks"] == 1.5  # rank 0 held 0.5, rank 1 held 1.5


def test_frozen_parts_and_activation_checkpointing(results):
    # ZeRO-3 with training.freeze and activation checkpointing
    assert_frozen_and_checkpointed(results, "zero3_memory")


def test_zero2_bf16_params_matches_the_torch_engine(results):
    """training.precision bf16_params under DeepSpeed: its BF16 module, FP32 masters in the ZeRO-2
    partitions, each micro-batch's gradient accumulated in FP32 (data_types.grad_accum_dtype)."""
    assert_bf16_matches(results, "zero2_bf16")
    assert results["zero2_bf16_accum"] == "torch.float32"  # bfloat16 without grad_accum_dtype
