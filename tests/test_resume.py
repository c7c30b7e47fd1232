"""Exact resume: a run killed with SIGKILL during a rollout, an optimizer step or a
checkpoint write, then resumed, logs the same metrics as an uninterrupted run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loomrl.platform.metrics import comparable

ROOT = Path(__file__).resolve().parent.parent


def cli(tmp: Path, out: str, *extra: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        LOOMRL_KILL_AT=kill_at or "",
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    args = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "run",
        str(ROOT / "recipes" / "demo.yaml"),
        "--out",
        str(tmp / out),
        f"data.shards={tmp}/shards/demo-*.tar",
        "data.demo.samples=48",
        "data.shuffle_buffer=20",
        "training.steps=6",
        "training.warmup.steps=2",
        "training.mini_batches=1",
        "training.prompts_per_step=4",
        "rollout.n=4",
        "checkpoint.every=1",
        "checkpoint.keep_last=3",
        "rollout.drafter.enabled=true",  # adaptive (the default): draft lengths from counted work
        "logging.tensorboard=false",
        "goal=null",
        "algorithm.reward=rewards_for_tests:distinct_words",
        *extra,
    ]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def rows(path: Path) -> list[dict]:
    """The rows without timings and per-process counters (metrics.comparable)."""
    return [comparable(json.loads(line)) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    p = cli(tmp, "full")
    assert p.returncode == 0, p.stderr
    full = rows(tmp / "full" / "metrics.jsonl")
    assert len({r["loss"] for r in full}) > 1 and all(r["grad_norm"] > 0 for r in full)  # it learns
    return tmp, full


@pytest.mark.parametrize("point", ["rollout:3", "optimizer:3", "checkpoint:3"])
def test_kill_then_resume_matches_uninterrupted(baseline, point):
    tmp, full = baseline
    name = point.replace(":", "-")
    killed = cli(tmp, name, kill_at=point)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_dir = tmp / name
    # killed in step 3's rollout or optimizer step: steps 0-2 logged; in the checkpoint
    # written after step 3: steps 0-3 logged, and step 3 is run again after the resume
    assert len(rows(run_dir / "metrics.jsonl")) == (4 if point.startswith("checkpoint") else 3)
    if point.startswith("checkpoint"):  # the interrupted write never becomes a checkpoint
        assert (run_dir / "checkpoints" / ".step-000004.tmp").exists()
        assert not (run_dir / "checkpoints" / "step-000004").exists()
    resumed = cli(tmp, name, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    got = rows(run_dir / "metrics.jsonl")
    assert got == full  # every deterministic field of every step, the data order included
    digests = [r["prompt_digest"] for r in got]
    assert len(set(digests)) == len(digests)  # 6 steps x 4 prompts < 48 samples: no prompt twice
    last = got[-1]
    assert last["trajectories_generated"] == last["trajectories_trained"] + last["trajectories_dropped"] == 6 * 16


def test_a_second_run_of_the_seed_repeats_the_first(baseline):
    """Adaptive drafting (the default) chooses draft lengths from counted work under a cost model: the
    first run fits it on its clock and keeps it in the machine's cache, the second adopts that fit
    (`draft_control.CostCache`), so it chooses alike, forward widths and log-probs included."""
    tmp, full = baseline
    again = cli(tmp, "again")
    assert again.returncode == 0, again.stderr[-2000:]
    assert rows(tmp / "again" / "metrics.jsonl") == full
    assert full[-1]["draft_calibrated"] == 1 and any(r["draft_k_mean"] > 0 for r in full)  # it drafted


def test_corrupt_checkpoint_is_refused_and_an_earlier_one_can_be_named(baseline):
    tmp, full = baseline
    killed = cli(tmp, "corrupt", kill_at="rollout:4")
    assert killed.returncode == -9
    ckpts = tmp / "corrupt" / "checkpoints"
    newest = ckpts / "step-000004"
    data = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(data[:-100])  # truncated
    refused = cli(tmp, "corrupt", "--resume")
    assert refused.returncode == 2
    assert "step-000004/model.safetensors: missing or corrupt" in refused.stderr
    assert "--resume-from" in refused.stderr
    ok = cli(tmp, "corrupt", "--resume-from", str(ckpts / "step-000003"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert rows(tmp / "corrupt" / "metrics.jsonl") == full


def test_other_recipe_is_refused_on_resume(baseline):
    tmp, _ = baseline
    p = cli(tmp, "full", "--resume", "training.lr=0.1")
    assert p.returncode == 2 and "training.lr" in p.stderr


def test_max_steps_stops_with_a_checkpoint_and_resume_finishes(baseline):
    tmp, full = baseline
    first = cli(tmp, "staged", "--max-steps", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp / "staged" / "checkpoints" / "step-000002").is_dir()
    assert "continue with --resume" in first.stdout
    rest = cli(tmp, "staged", "--resume")
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert rows(tmp / "staged" / "metrics.jsonl") == full


def test_thousand_step_synthetic_run_stays_within_the_caps(demo_shards, model, tokenizer):
    """1,000 steps of the run's bookkeeping (prompt source with its media cache, drafter
    histories fed by every rollout): every structure stays within its recipe cap."""
    import random as _random

    from loomrl.datasets.source import PromptSource
    from loomrl.datasets.stream import ShardStream
    from loomrl.platform.recipe import DrafterConfig, ModelConfig
    from loomrl.platform.rollout.drafter import NgramDrafter

    _, files = demo_shards
    source = PromptSource(ShardStream(files, shuffle_buffer=8, seed=1), model, tokenizer, ModelConfig(), media_cache=6)
    cfg = DrafterConfig(max_history=4, max_history_tokens=60, max_prompts=10, global_history=20)
    drafter = NgramDrafter(cfg)
    rng = _random.Random(0)
    for step in range(1000):
        for s in source.next(3):
            for _ in range(4):  # n samples per prompt
                drafter.observe(s.id, [rng.randrange(40) for _ in range(rng.randrange(5, 30))])
        assert len(source._media) <= 6
        assert len(drafter.histories) <= 10 and len(drafter.global_history.seqs) <= 20
        assert all(len(h.seqs) <= 4 and h.tokens <= 60 for h in drafter.histories.values())
    assert drafter.history_tokens() <= 10 * 60 + 20 * 30
    assert source.state()["served"] == 3000


def test_checkpoint_of_another_recipe_is_refused(baseline):
    tmp, _ = baseline
    p = cli(tmp, "elsewhere", "training.lr=0.1", "--resume-from", str(tmp / "full" / "checkpoints" / "step-000006"))
    assert p.returncode == 2 and "state.json: was written by another recipe" in p.stderr
