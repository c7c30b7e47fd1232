"""The distribution a rollout token is drawn from, and the log-prob reported for it.

Temperature, then the top-p nucleus (`backbone.vlm.nucleus`: the rule vLLM applies too), or a point
mass for greedy decoding. A sampled token's log-prob is reported under the distribution it was drawn
from, so with top_p < 1 under the renormalised nucleus, as vLLM's processed log-probs are; the
trainer's comparisons renormalise its own log-probs the same way (`sequence_logprobs(top_p=...)`).
"""

from __future__ import annotations

import torch

from loomrl.platform.backbone.vlm import nucleus, nucleus_log_mass
from loomrl.platform.rollout.base import SamplingParams


def target_probs(logp: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution tokens are drawn from: nucleus of softmax(logits / T), or greedy."""
    if temperature == 0:
        return torch.zeros_like(logp).scatter_(-1, logp.argmax(-1, keepdim=True), 1.0)
    probs = logp.exp()
    if top_p < 1.0:
        kept, order = nucleus(probs, top_p)
        probs = torch.zeros_like(probs).scatter(-1, order, kept)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sampled_logprobs(logp: torch.Tensor, tokens: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reported log-probs of the sampled tokens: under the distribution they were drawn from,
    so with top_p < 1 the nucleus's (renormalised), as vLLM's processed log-probs are."""
    out = logp.gather(-1, tokens[..., None]).squeeze(-1)
    if params.temperature > 0 and params.top_p < 1.0:
        out = out - nucleus_log_mass(logp, params.top_p)
    return out
