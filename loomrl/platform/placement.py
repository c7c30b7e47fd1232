"""Device placement: one device per rank, chosen once, and a count of what crosses between
host and device.

`training.device` picks it (`choose_device`): `auto` is `cuda:LOCAL_RANK` where torch sees
CUDA and the CPU elsewhere; `cuda` insists (refused at validation on a machine without it);
`cpu` never uses a GPU. The trainer moves the policy there once, and everything built from
it follows: the reference model (a copy), the critic and value head, the reward models,
the encoding cache (it holds tower outputs), the built-in rollout engine (its tensors and
its sampling generator are created on the model's device) and every micro-batch.

There is no `if cuda` beyond that choice: on a CPU-only machine the same calls run with
`device=cpu`, where a move is free. What does cross is counted where it crosses, through
the two helpers below, and every RL step's metrics row reports it (`h2d_copies`,
`h2d_mb`, `d2h_copies`, `d2h_mb`): host -> device for micro-batches, media pixels and
prompt ids; device -> host for the tokens and log-probs the rollout engine hands back
each forward and the prompt embeddings vLLM takes. Scalar reads (`float(...)` of a loss
statistic) are syncs, not counted copies. On CPU the counts are 0 by
construction (nothing crosses); on a GPU they are the per-step traffic to watch, beside
`device_peak_mb` (`memory_row`, the peak allocated GPU memory so far).

`tools/gpu_check.sh` is the prepared check of all this on one GPU (docs/gpu.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch


def choose_device(setting: str = "auto", local_rank: int | None = None) -> torch.device:
    """The device of this rank for `training.device` (auto | cpu | cuda)."""
    if setting not in ("auto", "cpu", "cuda"):
        raise ValueError(f"training.device: {setting!r} is not one of ['auto', 'cpu', 'cuda']")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "training.device: 'cuda', but torch sees no CUDA device on this machine "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda})"
        )
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if rank >= torch.cuda.device_count():
        raise ValueError(
            f"training.device: local rank {rank} but only {torch.cuda.device_count()} CUDA "
            "device(s) are visible (CUDA_VISIBLE_DEVICES?)"
        )
    return torch.device("cuda", rank)


@dataclass
class Transfers:
    """Host <-> device copies made through `to_device` / `to_host`, since the last `take`."""

    h2d_copies: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0

    def take(self) -> dict[str, float]:
        """The counts as a metrics row's keys, then zero them (one RL step each)."""
        row = {
            "h2d_copies": self.h2d_copies,
            "h2d_mb": self.h2d_bytes / 2**20,
            "d2h_copies": self.d2h_copies,
            "d2h_mb": self.d2h_bytes / 2**20,
        }
        for f in fields(self):
            setattr(self, f.name, 0)
        return row


TRANSFERS = Transfers()
"""This process's counts (the trainer takes them once per RL step)."""


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (and `dtype`), counted when that is a copy between host and device."""
    if t.device != device and (t.device.type == "cpu") != (device.type == "cpu"):
        TRANSFERS.h2d_copies += device.type != "cpu"
        TRANSFERS.d2h_copies += device.type == "cpu"
        nbytes = t.numel() * t.element_size()
        if device.type == "cpu":
            TRANSFERS.d2h_bytes += nbytes
        else:
            TRANSFERS.h2d_bytes += nbytes
    return t.to(device=device, dtype=dtype)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU, counted when it was on a device."""
    return to_device(t, torch.device("cpu"))


def memory_row(device: torch.device) -> dict[str, float]:
    """The device's peak allocated memory so far, for a metrics row (`device_peak_mb`); nothing
    on the CPU, whose memory torch does not account."""
    if device.type != "cuda":
        return {}
    return {"device_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20}
