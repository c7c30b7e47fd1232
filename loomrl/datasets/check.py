"""`loomrl shards verify` and `loomrl shards inspect`: read shards back.

verify reads every sample, checks every member against its sha256 and decodes
every medium the way training does; it reports each fault (shard, sample,
member, reason) and goes on. inspect reads only the tar headers and each
sample's .json: counts, modalities, unique media by hash, bytes, shard sizes.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

from tqdm import tqdm

from loomrl.datasets.shards import MAX_MEMBER_BYTES, ShardError, load_sample, open_shard, read_header, scan_shard
from loomrl.encoders.media import MAX_AUDIO_SECONDS, data_error, decode_audio, decode_image
from loomrl.encoders.video import check_video


@dataclass
class Fault:
    shard: str
    key: str | None
    member: str | None
    reason: str

    def __str__(self) -> str:
        where = self.shard if self.key is None else f"{self.shard}:{self.key}"
        return f"{where}: {self.reason}" if self.member is None else f"{where}: member {self.member} {self.reason}"


def _fault(e: ShardError) -> Fault:
    return Fault(e.shard, e.key, e.member, e.reason)


def verify_shard(
    path: str,
    *,
    sample_rate: int = 16000,
    max_pixels: int = 50_000_000,
    max_member_bytes: int = MAX_MEMBER_BYTES,
    max_audio_seconds: float = MAX_AUDIO_SECONDS,
    max_video_seconds: float = 600.0,
) -> Iterator[tuple[str, Fault | None]]:
    """(sample key, fault or None) for every sample of a shard. A fault in the
    tar structure (hostile member, damage) ends the shard with one fault."""
    try:
        with open_shard(path) as fh:  # a regular file only: a FIFO would block here forever
            for ref in scan_shard(path, max_member_bytes):
                try:
                    sample = load_sample(fh, ref)
                except ShardError as e:
                    yield ref.key, _fault(e)
                    continue
                members = [m["member"] for m in read_header(fh, ref).get("media", [])]
                yield (
                    ref.key,
                    _decode_fault(
                        ref.shard,
                        ref.key,
                        members,
                        sample,
                        sample_rate=sample_rate,
                        max_pixels=max_pixels,
                        max_audio_seconds=max_audio_seconds,
                        max_video_seconds=max_video_seconds,
                    ),
                )
    except ShardError as e:
        yield e.key or "", _fault(e)
    except OSError as e:
        yield "", Fault(path, None, None, f"cannot be read ({e.strerror or e})")


def _decode_fault(
    shard: str,
    key: str,
    members: list[str],
    sample: dict,
    *,
    sample_rate: int,
    max_pixels: int,
    max_audio_seconds: float,
    max_video_seconds: float,
) -> Fault | None:
    for member, (kind, _, data) in zip(members, sample["media"]):
        try:
            if kind == "image":
                decode_image(data, max_pixels)
            elif kind == "video":
                check_video(data, max_video_seconds, max_pixels)
            else:
                decode_audio(data, sample_rate, max_audio_seconds)  # the length is checked before decoding
        except Exception as e:  # whatever the decoder raises is a fault to report, not to crash on
            return Fault(shard, key, member, f"does not decode as {kind} ({data_error(e)})")
    return None


@dataclass
class VerifyResult:
    shards: int = 0
    samples: int = 0
    faults: list[Fault] = field(default_factory=list)


def verify_shards(
    files: list[str], *, on_fault: Callable[[Fault], None] = lambda f: None, progress: bool = False, **limits
) -> VerifyResult:
    """Verify every shard; each fault goes to `on_fault` and into the result."""

    result = VerifyResult()
    ids: dict[str, str] = {}
    for path in tqdm(files, desc="shards verify", unit="shard", disable=not progress, dynamic_ncols=True):
        result.shards += 1
        for key, fault in verify_shard(path, **limits):
            if fault is None:
                result.samples += 1
                where = f"{path}:{key}"
                if key in ids:  # keys are ids (or derived from them): a repeat is a duplicate sample
                    fault = Fault(path, key, None, f"duplicate sample key, first seen at {ids[key]}")
                else:
                    ids[key] = where
            if fault is not None:
                result.faults.append(fault)
                on_fault(fault)
    return result


def shard_stats(files: list[str], max_member_bytes: int = MAX_MEMBER_BYTES) -> dict:
    """Counts of a set of shards from headers and .json members only (no hashing).
    Raises ShardError on a damaged or hostile shard."""
    modalities: Counter = Counter()
    media: Counter = Counter()
    unique: dict[str, int] = {}
    shards = []
    samples = media_bytes = 0
    for path in files:
        n = 0
        with open_shard(path) as fh:
            shard_bytes = os.fstat(fh.fileno()).st_size
            for ref in scan_shard(path, max_member_bytes):
                header = read_header(fh, ref)
                kinds = [m["kind"] for m in header.get("media", [])]
                modalities["+".join(sorted(set(kinds))) or "text"] += 1
                for m in header.get("media", []):
                    size = ref.members.get(m["member"], (0, 0))[1]
                    media[m["kind"]] += 1
                    media_bytes += size
                    unique[m["sha256"]] = size
                n += 1
        shards.append({"file": path, "samples": n, "bytes": shard_bytes})
        samples += n
    return {
        "shards": len(shards),
        "samples": samples,
        "modalities": dict(sorted(modalities.items())),
        "media": dict(sorted(media.items())),
        "media_total": sum(media.values()),
        "media_unique": len(unique),
        "media_bytes": media_bytes,
        "media_unique_bytes": sum(unique.values()),
        "shard_bytes": sum(s["bytes"] for s in shards),
        "shard_sizes": shards,
    }
