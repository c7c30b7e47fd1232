"""`loomrl plan`: per-rank memory of a recipe by kind. Parameter counts are checked against the
models themselves (transformers' Qwen2.5-VL built from the shipped config on the meta device, loomrl's
demo policy, a tiny exported Qwen2-VL checkpoint); bytes against figures computed here by hand from
the config's sizes. Exit codes: 0 fits, 3 does not fit, 2 an error."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from loomrl.cli import main
from loomrl.commands.plan import PlanError, make_plan
from loomrl.platform import recipe as R
from loomrl.platform.backbone.hf_io import decoder_config
from loomrl.platform.engines.base import TRAINING_ENGINES
from loomrl.platform.memory import MemoryTerm, TrainingMemory

ROOT = Path(__file__).resolve().parents[1]
ZERO3 = str(ROOT / "recipes/qwen2.5-vl-3b-grpo-zero3.yaml")
MEGATRON = str(ROOT / "recipes/qwen2.5-vl-3b-grpo-megatron-tp2.yaml")
# the hand-computed cases below: 8 sequences per micro-batch, every activation stored
STORED = ["training.micro_batch_size=8", "training.activation_checkpointing=false"]
SHIPPED = ROOT / "recipes/models/Qwen2.5-VL-3B-Instruct"
GIB = 1 << 30
# Qwen2.5-VL-3B's language model, as the brief of the shipped config gives it
H, L, A, KV, I, V = 2048, 36, 16, 2, 11008, 151936  # noqa: E741 (the brief's names)
D = H // A


@pytest.fixture(scope="module")
def hf_counts():
    """(total, vision tower, its merger) parameters of transformers' Qwen2.5-VL from the shipped config,
    on the meta device."""
    config = transformers.Qwen2_5_VLConfig.from_pretrained(SHIPPED)
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    return (
        sum(p.numel() for p in model.parameters()),
        sum(p.numel() for p in model.model.visual.parameters()),
        sum(p.numel() for p in model.model.visual.merger.parameters()),
    )


def _plan(capsys, *argv, code=None):
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    data = json.loads(out.strip().splitlines()[-1])  # the JSON object is the last line
    assert rc == (0 if data["fits"] else 3)
    if code is not None:
        assert rc == code
    assert data["per_rank_bytes"]["total"] == sum(v for k, v in data["per_rank_bytes"].items() if k != "total")
    assert data["headroom_bytes"] == data["gpu_memory_bytes"] - data["per_rank_bytes"]["total"]
    assert data["fits"] == (data["headroom_bytes"] >= 0)
    return data, out


def _layer_bytes(s, b, tp=1, scores=True):
    """Korthikanti et al. 2022, 16-bit bytes of one decoder layer's activations."""
    return s * b * H * (10 + 24 / tp + (5 * A * s / (H * tp) if scores else 0))


def test_shipped_config_is_qwen25_vl_3b():
    cfg = transformers.Qwen2_5_VLConfig.from_pretrained(SHIPPED)
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (H, L, A, KV)
    assert (t.intermediate_size, t.vocab_size, t.max_position_embeddings, t.rms_norm_eps) == (I, V, 128000, 1e-6)
    assert t.rope_parameters["rope_theta"] == 1e6 and t.rope_parameters["mrope_section"] == [16, 24, 24]
    assert cfg.tie_word_embeddings is True
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.out_hidden_size) == (32, 1280, 3420, 16, H)
    assert (v.patch_size, v.spatial_merge_size, v.temporal_patch_size, v.window_size) == (14, 2, 2, 112)
    assert (v.fullatt_block_indexes, v.in_channels, v.tokens_per_second) == ([7, 15, 23, 31], 3, 2)
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (
        151655,
        151656,
        151652,
        151653,
    )
    assert (t.bos_token_id, t.eos_token_id) == (151643, 151645)
    raw = json.loads((SHIPPED / "config.json").read_text())
    assert "text_config" in raw and "vision_config" in raw  # transformers 5.19's layout
    d = decoder_config(raw, "config.json")
    assert (d.hidden_size, d.num_layers, d.vocab_size, d.tie_word_embeddings) == (H, L, V, True)
    assert not list(SHIPPED.glob("*.safetensors")) and "no weights" in (SHIPPED / "README.md").read_text()


def test_zero3_recipe(capsys, hf_counts):
    total, visual, _ = hf_counts
    data, out = _plan(capsys, ZERO3, *STORED)
    assert data["params_total"] == total and data["params_trainable"] == total
    assert data["params_towers"] == visual and data["params_language_model"] == total - visual
    assert (data["engine"], data["ranks"]) == ("deepspeed", {"world": 8, "dp": 8, "tp": 1})
    b = data["per_rank_bytes"]
    assert b["weights"] == 2 * total / 8  # bf16, ZeRO-3 over 8 ranks
    assert b["gradients"] == 2 * total / 8
    assert b["optimizer"] == 12 * total / 8  # fp32 master + 2 moments, ZeRO-1+
    assert b["rollout"] == 2 * (total - visual) + 1 * GIB  # vLLM bf16 language model + kv_cache_gib
    assert b["policy_copy"] == 4 * total
    s, mb = 4096, 8  # rollout.vllm.max_model_len, training.micro_batch_size
    assert b["activations"] == pytest.approx(L * _layer_bytes(s, mb) + (2 + 4) * s * mb * V, rel=1e-9)
    assert set(b) == {"weights", "gradients", "optimizer", "activations", "rollout", "policy_copy", "total"}
    assert "GiB/rank" in out and "Qwen2.5-VL-3B-Instruct/config.json" in out


def test_megatron_tp2_halves_the_language_models_linear_weights(capsys, hf_counts):
    total, _, _ = hf_counts
    data, _ = _plan(capsys, MEGATRON, *STORED)
    assert (data["engine"], data["ranks"]) == ("megatron", {"world": 8, "dp": 4, "tp": 2})
    # TP-sharded: the (tied) embedding, q/k/v (with biases), o, gate/up/down of every layer
    per_layer = 2 * H * H + H + 2 * (H * KV * D + KV * D) + 3 * H * I
    sharded = V * H + L * per_layer
    local = total - sharded + sharded // 2
    b = data["per_rank_bytes"]
    assert b["weights"] == 4 * local  # the Megatron engine trains fp32 parameters
    assert b["gradients"] == 4 * local and b["optimizer"] == 8 * local  # AdamW's 2 moments, no DP sharding
    s, mb = 4096, 8
    assert b["activations"] == pytest.approx(2 * L * _layer_bytes(s, mb, tp=2) + (4 + 4) * s * mb * V, rel=1e-9)


def test_megatron_bf16_params_counts_bf16_weights_fp32_masters_and_a_bf16_policy_copy(capsys, hf_counts):
    total, _, _ = hf_counts
    fp32, _ = _plan(capsys, MEGATRON, *STORED)
    data, out = _plan(capsys, MEGATRON, *STORED, "training.precision=bf16_params")
    b, f = data["per_rank_bytes"], fp32["per_rank_bytes"]
    local = f["weights"] // 4
    assert b["weights"] == 2 * local and b["gradients"] == 2 * local  # the BF16 shards and their gradients
    assert b["optimizer"] == 16 * local  # FP32 master, its FP32 main grad, AdamW's 2 moments
    assert f["policy_copy"] == 4 * total and b["policy_copy"] == 2 * total  # the trainer's copy is BF16 too
    assert "bfloat16 policy" in out


def test_nodes_times_gpus_per_node_is_the_world(capsys, hf_counts):
    """`--nodes 2 --gpus-per-node 8`: 16 ranks, so ZeRO-3 shards the weights and optimizer 16 ways."""
    total, _, _ = hf_counts
    data, out = _plan(capsys, ZERO3, *STORED, "--nodes", "2", "--gpus-per-node", "8")
    assert data["ranks"] == {"world": 16, "dp": 16, "tp": 1, "nodes": 2, "gpus_per_node": 8}
    assert data["per_rank_bytes"]["optimizer"] == 12 * total / 16 and "16 rank(s)" in out
    assert main(["plan", ZERO3, "--nodes", "2"]) == 2  # the two go together
    assert "--nodes and --gpus-per-node go together" in capsys.readouterr().err


FSDP2_7B = str(ROOT / "recipes/qwen2.5-vl-7b-grpo-fsdp2.yaml")


def test_a_7b_class_config_fits_8x80_gib_with_fsdp2_and_colocated_vllm(capsys):
    """The shipped Qwen2.5-VL-7B config: transformers' count on the meta device (8.29B, as published), and
    the FSDP2 + colocated vLLM recipe fits one 8x80 GiB node at its micro-batch of 1; at 4 it does not
    (the float32 policy copy the rollouts read is the largest term)."""
    config = transformers.Qwen2_5_VLConfig.from_pretrained(ROOT / "recipes/models/Qwen2.5-VL-7B-Instruct")
    with torch.device("meta"):
        total = sum(p.numel() for p in transformers.Qwen2_5_VLForConditionalGeneration(config).parameters())
    assert total == 8_292_166_656
    data, out = _plan(capsys, FSDP2_7B, code=0)
    assert data["params_total"] == total and data["engine"] == "fsdp2" and data["ranks"]["world"] == 8
    assert data["per_rank_bytes"]["optimizer"] == 8 * total / 8  # two fp32 moments, sharded 8 ways
    data, _ = _plan(capsys, FSDP2_7B, "training.micro_batch_size=4", code=3)
    assert max(data["per_rank_bytes"].items(), key=lambda kv: kv[1] if kv[0] != "total" else 0)[0] == "policy_copy"


@pytest.mark.parametrize("gib, code", [(1, 3), (100000, 0)])
def test_gpu_memory_decides_whether_it_fits(capsys, gib, code):
    data, out = _plan(capsys, ZERO3, *STORED, "--gpu-memory", str(gib), code=code)
    assert data["gpu_memory_bytes"] == gib * GIB and data["fits"] is (code == 0)
    assert ("does NOT fit" in out) is (code == 3)


def test_frozen_towers_offloaded_optimizer_and_fused_attention(capsys, hf_counts):
    total, visual, _ = hf_counts
    data, _ = _plan(
        capsys,
        ZERO3,
        *STORED,
        "model.encoders.frozen=true",
        "training.deepspeed.offload_optimizer=true",
        "training.micro_batch_size=1",
        "--fused-attention",
    )
    trainable = total - visual
    assert data["params_trainable"] == trainable
    b = data["per_rank_bytes"]
    assert b["weights"] == 2 * total / 8 and b["gradients"] == 2 * trainable / 8
    assert b["optimizer"] == 0 and data["cpu_bytes"] == 12 * trainable / 8
    s = 4096
    assert b["activations"] == pytest.approx(L * _layer_bytes(s, 1, scores=False) + 6 * s * V, rel=1e-9)
    assert data["activations_bytes"]["attention_scores"] == 0


def test_keys_a_recipe_may_gain_later(hf_counts):
    """activation_checkpointing, model.lora, training.freeze: read where a recipe has them."""
    total, visual, merger = hf_counts
    recipe = R.load_recipe(ZERO3, STORED, files=False)
    recipe.training.activation_checkpointing = True
    recipe.model.lora = SimpleNamespace(rank=8)
    p = make_plan(recipe, ZERO3).to_json()
    lora = 8 * L * ((H + H) + 2 * (H + KV * D) + (H + H) + 3 * (H + I))  # q, k, v, o, gate, up, down
    # the language model's own weights freeze; the adapters, the (tied) embedding and the towers train
    trained = lora + visual + V * H
    assert p["params_lora"] == lora and p["params_trainable"] == trained and p["params_total"] == total
    b = p["per_rank_bytes"]
    assert b["optimizer"] == -(-12 * trained // 8) and b["weights"] == -(-2 * (total + lora) // 8)
    s, mb = 4096, 8
    layers = L * 2 * s * mb * H + _layer_bytes(s, mb)  # each layer's input + one layer recomputed
    assert p["activations_bytes"]["layers"] == pytest.approx(layers, rel=1e-9)
    recipe = R.load_recipe(ZERO3, STORED, files=False)
    recipe.training.freeze = ["vision", "embeddings"]  # the tower less its merger; the tied embedding / head
    p = make_plan(recipe, ZERO3).to_json()
    assert p["params_trainable"] == total - (visual - merger) - V * H
    recipe.training.freeze = ["language_model.model.layers.0"]  # a parameter-name pattern
    per_layer = 2 * H * H + H + 2 * (H * KV * D + KV * D) + 3 * H * I + 2 * H  # linears + 2 norms
    assert make_plan(recipe, ZERO3).to_json()["params_trainable"] == total - per_layer


def test_demo_recipe_counts_loomrls_policy(capsys, tokenizer):
    from loomrl.platform.backbone.vlm import build_policy

    recipe = R.load_recipe(ROOT / "recipes/demo.yaml", files=False)
    policy = build_policy(recipe.model, tokenizer, seed=0)
    n = sum(p.numel() for p in policy.parameters())
    assert recipe.model.encoders.frozen  # the demo's towers (and the vision merger) do not train
    t = n - sum(p.numel() for m in (policy.visual, policy.audio_tower) for p in m.parameters())
    data, _ = _plan(capsys, str(ROOT / "recipes/demo.yaml"))
    assert data["params_total"] == n and data["params_trainable"] == t < n
    assert (data["engine"], data["ranks"]) == ("torch", {"world": 1, "dp": 1, "tp": 1})
    b = data["per_rank_bytes"]
    assert b["weights"] == 4 * n and b["gradients"] == 4 * t and b["optimizer"] == 8 * t  # fp32, AdamW
    assert "policy_copy" not in b
    # the built-in engine's KV cache: 32 prompts x 8 samples, 2 layers, 2 kv heads of 64 / 2
    assert b["rollout"] == 2 * 2 * 2 * 32 * (512 + 16) * (32 * 8) * 4


def test_a_checkpoint_folder_on_this_machine(tmp_path, capsys, tokenizer):
    from loomrl.platform.backbone.hf_io import export_policy
    from loomrl.platform.backbone.vlm import build_policy

    folder = export_policy(build_policy(R.ModelConfig(), tokenizer, seed=1), tmp_path / "tiny-vl", "image")
    loaded = build_policy(R.ModelConfig(init_from=str(folder)), tokenizer, seed=0)
    n = sum(p.numel() for p in loaded.parameters())
    data, _ = _plan(capsys, str(ROOT / "recipes/demo.yaml"), f"model.init_from={folder}", "model.num_heads=4")
    assert data["model_type"] == "qwen2_vl" and data["params_total"] == n
    assert data["params_towers"] == sum(p.numel() for p in loaded.visual.parameters())


def test_errors_name_the_key_or_file(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodel: {init_from: /nowhere/Some-Model-1B}\n")
    assert main(["plan", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "/nowhere/Some-Model-1B/config.json" in err and "recipes/models/Some-Model-1B/config.json" in err
    assert main(["plan", ZERO3, "model.intermediate_size=4096"]) == 2  # disagrees with the shipped config
    err = capsys.readouterr().err
    assert "model.intermediate_size" in err and "11008" in err
    with pytest.raises(SystemExit):
        main(["plan", ZERO3, "--gpu-memory", "-3"])


@pytest.fixture()
def halves_engine():
    """A training engine added by one registration, its memory model with it (docs/extending.md), removed after."""

    def memory(sizes, prec, training, *, dp, tp):
        half = MemoryTerm(sizes.params * prec.weight // 2, f"{sizes.params:,} params x {prec.weight} B / 2")
        return TrainingMemory(
            weights=half, gradients=half, optimizer=half, cpu_bytes=0, desc="halves", policy_copy=True
        )

    @TRAINING_ENGINES.register("halves", memory=memory, tensor_parallel=lambda training: 2)
    class Halves:
        pass

    @TRAINING_ENGINES.register("forgetful")
    class Forgetful:
        pass

    yield
    TRAINING_ENGINES._entries.pop("halves")
    TRAINING_ENGINES._entries.pop("forgetful")


def test_a_new_training_engine_brings_its_memory_model(halves_engine):
    """The plan reads the engine's traits, not its name: its `memory`, its `tensor_parallel`."""
    demo = ROOT / "recipes/demo.yaml"
    plan = make_plan(R.load_recipe(demo, ["training.engine=halves", "training.nproc=4"], files=False), demo)
    p, n = plan.to_json(), plan.counts.total
    assert p["ranks"] == {"world": 4, "dp": 2, "tp": 2} and plan.engine_desc == "halves, fp32"
    assert p["per_rank_bytes"]["weights"] == 4 * n // 2 and plan.how["weights"] == f"{n:,} params x 4 B / 2"
    assert p["per_rank_bytes"]["policy_copy"] == 4 * n  # the trainer's copy beside the engine's
    with pytest.raises(PlanError, match="training.engine: the training engine 'forgetful' has no `memory` trait"):
        make_plan(R.load_recipe(demo, ["training.engine=forgetful"], files=False), demo)


def test_qwen3_vl_4b_counts_what_transformers_builds(capsys):
    """The shipped Qwen3-VL-4B config (head width 128, not hidden / heads = 80; DeepStack mergers): the
    plan's parameters are transformers' count on the meta device (4.44B, as published), its KV cache
    is sized by the real head width, and the DeepStack mergers count as the merger."""
    config = transformers.Qwen3VLConfig.from_pretrained(ROOT / "recipes/models/Qwen3-VL-4B-Instruct")
    with torch.device("meta"):
        hf = transformers.Qwen3VLForConditionalGeneration(config)
    total = sum(p.numel() for p in hf.parameters())
    assert total == 4_437_815_808
    recipe = str(ROOT / "recipes/qwen3-vl-4b-grpo-fsdp2.yaml")
    data, out = _plan(capsys, recipe, code=0)
    assert data["params_total"] == total and data["engine"] == "fsdp2"
    _, out = _plan(capsys, recipe, "rollout.engine=torch", code=0)
    assert "8 kv heads x 128 x" in out  # the built-in engine's KV cache: head width 128, not 80
    data, _ = _plan(capsys, recipe, "training.freeze=[merger]", code=0)
    mergers = sum(p.numel() for n, p in hf.named_parameters() if ".merger." in n or "deepstack_merger_list" in n)
    assert data["params_trainable"] == total - mergers
