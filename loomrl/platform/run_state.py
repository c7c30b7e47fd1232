"""A run's bookkeeping around the trainer loop: how a step's phases are timed (`Phases`), what a
step accumulates for its metrics row (`StepTally`), the RL learning-rate schedule, the goal check
of the summary, the run's result, and stopping on a signal (`StopRequest`, `Interrupted`)."""

from __future__ import annotations

import logging
import math
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from loomrl.platform import signals
from loomrl.platform.engines.config import TrainingConfig

if TYPE_CHECKING:
    from loomrl.platform.recipe import GoalConfig

log = logging.getLogger("loomrl")


@dataclass
class RunResult:
    out: Path
    rows: list[dict]
    goal_met: Optional[bool]
    summary: str
    error: Optional[str] = None


class Phases:
    """Wall-clock seconds per named phase of a step: `with phases("train"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def rl_lr(cfg: TrainingConfig, step: int) -> float:
    """The learning rate of RL step `step` (0-based): linear warm-up over lr_warmup_steps, then
    constant or a half cosine down to lr x lr_min_ratio at the last step."""
    warm = cfg.lr_warmup_steps
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return cfg.lr
    t = min(1.0, (step - warm) / max(1, cfg.steps - 1 - warm))
    return cfg.lr * (cfg.lr_min_ratio + (1.0 - cfg.lr_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))


def scheduled(cfg: TrainingConfig) -> bool:
    """Whether the RL learning rate changes from step to step (then each step sets it, a resume too)."""
    return cfg.lr_warmup_steps > 0 or cfg.lr_schedule != "constant"


def machine() -> dict:
    """What a bit-identical rerun needs to match: the CPU kernels torch picked (by instruction set,
    or ATEN_CPU_CAPABILITY) and the threads; runs agree bit for bit only where these do."""
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def goal_check(
    rows: list[dict], goal: Optional[GoalConfig], validations: Optional[list[dict]] = None
) -> tuple[Optional[bool], str]:
    """The goal on the training reward (mean of the first / last N steps), or on the validation
    reward (`goal.metric: val_reward_mean`: the first validation, before training, against the last,
    after it)."""
    if goal is None:
        return None, ""
    if goal.metric == "val_reward_mean":
        if not validations:
            return None, ""
        first, last = validations[0]["val_reward_mean"], validations[-1]["val_reward_mean"]
        what = f"validation reward: step {validations[0]['step']} {first:.3f} -> step {validations[-1]['step']}"
    else:
        if not rows:
            return None, ""
        first = sum(r["reward_mean"] for r in rows[: goal.first_steps]) / min(goal.first_steps, len(rows))
        last_rows = rows[-goal.last_steps :]
        last = sum(r["reward_mean"] for r in last_rows) / len(last_rows)
        what = f"reward: first {goal.first_steps} RL steps {first:.3f} -> last {goal.last_steps}"
    ok = last >= goal.min_final and last - first >= goal.min_gain
    text = (
        f"{what} {last:.3f} (gain {last - first:+.3f}); goal: last >= {goal.min_final} and gain >= "
        f"{goal.min_gain}: " + ("MET" if ok else "NOT MET")
    )
    return ok, text


@dataclass
class StepTally:
    """What one RL step accumulates over its mini-batches (and epochs), for its metrics row."""

    phases: Phases
    trained: list = field(default_factory=list)  # the admitted mini-batches' trajectories
    totals: dict = field(default_factory=dict)  # the policy engine's summed stats
    critic_totals: dict = field(default_factory=dict)  # the separate critic's
    adv_stats: dict = field(default_factory=dict)  # the advantage estimator's, averaged
    staleness: list = field(default_factory=list)  # policy versions behind, per trajectory
    enc_before: object = None  # the encoder counters when the first mini-batch was admitted
    rollout_metrics: dict = field(default_factory=dict)  # the source's, and the mismatch


def value_metrics(totals: dict, critic_totals: dict, tokens: float, updates: int) -> dict:
    """PPO's value-model statistics: the value head's (part of the policy's loss) or the separate critic's."""
    if critic_totals:
        return {
            "value_loss": critic_totals["value_loss_sum"] / tokens,
            "value_clip_frac": critic_totals["value_clipped_tokens"] / tokens,
            "critic_grad_norm": critic_totals["grad_norm"] / updates,
        }
    if "value_loss_sum" in totals:
        return {
            "value_loss": totals["value_loss_sum"] / tokens,
            "value_clip_frac": totals["value_clipped_tokens"] / tokens,
        }
    return {}


class NoLog:
    """The metrics log of ranks > 0: rank 0 alone writes the run's metrics."""

    def log(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


class Interrupted(Exception):
    """SIGINT/SIGTERM: the current step finished and a checkpoint was written."""

    def __init__(self, step: int, path: Path, stage: str = "RL"):
        super().__init__(f"interrupted after {stage} step {step}; checkpoint {path}")
        self.step, self.path = step, path


class StopRequest:
    """While active, SIGINT and SIGTERM ask the loop to stop after the current step. A second
    signal stops at once: inside a wait on a reward server (signals.interruptible) the wait
    abandons the step and the run checkpoints its last whole step; elsewhere StopNow."""

    def __init__(self):
        self.requested = False
        self._old: dict = {}

    def _handler(self, signum, frame):
        signals.note()
        if self.requested:
            if signals.waiting():
                log.warning("[run] signal %d again: abandoning this step's reward request", signum)
                return
            raise signals.StopNow(f"signal {signum} again: stopped at once")
        self.requested = True
        log.warning(
            "[run] signal %d: finishing this step, then writing a checkpoint (signal again to stop now)", signum
        )

    def __enter__(self):
        signals.reset()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        signals.reset()  # the count means something only while these handlers are in place
        return False
