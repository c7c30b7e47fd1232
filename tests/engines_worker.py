"""Worker for tests/test_deepspeed_engine.py and tests/test_megatron_engine.py, run under
torchrun with 2 processes: `python -m torch.distributed.run --nproc-per-node 2
tests/engines_worker.py {deepspeed|megatron} SHARD_DIR OUT.json`.

It trains the demo model (tiny) with the real GRPO loss on fixed micro-batches built from
demo shards: the torch engine in each process as the reference, then the engine under
test for the same steps, then a stop/resume (state saved to a file, fresh policy from the
exported weights, fresh engine, state loaded) next to the uninterrupted run; last, the
memory tools (frozen parts + activation checkpointing) against the torch engine with the
same parts frozen. Rank 0 writes every loss and grad norm to OUT.json; the tests compare them.
"""

from __future__ import annotations

import copy
import glob
import json
import random
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from loomrl.datasets.source import PromptSource  # noqa: E402
from loomrl.datasets.stream import ShardStream  # noqa: E402
from loomrl.platform import recipe as R  # noqa: E402
from loomrl.platform.algorithms.losses import policy_loss_fn  # noqa: E402
from loomrl.platform.backbone.tokenizer import load_tokenizer  # noqa: E402
from loomrl.platform.backbone.vlm import build_policy  # noqa: E402
from loomrl.platform.engines import launch  # noqa: E402
from loomrl.platform.engines.base import allreduce_max, check_rank_agreement  # noqa: E402
from loomrl.platform.engines.torch_engine import TorchTrainEngine  # noqa: E402
from loomrl.platform.trajectory.batch import Trajectory, micro_batches  # noqa: E402

STEPS, STOP = 4, 2


def make_batches(recipe, policy, tokenizer, shard_dir):
    """STEPS mini-batches of 4 micro-batches (8 prompts x 4 samples, random completions,
    rewards and rollout log-probs; deterministic)."""
    files = sorted(glob.glob(f"{shard_dir}/*.tar"))
    source = PromptSource(ShardStream(files, shuffle_buffer=0, rank=0, world_size=1), policy, tokenizer, recipe.model)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    vocab = [i for i in range(len(tokenizer)) if i not in set(policy.banned_token_ids.tolist())]
    out, trajectories = [], []
    for _ in range(STEPS):
        trajs = []
        for g, s in enumerate(source.next(8)):
            for _ in range(4):
                ids = [rng.choice(vocab) for _ in range(rng.randint(2, 6))]
                trajs.append(
                    Trajectory(
                        s.id,
                        g,
                        s.ids,
                        ids,
                        s.media,
                        [-rng.random() * 3 for _ in ids],
                        0.0,
                        0,
                        advantage=rng.uniform(-1, 1),
                    )
                )
        trajectories.append(trajs)
        mbs = micro_batches(trajs, policy.pad_token_id, 8)
        # old log-probs near the initial policy's: the clipped ratio, hence the loss, then
        # depends on the weights each step trains
        with torch.no_grad():
            for mb in mbs:
                logp, _ = policy.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
                mb.old_logp = logp + 0.05 * torch.randn(logp.shape, generator=gen)
        out.append(mbs)
    return out, trajectories


def train(engine, batches, loss_fn, hook_for=None):
    rows = []
    for mbs in batches:
        hook = None
        if hook_for is not None and getattr(engine, "supports_hook", True):
            from loomrl.encoders.cache import SharedEncodings

            hook = SharedEncodings(engine.model)
        stats = engine.train_mini_batch(mbs, loss_fn if hook is None else policy_loss_fn(hook_for, hook), hook)
        rows.append({k: stats[k] for k in ("loss", "grad_norm", "tokens", "mismatch_sum")})
    return rows


def rank_agreement(trajs, rank) -> dict:
    """The runner's per-step check that every rank holds the same rollouts: on equal
    trajectories, and on rank 1 holding one other completion token (must raise on every rank)."""
    same = check_rank_agreement(0, trajs)
    other = copy.deepcopy(trajs)
    if rank == 1:
        other[-1].completion_ids[-1] += 1
    try:
        check_rank_agreement(7, other)
        error = ""
    except RuntimeError as e:
        error = str(e)
    flags = torch.tensor([int(same), int("RL step 7" in error)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # both ranks saw both outcomes
    return {"same_checked": int(flags[0]), "differing_refused": int(flags[1]), "error": error}


# Memory tools: parts frozen and activation checkpointing on; the reference is the torch engine
# with the same parts frozen (no checkpointing). Megatron trains its language model alone (tensor
# parallel): no layer input requires grad, which its reentrant recompute has to cope with.
MEMORY = {
    "deepspeed": ("zero3_memory", {"deepspeed.zero_stage": 3}, ["vision", "merger"]),
    "megatron": (
        "tp2_memory",
        {"megatron.tensor_parallel": 2},
        ["vision", "merger", "audio", "audio_projector", "embeddings"],
    ),
}


def memory_tools(which, recipe, policy, batches, loss_fn, build) -> dict:
    name, settings, parts = MEMORY[which]
    frozen_policy = copy.deepcopy(policy)
    frozen_policy.freeze(parts)
    ref = copy.deepcopy(frozen_policy)
    out = {"torch_frozen": train(TorchTrainEngine(ref, recipe.training), batches, loss_fn, hook_for=recipe)}
    cfg = configured(recipe.training, settings)
    cfg.activation_checkpointing, cfg.freeze = True, parts
    trained = copy.deepcopy(frozen_policy)
    trained.set_activation_checkpointing(True)
    engine = build(cfg, trained)
    out[name] = train(engine, batches, loss_fn, hook_for=recipe)
    # the engine's optimizer: no frozen weight, every trainable one (by identity in its own model)
    engine_parts = engine.model.parameter_parts()
    frozen_ids = {id(q) for part in parts for q in engine_parts[part]}
    trainable_ids = {id(q) for q in engine.model.parameters() if q.requires_grad}
    optimised = {id(q) for q in engine.params}
    out[name + "_optimizer"] = {
        "frozen_in": len(optimised & frozen_ids),
        "frozen": len(frozen_ids),
        "trainable_missing": len(trainable_ids - optimised),
        "extra": len(optimised - trainable_ids),
    }
    exported = dict(engine.export_weights())
    start = policy.state_dict()
    names = {
        n for n, q in policy.named_parameters() if any(q is f for part in parts for f in policy.parameter_parts()[part])
    }
    out[name + "_frozen_names"] = len(names)
    out[name + "_frozen_maxdiff"] = max(float((exported[k] - start[k]).abs().max()) for k in names)
    out[name + "_weights_maxdiff"] = max(float((exported[k] - v).abs().max()) for k, v in ref.state_dict().items())
    return out


def configured(training, settings: dict):
    """A copy of the training config with `settings` ("section.field" or "field": value) applied."""
    cfg = copy.deepcopy(training)
    for key, value in settings.items():
        *section, field = key.split(".")
        setattr(getattr(cfg, section[0]) if section else cfg, field, value)
    return cfg


def main():
    which, shard_dir, out_path = sys.argv[1:4]
    launch.init_distributed()
    rank = dist.get_rank()
    recipe = R.Recipe()
    recipe.training.lr = 3e-3  # big enough that the steps move the weights visibly
    tokenizer = load_tokenizer("demo")
    policy = build_policy(recipe.model, tokenizer, seed=0)
    batches, trajectories = make_batches(recipe, policy, tokenizer, shard_dir)
    loss_fn = policy_loss_fn(recipe)
    results = {
        "agreement": rank_agreement(trajectories[0], rank),
        "max_over_ranks": allreduce_max(0.5 + rank),
    }  # is_ratio_max's reduction

    ref = copy.deepcopy(policy)
    results["torch"] = train(TorchTrainEngine(ref, recipe.training), batches, loss_fn, hook_for=recipe)

    def build(cfg, pol):
        if which == "deepspeed":
            from loomrl.platform.engines.deepspeed_engine import DeepSpeedTrainEngine

            return DeepSpeedTrainEngine(pol, cfg)
        from loomrl.platform.engines.megatron_engine import MegatronTrainEngine

        return MegatronTrainEngine(pol, cfg)

    # BF16 weights with FP32 masters (training.precision bf16_params): the torch engine's is the reference
    bf16 = {"precision": "bf16_params"}
    ref_bf16 = copy.deepcopy(policy)
    results["torch_bf16"] = train(
        TorchTrainEngine(ref_bf16, configured(recipe.training, bf16)), batches, loss_fn, hook_for=recipe
    )
    variants = {
        "deepspeed": [
            ("zero2", {"deepspeed.zero_stage": 2}),
            ("zero3", {"deepspeed.zero_stage": 3}),
            ("zero2_bf16", {"deepspeed.zero_stage": 2, "deepspeed.bf16": True, **bf16}),
        ],
        "megatron": [
            ("tp2", {"megatron.tensor_parallel": 2}),
            ("tp1", {"megatron.tensor_parallel": 1}),
            ("tp2_bf16", {"megatron.tensor_parallel": 2, **bf16}),
        ],
    }
    for name, settings in variants[which]:
        cfg = configured(recipe.training, settings)
        engine = build(cfg, copy.deepcopy(policy))
        results[name] = train(engine, batches, loss_fn, hook_for=recipe)
        # the exported weights must be the torch engine's after the same steps (HF layout, full)
        exported = dict(engine.export_weights())
        ref_state = (ref_bf16 if name.endswith("_bf16") else ref).state_dict()
        results[name + "_bf16_values"] = all(
            torch.equal(t.to(torch.bfloat16).to(t.dtype), t) for t in exported.values()
        )
        accum = getattr(engine.optimizer, "gradient_accumulation_dtype", None)  # DeepSpeed ZeRO's
        results[name + "_accum"] = str(accum)
        results[name + "_weights_maxdiff"] = max(
            float((exported[k].float() - v.float()).abs().max()) for k, v in ref_state.items()
        )

        # stop after STOP steps, resume from the saved state in a fresh policy + engine
        first = build(cfg, copy.deepcopy(policy))
        part = train(first, batches[:STOP], loss_fn, hook_for=recipe)
        state = first.state_dict()
        weights = dict(first.export_weights())
        if rank == 0:
            torch.save(state, f"{out_path}.{name}.pt")
        dist.barrier()
        resumed_policy = copy.deepcopy(policy)
        resumed_policy.load_state_dict(weights, strict=False)
        second = build(cfg, resumed_policy)
        second.load_state_dict(torch.load(f"{out_path}.{name}.pt", weights_only=True))
        results[name + "_resumed"] = part + train(second, batches[STOP:], loss_fn, hook_for=recipe)
        del engine, first, second
    results.update(memory_tools(which, recipe, policy, batches, loss_fn, build))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    launch.finish()


if __name__ == "__main__":
    main()
