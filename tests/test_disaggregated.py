"""Disaggregated mode end to end: `loomrl run ... pipeline.mode=disaggregated` launches
torchrun with 1 trainer + 2 rollout workers (gloo), and a rollout worker that dies is
reported with balanced accounting."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from loomrl.platform.disaggregated import WorkerSource
from loomrl.platform.recipe import Recipe
from loomrl.platform.trajectory.dispatch import Job
from loomrl.platform.trajectory.sources import WorkerDied
from loomrl.platform.trajectory.transport import Channel


def run_cli(tmp_path, demo_shards, extra, env=None):
    d, _ = demo_shards
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "run",
        "recipes/demo.yaml",
        "--out",
        str(out),
        f"data.shards={d}/*.tar",
        "data.demo=null",
        "pipeline.mode=disaggregated",
        "pipeline.rollout_workers=2",
        "training.warmup.steps=0",
        "training.prompts_per_step=4",
        "training.mini_batches=2",
        "training.threads=1",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "logging.tensorboard=false",
        "goal=null",
        "checkpoint.every=0",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env or {}))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    return p, out


def single_stream_ids(demo_shards, k):
    """The first k prompt ids of a one-process stream of the demo recipe's shards and seed."""
    from loomrl.datasets.stream import ShardStream
    from loomrl.platform import recipe as R

    d, _ = demo_shards
    r = R.load_recipe("recipes/demo.yaml", [f"data.shards={d}/*.tar", "data.demo=null"])
    stream = iter(
        ShardStream(
            R.expand_pattern(r.data.shards),
            shuffle_buffer=r.data.shuffle_buffer,
            seed=r.data.seed,
            rank=0,
            world_size=1,
        )
    )
    return [next(stream)["id"] for _ in range(k)]


@pytest.mark.parametrize("admission", ["mini_batch"])
def test_three_process_run_logs_staleness(tmp_path, demo_shards, admission):
    p, out = run_cli(
        tmp_path,
        demo_shards,
        ["training.steps=3", f"pipeline.admission={admission}", "checkpoint.every=2", "checkpoint.keep_last=5"],
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["staleness_max"] >= r["staleness_mean"] >= 0
        assert 0 <= r["trainer_idle_frac"] <= 1
        assert (
            r["trajectories_generated"]
            == r["trajectories_trained"] + r["trajectories_dropped"] + r["trajectories_pending"]
        )
        assert r["media_bytes_naive"] >= r["media_bytes_dedup"] > 0
    assert rows[-1]["policy_version"] == 3 * 2  # one version per optimizer step
    assert rows[-1]["trajectories_trained"] == 3 * 4 * 4
    summary = json.loads((out / "summary.json").read_text())
    acc = summary["trajectories"]
    assert summary["error"] is None and acc["pending"] == 0
    assert acc["generated"] == acc["trained"] + acc["dropped"]
    assert "staleness" in p.stdout
    # the trainer reads every sample of the stream (not rank 0's share of the gloo group): the 12
    # trained prompts are distinct and come from the first 12 + 4 (back-pressure: in flight at the end)
    trained = [i for r in rows for i in r["prompt_ids"]]
    first = single_stream_ids(demo_shards, 3 * 4 + 4)
    assert len(trained) == 3 * 4 and len(set(trained)) == len(trained) and set(trained) <= set(first), (trained, first)
    assert set(first[:4]) <= set(trained)  # the oldest groups are admitted first
    # checkpoint.every=2: a periodic checkpoint at RL step 2 besides the final one at 3
    assert sorted(x.name for x in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]


def test_a_dead_rollout_worker_is_reported_and_nothing_is_lost(tmp_path, demo_shards):
    p, out = run_cli(
        tmp_path,
        demo_shards,
        ["training.steps=4", "pipeline.on_worker_death=stop"],
        env={"LOOMRL_KILL_AT": "rollout:1", "LOOMRL_KILL_RANK": "2"},
    )
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert "rollout worker rank 2 died" in p.stderr or "signal 15" in p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] and summary["steps"] < 4
    acc, disp = summary["trajectories"], summary["dispatch"]
    assert acc["generated"] == acc["trained"] + acc["dropped"] + acc["pending"]
    assert disp["requeued"] >= 1 and disp["dispatched"] == disp["completed"]  # nothing left in flight
    assert (out / "checkpoints").is_dir()


def test_a_bad_message_is_a_worker_failure(tmp_path, demo_shards):
    """Rank 2's first result has a tensor whose shape does not match its bytes: the trainer
    reports rank 2 as failed, re-queues its prompt and finishes with rank 1."""
    p, out = run_cli(
        tmp_path,
        demo_shards,
        ["training.steps=2", "pipeline.on_worker_death=continue"],
        env={"LOOMRL_BAD_MESSAGE_RANK": "2"},
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "rollout worker rank 2 died (sent a bad message: transport: tensor 'bad' of shape [4]" in p.stderr
    summary = json.loads((out / "summary.json").read_text())
    acc, disp = summary["trajectories"], summary["dispatch"]
    assert summary["error"] is None and summary["steps"] == 2
    assert disp["requeued"] >= 1 and acc["trained"] == 2 * 4 * 4
    assert acc["generated"] == acc["trained"] + acc["dropped"] + acc["pending"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rollout_workers_live"] == 1


def test_what_cannot_work_is_refused_by_dry_run(tmp_path, demo_shards):
    """--dry-run is the truth: a combination the run would refuse is refused by validation,
    naming the key (PPO's value model is trained by the torch engine only)."""
    p, _ = run_cli(
        tmp_path, demo_shards, ["--dry-run", "algorithm.name=ppo", "training.engine=deepspeed", "training.nproc=2"]
    )
    assert p.returncode == 2 and "algorithm.name: ppo" in p.stderr, p.stderr[-2000:]
    # what used to be refused at launch now validates: PPO epochs and the mismatch probe
    p, _ = run_cli(
        tmp_path,
        demo_shards,
        ["--dry-run", "algorithm.name=ppo", "algorithm.epochs=2", "logging.mismatch_every=5", "algorithm.kl_coef=0.01"],
    )
    assert p.returncode == 0 and "recipe OK" in p.stderr, p.stderr[-2000:]


class ClosedTo(Channel):
    """A real Channel whose sends to `gone` fail as gloo's do once that process has exited
    (RuntimeError "Connection closed by peer"): the race the CLI test above can lose, when the
    trainer sends weights or work before its receiving thread has seen the connection drop."""

    def __init__(self, gone: int):
        super().__init__()
        self.gone = gone

    def _isend(self, t, dst):
        assert dst == self.gone, f"only rank {self.gone} is sent to here"
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8101")


@pytest.mark.parametrize("on_death", ["continue", "stop"])
def test_a_send_to_a_worker_that_is_gone_is_its_death(on_death):
    recipe = Recipe()
    recipe.pipeline.on_worker_death = on_death
    src = WorkerSource(SimpleNamespace(recipe=recipe), ClosedTo(2), [1, 2], {1: 1, 2: 2})
    job = Job("g0", None)
    src.disp.assign(2, [job])  # in flight on the worker that is gone
    msg = torch.zeros(4, dtype=torch.uint8)
    if on_death == "stop":
        with pytest.raises(WorkerDied, match=r"rollout worker rank 2 died \(connection failed: .*closed by peer"):
            src.send(2, msg)
    else:
        assert src.send(2, msg) is False
    assert src.live == [1] and list(src.disp.requeued) == [job]  # its prompt re-queued, counted
    src.live = [2]  # close() returns whatever a gone worker does
    src.close(wait_s=1.0)
    assert src.live == []
