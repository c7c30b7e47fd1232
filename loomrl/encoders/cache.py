"""The content-hashed encoding cache: each distinct medium is encoded once per
mini-batch, and the gradient of every micro-batch that used it still reaches
the encoder.

In GRPO every sample of a group shares its prompt's image and audio, so a
mini-batch of G groups of n samples holds each medium n times. Three pieces:

- `encode_distinct` finds the distinct media of a request (by content hash and
  preprocessing fingerprint), runs only those through the towers (consulting an
  `EncodingCache` when the request allows it) and returns one encoding per
  distinct medium; `encode_every_copy` is the naive path it replaces.
- `EncodingCache` is a bounded LRU of tower outputs. A key is the medium's
  content hash + preprocessing fingerprint + the encoder's identity (class,
  config, dtype, device, mode); every lookup also names the encoders' weights
  version, and a new version empties the cache, so an encoding never outlives
  the weights that made it (trainable towers: one optimizer step; frozen
  towers: the whole run).
- `SharedEncodings` is the training engine's mini-batch hook: it encodes a
  mini-batch's distinct media once (with grad), hands every micro-batch the
  same detached leaf tensors, lets each micro-batch's backward add into the
  leaves' .grad, and after the last micro-batch pushes the summed gradients
  through the encoders in one backward call. Backward is linear in the
  incoming gradient, so the encoder parameters get exactly the gradient of
  encoding every copy separately (up to float summation order).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from typing import Callable, Hashable, Optional

import torch

from loomrl.encoders.media import Medium

MediaKey = tuple[str, str]  # Medium.key: (content hash, preprocessing fingerprint)
Encodings = dict[MediaKey, torch.Tensor]
TowerFn = Callable[[list[Medium]], list[torch.Tensor]]  # distinct media -> one tower output each
CacheKeyFn = Callable[[Medium], tuple[Hashable, Hashable]]  # medium -> (cache key, encoder weights version)


@dataclass
class EncodeStats:
    """Encoder work of one or more requests; fields add up across requests."""

    media_total: int = 0  # media placements asked for (one per sample that uses a medium)
    media_unique: int = 0  # distinct media among them
    calls: int = 0  # media actually run through a tower (cache hits excluded)
    bytes_moved: int = 0  # feature bytes fed to the towers
    bytes_naive: int = 0  # feature bytes had every placement been encoded
    forward_s: float = 0.0  # tower forward time
    backward_s: float = 0.0  # the one encoder backward per mini-batch (SharedEncodings)
    cache_hits: int = 0
    cache_misses: int = 0

    def add(self, other: "EncodeStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def copy(self) -> "EncodeStats":
        return EncodeStats(**asdict(self))

    def since(self, earlier: "EncodeStats") -> "EncodeStats":
        """The work done between a snapshot (`copy()`) and now."""
        return EncodeStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_dict(self, prefix: str = "enc_") -> dict[str, float]:
        return {prefix + k: v for k, v in asdict(self).items()}


class EncodingCache:
    """Bounded LRU of encoder outputs with hit/miss counters.

    All entries belong to one encoder weights version; a lookup or store with another
    version first empties the cache (those entries can never be served again, and in a
    trainable run they would otherwise sit in memory until evicted)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.version: Hashable = None
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    def _at(self, version: Hashable) -> None:
        if version != self.version:
            self.entries.clear()
            self.version = version

    def get(self, key: Hashable, version: Hashable) -> Optional[torch.Tensor]:
        self._at(version)
        value = self.entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Hashable, version: Hashable, value: torch.Tensor) -> None:
        self._at(version)
        if self.capacity <= 0:
            return
        self.entries[key] = value.detach()
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()

    def __deepcopy__(self, memo: dict) -> "EncodingCache":
        # A copied model (e.g. the frozen reference policy) gets its own empty cache: its
        # weights are separate tensors whose version counters start afresh.
        return EncodingCache(self.capacity)


def encode_distinct(
    media: list[Medium], towers: TowerFn, cache: Optional[EncodingCache] = None, cache_key: Optional[CacheKeyFn] = None
) -> tuple[Encodings, EncodeStats]:
    """One tower output per distinct medium of `media`, keyed by Medium.key.

    Each distinct medium is run through the towers at most once (all misses in one
    `towers` call, which batches per kind); with a cache, hits are served from it and
    misses stored in it. The same tensor then serves every sample that uses the medium."""
    stats = EncodeStats(media_total=len(media), bytes_naive=sum(m.nbytes for m in media))
    unique: dict[MediaKey, Medium] = {}
    for m in media:
        unique.setdefault(m.key, m)
    stats.media_unique = len(unique)
    out: Encodings = {}
    todo: list[Medium] = []
    for k, m in unique.items():
        hit = cache.get(*cache_key(m)) if cache is not None else None
        if hit is None:
            todo.append(m)
        else:
            out[k] = hit
    if cache is not None:
        stats.cache_hits, stats.cache_misses = len(unique) - len(todo), len(todo)
    if todo:
        start = time.perf_counter()
        encoded = towers(todo)
        stats.forward_s = time.perf_counter() - start
        stats.calls = len(todo)
        stats.bytes_moved = sum(m.nbytes for m in todo)
        for m, e in zip(todo, encoded):
            out[m.key] = e
            if cache is not None:
                cache.put(*cache_key(m), e)
    return out, stats


def encode_every_copy(media: list[Medium], towers: TowerFn) -> tuple[list[torch.Tensor], EncodeStats]:
    """The naive path: every placement through the towers, one output per item of `media`."""
    start = time.perf_counter()
    encoded = towers(media) if media else []
    nbytes = sum(m.nbytes for m in media)
    return encoded, EncodeStats(
        media_total=len(media),
        media_unique=len({m.key for m in media}),
        calls=len(media),
        bytes_moved=nbytes,
        bytes_naive=nbytes,
        forward_s=time.perf_counter() - start,
    )


class SharedEncodings:
    """Training-engine hook: encode a mini-batch's distinct media once, keep every gradient.

    `begin(micro_batches)` encodes the distinct media of all micro-batches (with grad)
    and exposes them as detached leaf tensors in `encodings`, which the loss function
    passes to the model for every micro-batch. Each micro-batch's backward stops at the
    leaves and adds into their .grad. `finish()`, called after the last micro-batch's
    backward and before the optimizer step, runs the encoder backward once with the
    summed gradients.

    model: the policy (loomrl.platform.backbone.vlm.VLM): its `encode(media)` returns
    encodings by Medium.key and adds its work to `model.encode_totals`, where this hook
    adds the backward time.
    """

    def __init__(self, model):
        self.model = model
        self.encodings: Encodings = {}
        self._roots: Encodings = {}

    def begin(self, micro_batches: list) -> None:
        media = [m for mb in micro_batches for row in mb.media for m in row]
        self._roots, _ = self.model.encode(media)
        self.encodings = {k: r.detach().requires_grad_(r.requires_grad) for k, r in self._roots.items()}

    def finish(self) -> None:
        used = [(self._roots[k], leaf.grad) for k, leaf in self.encodings.items() if leaf.grad is not None]
        if used:
            start = time.perf_counter()
            torch.autograd.backward([r for r, _ in used], [g for _, g in used])
            self.model.encode_totals.backward_s += time.perf_counter() - start
        self._roots, self.encodings = {}, {}  # free the encoder graph and the leaves
