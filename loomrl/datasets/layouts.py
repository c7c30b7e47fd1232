"""Layouts: the record shapes public VQA / RL sets ship in, made into the manifest's own fields.

Every record (a JSONL line, a .json list element, a parquet or `datasets` row; reading them is
`sources.py`) is first given a layout, then normalised into the dict of the documented manifest
fields (`manifest.py`: id, prompt, answer, images, audio, meta) and read by the same
`manifest.parse_fields` as a plain manifest line: the marker, path and limit checks are one code
path for all layouts. A layout is only this dict -> dict step (`NORMALISE`).

Detection is per record, without flags (`detect`); `--format NAME` forces one:

- `vqa`: the documented fields; a record with a string prompt under one of the prompt keys
  (`prompt`, `question`, ... or its `--field`) is always vqa, whatever else it has;
- `llava` (ShareGPT): `conversations` is a list of `{"from": "human"|"user"|"gpt"|"assistant"|
  "system", "value": "<image>\\n..."}`; media under `image` or `images`;
- `chat` (OpenAI / Hugging Face): `messages` is a list of `{"role": "system"|"user"|"assistant",
  "content": str | [parts]}`; parts `{"type": "text", "text"}`, `{"type": "image", "image"}` (or
  `url` / `path`), `{"type": "image_url", "image_url": {"url"}}`, `{"type": "audio", "audio"}`,
  `{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}`, `{"type": "video",
  "video"}` (or `video_url`); an image, audio or video part without a value takes the next medium
  of the record's `images` / `audio` / `videos` list (TRL style);
- `verl`: `prompt` is a list of chat messages, the answer `reward_model.ground_truth`, media
  under `images`; `data_source`, `extra_info` and the rest go to meta;
- `easyr1`: `problem` (with `<image>`), `images`, `answer`.

A record that fits none is read as vqa, so its rejection names the prompt keys looked for.
`--field` mappings apply to the vqa layout only (they name a vqa record's keys).

Conversations (llava, chat, verl): each image / audio part becomes a marker at its place in
the turn's text (parts are joined with nothing between them, as Qwen2-VL's chat template
does) and a medium, in order; a `<image>` / `<audio>` already in a turn's text takes the next
medium of the record's top-level list. The prompt is the last user turn (with its markers),
the answer the assistant turn after it (verl: the ground truth; none: no answer); at most that
one assistant turn may follow the last user turn. The earlier turns (a system turn included)
go to meta as `conversation`, a list of `{"role", "content"}` with their markers in the
content, and their media still go into the sample, before the prompt's (a run renders the
whole conversation: platform/backbone/chat.py). A record with media and no marker anywhere gets them placed before the
text of its first user turn. The earlier turns' markers and media are checked with the
prompt's (`marker-mismatch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Union

from loomrl.datasets.inline import MediaRef
from loomrl.datasets.manifest import (
    _MARKER,
    FIELD_KEYS,
    MARKERS,
    Entry,
    LineError,
    ReadOptions,
    Rejection,
    parse_fields,
)
from loomrl.encoders.base import modalities

LAYOUTS = ("vqa", "llava", "chat", "verl", "easyr1")
LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
CHAT_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}
# content part type -> (kind, keys its value may be under, in order)
PARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "image": ("image", ("image", "url", "path")),
    "image_url": ("image", ("image_url",)),
    "audio": ("audio", ("audio", "url", "path")),
    "input_audio": ("audio", ("input_audio",)),
    "video": ("video", ("video", "url", "path")),
    "video_url": ("video", ("video_url",)),
}


def detect(obj: dict, options: ReadOptions = ReadOptions()) -> str:
    """The layout of one record (module docstring); vqa when none fits."""
    if any(isinstance(obj.get(k), str) for k in dict(options.fields)["prompt"]):
        return "vqa"
    if isinstance(obj.get("conversations"), list):
        return "llava"
    if isinstance(obj.get("messages"), list):
        return "chat"
    if isinstance(obj.get("prompt"), list):
        return "verl"
    if isinstance(obj.get("problem"), str):
        return "easyr1"
    return "vqa"


def parse_record(
    obj: dict, where: str, base: str, options: ReadOptions, default_id: Optional[str] = None, *, layout: str
) -> Union[Entry, Rejection]:
    """A record in `layout` -> Entry or Rejection: normalised (`NORMALISE`), then read as a manifest
    line (`manifest.parse_fields`; layouts other than vqa with the default keys, not `--field`)."""
    if layout == "vqa":
        return parse_fields(obj, where, base, options, default_id)
    try:
        flat, history = NORMALISE[layout](dict(obj), _record_id(obj, default_id))
    except LineError as e:
        return e.rejection(where)
    plain = replace(options, fields=tuple(FIELD_KEYS.items()), explicit=frozenset())
    return parse_fields(flat, where, base, plain, default_id, history=history)


def _record_id(obj: dict, default_id: Optional[str]) -> Optional[str]:
    sid = obj.get("id")
    return str(sid) if isinstance(sid, (str, int)) and not isinstance(sid, bool) else default_id


def _bad(reason: str, sample_id: Optional[str]) -> LineError:
    return LineError("bad-line", reason, sample_id)


# --------------------------------------------------------------------------- conversations


@dataclass
class Talk:
    """A conversation being read: its turns (markers in their text) and its media per kind in
    marker order; `pool` holds the record's top-level media, taken by markers in order."""

    sample_id: Optional[str]
    pool: dict[str, list[MediaRef]]
    turns: list[dict] = field(default_factory=list)
    media: dict[str, list[MediaRef]] = field(default_factory=dict)

    def take(self, kind: str, ref: Optional[MediaRef] = None) -> str:
        """A marker of `kind`: `ref`, or the next top-level medium of that kind, becomes its medium."""
        if ref is None and self.pool[kind]:
            ref = self.pool[kind].pop(0)
        if ref is not None:
            self.media.setdefault(kind, []).append(ref)
        return next(m.marker for m in modalities() if m.name == kind)

    def text(self, text: str) -> str:
        """A text with markers: each takes the next top-level medium of its kind."""
        for marker in _MARKER.findall(text):
            self.take(MARKERS[marker])
        return text

    def flat(self, obj: dict, prompt: str, answer: object) -> dict:
        """The normalised record: the rest of `obj` (ids and meta) with the prompt, answer and media."""
        for kind, left in self.pool.items():  # more media than markers: place_markers counts them
            self.media.setdefault(kind, []).extend(left)
        flat: dict[str, object] = {"prompt": prompt}
        flat.update({m.manifest_keys[0]: self.media.get(m.name, []) for m in modalities()})
        if "id" in obj:
            flat["id"] = obj.pop("id")
        if answer is not None:
            flat["answer"] = answer
        flat["meta"] = _meta(obj, self.sample_id)
        return flat


def _pool(obj: dict, sample_id: Optional[str]) -> dict[str, list[MediaRef]]:
    """The record's top-level media (`images` / `image`, `audio` / `audios`), taken out of `obj`."""
    pool: dict[str, list[MediaRef]] = {}
    for m in modalities():
        present = [k for k in m.manifest_keys if k in obj]
        if len(present) > 1:
            raise _bad(
                f"keys {' and '.join(map(repr, present))} both give the {m.manifest_keys[0]}; keep one", sample_id
            )
        value = obj.pop(present[0]) if present else None
        values = [] if value is None else value if isinstance(value, list) else [value]
        key = present[0] if present else ""
        pool[m.name] = [
            MediaRef(v, f"'{key}'[{i}]" if isinstance(value, list) else f"'{key}'") for i, v in enumerate(values)
        ]
    return pool


def _meta(rest: dict, sample_id: Optional[str]) -> dict:
    """What is left of a record: its `meta` object and its other keys."""
    meta = rest.pop("meta", None) or {}
    if not isinstance(meta, dict):
        raise _bad("field 'meta' must be an object when given", sample_id)
    clash = sorted(set(meta) & set(rest))
    if clash:
        raise _bad(f"key(s) {clash} given both at the top level and in 'meta'", sample_id)
    return {**meta, **rest}


def _value(part: dict, keys: tuple[str, ...]) -> tuple[Optional[str], object]:
    """The first of `keys` with a value (a struct read from parquet has every key, unused ones null)."""
    return next(((k, part[k]) for k in keys if part.get(k) is not None), (None, None))


def _part(talk: Talk, part: object, where: str) -> str:
    """One content part -> its text, or the marker of its medium."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise _bad(f"field '{where}' must be a content part {{\"type\": ..., ...}}", talk.sample_id)
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise _bad(f"field '{where}.text' must be a string", talk.sample_id)
        return talk.text(part["text"])
    if kind not in PARTS:
        raise _bad(
            f"field '{where}.type': {kind!r} is not a content part this reads ({', '.join(['text', *PARTS])})",
            talk.sample_id,
        )
    medium, keys = PARTS[kind]
    key, value = _value(part, keys)
    if key is None:  # {"type": "image"}: the next of the record's `images`
        return talk.take(medium)
    if kind in ("image_url", "video_url"):
        value = value.get("url") if isinstance(value, dict) else value
    elif kind == "input_audio":
        value = _input_audio(value, f"{where}.{key}", talk.sample_id)
    return talk.take(medium, MediaRef(value, f"'{where}.{key}'"))


def _input_audio(value: object, where: str, sample_id: Optional[str]) -> str:
    """OpenAI's {"data": base64, "format": "wav"} -> a data: URI."""
    if not (isinstance(value, dict) and isinstance(value.get("data"), str)):
        raise _bad(f'field \'{where}\' must be {{"data": base64, "format": ...}}', sample_id)
    fmt = value.get("format") or "wav"
    return f"data:audio/{fmt};base64,{value['data']}"


def _turns(talk: Talk, turns: object, name: str, keys: tuple[str, str], roles: dict[str, str]) -> None:
    """Each turn of `turns` (the record's field `name`) into talk.turns: {"role", "content"}."""
    role_key, content_key = keys
    if not isinstance(turns, list) or not turns:
        raise _bad(f"field '{name}' must be a non-empty list of turns", talk.sample_id)
    for i, turn in enumerate(turns):
        where = f"{name}[{i}]"
        if not isinstance(turn, dict):
            raise _bad(f"field '{where}' must be an object with '{role_key}' and '{content_key}'", talk.sample_id)
        said = turn.get(role_key)
        role = roles.get(said) if isinstance(said, str) else None
        if role is None:
            raise _bad(
                f"field '{where}.{role_key}': {said!r} is not one of {', '.join(map(repr, roles))}",
                talk.sample_id,
            )
        content = turn.get(content_key)
        if isinstance(content, str):
            text = talk.text(content)
        elif isinstance(content, list):
            text = "".join(_part(talk, p, f"{where}.{content_key}[{j}]") for j, p in enumerate(content))
        else:
            raise _bad(f"field '{where}.{content_key}' must be a string or a list of content parts", talk.sample_id)
        talk.turns.append({"role": role, "content": text})


def _split(talk: Talk, name: str) -> tuple[list[dict], str, Optional[str]]:
    """(earlier turns, the prompt: the last user turn, the answer: the assistant turn after it)."""
    users = [i for i, t in enumerate(talk.turns) if t["role"] == "user"]
    if not users:
        raise _bad(f"field '{name}' has no user turn: nothing to prompt with", talk.sample_id)
    last = users[-1]
    after = talk.turns[last + 1 :]
    if len(after) > 1 or (after and after[0]["role"] != "assistant"):
        raise _bad(
            f"field '{name}': after the last user turn ({name}[{last}]) come {len(after)} turn(s); "
            f"at most one assistant turn, the answer, may follow it",
            talk.sample_id,
        )
    prompt = talk.turns[last]["content"]
    if not prompt.strip():
        raise _bad(f"field '{name}[{last}]': the last user turn, the prompt, is empty", talk.sample_id)
    answer = after[0]["content"] if after else None
    if answer is not None and _MARKER.search(answer):
        raise _bad(
            f"field '{name}[{last + 1}]': the answer turn holds a medium; only text can be an answer", talk.sample_id
        )
    return talk.turns[:last], prompt, answer


# --------------------------------------------------------------------------- the layouts


def llava(obj: dict, sample_id: Optional[str]) -> tuple[dict, list[dict]]:
    """ShareGPT / LLaVA: `conversations` of {"from", "value"}, media under `image` / `images`."""
    talk = Talk(sample_id, _pool(obj, sample_id))
    _turns(talk, obj.pop("conversations", None), "conversations", ("from", "value"), LLAVA_ROLES)
    history, prompt, answer = _split(talk, "conversations")
    return talk.flat(obj, prompt, answer), history


def chat(obj: dict, sample_id: Optional[str]) -> tuple[dict, list[dict]]:
    """OpenAI / HF chat: `messages` of {"role", "content": str or parts}."""
    talk = Talk(sample_id, _pool(obj, sample_id))
    _turns(talk, obj.pop("messages", None), "messages", ("role", "content"), CHAT_ROLES)
    history, prompt, answer = _split(talk, "messages")
    return talk.flat(obj, prompt, answer), history


def verl(obj: dict, sample_id: Optional[str]) -> tuple[dict, list[dict]]:
    """verl's RL parquet: `prompt` as chat messages, the answer `reward_model.ground_truth`."""
    talk = Talk(sample_id, _pool(obj, sample_id))
    _turns(talk, obj.pop("prompt", None), "prompt", ("role", "content"), CHAT_ROLES)
    history, prompt, answer = _split(talk, "prompt")
    reward = obj.pop("reward_model", None)
    if reward is not None and not isinstance(reward, dict):
        raise _bad("field 'reward_model' must be an object {\"ground_truth\": ..., ...}", sample_id)
    truth = (reward or {}).get("ground_truth")
    if isinstance(truth, bool) or (truth is not None and not isinstance(truth, (str, int, float, list))):
        raise _bad(
            "field 'reward_model.ground_truth' must be a string, a number or a list of strings when given", sample_id
        )
    rest = {k: v for k, v in (reward or {}).items() if k != "ground_truth" and v is not None}
    if rest:
        obj["reward_model"] = rest  # the rest (`style`) goes to meta with data_source, extra_info, ...
    return talk.flat(obj, prompt, truth if truth is not None else answer), history


def easyr1(obj: dict, sample_id: Optional[str]) -> tuple[dict, list[dict]]:
    """EasyR1: `problem` (with `<image>`), `images`, `answer`."""
    problem = obj.pop("problem", None)
    if not isinstance(problem, str) or not problem.strip():
        raise _bad("field 'problem', the prompt, must be a non-empty string", sample_id)
    talk = Talk(sample_id, _pool(obj, sample_id))
    prompt = talk.text(problem)
    return talk.flat(obj, prompt, obj.pop("answer", None)), []


NORMALISE: dict[str, Callable[[dict, Optional[str]], tuple[dict, list[dict]]]] = {
    "llava": llava,
    "chat": chat,
    "verl": verl,
    "easyr1": easyr1,
}
