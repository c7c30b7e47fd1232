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
"""
from __future__ import annotations

import re
from typing import Optional

from loomrl.platform.recipe import DrafterConfig
from loomrl.platform.rollout.drafter import DraftState, NgramDrafter

REQUEST_ID = re.compile(r"lrl:(\d+):(\d+):(\d+)")


def request_id(batch: int, prompt_index: int, sample: int) -> str:
    return f"lrl:{batch}:{prompt_index}:{sample}"


class NgramRLProposer:
    def __init__(self, vllm_config):
        from loomrl.platform.rollout import vllm_shims

        # built in vLLM's worker after its kernels are registered: sampled drafts verify exactly
        vllm_shims.fix_spec_sampling()
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.drafter: Optional[NgramDrafter] = None
        self.runner = None
        self.batch = -1
        self.prompts: list[tuple[str, list[int]]] = []   # (prompt key, prompt ids) by prompt index
        self.states: dict[str, DraftState] = {}            # request id -> its draft state

    def load_model(self, *args, **kwargs) -> None:
        """No model: the drafter lives on the host, built from finished rollouts."""

    def begin(self, runner, cfg: DrafterConfig, batch: int, prompts: list[tuple[str, list[int]]],
              observed: list[tuple[str, list[int]]]) -> None:
        if self.drafter is None:
            self.drafter = NgramDrafter(cfg)
        self.runner = runner
        for key, completion in observed:
            self.drafter.observe(key, completion)
        self.batch, self.prompts, self.states = batch, prompts, {}

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **kwargs) -> list[list[int]]:
        req_ids = self.runner.input_batch.req_ids if self.runner is not None else []
        drafts: list[list[int]] = []
        live = set()
        for i, sampled in enumerate(sampled_token_ids):
            state = self._state(req_ids[i] if i < len(req_ids) else None)
            if state is None or not len(sampled):
                drafts.append([])  # a request still in prefill, or one not started by loomrl
                continue
            live.add(req_ids[i])
            n = int(num_tokens_no_spec[i])
            if n > len(state.tokens):  # tokens committed since the last step (prompt ids already in)
                state.extend(token_ids_cpu[i, len(state.tokens):n].tolist())
            drafts.append(self.drafter.propose(state, self.k).tokens)
        for rid in [r for r in self.states if r not in live]:
            del self.states[rid]  # finished requests
        return drafts

    def _state(self, rid: Optional[str]) -> Optional[DraftState]:
        if rid is None or self.drafter is None:
            return None
        state = self.states.get(rid)
        if state is None:
            m = REQUEST_ID.search(rid)
            if m is None or int(m.group(1)) != self.batch:
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


def rpc_state_dict(worker) -> Optional[dict]:
    d = _proposer(worker).drafter
    return d.state_dict() if d is not None else None


def rpc_load_state_dict(worker, cfg: DrafterConfig, state: dict) -> None:
    p = _proposer(worker)
    if p.drafter is None:
        p.drafter = NgramDrafter(cfg)
    p.drafter.load_state_dict(state)
