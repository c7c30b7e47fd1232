"""SFT as an algorithm (`algorithm.name: sft`) and the validation split (`validation.*`), on the
demo shards through the CLI: losses, `val_*` rows, the goal on the validation reward, resume, and
the recipe errors."""

import json
from pathlib import Path

import pytest

from loomrl.cli import main
from loomrl.platform.recipe import RecipeError, load_recipe
from loomrl.platform.validation import pass_at, pass_at_k

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "recipes" / "demo.yaml")


@pytest.fixture(scope="module")
def shards(demo_shards):
    """The session's demo shards (conftest): demo-000000 trains, demo-000001 validates."""
    return demo_shards[0]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _sft(tmp_path, shards, out, *extra):
    return main(
        [
            "run",
            DEMO,
            "--out",
            str(tmp_path / out),
            f"data.shards={shards}/demo-000000.tar",
            "algorithm.name=sft",
            "training.warmup.steps=0",
            "training.steps=8",
            "training.mini_batches=1",
            "training.prompts_per_step=16",
            "training.lr=0.003",
            f"validation.shards={shards}/demo-000001.tar",
            "validation.samples=12",
            "validation.every=4",
            "goal.metric=val_reward_mean",
            "goal.min_final=0",
            "goal.min_gain=-1",
            "checkpoint.every=4",
            "logging.tensorboard=false",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, shards):
    """One uninterrupted SFT run, and what it printed."""
    import contextlib
    import io

    folder = tmp_path_factory.mktemp("sft")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert _sft(folder, shards, "sft") == 0
    return folder / "sft", printed.getvalue()


def test_sft_trains_answers_and_validates(tmp_path, shards, sft_run):
    run, printed = sft_run
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(8))
    assert rows[-1]["loss"] < rows[0]["loss"] and all(r["answer_tokens"] > 16 for r in rows)
    assert "reward_mean" not in rows[0]  # no rollouts, no training reward
    # validation before steps 0 and 4 (in their rows), and once more at the end (summary)
    assert [r["step"] for r in rows if "val_reward_mean" in r] == [0, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert [v["step"] for v in summary["validation"]] == [0, 4, 8]
    for v in summary["validation"]:
        assert 0.0 <= v["val_reward_mean"] <= 1.0 and 1 <= v["val_response_len"] <= 16
    assert "SFT steps       8" in printed and "validation reward: step 0" in printed and "MET" in printed
    # the goal reads the validation reward: an unreachable one is missed (exit 3)
    assert _sft(tmp_path, shards, "sft-goal", "goal.min_final=1.01", "training.steps=1") == 3


def test_sft_resumes_exactly(tmp_path, shards, sft_run):
    assert _sft(tmp_path, shards, "parts", "--max-steps", "4") == 0
    assert _sft(tmp_path, shards, "parts", "--resume") == 0
    whole, parts = _rows(sft_run[0]), _rows(tmp_path / "parts")
    assert [r["loss"] for r in whole] == [r["loss"] for r in parts]
    assert [r.get("val_reward_mean") for r in whole] == [r.get("val_reward_mean") for r in parts]


def test_validation_in_an_rl_run(tmp_path, shards):
    assert (
        main(
            [
                "run",
                DEMO,
                "--out",
                str(tmp_path / "rl"),
                f"data.shards={shards}/demo-000000.tar",
                "training.warmup.steps=0",
                "training.steps=3",
                "training.mini_batches=1",
                "training.prompts_per_step=4",
                "rollout.n=4",
                f"validation.shards={shards}/demo-000001.tar",
                "validation.samples=6",
                "validation.every=2",
                "validation.temperature=1.0",
                "validation.samples_per_prompt=4",
                "validation.pass_threshold=0.5",
                "goal=null",
                "logging.tensorboard=false",
            ]
        )
        == 0
    )
    rows = _rows(tmp_path / "rl")
    assert [r["step"] for r in rows if "val_reward_mean" in r] == [0, 2]
    assert all("reward_mean" in r for r in rows)
    for r in (r for r in rows if "val_reward_mean" in r):  # 6 prompts x 4 samples: pass@1 <= pass@4
        assert 0 <= r["val_pass@1"] <= r["val_pass@4"] <= 1 and r["val_pass@1"] * 24 == round(r["val_pass@1"] * 24)


def test_pass_at_k_is_the_unbiased_estimate():
    assert [pass_at_k(4, 1, k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]  # 1 - C(3,k)/C(4,k)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10) and pass_at_k(4, 0, 4) == 0.0
    # prompts 0 (1 of 4 right), 1 (none), 2 (all): pass@1 (0.25 + 0 + 1) / 3, pass@4 (1 + 0 + 1) / 3
    got = pass_at([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [1, 0, 0, 0.4, 0, 0, 0.9, 0, 1, 1, 1, 1], 4, 1.0)
    assert got == {"val_pass@1": pytest.approx(1.25 / 3), "val_pass@4": pytest.approx(2 / 3)}


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.name=sft", "pipeline.mode=disaggregated"], "pipeline.mode"),
        (["algorithm.name=sft", "training.warmup.steps=5"], "training.warmup.steps"),
        (["algorithm.name=sft", "training.warmup.steps=0"], "goal.metric"),  # the demo's goal reads the training reward
        (["goal.metric=val_reward_mean"], "goal.metric"),  # ... and needs a validation split
        (["validation.shards=data/{0..3.tar"], "validation.shards"),
        (["data.system_prompt=hi", "data.chat_template=none", "validation.every=0"], "validation.every"),
        (["validation.samples_per_prompt=4"], "validation.samples_per_prompt"),  # greedy: all the same
    ],
)
def test_recipe_errors_name_the_key(overrides, key):
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe(DEMO, overrides, files=False)
