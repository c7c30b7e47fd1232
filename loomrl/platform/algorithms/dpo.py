"""DPO (Rafailov et al. 2023): the policy trained directly on preference pairs, against a frozen
reference (the policy at the start of the run), with no reward model and no rollouts.

Per pair (a prompt with its media, a chosen answer y_c and a rejected one y_r), from the summed
log-probs of the answer tokens (the chat template's end-of-turn included) under the policy pi and
the reference:

    h = (log pi(y_c) - log pi(y_r)) - (log ref(y_c) - log ref(y_r))
    sigmoid:  L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)      (eps: label_smoothing,
              conservative DPO; eps = 0 is DPO as published)
    ipo:      L = (h - 1 / (2 beta))^2                                             (Azar et al. 2023)

and the implicit rewards r_c = beta (log pi(y_c) - log ref(y_c)), r_r = beta (log pi(y_r) - log ref(y_r)),
whose margin r_c - r_r = beta h is what `dpo_margin` reports (accuracy: the share of pairs with
r_c > r_r). The loss of a mini-batch is the mean over its pairs.

A micro-batch holds whole pairs, their chosen rows first, then their rejected rows in the same order
(`pair_batches` in platform/dpo_steps.py): both answers of a pair go through the policy in one
forward, and `mb.ref_logp` holds the reference's per-token log-probs of the same rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loomrl.platform.algorithms.base import ALGORITHMS

if TYPE_CHECKING:  # annotations only
    from loomrl.platform.algorithms.config import DPOConfig


def dpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    *,
    label_smoothing: float = 0.0,
    loss: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses [P] and the implicit rewards of the chosen and the rejected answers [P]
    (detached), from the pairs' summed answer log-probs [P] (the module docstring's formulas)."""
    h = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)
    if loss == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"algorithm.dpo.loss: {loss!r} is not one of ['sigmoid', 'ipo']")
    chosen = beta * (pi_chosen - ref_chosen).detach()
    rejected = beta * (pi_rejected - ref_rejected).detach()
    return losses, chosen, rejected


def answer_logps(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] summed log-probs of each row's answer tokens (`mask`: 1 where a position predicts one)."""
    return (logp * mask).sum(-1)


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor, pi: torch.Tensor) -> dict[str, float]:
    """Sums over a micro-batch's pairs (the engine adds the micro-batches' up): the implicit rewards,
    their margin, how many pairs rank the chosen answer higher, and the policy's own log-prob gap."""
    k = chosen.shape[0]
    pi = pi.detach()
    return {
        "pairs": float(k),
        "reward_chosen_sum": float(chosen.sum()),
        "reward_rejected_sum": float(rejected.sum()),
        "margin_sum": float((chosen - rejected).sum()),
        "correct": float((chosen > rejected).sum()),
        "logp_chosen_sum": float(pi[:k].sum()),
        "logp_rejected_sum": float(pi[k:].sum()),
    }


@ALGORITHMS.register("dpo", advantages=None, supervised=True, preference=True)
def dpo_loss_fn(config: DPOConfig):
    """The micro-batch loss the engines run (`algorithm.dpo`: beta, label smoothing, loss): the
    pairs' losses summed / the mini-batch's pairs (`mb.sequences`), so the micro-batches' losses
    add up to the mini-batch's mean. Needs mb.ref_logp (the reference's log-probs of the rows)."""

    def loss_fn(model, mb) -> tuple[torch.Tensor, dict[str, float]]:
        if mb.ref_logp is None:
            raise ValueError("DPO needs the reference's log-probs of the micro-batch (mb.ref_logp) before training")
        logp, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
        pi = answer_logps(logp, mb.loss_mask)
        ref = answer_logps(mb.ref_logp.to(logp), mb.loss_mask)
        k = pi.shape[0] // 2
        losses, chosen, rejected = dpo_loss(
            pi[:k],
            pi[k:],
            ref[:k],
            ref[k:],
            config.beta,
            label_smoothing=config.label_smoothing,
            loss=config.loss,
        )
        stats = pair_stats(chosen, rejected, pi)
        stats["tokens"] = float(mb.loss_mask.sum())
        return losses.sum() / mb.sequences, stats

    return loss_fn
