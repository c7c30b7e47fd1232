"""RL algorithms behind one seam (see base.py): GRPO, PPO, SFT and RLOO register themselves here."""

from loomrl.platform.algorithms import grpo, losses, ppo, rloo  # noqa: F401 (registration, in this order)
from loomrl.platform.algorithms.base import ALGORITHMS  # noqa: E402

__all__ = ["ALGORITHMS"]
