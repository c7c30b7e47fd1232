"""Settings of the KnitTrans trajectory pipeline (`pipeline`): colocated or disaggregated roles,
admission, staleness and token budgets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loomrl.config.schema import ranged


@dataclass
class PipelineConfig:
    """KnitTrans trajectory pipeline: where rollouts run and how trajectories are admitted."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    """`colocated`: one process, rollout and training share the model. `disaggregated`:
    rollout roles and the trainer as separate processes launched with torchrun (gloo on
    CPU, NCCL on GPU); the trainer sends weights after each optimizer step."""
    admission: Literal["train_batch", "mini_batch"] = "train_batch"
    """`train_batch`: wait for a whole train batch (`training.prompts_per_step` complete
    groups), then train its `training.mini_batches` mini-batches. `mini_batch`: admit each
    mini-batch as soon as its quotas can be met (whole groups, prompts per mini-batch,
    token budget, staleness) and train it at once."""
    max_staleness: int = ranged(-1, ge=-1)
    """Most optimizer steps a trajectory may lag the trainer when it is trained; staler
    groups are dropped (counted, reason `stale`). -1 = no limit."""
    tokens_per_mini_batch: int = ranged(0, ge=0)
    """Token budget (prompt + completion) of one mini-batch; admission never exceeds it,
    a group that alone exceeds it is dropped (reason `over_token_budget`). 0 = no budget."""
    tokens_per_micro_batch: int = ranged(0, ge=0)
    """Padded-token budget of one micro-batch in the layout (rows x longest row); 0 = only
    `training.micro_batch_size` rows per micro-batch."""
    rollout_workers: int = ranged(2, ge=1)
    """Rollout processes in disaggregated mode (beside the `training.nproc` trainer processes)."""
    prompts_per_request: int = ranged(1, ge=1)
    """Prompts a rollout worker generates per request (disaggregated mode)."""
    on_worker_death: Literal["continue", "stop"] = "stop"
    """When a rollout worker dies: `continue` with the others (its in-flight prompts are
    re-queued) or `stop` with a checkpoint and a clear error."""
    worker_timeout_s: float = ranged(300.0, gt=0)
    """A rollout worker silent this long with work in flight is declared dead."""
