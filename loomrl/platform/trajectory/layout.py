"""On-demand micro-batch layout: an admitted mini-batch laid out the way its
micro-batches will be consumed.

- Packing: trajectories keep their admitted order (so a layout with no token
  budget is exactly `batch.micro_batches`); a micro-batch closes when it holds
  `micro_batch_size` rows or one more row would push its padded size (rows x
  longest row) past `tokens_per_micro_batch`. A row longer than the budget on
  its own gets a micro-batch to itself (a sequence is never cut).
- Media: every distinct medium (content hash + preprocessing) is moved once per
  mini-batch; `media_transfer` counts bytes with and without that dedup.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loomrl.platform.trajectory.batch import MicroBatch, Trajectory, micro_batches


def plan(lengths: list[int], micro_batch_size: int, tokens_per_micro_batch: int = 0) -> list[list[int]]:
    """Indices of each micro-batch, in order, from the rows' sequence lengths."""
    out: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for i, n in enumerate(lengths):
        w = max(width, n)
        too_wide = tokens_per_micro_batch and cur and w * (len(cur) + 1) > tokens_per_micro_batch
        if cur and (len(cur) == micro_batch_size or too_wide):
            out.append(cur)
            cur, w = [], n
        cur.append(i)
        width = w
    if cur:
        out.append(cur)
    return out


def layout(
    trajs: list[Trajectory],
    pad_id: int,
    micro_batch_size: int,
    tokens_per_micro_batch: int = 0,
    device: torch.device = torch.device("cpu"),
) -> list[MicroBatch]:
    """One mini-batch as its micro-batches on `device` (`batch.micro_batches` with the packing `plan`)."""
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in trajs]
    return micro_batches(
        trajs, pad_id, micro_batch_size, plan(lengths, micro_batch_size, tokens_per_micro_batch), device
    )


@dataclass
class MediaTransfer:
    total: int = 0  # media placements (one per trajectory that uses a medium)
    unique: int = 0  # distinct media
    bytes_naive: int = 0  # every placement moved
    bytes_dedup: int = 0  # each distinct medium moved once


def media_transfer(trajs: list[Trajectory]) -> MediaTransfer:
    seen: dict = {}
    naive = 0
    for t in trajs:
        for m in t.media:
            naive += m.nbytes
            seen.setdefault(m.key, m.nbytes)
    return MediaTransfer(sum(len(t.media) for t in trajs), len(seen), naive, sum(seen.values()))
