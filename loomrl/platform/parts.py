"""A run's parts built from its recipe, shared by the trainer, the rollout workers and
`loomrl doctor`: torch settings, the shard list (demo shards written when missing), the
policy with its tokenizer and chat format, the prompt source, and prompt conversion. Factories
of the engines live beside them: `rollout.build_rollout_engine` and `engines.build_engine`."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Optional

import torch

from loomrl.datasets.cache import cached_shards
from loomrl.datasets.demo import write_demo_shards
from loomrl.datasets.preference import BAD_PAIR, pair_census
from loomrl.datasets.shards import ShardError, media_census
from loomrl.datasets.source import PromptSample, PromptSource
from loomrl.datasets.stream import ShardStream
from loomrl.encoders.hf_checkpoint import read_config
from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.backbone.chat import ChatFormat
from loomrl.platform.backbone.hf_weights import check_checkpoint
from loomrl.platform.backbone.tokenizer import load_tokenizer, media_layout, readable_media
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.placement import choose_device
from loomrl.platform.rollout.base import Prompt, SamplingParams

log = logging.getLogger("loomrl")


def resolve_sources(recipe: R.Recipe, missing_ok: bool = False) -> None:
    """`data.source` / `validation.source`: their shards made once into `data.cache` (or found
    there), and `data.shards` / `validation.shards` set to them. missing_ok: leave a source that
    is not on this machine alone (a dry run of a recipe for another machine notes it)."""
    d, v = recipe.data, recipe.validation
    if d.source is not None and not (missing_ok and not Path(d.source).exists()):
        d.shards = cached_shards(d.source, d.cache, "data.source")
    if v.source is not None and not (missing_ok and not Path(v.source).exists()):
        v.shards = cached_shards(v.source, d.cache, "validation.source")


def shard_files(recipe: R.Recipe) -> list[str]:
    """The run's shards; the demo shards are written first when missing and asked for."""
    files = R.expand_pattern(recipe.data.shards)
    if not files:
        demo = recipe.data.demo
        if demo is None:
            raise R.RecipeError(f"data.shards: no files match {recipe.data.shards!r}")

        directory = str(Path(recipe.data.shards).parent)
        log.info(
            "[data] no shards match %s; writing %d demo samples to %s/", recipe.data.shards, demo.samples, directory
        )
        try:
            files = write_demo_shards(directory, demo.samples, demo.samples_per_shard, demo.seed)
        except FileExistsError as e:  # the writer never replaces a file (an interrupted write leaves .tmp)
            raise R.RecipeError(
                f"data.shards: cannot write the demo shards: {e.filename} exists (left by an "
                f"interrupted write?); remove it and run again"
            ) from None
        if not R.expand_pattern(recipe.data.shards):
            raise R.RecipeError(
                f"data.shards: demo shards were written to {directory}/ but {recipe.data.shards!r} does not match them"
            )
    return files


def text_parts(recipe: R.Recipe):
    """(tokenizer, chat format) of the recipe, checked against the checkpoint without building the
    model: the tokenizer loads, the chat template renders, the checkpoint's media tokens are the
    tokenizer's. Anything wrong is a RecipeError naming the key (`--dry-run` runs this too)."""

    m = recipe.model
    try:
        tokenizer = load_tokenizer(m.tokenizer)
    except (OSError, ValueError) as e:
        raise R.RecipeError(f"model.tokenizer: cannot load {m.tokenizer!r}: {e}") from None
    if m.init_from is not None:
        try:
            media_layout(tokenizer, read_config(m.init_from), f"{m.init_from}/config.json")
        except ValueError as e:
            raise R.RecipeError(f"model.tokenizer: {m.tokenizer!r} does not fit model.init_from: {e}") from None
    return tokenizer, ChatFormat(tokenizer, recipe.data)


def check_init_from(recipe: R.Recipe) -> None:
    """model.init_from's folder checked whole before a policy is built from it (sizes against this
    machine's memory, weight files' headers against config.json: `hf_weights.check_checkpoint`);
    a RecipeError naming the file and key otherwise. Nothing without init_from."""
    if recipe.model.init_from is not None:
        try:
            check_checkpoint(recipe.model.init_from)
        except ValueError as e:
            raise R.RecipeError(f"model.init_from: {e}") from None


def check_pairs(recipe: R.Recipe) -> list[str]:
    """A preference algorithm's (DPO's) data: the shards of data.shards and validation.shards that are
    on this machine must hold preference pairs (`chosen` / `rejected`), counted from their headers; a
    RecipeError naming the key and the first sample when none does, a note when some do not (a run
    skips them as `bad-pair`). Nothing for other algorithms."""
    if not ALGORITHMS.get(recipe.algorithm.name).trait("preference"):
        return []
    notes = []
    for key, pattern in (("data.shards", recipe.data.shards), ("validation.shards", recipe.validation.shards)):
        files = R.expand_pattern(pattern) if pattern else []
        if not files:
            continue
        try:
            census = pair_census(files)
        except (ShardError, OSError) as e:
            raise R.RecipeError(f"{key}: {e}") from None
        if census.pairs == 0:
            raise R.RecipeError(
                f"{key}: none of the {census.samples} samples of {len(files)} shard(s) ({files[0]}, ...) holds a "
                f"preference pair, which algorithm.name={recipe.algorithm.name} trains on (first: {census.first_bad}); "
                f"make the shards from a manifest with 'chosen' and 'rejected' answers (docs/shards.md)"
            )
        if census.pairs < census.samples:
            notes.append(
                f"{key}: {census.samples - census.pairs} of {census.samples} samples hold no preference pair and "
                f"will be skipped ({BAD_PAIR}; first: {census.first_bad})"
            )
    return notes


def check_text_parts(recipe: R.Recipe) -> list[str]:
    """`check_pairs`, and `text_parts` and `check_media` where their files are on this machine (a
    recipe for a cluster: nothing); the notes they make. model.init_from's folder, when on this
    machine, is checked as a run checks it (`check_init_from`)."""
    m = recipe.model
    notes = check_pairs(recipe)
    if m.init_from is not None and (Path(m.init_from) / "config.json").is_file():
        check_init_from(recipe)
    if (m.tokenizer == "demo" or Path(m.tokenizer).is_dir()) and (
        m.init_from is None or (Path(m.init_from) / "config.json").is_file()
    ):
        tokenizer, _ = text_parts(recipe)
        return notes + check_media(recipe, tokenizer)
    return notes


def check_media(recipe: R.Recipe, tokenizer) -> list[str]:
    """The samples of the run's shards (and validation split) that hold a medium the model cannot
    read (audio for a vision-only checkpoint), counted from the shards' headers: a note naming the
    first, as a run skips them; a RecipeError when no sample of a split is readable."""
    m = recipe.model
    hf = read_config(m.init_from) if m.init_from is not None else None
    readable = {k for k, tokens in readable_media(tokenizer, hf, f"{m.init_from}/config.json").items() if tokens}
    notes = []
    for key, pattern in (("data.shards", recipe.data.shards), ("validation.shards", recipe.validation.shards)):
        files = R.expand_pattern(pattern) if pattern else []
        try:
            census = media_census(files, readable)
        except (ShardError, OSError) as e:
            raise R.RecipeError(f"{key}: {e}") from None
        if not census.unreadable:
            continue
        what = (
            f"{', '.join(f'{n} with {k}' for k, n in sorted(census.kinds.items()))}, which the model "
            f"(model.init_from={m.init_from!r}) cannot read (it reads: {', '.join(sorted(readable)) or 'text only'}); "
            f"first: {census.first}"
        )
        if census.unreadable == census.samples:
            raise R.RecipeError(f"{key}: none of its {census.samples} samples can be used: {what}")
        notes.append(f"{key}: {census.unreadable} of {census.samples} samples will be skipped: {what}")
    return notes


def build_policy_parts(recipe: R.Recipe, seed: Optional[int] = None):
    """(tokenizer, chat format, policy): the policy built from the recipe's model section
    (`seed`: its random initialisation, default training.seed) on this rank's device
    (`training.device`), its completions ending where the chat format says (the template's
    end-of-turn, else the tokenizer's EOS)."""

    check_init_from(recipe)
    tokenizer, chat = text_parts(recipe)
    try:
        device = choose_device(recipe.training.device)
    except ValueError as e:
        raise R.RecipeError(str(e)) from None
    model = build_policy(recipe.model, tokenizer, recipe.training.seed if seed is None else seed).to(device)
    if chat.stop_token_id != model.eos_token_id:
        model.set_stop_token(chat.stop_token_id)
    return tokenizer, chat, model


def prompt_source(recipe: R.Recipe, files: list[str], model, tokenizer, chat, one_pass: bool = False) -> PromptSource:
    """Prompts of `files` for the policy, rendered by the chat format. Every trainer rank reads the
    same prompts in the same order (the trajectory source splits them). one_pass: the shards once,
    in order (a validation split); else shuffled, epoch after epoch."""

    stream = ShardStream(
        files,
        shuffle_buffer=0 if one_pass else recipe.data.shuffle_buffer,
        seed=recipe.data.seed,
        rank=0,
        world_size=1,
        epochs=1 if one_pass else None,
    )
    return PromptSource(stream, model, tokenizer, recipe.model, render=chat.render, pieces=chat.pieces)


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
