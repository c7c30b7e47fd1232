"""Rollout engines behind one seam (see base.py): the built-in torch engine and vLLM. Importing
the package registers them (`ROLLOUT_ENGINES`); vLLM itself loads when its engine is built."""

from __future__ import annotations

from loomrl.platform.rollout import torch_engine, vllm_engine  # noqa: F401 (registration)
from loomrl.platform.rollout.base import ROLLOUT_ENGINES


def build_rollout_engine(recipe, model):
    """The recipe's rollout engine (`rollout.engine`) sampling from `model` (the trainer's
    full policy: the torch engine shares it, vLLM serves a synced copy)."""
    return ROLLOUT_ENGINES.get(recipe.rollout.engine).obj.from_recipe(recipe, model)
