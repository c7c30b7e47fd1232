"""The built-in rollout engine: batched, KV-cached sampling with the policy in torch.

Prompts are left-padded into one batch (n rows per prompt); media are encoded
once per distinct medium. Each decode step samples the next token with
temperature / top-p and records the log-prob of the sampled token under
log_softmax(logits / temperature), the same quantity the trainer recomputes
(top-p truncation changes which tokens can be drawn, not the reported value).
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

from loomrl.platform.backbone.vlm import VLM
from loomrl.platform.rollout.base import Prompt, Rollout, RolloutResult, SamplingParams


def sample_tokens(logp: torch.Tensor, top_p: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Draw one token per row from log-probs [B, V], keeping the smallest top-p nucleus."""
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep a token if the mass before it is below top_p (the first is always kept)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


class TorchRolloutEngine:
    def __init__(self, model: VLM):
        self.model = model
        self.version = 0

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: SamplingParams,
                 generator: Optional[torch.Generator] = None) -> RolloutResult:
        start = time.perf_counter()
        model = self.model
        was_training = model.training
        model.eval()
        rows = [(pi, j) for pi in range(len(prompts)) for j in range(params.n)]
        row_media = [prompts[pi].media for pi, _ in rows]
        encodings = model.encode_media([m for p in prompts for m in p.media])
        ids, mask = left_pad([prompts[pi].ids for pi, _ in rows], model.pad_token_id)
        logits, cache = model.forward_embeds(model.embed(ids, row_media, encodings), mask)
        forwards = 1
        b = len(rows)
        done = torch.zeros(b, dtype=torch.bool)
        tokens: list[list[int]] = [[] for _ in range(b)]
        logps: list[list[float]] = [[] for _ in range(b)]
        for step in range(params.max_new_tokens):
            logp = model.token_logprobs(logits[:, -1], params.temperature)
            tok = sample_tokens(logp, params.top_p, generator)
            tok_logp = logp.gather(-1, tok[:, None]).squeeze(-1)
            live = ~done
            for i in live.nonzero().flatten().tolist():
                tokens[i].append(int(tok[i]))
                logps[i].append(float(tok_logp[i]))
            done = done | (tok == model.eos_token_id)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            tok = torch.where(live, tok, torch.full_like(tok, model.pad_token_id))
            mask = torch.cat([mask, live.long()[:, None]], dim=1)
            logits, cache = model.forward_embeds(model.language_model.embed(tok[:, None]), mask, cache)
            forwards += 1
        model.train(was_training)
        rollouts = [
            Rollout(pi, j, tokens[i], logps[i],
                    "stop" if tokens[i] and tokens[i][-1] == model.eos_token_id else "length")
            for i, (pi, j) in enumerate(rows)]
        return RolloutResult(rollouts, forwards, time.perf_counter() - start)

    def update_weights(self, weights: Optional[Iterable[tuple[str, torch.Tensor]]], version: int) -> None:
        if weights is not None:
            state = dict(weights)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or (missing and set(missing) != {"language_model.lm_head.weight"}):
                raise ValueError(f"weight sync: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.version = version

    def shutdown(self) -> None:
        self.model = None
