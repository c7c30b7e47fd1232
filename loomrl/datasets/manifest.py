"""JSONL manifests: the input of `loomrl shards make`.

One sample per line:

    {"id": "cat-001", "prompt": "<image> what animal is this ?", "answer": "a cat",
     "images": ["img/cat.jpg"], "audio": [], "source": "web"}

`id` and `prompt` are required; `answer` is optional; `images` and `audio` are
lists of paths relative to the manifest's folder; every other key (and the
keys of an optional `meta` object) goes to the sample's `meta`. Media follow
the order of the `<image>` / `<audio>` markers in the prompt, so the prompt
must have one marker per medium.

A manifest is a .jsonl file or a folder of them (read in name order). A bad
line becomes a `Rejection`, never an exception: the job goes on.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

from loomrl.datasets.files import check_regular, open_regular

MARKERS = {"<image>": "image", "<audio>": "audio"}
_MARKER = re.compile(r"<image>|<audio>")
MAX_LINE_BYTES = 1 << 20


@dataclass
class Entry:
    """A well-formed manifest line: media paths resolved, in prompt-marker order."""

    id: str
    prompt: str
    answer: Optional[str]
    meta: dict
    media: list[tuple[str, str]]  # (kind, absolute or manifest-relative-resolved path)
    where: str                    # manifest.jsonl:LINE


@dataclass
class Rejection:
    """A sample (or line) left out, and why: reported on stderr and in rejected.jsonl."""

    id: Optional[str]
    where: str            # manifest.jsonl:LINE
    code: str             # short, countable: missing-file, not-an-image, ...
    reason: str           # one readable sentence
    file: Optional[str] = None

    def to_json(self) -> dict:
        return {"id": self.id, "file": self.file, "line": self.where, "code": self.code, "reason": self.reason}


@dataclass
class Manifest:
    """The manifest files of a source, in reading order."""

    files: list[str] = field(default_factory=list)

    @classmethod
    def from_source(cls, source: str) -> "Manifest":
        """A .jsonl file, or a folder whose *.jsonl files are read in name order. Each must be
        a regular file: FileNotFoundError if there is none, NotRegularFile (an OSError naming
        it) for a FIFO, a device or a folder, which would block or never end the job."""
        try:
            mode = os.stat(source).st_mode
        except FileNotFoundError:
            raise FileNotFoundError(f"{source}: no such manifest file or folder") from None
        if not stat.S_ISDIR(mode):
            check_regular(source, mode)
            return cls([source])
        files = sorted(os.path.join(source, f) for f in os.listdir(source) if f.endswith(".jsonl"))
        if not files:
            raise FileNotFoundError(f"{source}: folder has no .jsonl manifests")
        for f in files:
            check_regular(f, os.stat(f).st_mode)
        return cls(files)

    def count_lines(self) -> int:
        """Lines in all files (for a progress bar's total)."""
        n = 0
        for f in self.files:
            with open_regular(f) as fh:
                n += sum(1 for _ in fh)
        return n

    def entries(self) -> Iterator[Union[Entry, Rejection]]:
        """Every line, as an Entry or a Rejection; blank lines are skipped.
        An id claims its first line: a later line with the same id is rejected."""
        seen: dict[str, str] = {}
        for path in self.files:
            with open_regular(path) as fh:  # not a FIFO swapped in since from_source
                for n, raw in enumerate(fh, 1):
                    if not raw.strip():
                        continue
                    item = parse_line(raw, f"{path}:{n}", os.path.dirname(os.path.abspath(path)))
                    if isinstance(item, Entry):
                        if item.id in seen:
                            item = Rejection(item.id, item.where, "duplicate-id",
                                             f"id {item.id!r} was already used at {seen[item.id]}")
                        else:
                            seen[item.id] = item.where
                    yield item


def parse_line(raw: bytes, where: str, base: str) -> Union[Entry, Rejection]:
    """One manifest line -> Entry, or a Rejection naming what is wrong with it."""
    def bad(reason: str, sample_id: Optional[str] = None) -> Rejection:
        return Rejection(sample_id, where, "bad-line", reason)

    if len(raw) > MAX_LINE_BYTES:
        return bad(f"line of {len(raw)} bytes is over the limit of {MAX_LINE_BYTES}")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return bad(f"not valid JSON ({e})")
    if not isinstance(obj, dict):
        return bad(f"a line must be a JSON object, got {type(obj).__name__}")
    sample_id = obj.pop("id", None)
    if isinstance(sample_id, int) and not isinstance(sample_id, bool):
        sample_id = str(sample_id)
    if not isinstance(sample_id, str) or not sample_id.strip():
        return bad("field 'id' must be a non-empty string")
    prompt = obj.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt.strip():
        return bad("field 'prompt' must be a non-empty string", sample_id)
    answer = obj.pop("answer", None)
    if answer is not None and not isinstance(answer, str):
        return bad("field 'answer' must be a string when given", sample_id)
    lists = {}
    for name in ("images", "audio"):
        value = obj.pop(name, [])
        if not (isinstance(value, list) and all(isinstance(p, str) and p for p in value)):
            return bad(f"field '{name}' must be a list of file paths", sample_id)
        lists[name] = value
    meta = obj.pop("meta", {})
    if not isinstance(meta, dict):
        return bad("field 'meta' must be an object when given", sample_id)
    clash = sorted(set(meta) & set(obj))
    if clash:
        return bad(f"key(s) {clash} given both at the top level and in 'meta'", sample_id)
    meta = {**meta, **obj}  # extra keys are metadata

    markers = [MARKERS[m] for m in _MARKER.findall(prompt)]
    counts = {"image": markers.count("image"), "audio": markers.count("audio")}
    if counts["image"] != len(lists["images"]) or counts["audio"] != len(lists["audio"]):
        return Rejection(sample_id, where, "marker-mismatch",
                         f"prompt has {counts['image']} <image> and {counts['audio']} <audio> marker(s) for "
                         f"{len(lists['images'])} image(s) and {len(lists['audio'])} clip(s); put one marker "
                         f"where each medium goes")
    queues = {"image": list(lists["images"]), "audio": list(lists["audio"])}
    media = [(kind, os.path.join(base, queues[kind].pop(0))) for kind in markers]
    return Entry(sample_id, prompt, answer, meta, media, where)
