"""Rewards are plain callables: fn(completion: str, sample: dict) -> float.

`sample` is the prompt's record from the shards: id, prompt, answer, meta.
A recipe names one by registry name (below) or as `module:function` (a module on the
Python path, or a `module.py` beside the recipe file):

    slot_match   the demo's templated answers (meta.template, meta.slots): fraction of slots right
    exact_match  the completion equals the answer, whitespace-normalised
    exact        SQuAD-normalised exact match of the final answer (<answer>, \\boxed{}, else all)
    numeric      final number vs the answer's number, relative `tolerance` (default 1e-4)
    choice       multiple-choice letter A-J ("B", "(b)", "The answer is C.", "Answer: D) ...")
    math         final answer (\\boxed{}, else the last number) equal as a string, a number,
                 or an expression (safe converter, no eval), `tolerance` for numbers
    iou          IoU of the completion's first box with the answer's (grounding)
    regex        format reward: 1 if the stripped completion fully matches `pattern` (needed)

The task rewards (exact .. regex) are in `tasks.py`; every one returns a float in [0, 1],
never raises on a completion, and raises ValueError naming the sample when the sample
lacks the answer it needs (`regex` needs none). `build_reward(name, cfg)` gives a registry
reward with its parameters (`tolerance`, `pattern`) read from a reward source's config.
Besides callables, a recipe's `algorithm.rewards` takes learned reward models
(`models.py`) and remote reward servers (`remote.py`), combined in `sources.py`.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from loomrl.platform.rewards.tasks import TASK_REWARDS
from loomrl.platform.rewards.tasks import build_reward as _build_task_reward

_SLOT = re.compile(r"^\{(\w+)\}$")


class RewardError(RuntimeError):
    """A reward that cannot be computed (a sample without the answer its reward reads, a value that
    is not a finite number, a reward server that does not answer): the message names the source and
    the sample. The run stops with a checkpoint of its last whole step and says so."""


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


REGISTRY: dict[str, Callable[..., float]] = {"slot_match": slot_match, "exact_match": exact_match, **TASK_REWARDS}
"""Every reward a recipe can name without a module."""


def build_reward(name: str, cfg: Any = None) -> Callable[[str, dict], float]:
    """The registry reward `name`, with its parameters (tasks.PARAMETERS: `tolerance`, `pattern`)
    read from `cfg` (a reward source's config; None: defaults). ValueError when a required
    parameter is missing or a pattern does not compile; KeyError for an unknown name."""
    if name in TASK_REWARDS:
        return _build_task_reward(name, cfg)
    return REGISTRY[name]
