"""Worker for tests/test_fsdp2_engine.py, run under torchrun with 2 processes (gloo):
`python -m torch.distributed.run --nproc-per-node 2 tests/fsdp2_worker.py SHARD_DIR OUT.json`.

The same fixed micro-batches as tests/engines_worker.py (the demo model, the real GRPO loss, 4
mini-batches of 4 micro-batches), trained by the torch engine in each process (the reference)
and by the FSDP2 engine in variants: FP32; CPU offload; layers kept gathered between forward
and backward (reshard_after_forward false); mini-batches where a tower is idle on one rank or on
every rank; activation checkpointing with vision + merger frozen (against the torch engine with
the same parts frozen); LoRA; BF16 with FSDP2's mixed precision and BF16 autocast alone
(against the torch engine's BF16 path); a stop after 2 steps and a resume from the saved engine
state. Rank 0 writes losses, grad norms and the max
|difference| of the exported weights to OUT.json.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from engines_worker import STEPS, STOP, make_batches, train  # noqa: E402

from loomrl.platform import recipe as R  # noqa: E402
from loomrl.platform.algorithms.losses import policy_loss_fn  # noqa: E402
from loomrl.platform.backbone.tokenizer import load_tokenizer  # noqa: E402
from loomrl.platform.backbone.vlm import build_policy  # noqa: E402
from loomrl.platform.engines import fsdp2_engine, launch  # noqa: E402
from loomrl.platform.engines.torch_engine import TorchTrainEngine  # noqa: E402
from loomrl.platform.trajectory.batch import micro_batches  # noqa: E402

FROZEN = ["vision", "merger"]


def maxdiff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def run(name, recipe, policy, batches, loss_fn, out, reference=None, **settings) -> dict:
    """FSDP2 on `policy` (copied) with `settings` (training.* / training.fsdp2.* fields), its rows
    and the max |diff| of its exported weights from `reference` (the torch engine's model)."""
    cfg = copy.deepcopy(recipe.training)
    for key, value in settings.items():
        target = cfg.fsdp2 if key in {f.name for f in dataclasses.fields(cfg.fsdp2)} else cfg
        setattr(target, key, value)
    engine = fsdp2_engine.FSDP2TrainEngine(copy.deepcopy(policy), cfg)
    out[name] = train(engine, batches, loss_fn)
    exported = dict(engine.export_weights())
    if reference is not None:
        out[name + "_weights_maxdiff"] = maxdiff(exported, reference.state_dict())
    if name == "frozen_ac":
        names = {n for n, q in policy.named_parameters() if not q.requires_grad}
        start = policy.state_dict()
        out["frozen_names"] = len(names)
        out["frozen_maxdiff"] = max(float((exported[k] - start[k]).abs().max()) for k in names)
        optimised = {id(q) for q in engine.optimizer.param_groups[0]["params"]}
        frozen = {id(q) for part in FROZEN for q in engine.model.parameter_parts()[part]}
        out["frozen_in_optimizer"] = len(optimised & frozen)
        out["trainable_missing"] = len({id(q) for q in engine.model.parameters() if q.requires_grad} - optimised)
    return exported


def resume(recipe, policy, batches, loss_fn, out, path) -> None:
    """2 steps, the optimizer state saved sharded (as a checkpoint does), a fresh policy from the
    exported weights and a fresh engine with the state loaded, 2 more steps."""
    first = fsdp2_engine.FSDP2TrainEngine(copy.deepcopy(policy), recipe.training)
    part = train(first, batches[:STOP], loss_fn)
    first.save_sharded(path)  # every rank its own shards
    weights = dict(first.export_weights())
    out["saved_files"] = sorted(f.name for f in path.iterdir())
    resumed = copy.deepcopy(policy)
    resumed.load_state_dict(weights, strict=False)
    second = fsdp2_engine.FSDP2TrainEngine(resumed, recipe.training)
    second.load_sharded(path)
    out["resumed"] = part + train(second, batches[STOP:], loss_fn)
    out["resumed_weights"] = dict(second.export_weights())


def one_tower_batches(policy, trajectories) -> list:
    """Mini-batches where a tower sits idle: the first has image-only prompts (the audio tower
    unused by every rank: no gradient, AdamW skips it), the second [image-only, with audio,
    image-only] micro-batches (rank 0 images only, rank 1 audio too: its audio gradients meet
    zeros from rank 0 in the reduction); then the usual ones."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for step, trajs in enumerate(trajectories[:2]):
        image = [i for i, t in enumerate(trajs) if {m.kind for m in t.media} == {"image"}]
        audio = [i for i, t in enumerate(trajs) if "audio" in {m.kind for m in t.media}]
        rows = [image[:8], image[8:]] if step == 0 else [image[:4], audio[:4], image[4:8]]
        mbs = micro_batches(trajs, policy.pad_token_id, 8, rows=rows)
        with torch.no_grad():
            for mb in mbs:
                logp, _ = policy.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
                mb.old_logp = logp + 0.05 * torch.randn(logp.shape, generator=gen)
        out.append(mbs)
    return out


def reference(recipe, policy, batches, loss_fn, **settings):
    cfg = copy.deepcopy(recipe.training)
    for key, value in settings.items():
        setattr(cfg, key, value)
    model = copy.deepcopy(policy)
    return train(TorchTrainEngine(model, cfg), batches, loss_fn), model


def main():
    shard_dir, out_path = sys.argv[1:3]
    launch.init_distributed()
    recipe = R.Recipe()
    recipe.training.lr = 3e-3  # big enough that the steps move the weights visibly
    tokenizer = load_tokenizer("demo")
    policy = build_policy(recipe.model, tokenizer, seed=0)
    batches, trajectories = make_batches(recipe, policy, tokenizer, shard_dir)
    assert len(batches) == STEPS
    loss_fn = policy_loss_fn(recipe)
    out: dict = {}
    out["torch"], ref = reference(recipe, policy, batches, loss_fn)
    fp32 = run("fp32", recipe, policy, batches, loss_fn, out, ref)
    run("offload", recipe, policy, batches, loss_fn, out, ref, cpu_offload=True)
    run("keep_gathered", recipe, policy, batches, loss_fn, out, ref, reshard_after_forward=False)
    idle = one_tower_batches(policy, trajectories) + batches[2:]
    out["torch_idle"], ref_idle = reference(recipe, policy, idle, loss_fn)
    run("idle", recipe, policy, idle, loss_fn, out, ref_idle)
    frozen = copy.deepcopy(policy)
    frozen.freeze(FROZEN)
    out["torch_frozen"], ref_frozen = reference(recipe, frozen, batches, loss_fn)
    ac = copy.deepcopy(frozen)
    ac.set_activation_checkpointing(True)
    run("frozen_ac", recipe, ac, batches, loss_fn, out, ref_frozen, activation_checkpointing=True)

    lora_recipe = copy.deepcopy(recipe)
    lora_recipe.model.lora.rank = 4
    lora = build_policy(lora_recipe.model, tokenizer, seed=0)
    out["torch_lora"], ref_lora = reference(recipe, lora, batches, loss_fn)
    run("lora", recipe, lora, batches, loss_fn, out, ref_lora)

    out["torch_bf16"], ref_bf16 = reference(recipe, policy, batches, loss_fn, precision="bf16")
    run("bf16_mixed", recipe, policy, batches, loss_fn, out, ref_bf16, precision="bf16", mixed_precision=True)
    run("bf16_autocast", recipe, policy, batches, loss_fn, out, ref_bf16, precision="bf16")

    resume(recipe, policy, batches, loss_fn, out, Path(f"{out_path}.engine"))
    out["resumed_weights_maxdiff"] = maxdiff(out.pop("resumed_weights"), fp32)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
    launch.finish()


if __name__ == "__main__":
    main()
