"""The modality seam: one registered class per kind of medium (image, audio), which says
everything the rest of loomrl needs to know about it.

A modality owns, for its kind of medium:
- its prompt marker (`<image>`) and the manifest keys of its file list (`images`, `image`),
  the prefix of its members in a shard (`img`);
- its preprocessing: stored bytes -> a `Medium` (features, content hash, settings fingerprint)
  and the number of tokens that medium becomes;
- its tower on the policy: the `VLM` attributes it owns (their names are the state-dict
  prefixes, e.g. `visual.`), how it is built for the demo and from a checkpoint's config.json,
  its freeze parts, how a batch of its media is encoded and projected to the backbone width;
- its tokens: which placeholder (and framing tokens) a checkpoint's config.json gives it,
  which model types of checkpoint have its tower.

The policy (`platform/backbone/vlm.py`), the media loader (`load_medium`), the tokenizer's
media layout and the checkpoint reader loop over `modalities()` (by `order`: image, then audio;
towers run, parts list and weights are drawn in that order) instead of naming kinds, so a new
medium is one file with a registered subclass and its module in the import line of
`loomrl/encoders/__init__.py`:

    @register("image")
    class ImageModality(Modality):
        order, marker, manifest_keys, file_prefix = 0, "<image>", ("images", "image"), "img"
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple, Optional

import torch
from torch import nn

from loomrl.config.registry import Registry
from loomrl.encoders.media import Medium

if TYPE_CHECKING:
    from loomrl.platform.backbone.config import ModelConfig

# config.json model types of text-only checkpoints (no tower, no media tokens)
TEXT_CHECKPOINTS = ("qwen2",)


class MediaTokens(NamedTuple):
    """What one medium becomes in a prompt: `before`, placeholder x its token count, `after`.
    per_frame (Qwen3-VL video): each temporal patch framed alone, after a `<t seconds>` text."""

    placeholder: int
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    per_frame: bool = False


def token_id(tokenizer: Any, token: str) -> Optional[int]:
    """The id of `token` in `tokenizer`, None when the tokenizer does not have it."""
    i = tokenizer.convert_tokens_to_ids(token)
    return None if i is None or (i == tokenizer.unk_token_id and token != tokenizer.unk_token) else i


class Modality:
    """A kind of medium. Subclasses set the class attributes and implement the class methods;
    the base gives the defaults a tower without a projector needs."""

    name: ClassVar[str]  # Medium.kind, set by `register`
    order: ClassVar[int]  # place among the modalities (image 0, audio 1)
    marker: ClassVar[str]  # prompt marker, e.g. "<image>"
    manifest_keys: ClassVar[tuple[str, ...]]  # the manifest's list key first, then aliases
    file_prefix: ClassVar[str]  # shard member names: f"{prefix}{index}.{ext}"
    noun: ClassVar[str]  # one medium, as messages count them ("image", "clip")
    tower_name: ClassVar[str]  # how messages name its tower ("vision")
    tower_attrs: ClassVar[tuple[str, ...]]  # VLM attributes it owns, its tower first (state-dict prefixes)
    checkpoint_types: ClassVar[tuple[str, ...]]  # config.json model types whose towers read it

    # ---- data
    @classmethod
    def load(cls, data: bytes, cfg: ModelConfig) -> Medium:
        """Decode and preprocess stored bytes; ValueError (or a decoder's error) on bad data."""
        raise NotImplementedError

    @classmethod
    def num_tokens(cls, medium: Medium, cfg: ModelConfig) -> int:
        """How many placeholder tokens `medium` takes in a prompt."""
        raise NotImplementedError

    @classmethod
    def prompt_tokens(cls, medium: Medium, spec: MediaTokens, tokenizer: Any, cfg: ModelConfig) -> list[int]:
        """The token ids `medium` becomes in a prompt (default: before, its placeholders, after)."""
        return [*spec.before, *[spec.placeholder] * cls.num_tokens(medium, cfg), *spec.after]

    @classmethod
    def rope_grids(cls, medium: Medium, spec: MediaTokens) -> list[tuple[Any, Optional[float]]]:
        """(grid_thw, seconds between its temporal patches or None) of each placeholder run `medium`
        makes, in order, for M-RoPE (`VLM.position_ids`)."""
        return [(medium.grid, None)]

    # ---- the tower
    @classmethod
    def build_demo(cls, model: nn.Module, cfg: ModelConfig) -> None:
        """Set the modality's attributes of `model` to randomly initialised modules from `cfg`."""
        raise NotImplementedError

    @classmethod
    def build_from_checkpoint(cls, model: nn.Module, hf_config: dict, where: str) -> None:
        """Set the modality's attributes of `model` to the modules a checkpoint's config.json
        describes (randomly initialised: the weights are loaded after)."""
        raise NotImplementedError

    @classmethod
    def tower(cls, model: nn.Module) -> Optional[nn.Module]:
        return getattr(model, cls.tower_attrs[0])

    @classmethod
    def parameter_parts(cls, model: nn.Module) -> dict[str, list[nn.Parameter]]:
        """The modality's freeze parts of `model` and their weights, the tower's own part first
        (the part whose training turns on the tower's activation checkpointing); none when the
        model has no tower for it."""
        raise NotImplementedError

    @classmethod
    def reinitialised(cls, model: nn.Module) -> list[nn.Module]:
        """Modules of the policy's own (not the tower's) that start at N(0, model.init_std)."""
        return []

    @classmethod
    def batch(cls, media: list[Medium]) -> tuple[torch.Tensor, ...]:
        """The host tensors of one tower call over `media` (the caller moves them to the device)."""
        raise NotImplementedError

    @classmethod
    def encode(cls, tower: nn.Module, inputs: tuple, media: list[Medium], cfg: ModelConfig) -> list[torch.Tensor]:
        """Raw tower outputs [tokens, width], one per medium, from one call on `batch(media)`."""
        raise NotImplementedError

    @classmethod
    def project(cls, model: nn.Module, raw: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tower outputs -> backbone width (default: the tower already did it)."""
        return raw

    # ---- tokens
    @classmethod
    def checkpoint_tokens(
        cls, tokenizer: Any, hf_config: dict, checked: Callable[[str, Any], int]
    ) -> Optional[MediaTokens]:
        """The tokens a checkpoint's config.json gives this medium (`checked(key, value)` checks an
        id against the tokenizer); None when the config has none."""
        raise NotImplementedError


MODALITIES: Registry[type[Modality]] = Registry("modality", key="media kind")


def modalities() -> list[type[Modality]]:
    """Every registered modality, by `order` (image, audio)."""
    return sorted((MODALITIES.get(name).obj for name in MODALITIES.names()), key=lambda m: m.order)


def modality(kind: str) -> type[Modality]:
    """The modality of Medium.kind `kind`; a ValueError listing the registered kinds otherwise."""
    if kind not in MODALITIES:
        raise ValueError(f"unknown medium kind {kind!r}; kinds: {', '.join(MODALITIES.names())}")
    return MODALITIES.get(kind).obj


def register(name: str) -> Callable[[type[Modality]], type[Modality]]:
    """Decorator: register a Modality subclass under `name` (its Medium.kind)."""

    def add(cls: type[Modality]) -> type[Modality]:
        cls.name = name
        return MODALITIES.register(name)(cls)

    return add


def load_medium(kind: str, data: bytes, cfg: ModelConfig) -> Medium:
    """Decode and preprocess stored bytes of a `kind` medium (its modality's `load`)."""
    return modality(kind).load(data, cfg)


def checkpoint_towers(hf_config: dict, where: str = "config.json") -> tuple[str, ...]:
    """The media a checkpoint's towers read, by its config.json's model type: ("image",) for
    Qwen2-VL / Qwen2.5-VL, ("audio",) for Qwen2-Audio, () for a text-only Qwen2."""
    model_type = hf_config.get("model_type")
    kinds = tuple(m.name for m in modalities() if model_type in m.checkpoint_types)
    if not kinds and model_type not in TEXT_CHECKPOINTS:
        supported = [*TEXT_CHECKPOINTS, *(t for m in modalities() for t in m.checkpoint_types)]
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: {supported})")
    return kinds
