"""A checkpoint folder (`model.init_from`) checked whole before the policy is built from it.

What a run would build is built first on the meta device (no memory: sizes only, after
`hf_bounds` has bounded every size key): loomrl's decoder and the checkpoint's towers, from its
config.json. Its parameter count gives the budget (fp32 parameters, as the policy is built,
plus the weight files read beside them), refused when over this machine's physical memory,
with the figure and the keys it comes from. Its tensor names and shapes are what the weight
files' headers (`safetensors_check.read_header`: regular files, headers bounded and checked
against the file) must hold: a missing tensor, an unexpected one (a layer beyond
num_hidden_layers) or a shape of other sizes is refused naming the file, before any tensor
is read. `loomrl run` (and `--dry-run`, and `loomrl export`) call `check_checkpoint`
before building the policy, so the dry run refuses what the run would.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch import nn

from loomrl.encoders.hf_checkpoint import (
    AUDIO_PREFIXES,
    PROJECTOR_PREFIXES,
    VISION_PREFIXES,
    _audio_spec,
    _vision_spec,
    audio_tower_of,
    read_config,
    vision_tower_of,
    weight_headers,
)
from loomrl.platform.backbone.decoder import Decoder, DecoderConfig
from loomrl.platform.backbone.hf_bounds import check_towers
from loomrl.platform.backbone.hf_io import decoder_config, lm_name

BYTES_PER_PARAM = 4
"""The policy is built in fp32, then the checkpoint's tensors are read beside it."""


def machine_memory() -> int:
    """This machine's physical memory in bytes (0: unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


LAYER = re.compile(r"^((?:.*\.)?(?:layers|blocks))\.0\.")
"""The first block of a stack (`model.layers.0.`, `blocks.0.`, `layers.0.`): its shapes are every block's."""


class Part(NamedTuple):
    """One part of the policy as config.json describes it, counted without building it."""

    shapes: dict[str, tuple[int, ...]]  # {name under the part: shape}
    prefixes: tuple[str, ...]  # where its tensors are in the files ('': the decoder, via hf_io.lm_name)


def _stack(module: nn.Module, n: int) -> dict[str, tuple[int, ...]]:
    """The state's shapes of a module built with one block, as with `n` blocks."""
    out = {}
    for key, value in module.state_dict().items():
        m = LAYER.match(key)
        for i in range(n) if m else (None,):
            out[key if m is None else f"{m.group(1)}.{i}.{key[m.end() :]}"] = tuple(value.shape)
    return out


def meta_parts(cfg: dict, where: str) -> dict[str, Part]:
    """{part: Part} of what a policy started from this config.json is built of, each built on the
    meta device with one block (no memory, little time) and its block's shapes repeated."""
    check_towers(cfg, where)
    d = decoder_config(cfg, where)
    parts = {}
    with torch.device("meta"):
        decoder = Decoder(dataclasses.replace(d, num_layers=1))
        parts["language model"] = Part(_stack(decoder, d.num_layers), ("",))
        model_type = cfg["model_type"]
        if model_type in ("qwen2_vl", "qwen2_5_vl"):
            depth = _vision_spec(cfg, where)[1].depth
            vision = {**(cfg.get("vision_config") or {}), "depth": 1, "fullatt_block_indexes": [0]}
            parts["vision tower"] = Part(
                _stack(vision_tower_of({**cfg, "vision_config": vision}, where), depth), VISION_PREFIXES
            )
        if model_type == "qwen2_audio":
            layers = _audio_spec(cfg, where)[0].encoder_layers
            audio = {**(cfg.get("audio_config") or {}), "encoder_layers": 1}
            tower, projector = audio_tower_of({**cfg, "audio_config": audio}, where)
            parts["audio tower"] = Part(_stack(tower, layers), AUDIO_PREFIXES)
            parts["audio projector"] = Part(_stack(projector, 0), PROJECTOR_PREFIXES)
    if d.tie_word_embeddings:
        parts["language model"].shapes.pop("lm_head.weight", None)  # tied: the head is the embedding
    return parts


def check_budget(parts: dict[str, Part], d: DecoderConfig, where: str, file_bytes: int, memory: Optional[int]) -> None:
    """The parameters (fp32) plus the weight files, against this machine's memory."""
    memory = machine_memory() if memory is None else memory
    counts = {name: sum(math.prod(s) for s in part.shapes.values()) for name, part in parts.items()}
    need = sum(counts.values()) * BYTES_PER_PARAM + file_bytes
    if memory and need > memory:
        raise ValueError(
            f"{where}: vocab_size {d.vocab_size}, hidden_size {d.hidden_size}, num_hidden_layers "
            f"{d.num_layers}, intermediate_size {d.intermediate_size} and the towers make "
            f"{sum(counts.values()):,} parameters ({', '.join(f'{k} {v:,}' for k, v in counts.items())}): "
            f"{_gb(need)} to build (fp32) and load, more than this machine's {_gb(memory)} of memory"
        )


def _found(part: str, prefixes: tuple[str, ...], headers: dict) -> dict[str, tuple[int, ...]]:
    """{name under the part: shape} of the files' tensors of one part."""
    if part == "language model":
        return {name: shape for key, (_, shape) in headers.items() if (name := lm_name(key)) is not None}
    for prefix in prefixes:  # the first prefix the files use, as the loader reads them
        found = {k[len(prefix) :]: shape for k, (_, shape) in headers.items() if k.startswith(prefix)}
        if found:
            return found
    return {}


def check_weights(folder: str | Path, parts: dict[str, Part], tie: bool, headers: dict) -> None:
    """The files' tensors (names, shapes) against what config.json builds, part by part."""
    for part, (want, prefixes) in parts.items():
        have = _found(part, prefixes, headers)
        if part == "language model" and tie:
            have.pop("lm_head.weight", None)
        missing = sorted(set(want) - set(have))
        unexpected = sorted(set(have) - set(want))
        wrong = sorted(
            f"{k} {list(have[k])} (config.json: {list(want[k])})" for k in set(want) & set(have) if have[k] != want[k]
        )
        if missing or unexpected or wrong:
            said = [
                f"{what} {len(names)}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                for what, names in (("missing", missing), ("unexpected", unexpected), ("other shapes", wrong))
                if names
            ]
            raise ValueError(
                f"{folder}: the {part}'s tensors in the weight files do not fit {folder}/config.json "
                f"({'; '.join(said)})"
            )


def check_checkpoint(folder: str | Path, memory: Optional[int] = None) -> None:
    """Everything a policy built from `folder` needs, checked before it is built (see the module's
    docstring): a ValueError naming the file and key otherwise. memory: bytes (None: this machine's)."""
    where = f"{folder}/config.json"
    try:
        cfg = read_config(folder)
    except OSError as e:
        raise ValueError(str(e)) from None
    try:
        parts = meta_parts(cfg, where)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own checks of a tower's config (StrictDataclass...)
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else e
        raise ValueError(f"{where}: transformers refuses it: {type(cause).__name__}: {str(cause)[:200]}") from None
    try:
        headers = weight_headers(folder)
    except (OSError, KeyError) as e:  # no weight files, an index naming a missing file
        raise ValueError(str(e).strip("'\"")) from None
    d = decoder_config(cfg, where)
    check_budget(parts, d, where, sum(f.stat().st_size for f in {f for f, _ in headers.values()}), memory)
    check_weights(folder, parts, d.tie_word_embeddings, headers)
