"""PyTorch FSDP2 training engine (`training.engine: fsdp2`, `torch.distributed.fsdp.fully_shard`).

Sharding. The engine trains its own copy of the policy. Every decoder layer is its own FSDP unit
(its weights sharded over the ranks at rest, all-gathered for its forward and, with
`reshard_after_forward`, again for its backward, its gradients reduce-scattered right after its
backward); the rest of the policy (embeddings, LM head, final norm, the vision / audio towers
and their projectors, LoRA adapters where they sit) is the root unit, sharded the same way and
gathered once per micro-batch. The towers are kept in the root unit on purpose: a micro-batch
may carry an image on one rank and none on another, and a tower unit of its own would then be
all-gathered on one rank only (a collective the other never joins); in the root unit, whose
gather and reduction run on every rank for every micro-batch, a tower unused on a rank
contributes zero gradients (`set_reduce_scatter_unused_params`). Towers unused by the whole
mini-batch get no gradient at all, as in the torch engine, so AdamW skips them.

Gradients. Each rank trains its share of a mini-batch's micro-batches (base.rank_share, padded
to equal counts with zero-weight repeats: every unit's all-gather is a collective every rank
must join). Each micro-batch loss is already normalised by the whole mini-batch's tokens, so
the ranks' gradients must be *summed*: the reduce-scatter's divide factor is 1 (FSDP2 averages
by default). Global-norm clipping runs on the sharded (DTensor) gradients, AdamW on the shards.

Precision. `training.precision: fp32`: everything FP32 (matches the torch engine to ~1e-7).
`bf16`: the forward runs under the torch engine's autocast; with `training.fsdp2.mixed_precision`
the units also gather BF16 copies of their FP32 master shards (MixedPrecisionPolicy, parameters
BF16, reductions FP32), so the weights are BF16 in every op, not only where autocast casts.
`cpu_offload` keeps shards, gradients and AdamW state in host memory (CPUOffloadPolicy).

Frozen parts, LoRA and activation checkpointing come with the policy's copy: parameters that do
not require grad get none, stay bit-identical and are left out of AdamW; the decoder's
torch.utils.checkpoint wraps each (sharded) layer's call, whose re-run in the backward uses
the weights FSDP gathered for that layer's backward.

Rollout sync: `export_weights` yields the full HF-layout tensors one at a time (each all-gathered
from its shards, a collective on every rank) and the trainer copies each into the rollout policy
as it comes (`load_exported`), never the whole model at once (`loomrl bench sync`). Checkpoints:
the full FP32 weights are the policy's (synced from the export, saved by checkpoint.py); the
AdamW state is sharded: every rank writes its own shards through torch.distributed.checkpoint
(`save_sharded`, into the checkpoint's `engine/`), nothing is gathered. A resume re-shards the
saved full weights and reads each rank's optimizer shards back (`load_sharded`; DCP re-shards).

The encoding cache's single encoder backward per mini-batch (a MiniBatchHook) is not used:
media are encoded inside each micro-batch's forward (deduplicated within it), same gradients.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from loomrl.config import RecipeError
from loomrl.encoders.base import modalities
from loomrl.platform.checkpoint import load_sharded, save_sharded, sharded_shapes
from loomrl.platform.engines.base import (
    TRAINING_ENGINES,
    LossFn,
    allreduce_stats,
    rank_share,
    world,
)
from loomrl.platform.engines.launch import init_distributed
from loomrl.platform.engines.torch_engine import autocast
from loomrl.platform.faults import maybe_die
from loomrl.platform.memory import GIB, MemoryTerm, ModelSizes, Precision, TrainingMemory, ceil_div


class _LossModule(nn.Module):
    """The root FSDP unit: its forward is one micro-batch's loss on the policy, so the root's
    gather and gradient reduction run around whatever policy methods the loss function calls."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, mb, loss_fn: LossFn):
        return loss_fn(self.model, mb)


def check_recipe(r) -> None:
    """FSDP2's own rule: `training.fsdp2.mixed_precision` is its BF16 mode, so it needs
    training.precision bf16 (the precision of the recipe decides)."""
    t = r.training
    if t.fsdp2.mixed_precision and t.precision != "bf16":
        raise RecipeError(
            "training.fsdp2.mixed_precision: BF16 parameters in compute need training.precision=bf16 "
            f"(got {t.precision!r})"
        )


def training_memory(sizes: ModelSizes, prec: Precision, training, *, dp: int, tp: int) -> TrainingMemory:
    """Its bytes per rank (`loomrl plan`): weights, gradients and AdamW state all sharded over dp
    (FP32 master weights), plus the units gathered at a time: the root (embeddings, head, towers)
    for a whole micro-batch and one decoder layer (BF16 copies under `mixed_precision`);
    `cpu_offload` moves the shards, gradients and AdamW state to host memory."""
    P, T, w, opt_per, f = sizes.params, sizes.trainable, prec.weight, prec.optimizer, training.fsdp2
    embeddings = sizes.vocab_size * sizes.hidden_size * (1 if sizes.tied else 2)
    layer = max(0, sizes.language_model - embeddings) // max(1, sizes.num_layers)
    root = P - layer * sizes.num_layers
    g = 2 if f.mixed_precision else w
    gathered = (root + layer) * g if dp > 1 else 0  # one rank holds everything anyway
    shards = ceil_div(P * w, dp)
    weights = MemoryTerm(
        shards + gathered,
        f"{P:,} params x {w} B / {dp} (sharded)"
        + (f" + gathered root {root:,} + one layer {layer:,} x {g} B" if gathered else ""),
    )
    grads = MemoryTerm(ceil_div(T * w, dp), f"{T:,} trainable x {w} B / {dp} (reduce-scattered)")
    opt = MemoryTerm(ceil_div(T * opt_per, dp), f"{T:,} trainable x {opt_per} B ({prec.optimizer_what}) / {dp}")
    desc = "fsdp2, per-layer units" + (", bf16 params in compute" if f.mixed_precision else "")
    cpu = 0
    if f.cpu_offload:
        cpu = shards + grads.bytes + opt.bytes
        weights = MemoryTerm(gathered, f"gathered root {root:,} + one layer {layer:,} x {g} B; shards offloaded")
        grads = MemoryTerm(0, f"offloaded to host memory ({cpu / GIB:.2f} GiB per rank with weights + optimizer)")
        opt = MemoryTerm(0, "offloaded to host memory")
        desc += ", cpu offload"
    return TrainingMemory(weights=weights, gradients=grads, optimizer=opt, cpu_bytes=cpu, desc=desc, policy_copy=True)


def _media_kinds(micro_batches: list) -> set[str]:
    """The kinds of medium anywhere in the mini-batch (every rank holds all of it)."""
    return {m.kind for mb in micro_batches for row in getattr(mb, "media", []) for m in row}


@TRAINING_ENGINES.register(
    "fsdp2",
    distributed=True,
    value_model=False,
    lora=True,
    check=check_recipe,
    autocast=True,
    memory=training_memory,
)
class FSDP2TrainEngine:
    supports_hook = False

    def __init__(self, policy: nn.Module, cfg, lr: float | None = None):
        """policy: the full VLM (copied; the copy is sharded and trains). cfg: the TrainingConfig."""
        init_distributed()
        self.cfg = cfg
        self.rank, self.size = world()
        self.device = next(policy.parameters()).device
        model = copy.deepcopy(policy)  # frozen parts, LoRA and activation checkpointing come with it
        self.root = _LossModule(model)
        self._shard(self.root, model)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]  # the sharded (DTensor) ones
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr if lr is None else lr, weight_decay=cfg.weight_decay)

    def _shard(self, root: nn.Module, model: nn.Module) -> None:
        """Every decoder layer a unit, then the root; gradients summed over the ranks."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        # A decoder layer returns its residual stream as a view; FSDP2 warns that an in-place op on it
        # would skip the layer's pre-backward hook. Nothing writes to it in place (the outputs are used
        # out of place; tests/test_fsdp2_engine.py checks the gradients against the torch engine's).
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPDecoderLayer\) returned a view")
        f = self.cfg.fsdp2
        mesh = init_device_mesh(self.device.type, (self.size,))
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if f.cpu_offload else OffloadPolicy()

        def policy(cast_inputs: bool) -> MixedPrecisionPolicy:
            if not f.mixed_precision:
                return MixedPrecisionPolicy()
            return MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs
            )

        for layer in model.language_model.model.layers:
            fully_shard(
                layer,
                mesh=mesh,
                reshard_after_forward=f.reshard_after_forward,
                mp_policy=policy(True),
                offload_policy=offload,
            )
        # the root's forward input is a MicroBatch: its FP32 log-probs and advantages stay FP32
        fully_shard(root, mesh=mesh, mp_policy=policy(False), offload_policy=offload)
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # sum over the ranks (the default averages)
                module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        assert isinstance(root, FSDPModule)
        root.set_reduce_scatter_unused_params(True)  # a tower unused on this rank: zeros

    @classmethod
    def from_recipe(cls, recipe, policy: nn.Module, params=None) -> "FSDP2TrainEngine":
        """Trains its own copy of `policy` (its trainable parameters)."""
        return cls(policy, recipe.training)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def train_mini_batch(self, micro_batches: list, loss_fn: LossFn, hook=None) -> dict[str, float]:
        """Forward/backward this rank's share of the micro-batches, one optimizer step on the
        summed, sharded gradients. Returns the stats summed over all ranks."""
        self.root.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"loss": 0.0}
        for mb, counts in rank_share(micro_batches, self.rank, self.size, equal=True):
            with autocast(self.cfg.precision, self.model):
                loss, stats = self.root(mb, loss_fn)
            (loss.float() * (1.0 if counts else 0.0)).backward()
            if counts:
                totals["loss"] += float(loss.detach())
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
            else:
                for k in stats:
                    totals.setdefault(k, 0.0)
        self._drop_unused(micro_batches)
        params = [p for p in self.params if p.grad is not None]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        maybe_die("optimizer")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals = allreduce_stats(totals)
        totals["grad_norm"] = float(norm)
        return totals

    def _drop_unused(self, micro_batches: list) -> None:
        """A tower no micro-batch of the mini-batch used got zeros from the reduction (unused
        parameters are reduced as zeros): no gradient, as in the torch engine, so AdamW skips it."""
        kinds = _media_kinds(micro_batches)
        used = [m.tower(self.model) for m in modalities() if m.name in kinds]  # video runs the image tower
        for m in modalities():
            tower = m.tower(self.model)
            if tower is None or any(tower is t for t in used):
                continue
            for params in m.parameter_parts(self.model).values():
                for p in params:
                    p.grad = None

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full FP32 tensors under the policy's names, one at a time (each all-gathered from its
        shards: collective, every rank must consume the whole iterator)."""
        for name, t in self.model.state_dict().items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            yield name, full.detach().to(self.device, torch.float32)

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """AdamW's state of the trainable parameters, `NAME/KEY` -> tensor (DTensor shards, the
        step a plain tensor), by parameter name."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {f"{names[id(p)]}/{k}": v for p in self.params for k, v in self.optimizer.state.get(p, {}).items()}

    def save_sharded(self, folder: Path) -> None:
        """Every rank writes its own shards of the AdamW state into `folder` (torch.distributed
        .checkpoint; collective). The weights themselves are the exported ones, saved with the policy."""
        save_sharded(self._optimizer_tensors(), folder)

    def load_sharded(self, folder: Path) -> None:
        """The AdamW state of a save_sharded() folder, each rank reading its own shards (any world
        size: DCP re-shards); ValueError naming the folder when it does not fit this model."""
        from torch.distributed.tensor import DTensor, zeros

        shapes = sharded_shapes(folder)
        by_name = dict(self.model.named_parameters())
        targets: dict[str, torch.Tensor] = {}
        for key, shape in shapes.items():
            name, _, what = key.rpartition("/")
            p = by_name.get(name)
            if p is None or not p.requires_grad or what not in ("step", "exp_avg", "exp_avg_sq"):
                raise ValueError(f"{folder}: {key!r} is not AdamW state of this model's trainable parameters")
            if what == "step":
                targets[key] = torch.zeros(shape)
            elif shape != tuple(p.shape):
                raise ValueError(f"{folder}: {key} has shape {shape}, the parameter {tuple(p.shape)}")
            elif isinstance(p, DTensor):
                targets[key] = zeros(p.shape, device_mesh=p.device_mesh, placements=p.placements)
            else:
                targets[key] = torch.zeros_like(p)
        missing = {n for n, p in by_name.items() if p.requires_grad} - {k.rpartition("/")[0] for k in shapes}
        if missing:
            raise ValueError(f"{folder}: no optimizer state for {sorted(missing)[:3]}")
        load_sharded(targets, folder)
        for p in self.params:
            name = next(n for n, q in by_name.items() if q is p)
            self.optimizer.state[p] = {k: targets[f"{name}/{k}"] for k in ("step", "exp_avg", "exp_avg_sq")}
