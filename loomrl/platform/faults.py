"""Fault injection, the one hook the tests use to break a run on purpose; unset, each check costs
one environment lookup.

    LOOMRL_KILL_AT="point:step"     the process SIGKILLs itself when it reaches that point of that RL
                                    step (points: rollout, optimizer, checkpoint); a point outside
                                    training ("export": the export's folder filled, before its
                                    rename; "shards": a shard written under its temporary name)
                                    is named alone, LOOMRL_KILL_AT="export"; with
    LOOMRL_KILL_RANK=r              only in the rollout worker of global rank r
    LOOMRL_BAD_MESSAGE_RANK=r       rollout worker r's first result message carries a tensor whose
                                    header shape does not match its bytes (the trainer must refuse it)
"""

from __future__ import annotations

import os
import signal

import torch

from loomrl.platform.trajectory.transport import pack, unpack

current_step = -1  # set by the trainer (and rollout workers) at the start of each RL step
_corrupted = False


def maybe_die(point: str, rank: int | None = None) -> None:
    """SIGKILL this process at `point` of the current step (or at `point` alone) when LOOMRL_KILL_AT
    names it (and, for a
    rollout worker of global `rank`, when LOOMRL_KILL_RANK is unset or names it)."""
    if rank is not None and os.environ.get("LOOMRL_KILL_RANK", str(rank)) != str(rank):
        return
    if os.environ.get("LOOMRL_KILL_AT") in (f"{point}:{current_step}", point):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_corrupt(buf: torch.Tensor, rank: int) -> torch.Tensor:
    """`buf` (a packed message), or once per process on rank LOOMRL_BAD_MESSAGE_RANK, the same message
    with an extra tensor whose header claims shape [4] over the bytes of 3 floats."""
    global _corrupted
    if _corrupted or os.environ.get("LOOMRL_BAD_MESSAGE_RANK") != str(rank):
        return buf

    _corrupted = True
    meta, tensors = unpack(buf)
    bad = pack(meta, {**tensors, "bad": torch.zeros(3)})
    return tamper(bad, b'"bad", "float32", [3]', b'"bad", "float32", [4]')


def tamper(buf: torch.Tensor, old: bytes, new: bytes) -> torch.Tensor:
    """A packed message with `old` replaced by `new` (same length) in its bytes."""
    raw = bytes(buf.tolist()).replace(old, new, 1)
    assert len(new) == len(old) and raw != bytes(buf.tolist()), "tamper: nothing replaced"
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
