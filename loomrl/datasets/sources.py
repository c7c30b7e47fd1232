"""Sources: what `loomrl shards make SOURCE` reads, record by record.

SOURCE is one file or a folder, told apart by suffix and content, each read with its own
library (nothing is parsed by hand):

- `.jsonl`: one record per line, line by line (a line over 1 MiB is a `bad-line`, as before);
- `.json`: a list of objects, loaded whole, so bounded: a file over MAX_JSON_BYTES is refused
  naming it (convert it to JSONL: `jq -c '.[]' big.json > big.jsonl`); element i is the record
  `file.json:[i]`;
- `.parquet`: pyarrow.parquet, in record batches of BATCH_ROWS rows; row N (from 0) is
  `file.parquet:row N`;
- a Hugging Face `datasets` folder written by `save_to_disk` (`dataset_info.json` and
  `state.json`, or `dataset_dict.json` and one folder per split): `datasets.load_from_disk`,
  local only, read as Arrow record batches (`with_format("arrow")`), so an Image or Audio
  column comes as its stored `{"bytes", "path"}` struct, never decoded, at any nesting (a
  `cast_column(..., Image(decode=False))` of a nested list would write a cache file into the
  user's folder); row N of split S is `FOLDER/S:row N` (every split, in the order of
  `dataset_dict.json`; a split's own folder, `FOLDER/S`, reads that one);
- a folder of data files as `datasets.load_dataset` finds them: its `*.jsonl`, `*.json` and
  `*.parquet` files and those anywhere under its `data/` folder, read in name order
  (`dataset_info.json` and the like are not data).

Anything else is refused naming the supported kinds (`SourceError`, exit 2). Each file is a
regular file (`files.open_regular`: a FIFO or device is refused, never blocking).

A record that is not from JSON text (a parquet or `datasets` row) can hold values JSON has no
type for (timestamps, decimals, bytes in a column that is not a medium): in meta they are
stored as strings (`<N bytes>` for bytes). Every record of a .json list, parquet file or
`datasets` folder is also held to the JSONL line's bounds: nested at most 64 deep and at most
1 MiB of text (media bytes and `data:` URIs not counted; those are bounded by the file-size
limit when they are read).

Records are then given a layout and normalised (`layouts.py`); `Source.entries` yields an
`Entry` or a `Rejection` for each, and counts the layouts it detected (`Source.layouts`).
"""

from __future__ import annotations

import datetime
import json
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from loomrl.datasets.files import check_regular, open_regular
from loomrl.datasets.layouts import detect, parse_record
from loomrl.datasets.manifest import (
    MAX_DEPTH,
    MAX_LINE_BYTES,
    Entry,
    LineError,
    ReadOptions,
    Rejection,
    decode_line,
)

SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
MAX_JSON_BYTES = 512 << 20
"""A .json source is loaded whole (Python objects take several times its size): larger ones are refused."""
BATCH_ROWS = 64
"""Rows per record batch read from parquet and `datasets` (rows can hold whole images)."""
NOT_DATA = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"}
SUPPORTED = (
    ".jsonl (one object per line), .json (a list of objects), .parquet, a folder of them (also under "
    "data/), or a Hugging Face datasets folder written by save_to_disk"
)


class SourceError(ValueError):
    """A source that cannot be read as a whole, naming the file: an unsupported kind, a .json
    over its bound or not a list, a parquet file or `datasets` folder its library cannot read."""


@dataclass
class Part:
    """One file or `datasets` folder of a source."""

    kind: str  # "jsonl", "json", "parquet", "datasets"
    path: str
    rows: Optional[int] = None  # known up front: parquet metadata, datasets row counts
    dataset: Union[datasets.Dataset, datasets.DatasetDict, None] = None  # loaded by datasets_part


@dataclass
class Record:
    """One record as read, before its layout: its object, or why it cannot be one."""

    where: str  # file.jsonl:LINE, file.json:[i], file.parquet:row N, FOLDER/split:row N
    default_id: str
    base: str  # the folder its media paths are relative to
    obj: Optional[dict] = None
    error: Optional[LineError] = None
    plain: bool = True  # from JSON text: every value is a JSON value already


@dataclass
class Source:
    """The parts of a source, in reading order, and the layouts its records were read in."""

    parts: list[Part]
    layouts: Counter = field(default_factory=Counter)

    @classmethod
    def from_path(cls, source: str) -> "Source":
        """The parts at `source` (module docstring). FileNotFoundError if there is none,
        NotRegularFile (an OSError naming it) for a FIFO or a device, SourceError for a kind
        that is not read or a file its library refuses."""
        try:
            mode = os.stat(source).st_mode
        except FileNotFoundError:
            raise FileNotFoundError(f"{source}: no such manifest file or folder") from None
        if not stat.S_ISDIR(mode):
            check_regular(source, mode)
            return cls([file_part(source)])
        names = set(os.listdir(source))
        if "dataset_dict.json" in names or {"dataset_info.json", "state.json"} <= names:
            return cls([datasets_part(source)])
        files = data_files(source)
        if not files:
            raise FileNotFoundError(
                f"{source}: folder has no .jsonl, .json or .parquet files (nor under data/) and is no "
                f"datasets folder written by save_to_disk"
            )
        for f in files:
            check_regular(f, os.stat(f).st_mode)
        return cls([file_part(f) for f in files])

    def count_records(self) -> Optional[int]:
        """Records in all parts (a progress bar's total): JSONL lines, parquet and datasets rows;
        None when a .json list is among them (it is not loaded twice)."""
        n = 0
        for part in self.parts:
            if part.kind == "jsonl":
                with open_regular(part.path) as fh:
                    n += sum(1 for _ in fh)
            elif part.rows is None:
                return None
            else:
                n += part.rows
        return n

    def records(self) -> Iterator[Record]:
        for part in self.parts:
            yield from READERS[part.kind](part)

    def entries(self, options: ReadOptions = ReadOptions()) -> Iterator[Union[Entry, Rejection]]:
        """Every record, as an Entry or a Rejection; blank JSONL lines are skipped. The layout is
        `options.layout`, or detected per record (counted in `layouts`). An id claims its first
        record: a later one with the same id is rejected."""
        seen: dict[str, str] = {}
        for rec in self.records():
            item: Union[Entry, Rejection]
            if rec.obj is None:
                assert rec.error is not None
                item = rec.error.rejection(rec.where)
            else:
                layout = options.layout or detect(rec.obj, options)
                self.layouts[layout] += 1
                item = parse_record(rec.obj, rec.where, rec.base, options, rec.default_id, layout=layout)
            if isinstance(item, Entry):
                if not rec.plain:
                    item.meta = json_safe(item.meta)
                if item.id in seen:
                    item = Rejection(
                        item.id, item.where, "duplicate-id", f"id {item.id!r} was already used at {seen[item.id]}"
                    )
                else:
                    seen[item.id] = item.where
            yield item


# --------------------------------------------------------------------------- finding the parts


def file_part(path: str) -> Part:
    """A data file by its suffix; SourceError for another suffix, a .json over its bound, or a
    parquet file whose footer pyarrow cannot read."""
    kind = SUFFIXES.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise SourceError(f"{path}: not a source shards make reads; it reads {SUPPORTED}")
    if kind == "json":
        size = os.stat(path).st_size
        if size > MAX_JSON_BYTES:
            raise SourceError(
                f"{path}: a .json source is loaded whole and this one has {size} bytes, over the limit "
                f"of {MAX_JSON_BYTES}; convert it to JSONL, which is read line by line: "
                f"jq -c '.[]' {os.path.basename(path)} > {os.path.splitext(os.path.basename(path))[0]}.jsonl"
            )
    rows = None
    if kind == "parquet":
        with open_regular(path) as fh:
            try:
                rows = pq.read_metadata(fh).num_rows
            except (pa.ArrowException, OSError) as e:
                raise SourceError(f"{path}: not a parquet file pyarrow can read ({e})") from None
    return Part(kind, path, rows=rows)


def data_files(folder: str) -> list[str]:
    """A folder's data files (by suffix, not hidden, not `datasets` metadata) and those anywhere
    under its data/ folder, in name order of their path in the folder."""
    found = [os.path.join(folder, f) for f in os.listdir(folder)]
    for top, dirs, files in os.walk(os.path.join(folder, "data")):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(top, f) for f in files]
    return sorted(
        f
        for f in found
        if os.path.splitext(f)[1].lower() in SUFFIXES
        and not os.path.basename(f).startswith(".")
        and os.path.basename(f) not in NOT_DATA
        and not os.path.isdir(f)
    )


def datasets_part(folder: str) -> Part:
    """A `save_to_disk` folder, loaded (memory-mapped; nothing is read yet). Its files must be
    regular files; SourceError when `datasets.load_from_disk` refuses it."""
    for top, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(top, f)
            check_regular(path, os.stat(path).st_mode)
    try:
        ds = datasets.load_from_disk(folder)
    except Exception as e:  # FileNotFoundError, a json or Arrow error, a version mismatch, ...
        raise SourceError(
            f"{folder}: not a datasets folder load_from_disk can read ({type(e).__name__}: {e})"
        ) from None
    splits = ds.values() if isinstance(ds, datasets.DatasetDict) else [ds]
    return Part("datasets", folder, rows=sum(d.num_rows for d in splits), dataset=ds)


# --------------------------------------------------------------------------- reading them


def read_jsonl(part: Part) -> Iterator[Record]:
    stem, base = _stem(part.path), os.path.dirname(os.path.abspath(part.path))
    with open_regular(part.path) as fh:  # not a FIFO swapped in since from_path
        for n, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            rec = Record(f"{part.path}:{n}", f"{stem}-{n}", base)
            try:
                rec.obj = decode_line(raw)
            except LineError as e:
                rec.error = e
            yield rec


def read_json(part: Part) -> Iterator[Record]:
    with open_regular(part.path) as fh:
        data = fh.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:  # grew since from_path
        raise SourceError(f"{part.path}: a .json source over the limit of {MAX_JSON_BYTES} bytes; convert it to JSONL")
    try:
        value = json.loads(data)
    except RecursionError:
        raise SourceError(f"{part.path}: JSON nested deeper than Python can read") from None
    except ValueError as e:
        raise SourceError(f"{part.path}: not valid JSON ({e})") from None
    if not isinstance(value, list):
        raise SourceError(
            f"{part.path}: a .json source must hold a list of objects, one per sample, got "
            f"{type(value).__name__}; a .jsonl file holds one object per line"
        )
    base = os.path.dirname(os.path.abspath(part.path))
    yield from rows(value, _stem(part.path), f"{part.path}:[{{}}]", base, plain=True)


def read_parquet(part: Part) -> Iterator[Record]:
    base = os.path.dirname(os.path.abspath(part.path))
    with open_regular(part.path) as fh:
        n = 0
        try:
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=BATCH_ROWS):
                objs = batch.to_pylist()
                yield from rows(objs, _stem(part.path), f"{part.path}:row {{}}", base, start=n)
                n += len(objs)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{part.path}: cannot read the rows from row {n} on ({e})") from None


def read_datasets(part: Part) -> Iterator[Record]:
    ds = part.dataset
    assert ds is not None, "loaded by datasets_part"
    splits = list(ds.items()) if isinstance(ds, datasets.DatasetDict) else [(None, ds)]
    base = os.path.abspath(part.path)
    for split, d in splits:
        name = os.path.join(part.path, split) if split else part.path
        n = 0
        for table in d.with_format("arrow").iter(batch_size=BATCH_ROWS):
            objs = table.to_pylist()
            yield from rows(
                objs, split or os.path.basename(os.path.normpath(part.path)), f"{name}:row {{}}", base, start=n
            )
            n += len(objs)


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def rows(objs: list, stem: str, where: str, base: str, *, start: int = 0, plain: bool = False) -> Iterator[Record]:
    """Records of a list of objects (a .json list, a record batch): `where` formats the index,
    ids default to `<stem>-<index>`; each held to the bounds of a JSONL line (`record_problem`)."""
    for i, obj in enumerate(objs, start):
        rec = Record(where.format(i), f"{stem}-{i}", base, plain=plain)
        problem = record_problem(obj)
        if problem is None:
            rec.obj = obj
        else:
            sid = obj.get("id", rec.default_id) if isinstance(obj, dict) else None
            rec.error = LineError("bad-line", problem, str(sid) if isinstance(sid, (str, int)) else None)
        yield rec


def record_problem(obj: object) -> Optional[str]:
    """Why a record read from a list or a batch cannot be one: not an object, nested deeper than
    MAX_DEPTH, or over MAX_LINE_BYTES characters of text (bytes and `data:` URIs not counted)."""
    if not isinstance(obj, dict):
        return f"a record must be an object, got {type(obj).__name__}"
    deepest, text, stack = 0, 0, [(obj, 1)]
    while stack:  # iterative: no recursion on hostile input
        v, d = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            text += sum(len(k) for k in v if isinstance(k, str))
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, str) and not v[:5].lower() == "data:":
            text += len(v)
    if deepest > MAX_DEPTH:
        return f"record nested deeper than the limit of {MAX_DEPTH}"
    if text > MAX_LINE_BYTES:
        return (
            f"record of {text} characters of text (media bytes and data: URIs not counted) is over the "
            f"limit of {MAX_LINE_BYTES}"
        )
    return None


def json_safe(value: dict) -> dict:
    """`value` with every value JSON has no type for made a string (meta of a parquet or datasets row)."""
    return json.loads(json.dumps(value, default=_plain))


def _plain(o: object) -> object:
    if isinstance(o, (bytes, bytearray, memoryview)):
        return f"<{len(bytes(o))} bytes>"
    if isinstance(o, (datetime.date, datetime.time)):
        return o.isoformat()
    if isinstance(o, datetime.timedelta):
        return o.total_seconds()
    return str(o)  # Decimal, and whatever else a column may hold


READERS = {"jsonl": read_jsonl, "json": read_json, "parquet": read_parquet, "datasets": read_datasets}
