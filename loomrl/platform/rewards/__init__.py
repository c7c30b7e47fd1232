"""Rewards are plain callables: fn(completion: str, sample: dict) -> float.

`sample` is the prompt's record from the shards: id, prompt, answer, meta.
A recipe names one by its registered name (below) or as `module:function` (a module on the
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

Each registers itself in `REWARDS` (base.py, the seam) beside its code, with its traits (the
parameters it takes, which are required, whether `meta.answers` all count): slot_match and
exact_match in `demo.py`, the task rewards (exact .. regex) in `tasks.py`, which read answers with
`answers.py` and compare maths with `expressions.py`. Every task reward returns a float in [0, 1],
never raises on a completion, and raises ValueError naming the sample when the sample lacks the
answer it needs (`regex` needs none). `build_reward(name, cfg)` gives a registered reward with its
parameters (`tolerance`, `pattern`) read from a reward source's config; an unknown name is a
RecipeError listing the registered ones. This package imports the modules that register, so the
registry is full whichever module is imported first.
Besides callables, a recipe's `algorithm.rewards` takes learned reward models
(`models.py`) and remote reward servers (`remote.py`), combined in `sources.py`.
"""

from __future__ import annotations

from loomrl.platform.rewards import demo, tasks  # noqa: F401 (registration)
from loomrl.platform.rewards.base import REWARDS, Reward, RewardError, build_reward
from loomrl.platform.rewards.demo import exact_match, slot_match

__all__ = ["REWARDS", "Reward", "RewardError", "build_reward", "exact_match", "slot_match"]
