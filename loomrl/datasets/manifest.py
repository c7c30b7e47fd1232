"""JSONL manifests: the input of `loomrl shards make`.

One sample per line, in the field names public VQA / captioning sets already use:

    {"id": "cat-001", "prompt": "<image> what animal is this ?", "answer": "a cat",
     "images": ["img/cat.jpg"], "audio": [], "source": "web"}
    {"question": "what animal is this ?", "image": "img/cat.jpg", "answer": 1}

Fields (`FIELD_KEYS`: the keys each is read from, the first one present wins;
two of one field's keys in one line are a `bad-line`, naming both):

- id: `id` (a string or a whole number). Optional: a line without one gets
  `<manifest file stem>-<line number>`; an id (given or made) claims its
  first line, a later line with the same id is a `duplicate-id`.
- prompt: `prompt`, `question`, `query` or `instruction`; a non-empty string.
- answer: `answer`; optional; a string, a number (stored as its string) or a
  non-empty list of strings (the first is the answer, the whole list goes to
  meta as `answers`; a list of 4 numbers is a box, stored as the string `[x1, y1, x2, y2]`).
- images: `images` or `image`; audio: `audio` or `audios`. Each a list of
  paths or one path string (null: none), relative to the manifest's folder.

`--field NAME=KEY` (`ReadOptions.with_fields`) reads a field from KEY only;
that key is then no other field's. Every other key (and the keys of an
optional `meta` object) goes to the sample's `meta`.

Markers: media go where the prompt's `<image>` / `<audio>` markers are, one
marker per medium (a count that does not match is a `marker-mismatch`). A
prompt with media and no marker at all gets them placed before its text, in
manifest order (images in list order, then clips), with no separator, as
Qwen2-VL's chat template puts the vision tokens before the question:
"<image><image>" + text (`Entry.markers_placed`); `require_markers` refuses
such a line instead.

Paths: a medium whose real path (`os.path.realpath`: symlinks, `..` and
absolute paths resolved) is outside the real folder of its manifest is a
`path-outside-source` rejection, decided here, before any file is opened;
`allow_outside` (only for trusted manifests) lets it through. This checks what
the manifest names when its line is read; it is not a guard against files
being swapped inside the folder while the job runs.

A line is read in four steps (`parse_line`), each a function of named data:
`decode_line` (bytes -> dict), `map_fields` (dict -> `Fields`: the keys and
`--field` mapping above), `place_markers` and `check_paths`; a step that
refuses the line raises `LineError`, which becomes its Rejection. Another input
layout needs only its own dict -> `Fields` step.

A manifest is a .jsonl file or a folder of them (read in name order). A bad
line (bad JSON, over 1 MiB, nested deeper than 64, a wrong type) becomes a
`Rejection`, never an exception: the job goes on.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

from loomrl.datasets.files import check_regular, open_regular
from loomrl.encoders.base import modalities

MARKERS = {m.marker: m.name for m in modalities()}  # "<image>" -> "image", "<audio>" -> "audio"
_MARKER = re.compile("|".join(map(re.escape, MARKERS)))
MAX_LINE_BYTES = 1 << 20
MAX_DEPTH = 64  # nesting of a line's JSON: deeper would make json.dumps of the header recurse too far

# Field -> the keys it is read from, in order; `--field NAME=KEY` replaces one list.
FIELD_KEYS: dict[str, tuple[str, ...]] = {
    "id": ("id",),
    "prompt": ("prompt", "question", "query", "instruction"),
    "answer": ("answer",),
    # each modality's list: "images" from `images` or `image`, "audio" from `audio` or `audios`
    **{m.manifest_keys[0]: m.manifest_keys for m in modalities()},
}


@dataclass(frozen=True)
class ReadOptions:
    """How manifest lines are read: which keys give which field, and the two strict/lax switches."""

    fields: tuple[tuple[str, tuple[str, ...]], ...] = tuple(FIELD_KEYS.items())
    """(field, keys it is read from) for each of FIELD_KEYS' fields."""
    explicit: frozenset = frozenset()
    """Fields given by `--field` (named so in messages)."""
    require_markers: bool = False
    """A prompt with media but no marker is a `marker-mismatch` instead of getting markers placed."""
    allow_outside: bool = False
    """Media paths may resolve outside the manifest's folder (trusted manifests only)."""

    @classmethod
    def with_fields(cls, mapping: dict[str, str], **switches) -> "ReadOptions":
        """Options where each `mapping` field (NAME -> KEY, as `--field NAME=KEY`) is read from
        KEY only, and KEY is no other field's. ValueError naming the bad NAME or KEY."""
        for name, key in mapping.items():
            if name not in FIELD_KEYS:
                raise ValueError(f"unknown field {name!r} (want one of {', '.join(FIELD_KEYS)})")
            if not isinstance(key, str) or not key:
                raise ValueError(f"field {name!r}: the key must be a non-empty name")
            if key == "meta":
                raise ValueError(f"field {name!r}: 'meta' is the metadata object, not a field's key")
        keys = list(mapping.values())
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"key(s) {twice} mapped to more than one field")
        claimed = set(keys)
        fields = tuple(
            (name, (mapping[name],) if name in mapping else tuple(k for k in default if k not in claimed))
            for name, default in FIELD_KEYS.items()
        )
        return cls(fields=fields, explicit=frozenset(mapping), **switches)


@dataclass
class Entry:
    """A well-formed manifest line: media paths resolved, in prompt-marker order."""

    id: str
    prompt: str
    answer: Optional[str]
    meta: dict
    media: list[tuple[str, str]]  # (kind, absolute or manifest-relative-resolved path)
    where: str  # manifest.jsonl:LINE
    markers_placed: bool = False  # the prompt had no marker: they were put before its text


@dataclass
class Rejection:
    """A sample (or line) left out, and why: reported on stderr and in rejected.jsonl."""

    id: Optional[str]
    where: str  # manifest.jsonl:LINE
    code: str  # short, countable: missing-file, not-an-image, ...
    reason: str  # one readable sentence
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

    def entries(self, options: ReadOptions = ReadOptions()) -> Iterator[Union[Entry, Rejection]]:
        """Every line, as an Entry or a Rejection; blank lines are skipped.
        An id claims its first line: a later line with the same id is rejected."""
        seen: dict[str, str] = {}
        for path in self.files:
            stem = os.path.splitext(os.path.basename(path))[0]
            with open_regular(path) as fh:  # not a FIFO swapped in since from_source
                for n, raw in enumerate(fh, 1):
                    if not raw.strip():
                        continue
                    item = parse_line(
                        raw, f"{path}:{n}", os.path.dirname(os.path.abspath(path)), options, default_id=f"{stem}-{n}"
                    )
                    if isinstance(item, Entry):
                        if item.id in seen:
                            item = Rejection(
                                item.id,
                                item.where,
                                "duplicate-id",
                                f"id {item.id!r} was already used at {seen[item.id]}",
                            )
                        else:
                            seen[item.id] = item.where
                    yield item


def outside(path: str, base: str) -> Optional[str]:
    """The real path of `path` (relative to `base`) when it is outside base's real folder, else None."""
    real = os.path.realpath(os.path.join(base, path))
    root = os.path.realpath(base)
    return None if os.path.commonpath([root, real]) == root else real


def _depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


# --------------------------------------------------------------------------- one line, in four steps


class LineError(Exception):
    """A line that cannot be a sample, raised by a step of `parse_line`: the Rejection's code,
    reason, id and file; `parse_line` adds where the line is."""

    def __init__(self, code: str, reason: str, sample_id: Optional[str] = None, file: Optional[str] = None):
        super().__init__(reason)
        self.code, self.reason, self.sample_id, self.file = code, reason, sample_id, file

    def rejection(self, where: str) -> Rejection:
        return Rejection(self.sample_id, where, self.code, self.reason, file=self.file)


def _bad(reason: str, sample_id: Optional[str] = None) -> LineError:
    return LineError("bad-line", reason, sample_id)


@dataclass
class Fields:
    """A line's fields, whatever keys or layout they came from: what the marker and path steps check."""

    id: str
    prompt: str
    answer: Optional[str]
    media: dict[str, list[str]]  # kind -> paths as the manifest gives them (relative to its folder, or absolute)
    meta: dict


@dataclass
class Picked:
    """The fields a line has, each taken from the one key of its list that is present."""

    values: dict[str, object]  # field -> its value
    keys: dict[str, str]  # field -> the key it was read from
    options: ReadOptions

    def get(self, name: str) -> object:
        return self.values.get(name)

    def id_so_far(self, default_id: Optional[str]) -> Optional[str]:
        """The line's id for a message while its fields are picked ("id" is picked first)."""
        sid = self.get("id")
        return str(sid) if isinstance(sid, (str, int)) and not isinstance(sid, bool) else default_id

    def named(self, name: str) -> str:
        """How a field is named in a message: its key, and the --field that chose it."""
        key = self.keys[name] if name in self.keys else "' or '".join(dict(self.options.fields)[name]) or name
        return f"'{key}' (--field {name})" if name in self.options.explicit else f"'{key}'"


@dataclass
class Answer:
    """The answer as stored (a string, or None), and the whole list when the line gave a list of strings."""

    text: Optional[str]
    answers: Optional[list[str]] = None  # kept in meta as `answers`


@dataclass
class Markers:
    """The prompt's media markers, in prompt order; placed before the text when it had none."""

    prompt: str
    kinds: list[str]  # the medium kind of each marker, in prompt order
    placed: bool


def parse_line(
    raw: bytes, where: str, base: str, options: ReadOptions = ReadOptions(), default_id: Optional[str] = None
) -> Union[Entry, Rejection]:
    """One manifest line -> Entry, or a Rejection naming what is wrong with it. `base` is the
    manifest's folder; `default_id` the id of a line without one (None: the id is required).
    The steps: `decode_line` (bytes -> dict), `map_fields` (dict -> Fields: the keys and
    `--field` mapping), `place_markers` (markers against media), `check_paths`."""
    try:
        fields = map_fields(decode_line(raw), options, default_id)
        markers = place_markers(fields, options)
        check_paths(fields, base, options)
    except LineError as e:
        return e.rejection(where)
    return Entry(
        fields.id,
        markers.prompt,
        fields.answer,
        fields.meta,
        media_in_marker_order(fields, markers, base),
        where,
        markers_placed=markers.placed,
    )


def decode_line(raw: bytes) -> dict:
    """Step 1: a line -> its JSON object. A bad-line LineError when it is over MAX_LINE_BYTES, not
    JSON, not an object, or nested deeper than MAX_DEPTH."""
    if len(raw) > MAX_LINE_BYTES:
        raise _bad(f"line of {len(raw)} bytes is over the limit of {MAX_LINE_BYTES}")
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise _bad(f"JSON nested deeper than the limit of {MAX_DEPTH}") from None
    except ValueError as e:  # bad JSON, bad UTF-8, an integer of over 4300 digits
        raise _bad(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _bad(f"a line must be a JSON object, got {type(obj).__name__}")
    if _depth(obj) > MAX_DEPTH:
        raise _bad(f"JSON nested deeper than the limit of {MAX_DEPTH}")
    return obj


def map_fields(obj: dict, options: ReadOptions, default_id: Optional[str] = None) -> Fields:
    """Step 2: a line's object -> its Fields, each read from its keys (`options`); every other key
    (and those of a `meta` object) goes to meta. Takes the fields' keys out of `obj`. A bad-line
    LineError for an ambiguous key or a value of the wrong type."""
    picked = pick_fields(obj, options, default_id)
    sample_id = _sample_id(picked, default_id)
    prompt = picked.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        what = "must be a non-empty string" if "prompt" in picked.values else "is missing"
        raise _bad(f"the prompt, field {picked.named('prompt')}, {what}", sample_id)
    answer = _answer(picked, sample_id)
    media = {m.name: _paths(picked, m.manifest_keys[0], sample_id) for m in modalities()}
    meta = _meta(obj, answer, picked, sample_id)
    return Fields(sample_id, prompt, answer.text, media, meta)


def pick_fields(obj: dict, options: ReadOptions, default_id: Optional[str] = None) -> Picked:
    """Each field from its one key present, taken out of `obj`; two present keys of one field are
    ambiguous: a bad-line naming both."""
    picked = Picked({}, {}, options)
    for name, keys in options.fields:
        present = [k for k in keys if k in obj]
        if len(present) > 1:
            raise _bad(
                f"keys {' and '.join(repr(k) for k in present)} both give the {name}; keep one, "
                f"or choose with --field {name}=KEY",
                picked.id_so_far(default_id),
            )
        if present:
            picked.keys[name] = present[0]
            picked.values[name] = obj.pop(present[0])
        elif name in options.explicit:  # the user said where this field is: a line without it is wrong
            reason = f"--field {name}={keys[0]}: the line has no {keys[0]!r} key"
            raise LineError("missing-field", reason, picked.id_so_far(default_id))
    return picked


def _sample_id(picked: Picked, default_id: Optional[str]) -> str:
    sample_id = picked.get("id")
    if isinstance(sample_id, int) and not isinstance(sample_id, bool):
        sample_id = str(sample_id)
    if "id" not in picked.values and default_id is not None:
        sample_id = default_id
    if not isinstance(sample_id, str) or not sample_id.strip():
        raise _bad(f"field {picked.named('id')} must be a non-empty string or a whole number")
    return sample_id


def _answer(picked: Picked, sample_id: str) -> Answer:
    answer = picked.get("answer")
    if (
        isinstance(answer, list)
        and len(answer) == 4
        and all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in answer)
    ):
        return Answer(json.dumps(answer))  # a grounding box [x1, y1, x2, y2] (the `iou` reward reads it)
    if isinstance(answer, list):
        if not answer or not all(isinstance(a, str) for a in answer):
            raise _bad(f"field {picked.named('answer')} must be a non-empty list of strings when a list", sample_id)
        return Answer(answer[0], answers=answer)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        if not math.isfinite(answer):
            raise _bad(f"field {picked.named('answer')} must be a finite number when a number", sample_id)
        return Answer(str(answer))
    if answer is not None and not isinstance(answer, str):
        raise _bad(
            f"field {picked.named('answer')} must be a string, a number or a list of strings when given", sample_id
        )
    return Answer(answer)


def _paths(picked: Picked, name: str, sample_id: str) -> list[str]:
    """A media field's paths: a list of them, one path string, or null (none)."""
    value = picked.get(name)
    if value is None:
        value = []
    elif isinstance(value, str):
        value = [value]
    if not (isinstance(value, list) and all(isinstance(p, str) and p for p in value)):
        raise _bad(f"field {picked.named(name)} must be a file path or a list of file paths", sample_id)
    if any("\0" in p for p in value):  # no file has such a name; os calls raise ValueError on it
        raise _bad(f"field {picked.named(name)}: a file path cannot contain a NUL character", sample_id)
    return value


def _meta(rest: dict, answer: Answer, picked: Picked, sample_id: str) -> dict:
    """The line's `meta` object and its other keys (`rest`), with a list answer's `answers`."""
    meta = rest.pop("meta", {})
    if not isinstance(meta, dict):
        raise _bad("field 'meta' must be an object when given", sample_id)
    if answer.answers is not None:
        if "answers" in rest or "answers" in meta:
            raise _bad(
                f"field {picked.named('answer')} is a list, kept in meta as 'answers', but the line "
                f"already has an 'answers' key",
                sample_id,
            )
        rest["answers"] = answer.answers
    clash = sorted(set(meta) & set(rest))
    if clash:
        raise _bad(f"key(s) {clash} given both at the top level and in 'meta'", sample_id)
    return {**meta, **rest}  # extra keys are metadata


def place_markers(fields: Fields, options: ReadOptions) -> Markers:
    """Step 3: the prompt's markers against the media lists; a prompt with media and no marker gets
    them placed before its text (unless `require_markers`). A marker-mismatch LineError otherwise."""
    kinds = [MARKERS[m] for m in _MARKER.findall(fields.prompt)]
    mods = modalities()
    have = " and ".join(f"{len(fields.media[m.name])} {m.noun}(s)" for m in mods)  # "2 image(s) and 0 clip(s)"
    placed = not kinds and any(fields.media.values())
    if placed and options.require_markers:
        raise LineError(
            "marker-mismatch",
            f"prompt has no {' or '.join(MARKERS)} marker for {have}, and --require-markers is on; put "
            f"one marker where each medium goes, or leave out --require-markers to have them placed "
            f"before the text",
            fields.id,
        )
    if not placed:
        prompt = fields.prompt
    else:
        kinds = [m.name for m in mods for _ in fields.media[m.name]]
        prompt = "".join(m.marker * len(fields.media[m.name]) for m in mods) + fields.prompt
    if any(kinds.count(m.name) != len(fields.media[m.name]) for m in mods):
        markers = " and ".join(f"{kinds.count(m.name)} {m.marker}" for m in mods)
        raise LineError(
            "marker-mismatch",
            f"prompt has {markers} marker(s) for {have}; put one marker where each medium goes "
            f"(or none at all, to have them placed before the text)",
            fields.id,
        )
    return Markers(prompt, kinds, placed)


def check_paths(fields: Fields, base: str, options: ReadOptions) -> None:
    """Step 4: every medium inside the manifest's folder `base` (unless `allow_outside`); a
    path-outside-source LineError naming the first that is not. No file is opened."""
    if options.allow_outside:
        return
    for path in (p for paths in fields.media.values() for p in paths):
        real = outside(path, base)
        if real is not None:
            raise LineError(
                "path-outside-source",
                f"{path!r} resolves to {real}, outside the manifest's folder "
                f"{os.path.realpath(base)}; --allow-outside allows it (trusted manifests "
                f"only)",
                fields.id,
                file=os.path.join(base, path),
            )


def media_in_marker_order(fields: Fields, markers: Markers, base: str) -> list[tuple[str, str]]:
    """(kind, path joined to `base`) for each marker: images and clips in list order, each at its marker."""
    queues = {kind: list(paths) for kind, paths in fields.media.items()}
    return [(kind, os.path.join(base, queues[kind].pop(0))) for kind in markers.kinds]
