"""The trajectory store: finished trajectories wait here, grouped by prompt, until
admission takes them into a mini-batch.

Every trajectory carries the policy version that generated it (`Trajectory.version`).
A group (the n samples of one prompt, GRPO's unit) becomes ready when all its
members are in. Media are kept once per content key (`Medium.key`): trajectories
of a group share their prompt's media, so the store holds one copy and counts
what a naive copy per sample would have held.

Accounting always balances (`check()`):

    generated = trained + dropped (by reason) + pending

where pending = trajectories still in the store (partial groups, ready groups,
groups admitted but not yet trained). Nothing leaves the store except by
`mark_trained` or `drop`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loomrl.encoders.media import Medium
from loomrl.platform.trajectory.batch import Trajectory


@dataclass
class Group:
    """The trajectories of one prompt (one dispatch of it)."""

    key: str
    trajectories: list[Trajectory] = field(default_factory=list)
    ready_at: float = 0.0  # clock time its last member arrived
    admitted_at: float = 0.0  # clock time admission took it

    @property
    def version(self) -> int:
        """The oldest policy version among its members (what staleness is measured from)."""
        return min(t.version for t in self.trajectories)

    @property
    def tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.trajectories)


class TrajectoryStore:
    def __init__(self, group_size: int):
        self.group_size = group_size
        self.partial: dict[str, Group] = {}
        self.ready: list[Group] = []  # complete groups in the order they completed
        self.admitted: dict[str, Group] = {}  # taken by admission, not yet trained
        self.media: dict[tuple[str, str], Medium] = {}
        self._media_refs: dict[tuple[str, str], int] = {}
        self.generated = 0
        self.trained = 0
        self.dropped: dict[str, int] = {}
        self.media_bytes_stored = 0  # bytes of media kept, one copy per content key
        self.media_bytes_naive = 0  # bytes had every trajectory kept its own copy

    # ------------------------------------------------------------------ in

    def put(self, traj: Trajectory, group_key: str, now: float = 0.0) -> None:
        """Add a finished trajectory of group `group_key` (its prompt's dispatch)."""
        if group_key in self.admitted or any(g.key == group_key for g in self.ready):
            raise ValueError(f"trajectory store: group {group_key!r} is already complete")
        g = self.partial.setdefault(group_key, Group(group_key))
        traj.media = [self._intern(m) for m in traj.media]
        g.trajectories.append(traj)
        self.generated += 1
        if len(g.trajectories) == self.group_size:
            del self.partial[group_key]
            g.ready_at = now
            self.ready.append(g)

    def _intern(self, m: Medium) -> Medium:
        self.media_bytes_naive += m.nbytes
        kept = self.media.get(m.key)
        if kept is None:
            kept = self.media[m.key] = m
            self.media_bytes_stored += m.nbytes
        self._media_refs[m.key] = self._media_refs.get(m.key, 0) + 1
        return kept

    def _release(self, g: Group) -> None:
        for t in g.trajectories:
            for m in t.media:
                n = self._media_refs[m.key] - 1
                if n:
                    self._media_refs[m.key] = n
                else:  # no pending trajectory uses it any more
                    del self._media_refs[m.key]
                    del self.media[m.key]

    # ------------------------------------------------------------------ out

    def take(self, groups: list[Group], now: float = 0.0) -> None:
        """Admission took these ready groups into a mini-batch."""
        for g in groups:
            self.ready.remove(g)
            g.admitted_at = now
            self.admitted[g.key] = g

    def mark_trained(self, groups: list[Group]) -> None:
        for g in groups:
            del self.admitted[g.key]
            self.trained += len(g.trajectories)
            self._release(g)

    def drop(self, group: Group, reason: str) -> None:
        """Remove a group (ready, partial or admitted) for a stated reason; it is counted."""
        if group in self.ready:
            self.ready.remove(group)
        self.partial.pop(group.key, None)
        self.admitted.pop(group.key, None)
        self.dropped[reason] = self.dropped.get(reason, 0) + len(group.trajectories)
        self._release(group)

    def drop_all(self, reason: str) -> None:
        """Drop everything still pending (the end of a run), counted under `reason`."""
        for g in list(self.partial.values()) + list(self.ready) + list(self.admitted.values()):
            self.drop(g, reason)

    # ------------------------------------------------------------------ accounting

    @property
    def pending(self) -> int:
        groups = list(self.partial.values()) + self.ready + list(self.admitted.values())
        return sum(len(g.trajectories) for g in groups)

    def accounting(self) -> dict:
        return {
            "generated": self.generated,
            "trained": self.trained,
            "dropped": sum(self.dropped.values()),
            "pending": self.pending,
            "dropped_by_reason": dict(self.dropped),
        }

    def check(self) -> None:
        """Raise if a trajectory went missing (or was counted twice)."""
        a = self.accounting()
        if a["generated"] != a["trained"] + a["dropped"] + a["pending"]:
            raise AssertionError(f"trajectory accounting does not balance: {a}")
