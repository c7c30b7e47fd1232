"""A run's reward: a weighted sum of sources, each a plain callable (scored per
completion) or a batch scorer (scored in batches): a learned reward model (`models.py`)
or a remote reward server (`remote.py`). Each source's scores are kept so the trainer can
report its mean every step, and so are a registered reward's diagnostic `parts` (`slot_match`:
which slots were right), which the trainer reports and never adds to the reward."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from loomrl.platform.rewards.base import PART, RewardError, reward_parts
from loomrl.platform.rewards.config import resolve_callable
from loomrl.platform.rewards.models import RewardModel
from loomrl.platform.rewards.remote import RemoteReward


class BatchScorer(Protocol):
    """What scores completions in batches: RewardModel, RemoteReward."""

    def score(self, completions: list[str], samples: list[dict]) -> list[float]: ...


@dataclass
class Source:
    name: str
    weight: float
    fn: Optional[Callable[[str, dict], float]] = None
    model: Optional[BatchScorer] = None
    """A batch scorer (set this or `fn`)."""
    parts: Optional[Callable[[str, dict], dict]] = None
    """A registered reward's `parts` trait (rewards/base.py): diagnostics for the metrics row."""

    def part_scores(self, completions: list[str], samples: list[dict]) -> list[dict[str, float]]:
        """Per completion, this source's named parts (`{}` without a `parts` trait)."""
        if self.parts is None:
            return [{} for _ in completions]
        out = []
        for c, s in zip(completions, samples):
            try:
                out.append({name: float(v) for name, v in self.parts(c, s).items()})
            except Exception as e:  # noqa: BLE001 - as score(): the failure is named, never a traceback
                what = f"{type(e).__name__}: {e}"
                raise RewardError(f"reward {self.name!r} parts on sample {s.get('id')!r}: {what}") from None
        return out

    def score(self, completions: list[str], samples: list[dict]) -> list[float]:
        """One finite float per completion, or a RewardError naming this source and the sample."""
        if self.model is not None:
            return self.model.score(completions, samples)
        out = []
        for c, s in zip(completions, samples):
            try:
                value = self.fn(c, s)
            except RewardError:
                raise
            except Exception as e:  # noqa: BLE001 - a reward is user code: any failure is named, never a traceback
                raise RewardError(f"reward {self.name!r} on sample {s.get('id')!r}: {type(e).__name__}: {e}") from None
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RewardError(
                    f"reward {self.name!r} on sample {s.get('id')!r} returned {value!r}, not a finite number"
                )
            out.append(float(value))
        return out


def build_sources(algorithm, device: torch.device | str = "cpu") -> list[Source]:
    """Sources of a recipe's `algorithm` section: `rewards` if given, else `reward` alone."""

    if not algorithm.rewards:
        fn = resolve_callable(algorithm.reward)
        return [Source(algorithm.reward.split(":")[-1], 1.0, fn=fn, parts=reward_parts(algorithm.reward))]
    sources = []
    for i, r in enumerate(algorithm.rewards):
        if r.model is not None:
            model = RewardModel(r.model, device, r.batch_size, r.max_length, r.label, r.with_prompt)
            sources.append(Source(r.source_name(), r.weight, model=model))
        elif r.url is not None:
            server = RemoteReward(r.url, r.batch_size, r.timeout_s, r.retries)
            sources.append(Source(r.source_name(), r.weight, model=server))
        else:
            fn = resolve_callable(r.fn, f"algorithm.rewards[{i}].fn", r)
            sources.append(Source(r.source_name(), r.weight, fn=fn, parts=reward_parts(r.fn)))
    return sources


def score(
    sources: list[Source], completions: list[str], samples: list[dict]
) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted total per completion, and each source's own scores by name."""
    by_source = {s.name: s.score(completions, samples) for s in sources}
    total = [sum(s.weight * by_source[s.name][i] for s in sources) for i in range(len(completions))]
    return total, by_source


def score_parts(
    sources: list[Source], completions: list[str], samples: list[dict]
) -> tuple[list[float], list[dict[str, float]]]:
    """The weighted total per completion, and per completion its reward parts: each source's own
    score under the source's name, and each source's diagnostic parts as `part:<name>` (one source)
    or `part:<source>_<name>` (several). The trainer reports both; parts never enter the total."""
    total, by_source = score(sources, completions, samples)
    out = [{name: float(v[i]) for name, v in by_source.items()} for i in range(len(completions))]
    for s in sources:
        prefix = PART if len(sources) == 1 else f"{PART}{s.name}_"
        for row, parts in zip(out, s.part_scores(completions, samples)):
            row.update({prefix + name: v for name, v in parts.items()})
    return total, out
