"""A reward's diagnostic parts (the `parts` trait, rewards/base.py): `slot_match` reports which slots
of each demo sentence were right (`slot_size`, `slot_color`, `slot_pitch`), the reward itself is what
it was (the mean of its parts, 0 on a broken sentence), the trainer reports each part's mean over
the trajectories that have it, and a run's metrics rows carry them."""

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

from loomrl.cli import main
from loomrl.datasets.demo import CHOICES, make_sample
from loomrl.platform.recipe import AlgorithmConfig, RewardSourceConfig
from loomrl.platform.rewards import slot_match
from loomrl.platform.rewards.demo import slots_right
from loomrl.platform.rewards.sources import build_sources, score_parts
from loomrl.platform.rl_step import reward_part_means

ROOT = Path(__file__).resolve().parent.parent


def reference_slot_match(completion: str, sample: dict) -> float:
    """slot_match as it was before it had parts (the demo grids ran with this one)."""
    meta = sample["meta"]
    words, template = completion.split(), meta["template"].split()
    if len(words) != len(template):
        return 0.0
    right = 0
    for w, t in zip(words, template):
        slot = re.match(r"^\{(\w+)\}$", t)
        if slot:
            right += w == meta["slots"][slot.group(1)]
        elif w != t:
            return 0.0
    return right / max(1, len(meta["slots"]))


def samples(n=30):
    rng = random.Random(0)
    return [make_sample(i, rng) for i in range(n)]


def variants(sample: dict, rng: random.Random) -> list[str]:
    """The answer, each slot word replaced by each choice, a template word changed, a word dropped
    or added, random words of the right length."""
    words = sample["answer"].split()
    template = sample["meta"]["template"].split()
    vocab = sorted({w for s in CHOICES.values() for w in s} | set(template) - {t for t in template if "{" in t})
    out = [sample["answer"], " ".join(words[:-1]), sample["answer"] + " again", ""]
    for i, t in enumerate(template):
        if t.startswith("{"):
            for c in CHOICES[t[1:-1]]:
                out.append(" ".join(words[:i] + [c] + words[i + 1 :]))
        else:
            out.append(" ".join(words[:i] + ["shape" if t != "shape" else "tone"] + words[i + 1 :]))
    out += [" ".join(rng.choice(vocab) for _ in words) for _ in range(20)]
    return out


def test_parts_say_which_slots_are_right_and_the_reward_is_unchanged():
    rng = random.Random(1)
    seen = set()
    for s in samples():
        slots = s["meta"]["slots"]
        for c in variants(s, rng):
            parts = slots_right(c, s)
            assert set(parts) == {f"slot_{k}" for k in slots}  # every slot of the sample, only those
            assert slot_match(c, s) == reference_slot_match(c, s) == sum(parts.values()) / len(slots)
            seen.add(sum(parts.values()))
        assert slots_right(s["answer"], s) == {f"slot_{k}": 1.0 for k in slots}
        wrong = s["answer"].replace(" " + slots["size" if "size" in slots else "pitch"] + " ", " nope ")
        assert sum(slots_right(wrong, s).values()) == len(slots) - 1
        broken = s["answer"].replace("shape", "tone").replace("sound", "picture")
        assert set(slots_right(broken, s).values()) == {0.0}  # a broken sentence: no slot counts
    assert {0.0, 1.0, 2.0} <= seen  # the variants reached partly right sentences


def test_sources_name_their_parts_and_the_step_averages_each_over_the_samples_that_have_it():
    ss = samples(6)
    texts = [s["answer"] for s in ss[:3]] + ["x"] * 3
    (one,) = build_sources(AlgorithmConfig(reward="slot_match"))
    totals, parts = score_parts([one], texts, ss)
    assert totals == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    for p, s in zip(parts, ss):
        assert p["slot_match"] in (0.0, 1.0)
        assert {k for k in p if k.startswith("part:")} == {f"part:slot_{k}" for k in s["meta"]["slots"]}
    two = build_sources(
        AlgorithmConfig(rewards=[RewardSourceConfig(fn="slot_match"), RewardSourceConfig(fn="exact_match", weight=0.5)])
    )
    _, parts2 = score_parts(two, texts, ss)
    assert all(k in ("slot_match", "exact_match") or k.startswith("part:slot_match_slot_") for k in parts2[0])

    trajs = [SimpleNamespace(reward_parts=p) for p in parts]
    means = reward_part_means(trajs, listed_sources=False)
    assert "reward_slot_match_mean" not in means  # one source: its mean is reward_mean
    for k in ("size", "color", "pitch"):
        have = [p[f"part:slot_{k}"] for p in parts if f"part:slot_{k}" in p]
        assert have and means[f"reward_slot_{k}_mean"] == sum(have) / len(have)
    assert reward_part_means(trajs, listed_sources=True)["reward_slot_match_mean"] == 0.5


def test_a_run_reports_the_slots(tmp_path):
    out = tmp_path / "run"
    rc = main(
        [
            "run",
            str(ROOT / "recipes" / "demo.yaml"),
            "--out",
            str(out),
            f"data.shards={tmp_path}/shards/demo-*.tar",
            "data.demo.samples=48",
            "training.steps=2",
            "training.warmup.steps=0",
            "training.mini_batches=1",
            "training.prompts_per_step=8",
            "rollout.n=2",
            "logging.tensorboard=false",
            "goal=null",
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for k in ("size", "color", "pitch"):
            assert 0.0 <= r[f"reward_slot_{k}_mean"] <= 1.0
        assert "reward_slot_match_mean" not in r
