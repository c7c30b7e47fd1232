"""Drafting that pays for itself: the draft length, chosen per target forward by what it measurably buys.

Drafting k tokens per row buys accepted tokens (how many depends on the prompt, its history and the
policy) and costs the target k more positions per row plus the drafter's lookups. What those cost
depends on the model, the batch, the engine and the device: a 0.5B model decoding a few rows is
memory-bound, so extra positions are nearly free; the demo's tiny model at 256 rows is bound by the
per-row lookups in Python, so even well-accepted drafts can lose. No fixed k is right everywhere,
so the engine measures instead of guessing, one forward at a time:

- the arms are draft lengths k in {0 (plain decoding), 1, 2, 4, ..., K}, and with
  `rollout.drafter.tree_nodes` one more after K: a draft tree of that many tokens, K deep;
- an arm's *cost* is measured: seconds per row of its forwards (the lookups that prepared the
  drafts, the forward and the verification), a ratio of sums decayed by 0.95 per forward since,
  so one slow forward moves it little and an arm measured long ago counts by its newest forwards;
- its *gain* is estimated from every forward that drafted, whatever its arm: the acceptance rate
  a_i of draft position i (rows that had positions 0..i accepted over rows that were allowed to
  draft position i, decayed by 0.99 per forward: a row with no draft or a shorter one counts as
  not accepted), and an arm drafting k tokens commits 1 + a_0 + ... + a_(k-1) tokens per row
  (a position never offered yet counts as its predecessor's rate: optimistic, so it is tried);
  a tree's gain is its own forwards' committed tokens per row, decayed as its cost;
- its *rate* is gain / cost, committed tokens per second per row. The next forward runs the arm
  with the best rate (plain decoding at first, so a job starts no slower than without a drafter).
  An arm next to the best one (one step shorter or longer) that was never measured is tried at
  once, so a run where drafting pays climbs to its best k in a few forwards; one that was measured
  is tried again once its measurement is `explore` forwards old. A tried arm runs until it has
  served 16 rows (one forward of a large batch, four of a batch of 4), so one unlucky forward of a
  small batch does not rule it out. `explore` starts at 32 forwards and quadruples, to at most 256,
  each time the retried arm loses again, so an arm that does not pay gets at most one probe in 32
  forwards, and in steady state one in 256 (a recheck where lookups dominate, the demo's 256 rows,
  costs about two plain forwards).

Pooling the acceptance over arms is what makes the choice stable: a forward's committed tokens
vary a lot from row to row, its duration little, so an arm's rate is not at the mercy of a few
unlucky rejections.

The decision and its inputs reach the metrics row (`summary`): the mean k per forward, the best arm
with its estimated gain and measured cost (`draft_k_gain`, `draft_k_row_cost_s`), every measured arm's
rate (`draft_k<k>_row_tokens_per_s`) and the pooled acceptance by position
(`draft_control_accept_pos<i>`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

EXPLORE_FIRST, EXPLORE_MAX = 32, 256
DECAY = 0.95  # an arm's cost: its seconds over its rows, both decayed by this per forward elapsed
ACCEPT_DECAY = 0.99  # the acceptance by position: drafted and accepted counts, decayed by this per forward
PROBE_ROWS = 16  # a (re)checked arm runs consecutive forwards until it has drafted for this many rows


def arms(k_max: int) -> list[int]:
    """0, 1, 2, 4, ... up to and including k_max."""
    out, k = [0], 1
    while k < k_max:
        out.append(k)
        k *= 2
    return out + [k_max]


class Choice(NamedTuple):
    k: int  # draft depth: tokens per draft (0: plain decoding)
    nodes: int = 0  # > 0: a draft tree of at most this many tokens, at most k deep


@dataclass
class _Arm:
    k: int
    nodes: int = 0
    rows: float = 0.0  # decayed sums over this arm's forwards: its cost is seconds per row
    seconds: float = 0.0
    tokens: float = 0.0  # ... and committed tokens (a tree arm's own gain: trees are not pooled)
    measured: int = 0  # forwards measured
    last: int = -1  # forward index of the last measurement
    explore: int = EXPLORE_FIRST

    @property
    def cost(self) -> float:
        return self.seconds / self.rows if self.rows > 0 else 0.0


class DraftController:
    """Chooses each forward's draft length from measured rates (module docstring)."""

    def __init__(self, k_max: int, tree_nodes: int = 0):
        self.arms = [_Arm(k) for k in arms(k_max)] + ([_Arm(k_max, tree_nodes)] if tree_nodes > 0 else [])
        self.offered = [0.0] * k_max  # decayed: rows allowed to draft position i
        self.accepted = [0.0] * k_max  # ... that had positions 0..i accepted
        self.best = 0  # index into arms
        self.forwards = 0
        self.chosen: list[Choice] = []  # each forward's draft since the last `summary`
        self._probing: int | None = None  # the arm being (re)checked, until it has seen PROBE_ROWS rows
        self._probe_rows = 0

    def choose(self) -> Choice:
        """The draft for the next forward."""
        pick = self.best if self._probing is None else self._probing
        for i in (self.best + 1, self.best - 1) if self._probing is None else ():
            if 0 <= i < len(self.arms) and self.arms[self.best].measured:
                arm = self.arms[i]
                if arm.measured == 0 or self.forwards - arm.last >= arm.explore:
                    pick, self._probing, self._probe_rows = i, i, 0
                    break
        self._pending = pick
        self.chosen.append(Choice(self.arms[pick].k, self.arms[pick].nodes))
        return self.chosen[-1]

    def gain(self, k: int, nodes: int = 0) -> float:
        """Expected tokens committed per row by a forward drafting k tokens (a tree: as measured)."""
        if nodes:
            arm = next(a for a in self.arms if a.nodes == nodes)
            return arm.tokens / arm.rows if arm.rows else 1.0 + self.gain(k)  # untried: optimistic
        total, rate = 1.0, 1.0
        for i in range(k):
            if self.offered[i] > 0:
                rate = self.accepted[i] / self.offered[i]
            total += rate
        return total

    def rate(self, arm: _Arm) -> float:
        return self.gain(arm.k, arm.nodes) / arm.cost if arm.cost > 0 else 0.0

    def observe(self, seconds: float, rows: int, accepted: list[int], tokens: int = 0) -> None:
        """The forward chosen last took `seconds` (lookups, forward, verification) for `rows` rows,
        accepted[i] of which had draft positions 0..i accepted, and committed `tokens` in all."""
        i = self._pending
        arm = self.arms[i]
        fade = DECAY ** (self.forwards - arm.last)  # by forwards elapsed: a rechecked arm's old cost fades
        arm.tokens = fade * arm.tokens + tokens
        for p in range(len(self.offered) if not arm.nodes else 0):
            self.offered[p] = ACCEPT_DECAY * self.offered[p] + (rows if p < arm.k else 0)
            self.accepted[p] = ACCEPT_DECAY * self.accepted[p] + (accepted[p] if p < min(arm.k, len(accepted)) else 0)
        arm.rows = fade * arm.rows + max(rows, 1)
        arm.seconds = fade * arm.seconds + max(seconds, 1e-9)
        arm.measured += 1
        arm.last = self.forwards
        self.forwards += 1
        best = self.arms[self.best]
        if i != self.best:
            self._probe_rows += rows
            if self._probe_rows < PROBE_ROWS:
                return  # too few rows yet to judge (a batch of 4 rows: 4 forwards)
            self._probing = None
            if self.rate(arm) > self.rate(best):
                best.explore = EXPLORE_FIRST  # the old best stays a neighbour worth rechecking
                self.best = i
                arm.explore = EXPLORE_FIRST
            else:
                arm.explore = min(EXPLORE_MAX, 4 * arm.explore)
        else:  # the pooled acceptance moves every arm's rate: a measured neighbour may now lead
            for n in (i - 1, i + 1):
                if 0 <= n < len(self.arms) and self.arms[n].measured and self.rate(self.arms[n]) > self.rate(best):
                    self.best = n
                    break

    def summary(self) -> dict:
        """The decision and its inputs since the last call, for the metrics row."""
        n = max(1, len(self.chosen))
        out = {"draft_k_mean": sum(c.k for c in self.chosen) / n, "draft_k_best": self.arms[self.best].k}
        if self.arms[-1].nodes:
            out["draft_tree_share"] = sum(c.nodes > 0 for c in self.chosen) / n
        out.update(
            {
                (f"draft_tree{a.nodes}" if a.nodes else f"draft_k{a.k}") + "_row_tokens_per_s": self.rate(a)
                for a in self.arms
                if a.measured
            }
        )
        best = self.arms[self.best]
        out["draft_k_gain"] = self.gain(best.k, best.nodes)  # expected tokens per row, best arm
        out["draft_k_row_cost_s"] = best.cost  # measured seconds per row, best arm
        out.update(
            {f"draft_control_accept_pos{i}": a / d for i, (a, d) in enumerate(zip(self.accepted, self.offered)) if d}
        )
        self.chosen = []
        return out

    def state_dict(self) -> dict:
        return {
            "best": self.best,
            "forwards": self.forwards,
            "probing": self._probing,
            "probe_rows": self._probe_rows,
            "offered": list(self.offered),
            "accepted": list(self.accepted),
            "arms": [[a.k, a.nodes, a.rows, a.seconds, a.tokens, a.measured, a.last, a.explore] for a in self.arms],
        }

    def load_state_dict(self, state: dict) -> None:
        saved = {(row[0], row[1]): row for row in state["arms"] if len(row) == 8}  # (older layouts: start afresh)
        for a in self.arms:
            if (a.k, a.nodes) in saved:
                _, _, a.rows, a.seconds, a.tokens, a.measured, a.last, a.explore = saved[(a.k, a.nodes)]
        n = len(self.offered)
        self.offered = (list(state.get("offered", [])) + [0.0] * n)[:n]
        self.accepted = (list(state.get("accepted", [])) + [0.0] * n)[:n]
        self.best = min(state["best"], len(self.arms) - 1)
        self.forwards = state["forwards"]
        probing = state.get("probing")
        self._probing = probing if probing is not None and probing < len(self.arms) else None
        self._probe_rows = state.get("probe_rows", 0)
