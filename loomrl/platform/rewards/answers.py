"""Reading answers out of text: what the task rewards (`tasks.py`) compare, never a score.

Design: every reader takes any string (a model's completion or a sample's reference answer) and
returns a value or None; none raises on a completion and each reads a bounded slice of the text, so
a reward's work stays linear in MAX_SCAN whatever the model writes:

    final_answer   the content of the last `<answer>...</answer>` (an opened tag never closed
                   runs to the end), and inside it (or the whole text) the last `\\boxed{...}`
                   with balanced braces; looked for in the last MAX_SCAN characters
    normalize_text SQuAD's answer normalisation (`exact`)
    last_number    the last number: "1,234", "-3.5", "3/4", "\\frac{3}{4}", "12%" (12 or 0.12);
                   a number longer than MAX_NUMBER_CHARS is no number (`numeric`, `math`)
    choice_letter  the multiple-choice letter A-J a text chooses (`choice`)
    first_box      the first box [x1, y1, x2, y2] of the first MAX_SCAN characters (`iou`)

`reference` reads a sample's answer for a reward and is the one that raises: a sample without an
answer (missing, null, blank) is a data error, ValueError naming the sample id (`sample_id`,
quoted with bounded effort by `quote`). Maths expressions are compared in `expressions.py`.
"""

from __future__ import annotations

import math as _math
import re
import reprlib
import string
import unicodedata
from typing import Any, Optional

MAX_SCAN = 20_000
"""Characters of a completion searched for its final answer (the end: where it is)."""
MAX_NUMBER_CHARS = 64
"""A number token longer than this (a 100000-digit integer, say) is not read as a number."""
ABS_TOL = 1e-9
"""Absolute tolerance added to `numeric`'s and `math`'s relative one (so 0 matches 1e-12)."""

# --------------------------------------------------------------------------- samples, the final answer


def quote(value: Any, limit: int = 80) -> str:
    """A value as a message quotes it: repr'd with bounded effort, cut to `limit` characters."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = limit
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reference(sample: dict, reward: str) -> str:
    """The sample's answer as a string; a missing, null or blank answer is a ValueError."""
    answer = sample.get("answer") if isinstance(sample, dict) else None
    sid = sample_id(sample)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError(f"reward {reward!r}: sample {sid} has no answer (its record needs an `answer` string)")
    if not isinstance(answer, str):
        raise ValueError(
            f"reward {reward!r}: sample {sid}: the answer must be a string, got {type(answer).__name__} {quote(answer)}"
        )
    return answer


def sample_id(sample: dict) -> str:
    return quote(sample.get("id") if isinstance(sample, dict) else None)


def _boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}) of `text`, braces balanced (nested ok,
    \\{ \\} escaped ones skipped); None when there is none or it never closes."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    first, depth = i, 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[first:i]
        i += 1
    return None


def _tagged(text: str) -> Optional[str]:
    """Content of the last <answer>: up to its </answer>, or to the end when never closed."""
    start = text.rfind("<answer>")
    if start < 0:
        return None
    end = text.find("</answer>", start)
    return text[start + len("<answer>") : end if end >= 0 else None]


def final_answer(text: str) -> Optional[str]:
    """The final answer of `text` (see the module docstring), None when it marks none."""
    text = text[-MAX_SCAN:]
    tag = _tagged(text)
    boxed = _boxed(tag if tag is not None else text)
    return boxed if boxed is not None else tag


_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def unwrap_text(s: str) -> str:
    """\\text{Paris} -> Paris (one level), as answers are often boxed that way."""
    return _LATEX_TEXT.sub(r"\1", s)


# --------------------------------------------------------------------------- text

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_text(s: str) -> str:
    """SQuAD's answer normalisation: case-folded, punctuation (ASCII and Unicode) dropped,
    articles a/an/the dropped, whitespace collapsed."""
    s = "".join(ch for ch in s.casefold() if ch not in _PUNCT and not unicodedata.category(ch).startswith("P"))
    return " ".join(_ARTICLES.sub(" ", s).split())


# --------------------------------------------------------------------------- numbers

_NUM = r"(?:[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
# a sign only where it cannot be a subtraction (not right after a word, digit or bracket)
_SIGNED = rf"(?:(?<![\w)\]}}])[-+\u2212])?{_NUM}"
_NUMBER = re.compile(rf"({_SIGNED})(?:\s*/\s*({_SIGNED}))?(\s*(?:\\?%|percent\b))?")
_LATEX_FRAC = re.compile(rf"\\[dt]?frac\s*\{{\s*({_SIGNED})\s*\}}\s*\{{\s*({_SIGNED})\s*\}}")


def _to_float(token: str) -> Optional[float]:
    if len(token) > MAX_NUMBER_CHARS:
        return None
    try:
        value = float(token.replace(",", "").replace("\u2212", "-"))
    except (ValueError, OverflowError):
        return None
    return value if _math.isfinite(value) else None


def number_values(m: re.Match) -> Optional[tuple[float, ...]]:
    """The values a number match may mean: (v,), or (v, v/100) for a percentage; None when it
    is too long, not finite, or a fraction over 0."""
    value = _to_float(m.group(1))
    if value is None:
        return None
    if m.group(2) is not None:
        den = _to_float(m.group(2))
        if not den:
            return None
        value /= den
        if not _math.isfinite(value):
            return None
    return (value, value / 100) if m.group(3) else (value,)


def last_number_match(text: str) -> Optional[re.Match]:
    """The match of the last number in `text`'s last MAX_SCAN characters (\\frac{3}{4} read 3/4)."""
    last = None
    for last in _NUMBER.finditer(_LATEX_FRAC.sub(r"\1/\2", text[-MAX_SCAN:])):
        pass
    return last


def last_number(text: str) -> Optional[tuple[float, ...]]:
    """The last number of `text`'s last MAX_SCAN characters ("1,234", "-3.5", "3/4",
    "\\frac{3}{4}", "12%"), as number_values; None when there is none or it is unreadable."""
    last = last_number_match(text)
    return number_values(last) if last is not None else None


def whole_number(text: str) -> Optional[tuple[float, ...]]:
    """`text` read as one number (nothing else in it), else None."""
    text = _LATEX_FRAC.sub(r"\1/\2", text.strip().replace("$", ""))
    m = _NUMBER.fullmatch(text.strip()) if len(text) <= 4 * MAX_NUMBER_CHARS else None
    return number_values(m) if m else None


def close(a: tuple[float, ...], b: tuple[float, ...], tolerance: float) -> bool:
    return any(_math.isclose(x, y, rel_tol=tolerance, abs_tol=ABS_TOL) for x in a for y in b)


# --------------------------------------------------------------------------- letters

LETTERS = "ABCDEFGHIJ"
_CHOICE_ONLY = re.compile(r"\s*[(\[]?\s*([A-Ja-j])\s*[)\]]?\s*[.:]?\s*")
_CHOICE_LEAD = re.compile(r"\s*(?:\(([A-Ja-j])\)|([A-J])[).:])(?:\s|$)")
_CHOICE_SAID = re.compile(
    r"(?i:answer)(?:\s+(?i:is))?\s*[:\uff1a]?\s*(?:\*\*)?\s*"
    r"(?:[(\[]([A-Ja-j])[)\]]|([A-J])(?![A-Za-z0-9]))"
)


def choice_letter(text: str) -> Optional[str]:
    """The letter a text chooses, upper-case: from its final answer when marked, else the
    last "answer is C" / "Answer: (d)" / "Answer: D) ...", else the text being just a letter
    ("B", "(b)", "C.") or starting with one ("(B) Paris", "B) Paris"). Lower-case letters
    count only in brackets or alone (so "the answer is a dog" chooses nothing)."""
    marked = final_answer(text)
    text = marked if marked is not None else text
    said = None
    for said in _CHOICE_SAID.finditer(text[-MAX_SCAN:]):
        pass
    if said is not None:
        return (said.group(1) or said.group(2)).upper()
    head = text.strip()[:MAX_SCAN]
    m = _CHOICE_ONLY.fullmatch(head) if len(head) <= 16 else None
    if m is None:
        m = _CHOICE_LEAD.match(head)
    if m is None:
        return None
    return next(g for g in m.groups() if g).upper()


# --------------------------------------------------------------------------- boxes

_BOX_NUM = r"[-+]?[0-9]{1,12}(?:\.[0-9]{1,12})?"
_BOX_LIST = re.compile(rf"\[\s*({_BOX_NUM})\s*,\s*({_BOX_NUM})\s*,\s*({_BOX_NUM})\s*,\s*({_BOX_NUM})\s*\]")
_BOX_PAIRS = re.compile(rf"\(\s*({_BOX_NUM})\s*,\s*({_BOX_NUM})\s*\)\s*,?\s*\(\s*({_BOX_NUM})\s*,\s*({_BOX_NUM})\s*\)")
_BOX_BARE = re.compile(rf"\s*({_BOX_NUM})\s*,\s*({_BOX_NUM})\s*,\s*({_BOX_NUM})\s*,\s*({_BOX_NUM})\s*")

Box = tuple[float, float, float, float]


def first_box(text: str) -> Optional[Box]:
    """The first box of `text`'s first MAX_SCAN characters: `[x1, y1, x2, y2]` (also inside
    JSON such as {"bbox_2d": [...]}), Qwen2-VL's `<|box_start|>(x1,y1),(x2,y2)<|box_end|>` (the
    pairs alone too), or the text being just "x1, y1, x2, y2"."""
    text = text[:MAX_SCAN]
    found = [m for m in (_BOX_LIST.search(text), _BOX_PAIRS.search(text)) if m]
    if not found:
        m = _BOX_BARE.fullmatch(text)
        found = [m] if m else []
    if not found:
        return None
    m = min(found, key=lambda m: m.start())
    return tuple(float(g) for g in m.groups())  # type: ignore[return-value]


def valid_box(box: Box) -> bool:
    x1, y1, x2, y2 = box
    return all(_math.isfinite(v) and v >= 0 for v in box) and x2 > x1 and y2 > y1


def box_iou(a: Box, b: Box) -> float:
    """IoU of two (x1, y1, x2, y2) boxes; 0 when either is degenerate (x2 <= x1 or y2 <= y1)
    or has a negative coordinate."""
    if not (valid_box(a) and valid_box(b)):
        return 0.0
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return min(1.0, max(0.0, inter / union)) if union > 0 else 0.0
