"""The run folder is the run's: one run at a time (a lock held for its life), a folder that
is not empty is refused unless resumed, and checkpoints are numbered by the RL step they
hold, also after --resume-from with --max-steps."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from loomrl.platform.metrics import comparable

ROOT = Path(__file__).resolve().parent.parent


def cli(out: Path, shards: Path, *options: str, wait: bool = True):
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    args = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "run",
        str(ROOT / "recipes" / "demo.yaml"),
        "--out",
        str(out),
        f"data.shards={shards}/*.tar",
        "data.demo=null",
        "training.steps=8",
        "training.warmup.steps=0",
        "training.mini_batches=1",
        "training.prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "training.threads=1",
        "checkpoint.every=2",
        "checkpoint.keep_last=10",
        "logging.tensorboard=false",
        "goal=null",
        *options,
    ]
    if not wait:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_final_checkpoint_is_numbered_by_its_step_after_resume_from(tmp_path, demo_shards):
    d, _ = demo_shards
    first = cli(tmp_path / "a", d, "--max-steps", "6")
    assert first.returncode == 0, first.stderr[-3000:]
    new = cli(
        tmp_path / "b", d, "--resume-from", str(tmp_path / "a" / "checkpoints" / "step-000006"), "--max-steps", "8"
    )
    assert new.returncode == 0, new.stderr[-3000:]
    saved = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert saved[-1] == "step-000008", saved  # steps 6-7 ran: the state is at step 8, not 2
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-000008" / "state.json").read_text())
    assert state["step"] == 8
    # a later --resume continues from step 8 and keeps the rows of steps 6-7
    rows = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [6, 7]


def test_a_folder_that_is_not_empty_is_refused_unless_resumed(tmp_path, demo_shards):
    d, _ = demo_shards
    out = tmp_path / "other"
    out.mkdir()
    (out / "recipe.yaml").write_text("mine: true\n")  # e.g. the user's own recipe
    p = cli(out, d)
    assert p.returncode == 2 and "is not empty" in p.stderr, p.stderr[-2000:]
    assert (out / "recipe.yaml").read_text() == "mine: true\n"  # untouched
    notrun = tmp_path / "notrun"
    notrun.mkdir()
    (notrun / "data.txt").write_text("x")
    p = cli(notrun, d, "--resume")
    assert p.returncode == 2 and "holds no loomrl run" in p.stderr, p.stderr[-2000:]


def test_two_runs_cannot_share_a_folder(tmp_path, demo_shards):
    d, _ = demo_shards
    out = tmp_path / "shared"
    first = cli(out, d, "training.steps=100000", wait=False)  # killed below: it must outlive the second
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.2)
        second = cli(out, d, "--resume")
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"in use by another loomrl run (pid {first.pid})" in second.stderr, second.stderr[-2000:]
    finally:
        first.kill()
        first.communicate()


def test_a_refused_resume_writes_nothing(tmp_path, demo_shards):
    """--resume-from a checkpoint of another recipe is refused, and the folder stays free for the
    right one (it used to keep the refused recipe.yaml, which then refused the correct resume)."""
    d, _ = demo_shards
    first = cli(tmp_path / "a", d, "--max-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = str(tmp_path / "a" / "checkpoints" / "step-000002")
    wrong = cli(tmp_path / "b", d, "--resume-from", ckpt, "training.lr=0.01")
    assert wrong.returncode == 2 and "another recipe" in wrong.stderr, wrong.stderr[-2000:]
    assert not (tmp_path / "b" / "recipe.yaml").exists()
    right = cli(tmp_path / "b", d, "--resume-from", ckpt, "--max-steps", "3")
    assert right.returncode == 0, right.stderr[-2000:]


def test_a_signal_during_the_warm_up_checkpoints_it_and_resume_continues_exactly(tmp_path, demo_shards):
    d, _ = demo_shards
    opts = (
        "training.warmup.steps=30",
        "training.warmup.batch_size=4",
        "training.steps=2",
        "algorithm.reward=rewards_for_tests:distinct_words",
    )
    full = cli(tmp_path / "full", d, *opts)
    assert full.returncode == 0, full.stderr[-3000:]
    out = tmp_path / "cut"
    run = cli(out, d, *opts, wait=False)
    deadline = time.time() + 120
    while (
        time.time() < deadline
        and run.poll() is None
        and (not (out / "warmup.jsonl").exists() or len((out / "warmup.jsonl").read_text().splitlines()) < 3)
    ):
        time.sleep(0.05)
    run.send_signal(15)  # SIGTERM, as a scheduler sends it
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err[-3000:]
    assert "interrupted after warm-up step" in err and "--resume" in err, err[-2000:]
    cut = len((out / "warmup.jsonl").read_text().splitlines())
    assert 3 <= cut < 30
    resumed = cli(out, d, *opts, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed the warm-up" in resumed.stdout
    for name in ("warmup.jsonl", "metrics.jsonl"):

        def rows(p):
            return [comparable(json.loads(line)) for line in p.read_text().splitlines()]

        assert rows(out / name) == rows(tmp_path / "full" / name), name
