"""NgramRL's drafter: drafts tokens from earlier completions of the same prompt.

In RL the same prompt is sampled n times per step, step after step; its
earlier completions are the best predictor of the next one. For each prompt
the drafter keeps a bounded history of finished completions (count and token
caps, oldest evicted first; histories of the least recently used prompts are
evicted past `max_prompts`), indexed by token bigrams. A proposal:

1. looks up the context's last two tokens (one if the bigram is unseen) in the
   prompt's history and in the request's own prompt + output so far;
2. measures, for every occurrence, how far the match extends backwards;
3. keeps the occurrences whose match is longest (ties included) and walks
   forward: at each draft position it takes the next token with the most
   support among the occurrences still agreeing with the draft so far (longer
   matches and history count more), dropping the ones that disagree.

It also returns, per draft position, the runner-up tokens with their support:
the prefetcher uses them to guess the target's bonus token when it rejects.
No draft model, no training, nothing on the accelerator; weight updates do not
purge histories (earlier policies' completions remain good drafts).

The one implementation serves the built-in rollout engine, vLLM's proposer
hook and the trace-replay benchmark.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

from loomrl.platform.recipe import DrafterConfig

MAX_MATCH = 32          # backward match length is measured up to this many tokens
MAX_OCCURRENCES = 256   # most recent occurrences of a key considered per lookup


@dataclass
class Draft:
    tokens: list[int]
    # alternatives[i]: {token: support} for position i among occurrences agreeing with
    # tokens[:i], the drafted token included; used to predict the target's bonus token.
    alternatives: list[dict[int, float]] = field(default_factory=list)


class _History:
    """One prompt's recent completions and a bigram -> [(seq, pos)] index (pos: index of
    the token after the bigram)."""

    def __init__(self):
        self.seqs: OrderedDict[int, list[int]] = OrderedDict()
        self.tokens = 0
        self.next_id = 0
        self.index: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        self.unigram: dict[int, list[tuple[int, int]]] = defaultdict(list)

    def add(self, seq: list[int]) -> None:
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = seq
        self.tokens += len(seq)
        for i in range(len(seq)):
            self.unigram[seq[i]].append((sid, i + 1))
            if i >= 1:
                self.index[(seq[i - 1], seq[i])].append((sid, i + 1))

    def evict_oldest(self) -> None:
        sid, seq = self.seqs.popitem(last=False)
        self.tokens -= len(seq)
        for i in range(len(seq)):
            _drop(self.unigram, seq[i], sid)
            if i >= 1:
                _drop(self.index, (seq[i - 1], seq[i]), sid)


def _drop(index: dict, key, sid: int) -> None:
    occ = index.get(key)
    if occ is None:
        return
    occ[:] = [o for o in occ if o[0] != sid]
    if not occ:
        del index[key]


class DraftState:
    """A request in flight: its prompt key, tokens so far and their own bigram index."""

    def __init__(self, key: str, prompt_ids: list[int]):
        self.key = key
        self.tokens: list[int] = []
        self.index: dict[tuple, list[int]] = defaultdict(list)
        self.unigram: dict[int, list[int]] = defaultdict(list)
        self.extend(prompt_ids)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            n = len(self.tokens)
            # index positions whose continuation exists only once the next token arrives;
            # the newest occurrence (the context end itself) is excluded at lookup time.
            self.unigram[t].append(n)
            if n >= 2:
                self.index[(self.tokens[-2], t)].append(n)


class NgramDrafter:
    def __init__(self, cfg: DrafterConfig | None = None):
        self.cfg = cfg or DrafterConfig()
        self.histories: OrderedDict[str, _History] = OrderedDict()

    # ------------------------------------------------------------------ history

    def observe(self, key: str, completion: list[int]) -> None:
        """Record a finished completion of prompt `key`."""
        if not completion:
            return
        h = self.histories.get(key)
        if h is None:
            h = self.histories[key] = _History()
        self.histories.move_to_end(key)
        h.add(list(completion))
        while len(h.seqs) > 1 and (len(h.seqs) > self.cfg.max_history or h.tokens > self.cfg.max_history_tokens):
            h.evict_oldest()
        if h.tokens > self.cfg.max_history_tokens:  # a single completion above the cap
            h.evict_oldest()
            del self.histories[key]
        while len(self.histories) > self.cfg.max_prompts:
            self.histories.popitem(last=False)

    def history_tokens(self) -> int:
        return sum(h.tokens for h in self.histories.values())

    def start(self, key: str, prompt_ids: list[int]) -> DraftState:
        if key in self.histories:
            self.histories.move_to_end(key)
        return DraftState(key, prompt_ids)

    # ------------------------------------------------------------------ proposal

    def propose(self, state: DraftState, k: int) -> Draft:
        """Up to k draft tokens continuing state.tokens."""
        ctx = state.tokens
        if k <= 0 or not ctx:
            return Draft([])
        hist = self.histories.get(state.key)
        cands = self._occurrences(ctx, hist, state)
        if not cands:
            return Draft([])
        return _walk(cands, k)

    def _occurrences(self, ctx: list[int], hist: _History | None, state: DraftState):
        """[(sequence, next_pos, weight)] for the occurrences with the longest backward match."""
        n = len(ctx)
        found = []  # (match_len, is_history, seq, pos)
        for use_bigram in ((True, False) if n >= 2 else (False,)):
            if hist is not None:
                occ = hist.index.get((ctx[-2], ctx[-1])) if use_bigram else hist.unigram.get(ctx[-1])
                for sid, pos in (occ or ())[-MAX_OCCURRENCES:]:
                    seq = hist.seqs[sid]
                    if pos < len(seq):
                        found.append((_match_len(ctx, seq, pos), True, seq, pos))
            own = state.index.get((ctx[-2], ctx[-1])) if use_bigram else state.unigram.get(ctx[-1])
            for pos in (own or ())[-MAX_OCCURRENCES:]:
                if pos < n:  # not the context end itself
                    found.append((_match_len(ctx, ctx, pos), False, ctx, pos))
            if found:
                break
        if not found:
            return []
        best = max(f[0] for f in found)
        # weight: history beats own context (it holds whole completions of this prompt)
        return [(seq, pos, 2.0 if is_hist else 1.0) for m, is_hist, seq, pos in found if m == best]


def _match_len(ctx: list[int], seq: list[int], pos: int) -> int:
    """How many tokens before seq[pos] equal the end of ctx (capped)."""
    m, n = 0, len(ctx)
    limit = min(MAX_MATCH, pos, n)
    while m < limit and seq[pos - 1 - m] == ctx[n - 1 - m]:
        m += 1
    return m


def _walk(cands: list[tuple[list[int], int, float]], k: int) -> Draft:
    tokens: list[int] = []
    alternatives: list[dict[int, float]] = []
    live = cands
    for i in range(k + 1):
        votes: dict[int, float] = defaultdict(float)
        for seq, pos, w in live:
            if pos + i < len(seq):
                votes[seq[pos + i]] += w
        if not votes:
            break
        alternatives.append(dict(votes))
        if i == k:
            break  # position k: only its votes (the likely bonus after a full accept)
        tok = max(votes, key=votes.get)
        tokens.append(tok)
        live = [c for c in live if c[1] + i < len(c[0]) and c[0][c[1] + i] == tok]
    return Draft(tokens, alternatives)
