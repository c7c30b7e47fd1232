"""A safetensors file's header, read and checked against the file before any tensor is.

A checkpoint folder (`model.init_from`) is outside input: its weight files may be truncated,
damaged or hostile. The safetensors library trusts the first 8 bytes (the header length) and
the offsets the header gives, so a header length of 2^60, a garbage header or an offset past the
end is a library error (or a huge allocation) deep in a load. Here a file is opened as a regular
file only (`datasets.files.open_regular`: a FIFO named `model.safetensors` is refused, not waited
on), the header length is bounded (HEADER_LIMIT and the file's size), the header is parsed as
JSON, and every tensor's dtype, shape and offsets are checked: offsets within the data, the
byte count equal to shape x dtype size, no two tensors overlapping. What comes back is every
tensor's (dtype, shape), so callers compare names and shapes with what a config implies before
building anything. Every fault is a `WeightsError` (a ValueError) naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from loomrl.datasets.files import open_regular

HEADER_LIMIT = 100 << 20
"""The largest JSON header read (safetensors itself caps it at 100 MB)."""
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class WeightsError(ValueError):
    """A weight file that cannot be what it claims; the message names the file."""


def _cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sizes(v) -> bool:
    """A JSON list of integers >= 0."""
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def _tensor(name: str, info, size: int, file: Path) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, start, end) of one header entry, checked against the data's `size` bytes."""
    if not isinstance(info, dict):
        raise WeightsError(f"{file}: tensor {_cut(name)!r}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise WeightsError(f"{file}: tensor {_cut(name)!r}: dtype {_cut(repr(dtype), 40)} is not a safetensors dtype")
    if not _sizes(shape) or len(shape) > 16:
        raise WeightsError(f"{file}: tensor {_cut(name)!r}: shape {_cut(repr(shape), 60)} is not a list of sizes")
    if not _sizes(offsets) or len(offsets) != 2 or not offsets[0] <= offsets[1] <= size:
        raise WeightsError(
            f"{file}: tensor {_cut(name)!r}: data_offsets {_cut(repr(offsets), 60)} lie outside the "
            f"file's {size} data bytes (truncated or damaged)"
        )
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise WeightsError(
            f"{file}: tensor {_cut(name)!r}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype} "
            f"({nbytes} bytes)"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def read_header(file: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of a safetensors file, every entry checked against the file
    (see the module's docstring); a WeightsError naming the file otherwise. Reads the header
    only: at most HEADER_LIMIT bytes, whatever the file claims."""
    file = Path(file)
    try:
        with open_regular(str(file)) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise WeightsError(f"{file}: {size} bytes, shorter than a safetensors header (truncated)")
            (n,) = struct.unpack("<Q", head)
            if n > HEADER_LIMIT or n > size - 8:
                raise WeightsError(
                    f"{file}: header length {n} is past {'the 100 MB limit' if n > HEADER_LIMIT else 'the end'} "
                    f"of a {size}-byte file (truncated or not safetensors)"
                )
            raw = fh.read(n)
    except OSError as e:
        raise WeightsError(f"{file}: cannot read it: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deeply
        raise WeightsError(f"{file}: the header is not JSON (damaged or not safetensors): {_cut(str(e))}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{file}: the header is not a JSON object (damaged or not safetensors)")
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, start, end = _tensor(name, info, size - 8 - n, file)
        out[name] = (dtype, shape)
        spans.append((start, end, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise WeightsError(f"{file}: tensors {_cut(a)!r} and {_cut(b)!r} overlap (damaged)")
    return out
