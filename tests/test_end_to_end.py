"""A short real run through the CLI: demo shards made on the fly, warm-up, GRPO steps,
metrics, TensorBoard events, checkpoint, report."""

import json
import shutil
from pathlib import Path

from PIL import Image

from loomrl.cli import main
from loomrl.platform.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"step", "reward_mean", "loss", "tokens_per_s", "rollout_s", "train_s"}


def short_run(tmp_path, out_name, extra=()):
    return main(
        [
            "run",
            str(ROOT / "recipes" / "demo.yaml"),
            "--out",
            str(tmp_path / out_name),
            f"data.shards={tmp_path}/shards/demo-*.tar",
            "data.demo.samples=48",
            "training.steps=6",
            "training.warmup.steps=3",
            "training.mini_batches=1",
            "training.prompts_per_step=4",
            "rollout.n=4",
            "checkpoint.every=4",
            "goal=null",
            *extra,
        ]
    )


def test_short_run_then_report(tmp_path, capsys):
    assert short_run(tmp_path, "run") == 0
    out = tmp_path / "run"
    assert len(list((tmp_path / "shards").glob("demo-*.tar"))) == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    for r in rows:
        assert REQUIRED <= set(r)
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["tokens_per_s"] > 0 and r["rollout_s"] > 0
        assert r["logp_mismatch"] < 1e-4  # rollout and trainer agree on the same weights
        assert r["media_total"] == 4 * r["media_unique"] > 0  # each prompt's media shared by its 4 samples
    assert r["policy_version"] == 6
    assert len((out / "warmup.jsonl").read_text().splitlines()) == 3
    assert list((out / "tensorboard").iterdir())
    assert (out / "recipe.yaml").is_file()
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-000004", "step-000006"]
    from loomrl.platform.backbone.tokenizer import load_tokenizer
    from loomrl.platform.backbone.vlm import build_policy
    from loomrl.platform.recipe import load_recipe

    model_cfg = load_recipe(ROOT / "recipes" / "demo.yaml").model
    _, state = load_checkpoint(out / "checkpoints" / "step-000006", build_policy(model_cfg, load_tokenizer("demo"), 1))
    assert state["step"] == 6 and state["data"]["served"] == 3 * 32 + 6 * 4 and state["data"]["index"] > 0
    summary = capsys.readouterr().out
    assert "RL steps        6" in summary

    assert main(["report", str(out)]) == 0
    with Image.open(out / "report.png") as im:
        assert im.format == "PNG" and im.width > 400 and im.height > 300

    # the same out dir is refused, nothing overwritten
    before = (out / "metrics.jsonl").read_bytes()
    assert short_run(tmp_path, "run") == 2
    assert (out / "metrics.jsonl").read_bytes() == before


def test_deterministic_runs_match(tmp_path, capsys):
    assert short_run(tmp_path, "a") == 0
    assert short_run(tmp_path, "b") == 0
    keep = ("reward_mean", "loss", "entropy", "response_len")
    rows = [
        [{k: r[k] for k in keep} for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())]
        for d in ("a", "b")
    ]
    assert rows[0] == rows[1]
    # the two runs overlaid in one figure; several folders need --out, one folder takes none
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp" / "ab.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cmp" / "ab.png")
    with Image.open(tmp_path / "cmp" / "ab.png") as im:
        assert im.format == "PNG" and im.width > 400
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert main(["report", str(tmp_path / "a"), "--out", str(tmp_path / "x.png")]) == 2
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "missing"), "--out", str(tmp_path / "y.png")]) == 2
    assert "missing/metrics.jsonl: not found" in capsys.readouterr().err
    assert not (tmp_path / "y.png").exists() and not (tmp_path / "x.png").exists()


def test_goal_miss_exits_3(tmp_path, capsys):
    assert short_run(tmp_path, "g", ["goal={min_final: 2.0}"]) == 3
    assert "NOT MET" in capsys.readouterr().out


def test_report_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl: not found" in capsys.readouterr().err
    shutil.rmtree(tmp_path)


def test_mismatch_compares_the_rollout_with_the_policy_before_the_steps_updates(tmp_path):
    """With 2 mini-batches the policy moves after the first one; `logp_mismatch` still compares the
    rollout engine with the trainer on the weights that sampled (pi_old), not the moved policy."""
    assert short_run(tmp_path, "mb2", ["training.mini_batches=2", "checkpoint.every=0"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "mb2" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["policy_version"] == 12 and rows[-1]["staleness_max"] == 1  # two updates per step
    assert all(r["logp_mismatch"] < 1e-4 for r in rows)
