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


@REWARDS.register("slot_match")
def slot_match(completion: str, sample: dict) -> float:
    """For templated answers (meta.template with {slot} words, meta.slots): 0 unless the
    completion has the template's words in place; then the fraction of slots right."""
    meta = sample["meta"]
    words, template = completion.split(), meta["template"].split()
    if len(words) != len(template):
        return 0.0
    right = 0
    for w, t in zip(words, template):
        slot = _SLOT.match(t)
        if slot:
            right += w == meta["slots"][slot.group(1)]
        elif w != t:
            return 0.0
    return right / max(1, len(meta["slots"]))


@REWARDS.register("exact_match")
def exact_match(completion: str, sample: dict) -> float:
    """1 if the completion equals the reference answer (whitespace-normalised), else 0."""
    return float(completion.split() == sample["answer"].split())
