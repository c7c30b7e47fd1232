"""Megatron-core: HF <-> Megatron weight conversion, and (one torchrun launch, 2 processes)
TP=2 and TP=1 x DP=2 against the torch engine, with exact resume."""

import importlib.util

import pytest
import torch
from _engine_runs import assert_bf16_matches, assert_frozen_and_checkpointed, assert_matches, run_worker

from loomrl.platform.backbone.decoder import Decoder, DecoderConfig
from loomrl.platform.engines.base import check_rank_agreement, compare_digests, trajectory_digest
from loomrl.platform.engines.megatron_convert import Dims, hf_to_megatron, megatron_to_hf

needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core (optional dependency) is not installed"
)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_conversion_round_trips_exactly(tp, tied):
    cfg = DecoderConfig(
        vocab_size=37,
        hidden_size=32,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=48,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    hf = Decoder(cfg).state_dict()
    for v in hf.values():
        v.normal_()
    dims = Dims.of(cfg)
    shards = [hf_to_megatron(hf, dims, r, tp) for r in range(tp)]
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] * tp >= cfg.vocab_size
    back = megatron_to_hf(shards, dims)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    # the fused layouts are not the identity: q rows of group 0 come before k of group 0
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = cfg.head_dim
    rep = cfg.num_heads // cfg.num_kv_heads
    assert torch.equal(qkv[rep * d : (rep + 1) * d], hf["model.layers.0.self_attn.k_proj.weight"][:d])


def test_conversion_refuses_a_tp_size_that_does_not_divide_the_heads():
    cfg = DecoderConfig(vocab_size=10, hidden_size=32, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="tensor_parallel=4"):
        hf_to_megatron(Decoder(cfg).state_dict(), Dims.of(cfg), 0, 4)


@pytest.fixture(scope="module")
def results(demo_shards, tmp_path_factory):
    shard_dir, _ = demo_shards
    return run_worker("megatron", shard_dir, tmp_path_factory.mktemp("mg") / "out.json")


@needs_megatron
@pytest.mark.parametrize("layout", ["tp2", "tp1"])
def test_megatron_matches_torch_engine(results, layout):
    # tp2: 2 tensor-parallel ranks; tp1: 2 data-parallel replicas. Tolerance as for DeepSpeed:
    # |dloss| <= 1e-6, grad norm and mismatch within 1e-5 relative (measured ~3e-8 and ~1e-6).
    assert_matches(results["torch"], results[layout], loss_atol=1e-6, rel=1e-5)
    assert results[layout + "_weights_maxdiff"] < 1e-3  # exported HF-layout weights


@needs_megatron
def test_tp2_matches_tp1(results):
    assert_matches(results["tp1"], results["tp2"], loss_atol=1e-6, rel=1e-5)


@needs_megatron
@pytest.mark.parametrize("layout", ["tp2", "tp1"])
def test_megatron_resume_is_exact(results, layout):
    assert results[layout + "_resumed"] == results[layout]


def _traj(prompt, completion, reward):
    from loomrl.platform.trajectory.batch import Trajectory

    return Trajectory("p", 0, prompt, completion, [], [0.0] * len(completion), reward, 0)


def test_trajectory_digest_sees_ids_rewards_and_order():
    base = [_traj([1, 2], [3, 4], 1.0), _traj([1, 2], [5], 0.0)]
    d = trajectory_digest(base)
    assert d == trajectory_digest([_traj([1, 2], [3, 4], 1.0), _traj([1, 2], [5], 0.0)])
    assert d != trajectory_digest([_traj([1, 2], [3, 4], 1.0), _traj([1, 2], [6], 0.0)])  # a token
    assert d != trajectory_digest([_traj([1, 2], [3, 4], 1.0), _traj([1, 2], [5], 1e-9)])  # a reward
    assert d != trajectory_digest([_traj([1, 2], [3], 1.0), _traj([4, 1, 2], [5], 0.0)])  # where ids split
    assert d != trajectory_digest(base[::-1])
    assert -(2**63) <= d < 2**63  # fits the int64 tensor the ranks all-gather


def test_compare_digests_names_the_step_and_the_ranks():
    compare_digests(3, [5, 5, 5])
    with pytest.raises(RuntimeError, match=r"RL step 3: rank\(s\) \[2\] generated other rollouts"):
        compare_digests(3, [5, 5, 6])


def test_single_process_skips_the_rank_check():
    assert check_rank_agreement(0, [_traj([1], [2], 0.0)]) is False


@needs_megatron
def test_frozen_parts_and_activation_checkpointing(results):
    # TP 2 with training.freeze and activation checkpointing
    assert_frozen_and_checkpointed(results, "tp2_memory")


@needs_megatron
def test_tp2_bf16_params_matches_the_torch_engine(results):
    """training.precision bf16_params under Megatron (its --bf16): BF16 TP=2 shards, FP32 masters and
    main grads, clipped over the FP32 main grads."""
    assert_bf16_matches(results, "tp2_bf16")
