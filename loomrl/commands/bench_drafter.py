"""`loomrl bench drafter`: replay recorded rollouts through drafters, side by side.

Replay rules (those the traces were recorded for): the first completion token comes from
the prefill (1 forward, no draft); each later forward verifies the current
draft of up to k tokens: accepted = longest prefix equal to the recorded
continuation, committed = accepted + 1, capped at the end. tokens_per_forward
= completion tokens / forwards over rounds >= 1; every line (round 0 too) is
replayed in file order, and each finished completion enters the histories.

A draft tree (NgramRL's `ngramrl_tree<N>`, at most N tokens, k deep) is verified
the same way along the recorded continuation: accepted = the longest path from
the root whose tokens equal it. A tree of N tokens costs the target N + 1
positions in that forward (a single draft of k: k + 1); say so beside its figure.

Drafters: NgramRL (loomrl's drafter object, the one the rollout engines use),
prompt lookup as vLLM's `ngram` method does it (prompt + own output, last 3..1
tokens), and SuffixDecoding (arctic-inference, driven like vLLM's `suffix`
method: per-request tree + global tree of finished responses).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from dataclasses import dataclass, field

from loomrl.platform.rollout.config import DrafterConfig
from loomrl.platform.rollout.drafter import NgramDrafter, Tree
from loomrl.platform.rollout.prefetch import FanoutPrefetcher

ALL = 1 << 30  # a budget that prepares every outcome the prefetcher can name: its coverage ceiling
PREFETCH_BUDGETS = (4, 8, 16, ALL)


def load_traces(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt") as f:
        for i, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                rows.append(
                    {
                        "prompt_id": str(r["prompt_id"]),
                        "round": int(r["round"]),
                        "prompt_ids": list(r["prompt_ids"]),
                        "completion_ids": list(r["completion_ids"]),
                    }
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{i}: not a trace line ({type(e).__name__}: {e})") from None
    if not rows:
        raise ValueError(f"{path}: no trace lines")
    return rows


@dataclass
class Tally:
    tokens: int = 0
    forwards: int = 0
    accepted: int = 0
    drafts: int = 0
    lookup_s: list[float] = field(default_factory=list)
    accept_by_pos: list[int] = field(default_factory=list)  # forwards accepting >= i+1 tokens
    drafted_by_pos: list[int] = field(default_factory=list)  # forwards drafting >= i+1 tokens

    def summary(self) -> dict:
        lk = sorted(self.lookup_s) or [0.0]
        return {
            "tokens_per_forward": self.tokens / max(1, self.forwards),
            "mean_accepted": self.accepted / max(1, self.drafts),
            "lookup_us_p50": 1e6 * lk[len(lk) // 2],
            "lookup_us_p99": 1e6 * lk[min(len(lk) - 1, int(len(lk) * 0.99))],
            "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(self.accept_by_pos, self.drafted_by_pos)],
        }


def _verify(draft: list[int], truth: list[int]) -> int:
    j = 0
    while j < len(draft) and j < len(truth) and draft[j] == truth[j]:
        j += 1
    return j


def replay(rows: list[dict], k: int, make) -> Tally:
    """Generic replay. make() returns (start(row), propose(k) -> tokens, commit(tokens), finish())."""
    start, propose, commit, finish = make()
    tally = Tally(accept_by_pos=[0] * k, drafted_by_pos=[0] * k)
    for row in rows:
        comp = row["completion_ids"]
        counted = row["round"] >= 1
        start(row)
        pos = min(1, len(comp))
        commit(comp[:pos])
        forwards = 1
        while pos < len(comp):
            t0 = time.perf_counter()
            draft = propose(min(k, len(comp) - pos))
            dt = time.perf_counter() - t0
            if isinstance(draft, Tree):  # accepted: the path the recorded continuation takes
                j = len(draft.walk(comp[pos : pos + k]))
                draft = [0] * max(draft.depths(), default=0)  # (its depth, for the per-position counts)
            else:
                draft = draft[:k]
                j = _verify(draft, comp[pos:])
            n = min(j + 1, len(comp) - pos)
            commit(comp[pos : pos + n])
            pos += n
            forwards += 1
            if counted:
                tally.lookup_s.append(dt)
                tally.drafts += 1
                tally.accepted += j
                for i in range(len(draft)):
                    tally.drafted_by_pos[i] += 1
                    tally.accept_by_pos[i] += i < j
        finish(row)
        if counted:
            tally.tokens += len(comp)
            tally.forwards += forwards
    return tally


def ngramrl_factory(
    cfg: DrafterConfig, budgets=PREFETCH_BUDGETS, coverage_out: dict | None = None, ceiling_out: dict | None = None
):
    def make():
        drafter = NgramDrafter(cfg)
        prefetchers = {b: FanoutPrefetcher(b) for b in budgets}
        st = {}

        def start(row):
            st["row"] = row
            st["state"] = drafter.start(row["prompt_id"], row["prompt_ids"])
            st["end"] = len(row["prompt_ids"]) + len(row["completion_ids"])
            st["pending"] = None

        def propose(n):
            d = drafter.propose(st["state"], n, backoff=bool(prefetchers))
            st["pending"] = (d, {b: set(p.plan(d)) for b, p in prefetchers.items()})
            return d.tokens

        def commit(tokens):
            pending = st["pending"]
            done = len(st["state"].tokens) + len(tokens) >= st["end"]
            if pending is not None and tokens and not done:
                # committed = accepted + bonus; only outcomes that need a next draft count,
                # as in the engine (the last forward of a completion needs none)
                d, plans = pending
                j = len(tokens) - 1
                outcome = (j, tokens[j])
                for b, p in prefetchers.items():
                    if st["row"]["round"] >= 1:
                        p.observe(len(d.tokens), j, outcome in plans[b])
                if st["row"]["round"] >= 1 and ceiling_out is not None:
                    seen[0] += _bigram_seen(drafter, st["state"], tokens)
                    seen[1] += 1
            st["pending"] = None
            st["state"].extend(tokens)

        def finish(row):
            drafter.observe(row["prompt_id"], row["completion_ids"])
            if coverage_out is not None:
                coverage_out.update({("all" if b == ALL else str(b)): p.coverage for b, p in prefetchers.items()})
            if ceiling_out is not None:
                ceiling_out["seen"] = seen[0] / max(1, seen[1])

        seen = [0, 0]  # [outcomes whose bonus token had followed the last accepted token before, outcomes counted]
        return start, propose, commit, finish

    return make


def _bigram_seen(drafter: NgramDrafter, state, tokens: list[int]) -> bool:
    """Whether the bonus token tokens[-1] ever followed the token before it (the last accepted one) in
    this prompt's history, the request so far or the cross-prompt history: an outcome that no history
    names at all, so no prefetcher predicting from history covers it at any budget."""
    x, b = (state.tokens + tokens[:-1])[-1], tokens[-1]
    hist = drafter.histories.get(state.key)
    if hist is not None and (x, b) in hist.ready().index or (x, b) in drafter.global_history.ready().index:
        return True
    n = len(state.tokens)
    state.extend(tokens[:-1])  # the accepted tokens join the request's own index for the check
    try:
        return (x, b) in state.index and bool(state.index[(x, b)])
    finally:
        state.truncate(n)


def tree_factory(cfg: DrafterConfig, nodes: int):
    """NgramRL's draft trees (`NgramDrafter.propose_tree`) of up to `nodes` tokens."""

    def make():
        drafter = NgramDrafter(cfg)
        st = {}

        def start(row):
            st["state"] = drafter.start(row["prompt_id"], row["prompt_ids"])

        def commit(tokens):
            st["state"].extend(tokens)

        def finish(row):
            drafter.observe(row["prompt_id"], row["completion_ids"])

        return start, lambda k: drafter.propose_tree(st["state"], k, nodes), commit, finish

    return make


def prompt_lookup_factory(max_n: int = 3, min_n: int = 1):
    """vLLM's `ngram` proposer: the longest n-gram (max_n..min_n) ending the context that
    occurred earlier in prompt + output; propose what followed its earliest occurrence."""

    def make():
        st = {}

        def start(row):
            st["ctx"] = list(row["prompt_ids"])

        def propose(k):
            ctx = st["ctx"]
            for n in range(max_n, min_n - 1, -1):
                if len(ctx) <= n:
                    continue
                tail = ctx[-n:]
                for i in range(len(ctx) - n):
                    if ctx[i : i + n] == tail:
                        return ctx[i + n : i + n + k]
            return []

        def commit(tokens):
            st["ctx"].extend(tokens)

        return start, propose, commit, lambda row: None

    return make


def suffix_factory(max_tree_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1):
    """SuffixDecoding as vLLM's `suffix` method drives arctic-inference (its defaults)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    def make():
        cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=100000)
        st = {"n": 0}

        def start(row):
            st["n"] += 1
            st["rid"] = f"r{st['n']}"
            st["ctx"] = list(row["prompt_ids"])
            cache.start_request(st["rid"], st["ctx"])

        def propose(k):
            pattern = st["ctx"][-max_tree_depth:]
            d = cache.speculate(
                st["rid"], pattern, max_spec_tokens=k, max_spec_factor=max_spec_factor, min_token_prob=min_token_prob
            )
            return list(d.token_ids)

        def commit(tokens):
            st["ctx"].extend(tokens)
            cache.add_active_response(st["rid"], tokens)

        def finish(row):
            cache.stop_request(st["rid"])

        return start, propose, commit, finish

    return make


def run_bench(path: str, k: int, cfg: DrafterConfig | None = None, tree_nodes: int = 16) -> dict:
    rows = load_traces(path)
    cfg = cfg or DrafterConfig(max_prompts=1 << 20)
    coverage: dict = {}
    ceiling: dict = {}
    # prefetch coverage in its own pass, so NgramRL's lookup times are plain lookups
    replay(rows, k, ngramrl_factory(cfg, coverage_out=coverage, ceiling_out=ceiling))
    coverage["bigram_seen"] = ceiling.get("seen", 0.0)
    results = {
        "ngramrl": replay(rows, k, ngramrl_factory(cfg, budgets=())).summary(),
        f"ngramrl_tree{tree_nodes}": replay(rows, k, tree_factory(cfg, tree_nodes)).summary(),
        "prompt_lookup": replay(rows, k, prompt_lookup_factory()).summary(),
    }
    try:
        results["suffix"] = replay(rows, k, suffix_factory()).summary()
    except ImportError:
        print(
            "note: arctic-inference is not installed (pip install arctic-inference==0.1.1); SuffixDecoding skipped",
            file=sys.stderr,
        )
    results["no_drafter"] = replay(
        rows, k, lambda: (lambda r: None, lambda n: [], lambda t: None, lambda r: None)
    ).summary()
    return {"traces": path, "k": k, "lines": len(rows), "drafters": results, "prefetch_coverage": coverage}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="loomrl bench drafter", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--traces", required=True, nargs="+", help="trace files (gzip JSONL)")
    ap.add_argument("--k", type=int, default=8, help="most draft tokens per forward")
    ap.add_argument(
        "--tree-nodes",
        type=int,
        default=16,
        help="NgramRL's draft trees: most tokens per tree (rollout.drafter.tree_nodes)",
    )
    ap.add_argument("--json", action="store_true", help="end with one JSON object per trace file")
    args = ap.parse_args(argv)
    for path in args.traces:
        try:
            out = run_bench(path, args.k, tree_nodes=args.tree_nodes)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"\n{path}  ({out['lines']} rollouts, k={args.k}; rounds >= 1 counted)")
        print(f"{'drafter':<15}{'tokens/forward':>15}{'mean accepted':>15}{'lookup p50 us':>15}{'lookup p99 us':>15}")
        base = out["drafters"]["ngramrl"]["tokens_per_forward"]
        for name, s in out["drafters"].items():
            print(
                f"{name:<15}{s['tokens_per_forward']:>15.3f}{s['mean_accepted']:>15.3f}"
                f"{s['lookup_us_p50']:>15.1f}{s['lookup_us_p99']:>15.1f}"
                + ("" if name.startswith("ngramrl") else f"   ngramrl x{base / s['tokens_per_forward']:.2f}")
            )
        suffix = out["drafters"].get("suffix")
        if suffix:
            print(
                "vs SuffixDecoding: "
                + ", ".join(
                    f"{name} x{s['tokens_per_forward'] / suffix['tokens_per_forward']:.2f}"
                    for name, s in out["drafters"].items()
                    if name.startswith("ngramrl")
                )
            )
        cov = dict(out["prefetch_coverage"])
        seen = cov.pop("bigram_seen")
        print(
            "prefetch coverage: "
            + ", ".join(f"budget {b}: {c:.1%}" for b, c in cov.items())
            + "  (all: every outcome the prefetcher can name, the ceiling of any budget)"
        )
        print(
            f"outcomes whose bonus token ever followed the last accepted token before: {seen:.1%} "
            "(a prefetcher that predicts the bonus token from what followed the context can name no other)"
        )
        if args.json:
            print(
                json.dumps(
                    {
                        "k": out["k"],
                        "traces": path,
                        "drafters": out["drafters"],
                        "prefetch_coverage": out["prefetch_coverage"],
                    }
                )
            )
    return 0
