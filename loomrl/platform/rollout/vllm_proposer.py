"""NgramRL inside vLLM: the per-prompt history drafter behind vLLM's `custom_class`
speculative-decoding hook.

vLLM builds the proposer as `NgramRLProposer(vllm_config)` in its worker and calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)` once per decoding step
with one row per running request; it passes no request ids. Prompt identity is patched
in: the loomrl engine names every request `lrl:<batch>:<prompt index>:<sample>` and,
before each generate, sends the batch's prompt keys through `collective_rpc` (`begin`);
`begin` also hands the proposer its model runner, whose `input_batch.req_ids` names the
request of each row. All n samples of a prompt and all later steps therefore draft
from one history, keyed by the loomrl prompt id. The drafter is the one implementation
in `rollout/drafter.py`; its histories are fed with finished rollouts (`begin` carries
the completions observed since the last batch), kept across weight updates.

With `rollout.drafter.adaptive` (the default) the draft length is chosen per step by the
same controller as the built-in engine's (`draft_control.DraftController`): vLLM's
`num_speculative_tokens` is only the longest draft, and a step whose arm is k drafts at
most k tokens per row (k = 0: every row's draft is empty, and vLLM then runs the step as
plain decoding, at plain decoding's cost: measured, see `loomrl bench rollout`), and a row
at most twice what its last draft got committed, as in the built-in engine. The
proposer sees one step at a time, so a step's counted work is its rows (the requests it
drafted for), its positions (each row's 1 + draft length) and its lookups, and their accepted
drafts are what the next call's sampled tokens say (accepted = sampled - 1); while the controller
calibrates, the step's measured time is the time from one `propose` call to the next (that step's
forward, verification and scheduling, and the lookups). The first step of a batch and the gap
between batches are not counted.

Unlike the built-in engine (position-keyed samples), vLLM's rejection sampler draws a sampled
token differently at each draft length: the distribution is the same, the token for a seed is not.
That is why the controller decides from counted work with a cost model fitted once and kept in
the checkpoint (`draft_control`): a resumed run chooses the draft lengths of the uninterrupted
one, and so commits its tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from itertools import compress
from typing import Optional

import torch

from loomrl.platform.rollout import vllm_shims
from loomrl.platform.rollout.config import DrafterConfig
from loomrl.platform.rollout.draft_control import CostCache, DraftController, machine
from loomrl.platform.rollout.drafter import DraftState, NgramDrafter

REQUEST_ID = re.compile(r"lrl:(\d+):(\d+):(\d+)")


def request_id(batch: int, prompt_index: int, sample: int) -> str:
    return f"lrl:{batch}:{prompt_index}:{sample}"


def workload(vllm_config) -> str:
    """What a cost model depends on (draft_control.CostCache): vLLM, torch, the device and its
    kernels, threads, the model's configuration (not its folder: loomrl serves each run's policy
    from a new temporary one, and two runs of one seed must adopt one fit), dtype, the longest draft."""
    import vllm

    m = vllm_config.model_config
    config = {k: v for k, v in m.hf_config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    shape = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return (
        f"vllm|{vllm.__version__}|torch={torch.__version__}|{machine(vllm_config.device_config.device_type)}"
        f"|model={shape}|hidden={m.get_hidden_size()}|layers={m.hf_text_config.num_hidden_layers}|{m.dtype}"
        f"|k={vllm_config.speculative_config.num_speculative_tokens}"
    )


class NgramRLProposer:
    def __init__(self, vllm_config):

        # built in vLLM's worker after its kernels are registered: sampled drafts verify exactly
        vllm_shims.fix_spec_sampling()
        vllm_shims.plain_steps_without_drafts()  # a step the controller runs plain costs a plain step
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.workload = workload(vllm_config)
        self.drafter: Optional[NgramDrafter] = None
        self.control: Optional[DraftController] = None  # rollout.drafter.adaptive
        self.runner = None
        self.batch = -1
        self.prompts: list[tuple[str, list[int]]] = []  # (prompt key, prompt ids) by prompt index
        self.states: dict[str, DraftState] = {}  # request id -> its draft state
        self.caps: dict[str, int] = {}  # request id -> its longest next draft (adaptive)
        self.tally = _tally(self.k)  # drafts verified since the last `rpc_end_batch`
        # the last step: its start, draft length per request, lookups, whether any row drafted
        self._step: Optional[tuple[float, dict[str, int], int, bool]] = None
        self._zeros = [0] * self.k  # a plain step's accepted drafts by position
        self._empty: list[list[int]] = []  # a plain step's drafts: one empty list per row

    def load_model(self, *args, **kwargs) -> None:
        """No model: the drafter lives on the host, built from finished rollouts."""

    def begin(
        self,
        runner,
        cfg: DrafterConfig,
        batch: int,
        prompts: list[tuple[str, list[int]]],
        observed: list[tuple[str, list[int]]],
    ) -> None:
        self._build(cfg)
        self.runner = runner
        for key, completion in observed:
            self.drafter.observe(key, completion)
        if prompts:  # a new batch (not a flush of observed rollouts): the gap since the last step is not a step
            self.batch, self.prompts, self.states, self.caps, self._step = batch, prompts, {}, {}, None

    def _build(self, cfg: DrafterConfig) -> None:
        if self.drafter is None:
            self.drafter = NgramDrafter(cfg)
            cache = CostCache(self.workload) if cfg.cost_cache else None
            self.control = DraftController(self.k, cache=cache) if cfg.adaptive else None

    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs
    ) -> list[list[int]]:
        now = time.perf_counter()
        req_ids = self.runner.input_batch.req_ids if self.runner is not None else []
        plain_rows = None  # after a plain step: this step's rows of loomrl's batch (request id -> 0)
        if self._step is not None:
            start, lengths_before, lookups, drafted = self._step
            if drafted:
                self._account(now - start, lengths_before, lookups, req_ids, sampled_token_ids)
            else:
                plain_rows = self._account_plain(now - start, lengths_before, lookups, req_ids, sampled_token_ids)
        else:
            lengths_before = {}
        k = self.control.choose().k if self.control is not None else self.k
        if k == 0:  # plain decoding this step: no lookups, and a request's state catches up when it next drafts
            if plain_rows is None:
                plain_rows = self._rows(lengths_before, req_ids, sampled_token_ids)
            self._step = (now, plain_rows, 0, False)
            n = len(sampled_token_ids)
            if len(self._empty) < n:
                self._empty = [[] for _ in range(n)]
            # kept from step to step: vLLM hands empty drafts to no one (vllm_shims 4.), nor changes them
            return self._empty if len(self._empty) == n else self._empty[:n]
        drafts: list[list[int]] = []
        lengths: dict[str, int] = {}  # request id -> its draft length this step
        lookups = 0
        for i, sampled in enumerate(sampled_token_ids):
            state = self._state(req_ids[i] if i < len(req_ids) else None)
            if state is None or not len(sampled):
                drafts.append([])  # a request still in prefill, or one not started by loomrl
                continue
            n = int(num_tokens_no_spec[i])
            if n > len(state.tokens):  # tokens committed since the last step (prompt ids already in)
                state.extend(token_ids_cpu[i, len(state.tokens) : n].tolist())
            rid = req_ids[i]
            if self.control is not None and lengths_before.get(rid):  # as the built-in engine: at most twice
                self.caps[rid] = 2 * len(sampled)  # what its last draft got committed
            n_draft = min(k, self.caps.get(rid, k))
            drafts.append(self.drafter.propose(state, n_draft).tokens if n_draft > 0 else [])
            lookups += n_draft > 0
            lengths[rid] = len(drafts[-1])
        for rid in [r for r in self.states if r not in lengths]:
            del self.states[rid]  # finished requests
            self.caps.pop(rid, None)
        self._step = (now, lengths, lookups, any(lengths.values()))
        return drafts

    def _rows(self, before: dict[str, int], req_ids, sampled_token_ids) -> dict[str, int]:
        """The step's rows of loomrl's batch that decode (request id -> draft length 0)."""
        decoding = list(compress(req_ids, map(len, sampled_token_ids)))
        if all(map(before.__contains__, decoding)):  # no row joined: the usual step, in C loops
            return dict.fromkeys(decoding, 0)
        return {rid: 0 for rid in decoding if rid in before or self._ours(rid)}

    def _account_plain(
        self, seconds: float, rows: dict[str, int], lookups: int, req_ids, sampled_token_ids
    ) -> dict[str, int]:
        """`_account` for a step without drafts (nothing to tally; its rows, tokens and lookups for
        the controller); returns this step's rows (`_rows`). Called on every plain step, so its
        loops are C loops (map, compress), not a Python loop over the rows."""
        if all(map(rows.__contains__, req_ids)) and [] not in sampled_token_ids:
            # the usual step: no row joined and every row decoded (rows only leave, as they finish),
            # so every row counts, each with one token (no drafts were scheduled), and is a row of
            # the next step
            n = len(req_ids)
            if self.control is not None and n:
                self.control.observe(seconds, n, self._zeros, n, n, lookups)
            return rows if len(rows) == n else dict.fromkeys(req_ids, 0)
        counted = list(map(rows.__contains__, req_ids))
        n = sum(counted)
        if self.control is not None and n:
            tokens = sum(map(len, compress(sampled_token_ids, counted)))
            self.control.observe(seconds, n, [0] * self.k, tokens, n, lookups)
        return self._rows(rows, req_ids, sampled_token_ids)

    def _account(self, seconds: float, lengths: dict[str, int], lookups: int, req_ids, sampled_token_ids) -> None:
        """The last step's drafts as verified (this call's sampled tokens: vLLM learns that a request
        finished only after this call, so its last step is here too): counted into `tally`, and,
        with `adaptive`, the controller's view of the step: its rows, their accepted drafts, its time."""
        accepted = [0] * self.k  # rows with draft positions 0..i accepted
        rows = tokens = positions = 0
        t = self.tally
        for i, sampled in enumerate(sampled_token_ids):
            rid = req_ids[i] if i < len(req_ids) else None
            if rid in lengths:
                rows += 1
                tokens += len(sampled)
                positions += 1 + lengths[rid]
                a = min(len(sampled) - 1, lengths[rid])
                for p in range(a):
                    accepted[p] += 1
                if lengths[rid]:
                    t["drafts"] += 1
                    t["draft_tokens"] += lengths[rid]
                    t["accepted"] += a
        for p in range(self.k):
            t["accepted_per_pos"][p] += accepted[p]
        if self.control is not None and rows:
            self.control.observe(seconds, rows, accepted, tokens, positions, lookups)

    def _ours(self, rid: str) -> Optional[re.Match]:
        """A request of loomrl's current batch (its id parsed), or None."""
        m = REQUEST_ID.search(rid)
        return m if m is not None and int(m.group(1)) == self.batch else None

    def _state(self, rid: Optional[str]) -> Optional[DraftState]:
        if rid is None or self.drafter is None:
            return None
        state = self.states.get(rid)
        if state is None:
            m = self._ours(rid)
            if m is None:
                return None
            key, prompt_ids = self.prompts[int(m.group(2))]
            state = self.states[rid] = self.drafter.start(key, prompt_ids)
        return state


# --------------------------------------------------------------------------- worker-side calls
# Run inside vLLM's worker through LLM.collective_rpc (in-process or in vLLM's own
# process alike); module-level so they can be sent by reference.


def _proposer(worker) -> NgramRLProposer:
    drafter = getattr(worker.model_runner, "drafter", None)
    if not isinstance(drafter, NgramRLProposer):
        raise RuntimeError(f"vLLM's speculative proposer is {type(drafter).__name__}, not NgramRLProposer")
    return drafter


def rpc_begin(worker, cfg: DrafterConfig, batch: int, prompts, observed) -> None:
    _proposer(worker).begin(worker.model_runner, cfg, batch, prompts, observed)


def rpc_history_tokens(worker) -> int:
    d = _proposer(worker).drafter
    return d.history_tokens() if d is not None else 0


def _tally(k: int) -> dict:
    return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * k}


def rpc_end_batch(worker) -> tuple[dict, dict]:
    """(the drafts verified since the last call: how many, their tokens, the accepted ones in all
    and by position; the draft-length decision and its inputs since the last call: {} without
    `adaptive`)."""
    p = _proposer(worker)
    tally, p.tally = p.tally, _tally(p.k)
    return tally, (p.control.summary() if p.control is not None else {})


def rpc_state_dict(worker) -> Optional[dict]:
    p = _proposer(worker)
    if p.drafter is None:
        return None
    return {**p.drafter.state_dict(), **({"draft_control": p.control.state_dict()} if p.control else {})}


def rpc_load_state_dict(worker, cfg: DrafterConfig, state: dict) -> None:
    p = _proposer(worker)
    p._build(cfg)
    p.drafter.load_state_dict(state)
    if p.control is not None and "draft_control" in state:
        p.control.load_state_dict(state["draft_control"])
