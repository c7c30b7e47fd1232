"""The rollout-engine seam: what every engine (built-in torch, vLLM) provides, and all
the trainer loop and the rollout workers use of one. `build_rollout_engine` (in
`loomrl.platform.rollout`) makes the recipe's engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol

import torch

from loomrl.config.registry import Registry
from loomrl.encoders.media import Medium

ROLLOUT_ENGINES: Registry = Registry("rollout engine", key="rollout.engine")
"""The rollout engines by name (`rollout.engine`), filled by the engine modules, which the package
imports. An entry's object has `from_recipe(recipe, model)`; its traits: `rounding`, the
`model.rounding` mode that `auto` takes with this engine (the BF16 trainer forward measured
closest to it, docs/rounding.md), `check(recipe)`, its own refusals (RecipeError naming the
key), and for `loomrl plan` `sequence_length(rollout) -> (tokens, where from)`, the length it bounds
a sequence to, and `memory(sizes, rollout, *, seq_len, rollouts) -> MemoryTerm`, what it holds on a
trainer rank (loomrl/platform/memory.py). An engine may also have `sync_health(step, model, prompts,
params) -> dict`, metrics that compare it with the trainer after a weight sync (docs/extending.md)."""


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16


@dataclass
class Prompt:
    id: str  # stable prompt identity (groups, drafter histories)
    ids: list[int]  # token ids, media markers already expanded
    media: list[Medium] = field(default_factory=list)


@dataclass
class Rollout:
    prompt_index: int  # index into the prompts passed to generate()
    sample_index: int  # 0..n-1 within its group
    completion_ids: list[int]
    logprobs: list[float]  # per completion token, under logits / temperature
    finish_reason: str  # "stop" (EOS sampled) or "length"


@dataclass
class RolloutResult:
    rollouts: list[Rollout]
    forwards: int  # target forward passes of the batch (prefill + decode steps)
    seconds: float
    seq_forwards: int = 0  # sum over sequences of the forwards each took part in

    @property
    def tokens_per_forward(self) -> float:
        """Tokens committed per target forward of a sequence (1.0 without drafting)."""
        return self.tokens / max(1, self.seq_forwards)

    @property
    def tokens(self) -> int:
        return sum(len(r.completion_ids) for r in self.rollouts)


class Drafter(Protocol):
    """What callers read of an engine's NgramRL drafter (None when drafting is off)."""

    def history_tokens(self) -> int:
        """Tokens held in the draft histories."""


class RolloutEngine(Protocol):
    version: int  # policy version of the weights it samples from
    drafter: Optional[Drafter]  # NgramRL drafter, None when drafting is off
    last_stats: object  # drafting counters of the last generate() (torch_engine.DraftStats)
    spec_metrics: dict  # engine-specific speculative-decoding counters of the last generate()

    def generate(
        self, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
    ) -> RolloutResult:
        """n samples per prompt, grouped: rollouts of prompt i are contiguous."""

    def update_weights(self, weights: Optional[Iterable[tuple[str, torch.Tensor]]], version: int) -> None:
        """Take new weights (None: weights are shared with the trainer) tagged `version`."""

    def generate_plain(
        self, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
    ) -> Optional[RolloutResult]:
        """The same batch without drafting, for timing side by side (its tokens are discarded);
        None when the engine cannot run one."""

    def observe(self, prompt_id: str, completion_ids: list[int]) -> None:
        """Feed a finished rollout into the drafter's history of its prompt."""

    def state_dict(self) -> dict:
        """JSON state a resumed run needs to continue exactly (version, drafter histories)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`."""

    def shutdown(self) -> None:
        """Release the engine's resources."""
