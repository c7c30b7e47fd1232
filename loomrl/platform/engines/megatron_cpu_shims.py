"""The shims Megatron-core 0.16 needs to run on a CPU (gloo) and nowhere else.

Megatron-core assumes a CUDA device in three places that matter here:

1. Layers ask `torch.cuda.current_device()` for the device of the buffers they
   allocate (e.g. the all-gather buffer of ColumnParallelLinear). Without CUDA the
   call raises; on CPU every tensor lives on "cpu", which `torch.empty(device=...)`
   accepts, so it returns "cpu".
2. `CudaRNGStatesTracker.fork()` swaps CUDA RNG states around dropout and init so
   tensor-parallel ranks draw different (or identical) numbers. There is no CUDA RNG;
   loomrl's models have no dropout and their weights are loaded from the HF layout
   (never drawn by Megatron), so a null context is exact here.
3. Activation recompute (`recompute_granularity="full"`, training.activation_checkpointing)
   saves the CUDA RNG state before each recomputed layer and restores it for the
   recomputation; without CUDA there is none to save (the CPU RNG is still saved and
   restored), so getting and setting it do nothing.

`apply()` patches all three only when CUDA is unavailable and is idempotent; on a GPU it
does nothing. Megatron's own optimizer also assumes CUDA; loomrl does not use it
(the engine runs torch AdamW), so no shim is needed for it.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def apply() -> bool:
    """Patch Megatron for CPU when there is no CUDA. Returns whether patches are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"
    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    # activation recompute saves and restores the CUDA RNG state around each recomputed layer
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    _applied = True
    return True
