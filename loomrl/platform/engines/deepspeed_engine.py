"""DeepSpeed ZeRO training engine (stages 0-3, fp32 or bf16, optional optimizer offload).

The whole policy (towers, projector, language model) is one DeepSpeed module; the
optimizer is torch AdamW, which ZeRO partitions (stage 1: optimizer states, 2: + gradients,
3: + parameters). The DeepSpeed config comes from the recipe (`deepspeed_config`).

Each rank trains on its share of a mini-batch's micro-batches (base.rank_share, padded
to equal counts with zero-weight repeats: ZeRO-3 gathers parameters collectively in
every forward). Gradients accumulate locally over the micro-batches
(`managed_gradient_accumulation: false`) and are reduced once, in `step()`. DeepSpeed
averages gradients over the ranks, so each rank scales its loss by the world size: the
update equals the single-process one for the same mini-batch.

Frozen parts (training.freeze, model.encoders.frozen) and activation checkpointing
(training.activation_checkpointing) come with the policy's copy: the optimizer gets only
the weights that require grad (`params`), and the torch-level checkpointing of the decoder
layers and tower blocks runs inside the wrapped module.

The encoding cache's single encoder backward per mini-batch (a second backward outside
the engine's) is not used here: media are encoded inside each micro-batch's forward
(deduplicated within the micro-batch), and the gradients are the same.

Rollouts do not run on this (possibly partitioned) module: the trainer keeps a full
copy of the policy and loads `export_weights()` into it after every step.
"""

from __future__ import annotations

import copy
import logging
from typing import Iterator, Optional

import torch
from torch import nn

from loomrl.config import RecipeError
from loomrl.platform.engines.base import (
    TRAINING_ENGINES,
    LossFn,
    allreduce_stats,
    gather_rank_states,
    rank_share,
    rank_state,
    world,
)
from loomrl.platform.engines.launch import init_distributed
from loomrl.platform.faults import maybe_die
from loomrl.platform.memory import GIB, MemoryTerm, ModelSizes, Precision, TrainingMemory, ceil_div


def deepspeed_config(cfg) -> dict:
    """The DeepSpeed JSON config of a recipe's TrainingConfig (uses cfg.deepspeed, grad_clip)."""
    ds = cfg.deepspeed
    zero: dict = {
        "stage": ds.zero_stage,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": ds.reduce_bucket_size,
    }
    if ds.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter, however small
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,  # loomrl sizes micro-batches itself; this is bookkeeping
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # backward() accumulates; step() reduces and updates
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": ds.bf16},
        # bf16_params: each micro-batch's BF16 gradient is added to an FP32 sum (Megatron's main_grad)
        "data_types": {"grad_accum_dtype": "fp32" if cfg.precision == "bf16_params" else None},
        "zero_allow_untested_optimizer": True,  # torch AdamW under ZeRO
        "zero_force_ds_cpu_optimizer": False,  # offload with torch AdamW, no compiled cpu_adam (~60 s build)
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _skip_cpu_shm_build() -> None:
    """On CPU, DeepSpeed compiles a shared-memory all-reduce kernel (~40 s of C++ build at the
    first start) for its inference all-reduce; ZeRO training reduces through gloo and never
    calls it. Marking the op unavailable in DeepSpeed's op table skips the build."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class _LossModule(nn.Module):
    """The module DeepSpeed wraps: its forward is one micro-batch's loss on the policy."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, mb, loss_fn: LossFn):
        return loss_fn(self.model, mb)


def check_recipe(r) -> None:
    """DeepSpeed's own rules: BF16 and optimizer offload need ZeRO stage 1 or more, and BF16 training
    is DeepSpeed's BF16 mode (`training.deepspeed.bf16`)."""
    t = r.training
    if t.deepspeed.zero_stage == 0 and (t.deepspeed.bf16 or t.deepspeed.offload_optimizer):
        raise RecipeError("training.deepspeed.zero_stage: bf16 and offload_optimizer need zero_stage >= 1")
    if t.precision == "bf16" and not t.deepspeed.bf16:
        raise RecipeError(
            "training.precision: bf16 with training.engine=deepspeed is DeepSpeed's own BF16 "
            "mode; set training.deepspeed.bf16=true as well (it decides that engine's precision)"
        )
    if t.precision == "bf16_params" and not t.deepspeed.bf16:
        raise RecipeError(
            "training.precision: bf16_params with training.engine=deepspeed is DeepSpeed's BF16 mode with "
            "FP32 gradient accumulation; set training.deepspeed.bf16=true as well"
        )


def bf16_switch(training) -> bool:
    """Its own BF16 switch beside `training.precision`: `training.deepspeed.bf16`."""
    return bool(training.deepspeed.bf16)


def training_memory(sizes: ModelSizes, prec: Precision, training, *, dp: int, tp: int) -> TrainingMemory:
    """Its bytes per rank (`loomrl plan`): ZeRO-1 divides the optimizer by dp, ZeRO-2 also the
    gradients, ZeRO-3 also the weights; `offload_optimizer` moves the optimizer to host memory."""
    ds, P, T = training.deepspeed, sizes.params, sizes.trainable
    z, w, opt_per = ds.zero_stage, prec.weight, prec.optimizer
    shard_w, shard_g, shard_o = (dp if z >= 3 else 1), (dp if z >= 2 else 1), (dp if z >= 1 else 1)
    weights = MemoryTerm(
        ceil_div(P * w, shard_w), f"{P:,} params x {w} B" + (f" / {dp} (ZeRO-3)" if shard_w > 1 else "")
    )
    grads = MemoryTerm(
        ceil_div(T * w, shard_g), f"{T:,} trainable x {w} B" + (f" / {dp} (ZeRO-2+)" if shard_g > 1 else "")
    )
    opt = MemoryTerm(
        ceil_div(T * opt_per, shard_o),
        f"{T:,} trainable x {opt_per} B ({prec.optimizer_what})" + (f" / {dp} (ZeRO-1+)" if shard_o > 1 else ""),
    )
    desc = f"deepspeed ZeRO-{z}"
    cpu = 0
    if ds.offload_optimizer:
        cpu = opt.bytes
        opt = MemoryTerm(0, f"offloaded to host memory ({cpu / GIB:.2f} GiB per rank)")
        desc += ", optimizer offloaded"
    return TrainingMemory(weights=weights, gradients=grads, optimizer=opt, cpu_bytes=cpu, desc=desc, policy_copy=True)


@TRAINING_ENGINES.register(
    "deepspeed",
    distributed=True,
    value_model=False,
    lora=True,
    check=check_recipe,
    bf16=bf16_switch,
    master_weights=True,
    memory=training_memory,
)
class DeepSpeedTrainEngine:
    supports_hook = False

    def __init__(self, policy: nn.Module, cfg, lr: float | None = None):
        """policy: the full VLM (copied; the copy trains). cfg: the recipe's TrainingConfig."""
        _skip_cpu_shm_build()
        import deepspeed
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        init_distributed()
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.cfg = cfg
        self.stage = cfg.deepspeed.zero_stage
        self.rank, self.size = world()
        model = copy.deepcopy(policy)  # frozen parts and activation checkpointing come with the copy
        params = [p for p in model.parameters() if p.requires_grad]  # frozen weights: not optimised
        opt = torch.optim.AdamW(params, lr=cfg.lr if lr is None else lr, weight_decay=cfg.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=_LossModule(model), optimizer=opt, config=deepspeed_config(cfg)
        )
        self.model = model
        self.params = params
        self._client_opt = opt

    @classmethod
    def from_recipe(cls, recipe, policy: nn.Module, params=None) -> "DeepSpeedTrainEngine":
        """Trains its own copy of `policy` (its trainable parameters)."""
        return cls(policy, recipe.training)

    def set_lr(self, lr: float) -> None:
        for groups in (self.optimizer.param_groups, self._client_opt.param_groups):
            for g in groups:
                g["lr"] = lr

    def train_mini_batch(self, micro_batches: list, loss_fn: LossFn, hook=None) -> dict[str, float]:
        self.engine.train()
        totals: dict[str, float] = {"loss": 0.0}
        for mb, counts in rank_share(micro_batches, self.rank, self.size, equal=True):
            loss, stats = self.engine(mb, loss_fn)
            # DeepSpeed averages gradients over the ranks; the micro-batch losses of all ranks add up
            # to the mini-batch loss, so scale back up to a sum.
            self.engine.backward(loss * (self.size if counts else 0.0))
            if counts:
                totals["loss"] += float(loss.detach())
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
            else:
                for k in stats:
                    totals.setdefault(k, 0.0)

        maybe_die("optimizer")
        self.engine.step()
        totals = allreduce_stats(totals)
        norm = self.engine.get_global_grad_norm()
        totals["grad_norm"] = float(norm) if norm is not None else 0.0
        return totals

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's full tensors as fp32 under the policy's names, one at a time (ZeRO-3: gathered
        for the whole iteration; collective: every rank must consume it all).
        Under bf16 these are the BF16 module weights upcast, not the fp32 master copy (that one
        is in the optimizer's partitions and in state_dict())."""
        import deepspeed

        params = list(self.model.parameters()) if self.stage == 3 else []
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
            for name, t in self.model.state_dict().items():  # one at a time: the consumer copies it
                yield name, t.detach().to(torch.float32)

    def _partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 master partitions (ZeRO 1/2: flat per group; ZeRO-3: flat per group)."""
        if self.stage in (1, 2):
            return list(self.optimizer.single_partition_of_fp32_groups)
        return list(self.optimizer.fp32_partitioned_groups_flat)

    def state_dict(self) -> Optional[dict]:
        """Every rank's fp32 master partitions and AdamW state (tensors only), gathered on rank 0
        (None on the others); collective."""
        if self.stage == 0:
            if self.cfg.deepspeed.bf16:
                raise ValueError("training.deepspeed: bf16 checkpoints need zero_stage >= 1")
            local = {"optimizer": self.optimizer.state_dict()}
        else:
            local = {
                "fp32": [t.detach().clone() for t in self._partitions()],
                "optimizer": _param_states(self.optimizer.optimizer, self._partitions()),
            }
        return gather_rank_states(local)

    def load_state_dict(self, state: dict) -> None:
        local = rank_state(state, "deepspeed engine state")
        if self.stage == 0:
            self.optimizer.load_state_dict(local["optimizer"])
            return
        parts = self._partitions()
        if [t.shape for t in parts] != [t.shape for t in local["fp32"]]:
            raise ValueError("deepspeed engine state: fp32 partitions do not fit this model and world size")
        with torch.no_grad():
            for t, saved in zip(parts, local["fp32"]):
                t.copy_(saved)
        _load_param_states(self.optimizer.optimizer, parts, local["optimizer"])


def _param_states(opt: torch.optim.Optimizer, partitions: list[torch.Tensor]) -> list[dict]:
    """The inner optimizer's state (exp_avg, exp_avg_sq, step) of each fp32 partition. Keyed by
    the partitions, not by param_groups: ZeRO-3 puts a partition into its group only while it
    steps it, and the inner optimizer also holds stale entries torch's state_dict() cannot index."""
    return [
        {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in opt.state.get(t, {}).items()}
        for t in partitions
    ]


def _load_param_states(opt: torch.optim.Optimizer, partitions: list[torch.Tensor], saved: list[dict]) -> None:
    if len(partitions) != len(saved):
        raise ValueError("deepspeed engine state: optimizer partitions do not fit this model")
    for t, st in zip(partitions, saved):
        opt.state[t] = {k: v.to(t.device).clone() if torch.is_tensor(v) else v for k, v in st.items()}
