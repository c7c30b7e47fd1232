"""The training-engine seam and the few helpers the multi-process engines share.

Every engine (torch, deepspeed, megatron, fsdp2) has the same surface, used by the trainer (trainer.py):

    engine.model                                   the module the loss function runs on
    engine.train_mini_batch(mbs, loss_fn, hook)    forward/backward every micro-batch, one
                                                   optimizer step; stats summed over the
                                                   whole mini-batch (all ranks)
    engine.set_lr(lr)
    engine.export_weights()                        full HF-layout named tensors (for a rollout
                                                   engine or vLLM); collective on every rank
    engine.state_dict() / load_state_dict(state)   optimizer state for exact resume

    engine.supports_hook                           False: the engine ignores a MiniBatchHook

An engine registers itself in `TRAINING_ENGINES` under the name `training.engine` takes, with
`from_recipe(recipe, policy, params)` to build it and its traits, which recipe validation and
the launcher read (docs/extending.md):

    processes_max     most training processes it runs in (torch: 1); absent: any
    distributed       it needs a process group (torchrun above one process)
    value_model       it can train PPO's value model (value head or separate critic)
    lora              it runs the policy's own modules, LoRA adapters included
    check(recipe)     its own refusals (RecipeError naming the key), e.g. a tensor-parallel size

and, for `loomrl plan` (loomrl/platform/memory.py holds the plain data they take and return):

    memory(sizes, precision, training, *, dp, tp) -> TrainingMemory
                      its weights, gradients and optimizer per rank, as it shards them
    tensor_parallel(training)   the tensor-parallel size of its config; absent: 1
    padded_vocab(vocab, tp)     the vocabulary's rows as it pads them; absent: unpadded
    bf16(training)    its own BF16 switch beside `training.precision`; absent: none
    autocast          its bf16 is autocast over fp32 weights, gradients and optimizer
    master_weights    it takes `training.precision: bf16_params` (BF16 weights, FP32 masters)

Data parallelism: every rank rolls out its own share of a step's prompts and the
ranks exchange the trajectories (`trajectory/sources.py`), so every rank holds the
same mini-batch and trains on its share of the micro-batches (`rank_share`); each micro-batch
loss is already normalised by
the whole mini-batch's tokens, so the gradients of the ranks *add up* to the
single-process gradient.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from loomrl.config.registry import Registry

TRAINING_ENGINES: Registry = Registry("training engine", key="training.engine")
"""The training engines by name (`training.engine`); filled by the engine modules, which the
package imports."""

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


def allreduce_max(value: float, group=None) -> float:
    """The largest `value` over the ranks of `group` (collective)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def trajectory_digest(trajectories: list) -> int:
    """A signed 64-bit hash of a step's trajectories: prompt ids, completion token ids and
    rewards, in order (exact: the rewards' bits, not a rounding of them)."""
    h = hashlib.sha256()
    for t in trajectories:
        h.update(
            struct.pack(
                f"<2q{len(t.prompt_ids)}q{len(t.completion_ids)}qd",
                len(t.prompt_ids),
                len(t.completion_ids),
                *t.prompt_ids,
                *t.completion_ids,
                float(t.reward),
            )
        )
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def compare_digests(step: int, digests: list[int]) -> None:
    """Refuse a step whose ranks hold different trajectories (digests in rank order)."""
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(
            f"RL step {step}: rank(s) {differ} generated other rollouts than rank 0 "
            f"(trajectory digests per rank: {digests}); data parallelism needs every rank "
            f"to hold the same trajectories (same seeds, same rollout engine, same data)"
        )


def check_rank_agreement(step: int, trajectories: list) -> bool:
    """After the rollout exchange every rank must hold the same step's trajectories. All-gathers
    each rank's trajectory digest (collective) and raises naming the step if they differ.
    True when the check ran (more than one rank), False in a single process."""
    rank, size = world()
    if size == 1:
        return False
    mine = torch.tensor([trajectory_digest(trajectories)], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(every, mine)
    compare_digests(step, [int(t) for t in every])
    return True


def allreduce_grads(params: list[nn.Parameter], group=None) -> None:
    """Sum the gradients of `params` over `group` in one collective. A parameter without a
    gradient on some rank counts as zero there; one without a gradient on every rank keeps
    grad None (so the optimizer skips it, as the single-process engine does)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    has = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params] + [has]
    )
    dist.all_reduce(flat, group=group)
    has = flat[-len(params) :]
    offset = 0
    for p, h in zip(params, has.tolist()):
        n = p.numel()
        if h > 0:
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
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
        raise ValueError(
            f"{what}: the checkpoint holds {saved} rank states but this run has {size} "
            f"processes; resume with the same training.nproc"
        )
    return ranks[rank]


def load_exported(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy an engine's exported weights into the full policy (the rollout copy), one tensor at a
    time as the engine yields them, so the sync holds one exported tensor beside the policy, never a
    second copy of the model (`loomrl bench sync` measures it). Every parameter and buffer must be
    covered (a tied lm_head may come by name or not at all); an unknown name or another shape is a
    ValueError."""
    targets = dict(model.state_dict(keep_vars=True))  # the policy's own tensors, by name
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"engine weight export: unexpected {name!r}")
            if target.shape != tensor.shape:
                raise ValueError(
                    f"engine weight export: {name} has shape {tuple(tensor.shape)}, the policy {tuple(target.shape)}"
                )
            target.copy_(tensor)
            seen.add(name)
    missing = [k for k in targets if k not in seen and not k.endswith("lm_head.weight")]
    if missing:
        raise ValueError(f"engine weight export: missing {missing[:5]}")
