"""DPO runs through the CLI on a small preference set built from the own-task fixtures
(tests/test_own_task.py: a tiny Qwen2-VL checkpoint with a chat template, real photos): each photo's
name preferred to another photo's, under the training questions; the held-out pairs ask the
validation question SFT never saw. DPO raises the held-out margin (printed with `-s`), a run stopped
after 3 steps and resumed to 4 equals an uninterrupted one, the export loads in transformers with
the trainer's logits, and the torch, DeepSpeed and Megatron engines take the same steps."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen_checkpoints import CHAT_TEMPLATE, _qwen2_vl
from safetensors.torch import load_file
from test_own_task import PHOTOS, TRAIN_QUESTIONS, VAL_QUESTION, WORDS, _manifest, _photos, _run, check_export

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8


def pairs(questions: list[str]) -> list[dict]:
    """Each photo's name chosen over the next photo's name, for every question."""
    return [
        {"question": q, "image": f"img/{p}.png", "chosen": p, "rejected": PHOTOS[(i + 1) % len(PHOTOS)]}
        for q in questions
        for i, p in enumerate(PHOTOS)
    ]


def recipe_text(tmp: Path, **training) -> str:
    t = {"steps": STEPS, "prompts_per_step": 12, "micro_batch_size": 6, "lr": 0.002, "threads": 1, **training}
    return f"""
name: dpo
model: {{init_from: {tmp}/base}}
data: {{shards: "{tmp}/shards/train-*.tar", shuffle_buffer: 12}}
algorithm: {{name: dpo, reward: exact, dpo: {{beta: 0.1}}}}
training: {json.dumps(t)}
rollout: {{max_new_tokens: 3}}
validation: {{shards: "{tmp}/val/val-*.tar", every: 4, samples: 4, max_new_tokens: 3}}
checkpoint: {{every: 4, keep_last: 4}}
logging: {{tensorboard: false, progress: false}}
"""


@pytest.fixture(scope="module")
def dpo_set(tmp_path_factory):
    """The checkpoint, the photos, the train shards (12 pairs, one plain sample; a bad pair rejected)
    and the held-out pairs; a recipe."""
    tmp = tmp_path_factory.mktemp("dpo")
    _qwen2_vl(str(tmp / "base"), words=WORDS, chat_template=CHAT_TEMPLATE)
    _photos(tmp / "img")
    train = pairs(TRAIN_QUESTIONS)
    train += [
        {"question": "what is this ?", "image": "img/rocket.png", "chosen": "rocket", "rejected": "rocket"},
        {"question": "what is this ?", "image": "img/rocket.png", "answer": "rocket"},  # no pair: skipped by DPO
    ]
    _manifest(tmp / "train.jsonl", train)
    _manifest(tmp / "val.jsonl", pairs([VAL_QUESTION]))
    _run(["shards", "make", str(tmp / "train.jsonl"), "--out", str(tmp / "shards/train-%06d.tar")])
    rejected = [json.loads(x) for x in (tmp / "shards/train-rejected.jsonl").read_text().splitlines()]
    assert [r["code"] for r in rejected] == ["bad-pair"]
    _run(["shards", "make", str(tmp / "val.jsonl"), "--out", str(tmp / "val/val-%06d.tar")])
    (tmp / "dpo.yaml").write_text(recipe_text(tmp))
    return tmp


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.endswith("_s")}


@pytest.fixture(scope="module")
def learned(dpo_set):
    _run(["run", str(dpo_set / "dpo.yaml"), "--dry-run"])
    _run(["run", str(dpo_set / "dpo.yaml"), "--out", str(dpo_set / "runs/dpo")])
    return dpo_set / "runs/dpo"


def test_dpo_raises_the_held_out_margin(learned):
    summary = json.loads((learned / "summary.json").read_text())
    val = summary["validation"]
    first, last = val[0], val[-1]
    print(
        f"\nheld-out pairs ({len(PHOTOS)}, question {VAL_QUESTION!r}), step {first['step']} -> {last['step']}: "
        f"margin {first['val_dpo_margin']:+.4f} -> {last['val_dpo_margin']:+.4f}, "
        f"accuracy {first['val_dpo_accuracy']:.2f} -> {last['val_dpo_accuracy']:.2f}, "
        f"logp gap {first['val_logp_gap']:+.3f} -> {last['val_logp_gap']:+.3f}, "
        f"greedy reward {first['val_reward_mean']:.2f} -> {last['val_reward_mean']:.2f}"
    )
    assert [v["step"] for v in val] == [0, 4, 8]
    # step 0: the policy is the reference, so every pair's h is exactly 0
    assert first["val_dpo_margin"] == 0.0 and first["val_dpo_accuracy"] == 0.0
    assert last["val_dpo_margin"] > 0.2 and last["val_dpo_accuracy"] == 1.0
    assert last["val_logp_gap"] > first["val_logp_gap"] + 2.0
    # independent of how pairs are batched: the greedy answers to the held-out question name the photo more often
    assert last["val_reward_mean"] > first["val_reward_mean"]
    r = rows(learned)
    assert len(r) == STEPS and r[0]["pairs"] == 12
    assert r[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and r[0]["dpo_margin"] == pytest.approx(0, abs=1e-5)
    assert r[-1]["loss"] < 0.4 and r[-1]["dpo_accuracy"] == 1.0
    assert r[-1]["dpo_reward_chosen"] > r[-1]["dpo_reward_rejected"]
    assert summary["skipped_samples"] >= 1  # the sample without a pair, counted


def test_resume_from_3_to_4_equals_the_uninterrupted_run(dpo_set, learned):
    out = dpo_set / "runs/resumed"
    _run(["run", str(dpo_set / "dpo.yaml"), "--out", str(out), "--max-steps", "3"])
    _run(["run", str(dpo_set / "dpo.yaml"), "--out", str(out), "--resume", "--max-steps", "4"])
    got, want = rows(out), rows(learned)[:4]
    assert [untimed(x) for x in got] == [untimed(x) for x in want]
    a = load_file(str(out / "checkpoints/step-000004/model.safetensors"))
    b = load_file(str(learned / "checkpoints/step-000004/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_export_loads_in_transformers(dpo_set, learned):
    _run(["export", str(learned / f"checkpoints/step-{STEPS:06d}"), "--out", str(dpo_set / "dpo-hf")])
    check_export(dpo_set, "runs/dpo", f"step-{STEPS:06d}", "dpo-hf")


def cli_run(dpo_set: Path, name: str, *overrides: str) -> list[dict]:
    """A run in its own process (a distributed engine holds a process group)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    out = dpo_set / "runs" / name
    args = [sys.executable, "-m", "loomrl.cli", "run", str(dpo_set / "dpo.yaml"), "--out", str(out)]
    args += ["training.steps=3", "validation.shards=null", "checkpoint.every=0", *overrides]
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=dpo_set)
    assert p.returncode == 0, p.stderr[-4000:]
    return rows(out)


def test_the_engines_take_the_same_steps(dpo_set):
    """DPO on DeepSpeed (ZeRO-2) and Megatron (one process each) against the torch engine: the same
    losses and gradient norms, step after step."""
    torch_rows = cli_run(dpo_set, "torch")
    for engine in ("deepspeed", "megatron"):
        got = cli_run(dpo_set, engine, f"training.engine={engine}")
        for a, b in zip(torch_rows, got, strict=True):
            print(f"\n{engine} step {a['step']}: loss {b['loss']:.8f} vs torch {a['loss']:.8f}")
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (engine, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (engine, a, b)
            assert b["dpo_margin"] == pytest.approx(a["dpo_margin"], abs=1e-5), (engine, a, b)
