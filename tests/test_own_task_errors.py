"""What a user's own task gets wrong is named before training or stops the run cleanly: a reward
that returns garbage, a validation split without the answers its reward reads, a broken chat
template at `--dry-run`; VQA answer lists and grounding boxes in manifests reach the rewards."""

import json
from pathlib import Path

import pytest

from loomrl.cli import main
from loomrl.platform.rewards import build_reward

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "recipes" / "demo.yaml")


@pytest.fixture(scope="module")
def shards(demo_shards):
    """The session's demo shards (conftest): demo-000000 trains, demo-000001 validates."""
    return demo_shards[0]


def _demo(tmp_path, shards, out, *extra):
    return main(
        [
            "run",
            DEMO,
            "--out",
            str(tmp_path / out),
            f"data.shards={shards}/demo-000000.tar",
            "training.warmup.steps=0",
            "training.steps=3",
            "training.mini_batches=1",
            "training.prompts_per_step=2",
            "rollout.n=2",
            "goal=null",
            "logging.tensorboard=false",
            *extra,
        ]
    )


def test_a_reward_returning_nan_stops_the_run_with_a_checkpoint(tmp_path, shards, capsys, monkeypatch):
    (tmp_path / "bad_reward.py").write_text(
        "import math\ncalls = []\n\ndef reward(completion, sample):\n"
        "    calls.append(1)\n    return 0.5 if len(calls) <= 4 else math.nan\n"
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        (ROOT / "recipes" / "demo.yaml").read_text().replace("reward: slot_match", "reward: bad_reward:reward")
    )
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "run",
            str(recipe),
            "--out",
            "run",
            f"data.shards={shards}/demo-000000.tar",
            "training.warmup.steps=0",
            "training.steps=3",
            "training.mini_batches=1",
            "training.prompts_per_step=2",
            "rollout.n=2",
            "goal=null",
            "logging.tensorboard=false",
        ]
    )
    assert code == 2
    err = capsys.readouterr()
    assert "reward 'reward' on sample" in err.out and "not a finite number" in err.out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and "not a finite number" in summary["error"]
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()  # the last whole step, resumable
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and rows[0]["reward_mean"] == 0.5


def test_a_validation_split_without_answers_is_refused_before_training(tmp_path, shards, capsys):
    from PIL import Image

    (tmp_path / "img").mkdir()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "img" / "red.png")
    (tmp_path / "val.jsonl").write_text(
        json.dumps({"question": "describe the picture .", "image": "img/red.png"}) + "\n"
    )
    assert main(["shards", "make", str(tmp_path / "val.jsonl"), "--out", str(tmp_path / "val" / "v-%06d.tar")]) == 0
    code = _demo(tmp_path, shards, "run", "algorithm.reward=exact", f"validation.shards={tmp_path}/val/v-*.tar")
    assert code == 2
    err = capsys.readouterr().err
    assert "validation.shards" in err and "has no answer" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_dry_run_renders_the_chat_template(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] | nosuchfilter }}{% endfor %}")
    assert main(["run", DEMO, "--dry-run", f"data.chat_template={broken}"]) == 2
    assert main(["run", DEMO, "--dry-run", "data.chat_template=none", "data.system_prompt=hi"]) == 2
    assert main(["run", DEMO, "--dry-run"]) == 0


def test_answer_lists_and_boxes_reach_the_rewards(tmp_path):
    from loomrl.datasets.manifest import parse_line

    entry = parse_line(
        json.dumps({"id": "a", "prompt": "where ?", "answer": [10, 20, 30, 40]}).encode(), "m:1", str(tmp_path)
    )
    assert entry.answer == "[10, 20, 30, 40]"
    assert build_reward("iou")("[10, 20, 30, 40]", {"id": "a", "answer": entry.answer}) == 1.0
    assert build_reward("iou")("[10, 20, 20, 40]", {"id": "a", "answer": entry.answer}) == 0.5
    vqa = parse_line(
        json.dumps({"id": "b", "prompt": "what ?", "answer": ["cat", "kitty"]}).encode(), "m:2", str(tmp_path)
    )
    sample = {"id": "b", "answer": vqa.answer, "meta": vqa.meta}
    assert [build_reward("exact")(c, sample) for c in ("kitty", "Cat.", "dog")] == [1.0, 1.0, 0.0]


def test_shards_make_shows_the_first_rejections_and_counts_the_rest(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (56, 56), (10, 200, 10)).save(tmp_path / "ok.png")
    lines = [{"question": "what ?", "image": "ok.png", "answer": "green"}]
    lines += [{"question": "what ?", "image": f"missing-{i}.png", "answer": "x"} for i in range(30)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["shards", "make", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "s" / "s-%06d.tar")]) == 0
    err = capsys.readouterr().err
    assert err.count("rejected id=") == 20 and "10 more rejection(s) not shown above" in err
    assert len((tmp_path / "s" / "s-rejected.jsonl").read_text().splitlines()) == 30  # every one recorded
