"""Settings of the training data (`data`) and of the held-out split scored during a run (`validation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from loomrl.config.schema import SEED_MAX, ranged


@dataclass
class DemoDataConfig:
    """Procedural demo shards, written when `data.shards` matches nothing."""

    samples: int = ranged(768, ge=1)
    """Samples to generate."""
    samples_per_shard: int = ranged(256, ge=1)
    """Samples per tar shard."""
    seed: int = ranged(1234, ge=0, le=SEED_MAX)
    """Seed of the procedural generator (same seed, same bytes)."""


@dataclass
class DataConfig:
    """Prompt shards (webdataset tars)."""

    shards: str = "data/demo/demo-*.tar"
    """Shard pattern: a glob or a brace range (`dir/name-{000000..000003}.tar`),
    relative to the working directory."""
    source: Optional[str] = None
    """A dataset as you have it instead of shards: a JSONL manifest, a .json list, parquet, a
    Hugging Face `datasets` folder or a folder of them (docs/shards.md). The run makes its shards
    once into `cache` (keyed by the source's sha256), reuses them after, and reads them in place
    of `shards`."""
    cache: str = "data/cache"
    """Where the shards of a `source` (and of `validation.source`) are made and kept."""
    demo: Optional[DemoDataConfig] = None
    """If set and `shards` matches nothing, generate the demo shards there.
    If null, missing shards are an error."""
    seed: int = ranged(0, ge=0, le=SEED_MAX)
    """Seed of the epoch shuffle of prompts."""
    shuffle_buffer: int = ranged(1000, ge=0)
    """Samples held by the streaming reader's shuffle buffer (0 = shard order)."""
    chat_template: str = "auto"
    """How prompts are written for the model: `auto` renders each prompt as a user turn with the
    tokenizer's chat template when it has one (completions then end at the template's end-of-turn
    token), `none` uses the prompt text as written, or a path to a Jinja template file."""
    system_prompt: Optional[str] = None
    """A system turn put before every prompt (needs a chat template)."""


@dataclass
class ValidationConfig:
    """Held-out prompts the policy is scored on during the run (never trained on)."""

    shards: Optional[str] = None
    """Shard pattern of the validation split (null: no validation)."""
    source: Optional[str] = None
    """The validation split as you have it (as `data.source`), instead of `shards`: its shards
    are made once into `data.cache`."""
    every: int = ranged(10, ge=1)
    """Validate before every N-th step (steps 0, N, 2N, ...) and once more at the end."""
    samples: int = ranged(64, ge=1)
    """Prompts per validation: the first N of the split, the same ones every time."""
    temperature: float = ranged(0.0, ge=0)
    """Sampling temperature of validation completions (0 = greedy)."""
    samples_per_prompt: int = ranged(1, ge=1, le=1024)
    """Completions per prompt, k. With k > 1 (and a temperature above 0) the metrics add `val_pass@1`
    and `val_pass@k`: the unbiased estimates (Chen et al. 2021) that one sample, and that any of k,
    is correct (its reward at least `pass_threshold`)."""
    pass_threshold: float = ranged(1.0, ge=-1e6, le=1e6)
    """The reward from which a validation completion counts as correct, for pass@k."""
    max_new_tokens: Optional[int] = ranged(None, ge=1)
    """Completion length cap (null: rollout.max_new_tokens)."""
    batch_size: int = ranged(64, ge=1)
    """Prompts generated together."""
