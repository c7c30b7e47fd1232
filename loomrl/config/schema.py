"""Typed configuration from YAML: the core every part's config is built with.

A part declares its settings as a dataclass beside its code; each field is documented by the
string under it and each number has its range (`ranged`). `build` maps a parsed YAML mapping onto
such a dataclass, refusing (RecipeError, naming the key path) an unknown key, a wrong type, a
number outside its range, NaN or infinity, a value outside a Literal's set, and YAML alias bombs;
`apply_override` applies a `key.path=value` from the command line; `field_docs` lists every key
with its type, default and documentation (`loomrl recipe`). Imports nothing else from loomrl."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the key path or file."""


# --------------------------------------------------------------------------- ranges


SEED_MAX = 2**31 - 1
"""Seeds are 31-bit: torch, numpy and vLLM all take them (a rank's offset included)."""
INT_MAX = 2**63 - 1
"""Every integer field fits in 64 bits (torch and the C libraries take them)."""


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts. Beyond it, NaN and infinities are never accepted,
    and an integer must fit in 64 bits."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, v: float) -> bool:
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def __str__(self) -> str:
        lo, hi = _num(self.low), _num(self.high)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {lo}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {hi}"
        return ""


def _num(x: Optional[float]) -> str:
    return str(int(x)) if isinstance(x, int) or (x is not None and float(x).is_integer()) else repr(x)


def ranged(
    default: Any,
    *,
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    le: Optional[float] = None,
    lt: Optional[float] = None,
) -> Any:
    """A numeric field: its default and its range (ge/gt: >= / > low, le/lt: <= / < high; none:
    any finite number). Checked when a recipe is loaded, shown by `loomrl recipe`."""
    rng = Range(gt if gt is not None else ge, lt if lt is not None else le, gt is not None, lt is not None)
    if isinstance(default, list):  # a list of numbers: each item in the range
        return field(default_factory=lambda: list(default), metadata={"range": rng})
    return field(default=default, metadata={"range": rng})


def choice(registry: Any, default: str) -> Any:
    """A field naming a registered part (a rollout engine, a training engine, an algorithm): its
    value must be one of `registry.names()`, read when a recipe is checked, so a part that
    registers itself in its own module is accepted without editing the config; `loomrl recipe`
    lists the names."""
    return field(default=default, metadata={"choices": registry})


def check_choice(value: Any, f: dataclasses.Field, path: str) -> None:
    """A `choice` field's value is a registered name (the same message as a Literal's)."""
    registry = f.metadata.get("choices")
    if registry is not None and value not in registry.names():
        raise RecipeError(
            f"{path}: {show(value)} is not allowed; allowed values: " + ", ".join(repr(a) for a in registry.names())
        )


def type_name(tp: Any, rng: Optional[Range] = None) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a, rng) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    name = getattr(tp, "__name__", str(tp)).replace("NoneType", "null")
    return f"{name} {rng}" if tp in (int, float) and rng is not None and str(rng) else name


def show(value: Any, limit: int = 120) -> str:
    """A value as a message quotes it: repr'd with bounded effort (a few levels and items)
    and cut to `limit` characters, whatever the recipe held."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, limit, limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = 8
    try:
        return cut(r.repr(value), limit)
    except ValueError:  # an integer over Python's 4300-digit str() limit (YAML reads 0x... as one)
        return f"an integer of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__


def cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


ALIAS_BUDGET = 10_000
"""Values that YAML aliases may add to a recipe when expanded: reusing a setting stays far
below; a 'billion laughs' (each level a list of aliases of the one below) is refused."""


def check_aliases(data: Any, where: str) -> None:
    """Refuse parsed YAML whose aliases expand past ALIAS_BUDGET extra values, or refer to
    themselves, before anything walks or quotes it. PyYAML builds an alias as a shared
    object, so sizes are counted once per object (memoised), never by expanding."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stored = 0  # values as written: each container once, with its direct items

    def size(v: Any) -> int:
        nonlocal stored
        if not isinstance(v, (list, dict)):
            return 1
        if id(v) in sizes:
            return sizes[id(v)]
        if id(v) in active:
            raise RecipeError(f"{where}: a YAML alias refers to itself (a recursive structure); refused")
        active.add(id(v))
        items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
        stored += 1 + len(items)
        n = sizes[id(v)] = 1 + sum(size(x) for x in items)
        active.discard(id(v))
        return n

    try:
        extra = size(data) - stored
    except RecursionError:
        raise RecipeError(f"{where}: nested too deeply") from None
    if extra > ALIAS_BUDGET:
        raise RecipeError(
            f"{where}: YAML aliases expand to {extra} more values than are written, over the "
            f"limit of {ALIAS_BUDGET} (an alias bomb?); refused"
        )


def _check_number(value: float, raw: Any, rng: Optional[Range], path: str) -> None:
    """`value` (converted from `raw`) is finite, in `rng` and, for an integer, fits in 64 bits."""
    where = f" {rng}" if rng is not None and str(rng) else ""
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"{path}: must be a finite number{where}, got {show(raw)}")
    if rng is not None and not rng.contains(value):
        raise RecipeError(f"{path}: must be{where}, got {show(value)}")
    if isinstance(value, int) and not -INT_MAX - 1 <= value <= INT_MAX:
        raise RecipeError(f"{path}: must be{where}{' and' if where else ''} below 2**63, got {show(value)}")


_EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def convert(value: Any, tp: Any, path: str, rng: Optional[Range] = None) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(value, inner[0], path, rng)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise RecipeError(
                f"{path}: {show(value)} is not allowed; allowed values: " + ", ".join(repr(a) for a in allowed)
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list, got {type(value).__name__} {show(value)}")
        (inner,) = typing.get_args(tp)
        return [convert(v, inner, f"{path}[{i}]", rng) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: expected a mapping, got {type(value).__name__} {show(value)}")
        return build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{path}: expected true or false, got {show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{path}: expected an integer, got {show(value)}")
        _check_number(value, value, rng, path)
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 5e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{path}: expected a number, got {show(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer past float's range
            number = math.inf if value > 0 else -math.inf
        _check_number(number, value, rng, path)
        return number
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{path}: expected a string, got {show(value)}")
        return value
    raise RecipeError(f"{path}: unsupported field type {tp}")  # a bug in this file, not the recipe


def build(cls: Any, data: dict, prefix: str = "") -> Any:
    """An instance of the dataclass `cls` from a parsed YAML mapping (every key checked, see
    the module docstring); `prefix` is the key path of `data`, for messages."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise RecipeError(f"{cut(where)}: unknown key; allowed keys here: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            where = f"{prefix}.{name}" if prefix else name
            kwargs[name] = convert(data[name], hints[name], where, f.metadata.get("range"))
            check_choice(kwargs[name], f, where)
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """Apply one `key.path=value` (value parsed as YAML) to a raw recipe dict."""
    if "=" not in override:
        raise RecipeError(f"override {show(override)}: expected key.path=value")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"override {cut(key)}: cannot parse value {show(raw)}: {cut(str(e), 300)}") from None
    except RecursionError:
        raise RecipeError(f"override {cut(key)}: value nested too deeply") from None
    except (ValueError, OverflowError) as e:  # a YAML int over 4300 digits, a date that does not exist, ...
        raise RecipeError(f"override {cut(key)}: cannot read value {show(raw)}: {cut(str(e), 200)}") from None
    check_aliases(value, f"override {cut(key)}")
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {show(key)}: expected key.path=value with a key path such as training.lr")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise RecipeError(f"override {cut(key)}: {cut('.'.join(parts[: i + 1]))} is not a mapping")
        node = child
    node[parts[-1]] = value


def is_file(path: str) -> bool:
    """Path.is_file, False for a path the OS cannot even look up (too long, a NUL byte, ...)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def to_dict(recipe: Any) -> dict:
    return dataclasses.asdict(recipe)


def dump(recipe: Any) -> str:
    return yaml.safe_dump(to_dict(recipe), sort_keys=False)


def field_docs(cls: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) for every field of the dataclass `cls` and of the dataclasses
    it nests, the doc read from the string under each field where it is declared; used to print
    the recipe reference."""

    src = ast.parse(inspect.getsource(cls))
    docs: dict[str, str] = {}
    body = src.body[0].body if isinstance(src.body[0], ast.ClassDef) else []
    for a, b in zip(body, body[1:]):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            docs[a.target.id] = " ".join(b.value.value.split())
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            rows.append((key, type_name(tp), "", docs.get(f.name, inner[0].__doc__ or "")))
            rows.extend(field_docs(inner[0], key + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = type_name(tp, f.metadata.get("range"))
            if "choices" in f.metadata:
                shown = " | ".join(repr(a) for a in f.metadata["choices"].names())
            rows.append((key, shown, repr(default), docs.get(f.name, "")))
    return rows
