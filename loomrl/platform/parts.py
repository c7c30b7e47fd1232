"""A run's parts built from its recipe, shared by the trainer, the rollout workers and
`loomrl doctor`: torch settings, the shard list (demo shards written when missing) and
prompt conversion. Factories of the engines live beside them: `rollout.build_rollout_engine`
and `engines.build_engine`."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from loomrl.datasets.source import PromptSample
from loomrl.platform import recipe as R
from loomrl.platform.rollout.base import Prompt, SamplingParams

log = logging.getLogger("loomrl")


def shard_files(recipe: R.Recipe) -> list[str]:
    """The run's shards; the demo shards are written first when missing and asked for."""
    files = R.expand_pattern(recipe.data.shards)
    if not files:
        demo = recipe.data.demo
        if demo is None:
            raise R.RecipeError(f"data.shards: no files match {recipe.data.shards!r}")
        from loomrl.datasets.demo import write_demo_shards

        directory = str(Path(recipe.data.shards).parent)
        log.info("[data] no shards match %s; writing %d demo samples to %s/", recipe.data.shards, demo.samples,
                 directory)
        try:
            files = write_demo_shards(directory, demo.samples, demo.samples_per_shard, demo.seed)
        except FileExistsError as e:  # the writer never replaces a file (an interrupted write leaves .tmp)
            raise R.RecipeError(f"data.shards: cannot write the demo shards: {e.filename} exists (left by an "
                                f"interrupted write?); remove it and run again") from None
        if not R.expand_pattern(recipe.data.shards):
            raise R.RecipeError(f"data.shards: demo shards were written to {directory}/ "
                                f"but {recipe.data.shards!r} does not match them")
    return files


def configure_torch(cfg: R.TrainingConfig) -> None:
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(cfg.deterministic)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)


def to_prompts(samples: list[PromptSample]) -> list[Prompt]:
    return [Prompt(s.id, s.ids, s.media) for s in samples]


def sampling_params(recipe: R.Recipe) -> SamplingParams:
    ro = recipe.rollout
    return SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens)
