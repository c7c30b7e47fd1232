"""`loomrl shards make`: manifest -> validated media -> shards + the split's rejection list.

Every medium is decoded before it is stored, so a shard never holds a file the
trainer cannot read:

- images are opened with Pillow under a pixel limit (decompression bombs are
  refused from the header, before any pixel is decoded) and fully decoded
  (truncated files fail here). A PNG, JPEG or WebP that decodes is stored as
  its original bytes, so its hash is the sha256 of the source file; any other
  format (BMP, TIFF, GIF, ...) is stored as a lossless PNG of its first frame.
- audio is read with soundfile (length checked from the header first), mixed
  to mono, resampled with torchaudio to the target rate and stored as 16-bit
  PCM WAV (the demo's format; 96 dB of range is more than a log-mel front end
  resolves, at half the bytes of float).

Media held in the record (a data: URI, bytes in a parquet or `datasets` column)
meet the same checks without touching the filesystem: a URI's decoded size is
counted from its length and refused over `max_file_bytes` before it is decoded,
bad base64 is a `bad-base64`, and a rejection names the field it came from.

A bad sample never stops the job and is never dropped silently: it becomes a
Rejection (stderr, the rejection list `rejected_path`, summary counts). How manifest lines are read
(field names, markers placed before a marker-free prompt, media paths kept
inside the manifest's folder) is `manifest.ReadOptions`; the summary counts the
written samples whose markers were placed.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import os
import re
import sys
import time
import urllib.parse
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, TextIO, Union

import numpy as np
import soundfile as sf
import torch
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from loomrl.datasets.files import NotRegularFile, open_regular
from loomrl.datasets.inline import Inline, decoded_size
from loomrl.datasets.manifest import Entry, MediaItem, ReadOptions, Rejection
from loomrl.datasets.shards import MAX_MEMBER_BYTES, write_shards
from loomrl.datasets.sources import Source
from loomrl.encoders.base import modality
from loomrl.encoders.media import AudioTooLong, data_error, decode_image, read_audio, resample
from loomrl.encoders.video import VideoTooLarge, VideoTooLong, check_video

KEEP_IMAGE_FORMATS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}


@dataclass
class Limits:
    """What `make` accepts; each is a command-line option."""

    sample_rate: int = 16000
    max_pixels: int = 50_000_000
    max_audio_seconds: float = 60.0
    max_video_seconds: float = 600.0
    max_file_bytes: int = MAX_MEMBER_BYTES


class Reject(Exception):
    """A medium that cannot go into a shard: a countable code and a readable reason."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


# --------------------------------------------------------------------------- media


def prepare_image(data: bytes, limits: Limits) -> tuple[str, bytes]:
    """(extension, bytes to store) of a valid image; raises Reject."""

    try:
        # The same decoder the trainer uses, with the same pixel guard.
        img = decode_image(data, limits.max_pixels)
        with Image.open(io.BytesIO(data)) as probe:
            fmt = probe.format
    except UnidentifiedImageError:
        raise Reject("not-an-image", "not an image Pillow can identify") from None
    except ValueError as e:
        if "exceeds the limit" in str(e) or "decompression bomb" in str(e).lower():
            raise Reject("image-too-large", str(e)) from None
        raise Reject("bad-image", f"cannot decode: {e}") from None
    except Exception as e:  # truncated or corrupt data: OSError, SyntaxError, zlib errors, ...
        raise Reject("bad-image", f"cannot decode ({data_error(e)})") from None
    if fmt in KEEP_IMAGE_FORMATS:
        return KEEP_IMAGE_FORMATS[fmt], data
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "png", buf.getvalue()


def prepare_audio(data: bytes, limits: Limits) -> bytes:
    """Mono 16-bit WAV at the target rate of a valid clip; raises Reject."""

    try:
        # The same reader the trainer uses: the length is checked from the header before
        # decoding, so a 10-hour file is refused cheaply.
        wave, sr = read_audio(data, limits.max_audio_seconds)
    except AudioTooLong as e:
        raise Reject("audio-too-long", str(e)) from None
    except Exception as e:  # libsndfile: "Format not recognised", "unspecified internal error", ...
        data_error(e)  # (raises a bug's exception under LOOMRL_STRICT_DATA_ERRORS=1)
        raise Reject("bad-audio", f"not audio soundfile can read ({_sf_message(e)})") from None
    if wave.size == 0:
        raise Reject("empty-audio", "clip has no samples")
    if not np.isfinite(wave).all():
        raise Reject("bad-audio", "clip has NaN or infinite samples")
    wave = wave.mean(axis=1)
    try:
        wave = resample(wave, sr, limits.sample_rate)  # refuses rates whose resampling kernel is huge
    except ValueError as e:
        raise Reject("bad-audio", str(e)) from None
    if wave.size == 0:
        raise Reject("empty-audio", f"clip is shorter than one sample at {limits.sample_rate} Hz")
    buf = io.BytesIO()
    # Resampling can overshoot full scale a little; clip rather than let PCM wrap.
    sf.write(buf, np.clip(wave, -1.0, 1.0), limits.sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def prepare_video(data: bytes, limits: Limits) -> str:
    """The extension to store a valid clip under (its bytes are stored as they are); raises Reject.
    The same reader the trainer uses: the header's length and frame count are checked before any
    frame is decoded, then every frame is decoded with the pixel guard (a truncated file shows)."""
    try:
        ext, _ = check_video(data, limits.max_video_seconds, limits.max_pixels)
    except VideoTooLong as e:
        raise Reject("video-too-long", str(e)) from None
    except VideoTooLarge as e:
        raise Reject("video-too-large", str(e)) from None
    except ValueError as e:
        text = str(e)
        code = "not-a-video" if text.startswith(("not a video", "a '")) or "no video stream" in text else "bad-video"
        raise Reject(code, text) from None
    except Exception as e:  # noqa: BLE001 - whatever FFmpeg raises on a hostile file is the file's fault
        raise Reject("bad-video", f"cannot decode ({data_error(e)})") from None
    return ext


def _sf_message(e: Exception) -> str:
    # soundfile names the in-memory buffer ("Error opening <_io.BytesIO object at 0x..>: ...");
    # the file is named elsewhere, so keep only libsndfile's reason.
    return re.sub(r"^Error opening <[^>]*>: ", "", str(e)).strip() or type(e).__name__


def read_file(path: str, limits: Limits) -> bytes:
    """The bytes of a medium's file; raises Reject. Only a regular file is read: a FIFO
    would block the job forever, a device could be endless (see `open_regular`)."""
    try:
        fh = open_regular(path)
    except FileNotFoundError:
        raise Reject("missing-file", "file does not exist") from None
    except NotRegularFile as e:
        raise Reject("unreadable-file", e.strerror) from None
    except OSError as e:  # a folder, no permission, I/O error
        raise Reject("unreadable-file", f"cannot read ({e.strerror or e})") from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limits.max_file_bytes:
            raise Reject("file-too-large", f"file of {size} bytes is over the limit of {limits.max_file_bytes}")
        try:
            data = fh.read(limits.max_file_bytes + 1)
        except OSError as e:  # an I/O error
            raise Reject("unreadable-file", f"cannot read ({e.strerror or e})") from None
    if len(data) > limits.max_file_bytes:  # grew since the fstat
        raise Reject("file-too-large", f"file is over the limit of {limits.max_file_bytes} bytes")
    return data


def inline_bytes(inline: Inline, limits: Limits) -> bytes:
    """The bytes of a medium held in its record; raises Reject. A data: URI's payload is decoded
    only after its decoded size (counted from its length) was found within max_file_bytes."""
    size = decoded_size(inline)
    if size > limits.max_file_bytes:
        if inline.data is not None:
            raise Reject("file-too-large", f"{size} bytes, over the limit of {limits.max_file_bytes}")
        raise Reject(
            "file-too-large",
            f"decodes to {size} bytes, over the limit of {limits.max_file_bytes} (refused before decoding)",
        )
    if inline.data is not None:
        return inline.data
    text = inline.encoded or ""
    if not inline.base64:
        return urllib.parse.unquote_to_bytes(text)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:  # a character outside base64, wrong padding, non-ASCII
        raise Reject("bad-base64", f"not valid base64 ({e})") from None


def read_medium(item: MediaItem, limits: Limits) -> bytes:
    """A medium's bytes: its file's (`read_file`), or those held inline (no file is touched)."""
    if item.inline is not None:
        data = inline_bytes(item.inline, limits)
    else:
        assert item.path is not None, "a MediaItem holds a path or inline bytes"
        data = read_file(item.path, limits)
    if not data:
        raise Reject("empty-file", "file is empty (0 bytes)" if item.inline is None else "empty (0 bytes)")
    return data


def prepare_entry(entry: Entry, limits: Limits) -> Union[dict, Rejection]:
    """A writable sample {id, prompt, answer, chosen, rejected, meta, media: [(kind, member, bytes)]}, or the
    Rejection of its first bad medium (naming its file, or the field of an inline one)."""
    media = []
    counts: Counter = Counter()
    for item in entry.media:
        try:
            data = read_medium(item, limits)
            if item.kind == "image":
                ext, stored = prepare_image(data, limits)
            elif item.kind == "video":
                ext, stored = prepare_video(data, limits), data
            else:
                ext, stored = "wav", prepare_audio(data, limits)
            if len(stored) > limits.max_file_bytes:
                raise Reject(
                    "file-too-large", f"stored form of {len(stored)} bytes is over the limit of {limits.max_file_bytes}"
                )
        except Reject as r:
            if item.inline is None:
                return Rejection(entry.id, entry.where, r.code, r.reason, file=item.path)
            return Rejection(entry.id, entry.where, r.code, f"{item.inline.name}: {r.reason}")
        prefix = modality(item.kind).file_prefix
        media.append((item.kind, f"{prefix}{counts[item.kind]}.{ext}", stored))
        counts[item.kind] += 1
    sample = {"id": entry.id, "prompt": entry.prompt, "meta": entry.meta, "media": media}
    if entry.answer is not None:
        sample["answer"] = entry.answer
    if entry.pair is not None:
        sample["chosen"], sample["rejected"] = entry.pair
    return sample


# --------------------------------------------------------------------------- the job


@dataclass
class MakeResult:
    shards: list[str] = field(default_factory=list)
    samples: int = 0
    media: Counter = field(default_factory=Counter)  # kind -> count
    media_bytes: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    seconds: float = 0.0
    markers_placed: int = 0  # written samples whose prompt had no marker: media placed before the text
    layouts: Counter = field(default_factory=Counter)  # layout -> records read in it (detected or --format)

    def summary(self) -> str:
        codes = Counter(r.code for r in self.rejected)
        total = sum(os.path.getsize(s) for s in self.shards)
        text = (
            f"wrote {self.samples} samples ({self.media['image']} images, {self.media['audio']} clips, "
            f"{self.media['video']} videos, "
            f"{self.media_bytes / 1e6:.1f} MB of media) to {len(self.shards)} shard(s), "
            f"{total / 1e6:.1f} MB, in {self.seconds:.1f} s"
        )
        if self.markers_placed:
            text += f"; markers placed before the text in {self.markers_placed}"
        if self.rejected:
            text += f"; rejected {len(self.rejected)}: " + ", ".join(f"{n} {c}" for c, n in codes.most_common())
        else:
            text += "; rejected 0"
        if self.layouts:
            text += "; read as " + ", ".join(f"{n} {name}" for name, n in self.layouts.most_common())
        return text

    def to_json(self) -> dict:
        """The summary's numbers (`shards make --json`)."""
        codes = Counter(r.code for r in self.rejected)
        return {
            "written": self.samples,
            "shards": list(self.shards),
            "shard_bytes": sum(os.path.getsize(s) for s in self.shards),
            "images": self.media["image"],
            "clips": self.media["audio"],
            "videos": self.media["video"],
            "media_bytes": self.media_bytes,
            "markers_placed": self.markers_placed,
            "rejected": len(self.rejected),
            "rejected_by_code": dict(codes.most_common()),
            "layouts": dict(self.layouts.most_common()),
            "seconds": round(self.seconds, 3),
        }


def make_shards(
    source: str,
    pattern: str,
    *,
    maxcount: int = 1000,
    maxsize: Optional[int] = None,
    limits: Limits = Limits(),
    workers: int = 4,
    on_reject: Callable[[Rejection], None] = lambda r: None,
    progress: bool = False,
    options: ReadOptions = ReadOptions(),
) -> MakeResult:
    """Validate every sample of the source at `source` (a manifest, a .json, parquet or datasets
    source: sources.py; records read with `options`) and write the good ones with `write_shards`;
    every rejection goes to `on_reject` and to the split's rejection list (`rejected_path`:
    DIR/train-rejected.jsonl for DIR/train-%06d.tar; written even when empty; an existing one is
    never overwritten: FileExistsError). progress: a bar on a terminal, else a line on stderr
    every PROGRESS_SECONDS. On
    failure (an OSError such as a full disk, naming the file) nothing of this
    call is left behind."""
    t0 = time.perf_counter()
    src = Source.from_path(source)
    out_dir = os.path.dirname(pattern) or "."
    os.makedirs(out_dir, exist_ok=True)
    outcomes = Outcomes.start(src, rejected_path(pattern), on_reject=on_reject, progress=progress)
    outcomes.result.layouts = src.layouts  # counted as the records are read
    samples = good_samples(src, outcomes, options=options, limits=limits, workers=workers)
    try:
        with one_torch_thread():
            outcomes.result.shards = write_shards(samples, pattern, maxcount, maxsize)
        outcomes.rejected.close()  # line-buffered: nothing is left to write
    except BaseException:  # write_shards has removed its files; this one goes too, so a rerun is clean
        outcomes.discard_rejected()
        raise
    finally:
        outcomes.bar.close()
    outcomes.result.seconds = time.perf_counter() - t0
    return outcomes.result


PROGRESS_SECONDS = 5.0
"""Without a terminal (a log file, CI), a progress line this often."""


def rejected_path(pattern: str) -> str:
    """The rejection list of the split a shard pattern writes: beside the shards, named by the
    pattern's prefix (`shards/train-%06d.tar` -> `shards/train-rejected.jsonl`), so one folder
    holds several splits; `rejected.jsonl` for a pattern with no prefix (`shards/%06d.tar`)."""
    prefix = re.split(r"[%{]", os.path.basename(pattern))[0].rstrip("-_.")
    return os.path.join(os.path.dirname(pattern) or ".", f"{prefix}-rejected.jsonl" if prefix else "rejected.jsonl")


@dataclass
class Ticker:
    """A progress line on stderr every PROGRESS_SECONDS, for output that is not a terminal."""

    on: bool
    t0: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def tick(self, result: MakeResult) -> None:
        now = time.monotonic()
        if self.on and now - self.last >= PROGRESS_SECONDS:
            self.last = now
            done = result.samples + len(result.rejected)
            print(
                f"shards make: {done} read, {result.samples} written, {len(result.rejected)} rejected "
                f"({done / (now - self.t0):.0f} samples/s)",
                file=sys.stderr,
                flush=True,
            )


@dataclass
class Pending:
    """A manifest line on its way to the shards: its Rejection, or its Entry and the future of its prepared sample."""

    item: Union[Entry, Rejection]
    future: Optional[Future] = None


@dataclass
class Outcomes:
    """Where a make's outcomes go: the counts (`result`), the rejection list, the caller's
    `on_reject` and the progress bar."""

    result: MakeResult
    rejected: TextIO
    rejected_path: str
    on_reject: Callable[[Rejection], None]
    bar: tqdm
    ticker: Ticker

    @classmethod
    def start(
        cls, source: Source, rejected_to: str, *, on_reject: Callable[[Rejection], None], progress: bool
    ) -> "Outcomes":
        """The bar, and the rejection list created (never overwritten: FileExistsError)."""
        bar = tqdm(
            total=source.count_records() if progress else None,
            disable=not progress,
            unit="sample",
            desc="shards make",
            dynamic_ncols=True,
        )
        try:  # "x": an earlier make's rejections are never overwritten
            rejected = open(rejected_to, "x", buffering=1)
        except OSError:
            bar.close()
            raise
        return cls(MakeResult(), rejected, rejected_to, on_reject, bar, Ticker(on=not progress))

    def reject(self, r: Rejection) -> None:
        self.result.rejected.append(r)
        try:  # line-buffered: a full disk shows up here, naming the file, not at the close
            self.rejected.write(json.dumps(r.to_json()) + "\n")
        except OSError as e:
            e.filename = e.filename or self.rejected_path
            raise
        self.on_reject(r)

    def settle(self, p: Pending) -> Optional[dict]:
        """The line's sample when it is good (counted), else None (its rejection recorded)."""
        self.bar.update(1)
        out = p.item if p.future is None else p.future.result()
        if isinstance(out, Rejection):
            self.reject(out)
            self.ticker.tick(self.result)
            return None
        assert isinstance(p.item, Entry)
        self.result.samples += 1
        self.result.markers_placed += p.item.markers_placed
        for kind, _, data in out["media"]:
            self.result.media[kind] += 1
            self.result.media_bytes += len(data)
        self.ticker.tick(self.result)
        return out

    def discard_rejected(self) -> None:
        """Close and remove the rejection list, after a failure."""
        for step in (self.rejected.close, lambda: os.remove(self.rejected_path)):
            try:
                step()
            except OSError:  # a full disk fails the close's flush too; the file goes anyway
                pass


def good_samples(
    source: Source, outcomes: Outcomes, *, options: ReadOptions, limits: Limits, workers: int
) -> Iterator[dict]:
    """The source's good samples, prepared; every record is settled with `outcomes`."""
    # Decoding runs in threads (Pillow, libsndfile and torch release the GIL);
    # results come back in manifest order, so the shards are deterministic.
    with ThreadPoolExecutor(max(1, workers)) as pool:
        pending: list[Pending] = []
        for item in source.entries(options):
            pending.append(Pending(item, pool.submit(prepare_entry, item, limits) if isinstance(item, Entry) else None))
            if len(pending) >= 4 * max(1, workers):
                sample = outcomes.settle(pending.pop(0))
                if sample is not None:
                    yield sample
        for p in pending:
            sample = outcomes.settle(p)
            if sample is not None:
                yield sample


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block."""
    # Samples are decoded in parallel threads; torch's own intra-op threads for each
    # small resample would only oversubscribe the cores (measured: 1000 samples took
    # 27 s instead of 4.6 s on 2 busy cores). Restored afterwards.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(torch_threads)


def print_rejection(r: Rejection) -> None:
    """One line on stderr for a rejected sample: id, file, reason."""
    what = f"id={r.id}" if r.id is not None else "line"
    file = f" file={r.file}" if r.file else ""
    print(f"rejected {what} ({r.where}){file}: {r.code}: {r.reason}", file=sys.stderr, flush=True)


class RejectionEcho:
    """`on_reject` for the command line: the first `limit` rejections on stderr, then only counted
    (the rejection list has them all); `close()` says how many were not shown."""

    def __init__(self, limit: int = 20):
        self.limit, self.seen = limit, 0

    def __call__(self, r: Rejection) -> None:
        self.seen += 1
        if self.seen <= self.limit:
            print_rejection(r)
        elif self.seen == self.limit + 1:
            print(
                "... more rejections are counted but not shown here (all are in the rejection list)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.seen > self.limit:
            print(
                f"{self.seen - self.limit} more rejection(s) not shown above; see the rejection list", file=sys.stderr
            )
