"""The training-engine seam and the few helpers the multi-process engines share.

Every engine (torch, deepspeed, megatron) has the same surface, used by the runner:

    engine.model                                   the module the loss function runs on
    engine.train_mini_batch(mbs, loss_fn, hook)    forward/backward every micro-batch, one
                                                   optimizer step; stats summed over the
                                                   whole mini-batch (all ranks)
    engine.set_lr(lr)
    engine.export_weights()                        full HF-layout named tensors (for a rollout
                                                   engine or vLLM); collective on every rank
    engine.state_dict() / load_state_dict(state)   optimizer state for exact resume

Data parallelism: every rank receives the same mini-batch and trains on its share
of the micro-batches (`rank_share`); each micro-batch loss is already normalised by
the whole mini-batch's tokens, so the gradients of the ranks *add up* to the
single-process gradient.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

LossFn = Callable[[nn.Module, object], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine(Protocol):
    model: nn.Module
    supports_hook: bool
    """False: the engine ignores a MiniBatchHook (the loss function then encodes media per micro-batch)."""

    def train_mini_batch(self, micro_batches: list, loss_fn: LossFn, hook=None) -> dict[str, float]: ...

    def set_lr(self, lr: float) -> None: ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def state_dict(self) -> Optional[dict]: ...

    def load_state_dict(self, state: dict) -> None: ...


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_share(micro_batches: list, rank: int, size: int, equal: bool = False) -> list[tuple[object, bool]]:
    """This rank's micro-batches as (micro_batch, counts). Round-robin, so ranks differ by
    at most one. equal=True pads a short rank with a repeat whose loss must be multiplied by
    0 (counts=False): ZeRO-3 gathers parameters collectively in every forward, so every rank
    must run as many forwards as the others."""
    mine = [(mb, True) for mb in micro_batches[rank::size]]
    if equal:
        most = -(-len(micro_batches) // size)
        while len(mine) < most:
            mine.append((micro_batches[rank % len(micro_batches)], False))
    return mine


def allreduce_stats(stats: dict[str, float], group=None) -> dict[str, float]:
    """Sum stats over the ranks of `group` (every rank must hold the same keys)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return stats
    keys = sorted(stats)
    t = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))


def allreduce_grads(params: list[nn.Parameter], group=None) -> None:
    """Sum the gradients of `params` over `group` in one collective. A parameter without a
    gradient on some rank counts as zero there; one without a gradient on every rank keeps
    grad None (so the optimizer skips it, as the single-process engine does)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    has = torch.tensor([float(p.grad is not None) for p in params])
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params] + [has])
    dist.all_reduce(flat, group=group)
    has = flat[-len(params):]
    offset = 0
    for p, h in zip(params, has.tolist()):
        n = p.numel()
        if h > 0:
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
        offset += n


def gather_rank_states(local: dict) -> Optional[dict]:
    """{"ranks": [state of rank 0, rank 1, ...]} on rank 0, None elsewhere (collective).
    The states are tensors and plain values; they travel between this job's own processes."""
    rank, size = world()
    if size == 1:
        return {"ranks": [local]}
    out = [None] * size if rank == 0 else None
    dist.gather_object(local, out, dst=0)
    return {"ranks": out} if rank == 0 else None


def rank_state(state: dict, what: str) -> dict:
    """This rank's entry of a gather_rank_states() checkpoint; a different world size is refused."""
    rank, size = world()
    ranks = state.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != size:
        saved = len(ranks) if isinstance(ranks, list) else "no"
        raise ValueError(f"{what}: the checkpoint holds {saved} rank states but this run has {size} "
                         f"processes; resume with the same training.nproc")
    return ranks[rank]


def load_exported(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy an engine's exported weights into the full policy (the rollout copy); every
    parameter must be covered (a tied lm_head may come by name or not at all)."""
    state = dict(weights)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"engine weight export: missing {missing[:5]}, unexpected {unexpected[:5]}")
