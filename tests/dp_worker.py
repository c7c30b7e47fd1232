"""One rank of the data-parallel rollout test (run under torchrun by test_data_parallel.py):
a colocated trainer with DeepSpeed ZeRO-2 on 2 gloo ranks runs one RL step; each rank writes
the prompts it rolled out itself, and rank 0 the step's trajectories and the updated policy."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from loomrl.platform import recipe as R
from loomrl.platform.engines.launch import init_distributed
from loomrl.platform.trainer import Trainer


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
    trainer.step(0)
    (out / f"rank{rank}.json").write_text(json.dumps(trainer.source.generated_here))
    if rank == 0:
        trajs = [{"prompt_id": t.prompt_id, "group": t.group, "completion_ids": t.completion_ids,
                  "logp": t.rollout_logprobs, "reward": t.reward} for b in captured for t in b]
        (out / "trajectories.json").write_text(json.dumps(trajs))
        torch.save(dict(trainer.model.state_dict()), out / "policy.pt")
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
