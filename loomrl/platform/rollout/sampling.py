"""The distribution a rollout token is drawn from, and the log-prob reported for it.

Temperature, then the top-p nucleus (`backbone.vlm.nucleus`: the rule vLLM applies too), or a point
mass for greedy decoding. A sampled token's log-prob is reported under the distribution it was drawn
from, so with top_p < 1 under the renormalised nucleus, as vLLM's processed log-probs are; the
trainer's comparisons renormalise its own log-probs the same way (`sequence_logprobs(top_p=...)`).
"""

from __future__ import annotations

import torch

from loomrl.platform.backbone.vlm import nucleus


def target_distribution(logp: torch.Tensor, temperature: float, top_p: float):
    """The distribution tokens are drawn from (nucleus of softmax(logits / T), or greedy), and the
    log of the nucleus's mass under softmax(logits / T) where top_p < 1 (else None): a drawn token's
    log-prob under its distribution is logp - that (`sampled_logprobs`), from the one sort."""
    if temperature == 0:
        return torch.zeros_like(logp).scatter_(-1, logp.argmax(-1, keepdim=True), 1.0), None
    probs = logp.exp()
    if top_p >= 1.0:
        return probs, None
    kept, order = nucleus(probs, top_p)
    probs = torch.zeros_like(probs).scatter(-1, order, kept)
    return probs / probs.sum(-1, keepdim=True), kept.sum(-1).log()  # the log: nucleus_log_mass's


def target_probs(logp: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution tokens are drawn from (`target_distribution` without the log-mass)."""
    return target_distribution(logp, temperature, top_p)[0]


def sampled_logprobs(logp: torch.Tensor, tokens: torch.Tensor, log_mass) -> torch.Tensor:
    """The reported log-probs of the sampled tokens: under the distribution they were drawn from,
    so with top_p < 1 the nucleus's (renormalised; log_mass from `target_distribution`), as vLLM's
    processed log-probs are."""
    out = logp.gather(-1, tokens[..., None]).squeeze(-1)
    return out if log_mass is None else out - log_mass
