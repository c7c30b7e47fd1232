"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): a group whose samples all got the same
reward has zero group-relative advantage, so it costs a full forward and backward and teaches
nothing. Such groups are dropped and more prompts are drawn until the step holds
`training.prompts_per_step` groups with a reward spread.

    informative(group)  =  std(rewards of the group) > algorithm.dynamic_sampling.min_reward_std

Where the extra prompts come from is the trajectory source's business:

- colocated (trajectory/sources.py): extra generation rounds, at most `max_rounds` per step. Each
  round draws the deficit scaled by the share kept so far (at least the deficit, at most one step's
  prompts). If the rounds run out, the step is topped up with the earliest dropped groups, so every
  step trains a full batch (reported as `dynamic_zero_var_trained`); groups past the step's need
  are dropped as `surplus`.
- disaggregated (disaggregated.py): a finished group without spread is dropped on arrival and the
  dispatcher's back-pressure sends another prompt, up to max_rounds x prompts_per_step drops a step;
  later ones are kept.

Every dropped trajectory is counted by the store under its reason (`zero_variance`, `surplus`), so
the books balance: generated = trained + dropped + pending. The decisions depend only on rewards
and counts, never on timings, so seeded runs and resumes repeat them exactly.

Step metrics (`DynamicBooks.row`): dynamic_groups (groups generated this step), dynamic_dropped
(groups dropped for zero variance), dynamic_dropped_frac, dynamic_extra_rounds, and
dynamic_zero_var_trained.
"""

from __future__ import annotations

import math

import torch

from loomrl.platform.algorithms.config import DynamicSamplingConfig


def informative(rewards: list[float], cfg: DynamicSamplingConfig) -> bool:
    """True when the group's rewards have more spread than cfg.min_reward_std (population std)."""
    if len(rewards) < 2:
        return False
    return float(torch.tensor(rewards, dtype=torch.float64).std(unbiased=False)) > cfg.min_reward_std


def next_round_prompts(wanted: int, kept: int, generated: int) -> int:
    """Prompts to draw in the next round: the deficit divided by the share of groups kept so far,
    at least the deficit, at most one step's `wanted`."""
    deficit = wanted - kept
    if kept == 0:
        return wanted
    return min(wanted, max(deficit, math.ceil(deficit * generated / kept)))


class DynamicBooks:
    """One step's counts of the filter, reset by `row`."""

    def __init__(self) -> None:
        self.groups = self.dropped = self.zero_var_trained = 0
        self.extra_rounds = 0.0

    def row(self) -> dict:
        out = {
            "dynamic_groups": self.groups,
            "dynamic_dropped": self.dropped,
            "dynamic_dropped_frac": self.dropped / max(1, self.groups),
            "dynamic_extra_rounds": self.extra_rounds,
            "dynamic_zero_var_trained": self.zero_var_trained,
        }
        self.__init__()  # type: ignore[misc]
        return out


def split_groups(
    groups: list[list[float]], cfg: DynamicSamplingConfig, wanted: int, books: DynamicBooks
) -> tuple[list[int], dict[int, str]]:
    """The colocated step's choice among its generated groups (their rewards, in generation order):
    the indices kept (exactly `wanted`, or fewer if fewer were generated) and the reason each other
    group is dropped. Informative groups come first in generation order; dropped ones top the step up
    when there are too few."""
    good = [i for i, g in enumerate(groups) if informative(g, cfg)]
    flat = [i for i, g in enumerate(groups) if not informative(g, cfg)]
    fill = flat[: max(0, wanted - len(good))]
    kept = sorted(good[:wanted] + fill)
    drops = {i: "zero_variance" for i in flat if i not in fill}
    drops.update({i: "surplus" for i in good[wanted:]})
    books.groups += len(groups)
    books.dropped += len(flat) - len(fill)
    books.zero_var_trained += len(fill)
    return kept, drops
