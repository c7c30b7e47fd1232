"""Every part composes in one trainer loop: short CLI runs of rollout engine x training
engine x algorithm x pipeline mode, each run for 4 RL steps with a checkpoint at 3, resumed
from that checkpoint in a copy of its folder and compared with the uninterrupted rows (bit for
bit in deterministic mode: every field that is not a timing or a per-process byte counter);
`loomrl report` works on the resumed folder."""

import json
import os
import shutil
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
        "model.encoders.frozen=false",  # the demo's towers are frozen; here they train (SharedEncodings' backward)
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


def rows(out: Path) -> list[dict]:
    """The run's metrics rows, timings and per-process counters left out (metrics.comparable)."""
    return [comparable(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_composes(tmp_path: Path, shards: Path, extra: list[str]) -> list[dict]:
    """The uninterrupted run checkpoints at step 3 and goes on to 4; a copy of its folder without the
    later checkpoint is resumed from step 3 (the resume drops the rows after its checkpoint) and must
    write the same rows. (`--max-steps` stopping with a checkpoint is test_resume.py's.)"""
    full = cli(tmp_path / "full", shards, extra, "checkpoint.every=3")
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-6000:]
    assert (tmp_path / "full" / "checkpoints" / "step-000003").is_dir()
    shutil.copytree(tmp_path / "full", tmp_path / "resumed", ignore=shutil.ignore_patterns("step-000004", "report.png"))
    resumed = cli(tmp_path / "resumed", shards, extra, "checkpoint.every=3", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert "resumed from" in resumed.stdout and "step-000003" in resumed.stdout
    want, got = rows(tmp_path / "full"), rows(tmp_path / "resumed")
    assert [r["step"] for r in want] == [0, 1, 2, 3]
    assert [r["step"] for r in got] == [0, 1, 2, 3]  # the resume wrote step 3, once
    assert len({r["loss"] for r in want}) > 1  # it trains
    for a, b in zip(want, got, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    rep = subprocess.run(  # on the resumed folder: rows from two processes
        [sys.executable, "-m", "loomrl.cli", "report", str(tmp_path / "resumed")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 0 and (tmp_path / "resumed" / "report.png").is_file(), rep.stderr
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
