"""Data-parallel rollouts: with 2 ranks each rolls out its own share of the step's prompts
(whole groups), the ranks exchange the trajectories, and the update equals one process
training on the whole batch.

"Equals" is checked on the gradients the optimizer step receives, not only on the weights
after it: Adam's first step moves each weight by about lr x sign(g) whatever the gradient's
scale, so a sum instead of a mean over the ranks, or a per-rank token normaliser, would leave
the weights equal. Gradient clipping is off for the same reason (it rescales a gradient)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from loomrl.platform import recipe as R
from loomrl.platform.trainer import Trainer
from loomrl.platform.trajectory.batch import Trajectory

ROOT = Path(__file__).resolve().parent.parent


class ReplaySource:
    """The trajectories rank 0 held after the exchange, handed to a one-process trainer."""

    sync_every_update = False

    def __init__(self, trainer, rows):
        self.trainer, self.rows = trainer, rows

    def admit(self, step, version):
        samples = self.trainer.prompts.next(self.trainer.recipe.training.prompts_per_step)
        trajs = [
            Trajectory(
                r["prompt_id"],
                r["group"],
                samples[r["group"]].ids,
                r["completion_ids"],
                samples[r["group"]].media,
                r["logp"],
                r["reward"],
                version,
            )
            for r in self.rows
        ]
        assert all(samples[r["group"]].id == r["prompt_id"] for r in self.rows)
        return [trajs]

    def end_step(self, step, version):
        return {}

    def accounting(self):
        return {"generated": 0, "trained": 0, "dropped": 0, "pending": 0}

    def close(self):
        pass


def test_two_ranks_roll_out_disjoint_shares_and_update_like_one(tmp_path, demo_shards):
    d, _ = demo_shards
    overrides = [
        f"data.shards={d}/*.tar",
        "data.demo=null",
        "training.warmup.steps=0",
        "training.mini_batches=1",
        "training.prompts_per_step=6",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "logging.tensorboard=false",
        "goal=null",
        "training.threads=1",
        "rollout.drafter.compare_every=0",
        "algorithm.reward=rewards_for_tests:distinct_words",
        "training.grad_clip=0",
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "dp_worker.py"),
        str(tmp_path),
        *overrides,
        "training.engine=deepspeed",
        "training.nproc=2",
        "training.deepspeed.zero_stage=2",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    rows = json.loads((tmp_path / "trajectories.json").read_text())
    shares = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    step_prompts = sorted({r["prompt_id"] for r in rows})
    assert len(step_prompts) == 6 and len(rows) == 6 * 4
    assert len(shares[0]) == len(shares[1]) == 3
    assert not set(shares[0]) & set(shares[1])  # disjoint
    assert sorted(shares[0] + shares[1]) == step_prompts  # their union is the step

    # one process, the torch engine, the same trajectories: the same update
    sys.path.insert(0, str(ROOT / "tests"))
    recipe = R.load_recipe(str(ROOT / "recipes" / "demo.yaml"), overrides)
    single = Trainer(recipe, tmp_path / "single", source_factory=lambda t: ReplaySource(t, rows))
    single.setup()
    before = {k: v.clone() for k, v in single.model.state_dict().items()}
    want_grads = {}
    opt_step = single.engine.optimizer.step

    def record_then_step(*args, **kwargs):
        want_grads.update(
            {n: p.grad.detach().clone() for n, p in single.engine.model.named_parameters() if p.grad is not None}
        )
        return opt_step(*args, **kwargs)

    single.engine.optimizer.step = record_then_step
    single.step(0)

    # the gradients: the same for every trainable weight, to float32 reduction order
    got_grads = torch.load(tmp_path / "grads.pt", weights_only=True)
    assert set(got_grads) == set(want_grads) and len(want_grads) > 10
    for name, want in want_grads.items():
        scale = float(want.abs().max())
        assert scale > 0, name
        err = float((got_grads[name] - want).abs().max())
        assert err <= 1e-4 * scale, (name, err, scale)
    # the update: each weight's change equals the one process's, to 1% of the step's size (lr)
    lr = single.engine.optimizer.param_groups[0]["lr"]  # step 0's (the lr warm-up's first)
    got = torch.load(tmp_path / "policy.pt", weights_only=True)
    moved = 0
    for name, want in single.model.state_dict().items():
        assert float((got[name] - want).abs().max()) <= 0.01 * lr, name
        moved += float((want - before[name]).abs().max()) > 0.5 * lr
    assert moved > 10  # the step moved the weights by about lr
