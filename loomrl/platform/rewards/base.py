"""The reward seam: `REWARDS`, the rewards a recipe names without a module (`algorithm.reward`,
`algorithm.rewards[i].fn`), each registered beside its code, and `build_reward`, which makes the
callable a reward source calls.

A reward is a plain callable, fn(completion: str, sample: dict) -> float (`Reward`); a registered
one may take keyword parameters, read from its reward source's config. Its traits:

    params        the fields of a reward source (`algorithm.rewards[i]`) it takes as keywords:
                  ("tolerance",) for `numeric` and `math`, ("pattern",) for `regex`; default none
    required      those of them without a default (`regex`'s pattern): a source without one is
                  refused
    check_params  fn(**params) raising ValueError on a value the reward cannot use (`regex`: a
                  pattern that does not compile)
    any_answer    true: also scored against each of a sample's `meta.answers` (VQA sets list
                  several), the best score counting
    parts         fn(completion, sample) -> {name: float}: what the reward is made of, for the
                  metrics row only (`slot_match`: each slot right or not, `slot_color`, ...): the
                  trainer reports each part's mean over the completions that have it as
                  `reward_<name>_mean`; parts never enter the reward

build_reward and the recipe's validation (`config.py`) read the entry, so a new reward is one
function and one registration (docs/extending.md); an unknown name is a RecipeError listing the
registered ones.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from loomrl.config.registry import Registry

Reward = Callable[[str, dict], float]
"""What a reward source calls: fn(completion, sample) -> float."""

REWARDS: Registry[Callable[..., float]] = Registry("reward", key="algorithm.reward")
"""The rewards by name, filled by the modules that `loomrl.platform.rewards` imports (`demo.py`:
slot_match, exact_match; `tasks.py`: exact, numeric, choice, math, iou, regex)."""

PART = "part:"
"""The prefix of a diagnostic part's name in a trajectory's `reward_parts`, beside the sources' names
(`rewards/sources.py` score_parts; the trainer reports `part:slot_color` as `reward_slot_color_mean`)."""

MAX_ANSWERS = 32
"""`any_answer`: at most this many of a sample's `meta.answers` are tried."""


class RewardError(RuntimeError):
    """A reward that cannot be computed (a sample without the answer its reward reads, a value that
    is not a finite number, a reward server that does not answer): the message names the source and
    the sample. The run stops with a checkpoint of its last whole step and says so."""


def build_reward(name: str, cfg: Any = None) -> Reward:
    """The registered reward `name` with its parameters (its `params` trait: `tolerance`, `pattern`)
    read from `cfg` (a reward source's config; None: defaults), as a functools.partial when it has
    any. ValueError when a required one is missing or its `check_params` refuses a value (a pattern
    that does not compile); RecipeError listing the registered names for an unknown `name`."""
    entry = REWARDS.get(name)
    params = {p: getattr(cfg, p) for p in entry.trait("params", ()) if getattr(cfg, p, None) is not None}
    missing = [p for p in entry.trait("required", ()) if p not in params]
    if missing:
        raise ValueError(f"the {name!r} reward needs `{missing[0]}` (set it in an algorithm.rewards entry)")
    check = entry.trait("check_params")
    if check is not None:
        check(**params)
    fn: Reward = functools.partial(entry.obj, **params) if params else entry.obj
    return best_of_answers(fn) if entry.trait("any_answer", False) else fn


def reward_parts(name: str) -> Optional[Callable[[str, dict], dict]]:
    """The `parts` trait of the registered reward `name` (None: not registered, or no parts)."""
    return REWARDS.get(name).trait("parts") if name in REWARDS else None


def best_of_answers(fn: Reward) -> Reward:
    """fn scored against each of the sample's `meta.answers` (at most MAX_ANSWERS) when it lists
    more than one; the best score counts."""

    def scored(completion: str, sample: dict) -> float:
        meta = sample.get("meta") if isinstance(sample, dict) else None
        answers = meta.get("answers") if isinstance(meta, dict) else None
        if isinstance(answers, list) and len(answers) > 1 and all(isinstance(a, str) for a in answers):
            return max(fn(completion, {**sample, "answer": a}) for a in answers[:MAX_ANSWERS])
        return fn(completion, sample)

    return scored
