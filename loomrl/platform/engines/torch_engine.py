"""The built-in training engine: one process, AdamW, gradient accumulation over
micro-batches, global-norm clipping, FP32 or BF16 mixed precision.

`training.precision: bf16` is mixed precision in the usual sense: the parameters (master
weights), their gradients and AdamW's moments stay FP32; each micro-batch's forward (and the
hook's shared encoding forward) runs under `torch.autocast(<model device type>, bfloat16)`, so
the matmuls and attention compute in BF16 from BF16 copies of the FP32 weights, while ops that
autocast keeps in FP32 and everything the model casts explicitly (the log-softmax of
`VLM.token_logprobs`, the loss) stay FP32. The backward runs outside autocast (autograd replays
each op in its forward dtype) and the gradients arrive in FP32. No loss scaling: BF16 has FP32's
exponent range. `autocast(recipe_precision, module)` gives the same context to the other
forwards that must match the training one (the trainer's old / reference log-probs).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional, Protocol

import torch
from torch import nn

from loomrl.platform.engines.base import TRAINING_ENGINES
from loomrl.platform.engines.config import TrainingConfig
from loomrl.platform.faults import maybe_die
from loomrl.platform.memory import MemoryTerm, ModelSizes, Precision, TrainingMemory

LossFn = Callable[[nn.Module, object], tuple[torch.Tensor, dict[str, float]]]


def autocast(precision: str, module: nn.Module) -> ContextManager:
    """The forward context of `training.precision` for `module`: BF16 autocast on the device
    type of its first parameter for `bf16`, nothing for `fp32` and `bf16_params` (the
    parameters themselves are BF16 there)."""
    if precision in ("fp32", "bf16_params"):
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"training.precision: {precision!r} is not one of ['fp32', 'bf16', 'bf16_params']")
    device = next(module.parameters()).device.type
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


class MiniBatchHook(Protocol):
    """Work around a mini-batch's micro-batches, e.g. loomrl.encoders.cache.SharedEncodings:
    encode shared media once before them, run the encoder backward once after them."""

    def begin(self, micro_batches: list) -> None:
        """Before the first micro-batch's forward (model in train mode, grads zeroed)."""

    def finish(self) -> None:
        """After the last micro-batch's backward, before clipping and the optimizer step."""


def training_memory(sizes: ModelSizes, prec: Precision, training, *, dp: int, tp: int) -> TrainingMemory:
    """Its bytes per rank (`loomrl plan`): one process, the policy itself trained, nothing sharded."""
    P, T, w, opt_per = sizes.params, sizes.trainable, prec.weight, prec.optimizer
    return TrainingMemory(
        weights=MemoryTerm(P * w, f"{P:,} params x {w} B"),
        gradients=MemoryTerm(T * w, f"{T:,} trainable x {w} B"),
        optimizer=MemoryTerm(T * opt_per, f"{T:,} trainable x {opt_per} B ({prec.optimizer_what})"),
        cpu_bytes=0,
        desc="torch (one process)",
        policy_copy=False,
    )


@TRAINING_ENGINES.register(
    "torch", processes_max=1, value_model=True, lora=True, autocast=True, master_weights=True, memory=training_memory
)
class TorchTrainEngine:
    supports_hook = True  # runs a MiniBatchHook around the micro-batches (the encoding cache)

    @classmethod
    def from_recipe(cls, recipe, policy: nn.Module, params: list[nn.Parameter] | None = None) -> "TorchTrainEngine":
        """Trains `policy` itself (`params`: the parameters to optimise, default every trainable one)."""
        return cls(policy, recipe.training, params=params)

    def __init__(
        self, model: nn.Module, cfg: TrainingConfig, lr: float | None = None, params: list[nn.Parameter] | None = None
    ):
        self.model = model
        self.cfg = cfg
        params = [p for p in model.parameters() if p.requires_grad] if params is None else params
        self.params = params
        # bf16_params: AdamW steps FP32 master copies; the model's own weights are their BF16 roundings
        self.masters = MasterWeights(model, params) if cfg.precision == "bf16_params" else None
        stepped = self.masters.fp32 if self.masters is not None else params
        self.optimizer = torch.optim.AdamW(stepped, lr=cfg.lr if lr is None else lr, weight_decay=cfg.weight_decay)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def train_mini_batch(
        self, micro_batches: list, loss_fn: LossFn, hook: Optional[MiniBatchHook] = None
    ) -> dict[str, float]:
        """Forward/backward every micro-batch (loss_fn returns a loss already scaled
        to its share of the mini-batch), then one optimizer step. Returns summed stats."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if hook is not None:
            with autocast(self.cfg.precision, self.model):
                hook.begin(micro_batches)
        totals: dict[str, float] = {}
        masters = self.masters
        if masters is not None:
            masters.zero_grad()
        for mb in micro_batches:
            with autocast(self.cfg.precision, self.model):
                loss, stats = loss_fn(self.model, mb)
            loss.float().backward()  # FP32 already (fp32 log-softmax); backward outside autocast
            if masters is not None:
                masters.accumulate()  # each micro-batch's BF16 gradient into the FP32 sums
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        if hook is not None:
            hook.finish()  # the gradients it adds must be in before clipping
            if masters is not None:
                masters.accumulate()
        params = [p for p in (self.params if masters is None else masters.fp32) if p.grad is not None]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        totals["grad_norm"] = float(norm)

        maybe_die("optimizer")
        self.optimizer.step()
        if masters is not None:
            masters.publish()  # the model's BF16 weights: the new masters, rounded
        self.model.zero_grad(set_to_none=True)  # also frees grads of parameters not optimised here
        return totals

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Named tensors for a rollout engine (tied lm_head included by name)."""
        yield from self.model.state_dict().items()

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.masters is not None:  # the FP32 weights the BF16 model cannot hold
            state["masters"] = [m.detach().clone() for m in self.masters.fp32]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.masters is not None:
            self.masters.load(state.get("masters"))


class MasterWeights:
    """Megatron's and DeepSpeed's BF16 training, for one process: the model's parameters (all of
    them, frozen ones too, so every forward runs in BF16) become BF16, and the trained ones keep an
    FP32 master copy, which the optimizer steps. Each micro-batch's BF16 gradient is added to the
    master's FP32 gradient as soon as it exists (FP32 accumulation, as Megatron's `main_grad` and
    DeepSpeed's `grad_accum_dtype: fp32`); after the step the model's weights are the masters
    rounded to BF16. So old, reference and loss log-probs all come from the BF16 weights a BF16
    inference engine (vLLM) is given, with `model.rounding` deciding where each region rounds."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter]):
        self.params = params
        # a parameter keeps its master (`p.master`) from one engine to the next (warm-up -> RL), so a
        # stage change does not round the weights
        for p in params:
            if getattr(p, "master", None) is None:
                p.master = nn.Parameter(p.detach().float().clone(), requires_grad=True)
        self.fp32 = [p.master for p in params]
        model.to(torch.bfloat16)
        for p in params:  # a trained module outside the model (a value head)
            p.data = p.data.to(torch.bfloat16)

    def zero_grad(self) -> None:
        for m in self.fp32:
            m.grad = None

    def accumulate(self) -> None:
        """Move the parameters' BF16 gradients into the masters' FP32 gradients."""
        for p, m in zip(self.params, self.fp32):
            if p.grad is None:
                continue
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        for p, m in zip(self.params, self.fp32):
            p.copy_(m)

    @torch.no_grad()
    def load(self, masters: Optional[list[torch.Tensor]]) -> None:
        """The masters of a checkpoint (absent: an FP32 run's, the model's weights already are them)."""
        if masters is None:
            return
        if len(masters) != len(self.fp32) or any(a.shape != b.shape for a, b in zip(masters, self.fp32)):
            raise ValueError("training.precision bf16_params: the checkpoint's master weights do not fit the model")
        for m, saved in zip(self.fp32, masters):
            m.copy_(saved)
        self.publish()
