"""Manifest records: what every input of `loomrl shards make` becomes before it is checked.

One sample per JSONL line (the `vqa` layout), in the field names public VQA /
captioning sets already use:

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
- chosen, rejected: `chosen`, `rejected`; optional: a preference pair (DPO,
  `preference.py`): both non-empty strings that differ, else the line is a
  `bad-pair`; a line with neither is an ordinary sample.
- images: `images` or `image`; audio: `audio` or `audios`. Each a list of
  media or one (null: none). A medium is a path relative to the manifest's
  folder (or absolute), a `file://` URL (its path, under the same rules), a
  `data:<mime>;base64,...` URI, bytes (a binary column) or a Hugging Face
  Image / Audio struct `{"bytes", "path"}` (`inline.resolve`). Inline media
  (`Inline`: bytes, or a URI's payload, decoded by `prepare` only after its
  decoded size passed the file-size limit) never touch the filesystem; a
  rejection of one names the field it came from.

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
`--field` mapping above), `place_markers` and `check_paths` (the last three are
`parse_fields`); a step that refuses the line raises `LineError`, which becomes
its Rejection. Other layouts (llava, chat, verl, easyr1: `layouts.py`) are each
a dict -> dict step before `parse_fields`, so their records meet the same
checks; a multi-turn record also hands over its earlier turns (`history`):
their markers are counted with the prompt's, their media come first, and they
are kept in meta as `conversation`.

Sources (a .jsonl file, a .json list, parquet, a `datasets` folder, or a folder
of data files) are read by `sources.py`. A bad line (bad JSON, over 1 MiB,
nested deeper than 64, a wrong type) becomes a `Rejection`, never an
exception: the job goes on.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Union

from loomrl.datasets.inline import Inline, MediaRef, resolve
from loomrl.datasets.preference import BAD_PAIR, PAIR_FIELDS, line_pair
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
    **{name: (name,) for name in PAIR_FIELDS},  # a preference pair (DPO): `chosen`, `rejected`
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
    layout: Optional[str] = None
    """The layout every record is read in (`--format`); None: detected per record (layouts.py)."""

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


@dataclass(frozen=True)
class MediaItem:
    """One medium of an Entry: a file (`path`, joined to the source's folder) or bytes held in the
    record itself (`inline`: bytes, or a data: URI's payload that `prepare` decodes under its limits)."""

    kind: str  # "image", "audio"
    path: Optional[str] = None
    inline: Optional[Inline] = None

    @property
    def name(self) -> str:
        """How messages name it: the path, or the inline medium's field."""
        return self.inline.name if self.inline is not None else self.path or ""


@dataclass
class Entry:
    """A well-formed record: media resolved, in marker order (earlier turns' first, then the prompt's)."""

    id: str
    prompt: str
    answer: Optional[str]
    meta: dict
    media: list[MediaItem]
    where: str  # manifest.jsonl:LINE, data.parquet:row 7, ...
    markers_placed: bool = False  # the text had no marker: they were put before the (first user turn's) text
    pair: Optional[tuple[str, str]] = None  # (chosen, rejected): a preference pair (DPO)


@dataclass
class Rejection:
    """A sample (or line) left out, and why: reported on stderr and in the split's rejection list."""

    id: Optional[str]
    where: str  # manifest.jsonl:LINE
    code: str  # short, countable: missing-file, not-an-image, ...
    reason: str  # one readable sentence
    file: Optional[str] = None

    def to_json(self) -> dict:
        return {"id": self.id, "file": self.file, "line": self.where, "code": self.code, "reason": self.reason}


def outside(path: str, base: str) -> Optional[str]:
    """The real path of `path` (relative to `base`) when it is outside base's real folder, else None."""
    real = os.path.realpath(os.path.join(base, path))
    root = os.path.realpath(base)
    return None if os.path.commonpath([root, real]) == root else real


def json_depth(value: object) -> int:
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
    media: dict[
        str, list[Union[str, Inline]]
    ]  # kind -> paths as given (relative to the source's folder, or absolute), or inline
    meta: dict
    history: list[dict] = field(default_factory=list)  # earlier turns {"role", "content"} of a multi-turn record
    pair: Optional[tuple[str, str]] = None  # (chosen, rejected) of a preference pair


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
    kinds: list[str]  # the medium kind of each marker, in order (earlier turns', then the prompt's)
    placed: bool
    history: list[dict] = field(default_factory=list)  # the earlier turns, markers placed in the first user turn


def parse_line(
    raw: bytes, where: str, base: str, options: ReadOptions = ReadOptions(), default_id: Optional[str] = None
) -> Union[Entry, Rejection]:
    """One manifest line (the documented fields above) -> Entry, or a Rejection naming what is
    wrong with it. `base` is the manifest's folder; `default_id` the id of a line without one (None:
    the id is required). The steps: `decode_line` (bytes -> dict), then `parse_fields`."""
    try:
        obj = decode_line(raw)
    except LineError as e:
        return e.rejection(where)
    return parse_fields(obj, where, base, options, default_id)


def parse_fields(
    obj: dict,
    where: str,
    base: str,
    options: ReadOptions = ReadOptions(),
    default_id: Optional[str] = None,
    *,
    history: Optional[list[dict]] = None,
) -> Union[Entry, Rejection]:
    """A record's object in the documented fields (a line's, or what a layout made of its record)
    -> Entry or Rejection: `map_fields` (the keys and `--field` mapping), `place_markers` (markers
    against media, over `history`, the earlier turns of a multi-turn record, and the prompt),
    `check_paths`. The earlier turns are kept in meta as `conversation`."""
    try:
        fields = map_fields(obj, options, default_id)
        if history:
            if "conversation" in fields.meta:
                raise _bad(
                    "key 'conversation' is where the earlier turns of a multi-turn record are kept; rename it",
                    fields.id,
                )
            fields.history = history
        markers = place_markers(fields, options)
        check_paths(fields, base, options)
    except LineError as e:
        return e.rejection(where)
    meta = {**fields.meta, "conversation": markers.history} if markers.history else fields.meta
    return Entry(
        fields.id,
        markers.prompt,
        fields.answer,
        meta,
        media_in_marker_order(fields, markers, base),
        where,
        markers_placed=markers.placed,
        pair=fields.pair,
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
    if json_depth(obj) > MAX_DEPTH:
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
    media = {m.name: _media(picked, m.manifest_keys[0], sample_id) for m in modalities()}
    pair = _pair(picked, sample_id)
    meta = _meta(obj, answer, picked, sample_id)
    return Fields(sample_id, prompt, answer.text, media, meta, pair=pair)


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


def _pair(picked: Picked, sample_id: str) -> Optional[tuple[str, str]]:
    """(chosen, rejected) of a line holding a preference pair, None of a line with neither; a
    `bad-pair` LineError for half a pair, an empty or non-string answer, or two equal answers."""
    chosen, rejected = picked.get("chosen"), picked.get("rejected")
    problem = line_pair(chosen, rejected)
    if problem is not None:
        raise LineError(BAD_PAIR, problem, sample_id)
    if chosen is None:
        return None
    assert isinstance(chosen, str) and isinstance(rejected, str)
    return chosen, rejected


def _media(picked: Picked, name: str, sample_id: str) -> list[Union[str, Inline]]:
    """A media field's media: a list of them, one, or null (none). Each a path, a file:// URL (its
    path), a data: URI, bytes or a {"bytes", "path"} struct (inline.resolve)."""
    value = picked.get(name)
    values = [] if value is None else value if isinstance(value, list) else [value]
    key = picked.keys.get(name, name)
    media: list[Union[str, Inline]] = []
    for i, v in enumerate(values):
        try:
            item: Union[str, Inline, None] = resolve(v, f"'{key}'[{i}]" if isinstance(value, list) else f"'{key}'")
        except TypeError:
            item = None
        except ValueError as e:
            raise _bad(str(e), sample_id) from None
        if not item and isinstance(v, MediaRef):  # a layout's medium: named by its own field
            raise _bad(
                f"field {v.field} must be a path, a file:// URL, a data: URI, bytes or "
                f'{{"bytes", "path"}}, got {type(v.value).__name__}',
                sample_id,
            )
        if not item:
            raise _bad(f"field {picked.named(name)} must be a file path or a list of file paths", sample_id)
        media.append(item)
    if any(isinstance(p, str) and "\0" in p for p in media):  # no file has such a name; os calls raise ValueError
        raise _bad(f"field {picked.named(name)}: a file path cannot contain a NUL character", sample_id)
    return media


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
    """Step 3: the markers of the earlier turns and the prompt against the media lists; a record
    with media and no marker at all gets them placed before the text of its first user turn (the
    prompt, for a single turn) unless `require_markers`. A marker-mismatch LineError otherwise."""
    what = "conversation" if fields.history else "prompt"
    texts = [t["content"] for t in fields.history] + [fields.prompt]
    kinds = [MARKERS[m] for text in texts for m in _MARKER.findall(text)]
    mods = modalities()
    have = " and ".join(f"{len(fields.media[m.name])} {m.noun}(s)" for m in mods)  # "2 image(s) and 0 clip(s)"
    placed = not kinds and any(fields.media.values())
    if placed and options.require_markers:
        raise LineError(
            "marker-mismatch",
            f"{what} has no {' or '.join(MARKERS)} marker for {have}, and --require-markers is on; put "
            f"one marker where each medium goes, or leave out --require-markers to have them placed "
            f"before the text",
            fields.id,
        )
    prompt, history = fields.prompt, fields.history
    if placed:
        kinds = [m.name for m in mods for _ in fields.media[m.name]]
        marks = "".join(m.marker * len(fields.media[m.name]) for m in mods)
        first = next((i for i, t in enumerate(history) if t["role"] == "user"), None)
        if first is None:
            prompt = marks + prompt
        else:
            history = [dict(t, content=marks + t["content"]) if i == first else t for i, t in enumerate(history)]
    if any(kinds.count(m.name) != len(fields.media[m.name]) for m in mods):
        markers = " and ".join(f"{kinds.count(m.name)} {m.marker}" for m in mods)
        raise LineError(
            "marker-mismatch",
            f"{what} has {markers} marker(s) for {have}; put one marker where each medium goes "
            f"(or none at all, to have them placed before the text)",
            fields.id,
        )
    return Markers(prompt, kinds, placed, history)


def check_paths(fields: Fields, base: str, options: ReadOptions) -> None:
    """Step 4: every medium inside the manifest's folder `base` (unless `allow_outside`); a
    path-outside-source LineError naming the first that is not. No file is opened."""
    if options.allow_outside:
        return
    for path in (p for paths in fields.media.values() for p in paths if isinstance(p, str)):
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


def media_in_marker_order(fields: Fields, markers: Markers, base: str) -> list[MediaItem]:
    """A MediaItem for each marker: images and clips in list order, each at its marker; a path is
    joined to `base`, inline bytes stay as they are."""
    taken = {kind: 0 for kind in fields.media}
    items = []
    for kind in markers.kinds:
        medium = fields.media[kind][taken[kind]]
        taken[kind] += 1
        if isinstance(medium, str):
            items.append(MediaItem(kind, path=os.path.join(base, medium)))
        else:
            items.append(MediaItem(kind, inline=medium))
    return items
