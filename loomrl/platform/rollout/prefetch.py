"""NgramRL's adaptive fan-out prefetcher.

While the target verifies a draft, the next draft depends on the outcome:
j = how many draft tokens it accepts and b = its own next (bonus) token. The
prefetcher guesses the likely (j, b) pairs and prepares their drafts ahead, so
the lookup leaves the critical path. A causal budget allocator spends at most
`budget` candidates per sequence on the most probable outcomes, using only
what has been observed so far:

    P(j, b) = P(j | draft length) * P(b | j)

P(j | L) is a running histogram of accepted lengths for drafts of length L
(add-one smoothed). P(b | j) mixes two of the drafter's counts at position j:
the support of the other continuations among the draft's own matches, and the
backoff counts of everything that followed the same two tokens in this
prompt's history and the request (the rejected token excluded in both; after
a full accept, j = L, the counts at position L). An outcome not prepared
falls back to a plain lookup: the draft is the same either way (the drafter
is deterministic in the context), so committed tokens never change.
"""

from __future__ import annotations

from loomrl.platform.rollout.drafter import Draft

SMOOTH = 1.0  # pseudo-count for unseen bonus tokens ("something else") and for P(j | L)
BACKOFF = 0.5  # share of P(b | j) given to the wider backoff counts (all continuations of the bigram)


class FanoutPrefetcher:
    def __init__(self, budget: int):
        self.budget = budget
        self.accept_hist: dict[int, list[float]] = {}
        self.planned = 0
        self.covered = 0

    def plan(self, draft: Draft) -> list[tuple[int, int]]:
        """The (j, b) outcomes to prepare for this draft, most probable first."""
        if self.budget <= 0:
            return []
        L = len(draft.tokens)
        hist = self.accept_hist.get(L) or [0.0] * (L + 1)
        total = sum(hist) + SMOOTH * (L + 1)
        scored = []
        for j in range(L + 1):
            p_j = (hist[j] + SMOOTH) / total
            p_b: dict[int, float] = {}
            for source, share in ((draft.alternatives, 1 - BACKOFF), (draft.backoff, BACKOFF)):
                votes = source[j] if j < len(source) else {}
                others = {t: v for t, v in votes.items() if j == L or t != draft.tokens[j]}
                mass = sum(others.values()) + SMOOTH
                for tok, v in others.items():
                    p_b[tok] = p_b.get(tok, 0.0) + share * v / mass
            scored.extend((p_j * p, j, tok) for tok, p in p_b.items())
        scored.sort(key=lambda s: -s[0])
        return [(j, tok) for _, j, tok in scored[: self.budget]]

    def observe(self, draft_len: int, accepted: int, covered: bool) -> None:
        """Record a verification outcome (and whether it had been prepared)."""
        hist = self.accept_hist.setdefault(draft_len, [0.0] * (draft_len + 1))
        hist[accepted] += 1
        self.planned += 1
        self.covered += covered

    @property
    def coverage(self) -> float:
        return self.covered / self.planned if self.planned else 0.0
