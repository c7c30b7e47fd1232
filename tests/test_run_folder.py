"""The run folder is the run's: one run at a time (a lock held for its life), a folder that
is not empty is refused unless resumed, and checkpoints are numbered by the RL step they
hold, also after --resume-from with --max-steps."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli(out: Path, shards: Path, *options: str, wait: bool = True):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "loomrl.cli", "run", str(ROOT / "recipes" / "demo.yaml"), "--out", str(out),
            f"data.shards={shards}/*.tar", "data.demo=null", "training.steps=8", "training.warmup.steps=0",
            "training.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4", "training.threads=1",
            "checkpoint.every=2", "checkpoint.keep_last=10", "logging.tensorboard=false", "goal=null", *options]
    if not wait:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_final_checkpoint_is_numbered_by_its_step_after_resume_from(tmp_path, demo_shards):
    d, _ = demo_shards
    first = cli(tmp_path / "a", d, "--max-steps", "6")
    assert first.returncode == 0, first.stderr[-3000:]
    new = cli(tmp_path / "b", d, "--resume-from", str(tmp_path / "a" / "checkpoints" / "step-000006"),
              "--max-steps", "8")
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
    first = cli(out, d, "training.steps=40", wait=False)
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
