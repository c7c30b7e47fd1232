"""NgramRL's drafter: drafts tokens from earlier completions of the same prompt.

In RL the same prompt is sampled n times per step, step after step; its
earlier completions are the best predictor of the next one. For each prompt
the drafter keeps a bounded history of finished completions (count and token
caps, oldest evicted first; histories of the least recently used prompts are
evicted past `max_prompts`), indexed by token bigrams. A proposal:

1. looks up the context's last two tokens (one if the bigram is unseen) in the
   prompt's history and in the request's own prompt + output so far;
2. measures, for every occurrence, how far the match extends backwards, and
   keeps those whose match is longest (ties included);
3. if that match is short (< 4 tokens), adds with a small weight the
   longest-matching occurrences in a bounded cross-prompt history of recent
   completions (common phrasing across prompts: measured on the traces, +3-4%
   tokens per forward);
4. walks forward: at each draft position it takes the next token with the most
   support among the occurrences still agreeing with the draft so far, and
   drops the ones that disagree. Support weights (tuned by trace replay, see
   `loomrl bench drafter`): the request's own context 20 (a completion that
   repeats itself tends to keep doing so), this prompt's history 2 (newer
   completions up to ~15% more), the cross-prompt history 0.5.

`propose_tree` drafts several continuations at once: a tree grown best-first from the same
occurrences (`grow_tree`), verified by the built-in engine in one forward.

It also returns, per draft position, the runner-up tokens with their support:
the prefetcher uses them to guess the target's bonus token when it rejects.
No draft model, no training, nothing on the accelerator; weight updates do not
purge histories (earlier policies' completions remain good drafts).

The one implementation serves the built-in rollout engine, vLLM's proposer
hook and the trace-replay benchmark.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

from loomrl.platform.rollout.config import DrafterConfig

MAX_MATCH = 32  # backward match length is measured up to this many tokens
MAX_OCCURRENCES = 64  # most recent occurrences of a key considered per lookup
W_HISTORY, W_OWN, W_GLOBAL = 2.0, 20.0, 0.5
RECENCY = 0.01  # extra weight per completion of recency within a prompt's history
GLOBAL_BELOW = 4  # consult the cross-prompt history only when the best match is shorter
SHORTER = 0.3  # draft trees: occurrences with shorter matches count, their weight times this
# per token short (tuned on traces_A; 0 = the longest matches only, as single drafts)
TREE_SMOOTH = 20.0  # draft trees: support of "none of the children" (tuned on traces_A)


@dataclass
class Draft:
    tokens: list[int]
    # alternatives[i]: {token: support} for position i among occurrences agreeing with
    # tokens[:i], the drafted token included; used to predict the target's bonus token.
    alternatives: list[dict[int, float]] = field(default_factory=list)
    # backoff[i]: {token: count} of what followed the last two tokens of context + tokens[:i]
    # anywhere in this prompt's history and the request (filled only when asked: prefetch).
    backoff: list[dict[int, float]] = field(default_factory=list)


POS_BITS = 24  # an occurrence is one int, seq_id << POS_BITS | pos: no per-entry Python
# objects for the garbage collector to walk (histories hold ~10^6 entries)


def _occ(sid: int, pos: int) -> int:
    return sid << POS_BITS | pos


def _split(o: int) -> tuple[int, int]:
    return o >> POS_BITS, o & ((1 << POS_BITS) - 1)


class _History:
    """One prompt's recent completions and a bigram -> [occurrence] index (an occurrence
    encodes the sequence and the index of the token after the bigram)."""

    def __init__(self):
        self.seqs: OrderedDict[int, list[int]] = OrderedDict()
        self.tokens = 0
        self.next_id = 0
        self.index: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        self.unigram: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.pending: list[int] = []  # sequence ids added but not yet indexed, oldest first

    def add(self, seq: list[int]) -> None:
        """Keep `seq`; it is indexed when a lookup first needs it (`ready`), so a run that
        does not draft (draft_control chose plain decoding) pays a list append per completion."""
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = seq
        self.tokens += len(seq)
        self.pending.append(sid)

    def ready(self) -> "_History":
        """Index the completions added since the last lookup, oldest first."""
        for sid in self.pending:
            seq = self.seqs[sid]
            for i in range(len(seq)):
                self.unigram[seq[i]].append(_occ(sid, i + 1))
                if i >= 1:
                    self.index[(seq[i - 1], seq[i])].append(_occ(sid, i + 1))
        self.pending = []
        return self

    def evict_oldest(self) -> None:
        sid, seq = self.seqs.popitem(last=False)
        self.tokens -= len(seq)
        if self.pending and self.pending[0] == sid:  # never indexed: nothing to drop
            self.pending.pop(0)
            return
        keys = {seq[i] for i in range(len(seq))}
        bigrams = {(seq[i - 1], seq[i]) for i in range(1, len(seq))}
        for table, ks in ((self.unigram, keys), (self.index, bigrams)):
            for key in ks:
                _drop_front(table, key, sid)


def _drop_front(table: dict, key, sid: int) -> None:
    """Remove `sid`'s occurrences of `key`. Sequences are added with increasing ids and
    evicted oldest first, so they sit at the front of the list: cut the prefix."""
    occ = table.get(key)
    if occ is None:
        return
    n = 0
    while n < len(occ) and occ[n] >> POS_BITS == sid:
        n += 1
    del occ[:n]
    if not occ:
        del table[key]


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

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens (undoing extend; used to draft
        ahead for a hypothetical outcome)."""
        while len(self.tokens) > length:
            n = len(self.tokens)
            t = self.tokens.pop()
            self.unigram[t].pop()
            if n >= 2:
                self.index[(self.tokens[-1], t)].pop()


class NgramDrafter:
    def __init__(self, cfg: DrafterConfig | None = None):
        self.cfg = cfg or DrafterConfig()
        self.histories: OrderedDict[str, _History] = OrderedDict()
        self.global_history = _History()
        self.index_s = 0.0  # seconds spent indexing new completions and new requests (paid once each)

    def _ready(self, hist: "_History | None") -> None:
        t0 = time.perf_counter()
        if hist is not None:
            hist.ready()
        self.global_history.ready()
        self.index_s += time.perf_counter() - t0

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
            h.evict_oldest()  # the newest is kept unless it alone breaks the token cap (below)
        if h.tokens > self.cfg.max_history_tokens:  # a single completion above the cap
            h.evict_oldest()
            del self.histories[key]
        while len(self.histories) > self.cfg.max_prompts:
            self.histories.popitem(last=False)
        if self.cfg.global_history > 0:
            g = self.global_history
            g.add(list(completion))
            while len(g.seqs) > self.cfg.global_history:
                g.evict_oldest()

    def state_dict(self) -> dict:
        """Histories as plain lists (JSON), oldest first, prompts in LRU order."""
        return {
            "prompts": [[key, list(h.seqs.values())] for key, h in self.histories.items()],
            "global": list(self.global_history.seqs.values()),
        }

    def load_state_dict(self, state: dict) -> None:
        """Rebuild the histories; recency weights depend only on relative age, so
        re-adding in order reproduces every future draft exactly."""
        self.histories = OrderedDict()
        for key, seqs in state["prompts"]:
            h = self.histories[key] = _History()
            for seq in seqs:
                h.add(list(seq))
        self.global_history = _History()
        for seq in state["global"]:
            self.global_history.add(list(seq))

    def history_tokens(self) -> int:
        """Tokens held in all histories (the drafter's memory, bounded by the caps)."""
        return sum(h.tokens for h in self.histories.values()) + self.global_history.tokens

    def start(self, key: str, prompt_ids: list[int]) -> DraftState:
        """A request's state, its prompt (and output so far) indexed: paid once per request, so it
        counts as indexing (`index_s`)."""
        t0 = time.perf_counter()
        if key in self.histories:
            self.histories.move_to_end(key)
        state = DraftState(key, prompt_ids)
        self.index_s += time.perf_counter() - t0
        return state

    # ------------------------------------------------------------------ proposal

    def propose(self, state: DraftState, k: int, backoff: bool = False) -> Draft:
        """Up to k draft tokens continuing state.tokens. backoff: also count, for each
        position, every continuation of its last two tokens (for the prefetcher)."""
        ctx = state.tokens
        if k <= 0 or not ctx:
            return Draft([])
        hist = self.histories.get(state.key)
        self._ready(hist)
        cands = self._occurrences(ctx, hist, state)
        draft = _walk(cands, k) if cands else Draft([])
        if backoff:
            draft.backoff = [
                self._next_counts(ctx + draft.tokens[:i], hist, state) for i in range(len(draft.tokens) + 1)
            ]
        return draft

    def propose_tree(self, state: DraftState, k: int, nodes: int, smooth: float = TREE_SMOOTH) -> Tree:
        """A draft tree of at most `nodes` tokens, at most k deep (`grow_tree`)."""
        ctx = state.tokens
        if k <= 0 or nodes <= 0 or not ctx:
            return Tree()
        hist = self.histories.get(state.key)
        self._ready(hist)
        cands = self._occurrences(ctx, hist, state, shorter=SHORTER)
        return grow_tree(cands, k, nodes, smooth) if cands else Tree()

    def _next_counts(self, ctx: list[int], hist: _History | None, state: DraftState) -> dict[int, float]:
        counts: dict[int, float] = defaultdict(float)
        if len(ctx) < 2:
            return counts
        key = (ctx[-2], ctx[-1])
        if hist is not None:
            for sid, pos in map(_split, (hist.index.get(key) or ())[-MAX_OCCURRENCES:]):
                seq = hist.seqs[sid]
                if pos < len(seq):
                    counts[seq[pos]] += 1
        own = state.tokens
        for pos in (state.index.get(key) or ())[-MAX_OCCURRENCES:]:
            if pos < len(own):
                counts[own[pos]] += 1
        return counts

    def _occurrences(self, ctx: list[int], hist: _History | None, state: DraftState, shorter: float = 0.0):
        """[(sequence, next_pos, weight)]: the longest-matching occurrences in this prompt's
        history and own context, plus those in the cross-prompt history. shorter > 0: also the
        occurrences with shorter matches, their weight times shorter ** (tokens short)."""
        found = []  # (match_len, seq, pos, weight)
        if hist is not None:
            newest = hist.next_id - 1
            cap = self.cfg.max_history
            for sid, pos in map(_split, _lookup(hist.index, hist.unigram, ctx)):
                seq = hist.seqs[sid]
                if pos < len(seq):
                    w = W_HISTORY * (1 + RECENCY * max(0, cap - (newest - sid)))
                    found.append((_match_len(ctx, seq, pos), seq, pos, w))
        for pos in _lookup(state.index, state.unigram, ctx, own=True):
            found.append((_match_len(ctx, ctx, pos), ctx, pos, W_OWN))
        out = _longest(found, shorter)
        g = self.global_history
        if g.seqs and (not found or max(f[0] for f in found) < GLOBAL_BELOW):
            cross = [
                (_match_len(ctx, g.seqs[sid], pos), g.seqs[sid], pos, W_GLOBAL)
                for sid, pos in map(_split, _lookup(g.index, g.unigram, ctx))
                if pos < len(g.seqs[sid])
            ]
            out += _longest(cross, shorter)
        return out


def _lookup(index: dict, unigram: dict, ctx: list[int], own: bool = False) -> list:
    """Occurrences of the context's last bigram (its last token if the bigram is unseen),
    most recent last. In the request's own index the context end itself is excluded."""
    n = len(ctx)
    for key, table in (((ctx[-2], ctx[-1]), index), (ctx[-1], unigram)):
        if key == (ctx[-2], ctx[-1]) and n < 2:
            continue
        occ = table.get(key) or ()
        if own:
            occ = [p for p in occ if p < n]
        if occ:
            return occ[-MAX_OCCURRENCES:]
    return []


def _longest(found: list, shorter: float = 0.0) -> list:
    if not found:
        return []
    best = max(f[0] for f in found)
    if shorter > 0:
        return [(seq, pos, w * shorter ** (best - m)) for m, seq, pos, w in found]
    return [(seq, pos, w) for m, seq, pos, w in found if m == best]


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


@dataclass
class Tree:
    """A multi-candidate draft: node i is token tokens[i] following node parents[i] (-1: the
    context's end); parents come before their children, and siblings have distinct tokens."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def walk(self, truth: list[int]) -> list[int]:
        """The nodes a verification that samples `truth` accepts, root first."""
        path, cur = [], -1
        for tok in truth:
            nxt = next((i for i, (t, p) in enumerate(zip(self.tokens, self.parents)) if p == cur and t == tok), None)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        return path


def grow_tree(cands: list[tuple[list[int], int, float]], k: int, nodes: int, smooth: float) -> Tree:
    """Best-first: the tree of at most `nodes` tokens, at most k deep, whose nodes have the highest
    estimated probability of being reached, P(child) = P(parent) * support(child) / (support of all
    the parent's children + smooth), support summed over the occurrences agreeing with the path."""
    tree = Tree()
    order = itertools.count()  # ties: first pushed first
    heap: list = []  # candidate nodes: (-P, order, parent node, token, depth, occurrences agreeing)

    def push_children(parent: int, p: float, depth: int, live) -> None:
        votes: dict[int, float] = defaultdict(float)
        agree: dict[int, list] = defaultdict(list)  # per next token, the occurrences continuing with it
        for c in live:
            seq, pos, w = c
            if pos + depth < len(seq):
                votes[seq[pos + depth]] += w
                agree[seq[pos + depth]].append(c)
        total = sum(votes.values()) + smooth
        for tok, v in votes.items():
            heapq.heappush(heap, (-p * v / total, next(order), parent, tok, depth + 1, agree[tok]))

    push_children(-1, 1.0, 0, cands)
    while heap and len(tree.tokens) < nodes:
        neg_p, _, parent, tok, depth, live = heapq.heappop(heap)
        tree.tokens.append(tok)
        tree.parents.append(parent)
        if depth < k:
            push_children(len(tree.tokens) - 1, -neg_p, depth, live)
    return tree
