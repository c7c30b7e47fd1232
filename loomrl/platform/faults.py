"""Fault injection for the resume tests: with LOOMRL_KILL_AT="point:step" the process
SIGKILLs itself when it reaches that point of that RL step (points: rollout, optimizer,
checkpoint). Unset, this costs one dict lookup."""

from __future__ import annotations

import os
import signal

current_step = -1  # set by the trainer (and rollout workers) at the start of each RL step


def maybe_die(point: str) -> None:
    if os.environ.get("LOOMRL_KILL_AT") == f"{point}:{current_step}":
        os.kill(os.getpid(), signal.SIGKILL)
