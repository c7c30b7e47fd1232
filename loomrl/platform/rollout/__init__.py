"""Rollout engines behind one seam (see base.py): the built-in torch engine and vLLM."""
from __future__ import annotations

import logging

log = logging.getLogger("loomrl")


def build_rollout_engine(recipe, model):
    """The recipe's rollout engine (`rollout.engine`) sampling from `model` (the trainer's
    full policy: the torch engine shares it, vLLM serves a synced copy)."""
    ro = recipe.rollout
    if ro.engine == "vllm":
        from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine

        engine = VLLMRolloutEngine(model, ro.vllm, ro.drafter, ro.temperature, ro.vllm.max_model_len,
                                   recipe.training.seed)
        log.info("[rollout] vLLM engine started in %.1fs%s", engine.start_s,
                 f"; drafting off: {engine.drafting_note}" if engine.drafting_note else "")
        return engine
    from loomrl.platform.rollout.torch_engine import TorchRolloutEngine

    return TorchRolloutEngine(model, ro.drafter)
