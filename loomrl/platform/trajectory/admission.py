"""Admission: which ready groups of the store form the next mini-batch(es), and when.

Two policies (recipe `pipeline.admission`):

- `train_batch`: nothing is admitted until a whole train batch can be formed
  (`mini_batches` mini-batches of `groups` complete groups each); then all of them
  are admitted at once and trained one after another. Mini-batch k of the batch is
  trained by policy version v + k, so its trajectories are at least k steps stale.
- `mini_batch` (KnitTrans, constraint-preserving): the next mini-batch is admitted
  as soon as its quotas can be met from what is ready, and trained at once.

Quotas, kept by both policies: whole GRPO groups only (a group is never split);
exactly `groups` groups (prompts) per mini-batch; at most `max_tokens` tokens
(prompt + completion) per mini-batch; trajectories at most `max_staleness` steps
older than the version that trains them. A group too stale to ever be trained,
or larger than the token budget on its own, is dropped with that reason (the
store counts it). Ready groups are considered oldest version first, then in the
order they completed, so nothing waits behind newer work forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from loomrl.platform.trajectory.store import Group, TrajectoryStore

Policy = Literal["train_batch", "mini_batch"]


@dataclass
class Quota:
    groups: int  # complete groups (prompts) per mini-batch
    mini_batches: int = 1  # mini-batches per train batch
    max_tokens: int = 0  # token budget per mini-batch (0 = none)
    max_staleness: int = -1  # most versions a trajectory may lag its optimizer step (-1 = no limit)


def _pick(candidates: list[Group], quota: Quota, step_version: int) -> Optional[list[Group]]:
    """Exactly quota.groups whole groups within the token budget and staleness bound, or None."""
    chosen: list[Group] = []
    tokens = 0
    for g in candidates:
        if quota.max_staleness >= 0 and step_version - g.version > quota.max_staleness:
            continue
        if quota.max_tokens and tokens + g.tokens > quota.max_tokens:
            continue  # a smaller group may still fit
        chosen.append(g)
        tokens += g.tokens
        if len(chosen) == quota.groups:
            return chosen
    return None


def drop_unadmittable(store: TrajectoryStore, quota: Quota, trainer_version: int) -> None:
    """Drop ready groups that can never be admitted (counted by the store, with the reason)."""
    for g in list(store.ready):
        if quota.max_staleness >= 0 and trainer_version - g.version > quota.max_staleness:
            store.drop(g, "stale")  # staleness only grows
        elif quota.max_tokens and g.tokens > quota.max_tokens:
            store.drop(g, "over_token_budget")


def admit(
    store: TrajectoryStore, policy: Policy, quota: Quota, trainer_version: int, now: float = 0.0
) -> list[list[Group]]:
    """The mini-batches admitted now, in training order ([] = wait for more).

    trainer_version: the policy version the next optimizer step applies to."""
    drop_unadmittable(store, quota, trainer_version)
    candidates = sorted(store.ready, key=lambda g: g.version)  # stable: completion order within a version
    count = quota.mini_batches if policy == "train_batch" else 1
    if len(candidates) < quota.groups * count:
        return []
    batches: list[list[Group]] = []
    for k in range(count):
        picked = _pick(candidates, quota, trainer_version + k)
        if picked is None:
            return []  # nothing is taken until every mini-batch of the unit can be formed
        batches.append(picked)
        taken = {id(g) for g in picked}
        candidates = [g for g in candidates if id(g) not in taken]
    for b in batches:
        store.take(b, now)
    return batches


def staleness(groups: list[Group], step_version: int) -> list[int]:
    """Per trajectory: the version its optimizer step applies to minus the version that generated it."""
    return [step_version - t.version for g in groups for t in g.trajectories]


def admit_ready(
    store: TrajectoryStore, policy: Policy, quota: Quota, trainer_version: int, now: float = 0.0
) -> list[list[Group]]:
    """Every mini-batch admissible now, in training order (the colocated loop, where a
    step's groups are all ready at once, trains them one after another)."""
    out: list[list[Group]] = []
    while True:
        batches = admit(store, policy, quota, trainer_version + len(out), now)
        if not batches:
            return out
        out += batches


def recipe_quota(recipe) -> Quota:
    """The quotas a recipe sets (loomrl.platform.recipe.Recipe)."""
    tr, pl = recipe.training, recipe.pipeline
    return Quota(tr.prompts_per_step // tr.mini_batches, tr.mini_batches, pl.tokens_per_mini_batch, pl.max_staleness)


def admit_step(
    store: TrajectoryStore, recipe, trajs: list, step: int, drops: Optional[dict[int, str]] = None
) -> list[list[Group]]:
    """The colocated loop's admission: one step's trajectories (groups of `rollout.n`, all
    generated by the current policy) into the store, then every admissible mini-batch.
    `drops`: groups (by `Trajectory.group`) dropped first, with their reasons (dynamic sampling).
    Groups no full mini-batch can take are dropped (counted, reason `not_admitted`): the
    next step brings fresh rollouts."""
    for t in trajs:
        store.put(t, f"{step}:{t.group}")
    for g in list(store.ready):
        reason = (drops or {}).get(g.trajectories[0].group)
        if reason is not None:
            store.drop(g, reason)
    version = trajs[0].version if trajs else 0
    admitted = admit_ready(store, recipe.pipeline.admission, recipe_quota(recipe), version)
    for g in list(store.ready):
        store.drop(g, "not_admitted")
    if not admitted:
        raise RuntimeError(
            f"RL step {step}: no mini-batch could be admitted (quota "
            f"{recipe_quota(recipe)}); raise pipeline.tokens_per_mini_batch or "
            f"pipeline.max_staleness"
        )
    return admitted
