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
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import types
from pathlib import Path

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
        raise ImportError(f"{_TV_MODULE}.{name} needs torchvision, which is not installed "
                          "(loomrl's stand-in offers only smart_resize)")

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

        def __call__(self, *args, **kwargs):
            raise RuntimeError("video input needs torchvision, which is not installed here "
                               "(loomrl's inert video processor; images and audio work)")

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
    return [sys.executable, "-c",
            f"import sys; sys.path.insert(0, {root!r}); import {__name__} as s; s.apply(); "
            "from vllm.model_executor.models.registry import _run; _run()"]


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
