"""RL algorithms behind one seam (see base.py): GRPO, GSPO, PPO, SFT, DPO, RLOO and REINFORCE++
register themselves here."""

from loomrl.platform.algorithms import dpo, grpo, gspo, losses, ppo, reinforce_pp, rloo  # noqa: F401 (registration)
from loomrl.platform.algorithms.base import ALGORITHMS  # noqa: E402

__all__ = ["ALGORITHMS"]
