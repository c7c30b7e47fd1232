"""`loomrl bench demo`: the grid runs each cell as its own `loomrl run` with that seed, thread
count and CPU kernels, and reports what each cell reached and whether it met the goal."""

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_the_grid_runs_each_cell_with_its_seed_threads_and_kernels(tmp_path, demo_shards):
    short = [
        f"data.shards={demo_shards[0]}/*.tar",
        "data.demo=null",
        "training.steps=3",
        "training.warmup.steps=1",
        "training.mini_batches=1",
        "training.prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "checkpoint.every=0",
        "logging.tensorboard=false",
        "goal={first_steps: 1, last_steps: 2, min_final: 2.0}",
    ]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "loomrl.cli",
            "bench",
            "demo",
            "--seeds",
            "0,3",
            "--threads",
            "1",
            "--capabilities",
            "default,avx2",
            "--out",
            str(tmp_path / "grid"),
            "--json",
            *short,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-3000:]  # a goal of 2.0 is missed by every cell
    result = json.loads(p.stdout.strip().splitlines()[-1])
    cells = result["cells"]
    assert [(c["seed"], c["capability"]) for c in cells] == [(0, "default"), (3, "default"), (0, "avx2"), (3, "avx2")]
    assert result["cells_met"] == 0 and result["cells_total"] == 4
    # each cell ran with the kernels asked for: this CPU's, and AVX2 forced by ATEN_CPU_CAPABILITY
    assert [c["kernels"] for c in cells] == [torch.backends.cpu.get_cpu_capability()] * 2 + ["AVX2"] * 2
    for c in cells:
        assert c["rc"] == 3 and c["goal_met"] is False and c["steps"] == 3
        rows = [
            json.loads(x)
            for x in (tmp_path / "grid" / f"seed{c['seed']}-t1-{c['capability']}" / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        rewards = [r["reward_mean"] for r in rows]
        assert c["first"] == round(rewards[0], 4) and c["last"] == round(sum(rewards[-2:]) / 2, 4)
        for k in ("size", "color", "pitch"):  # slot_match's parts over the last 2 steps
            have = [r[f"reward_slot_{k}_mean"] for r in rows[-2:] if f"reward_slot_{k}_mean" in r]
            assert c["parts"][f"slot_{k}"] == round(sum(have) / len(have), 4)
        summary = json.loads((tmp_path / "grid" / f"seed{c['seed']}-t1-{c['capability']}" / "summary.json").read_text())
        assert summary["machine"]["threads"] == 1
        saved = yaml.safe_load(
            (tmp_path / "grid" / f"seed{c['seed']}-t1-{c['capability']}" / "recipe.yaml").read_text()
        )
        assert saved["training"]["seed"] == c["seed"] and saved["training"]["threads"] == 1
    assert "| 0 | 1 | AVX2 |" in p.stdout and "0 of 4 cells met the goal" in p.stdout


def test_a_recipe_every_cell_would_refuse_is_refused_once_before_any_cell_runs(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "loomrl.cli",
            "bench",
            "demo",
            "--out",
            str(tmp_path / "grid"),
            "training.prompts_per_step=3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "training.mini_batches" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "grid").exists()
