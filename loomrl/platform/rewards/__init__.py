"""Rewards are plain callables: fn(completion: str, sample: dict) -> float.

`sample` is the prompt's record from the shards: id, prompt, answer, meta.
A recipe names one by registry name (below) or as `module:function`.
"""
from __future__ import annotations

import re

_SLOT = re.compile(r"^\{(\w+)\}$")


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


def exact_match(completion: str, sample: dict) -> float:
    """1 if the completion equals the reference answer (whitespace-normalised), else 0."""
    return float(completion.split() == sample["answer"].split())


REGISTRY = {"slot_match": slot_match, "exact_match": exact_match}
