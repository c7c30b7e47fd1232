"""Writing and reading loomrl prompt shards: plain webdataset tars.

A sample `KEY` is stored as `KEY.json` (id, prompt, answer, a preference pair's chosen and
rejected, meta, and a media list of {kind, member, sha256}) plus one member per medium (`KEY.img0.png`,
`KEY.aud0.wav`, ...). The sha256 is of the stored bytes: the same content hash
the encoding cache keys on. Any tar tool and the stock `webdataset` pipeline
read these shards; loomrl's own reader below adds the guards a training job
needs against hostile or damaged tars:

- member names: no absolute paths, no `..` components;
- member types: regular files only (directories are skipped; links, devices,
  fifos and sparse files are refused);
- member sizes: bounded (`max_member_bytes`) before anything is read;
- nothing is unpickled: members are raw bytes, only `.json` is parsed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from typing import BinaryIO, Iterable, Iterator, Optional

from loomrl.datasets.files import NotRegularFile, open_regular
from loomrl.encoders.base import modalities
from loomrl.encoders.media import content_hash
from loomrl.platform.faults import maybe_die

log = logging.getLogger(__name__)

MAX_MEMBER_BYTES = 64 << 20
"""Default bound on one member (one image, clip or sample header)."""
MAX_HEADER_BYTES = 1 << 20
"""Bound on what one tar header may make tarfile read (pax records, GNU long names): a
damaged size field there would otherwise ask for gigabytes, or for the whole rest."""

KINDS = tuple(m.name for m in modalities())  # "image", "audio"
HEADER_FIELDS = ("id", "prompt", "answer", "chosen", "rejected", "meta")
"""A sample header's fields besides its media list (`chosen`, `rejected`: a preference pair)."""
_SAFE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
_SAFE_MEMBER = re.compile(r"[a-z0-9][a-z0-9_]*\.[a-z0-9]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ShardError(ValueError):
    """A fault in a shard, naming the shard and, where known, the sample and member."""

    def __init__(self, shard: str, reason: str, key: Optional[str] = None, member: Optional[str] = None):
        self.shard, self.key, self.member, self.reason = shard, key, member, reason
        where = shard if key is None else f"{shard}:{key}"
        super().__init__(f"{where}: {reason}" if member is None else f"{where}: member {member} {reason}")


# --------------------------------------------------------------------------- writing


def shard_key(sample_id: str) -> str:
    """The tar key of a sample: its id when that is a safe webdataset key, else a
    readable, collision-free stand-in (the id itself is kept in the .json).

    webdataset splits a member name at the first dot of its base name and skips
    names like `__x__`, so ids with dots, slashes or leading underscores cannot
    be keys as they are."""
    if _SAFE_KEY.fullmatch(sample_id):
        return sample_id
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", sample_id).strip("_-")[:60] or "sample"
    return f"{stem}-{hashlib.sha256(sample_id.encode()).hexdigest()[:16]}"


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    # Fixed owner, mode and time: the same samples give byte-identical shards.
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = size, 0o444, 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def _sample_members(s: dict) -> list[tuple[str, bytes]]:
    """(member name, bytes) of one sample, header first; validates the sample."""
    sample_id = s.get("id")
    if not isinstance(sample_id, str) or not sample_id:
        raise ValueError(f"sample id must be a non-empty string, got {sample_id!r}")
    key = shard_key(sample_id)
    media, members = [], []
    for kind, member, data in s.get("media", []):
        if kind not in KINDS:
            raise ValueError(f"sample {sample_id}: unknown medium kind {kind!r}")
        if not _SAFE_MEMBER.fullmatch(member) or member == "json":
            raise ValueError(f"sample {sample_id}: bad member name {member!r} (want e.g. img0.png)")
        media.append({"kind": kind, "member": member, "sha256": content_hash(data)})
        members.append((f"{key}.{member}", data))
    if len({m for m, _ in members}) != len(members):
        raise ValueError(f"sample {sample_id}: two media share a member name")
    header = {k: s[k] for k in HEADER_FIELDS if k in s}
    return [(f"{key}.json", json.dumps({**header, "media": media}).encode())] + members


def _tar_bytes(members: list[tuple[str, bytes]]) -> int:
    """Bytes these members take in a tar: headers (with any pax extension) plus
    data padded to 512-byte blocks."""
    return sum(len(_tarinfo(n, len(d)).tobuf(tarfile.PAX_FORMAT)) + -(-len(d) // 512) * 512 for n, d in members)


def _file_bytes(member_bytes: int) -> int:
    """Size of a tar file holding `member_bytes` of members: two zero blocks end it
    and tarfile pads it to a whole 10240-byte record."""
    return -(-(member_bytes + 1024) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def write_shards(samples: Iterable[dict], pattern: str, maxcount: int, maxsize: Optional[int] = None) -> list[str]:
    """Write samples {id, prompt, answer, meta, media: [(kind, member, bytes)]} to
    tar shards named by `pattern` (printf-style, e.g. dir/name-%06d.tar), at most
    `maxcount` samples and (if given) `maxsize` bytes per shard; a single sample
    larger than `maxsize` gets a shard of its own. Returns the shard paths.

    Shards are written to new .tmp files and renamed when all are complete, never
    over an existing file (FileExistsError, and the shards of this call are
    removed). On any failure (a bad sample, a full disk: an OSError naming the
    file) every file of this call is removed, so a rerun is not blocked.

    This is the one writer: `loomrl shards make` and the demo shards both use it."""
    if maxcount < 1:
        raise ValueError(f"maxcount must be at least 1, got {maxcount}")
    check_pattern(pattern)
    os.makedirs(os.path.dirname(pattern) or ".", exist_ok=True)
    # Write to .tmp names and rename at the end, so an interrupted write never
    # leaves a set of shards that looks complete.
    tmp_names: list[str] = []
    keys: set[str] = set()
    tar: Optional[tarfile.TarFile] = None
    count = size = 0
    try:
        for s in samples:
            members = _sample_members(s)
            key = members[0][0][: -len(".json")]
            if key in keys:
                raise ValueError(f"sample {s['id']}: duplicate sample key {key!r}")
            keys.add(key)
            need = _tar_bytes(members)
            current = tmp_names[-1] if tmp_names else ""
            try:  # an OSError here (a full disk) names the file it was writing
                if tar is not None and (count >= maxcount or (maxsize and _file_bytes(size + need) > maxsize)):
                    tar, done = None, tar
                    done.close()
                    maybe_die("shards")  # tests: killed with a whole shard under its .tmp name
                if tar is None:
                    current = pattern % len(tmp_names) + ".tmp"
                    tar = tarfile.open(current, "x", format=tarfile.PAX_FORMAT)  # "x": never an existing file
                    tmp_names.append(current)  # ours to remove on failure from here on
                    count = size = 0
                for name, data in members:
                    tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
            except OSError as e:
                e.filename = e.filename or current
                raise
            count += 1
            size += need
        if tar is not None:
            tar, done = None, tar
            try:
                done.close()
            except OSError as e:
                e.filename = e.filename or tmp_names[-1]
                raise
    except BaseException:
        if tar is not None:
            try:
                tar.close()  # closes the file even when writing the end of the archive fails
            except OSError:
                pass  # the disk that failed a write fails this one too; the file is removed below
        _remove(tmp_names)
        raise
    return _publish(tmp_names)


def _remove(paths: Iterable[str]) -> None:
    """Remove what a failed write left, going on past files that are gone or will not go."""
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("warning: could not remove %s: %s", p, e.strerror or e)


def _publish(tmp_names: list[str]) -> list[str]:
    """Give the .tmp files their final names, never replacing an existing file: a hard
    link fails when the name is taken (where there are no hard links: a check, then a
    rename). If one name is taken, the shards already renamed are removed again."""
    done: list[str] = []
    try:
        for t in tmp_names:
            final = t[: -len(".tmp")]
            try:
                os.link(t, final)
            except FileExistsError:
                raise FileExistsError(
                    errno.EEXIST, "a shard of this name already exists; not replaced", final
                ) from None
            except OSError:
                if os.path.lexists(final):
                    raise FileExistsError(
                        errno.EEXIST, "a shard of this name already exists; not replaced", final
                    ) from None
                os.rename(t, final)
            done.append(final)
    except BaseException:
        _remove(done + tmp_names)
        raise
    _remove(tmp_names)
    return done


# A printf conversion in a shard pattern: a literal "%%", an integer field, or anything else.
_PATTERN_TOKEN = re.compile(r"%%|%[-#0 +]*[0-9]*(?:[.][0-9]+)?[hlL]?[diouxX]|%")


def check_pattern(pattern: str) -> None:
    """A shard pattern numbers its shards with one printf integer field in the file
    name: `dir/name-%06d.tar` (%d, %i, %u, %x, %X, %o with flags and width; `%%` is a
    literal %). Anything else (%s, %e, %r, a second field, a field in the folder) is
    refused: the check for existing shards could not know the names it makes."""
    folder, name = os.path.split(pattern)
    tokens = [m.group() for m in _PATTERN_TOKEN.finditer(name) if m.group() != "%%"]
    ok = "%" not in folder and len(tokens) == 1 and tokens[0] != "%"
    if ok:
        try:
            ok = pattern % 0 != pattern % 1
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(
            f"shard pattern {pattern!r} needs one printf number field, an integer one (%d, %06d, "
            f"%x, ...), in its file name and no other %, e.g. 'dir/name-%06d.tar'"
        )


def existing_shards(pattern: str) -> list[str]:
    """Files (and leftover .tmp files) a valid shard pattern (see `check_pattern`) would name."""
    folder, name = os.path.split(pattern)
    if not os.path.isdir(folder or "."):
        return []
    regex = ""
    for m in re.finditer(r"%%|%[^diouxX%]*[diouxX]|[^%]+", name):
        text = m.group()
        if text == "%%":
            regex += "%"
        elif text.startswith("%"):
            regex += r"[ +]*(?:0[xXo])?[0-9a-fA-F]+ *"  # any number, any padding, any base
        else:
            regex += re.escape(text)
    regex += r"(?:\.tmp)?"
    return sorted(os.path.join(folder, f) for f in os.listdir(folder or ".") if re.fullmatch(regex, f))


# --------------------------------------------------------------------------- reading


@dataclass
class SampleRef:
    """Where one sample's members lie in a shard: enough to read it later by seeking."""

    shard: str
    key: str
    members: dict[str, tuple[int, int]] = field(default_factory=dict)  # ext -> (data offset, size)


def check_member(shard: str, ti: tarfile.TarInfo, max_member_bytes: int) -> None:
    """Refuse a member a training job should never touch (raises ShardError)."""
    name = ti.name
    if not name or name.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", name):
        raise ShardError(shard, "has an absolute path", member=repr(name))
    if ".." in re.split(r"[\\/]", name):
        raise ShardError(shard, "has a '..' path component", member=repr(name))
    if "\0" in name:
        raise ShardError(shard, "has a NUL byte in its name", member=repr(name))
    if ti.issym() or ti.islnk():
        raise ShardError(shard, f"is a link (to {ti.linkname!r}); links are refused", member=name)
    if ti.issparse() or not (ti.isreg() or ti.isdir()):
        raise ShardError(shard, "is not a regular file (device, fifo or sparse); refused", member=name)
    if ti.size > max_member_bytes:
        raise ShardError(shard, f"is {ti.size} bytes, over the limit of {max_member_bytes}", member=name)
    if ti.size < 0 or ti.offset_data < 0:  # a damaged size field; tarfile would seek backwards
        raise ShardError(shard, f"has a negative size or offset ({ti.size}, {ti.offset_data})", member=name)


def split_name(name: str) -> tuple[Optional[str], Optional[str]]:
    """(key, extension) the way webdataset splits a member name: the key runs to
    the first dot of the base name."""
    m = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name)
    return (m.group(1), m.group(2)) if m else (None, None)


class _HeaderReads:
    """A shard file as tarfile sees it. tarfile reads only headers through it (member
    data is read by offset, see `read_member`), so a read of more than MAX_HEADER_BYTES,
    or of "everything" (a negative size), is a damaged header: a ReadError."""

    def __init__(self, fh: BinaryIO):
        self._fh = fh

    def read(self, n: Optional[int] = -1) -> bytes:
        if n is None or n < 0 or n > MAX_HEADER_BYTES:
            raise tarfile.ReadError(f"a header asks to read {'all the rest' if n is None or n < 0 else n} bytes")
        return self._fh.read(n)

    def __getattr__(self, name):
        return getattr(self._fh, name)


def _end_fault(fh: BinaryIO, offset: int) -> Optional[str]:
    """Why the archive does not end properly at `offset` (where tarfile found no further
    header), or None: a tar ends with two 512-byte zero blocks. tarfile also stops
    without a word at a damaged header, at a header cut short and at the end of the
    file, so a shard cut at a member boundary, or one whose next header was
    overwritten, would pass for a shorter whole one."""
    fh.seek(offset)
    tail = fh.read(2 * tarfile.BLOCKSIZE)
    if tail == bytes(2 * tarfile.BLOCKSIZE):
        return None
    if not tail.strip(b"\0"):
        return f"ends at byte {offset + len(tail)} without the two zero blocks that end a tar archive (cut short?)"
    return f"has a damaged tar header at byte {offset}"


def open_shard(path: str) -> BinaryIO:
    """A shard file opened for reading: ShardError if it does not exist or is not a regular
    file (a FIFO would block the open forever, see `open_regular`); OSError on an I/O error."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise ShardError(path, "does not exist") from None
    except NotRegularFile as e:
        raise ShardError(path, e.strerror) from None


def scan_shard(path: str, max_member_bytes: int = MAX_MEMBER_BYTES) -> Iterator[SampleRef]:
    """The samples of a shard, from its tar headers alone (member data is skipped,
    not read). Every member is checked (see `check_member`) before use.
    Raises ShardError naming the shard and member on the first fault: a hostile
    member, a damaged header, a tar that does not end with its end-of-archive blocks
    (cut short), a shard without any sample. Only a regular file is opened (see
    `open_regular`); an I/O error is an OSError."""
    with open_shard(path) as fh:
        try:  # plain tars only: seekable, no decompression bombs
            tf = tarfile.open(path, "r:", fileobj=_HeaderReads(fh))
        except (OSError, MemoryError):
            raise
        except Exception as e:  # tarfile raises more than TarError on some hostile headers
            raise ShardError(path, f"is not a readable uncompressed tar ({_tar_error(e)})") from None
        seen: set[str] = set()
        ref: Optional[SampleRef] = None
        last = "the start"
        while True:
            try:
                ti = tf.next()
            except (OSError, MemoryError):
                raise
            except Exception as e:
                raise ShardError(path, f"is damaged after {last} ({_tar_error(e)})") from None
            if ti is None:
                fault = _end_fault(fh, tf.offset)
                if fault:
                    raise ShardError(path, f"{fault}, after {last}")
                break
            tf.members.clear()  # tarfile keeps every header otherwise; we keep our own index
            check_member(path, ti, max_member_bytes)
            last = f"member {ti.name}"
            if ti.isdir():
                continue
            key, ext = split_name(ti.name)
            if key is None:
                raise ShardError(path, "has no extension (want KEY.EXT)", member=ti.name)
            if ref is None or key != ref.key:
                if ref is not None:
                    yield ref
                if key in seen:
                    raise ShardError(
                        path,
                        "reappears after other samples (members of a sample must be consecutive)",
                        key=key,
                        member=ti.name,
                    )
                seen.add(key)
                ref = SampleRef(path, key)
            if ext in ref.members:
                raise ShardError(path, "appears twice in the sample", key=key, member=ti.name)
            ref.members[ext] = (ti.offset_data, ti.size)
    if ref is None:
        raise ShardError(path, "has no samples (an empty tar archive, or one of zeros)")
    yield ref


def _tar_error(e: Exception) -> str:
    return str(e) if isinstance(e, tarfile.TarError) else f"{type(e).__name__}: {e}"


def read_member(fh: BinaryIO, ref: SampleRef, ext: str) -> bytes:
    offset, size = ref.members[ext]
    fh.seek(offset)
    data = fh.read(size)
    if len(data) != size:
        raise ShardError(ref.shard, f"is truncated ({len(data)} of {size} bytes)", key=ref.key, member=ext)
    return data


def read_header(fh: BinaryIO, ref: SampleRef) -> dict:
    """The parsed, schema-checked .json member of a sample."""
    if "json" not in ref.members:
        raise ShardError(ref.shard, "sample has no .json member", key=ref.key)
    try:
        header = json.loads(read_member(fh, ref, "json"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(ref.shard, f"is not valid JSON ({e})", key=ref.key, member="json") from None
    except RecursionError:  # "[[[[..." nested deeper than the parser's stack
        raise ShardError(ref.shard, "is JSON nested too deeply to parse", key=ref.key, member="json") from None
    problem = _header_problem(header)
    if problem:
        raise ShardError(ref.shard, problem, key=ref.key, member="json")
    return header


def _header_problem(h) -> Optional[str]:
    if not isinstance(h, dict):
        return "is not a JSON object"
    if not isinstance(h.get("id"), str) or not isinstance(h.get("prompt"), str):
        return "needs string fields id and prompt"
    if not isinstance(h.get("media", []), list):
        return "field media is not a list"
    for m in h.get("media", []):
        if not (
            isinstance(m, dict)
            and m.get("kind") in KINDS
            and isinstance(m.get("member"), str)
            and isinstance(m.get("sha256"), str)
            and _SHA256.fullmatch(m["sha256"])
        ):
            return f"has a bad media entry {m!r} (want {{kind, member, sha256}})"
    return None


def load_sample(fh: BinaryIO, ref: SampleRef, check_hashes: bool = True) -> dict:
    """A sample as {id, prompt, answer, meta, media: [(kind, sha256, bytes)], source}.
    Raises ShardError naming shard, sample and member on a missing member or hash mismatch."""
    header = read_header(fh, ref)
    media = []
    for m in header.get("media", []):
        if m["member"] not in ref.members:
            raise ShardError(ref.shard, "is missing", key=ref.key, member=m["member"])
        data = read_member(fh, ref, m["member"])
        if check_hashes and content_hash(data) != m["sha256"]:
            raise ShardError(ref.shard, "does not match its sha256", key=ref.key, member=m["member"])
        media.append((m["kind"], m["sha256"], data))
    return {**header, "media": media, "source": f"{ref.shard}:{ref.key}"}


def read_shards(files: list[str], max_member_bytes: int = MAX_MEMBER_BYTES) -> Iterator[dict]:
    """Samples as {id, prompt, answer, meta, media: [(kind, sha256, bytes)], source},
    in shard order. Raises ShardError (a ValueError) naming the shard and member on
    a hostile member, a missing member, a hash mismatch, a damaged or cut tar, a shard
    without samples, or a path that is not a regular file."""
    for f in files:
        with open_shard(f) as fh:
            for ref in scan_shard(f, max_member_bytes):
                yield load_sample(fh, ref)


@dataclass
class MediaCensus:
    """Samples of some shards that hold a medium the model cannot read (`media_census`)."""

    samples: int = 0
    unreadable: int = 0  # samples holding at least one medium of a kind not readable
    kinds: Counter = field(default_factory=Counter)  # unreadable kind -> samples holding it
    first: str = ""  # "shard:key" of the first such sample


def media_census(files: list[str], readable: set[str], max_member_bytes: int = MAX_MEMBER_BYTES) -> MediaCensus:
    """Count the samples of `files` holding media of kinds not in `readable`, from the headers
    alone (the tar index and each sample's .json; no medium is read). ShardError on a damaged shard."""
    census = MediaCensus()
    for f in files:
        with open_shard(f) as fh:
            for ref in scan_shard(f, max_member_bytes):
                census.samples += 1
                kinds = {m["kind"] for m in read_header(fh, ref).get("media", [])} - readable
                if kinds:
                    census.unreadable += 1
                    census.kinds.update(kinds)
                    census.first = census.first or f"{ref.shard}:{ref.key}"
    return census
