#!/usr/bin/env python3
"""Behaviour unchanged, bit for bit: run short CLI jobs at two checkouts and compare their
metrics rows, timings aside (keys ending in _s / _us, and the two ratios of timings).

    .venv/bin/python tools/same_metrics.py BASE_CHECKOUT [--steps 3]

BASE_CHECKOUT is a folder holding another commit of this repository (`git worktree add
/tmp/base <commit>`); each job runs there (its `loomrl` package first on the path) and here,
with the same recipe, overrides and seed, in deterministic mode. Prints one line per job and
exits 1 on the first difference, naming the step and the keys."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
COMMON = [
    "training.warmup.steps=0",
    "logging.tensorboard=false",
    "logging.progress=false",
    "goal=null",
    "rollout.drafter.adaptive=false",
    "training.threads=1",
]
JOBS = {  # name: (recipe, overrides)
    "demo": ("recipes/demo.yaml", ["training.prompts_per_step=4", "rollout.n=4"]),
    "demo-ppo": ("recipes/demo-ppo.yaml", ["training.prompts_per_step=4", "rollout.n=4"]),
    "demo-draft-trees": (
        "recipes/demo.yaml",
        ["training.prompts_per_step=4", "rollout.n=4", "rollout.drafter.tree_nodes=16"],
    ),
    "demo-draft-prefetch": (
        "recipes/demo.yaml",
        ["training.prompts_per_step=4", "rollout.n=4", "rollout.drafter.prefetch_budget=16"],
    ),
    "demo-sft": ("recipes/demo.yaml", ["algorithm.name=sft", "training.prompts_per_step=8"]),
    "demo-grpo-importance-kl": (
        "recipes/demo.yaml",
        ["training.prompts_per_step=4", "rollout.n=4", "algorithm.importance.mode=truncate", "algorithm.kl_coef=0.01"],
    ),
}
SMALL = ["training.prompts_per_step=4", "training.mini_batches=2", "rollout.n=4", "rollout.max_new_tokens=8"]
MATRIX = {  # --matrix: the composition matrix of tests/test_compose.py
    "disaggregated-vllm-ppo": (
        "recipes/demo.yaml",
        [
            *SMALL,
            "pipeline.mode=disaggregated",
            "pipeline.rollout_workers=1",
            "rollout.engine=vllm",
            "model.num_heads=2",
            "algorithm.name=ppo",
            "algorithm.epochs=2",
        ],
    ),
    "disaggregated-deepspeed-zero2-2ranks": (
        "recipes/demo.yaml",
        [
            *SMALL,
            "pipeline.mode=disaggregated",
            "pipeline.rollout_workers=1",
            "training.engine=deepspeed",
            "training.nproc=2",
            "training.deepspeed.zero_stage=2",
            "algorithm.kl_coef=0.01",
        ],
    ),
    "colocated-megatron-tp2-vllm": (
        "recipes/demo.yaml",
        [
            *SMALL,
            "training.engine=megatron",
            "training.nproc=2",
            "training.megatron.tensor_parallel=2",
            "rollout.engine=vllm",
            "model.num_heads=2",
            "algorithm.importance.mode=truncate",
            "algorithm.kl_coef=0.01",
            "algorithm.kl_placement=reward",
        ],
    ),
}


def rows(folder: Path) -> list[dict]:
    """The run's metrics rows without timings and per-process counters (loomrl's metrics.comparable)."""
    from loomrl.platform.metrics import comparable

    return [comparable(json.loads(line)) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def run(checkout: Path, recipe: str, overrides: list[str], out: Path, shards: Path, steps: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), str(checkout / "tests")]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "run",
        str(checkout / recipe),
        "--out",
        str(out),
        f"data.shards={shards}/*.tar",
        "data.demo=null",
        f"training.steps={steps}",
        *COMMON,
        *overrides,
    ]
    p = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"{out.name} at {checkout}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return rows(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--matrix", action="store_true", help="also the composition matrix (2 ranks, vLLM; minutes)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from loomrl.datasets.demo import write_demo_shards

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_demo_shards(str(tmp / "shards"), samples=48, samples_per_shard=16, seed=7)
        for name, (recipe, overrides) in {**JOBS, **(MATRIX if args.matrix else {})}.items():
            base = run(args.base.resolve(), recipe, overrides, tmp / f"base-{name}", tmp / "shards", args.steps)
            here = run(HERE, recipe, overrides, tmp / f"here-{name}", tmp / "shards", args.steps)
            if len(base) != len(here) or not base:
                print(f"{name}: {len(base)} rows at the base, {len(here)} here")
                return 1
            for step, (a, b) in enumerate(zip(base, here)):
                diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
                if diff:
                    print(f"{name}: step {step} differs: {diff}")
                    return 1
            print(f"{name}: {len(here)} rows, {len(here[0])} fields each, identical (timings aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
