"""Training engines behind one seam (see base.py): torch (default), DeepSpeed ZeRO, Megatron-core."""
from __future__ import annotations


def build_engine(recipe, policy, params=None):
    """The recipe's training engine (`training.engine`) for `policy`. torch: trains `policy`
    itself (`params`: the parameters to optimise, default every trainable one). DeepSpeed /
    Megatron train their own copy; the trainer loads `engine.export_weights()` back into
    `policy` (the rollout copy) after its updates. Combinations an engine cannot train are
    refused by recipe validation (`recipe.validate`), never here."""
    name = recipe.training.engine
    if name == "torch":
        from loomrl.platform.engines.torch_engine import TorchTrainEngine

        return TorchTrainEngine(policy, recipe.training, params=params)
    if name == "deepspeed":
        from loomrl.platform.engines.deepspeed_engine import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(policy, recipe.training)
    if name == "megatron":
        from loomrl.platform.engines.launch import init_distributed
        from loomrl.platform.engines.megatron_engine import MegatronTrainEngine

        init_distributed()
        return MegatronTrainEngine(policy, recipe.training)
    raise ValueError(f"training.engine: unknown engine {name!r}")
