"""Training engines behind one seam (see base.py): torch (default), DeepSpeed ZeRO, Megatron-core,
PyTorch FSDP2.
Importing the package registers them (`TRAINING_ENGINES`); their heavy libraries load when an
engine is built."""

from __future__ import annotations

from loomrl.platform.engines import (  # noqa: F401 (registration)
    deepspeed_engine,
    fsdp2_engine,
    megatron_engine,
    torch_engine,
)
from loomrl.platform.engines.base import TRAINING_ENGINES


def build_engine(recipe, policy, params=None):
    """The recipe's training engine (`training.engine`) for `policy`. torch: trains `policy`
    itself (`params`: the parameters to optimise, default every trainable one). DeepSpeed /
    Megatron train their own copy; the trainer loads `engine.export_weights()` back into
    `policy` (the rollout copy) after its updates. Combinations an engine cannot train are
    refused by recipe validation (`recipe.validate`, the engine's traits), never here."""
    return TRAINING_ENGINES.get(recipe.training.engine).obj.from_recipe(recipe, policy, params)
