"""The built-in rollout engine: batched, KV-cached sampling with the policy in torch,
optionally accelerated by NgramRL speculative decoding.

Prompts are left-padded into one batch (n rows per prompt); media are encoded
once per distinct medium. Every forward feeds each live row its last committed
token followed by its draft (empty without a drafter, so plain decoding is the
k = 0 case of the same loop) and verifies the draft exactly:

- the target distribution p' at each position is softmax(logits / T) with the
  top-p nucleus kept (one-hot argmax when T = 0, greedy);
- the token at each (row, completion position) after the first is a position-keyed
  sample of p' (inverse CDF at a hashed uniform, `position_keyed_sample`): a drafted
  token is accepted iff it equals that sample (probability p'(x): speculative
  sampling's min(1, p/q) with a deterministic draft, q = 1), and the sample at the
  first mismatch is the bonus token. The committed tokens are distributed exactly as
  without drafting, and they do not depend on how many tokens each forward drafted:
  with the same seed, drafting on or off commits the same tokens;
- how many tokens to draft is chosen per forward from rates of counted work under a cost
  model calibrated once per run (`draft_control.DraftController`, `rollout.drafter.adaptive`),
  so drafting only runs where it makes rollouts faster, and seeded runs and resumes repeat.

Reported log-probs are log_softmax(logits / T) of each committed token, the
quantity the trainer recomputes (top-p changes what can be drawn, not the
reported value). Rejected draft tokens leave the KV cache after each forward
(`drop_rejected`), which is the rollback.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from loomrl.platform.backbone.vlm import VLM
from loomrl.platform.placement import to_device, to_host
from loomrl.platform.rollout.base import ROLLOUT_ENGINES, Prompt, Rollout, RolloutResult, SamplingParams
from loomrl.platform.rollout.config import DrafterConfig
from loomrl.platform.rollout.draft_control import Choice, CostCache, DraftController, machine
from loomrl.platform.rollout.drafter import Draft, NgramDrafter, Tree
from loomrl.platform.rollout.prefetch import FanoutPrefetcher
from loomrl.platform.rollout.sampling import sampled_logprobs, target_distribution
from loomrl.platform.rollout.torch_memory import rollout_memory, sequence_length

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; products wrap around)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def position_keyed_sample(probs: torch.Tensor, row_seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per (row, position) from probs [B, W, V] by inverse CDF, with the uniform a hash
    (splitmix64) of the row's seed and the completion position.

    A token drawn this way depends only on the row's seed, its position and the distribution there,
    not on how many positions a forward scores: so a draft token is accepted exactly when it equals
    this sample (accepted with probability p(x), as speculative sampling's min(1, p/q) with a
    deterministic draft, q = 1) and the sample at the first mismatch is the bonus token. The committed
    tokens are distributed as without drafting, and a seeded run's tokens do not depend on the draft
    lengths the engine chose (`draft_control`)."""
    x = row_seeds[:, None] + positions * _GOLDEN
    x = x ^ _shift_right(x, 30)
    x = x * _MIX1
    x = x ^ _shift_right(x, 27)
    x = x * _MIX2
    x = x ^ _shift_right(x, 31)
    u = (_shift_right(x, 11).double() + 0.5) * 2.0**-53  # in (0, 1)
    cdf = probs.double().cumsum(-1)
    # the first token whose cumulative probability reaches u: a token of probability 0 never is
    token = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None]).squeeze(-1)
    return token.clamp(max=probs.shape[-1] - 1)


def drop_rejected(mask: torch.Tensor, cache, col0: int, kept: torch.Tensor, path: Optional[torch.Tensor] = None):
    """The mask and KV cache after a verifying forward that appended columns col0.. : row i keeps
    kept[i] of them, the first ones, or with `path` [B, >= kept] the columns path[i, :kept[i]] (its
    last token and its accepted drafts, a path through a draft tree), moved to the block's right
    end in that order (a masked gap before them is harmless: positions count real tokens only), and
    the block's leading columns that no row keeps are dropped. Without this, every rejected draft
    token would stay in the cache, masked, and the cache (and each forward's attention over it)
    would grow by the full draft width per forward instead of by the tokens accepted."""
    keep = int(kept.max())
    src = torch.arange(keep, device=mask.device)[None, :] - keep + kept[:, None]  # [B, keep]; < 0: a gap
    hole = src < 0
    src = src.clamp(min=0)
    if path is not None:
        src = path.gather(1, src)
    block = mask[:, col0:].gather(1, src).masked_fill(hole, 0)
    new_mask = torch.cat([mask[:, :col0], block], dim=1)
    idx = src[:, None, :, None]
    new_cache = []
    for k, v in cache:
        i = idx.expand(k.shape[0], k.shape[1], keep, k.shape[3])
        new_cache.append(
            (
                torch.cat([k[:, :, :col0], k[:, :, col0:].gather(2, i)], dim=2),
                torch.cat([v[:, :, :col0], v[:, :, col0:].gather(2, i)], dim=2),
            )
        )
    return new_mask, new_cache


def tree_mask(parent: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """bool [B, W, W]: column a sees column b iff b is a or one of its ancestors (parent [B, W]: each
    column's parent column, a root or padding column its own; depth [B, W])."""
    b, w = parent.shape
    eye = torch.eye(w, dtype=torch.bool, device=parent.device).expand(b, w, w)
    sees = eye | torch.zeros_like(eye).scatter_(2, parent[..., None], True)
    for _ in range(max(1, int(depth.max())).bit_length()):  # closure by squaring: paths of 2, 4, ... steps
        sees = sees | (sees.float() @ sees.float() > 0)
    return sees


def left_pad(
    rows: list[list[int]], pad_id: int, device: torch.device = torch.device("cpu")
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask, built on the host and moved to `device` once."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return to_device(ids, device), to_device(mask, device)


@dataclass
class DraftStats:
    """Drafting counters of one generate() call."""

    drafted_by_pos: list[int] = field(default_factory=list)  # forwards that drafted >= i+1 tokens
    accepted_by_pos: list[int] = field(default_factory=list)  # ... and had position i accepted
    lookup_s: float = 0.0
    lookups: int = 0
    prefetched: int = 0  # verification outcomes whose next draft had been prepared
    outcomes: int = 0  # verification outcomes that needed a next draft

    @property
    def coverage(self) -> float:
        return self.prefetched / self.outcomes if self.outcomes else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_pos, self.drafted_by_pos)]


# rounding: it samples from the FP32 policy, one rounding per region; memory: torch_memory.py
@ROLLOUT_ENGINES.register("torch", rounding="aligned", sequence_length=sequence_length, memory=rollout_memory)
class TorchRolloutEngine:
    @classmethod
    def from_recipe(cls, recipe, model: VLM) -> "TorchRolloutEngine":
        """The built-in engine on the trainer's own policy (shared, never synced)."""
        return cls(model, recipe.rollout.drafter)

    def __init__(self, model: VLM, drafter_cfg: Optional[DrafterConfig] = None):
        self.model = model
        self.version = 0
        self.drafter_cfg = drafter_cfg if drafter_cfg is not None and drafter_cfg.enabled else None
        self.drafter = NgramDrafter(self.drafter_cfg) if self.drafter_cfg else None
        self.prefetcher = FanoutPrefetcher(self.drafter_cfg.prefetch_budget) if self.drafter_cfg else None
        self._pool = ThreadPoolExecutor(1) if self.prefetcher and self.prefetcher.budget > 0 else None
        # rollout.drafter.adaptive: each forward's draft length chosen by modelled rate (draft_control.py)
        self.tree_nodes = self.drafter_cfg.tree_nodes if self.drafter_cfg else 0
        self.control = None
        if self.drafter_cfg and self.drafter_cfg.adaptive:
            cache = CostCache(self._workload()) if self.drafter_cfg.cost_cache else None
            self.control = DraftController(self.drafter_cfg.k, self.tree_nodes, cache)
        self.last_stats = DraftStats()
        self.spec_metrics: dict = {}

    def _workload(self) -> str:
        """What a cost model depends on (draft_control.CostCache): engine, torch version, device and
        kernels, threads, the model's shapes, the longest draft, trees, the prefetch thread."""
        dev = self.model.device
        shapes = hashlib.sha256(
            repr([(n, tuple(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()]).encode()
        ).hexdigest()[:16]
        cfg = self.drafter_cfg
        return (
            f"torch|{torch.__version__}|{machine(dev.type, dev)}|model={shapes}"
            f"|k={cfg.k}|tree={cfg.tree_nodes}|prefetch={cfg.prefetch_budget}"
        )

    # ------------------------------------------------------------------ drafting

    def _propose(self, state, k: int, nodes: int, stats: DraftStats, memo: dict) -> Draft | Tree:
        # Sequences of one prompt often share their whole context (n samples start alike):
        # the drafter is deterministic in (prompt, context, k, nodes), so draft once for them.
        t0 = time.perf_counter()
        key = (state.key, k, nodes, tuple(state.tokens))
        d = memo.get(key)
        if d is None:
            d = memo[key] = (
                self.drafter.propose_tree(state, k, nodes)
                if nodes
                else self.drafter.propose(state, k, backoff=self._pool is not None)
            )
        stats.lookup_s += time.perf_counter() - t0
        stats.lookups += 1
        return d

    def _prefetch(self, states, drafts: dict[int, Draft], k: int) -> dict[int, dict]:
        """Drafts prepared for each row's likely (accepted, bonus) outcomes."""
        prepared: dict[int, dict] = {}
        for i, d in drafts.items():
            st = states[i]
            mark = len(st.tokens)
            prepared[i] = {}
            for j, b in self.prefetcher.plan(d):
                st.extend(d.tokens[:j] + [b])
                prepared[i][(j, b)] = self.drafter.propose(st, k, backoff=True)
                st.truncate(mark)
        return prepared

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        generator: Optional[torch.Generator] = None,
        forced: Optional[list[list[int]]] = None,
    ) -> RolloutResult:
        """n samples per prompt, grouped. Each forward scores every live row's last token and its
        draft (a chain, or a tree), verifies the draft against the row's own position-keyed samples,
        commits the accepted tokens plus one, and rolls the rejected columns out of the KV cache.

        forced (benchmarks): per row (prompt-major, n per prompt), the completion to commit
        instead of sampling, at least max_new_tokens long: every forward runs as it would, the
        target's distribution is a point mass on the forced token, so drafts are accepted exactly
        where they equal it (`loomrl bench rollout` forces recorded rollouts onto a random model)."""
        start = time.perf_counter()
        model = self.model
        was_training = model.training
        model.eval()
        k = self.drafter_cfg.k if self.drafter else 0
        stats = DraftStats([0] * k, [0] * k)
        control = self.control
        d = self._start(prompts, params, generator, forced, k)
        t_step, index_s = time.perf_counter(), self.drafter.index_s if self.drafter else 0.0
        arm = (control.choose() if control else Choice(k, self.tree_nodes)) if self.drafter else Choice(0, 0)
        drafts = self._propose_all(d, prompts, params, arm, {}, stats)
        forwards, seq_forwards = 1, len(d.rows)
        while not all(d.done):
            d.drop_finished(model.device)  # finished rows leave the batch: later forwards score live rows only
            n = len(d.live)
            seq_forwards += n
            forwards += 1
            step = self._decode_step(d, drafts, arm.nodes > 0, params, k, stats)
            next_drafts, committed_now = self._commit(d, drafts, arm.nodes > 0, step, params, stats)
            if control is not None:
                # this forward's lookups, forward and verification; indexing finished completions and
                # new requests is paid once whatever the draft length, so it is left out of the comparison
                now, indexed = time.perf_counter(), self.drafter.index_s
                seconds = now - t_step - (indexed - index_s)  # read only while the controller calibrates
                positions, lookups = n * len(step.committed[0]), len(drafts)
                control.observe(seconds, n, step.n_accepted, committed_now, positions, lookups)
                t_step, index_s = now, indexed
                arm = control.choose()
            if self.drafter:
                drafts = self._propose_all(d, prompts, params, arm, next_drafts, stats)
        model.train(was_training)
        self.last_stats = stats
        self.spec_metrics = control.summary() if control is not None else {}
        rollouts = [
            Rollout(pi, j, d.tokens[i], d.logps[i], "stop" if d.tokens[i][-1] == model.eos_token_id else "length")
            for i, (pi, j) in enumerate(d.rows)
        ]
        return RolloutResult(rollouts, forwards, time.perf_counter() - start, seq_forwards)

    def _start(
        self, prompts: list[Prompt], params: SamplingParams, generator, forced: Optional[list[list[int]]], k: int
    ) -> "_Decoding":
        """The prefill of every row (n per prompt, media encoded once each) and its first token."""
        model = self.model
        rows = [(pi, j) for pi in range(len(prompts)) for j in range(params.n)]
        b = len(rows)
        row_media = [prompts[pi].media for pi, _ in rows]
        encodings = model.encode_media([m for p in prompts for m in p.media])
        dev = model.device  # every tensor below is made there, and the generator draws there
        force = None
        if forced is not None:
            if len(forced) != b or min(len(f) for f in forced) < params.max_new_tokens:
                raise ValueError(f"forced: {b} completions of at least {params.max_new_tokens} tokens expected")
            force = to_device(torch.tensor([f[: params.max_new_tokens] for f in forced]), dev)
        ids, mask = left_pad([prompts[pi].ids for pi, _ in rows], model.pad_token_id, dev)
        # M-RoPE: image tokens take (t, h, w) positions; generated tokens continue from the
        # prompt's largest position + 1 (rope_deltas), as in transformers' Qwen2-VL
        positions, rope_deltas = model.position_ids(ids, mask, row_media)
        embeds, deepstack = model.embed_inputs(ids, row_media, encodings)
        logits, cache = model.forward_embeds(embeds, mask, positions=positions, deepstack=deepstack)
        logp = model.token_logprobs(logits[:, -1], _report_temperature(params))
        probs, log_mass = target_distribution(logp, params.temperature, params.top_p)
        if force is not None:
            probs = _point_mass(probs, force, torch.zeros((b, 1), dtype=torch.long, device=dev))
        first = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        first_logp = sampled_logprobs(logp, first, log_mass)
        tokens = [[t] for t in to_host(first).tolist()]
        logps = [[x] for x in to_host(first_logp).tolist()]
        # later tokens are position-keyed samples (position_keyed_sample): a row's seed and the position
        row_seeds = torch.randint(0, 1 << 62, (b,), generator=generator, device=dev)
        done = [params.max_new_tokens <= 1 or t[0] == model.eos_token_id for t in tokens]
        return _Decoding(
            rows, tokens, logps, done, [None] * b, [k] * b, list(range(b)), mask, cache, row_seeds, rope_deltas, force
        )

    def _propose_all(
        self, d: "_Decoding", prompts: list[Prompt], params: SamplingParams, arm: Choice, ready: dict, stats
    ) -> dict:
        """Each live row's draft of up to arm.k tokens (a Draft), or with arm.nodes > 0 its draft
        tree of up to arm.nodes tokens arm.k deep (a Tree): prefetched (`ready`) or looked up."""
        out: dict = {}
        memo: dict = {}
        if arm.k == 0:  # plain decoding: no lookups
            return out
        for i in range(len(d.rows)):
            if d.done[i]:
                continue
            left = params.max_new_tokens - 1 - len(d.tokens[i])
            n = min(arm.k, left) if arm.nodes else min(arm.k, d.cap[i], left)
            prompt = prompts[d.rows[i][0]]
            if d.states[i] is None:
                d.states[i] = self.drafter.start(prompt.id, prompt.ids + d.tokens[i])
            else:  # plain forwards do not index their tokens: the state catches up when the row drafts
                d.states[i].extend(d.tokens[i][len(d.states[i].tokens) - len(prompt.ids) :])
            if i in ready and not arm.nodes:  # deterministic drafter: a shorter draft is a prefix of a longer one
                r = ready[i]
                out[i] = Draft(r.tokens[:n], r.alternatives[: n + 1], r.backoff[: n + 1])
                continue
            out[i] = self._propose(d.states[i], n, arm.nodes, stats, memo)
        return out

    def _decode_step(self, d: "_Decoding", drafts: dict, tree: bool, params: SamplingParams, k: int, stats) -> "_Step":
        """One forward over the live rows and their drafts, verified; the rejected columns leave the KV
        cache and the mask. Returns what the host needs, brought over in one copy."""
        model, dev = self.model, self.model.device
        n = len(d.live)
        step_ids, step_mask, draft, parent, depth, counts, width = _step_columns(d, drafts, tree, model.pad_token_id)
        d.mask = torch.cat([d.mask, step_mask], dim=1)
        col0 = d.mask.shape[1] - width
        future = (
            self._pool.submit(self._prefetch, d.states, dict(drafts), k) if self._pool and drafts and not tree else None
        )
        logits, d.cache = model.forward_embeds(
            model.language_model.embed(step_ids),
            d.mask,
            d.cache,
            rope_deltas=d.rope_deltas,
            tree=(depth, tree_mask(parent, depth)) if tree else None,
        )
        logp = model.token_logprobs(logits, _report_temperature(params))  # [B, W, V]
        probs, log_mass = target_distribution(logp, params.temperature, params.top_p)
        if d.force is not None:
            probs = _point_mass(probs, d.force, counts + depth)
        prepared = future.result() if future is not None else {}
        sample = position_keyed_sample(probs, d.seeds, counts + depth)
        sample_logp = sampled_logprobs(logp, sample, log_mass)
        j, path = _accepted_path(sample, draft, parent, depth, tree)
        committed, committed_logp = sample.gather(1, path), sample_logp.gather(1, path)
        if width > 1:  # roll back: the rejected draft columns leave the KV cache and the mask
            d.mask, d.cache = drop_rejected(d.mask, d.cache, col0, 1 + j, path)
        # what the host needs of this forward, in one copy: per row j and the committed
        # tokens with their log-probs, per draft position the drafted and accepted counts
        per_pos = k if width > 1 else 0  # a forward without drafts drafted and accepted nothing
        levels = torch.arange(1, per_pos + 1, device=dev)[None]
        n_drafted = (depth.amax(dim=1)[:, None] >= levels).sum(dim=0)
        n_accepted = (j[:, None] >= levels).sum(dim=0)
        host = to_host(
            torch.cat(
                [
                    j[:, None].double(),
                    committed.double(),
                    committed_logp.double(),
                    torch.cat([n_drafted, n_accepted]).double()[None].expand(n, -1),
                ],
                dim=1,
            )
        )
        n_drafted = host[0, 1 + 2 * width : 1 + 2 * width + per_pos].long().tolist() + [0] * (k - per_pos)
        n_accepted = host[0, 1 + 2 * width + per_pos :].long().tolist() + [0] * (k - per_pos)
        for pos in range(k):
            stats.drafted_by_pos[pos] += n_drafted[pos]
            stats.accepted_by_pos[pos] += n_accepted[pos]
        return _Step(
            host[:, 0].long().tolist(),
            host[:, 1 : 1 + width].long().tolist(),
            host[:, 1 + width : 1 + 2 * width].tolist(),
            n_accepted,
            prepared,
        )

    def _commit(
        self, d: "_Decoding", drafts: dict, tree: bool, step: "_Step", params: SamplingParams, stats
    ) -> tuple[dict, int]:
        """Each live row takes its accepted drafts and the bonus token (up to EOS); a row that ends is
        done. Returns the next drafts the prefetcher prepared for the outcomes that happened, and the
        tokens committed."""
        eos = self.model.eos_token_id
        next_drafts: dict[int, Draft] = {}
        committed_now = 0
        for r, i in enumerate(d.live):
            ji = step.accepted[r]
            new = step.committed[r][: ji + 1]
            new_logp = step.committed_logp[r][: ji + 1]
            if eos in new:
                cut = new.index(eos) + 1
                new, new_logp = new[:cut], new_logp[:cut]
            d.tokens[i].extend(new)
            d.logps[i].extend(new_logp)
            committed_now += len(new)
            if new[-1] == eos or len(d.tokens[i]) >= params.max_new_tokens:
                d.done[i] = True
                continue
            if i in drafts and not tree:  # (drafts exist only with a drafter)
                n_d = len(drafts[i].tokens)
                if n_d:
                    d.cap[i] = 2 * (ji + 1)
                outcome = (ji, new[-1])
                prepared = step.prepared.get(i, {})  # (prepared only with the prefetch thread)
                if self.prefetcher:
                    self.prefetcher.observe(n_d, ji, outcome in prepared)
                stats.outcomes += 1
                if outcome in prepared:
                    stats.prefetched += 1
                    next_drafts[i] = prepared[outcome]
        return next_drafts, committed_now

    def generate_plain(
        self, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
    ) -> Optional[RolloutResult]:
        """The same batch, same weights, no drafter (timed side by side with drafting)."""
        if self.drafter is None:
            return None
        return TorchRolloutEngine(self.model).generate(prompts, params, generator)

    def state_dict(self) -> dict:
        """What a resumed run needs to continue exactly: version, drafter histories,
        prefetcher statistics (JSON)."""
        state: dict = {"version": self.version}
        if self.drafter:
            state["drafter"] = self.drafter.state_dict()
            state["accept_hist"] = {str(k): v for k, v in self.prefetcher.accept_hist.items()}
        if self.control is not None:
            state["draft_control"] = self.control.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        if self.drafter and "drafter" in state:
            self.drafter.load_state_dict(state["drafter"])
            self.prefetcher.accept_hist = {int(k): v for k, v in state["accept_hist"].items()}
        if self.control is not None and "draft_control" in state:
            self.control.load_state_dict(state["draft_control"])

    def observe(self, prompt_id: str, completion_ids: list[int]) -> None:
        """Feed a finished rollout into the drafter's history of its prompt."""
        if self.drafter:
            self.drafter.observe(prompt_id, completion_ids)

    def update_weights(self, weights: Optional[Iterable[tuple[str, torch.Tensor]]], version: int) -> None:
        # Drafter histories are kept: earlier policies' completions remain good drafts.
        if weights is not None:
            state = dict(weights)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or (missing and set(missing) != {"language_model.lm_head.weight"}):
                raise ValueError(f"weight sync: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.version = version

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.model = None


@dataclass
class _Decoding:
    """The rows of one `generate` call while they decode. The host lists are indexed by row
    (prompt-major, n per prompt); the tensors hold the live rows only, in `live` order."""

    rows: list  # (prompt index, sample index)
    tokens: list  # completion tokens so far
    logps: list  # their log-probs
    done: list
    states: list  # a row's drafter state, made when it first drafts and caught up whenever it drafts again
    # per row, the most it drafts next: twice what its last draft got committed (its accepted
    # tokens + 1), so a row whose drafts keep failing costs the forward few extra positions
    cap: list
    live: list  # the rows in the batch tensors (mask, cache, seeds), in order
    mask: torch.Tensor
    cache: list
    seeds: torch.Tensor  # per live row: its position-keyed samples draw from (seed, position)
    rope_deltas: Optional[torch.Tensor]
    force: Optional[torch.Tensor]  # benchmarks: per live row, the completion to commit

    def drop_finished(self, dev) -> None:
        """Finished rows leave the batch tensors."""
        still = [r for r, i in enumerate(self.live) if not self.done[i]]
        if len(still) == len(self.live):
            return
        sel = to_device(torch.tensor(still), dev)
        self.mask, self.seeds = self.mask[sel], self.seeds[sel]
        self.cache = [(kc[sel], vc[sel]) for kc, vc in self.cache]
        self.rope_deltas = self.rope_deltas[sel] if self.rope_deltas is not None else None
        self.force = self.force[sel] if self.force is not None else None
        self.live = [self.live[r] for r in still]


@dataclass
class _Step:
    """What the host needs of one verified forward, per live row: accepted drafts, committed
    tokens and log-probs (by column along the accepted path); per draft position the accepted
    count; the prefetcher's prepared next drafts."""

    accepted: list
    committed: list
    committed_logp: list
    n_accepted: list
    prepared: dict


def _report_temperature(params: SamplingParams) -> float:
    """The temperature reported log-probs are under (greedy decoding reports T = 1)."""
    return params.temperature if params.temperature > 0 else 1.0


def _point_mass(probs: torch.Tensor, force: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Benchmarks: the distribution at each position, replaced by a point mass on the forced token."""
    tok = force.gather(1, positions.clamp(max=force.shape[1] - 1))
    return torch.zeros_like(probs).scatter_(-1, tok.view(*probs.shape[:-1], 1), 1.0)


def _step_columns(d: _Decoding, drafts: dict, tree: bool, pad_token_id: int):
    """The forward's inputs for the live rows, built on the host and moved in one copy: column 0 is
    the row's last token; column c > 0 is draft token c - 1, whose parent column is parent[c] and
    which sits depth[c] positions after column 0 (a single draft: c - 1 and c). Returns (ids, mask,
    draft, parent, depth, counts of completion tokens so far, width)."""
    width = 1 + max((len(drafts[i].tokens) for i in d.live if i in drafts), default=0)
    rows = []  # per live row: ids, mask, draft, parent, depth (width each), then its count
    for i in d.live:
        dr = drafts[i] if i in drafts else Tree()
        m, pad = len(dr.tokens), width - 1 - len(dr.tokens)
        tokens = list(dr.tokens)
        if tree:
            parents, depths = [p + 1 for p in dr.parents], dr.depths()
        else:
            parents, depths = list(range(m)), list(range(1, m + 1))
        rows.append(
            [d.tokens[i][-1], *tokens, *[pad_token_id] * pad]
            + [*[1] * (1 + m), *[0] * pad]
            + [-1, *tokens, *[-1] * pad]
            + [0, *parents, *range(1 + m, width)]  # padding columns: their own parent, depth 0
            + [0, *depths, *[0] * pad]
            + [len(d.tokens[i])]
        )
    step = to_device(torch.tensor(rows, dtype=torch.long), d.mask.device)
    return (*step.split([width] * 5 + [1], dim=1), width)


def _accepted_path(sample: torch.Tensor, draft, parent, depth, tree: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every row at once: each column's own sample (the token at its position, given its
    ancestors) decides which child, if any, is accepted next. The accepted columns form a path from
    column 0; returns j (its length: the accepted drafts, [B]) and the column at each depth [B, W]
    (the sample at depth j is the bonus token)."""
    n, width = sample.shape
    dev = sample.device
    if not tree:  # a single draft: columns in order, accepted up to the first mismatch
        accept = (sample[:, :-1] == draft[:, 1:]) & (draft[:, 1:] >= 0)
        return accept.long().cumprod(dim=1).sum(dim=1), torch.arange(width, device=dev).expand(n, width)
    accepted = torch.zeros((n, width), dtype=torch.bool, device=dev)
    accepted[:, 0] = True
    for level in range(1, int(depth.max()) + 1):
        accepted |= (depth == level) & (draft == sample.gather(1, parent)) & accepted.gather(1, parent)
    j = (depth * accepted).amax(dim=1)
    path = torch.zeros((n, width + 1), dtype=torch.long, device=dev)  # column at each depth
    path.scatter_(1, torch.where(accepted, depth, width), torch.arange(width, device=dev).expand(n, width))
    return j, path[:, :width]
