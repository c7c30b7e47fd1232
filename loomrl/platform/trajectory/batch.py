"""A trajectory (one sampled completion with everything training needs) and the
collation of trajectories into padded micro-batch tensors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from loomrl.encoders.media import Medium


@dataclass
class Trajectory:
    prompt_id: str
    group: int                      # index of its prompt within the step
    prompt_ids: list[int]
    completion_ids: list[int]
    media: list[Medium]
    rollout_logprobs: list[float]   # from the rollout engine
    reward: float
    version: int                    # policy version that generated it
    advantage: float = 0.0
    reward_parts: dict = field(default_factory=dict)  # reward source name -> its score


@dataclass
class MicroBatch:
    input_ids: torch.Tensor         # [B, T] prompt + completion, right-padded
    attention_mask: torch.Tensor    # [B, T]
    loss_mask: torch.Tensor         # [B, T-1] 1 where position t predicts a completion token
    media: list[list[Medium]]
    advantages: torch.Tensor        # [B] per sequence (GRPO), or [B, T-1] per token (PPO)
    rollout_logp: torch.Tensor      # [B, T-1] aligned with loss_mask
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    normaliser: float = 1.0         # loss divisor: completion tokens of the whole mini-batch
    sequences: int = 1              # sequences of the whole mini-batch (sequence-level loss divisor)
    values: Optional[torch.Tensor] = None   # [B, T-1] critic values before the update (PPO)
    returns: Optional[torch.Tensor] = None  # [B, T-1] GAE value targets (PPO)
    trajectories: list[Trajectory] = field(default_factory=list)


def collate(trajs: list[Trajectory], pad_id: int) -> MicroBatch:
    width = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)
    b = len(trajs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1))
    rollout_logp = torch.zeros((b, width - 1))
    for i, t in enumerate(trajs):
        seq = t.prompt_ids + t.completion_ids
        p, n = len(t.prompt_ids), len(t.completion_ids)
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        loss_mask[i, p - 1:p - 1 + n] = 1  # position j predicts token j+1
        rollout_logp[i, p - 1:p - 1 + n] = torch.tensor(t.rollout_logprobs)
    adv = torch.tensor([t.advantage for t in trajs], dtype=torch.float32)
    return MicroBatch(ids, attn, loss_mask, [t.media for t in trajs], adv, rollout_logp, trajectories=trajs)


def split(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def micro_batches(trajs: list[Trajectory], pad_id: int, micro_batch_size: int,
                  rows: Optional[list[list[int]]] = None) -> list[MicroBatch]:
    """One mini-batch as its micro-batches, each loss normalised by the mini-batch's
    completion tokens (so accumulated micro-batch losses add up to the mini-batch loss).

    rows: the indices of each micro-batch (`layout.plan`); None = consecutive chunks of
    `micro_batch_size`."""
    chunks = split(trajs, micro_batch_size) if rows is None else [[trajs[i] for i in idx] for idx in rows]
    mbs = [collate(c, pad_id) for c in chunks]
    total = float(sum(mb.loss_mask.sum() for mb in mbs))
    for mb in mbs:
        mb.normaliser = total
        mb.sequences = len(trajs)
    return mbs
