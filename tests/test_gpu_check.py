"""tools/gpu_check.py, the prepared GPU check, runs end to end with `--device cpu` (short runs),
so a lent GPU's few minutes are not spent on a script error. On the CPU the same-weights log-probs
and the checkpointed gradients must agree exactly; the short demos cannot meet the goal (exit 1)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_every_check_on_the_cpu(tmp_path):
    short = [
        "training.steps=1",
        "training.warmup.steps=1",
        "checkpoint.every=0",
        "training.threads=1",
        "training.prompts_per_step=4",
        "training.mini_batches=1",
        "logging.tensorboard=false",
    ]
    cmd = [
        sys.executable,
        str(ROOT / "tools/gpu_check.py"),
        str(tmp_path),
        "--device",
        "cpu",
        "--lora-steps",
        "1",
        *[a for o in short for a in ("--override", o)],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]  # one RL step does not meet the demo's goal
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["logprobs"]["tokens"] > 100 and result["logprobs"]["max_abs"] == 0.0
    assert result["checkpoint"]["tensors"] > 50 and result["checkpoint"]["max_abs"] == 0.0
    for name in ("demo_fp32", "demo_bf16"):
        assert result[name]["exit"] == 3 and result[name]["goal_met"] is False  # ran, goal not met
        assert result[name]["h2d_copies"] == 0 and "device_peak_mb" in result[name]
    assert result["lora"]["exit"] == 0 and result["lora"]["error"] is None
