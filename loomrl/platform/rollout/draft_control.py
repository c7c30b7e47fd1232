"""Drafting that pays for itself: the draft length, chosen per target forward by what it measurably buys.

Drafting k tokens per row buys accepted tokens (how many depends on the prompt, its history and the
policy) and costs the target k more positions per row plus the drafter's lookups. What those cost
depends on the model, the batch, the engine and the device: a 0.5B model decoding a few rows is
memory-bound, so extra positions are nearly free; the demo's tiny model at 256 rows is bound by the
per-row lookups in Python, so even well-accepted drafts can lose. No fixed k is right everywhere,
so the engine measures instead of guessing, one forward at a time:

- the arms are draft lengths k in {0 (plain decoding), 1, 2, 4, ..., K};
- each forward runs one arm; its *rate* is the tokens that forward committed for the row furthest
  behind (a batch of rollouts takes as long as its last row) divided by what it took
  (the lookups that prepared its drafts, the forward and the verification); an arm's rate is its
  tokens over its seconds, both summed over its forwards, each weighted by 0.95 per forward since
  (a ratio of sums, so one lucky or unlucky forward moves it little, and an arm measured long ago
  counts mostly by its newest measurement);
- the next forward runs the arm with the best rate (plain decoding at first, so a job starts no
  slower than without a drafter). An arm next to the best one (one step shorter or longer) that was
  never measured is tried at once, so a run where drafting pays climbs to its best k in a few
  forwards; one that was measured is tried again once its measurement is `explore` forwards old.
  `explore` starts at 32 forwards and quadruples, to at most 256, each time the retried arm loses
  again, so an arm that does not pay gets at most one forward in 32, and in steady state one in 256
  (a recheck where lookups dominate, the demo's 256 rows, costs about two plain forwards).

The decision and its inputs reach the metrics row (`summary`): the mean k per forward, the best arm
and every measured arm's rate (`draft_k<k>_row_tokens_per_s`: the last row's tokens per second).
"""
from __future__ import annotations

from dataclasses import dataclass

EXPLORE_FIRST, EXPLORE_MAX = 32, 256
DECAY = 0.95  # an arm's rate: its committed tokens over its seconds, both decayed by this per forward elapsed


def arms(k_max: int) -> list[int]:
    """0, 1, 2, 4, ... up to and including k_max."""
    out, k = [0], 1
    while k < k_max:
        out.append(k)
        k *= 2
    return out + [k_max]


@dataclass
class _Arm:
    k: int
    tokens: float = 0.0     # decayed sums over this arm's forwards: its rate is their ratio
    seconds: float = 0.0
    measured: int = 0       # forwards measured
    last: int = -1          # forward index of the last measurement
    explore: int = EXPLORE_FIRST

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class DraftController:
    """Chooses each forward's draft length from measured rates (module docstring)."""

    def __init__(self, k_max: int):
        self.arms = [_Arm(k) for k in arms(k_max)]
        self.best = 0           # index into arms
        self.forwards = 0
        self.chosen: list[int] = []   # k of each forward since the last `summary`

    def choose(self) -> int:
        """The draft length for the next forward."""
        pick = self.best
        for i in (self.best + 1, self.best - 1):
            if 0 <= i < len(self.arms) and self.arms[self.best].measured:
                arm = self.arms[i]
                if arm.measured == 0 or self.forwards - arm.last >= arm.explore:
                    pick = i
                    break
        self._pending = pick
        self.chosen.append(self.arms[pick].k)
        return self.arms[pick].k

    def observe(self, tokens: int, seconds: float) -> None:
        """The forward chosen last advanced the batch by `tokens` in `seconds` (lookups, forward,
        verification). The engine passes the tokens committed for the row furthest behind: a
        batch of rollouts takes as long as its last row, so rows that drafted well while another
        did not have not made the batch any faster."""
        i = self._pending
        arm = self.arms[i]
        fade = DECAY ** (self.forwards - arm.last)  # by forwards elapsed: a rechecked arm's old rate fades
        arm.tokens = fade * arm.tokens + tokens
        arm.seconds = fade * arm.seconds + max(seconds, 1e-9)
        arm.measured += 1
        arm.last = self.forwards
        self.forwards += 1
        if i != self.best:
            if arm.rate > self.arms[self.best].rate:
                self.arms[self.best].explore = EXPLORE_FIRST  # the old best stays a neighbour worth rechecking
                self.best = i
                arm.explore = EXPLORE_FIRST
            else:
                arm.explore = min(EXPLORE_MAX, 4 * arm.explore)

    def summary(self) -> dict:
        """The decision and its inputs since the last call, for the metrics row."""
        out = {"draft_k_mean": sum(self.chosen) / len(self.chosen) if self.chosen else 0.0,
               "draft_k_best": self.arms[self.best].k}
        out.update({f"draft_k{a.k}_row_tokens_per_s": a.rate for a in self.arms if a.measured})
        self.chosen = []
        return out

    def state_dict(self) -> dict:
        return {"best": self.best, "forwards": self.forwards,
                "arms": [[a.k, a.tokens, a.seconds, a.measured, a.last, a.explore] for a in self.arms]}

    def load_state_dict(self, state: dict) -> None:
        saved = {row[0]: row for row in state["arms"]}
        for a in self.arms:
            if a.k in saved:
                _, a.tokens, a.seconds, a.measured, a.last, a.explore = saved[a.k]
        self.best = min(state["best"], len(self.arms) - 1)
        self.forwards = state["forwards"]
