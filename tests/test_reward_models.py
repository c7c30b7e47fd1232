"""Reward sources: a learned reward model (a tiny transformers sequence classifier saved to a
local folder, as a user's checkpoint would be) scores exactly what the model computes directly;
sources combine with their weights; bad sources are refused naming the key."""

import pytest
import torch

from loomrl.platform.recipe import AlgorithmConfig, RecipeError, RewardSourceConfig, load_recipe
from loomrl.platform.rewards.models import RewardModel
from loomrl.platform.rewards.sources import build_sources, score

SAMPLES = [
    {"prompt": "<image> describe the picture .", "answer": "a red shape", "meta": {}},
    {"prompt": "<audio> describe the sound .", "answer": "a high tone plays", "meta": {}},
    {"prompt": "<image> <audio> describe both .", "answer": "x", "meta": {}},
]
COMPLETIONS = ["a small red shape is shown .", "a high tone", "a large blue shape is shown while a low tone plays ."]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification

    from loomrl.platform.backbone.tokenizer import load_tokenizer

    d = tmp_path_factory.mktemp("rm")
    tok = load_tokenizer("demo")  # a word-level tokenizer (a Qwen2 config would make AutoTokenizer pick Qwen2's BPE)
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():
        model.classifier.weight.normal_(std=1.0)  # visible score differences between texts
    model.save_pretrained(d)
    tok.save_pretrained(d)
    assert list(d.glob("*.safetensors"))
    return d, model.eval(), tok


def test_reward_model_score_equals_the_models_own_score(rm_dir):
    d, model, tok = rm_dir
    rm = RewardModel(d, "cpu", batch_size=2)  # 3 completions: two batches, padding inside a batch
    got = rm.score(COMPLETIONS, SAMPLES)
    with torch.no_grad():
        direct = [
            float(model(**tok(s["prompt"], c, return_tensors="pt")).logits[0, 0]) for c, s in zip(COMPLETIONS, SAMPLES)
        ]
    assert got == pytest.approx(direct, abs=1e-5)
    assert len(set(round(x, 4) for x in got)) == 3
    alone = RewardModel(d, "cpu", with_prompt=False).score(COMPLETIONS[:1], SAMPLES[:1])
    with torch.no_grad():
        assert alone[0] == pytest.approx(
            float(model(**tok(COMPLETIONS[0], return_tensors="pt")).logits[0, 0]), abs=1e-5
        )


def test_sources_combine_with_weights_and_report_each(rm_dir):
    d, _, _ = rm_dir
    a = AlgorithmConfig(
        rewards=[
            RewardSourceConfig(fn="exact_match", weight=2.0),
            RewardSourceConfig(model=str(d), weight=-0.5, name="rm"),
        ]
    )
    sources = build_sources(a, "cpu")
    samples = [dict(SAMPLES[0], answer=COMPLETIONS[0]), SAMPLES[1]]
    total, by = score(sources, COMPLETIONS[:2], samples)
    rm = RewardModel(d).score(COMPLETIONS[:2], samples)
    assert by["exact_match"] == [1.0, 0.0]
    assert by["rm"] == pytest.approx(rm, abs=1e-6)
    assert total == pytest.approx([2.0 - 0.5 * rm[0], -0.5 * rm[1]], abs=1e-6)
    # without `rewards`, `reward` alone with weight 1
    (only,) = build_sources(AlgorithmConfig(reward="exact_match"))
    assert only.weight == 1.0 and only.score(COMPLETIONS[:1], samples[:1]) == [1.0]


def test_bad_sources_are_refused_naming_the_key(tmp_path, rm_dir):
    d, _, _ = rm_dir
    cases = [
        ("algorithm.rewards=[{weight: 1.0}]", "algorithm.rewards[0]: set exactly one of fn"),
        (f"algorithm.rewards=[{{fn: exact_match, model: {d}}}]", "algorithm.rewards[0]: set exactly one"),
        ("algorithm.rewards=[{fn: exact_match}, {fn: nope}]", "algorithm.rewards[1].fn: 'nope' is neither"),
        (f"algorithm.rewards=[{{model: {tmp_path}/missing}}]", "algorithm.rewards[0].model:"),
        ("algorithm.rewards=[{fn: exact_match}, {fn: exact_match}]", "a second source named 'exact_match'"),
        ("algorithm.rewards={fn: exact_match}", "algorithm.rewards: expected a list"),
        ("algorithm.rewards=[{fn: exact_match, wieght: 2}]", "algorithm.rewards[0].wieght: unknown key"),
    ]
    for override, needle in cases:
        with pytest.raises(RecipeError) as e:
            load_recipe("recipes/demo.yaml", [override])
        assert needle in str(e.value), override
    r = load_recipe("recipes/demo.yaml", [f"algorithm.rewards=[{{fn: slot_match}}, {{model: {d}, weight: 0.1}}]"])
    assert r.algorithm.rewards[1].weight == 0.1 and r.algorithm.rewards[1].model == str(d)


def test_reward_model_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        RewardModel(tmp_path)


def test_run_with_a_reward_model_reports_each_source(tmp_path, rm_dir, demo_shards):
    import json
    from pathlib import Path

    from loomrl.cli import main

    d, _, _ = rm_dir
    shards, _ = demo_shards
    root = Path(__file__).resolve().parent.parent
    assert (
        main(
            [
                "run",
                str(root / "recipes" / "demo.yaml"),
                "--out",
                str(tmp_path / "run"),
                f"data.shards={shards}/demo-*.tar",
                "training.steps=2",
                "training.warmup.steps=0",
                "training.mini_batches=1",
                "training.prompts_per_step=2",
                "rollout.n=2",
                "goal=null",
                "logging.tensorboard=false",
                "rollout.drafter.compare_every=0",
                "training.threads=1",
                f"algorithm.rewards=[{{fn: 'rewards_for_tests:distinct_words', name: words}}, "
                f"{{model: '{d}', weight: 0.5, name: rm}}]",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["reward_words_mean"] > 0 and r["reward_rm_mean"] != 0
        assert r["reward_mean"] == pytest.approx(r["reward_words_mean"] + 0.5 * r["reward_rm_mean"], abs=1e-6)
