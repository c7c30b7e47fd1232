"""Disaggregated mode end to end: `loomrl run ... pipeline.mode=disaggregated` launches
torchrun with 1 trainer + 2 rollout workers (gloo), and a rollout worker that dies is
reported with balanced accounting."""
import json
import os
import subprocess
import sys

import pytest


def run_cli(tmp_path, demo_shards, extra, env=None):
    d, _ = demo_shards
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "loomrl.cli", "run", "recipes/demo.yaml", "--out", str(out),
           f"data.shards={d}/*.tar", "data.demo=null", "pipeline.mode=disaggregated", "pipeline.rollout_workers=2",
           "training.warmup.steps=0", "training.prompts_per_step=4", "training.mini_batches=2",
           "training.threads=1", "rollout.n=4", "rollout.max_new_tokens=8", "logging.tensorboard=false",
           "goal=null", "checkpoint.every=0", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env or {}))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    return p, out


@pytest.mark.parametrize("admission", ["mini_batch"])
def test_three_process_run_logs_staleness(tmp_path, demo_shards, admission):
    p, out = run_cli(tmp_path, demo_shards, ["training.steps=3", f"pipeline.admission={admission}"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["staleness_max"] >= r["staleness_mean"] >= 0
        assert 0 <= r["trainer_idle_frac"] <= 1
        assert r["trajectories_generated"] == r["trajectories_trained"] + r["trajectories_dropped"] \
            + r["trajectories_pending"]
        assert r["media_bytes_naive"] >= r["media_bytes_dedup"] > 0
    assert rows[-1]["policy_version"] == 3 * 2  # one version per optimizer step
    assert rows[-1]["trajectories_trained"] == 3 * 4 * 4
    summary = json.loads((out / "summary.json").read_text())
    acc = summary["trajectories"]
    assert summary["error"] is None and acc["pending"] == 0
    assert acc["generated"] == acc["trained"] + acc["dropped"]
    assert "staleness" in p.stdout


def test_a_dead_rollout_worker_is_reported_and_nothing_is_lost(tmp_path, demo_shards):
    p, out = run_cli(tmp_path, demo_shards, ["training.steps=4", "pipeline.on_worker_death=stop"],
                     env={"LOOMRL_KILL_AT": "rollout:1", "LOOMRL_KILL_RANK": "2"})
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert "rollout worker rank 2 died" in p.stderr or "signal 15" in p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] and summary["steps"] < 4
    acc, disp = summary["trajectories"], summary["dispatch"]
    assert acc["generated"] == acc["trained"] + acc["dropped"] + acc["pending"]
    assert disp["requeued"] >= 1 and disp["dispatched"] == disp["completed"]  # nothing left in flight
    assert (out / "checkpoints").is_dir()
