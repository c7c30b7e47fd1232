"""Run tests/engines_worker.py under torchrun (2 processes) once per engine and test session."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("engines_worker.py")


def run_worker(engine: str, shard_dir: Path, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(WORKER), engine, str(shard_dir), str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{engine} worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(out.read_text())


def assert_matches(reference: list[dict], got: list[dict], loss_atol: float, rel: float) -> None:
    assert len(got) == len(reference)
    for step, (a, b) in enumerate(zip(reference, got)):
        assert abs(a["loss"] - b["loss"]) <= loss_atol, (step, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= rel * a["grad_norm"], (step, a, b)
        assert abs(a["mismatch_sum"] - b["mismatch_sum"]) <= rel * a["mismatch_sum"], (step, a, b)
        assert a["tokens"] == b["tokens"], (step, a, b)  # every rank's share counted exactly once
