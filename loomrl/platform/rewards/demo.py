"""The plainest rewards, registered by name: `slot_match` (the demo task's templated answers) and
`exact_match` (the completion is the answer, whitespace-normalised).

Design: they read the sample as the demo's shards write it (`answer`; `meta.template` with `{slot}`
words and `meta.slots`) and take no parameters; the task rewards, with their answer reading and
data-error guarantees, are in `tasks.py`.
"""

from __future__ import annotations

import re

from loomrl.platform.rewards.base import REWARDS

_SLOT = re.compile(r"^\{(\w+)\}$")


def slots_right(completion: str, sample: dict) -> dict[str, float]:
    """`slot_match`'s parts: per slot of the sample's template, `slot_<name>` 1.0 when the
    completion has the template's words in place and that slot's word right, else 0.0."""
    meta = sample["meta"]
    words, template = completion.split(), meta["template"].split()
    slots = [(i, m.group(1)) for i, t in enumerate(template) if (m := _SLOT.match(t))]
    in_place = len(words) == len(template) and all(w == t for w, t in zip(words, template) if not _SLOT.match(t))
    return {f"slot_{name}": float(in_place and words[i] == meta["slots"][name]) for i, name in slots}


@REWARDS.register("slot_match", parts=slots_right)
def slot_match(completion: str, sample: dict) -> float:
    """For templated answers (meta.template with {slot} words, meta.slots): 0 unless the
    completion has the template's words in place; then the fraction of slots right."""
    right = slots_right(completion, sample)
    return sum(right.values()) / max(1, len(sample["meta"]["slots"]))


@REWARDS.register("exact_match")
def exact_match(completion: str, sample: dict) -> float:
    """1 if the completion equals the reference answer (whitespace-normalised), else 0."""
    return float(completion.split() == sample["answer"].split())
