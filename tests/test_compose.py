"""Every part composes in one trainer loop: short CLI runs of rollout engine x training
engine x algorithm x pipeline mode, each run for 3 RL steps, resumed to 4, and compared
with an uninterrupted 4-step run (bit for bit in deterministic mode: every field that is
not a timing or a per-process byte counter); `loomrl report` works on every run folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loomrl.platform.metrics import comparable

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "disaggregated-vllm-ppo": [
        "pipeline.mode=disaggregated",
        "pipeline.rollout_workers=1",
        "rollout.engine=vllm",
        "model.num_heads=2",
        "algorithm.name=ppo",
        "algorithm.epochs=2",
    ],
    "disaggregated-deepspeed-zero2-2ranks": [
        "pipeline.mode=disaggregated",
        "pipeline.rollout_workers=1",
        "training.engine=deepspeed",
        "training.nproc=2",
        "training.deepspeed.zero_stage=2",
        "algorithm.kl_coef=0.01",
    ],
    "colocated-fsdp2-2ranks-vllm": [
        "training.engine=fsdp2",
        "training.nproc=2",
        "rollout.engine=vllm",
        "model.num_heads=2",
        "algorithm.kl_coef=0.01",
    ],
    "disaggregated-fsdp2-2ranks": [
        "pipeline.mode=disaggregated",
        "pipeline.rollout_workers=1",
        "training.engine=fsdp2",
        "training.nproc=2",
        "training.activation_checkpointing=true",
    ],
    "colocated-megatron-tp2-vllm": [
        "training.engine=megatron",
        "training.nproc=2",
        "training.megatron.tensor_parallel=2",
        "rollout.engine=vllm",
        "model.num_heads=2",
        "algorithm.importance.mode=truncate",
        "algorithm.kl_coef=0.01",
        "algorithm.kl_placement=reward",
    ],
}


def command(out: Path, shards: Path, extra: list[str], *options: str) -> tuple[list[str], dict]:
    """The argv and environment of a short `loomrl run` of the demo with `extra` settings."""
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
        "training.steps=4",
        "training.warmup.steps=0",
        "training.prompts_per_step=4",
        "training.mini_batches=2",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "training.threads=1",
        "rollout.drafter.compare_every=0",
        "logging.tensorboard=false",
        "goal=null",
        "algorithm.reward=rewards_for_tests:distinct_words",
        *extra,
        *options,
    ]
    return args, env


def cli(out: Path, shards: Path, extra: list[str], *options: str) -> subprocess.CompletedProcess:
    args, env = command(out, shards, extra, *options)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def side_by_side(*runs: tuple[list[str], dict]) -> list[subprocess.CompletedProcess]:
    """Runs started together and waited for (each has one thread: the two cores share them), so the
    suite pays for the longer one, not the sum."""
    procs = [
        subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args, env in runs
    ]
    done = []
    for (args, _), p in zip(runs, procs):
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(args, p.returncode, out, err))
    return done


def rows(out: Path) -> list[dict]:
    """The run's metrics rows, timings and per-process counters left out (metrics.comparable)."""
    return [comparable(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_composes(tmp_path: Path, shards: Path, extra: list[str]) -> list[dict]:
    full, part = side_by_side(
        command(tmp_path / "full", shards, extra), command(tmp_path / "resumed", shards, extra, "--max-steps", "3")
    )
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-6000:]
    assert part.returncode == 0, part.stdout[-3000:] + part.stderr[-6000:]
    assert "continue with --resume" in part.stdout
    assert (tmp_path / "resumed" / "checkpoints" / "step-000003").is_dir()
    resumed = cli(tmp_path / "resumed", shards, extra, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert "resumed from" in resumed.stdout
    want, got = rows(tmp_path / "full"), rows(tmp_path / "resumed")
    assert [r["step"] for r in want] == [0, 1, 2, 3]
    assert [r["step"] for r in got] == [0, 1, 2, 3]  # the resume wrote step 3, once
    assert len({r["loss"] for r in want}) > 1  # it trains
    for a, b in zip(want, got, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    for run in ("full", "resumed"):
        rep = subprocess.run(
            [sys.executable, "-m", "loomrl.cli", "report", str(tmp_path / run)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rep.returncode == 0 and (tmp_path / run / "report.png").is_file(), rep.stderr
    return want


def test_qwen2_vl_checkpoint_with_vllm_rollouts_and_drafting(tmp_path, demo_shards):
    """A tiny Qwen2-VL checkpoint (M-RoPE) as the policy, rolled out by vLLM with NgramRL drafting."""
    from qwen_checkpoints import _qwen2_vl
    from test_qwen_vl_checkpoint import OVERRIDES, PADDED

    folder = tmp_path / "qwen2-vl"
    _qwen2_vl(str(folder), "qwen2_vl", vocab_size=PADDED)
    d, _ = demo_shards
    want = check_composes(
        tmp_path,
        d,
        [
            "rollout.engine=vllm",
            "rollout.drafter.enabled=true",
            f"model.init_from={folder}",
            f"model.tokenizer={folder}",
            *OVERRIDES,
            "training.micro_batch_size=8",
        ],
    )
    # vLLM's M-RoPE positions are the trainer's: pi_old under the trainer / pi_rollout is 1 on every token
    assert all(abs(r["is_ratio_mean"] - 1) < 1e-4 and r["is_ratio_max"] < 1 + 1e-3 for r in want)
    assert sum(r["vllm_draft_tokens"] for r in want) > 0  # NgramRL drafts inside vLLM
    assert sum(r["vllm_accepted_tokens"] for r in want) > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_equals_uninterrupted(tmp_path, demo_shards, case):
    d, _ = demo_shards
    want = check_composes(tmp_path, d, CASES[case])
    if "ppo" in case:
        assert all("value_loss" in r for r in want)
    if "disaggregated" in case:
        assert all(
            r["trajectories_generated"]
            == r["trajectories_trained"] + r["trajectories_dropped"] + r["trajectories_pending"]
            for r in want
        )
    if "kl_coef=0.01" in CASES[case]:
        assert all("kl" in r or "kl_reward_mean" in r for r in want)
