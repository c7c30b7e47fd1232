"""A trajectory (one sampled completion with everything training needs) and the
collation of trajectories into padded micro-batch tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from loomrl.encoders.media import Medium
from loomrl.platform.placement import to_device


@dataclass
class Trajectory:
    prompt_id: str
    group: int  # index of its prompt within the step
    prompt_ids: list[int]
    completion_ids: list[int]
    media: list[Medium]
    rollout_logprobs: list[float]  # from the rollout engine
    reward: float
    version: int  # policy version that generated it
    advantage: float = 0.0
    reward_parts: dict = field(default_factory=dict)  # reward source name -> its score
    # which completion tokens are trained (1) and which are context (0): a multi-turn SFT sample's
    # user turns between its assistant replies; None: every completion token
    completion_mask: Optional[list[int]] = None

    def trained_tokens(self) -> int:
        return len(self.completion_ids) if self.completion_mask is None else sum(self.completion_mask)


def rollout_trajectories(prompts: list, rollouts: list) -> list[Trajectory]:
    """Rollouts of `prompts` (rollout engine output) as trajectories to score with the trainer's
    forward: no reward, policy version 0 (the on-policy checks and the doctor)."""
    return [
        Trajectory(
            prompts[r.prompt_index].id,
            r.prompt_index,
            prompts[r.prompt_index].ids,
            r.completion_ids,
            prompts[r.prompt_index].media,
            r.logprobs,
            0.0,
            0,
        )
        for r in rollouts
    ]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T-1] 1 where position t predicts a completion token
    media: list[list[Medium]]
    advantages: torch.Tensor  # [B] per sequence (GRPO), or [B, T-1] per token (PPO)
    rollout_logp: torch.Tensor  # [B, T-1] aligned with loss_mask
    old_logp: Optional[torch.Tensor] = None
    old_nucleus: Optional[torch.Tensor] = None  # [B, T-1] log nucleus mass under pi_old (rollout.top_p < 1)
    ref_logp: Optional[torch.Tensor] = None
    normaliser: float = 1.0  # loss divisor: completion tokens of the whole mini-batch
    sequences: int = 1  # sequences of the whole mini-batch (sequence-level loss divisor)
    values: Optional[torch.Tensor] = None  # [B, T-1] critic values before the update (PPO)
    returns: Optional[torch.Tensor] = None  # [B, T-1] GAE value targets (PPO)
    trajectories: list[Trajectory] = field(default_factory=list)


def collate(trajs: list[Trajectory], pad_id: int, device: torch.device = torch.device("cpu")) -> MicroBatch:
    """Right-padded tensors of `trajs`, built on the host and moved to `device` (the model's)."""
    width = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)
    b = len(trajs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1))
    rollout_logp = torch.zeros((b, width - 1))
    for i, t in enumerate(trajs):
        seq = t.prompt_ids + t.completion_ids
        p, n = len(t.prompt_ids), len(t.completion_ids)
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        # position j predicts token j+1
        loss_mask[i, p - 1 : p - 1 + n] = 1 if t.completion_mask is None else torch.tensor(t.completion_mask)
        rollout_logp[i, p - 1 : p - 1 + n] = torch.tensor(t.rollout_logprobs)
    adv = torch.tensor([t.advantage for t in trajs], dtype=torch.float32)
    ids, attn, loss_mask, adv, rollout_logp = (to_device(x, device) for x in (ids, attn, loss_mask, adv, rollout_logp))
    return MicroBatch(ids, attn, loss_mask, [t.media for t in trajs], adv, rollout_logp, trajectories=trajs)


def split(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def micro_batches(
    trajs: list[Trajectory],
    pad_id: int,
    micro_batch_size: int,
    rows: Optional[list[list[int]]] = None,
    device: torch.device = torch.device("cpu"),
) -> list[MicroBatch]:
    """One mini-batch as its micro-batches, each loss normalised by the mini-batch's
    completion tokens (so accumulated micro-batch losses add up to the mini-batch loss).

    rows: the indices of each micro-batch (`layout.plan`); None = consecutive chunks of
    `micro_batch_size`. device: where the tensors go (the model's)."""
    chunks = split(trajs, micro_batch_size) if rows is None else [[trajs[i] for i in idx] for idx in rows]
    mbs = [collate(c, pad_id, device) for c in chunks]
    # the loss masks' sum, counted on the host (at least 1: a mini-batch of filtered responses trains nothing)
    total = float(max(1, sum(t.trained_tokens() for t in trajs)))
    for mb in mbs:
        mb.normaliser = total
        mb.sequences = len(trajs)
    return mbs
