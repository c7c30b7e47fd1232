"""Media as a record gives them: a path, a `file://` URL, a `data:` URI, or bytes in a column.

`resolve(value, field)` turns one medium's value into what the manifest steps check:

- a path (str): as it is; relative to the source's folder, kept inside it (`check_paths`);
- a `file://` URL (`file:///abs/a.png`, `file:rel/a.png`, `file://localhost/...`): its path,
  percent-decoded, then exactly like a path (the same path-outside-source rule);
- a `data:<mime>[;...];base64,<payload>` URI (or a percent-encoded one without `;base64`): an
  `Inline` holding the payload text, decoded only later by `prepare` after its decoded size was
  checked against the file-size limit;
- bytes (a binary column), or a Hugging Face Image / Audio storage struct
  `{"bytes": ..., "path": ...}` (both keys, as `datasets` and verl store it): an `Inline` of the
  bytes when there are any, else its `path` (a path as above);
- a remote URL (`http://`, `s3://`, ...): refused; nothing is downloaded.

`MediaRef(value, field)` is how a layout (`layouts.py`) hands over a medium together with
where it was in the record (`messages[1].content[0].image_url`), so a rejection names that
field. Values of any other type are the caller's to refuse (a `TypeError` here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

_DATA_URI = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
_REMOTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")
_STRUCT_KEYS = {"bytes", "path"}


@dataclass(frozen=True)
class MediaRef:
    """A medium's value as a layout found it, and where: the field named in messages."""

    value: object
    field: str


@dataclass(frozen=True)
class Inline:
    """A medium held in the record itself: `data` (bytes), or `encoded` (a data: URI's payload,
    `base64` true when it is base64, else percent-encoded), decoded by `prepare` under its limits."""

    field: str  # where it was: "'image'", "messages[1].content[0].image"
    what: str  # "inline bytes (path 'cat.png')", "a data:image/png URI"
    data: Optional[bytes] = None
    encoded: Optional[str] = None
    base64: bool = False

    @property
    def name(self) -> str:
        """How messages name it: "field 'image' (inline bytes (path 'cat.png'))"."""
        return f"field {self.field} ({self.what})"


def resolve(value: object, field: str) -> Union[str, Inline]:
    """One medium's value -> a path (str) or an Inline. ValueError (a reason naming `field`) for
    a malformed URI or struct, TypeError for a value of no medium's type."""
    if isinstance(value, MediaRef):
        return resolve(value.value, value.field)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Inline(field, "inline bytes", data=bytes(value))
    if isinstance(value, dict) and set(value) == _STRUCT_KEYS:
        return _struct(value, field)
    if not isinstance(value, str):
        raise TypeError(field)
    head = value[:8].lower()
    if head.startswith("data:"):
        return data_uri(value, field)
    if head.startswith("file:"):
        return file_url_path(value, field)
    if _REMOTE.match(value):
        raise ValueError(
            f"field {field}: {_short(value)} is a remote URL; nothing is downloaded: give a local "
            f"path, a file:// URL or a data: URI"
        )
    return value


def _struct(value: dict, field: str) -> Union[str, Inline]:
    """A `{"bytes", "path"}` struct: its bytes, else its path."""
    data, path = value["bytes"], value["path"]
    if data is not None and not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"field {field}: 'bytes' must be binary data or null, got {type(data).__name__}")
    if path is not None and not isinstance(path, str):
        raise ValueError(f"field {field}: 'path' must be a string or null, got {type(path).__name__}")
    if data is not None:
        return Inline(field, f"inline bytes (path {path!r})" if path else "inline bytes", data=bytes(data))
    if not path:
        raise ValueError(f"field {field}: has neither bytes nor a path")
    return resolve(path, field)


def data_uri(value: str, field: str) -> Inline:
    """A `data:` URI -> an Inline of its (still encoded) payload; ValueError when malformed."""
    m = _DATA_URI.match(value)
    if m is None:
        raise ValueError(f"field {field}: {_short(value)} is not a data: URI (data:<type>;base64,<data>)")
    params = [p.strip().lower() for p in m.group(2).split(";") if p.strip()]
    mime = m.group(1).strip().lower() or "text/plain"
    return Inline(field, f"a data:{mime} URI", encoded=value[m.end() :], base64="base64" in params)


def file_url_path(value: str, field: str) -> str:
    """A `file:` URL -> its local path; ValueError for another host or an empty path."""
    parts = urlsplit(value)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"field {field}: {_short(value)} names the host {parts.netloc!r}; only local files are read")
    if parts.query or parts.fragment:
        raise ValueError(f"field {field}: {_short(value)} has a query or fragment; a file:// URL names a file")
    path = url2pathname(unquote(parts.path)) if parts.path.startswith("/") else unquote(parts.path)
    if not path:
        raise ValueError(f"field {field}: {_short(value)} names no file")
    return path


def decoded_size(inline: Inline) -> int:
    """The number of bytes an Inline decodes to, counted without decoding it: line breaks and
    spaces in a base64 payload and its `=` padding are left out (for a percent-encoded payload,
    its length: an upper bound, percent-decoding only shrinks)."""
    if inline.data is not None:
        return len(inline.data)
    text = inline.encoded or ""
    if not inline.base64:
        return len(text)
    n = len(text) - sum(text.count(c) for c in " \t\r\n")
    pad = len(text.rstrip()) - len(text.rstrip().rstrip("="))
    return (n - min(pad, 2)) * 3 // 4


def _short(value: str) -> str:
    return repr(value if len(value) <= 60 else value[:57] + "...")
