"""Shard patterns (`data.shards`, `validation.shards`): a glob or a brace range, refused before
expansion when it cannot be expanded or would expand past MAX_SHARD_PATTERNS."""

from __future__ import annotations

import glob
import logging
from typing import Optional

from braceexpand import (  # type: ignore[attr-defined]  # private helpers, to count before expanding
    braceexpand,
    char_range_re,
    int_range_re,
    make_char_range,
)

from loomrl.config.schema import RecipeError, show

log = logging.getLogger("loomrl")

TEMPORARY_SUFFIXES = (".tmp",)
"""File names a writer uses while a file is incomplete (`write_shards` writes NAME.tmp, renamed
when whole): a pattern never reads them, and warns when it matches one (a write was interrupted)."""

MAX_SHARD_PATTERNS = 100_000
"""Patterns a brace range in `data.shards` may expand to (each is globbed)."""


def _brace_count(pattern: str, limit: int) -> int:
    """How many patterns braceexpand(pattern) yields, counted without expanding (braceexpand
    builds every one in memory first), capped at limit + 1. Mirrors braceexpand's parser; raises
    ValueError on unbalanced braces, RecursionError on braces nested too deeply."""

    def pattern_count(p: str) -> int:
        total, start, depth, pos = 1, 0, 0, 0
        while pos < len(p):
            if p[pos] == "\\":
                pos += 2
                continue
            if p[pos] == "{":
                start = pos if depth == 0 else start
                depth += 1
            elif p[pos] == "}":
                depth -= 1
                if depth == 0:
                    total = min(total * expression_count(p[start + 1 : pos]), limit + 1)
                    start = pos + 1
            pos += 1
        if depth != 0:
            raise ValueError("unbalanced braces")
        return total

    def expression_count(e: str) -> int:
        m = int_range_re.match(e)
        if m:
            lo, hi, step = m.groups()
            if max(len(lo), len(hi), len(step or "")) > 18:
                return limit + 1
            lo, hi, step = int(lo), int(hi), (int(step) or 1) if step else 1
            return len(range(min(lo, hi), max(lo, hi) + 1, step))
        m = char_range_re.match(e)
        if m:
            return len(make_char_range(*m.groups())) if len(m.group(3) or "") <= 18 else 1
        items, start, depth, pos = [], 0, 0, 0
        while pos < len(e):  # a sequence {a,b,...}: commas outside nested braces
            if e[pos] == "\\":
                pos += 2
                continue
            if e[pos] == "{":
                depth += 1
            elif e[pos] == "}":
                depth -= 1
            elif e[pos] == "," and depth == 0:
                items.append(e[start:pos])
                start = pos + 1
            pos += 1
        if depth != 0 or not items:  # not a sequence: braceexpand keeps the braces, expands inside
            return pattern_count(e)
        return sum(pattern_count(x) for x in items + [e[start:]])

    return pattern_count(pattern)


def check_pattern(pattern: str, key: Optional[str] = None) -> None:
    """Refuse (RecipeError, naming `key`) a shard pattern braceexpand cannot expand or would
    expand past MAX_SHARD_PATTERNS."""
    where = f"{key}: " if key else ""
    try:
        n = _brace_count(pattern, MAX_SHARD_PATTERNS)
    except ValueError:
        raise RecipeError(f"{where}{show(pattern)} has unbalanced braces") from None
    except RecursionError:
        raise RecipeError(f"{where}{show(pattern)} has braces nested too deeply") from None
    if n > MAX_SHARD_PATTERNS:
        raise RecipeError(f"{where}{show(pattern)} expands to more than {MAX_SHARD_PATTERNS} patterns")


def expand_pattern(pattern: str, key: Optional[str] = None) -> list[str]:
    """Shard files matched by a glob or brace range, sorted; only existing files, never a
    temporary one (TEMPORARY_SUFFIXES: a write interrupted midway), with a warning naming it. A
    pattern that cannot be expanded is a RecipeError (naming `key` when given)."""

    check_pattern(pattern, key)
    files: set[str] = set()
    for p in braceexpand(pattern):
        files.update(glob.glob(p))
    partial = sorted(f for f in files if f.endswith(TEMPORARY_SUFFIXES))
    if partial:
        log.warning(
            "%s%s matches %d temporary file(s) left by an interrupted write, not read: %s%s "
            "(remove them, or make the shards again)",
            f"{key}: " if key else "",
            show(pattern),
            len(partial),
            ", ".join(show(f) for f in partial[:3]),
            ", ..." if len(partial) > 3 else "",
        )
    return sorted(files.difference(partial))
