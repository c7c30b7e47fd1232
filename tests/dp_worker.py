"""One rank of the data-parallel rollout test (run under torchrun by test_data_parallel.py):
a colocated trainer with DeepSpeed ZeRO-2 on 2 gloo ranks runs one RL step; each rank writes
the prompts it rolled out itself, and rank 0 the step's trajectories, the full gradients
the optimizer step received (gathered from the ZeRO partitions) and the updated policy."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from loomrl.platform import recipe as R
from loomrl.platform.engines.launch import init_distributed
from loomrl.platform.trainer import Trainer


def record_gradients(engine) -> dict:
    """Fills the returned dict with each trainable weight's full gradient as the ZeRO optimizer's
    step receives it (reduced over the ranks in DeepSpeed's step, just before; gathered from the
    partitions: a collective, so every rank calls)."""
    from deepspeed.utils import safe_get_full_grad

    grads, step = {}, engine.optimizer.step

    def record_then_step(*args, **kwargs):
        for name, p in engine.model.named_parameters():
            if p.requires_grad:
                g = safe_get_full_grad(p)
                if g is not None:
                    grads[name] = g.detach().float().clone()
        return step(*args, **kwargs)

    engine.optimizer.step = record_then_step
    return grads


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    init_distributed()
    rank = dist.get_rank()
    recipe = R.load_recipe("recipes/demo.yaml", overrides)
    trainer = Trainer(recipe, out / "run")
    trainer.setup()
    captured = []
    admit = trainer.source.admit
    trainer.source.admit = lambda step, version: captured.extend(admit(step, version)) or captured
    grads = record_gradients(trainer.engine)
    trainer.step(0)
    (out / f"rank{rank}.json").write_text(json.dumps(trainer.source.generated_here))
    if rank == 0:
        trajs = [
            {
                "prompt_id": t.prompt_id,
                "group": t.group,
                "completion_ids": t.completion_ids,
                "logp": t.rollout_logprobs,
                "reward": t.reward,
            }
            for b in captured
            for t in b
        ]
        (out / "trajectories.json").write_text(json.dumps(trajs))
        torch.save(dict(trainer.model.state_dict()), out / "policy.pt")
        torch.save(grads, out / "grads.pt")
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
