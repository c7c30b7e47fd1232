"""Drafting that pays for itself: the draft length, chosen per target forward by what it measurably buys.

Drafting k tokens per row buys accepted tokens (how many depends on the prompt, its history and the
policy) and costs the target k more positions per row plus the drafter's lookups. What those cost
depends on the model, the batch, the engine and the device: a 0.5B model decoding a few rows is
memory-bound, so extra positions are nearly free; the demo's tiny model at 256 rows is bound by the
per-row lookups in Python, so even well-accepted drafts can lose. No fixed k is right everywhere,
so the engine measures instead of guessing. It measures once, and then decides from counted work
alone, so that a seeded run, a second run of the same seed and a resumed run choose the same draft
lengths (and so score the same forward widths and, in vLLM, draw the same tokens):

- **a cost model, calibrated once per run**: a forward's seconds are modelled as
  `forward_s + rows x row_s + positions x position_s + lookups x lookup_s` (rows decoded,
  positions scored: rows x the forward's width, lookups: rows that drafted). The first forwards run
  a fixed schedule, whatever their timings: plain decoding every other forward and the drafting
  arms in turn between, until `CALIBRATION` forwards of which `CAL_DRAFTED` scored real drafts
  (drafts exist only once histories do; `CAL_MAX` forwards if drafts never land); their measured
  seconds are then fitted by non-negative least squares, and the fit is kept in the controller's
  state (checkpoints, the metrics row: `draft_cost_*_s`). From then on the clock is not read: every
  forward's cost is the model's cost of its counted work;

- the arms are draft lengths k in {0 (plain decoding), 1, 2, 4, ..., K}, and with
  `rollout.drafter.tree_nodes` one more after K: a draft tree of that many tokens, K deep;
- an arm's *cost* is the modelled seconds per row of a forward of the current width of the batch
  (the last forward's rows) on that arm: the lookups that prepare its drafts, the forward and the
  verification, from the arm's positions and lookups per row (sums of its counted work decayed by
  0.95 per forward since: a row drafts at most twice what its last draft got committed, so an
  arm's width follows the acceptance);
- its *gain* is estimated from every forward that drafted, whatever its arm: the acceptance rate
  a_i of draft position i (rows that had positions 0..i accepted over rows that were allowed to
  draft position i, decayed by 0.99 per forward: a row with no draft or a shorter one counts as
  not accepted), and an arm drafting k tokens commits 1 + a_0 + ... + a_(k-1) tokens per row
  (a position never offered yet counts as its predecessor's rate: optimistic, so it is tried);
  a tree's gain is its own forwards' committed tokens per row, decayed as its cost;
- its *rate* is gain / cost, committed tokens per second per row. After calibration the next forward runs
  the arm with the best rate.
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

import fcntl
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch

log = logging.getLogger(__name__)

EXPLORE_FIRST, EXPLORE_MAX = 32, 256
DECAY = 0.95  # an arm's work (rows, positions, lookups, tokens): sums decayed by this per forward elapsed
ACCEPT_DECAY = 0.99  # the acceptance by position: drafted and accepted counts, decayed by this per forward
PROBE_ROWS = 16  # a (re)checked arm runs consecutive forwards until it has drafted for this many rows
CALIBRATION = 32  # forwards on the fixed schedule before the cost model is fitted ...
CAL_DRAFTED = 8  # ... at least this many of which scored real drafts (positions > rows) ...
CAL_MAX = 512  # ... or this many forwards in all, where drafts never land


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


class Work(NamedTuple):
    """One forward's counted work (and, for calibration only, its measured seconds)."""

    arm: int  # index into the controller's arms
    forward: int  # the controller's forward index
    rows: int
    positions: int
    lookups: int
    tokens: int  # tokens committed (a tree arm's own gain)
    seconds: float


class CostModel(NamedTuple):
    """A forward's seconds from its counted work, fitted once per run (module docstring)."""

    forward_s: float
    row_s: float
    position_s: float
    lookup_s: float

    def seconds(self, rows: int, positions: int, lookups: int) -> float:
        return self.forward_s + rows * self.row_s + positions * self.position_s + lookups * self.lookup_s


TIE = 1e-9  # residuals this close (relative to the larger of the best residual and the data) tie


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every subset of columns (4 columns: 15 small solves).
    A subset whose columns are collinear (the rows column of forwards that all had the same rows,
    beside the constant one) is skipped, and residuals within TIE of each other are a tie won by the
    subset tried first, so the fit does not depend on the last bits of a BLAS's sums."""
    best: tuple[float, list[int], np.ndarray] | None = None
    n = x.shape[1]
    scale = float((y**2).sum())  # residuals are compared against the data's size: exact fits tie too
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        if np.linalg.matrix_rank(x[:, cols]) < len(cols):
            continue
        coef = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        if (coef < 0).any():
            continue
        residual = float(((x[:, cols] @ coef - y) ** 2).sum())
        if best is None or residual < best[0] - TIE * max(best[0], scale):
            best = (residual, cols, coef)
    out = np.zeros(n)
    if best is not None:
        out[best[1]] = best[2]
    return out


def fit_cost(work: list[Work]) -> CostModel:
    """The cost model of the measured forwards. Where no forward scored a draft, rows and positions
    cannot be told apart; an extra position is then taken to cost as much as a row (drafting's worst
    case, so it is not chosen on a guess)."""
    y = np.array([w.seconds for w in work], dtype=np.float64)
    drafted = any(w.positions > w.rows for w in work)
    x = np.array([[1.0, w.rows, w.positions, w.lookups] for w in work], dtype=np.float64)
    if drafted:
        f, r, p, lk = _nnls(x, y)
    else:
        f, p, lk = _nnls(x[:, [0, 2, 3]], y)
        r = 0.0
    return CostModel(float(f), float(r), float(p), float(lk))


CACHE_KEYS = 256  # workloads a cache keeps (the oldest dropped first)


def machine(device_type: str, device=None) -> str:
    """The machine part of a cost cache key (CostCache): the device type, its kind (the GPU's name,
    or the CPU kernels torch dispatches to) and torch's threads."""
    kind = torch.cuda.get_device_name(device) if device_type == "cuda" else torch.backends.cpu.get_cpu_capability()
    return f"{device_type}|{kind}|threads={torch.get_num_threads()}"


def cache_path() -> Path:
    return Path(os.environ.get("LOOMRL_CACHE_DIR") or Path.home() / ".cache" / "loomrl") / "draft_cost.json"


class CostCache:
    """The cost models fitted earlier on this machine, by workload: a run adopts the first fit of its
    workload, so two runs of one seed choose the same draft lengths (module docstring)."""

    def __init__(self, key: str, path: Optional[Path] = None):
        self.key, self.path = key, path or cache_path()

    def adopt(self, fitted: CostModel) -> CostModel:
        """The stored model of this workload, or `fitted`, stored now (under a lock: concurrent runs
        adopt one fit). A damaged cache file is moved aside (`.damaged`) and started again; a cache
        that cannot be read, written or locked within LOCK_WAIT_S is left alone: `fitted` is used."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "w") as lock:
                _lock(lock)
                stored = self._read()
                row = stored.get(self.key)
                if _valid(row):
                    log.info("draft cost model: adopted the first fit of this workload from %s", self.path)
                    return CostModel(*map(float, row))
                if row is not None:
                    log.warning("draft cost model: %s: unusable entry for this workload, fitted again", self.path)
                stored[self.key] = list(fitted)
                stored = dict(list(stored.items())[-CACHE_KEYS:])
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(stored, indent=0))
                os.replace(tmp, self.path)
                log.info("draft cost model: fitted, and kept in %s for later runs of this workload", self.path)
        except OSError as e:
            log.warning("draft cost model: cache %s not usable (%s); this run's fit is used", self.path, e)
        return fitted

    def _read(self) -> dict:
        """The cache's workloads; a file that is not a JSON object is moved aside, with a warning."""
        if not self.path.exists():
            return {}
        try:
            stored = json.loads(self.path.read_text())
        except (ValueError, UnicodeDecodeError):
            stored = None
        if isinstance(stored, dict):
            return stored
        aside = self.path.with_suffix(".damaged")
        os.replace(self.path, aside)
        log.warning("draft cost model: %s is damaged; moved to %s and started again", self.path, aside)
        return {}


LOCK_WAIT_S = 30.0  # a cache lock held longer than this (a stuck process): the run uses its own fit


def _lock(f) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(f"lock {f.name} held for over {LOCK_WAIT_S:.0f} s") from None
            time.sleep(0.05)


def _valid(row) -> bool:
    """A stored cost model: four finite, non-negative numbers (not booleans)."""
    return (
        isinstance(row, list)
        and len(row) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in row)
    )


@dataclass
class _Arm:
    k: int
    nodes: int = 0
    rows: float = 0.0  # decayed sums over this arm's forwards: rows, positions scored and lookups,
    positions: float = 0.0  # counted, so the arm's width and lookups per row (they follow the
    lookups: float = 0.0  # acceptance: a row drafts at most twice what its last draft got committed)
    tokens: float = 0.0  # ... and committed tokens (a tree arm's own gain: trees are not pooled)
    measured: int = 0  # forwards measured
    last: int = -1  # forward index of the last measurement
    explore: int = EXPLORE_FIRST

    def cost(self, model: CostModel, rows: int) -> float:
        """Modelled seconds per row of a forward of `rows` rows on this arm."""
        if self.rows:
            width, lookups = self.positions / self.rows, self.lookups / self.rows
        else:  # unmeasured: every row drafts its full length
            width, lookups = 1 + (self.nodes or self.k), float(self.k > 0)
        return model.seconds(rows, rows * width, rows * lookups) / rows


class DraftController:
    """Chooses each forward's draft length from modelled rates (module docstring)."""

    def __init__(self, k_max: int, tree_nodes: int = 0, cache: Optional[CostCache] = None):
        self.cache = cache
        self.arms = [_Arm(k) for k in arms(k_max)] + ([_Arm(k_max, tree_nodes)] if tree_nodes > 0 else [])
        self.offered = [0.0] * k_max  # decayed: rows allowed to draft position i
        self.accepted = [0.0] * k_max  # ... that had positions 0..i accepted
        self.best = 0  # index into arms
        self.forwards = 0
        self.chosen: list[Choice] = []  # each forward's draft since the last `summary`
        self._probing: int | None = None  # the arm being (re)checked, until it has seen PROBE_ROWS rows
        self._probe_rows = 0
        self.model: Optional[CostModel] = None  # fitted once calibration is over
        self.rows_now = 1  # the last forward's rows: arms' costs are compared at it
        self.calibration: list[Work] = []  # the measured forwards it is fitted from

    def choose(self) -> Choice:
        """The draft for the next forward."""
        if self.model is None:  # calibrating: a fixed schedule, plain every other forward
            n = len(self.calibration)
            pick = 0 if n % 2 == 0 else 1 + (n // 2) % (len(self.arms) - 1)
        else:
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
        """Committed tokens per second per row, at the last forward's rows (0 before calibration)."""
        if self.model is None:
            return 0.0
        cost = arm.cost(self.model, self.rows_now)
        return self.gain(arm.k, arm.nodes) / cost if cost > 0 else float("inf")

    def observe(
        self, seconds: float, rows: int, accepted: list[int], tokens: int, positions: int, lookups: int
    ) -> None:
        """The forward chosen last took `seconds` (lookups, forward, verification; read only while
        calibrating) for `rows` rows, scoring `positions` positions in all after `lookups` draft
        lookups; accepted[i] rows had draft positions 0..i accepted, and it committed `tokens`."""
        i = self._pending
        arm = self.arms[i]
        if not arm.nodes:  # (list comprehensions: this runs on every forward, plain ones included)
            kept = min(arm.k, len(accepted))
            self.offered = [ACCEPT_DECAY * o + (rows if p < arm.k else 0) for p, o in enumerate(self.offered)]
            self.accepted = [ACCEPT_DECAY * a + (accepted[p] if p < kept else 0) for p, a in enumerate(self.accepted)]
        work = Work(i, self.forwards, max(rows, 1), positions, lookups, tokens, seconds)
        self.forwards += 1
        self.rows_now = work.rows
        if self.model is None:
            self.calibration.append(work)
            self._calibrate()
            return
        self._account(work)
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

    def _account(self, w: Work) -> None:
        """A forward's counted work and its tokens into its arm's decayed sums."""
        arm = self.arms[w.arm]
        fade = DECAY ** (w.forward - arm.last)  # by forwards elapsed: a rechecked arm's old work fades
        arm.tokens = fade * arm.tokens + w.tokens
        arm.rows = fade * arm.rows + w.rows
        arm.positions = fade * arm.positions + w.positions
        arm.lookups = fade * arm.lookups + w.lookups
        arm.measured += 1
        arm.last = w.forward

    def _calibrate(self) -> None:
        """Fit the cost model once the schedule has measured enough, then account the calibration
        forwards with it and start from the best arm."""
        cal = self.calibration
        drafted = sum(w.positions > w.rows for w in cal)
        if not ((len(cal) >= CALIBRATION and drafted >= CAL_DRAFTED) or len(cal) >= CAL_MAX):
            return
        self.model = fit_cost(cal[1:])  # the run's first forward also pays one-time costs (allocations)
        if self.cache is not None:
            self.model = self.cache.adopt(self.model)
        for w in cal:
            self._account(w)
        rates = [self.rate(a) if a.measured else 0.0 for a in self.arms]
        self.best = max(range(len(self.arms)), key=lambda j: (rates[j], -j))
        for a in self.arms:
            a.explore = EXPLORE_FIRST

    def summary(self) -> dict:
        """The decision and its inputs since the last call, for the metrics row."""
        n = max(1, len(self.chosen))
        out = {"draft_k_mean": sum(c.k for c in self.chosen) / n, "draft_k_best": self.arms[self.best].k}
        out["draft_calibrated"] = int(self.model is not None)
        if self.model is not None:
            out.update({f"draft_cost_{name}": v for name, v in self.model._asdict().items()})
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
        if self.model is not None:  # modelled seconds per row, best arm
            out["draft_k_row_cost_s"] = best.cost(self.model, self.rows_now)
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
            "rows_now": self.rows_now,
            "arms": [
                [a.k, a.nodes, a.rows, a.positions, a.lookups, a.tokens, a.measured, a.last, a.explore]
                for a in self.arms
            ],
            "cost_model": list(self.model) if self.model is not None else None,
            "calibration": [list(w) for w in self.calibration],
        }

    def load_state_dict(self, state: dict) -> None:
        if "cost_model" not in state:
            return  # an older layout, whose sums are measured seconds: calibrate afresh
        saved = {(row[0], row[1]): row for row in state["arms"]}
        for a in self.arms:
            if (a.k, a.nodes) in saved:
                _, _, a.rows, a.positions, a.lookups, a.tokens, a.measured, a.last, a.explore = saved[(a.k, a.nodes)]
        n = len(self.offered)
        self.offered = (list(state.get("offered", [])) + [0.0] * n)[:n]
        self.accepted = (list(state.get("accepted", [])) + [0.0] * n)[:n]
        self.best = min(state["best"], len(self.arms) - 1)
        self.forwards = state["forwards"]
        self.rows_now = state["rows_now"]
        probing = state.get("probing")
        self._probing = probing if probing is not None and probing < len(self.arms) else None
        self._probe_rows = state.get("probe_rows", 0)
        model = state.get("cost_model")
        self.model = CostModel(*model) if model is not None else None
        self.calibration = [Work(*w) for w in state.get("calibration", []) if w[0] < len(self.arms)]
