"""The demo's RL still learns: a short run of recipes/demo.yaml as it is (model, GRPO settings,
mini-batches, learning-rate schedule, reward), started from a policy that a short *answer*
warm-up taught part of the content, must raise the reward from the reward alone, above a
control run that is the same in everything but a learning rate of ~0.

The whole demo (500 RL steps from chance) is `make demo` / `loomrl bench demo`; at suite
size this catches what makes RL stop learning: a flipped advantage, a loss that does not
reach the weights, an optimizer that does not step, a learning-rate schedule at zero, media
that stop reaching the model. The two runs see the same prompts in the same order, so the
prompts' difficulty cancels out of the comparison.
"""

import json
from pathlib import Path

import pytest

from loomrl.cli import main

ROOT = Path(__file__).resolve().parent.parent
SHORT = [
    "training.steps=40",
    "training.warmup.steps=100",
    "training.warmup.target=answer",
    "training.prompts_per_step=16",
    "checkpoint.every=0",
    "logging.tensorboard=false",
    "goal=null",
    "training.threads=2",
]


def rewards(tmp_path, name, demo_shards, extra=()):
    out = tmp_path / name
    assert (
        main(
            [
                "run",
                str(ROOT / "recipes" / "demo.yaml"),
                "--out",
                str(out),
                f"data.shards={demo_shards[0]}/*.tar",
                "data.demo=null",
                *SHORT,
                *extra,
            ]
        )
        == 0
    )
    return [json.loads(x)["reward_mean"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "extra",
    [["training.warmup.steps=60"], ["model.lora.rank=8", "training.steps=60", "training.warmup.steps=60"]],
    ids=["full", "lora"],
)
def test_demo_rl_raises_the_reward_above_a_control_that_does_not_learn(tmp_path, demo_shards, extra):
    """`full`: 60 warm-up steps, not 100: with the recipe's grad_clip 0.5 the 100-step warm-up
    already reaches ~0.63 on these 24 samples, and 40 RL steps from there rose 0.03 above the
    control on one CPU and not on another; from ~0.42 the learner ends 0.085-0.093 above it
    (AVX2 and AVX-512 kernels; measured with trained towers, before the recipe froze them).
    `lora`: the same with LoRA adapters on the language model (its own weights frozen; warm-up
    and RL train the adapters and embeddings, and the audio projector: the recipe freezes the towers),
    with the recipe's alpha 64, 60 warm-up and 60 RL steps: the 100-step warm-up alone already
    reaches ~0.91 with alpha 64; after 60 the first rollouts are at ~0.52, and the learner's last
    15 steps were 0.19 above the control's (AVX-512, 2026-12-08)."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    learner = rewards(tmp_path, "learn", demo_shards, extra)
    control = rewards(tmp_path, "control", demo_shards, [*extra, "training.lr=1e-12"])
    assert control[0] == learner[0]  # the same warm-up and first rollouts
    assert mean(learner[-15:]) >= mean(control[-15:]) + 0.03, (learner, control)
    assert mean(learner[-10:]) >= mean(learner[:5]) + 0.05, learner
