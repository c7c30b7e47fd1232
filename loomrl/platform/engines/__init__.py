"""Training engines behind one seam (see base.py): torch (default), DeepSpeed ZeRO, Megatron-core."""
from __future__ import annotations


def build_engine(recipe, policy):
    """The recipe's distributed training engine for `policy` (deepspeed or megatron; the runner
    builds the torch engine itself). The engine trains its own copy; the runner syncs
    `policy` (the rollout copy) from `engine.export_weights()` after every step."""
    from loomrl.platform.recipe import RecipeError

    name = recipe.training.engine
    if recipe.algorithm.name != "grpo":
        raise RecipeError(f"training.engine: {name} trains the policy only; algorithm.name="
                          f"{recipe.algorithm.name!r} (critic, value head) needs the torch engine")
    if name == "deepspeed":
        from loomrl.platform.engines.deepspeed_engine import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(policy, recipe.training)
    if name == "megatron":
        from loomrl.platform.engines.launch import init_distributed
        from loomrl.platform.engines.megatron_engine import MegatronTrainEngine

        init_distributed()
        return MegatronTrainEngine(policy, recipe.training)
    raise RecipeError(f"training.engine: {name!r} is built by the runner")
