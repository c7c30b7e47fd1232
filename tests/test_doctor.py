"""`loomrl doctor`: JSON schema of the last line, the transformers reference measured, and the
aligned setting exact against a hand-rounded reference engine registered in the dispatch table."""

import json
from pathlib import Path

import pytest
import torch
from rounding_reference import aligned_logits

from loomrl.cli import main
from loomrl.commands import doctor
from loomrl.platform.rollout.base import Rollout
from loomrl.platform.trajectory.batch import micro_batches

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"mean_abs_dlogp", "max_abs_dlogp", "kl"}


def _doctor(capsys, demo_shards, engine):
    d, _ = demo_shards
    rc = main(
        [
            "doctor",
            str(ROOT / "recipes" / "demo.yaml"),
            f"data.shards={d}/*.tar",
            "rollout.max_new_tokens=6",
            "--prompts",
            "2",
            "--engine",
            engine,
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report) == {"engine", "dtype", "tokens", "settings", "closest", "auto"}
    means = {name: row["mean_abs_dlogp"] for name, row in report["settings"].items()}
    assert means[report["closest"]] == min(means.values())
    assert report["auto"] == {"torch": "aligned", "vllm": "vllm"}.get(engine)
    assert report["engine"] == engine and report["dtype"] == "bfloat16" and report["tokens"] > 0
    assert list(report["settings"]) == ["native", "rope", "swiglu", "rmsnorm", "attention", "aligned", "vllm"]
    assert all(set(row) == FIELDS for row in report["settings"].values())
    assert "| aligned |" in out  # the table precedes the JSON line
    return report["settings"]


def test_doctor_json_against_transformers_reference(capsys, demo_shards):
    s = _doctor(capsys, demo_shards, "transformers")
    # transformers rounds like `native`: that row is far below the all-aligned one
    assert s["native"]["mean_abs_dlogp"] < 0.5 * s["aligned"]["mean_abs_dlogp"]
    assert all(row["kl"] >= 0 and row["max_abs_dlogp"] >= row["mean_abs_dlogp"] for row in s.values())


def _hand_rounded_engine(model, prompts, params, generator=None):
    """Tokens from the built-in engine; log-probs from the hand-written aligned BF16 forward,
    laid out in the trainer's micro-batches."""
    rollouts = doctor.torch_engine(model, prompts, params, generator)
    policy = doctor.low_precision_copy(model, doctor.SETTINGS["native"])  # regions unused below
    scored = []
    with torch.no_grad():
        for mb in micro_batches(doctor.trajectories(prompts, rollouts), policy.pad_token_id, doctor.MICRO_BATCH):
            embeds = policy.embed(mb.input_ids, mb.media, policy.encode_media([m for r in mb.media for m in r]))
            mask = mb.attention_mask.bool()
            logits = aligned_logits(policy.language_model, embeds, (mask.long().cumsum(-1) - 1).clamp(min=0), mask)
            logp = policy.token_logprobs(logits[:, :-1], params.temperature)
            scored.extend(doctor.completion_logprobs(logp.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1), mb))
    return [
        Rollout(r.prompt_index, r.sample_index, r.completion_ids, s, r.finish_reason) for r, s in zip(rollouts, scored)
    ]


def test_registered_engine_and_aligned_is_exact(capsys, demo_shards):
    doctor.register_engine("hand_rounded", _hand_rounded_engine)
    try:
        s = _doctor(capsys, demo_shards, "hand_rounded")
    finally:
        del doctor.ENGINES["hand_rounded"]
    assert s["aligned"] == {"mean_abs_dlogp": 0.0, "max_abs_dlogp": 0.0, "kl": 0.0}
    assert s["native"]["max_abs_dlogp"] > 0


def test_unknown_engine_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--engine", "magic"])
    assert e.value.code == 2
    assert "magic" in capsys.readouterr().err
