"""Verifiable rewards for real tasks: exact answers, numbers, multiple choice, maths,
grounding boxes, and a format check.

Each is a plain reward, fn(completion: str, sample: dict) -> float, reading the sample's
reference `answer` (except `regex`, which checks the completion's format alone):

    exact     SQuAD-normalised exact match of the final answer
    numeric   the completion's final number vs the answer's, relative `tolerance`
    choice    the multiple-choice letter (A-J)
    math      final answer equal as a string, as a number, or as an expression
    iou       intersection over union of the completion's first box and the answer's
    regex     1 when the stripped completion fully matches `pattern`

The *final answer* of a text is the content of its last `<answer>...</answer>` (an
opened tag never closed runs to the end), and inside it (or the whole text) the last
`\\boxed{...}` with balanced braces; `exact`, `numeric`, `choice` and `math` read that
when the completion has one, else what each says below.

Guarantees: on any completion (empty, garbage, 1 MB long, huge numbers, unbalanced
braces) a reward returns a float in [0, 1] and never raises, in time linear in a bounded
slice of the text: the final answer is looked for in the last MAX_SCAN characters (the
first MAX_SCAN for `iou`'s first box), a number longer than MAX_NUMBER_CHARS is no
number, `math` converts at most MAX_EXPR_CHARS characters with bounded exponents and
number sizes, `regex` checks at most MAX_REGEX_CHARS. A *sample* without an answer (missing,
null, blank), or whose answer has no number / letter / box where the reward needs one, is
a data error: ValueError naming the sample id.

`math` never evaluates model text as code (no sympify / parse_expr, which run Python's
eval): it tokenizes the answer itself (numbers, single-letter variables, + - * / ^,
parentheses and braces, \\frac, \\sqrt, \\cdot, \\times, \\div, \\pi), and builds each value
from the tokens: exact rationals for constants, and for expressions with variables their
values at three fixed points (mpmath, sympy's numeric library, at 50 digits): equal values
there is equivalence (random identity testing: 2x+x and 3x, (x+1)^2 and x^2+2x+1). Sympy's
own expressions are not used: their automatic evaluation took 1.6 s on a 45-character
answer here, and evalf on unevaluated products grows exponentially with their nesting
(99 s for 20 factors), while rewards must stay cheap whatever the model writes. Anything
the converter does not read falls back to string equality.
"""

from __future__ import annotations

import functools
import math as _math
import random
import re
import reprlib
import string
import unicodedata
from fractions import Fraction
from typing import Any, Callable, NamedTuple, Optional

MAX_SCAN = 20_000
"""Characters of a completion searched for its final answer (the end: where it is)."""
MAX_NUMBER_CHARS = 64
"""A number token longer than this (a 100000-digit integer, say) is not read as a number."""
MAX_EXPR_CHARS = 200
"""`math` converts final answers up to this long (after normalisation) to expressions."""
MAX_EXPONENT = 64
"""`math`: exponents are rationals p/q with |p|, q <= this."""
MAX_WEIGHT = 10_000
"""`math`: bound on an expression's size, exponents multiplied in (about the bits of its
largest exact number), so nested powers cannot allocate without bound."""
MAX_REGEX_CHARS = 50_000
"""`regex`: a longer completion is not checked (reward 0)."""
ABS_TOL = 1e-9
"""Absolute tolerance added to `numeric`'s and `math`'s relative one (so 0 matches 1e-12)."""

# --------------------------------------------------------------------------- helpers


def _cut(value: Any, limit: int = 80) -> str:
    """A value as a message quotes it: repr'd with bounded effort, cut to `limit` characters."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = limit
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reference(sample: dict, reward: str) -> str:
    """The sample's answer as a string; a missing, null or blank answer is a ValueError."""
    answer = sample.get("answer") if isinstance(sample, dict) else None
    sid = _sample_id(sample)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError(f"reward {reward!r}: sample {sid} has no answer (its record needs an `answer` string)")
    if not isinstance(answer, str):
        raise ValueError(
            f"reward {reward!r}: sample {sid}: the answer must be a string, got {type(answer).__name__} {_cut(answer)}"
        )
    return answer


def _sample_id(sample: dict) -> str:
    return _cut(sample.get("id") if isinstance(sample, dict) else None)


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


def _unwrap_text(s: str) -> str:
    """\\text{Paris} -> Paris (one level), as answers are often boxed that way."""
    return _LATEX_TEXT.sub(r"\1", s)


# --------------------------------------------------------------------------- exact

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_text(s: str) -> str:
    """SQuAD's answer normalisation: case-folded, punctuation (ASCII and Unicode) dropped,
    articles a/an/the dropped, whitespace collapsed."""
    s = "".join(ch for ch in s.casefold() if ch not in _PUNCT and not unicodedata.category(ch).startswith("P"))
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact(completion: str, sample: dict) -> float:
    """1 if the final answer (else the whole completion) equals the answer after SQuAD
    normalisation, else 0. A completion over MAX_SCAN characters without a final answer is 0."""
    ref = _reference(sample, "exact")
    if not isinstance(completion, str):
        return 0.0
    ref = final_answer(ref) or ref
    got = final_answer(completion)
    if got is None:
        got = completion.strip()
        if len(got) > MAX_SCAN:
            return 0.0
    return float(normalize_text(_unwrap_text(got)) == normalize_text(_unwrap_text(ref)))


# --------------------------------------------------------------------------- numeric

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


def _number_values(m: re.Match) -> Optional[tuple[float, ...]]:
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


def _last_number_match(text: str) -> Optional[re.Match]:
    """The match of the last number in `text`'s last MAX_SCAN characters (\\frac{3}{4} read 3/4)."""
    last = None
    for last in _NUMBER.finditer(_LATEX_FRAC.sub(r"\1/\2", text[-MAX_SCAN:])):
        pass
    return last


def last_number(text: str) -> Optional[tuple[float, ...]]:
    """The last number of `text`'s last MAX_SCAN characters ("1,234", "-3.5", "3/4",
    "\\frac{3}{4}", "12%"), as _number_values; None when there is none or it is unreadable."""
    last = _last_number_match(text)
    return _number_values(last) if last is not None else None


def _whole_number(text: str) -> Optional[tuple[float, ...]]:
    """`text` read as one number (nothing else in it), else None."""
    text = _LATEX_FRAC.sub(r"\1/\2", text.strip().replace("$", ""))
    m = _NUMBER.fullmatch(text.strip()) if len(text) <= 4 * MAX_NUMBER_CHARS else None
    return _number_values(m) if m else None


def _close(a: tuple[float, ...], b: tuple[float, ...], tolerance: float) -> bool:
    return any(_math.isclose(x, y, rel_tol=tolerance, abs_tol=ABS_TOL) for x in a for y in b)


def numeric(completion: str, sample: dict, tolerance: float = 1e-4) -> float:
    """1 if the completion's final number (from its final answer, else its last number) is
    within `tolerance` (relative, plus ABS_TOL) of the answer's (last) number, else 0. A
    percentage "12%" stands for 12 or 0.12; commas group thousands; "3/4" is 0.75."""
    ref_text = _reference(sample, "numeric")
    ref = last_number(final_answer(ref_text) or ref_text)
    if ref is None:
        raise ValueError(
            f"reward 'numeric': sample {_sample_id(sample)}: the answer {_cut(ref_text)} has no (finite) number"
        )
    if not isinstance(completion, str):
        return 0.0
    got = last_number(final_answer(completion) or completion)
    return float(got is not None and _close(got, ref, tolerance))


# --------------------------------------------------------------------------- choice

_LETTERS = "ABCDEFGHIJ"
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


def choice(completion: str, sample: dict) -> float:
    """1 if the completion chooses the answer's letter (A-J; the answer as "B" or "(B) some
    text"), else 0."""
    ref_text = _reference(sample, "choice")
    ref = choice_letter(ref_text)
    if ref is None:
        raise ValueError(
            f"reward 'choice': sample {_sample_id(sample)}: the answer {_cut(ref_text)} "
            f"names no letter {_LETTERS[0]}-{_LETTERS[-1]}"
        )
    if not isinstance(completion, str):
        return 0.0
    return float(choice_letter(completion) == ref)


# --------------------------------------------------------------------------- math


class _Unsupported(Exception):
    """Text the safe converter does not read: `math` falls back to string equality."""


_MATH_DROP = re.compile(r"\\left|\\right|\\displaystyle|\\[,;:! ]|\$|\s+|\^\{?\\circ\}?|°")
_MATH_TOKEN = re.compile(
    r"[0-9]+(?:\.[0-9]+)?|\.[0-9]+|\\(?:frac|sqrt|cdot|times|div|pi)|\\[A-Za-z]+|[A-Za-z]"
    r"|[-+*/^(){}\[\]]"
)
_ASSIGNMENT = re.compile(r"[A-Za-z]=(?!=)")


def normalize_math(s: str) -> str:
    """A final answer as `math` compares strings: \\text{} unwrapped, spaces, \\left \\right, $,
    degrees, a trailing period and a leading "x=" dropped, \\dfrac and \\tfrac read \\frac."""
    s = _MATH_DROP.sub("", _unwrap_text(s)).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\%", "%").rstrip(".")
    if _ASSIGNMENT.match(s):
        s = s[2:]
    return s


POINTS = 3
"""`math` compares expressions with variables at this many fixed points."""
DIGITS = 50
"""Working precision (decimal digits) of those evaluations."""


class _Node(NamedTuple):
    weight: int  # number bits, exponents multiplied in (bounded by MAX_WEIGHT)
    const: Optional[Fraction]  # its exact value when it is a rational constant
    values: tuple  # its value at each point (mpmath mpc), None where undefined
    variables: bool  # whether it has a variable


@functools.lru_cache(maxsize=1)
def _mp():
    """A private mpmath context at DIGITS digits (mpmath's global one is shared)."""
    from mpmath.ctx_mp import MPContext

    ctx = MPContext()
    ctx.dps = DIGITS
    return ctx


@functools.lru_cache(maxsize=512)
def _variable_value(name: str, k: int) -> float:
    """The value of variable `name` at point k: in +-[0.1, 2], all positive at point 0, all
    negative at 1, mixed at 2 (a fixed pseudo-random draw per name and point)."""
    magnitude = random.Random(f"loomrl-math-{k}-{name}").uniform(0.1, 2.0)
    return -magnitude if k == 1 or (k == 2 and ord(name) % 2) else magnitude


class _Converter:
    """Recursive descent over the tokens of a normalised final answer. Model text is never
    evaluated as code: each node is built from its tokens as an exact rational (constants)
    and its values at POINTS fixed points of the variables (mpmath, DIGITS digits). Weights
    are capped at MAX_WEIGHT, nesting at MAX_DEPTH, so work and memory stay bounded."""

    MAX_DEPTH = 40
    _ATOM_START = ("(", "{", "[", "\\frac", "\\sqrt", "\\pi")

    def __init__(self, text: str):
        self.mp = _mp()
        self.tokens: list[str] = []
        pos = 0
        for m in _MATH_TOKEN.finditer(text):
            if m.start() != pos:
                raise _Unsupported(text[pos : m.start()])
            self.tokens.append(m.group())
            pos = m.end()
        if pos != len(text) or not self.tokens:
            raise _Unsupported(text[pos:])
        letters = "".join("a" if len(t) == 1 and t.isalpha() else " " for t in self.tokens)
        if any(len(run) > 2 for run in letters.split()):
            raise _Unsupported("a word, not a product of variables")
        self.i, self.depth = 0, 0

    # -- tokens

    def peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: Optional[str] = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _Unsupported(f"expected {expected}")
        self.i += 1
        return tok

    # -- nodes

    @staticmethod
    def weighed(weight: int) -> int:
        if weight > MAX_WEIGHT:
            raise _Unsupported("too large")
        return weight

    def number(self, value: Fraction) -> _Node:
        bits = value.numerator.bit_length() + value.denominator.bit_length() + 1
        v = self.mp.mpc(self.mp.mpf(value.numerator) / value.denominator)
        return _Node(self.weighed(bits), value, (v,) * POINTS, False)

    def combine(self, a: _Node, b: _Node, op: Callable) -> _Node:
        values = tuple(None if x is None or y is None else op(x, y) for x, y in zip(a.values, b.values))
        return _Node(self.weighed(a.weight + b.weight), None, values, a.variables or b.variables)

    def add(self, a: _Node, b: _Node, sign: int = 1) -> _Node:
        if a.const is not None and b.const is not None:
            return self.number(a.const + sign * b.const)
        return self.combine(a, b, (lambda x, y: x + y) if sign > 0 else (lambda x, y: x - y))

    def mul(self, a: _Node, b: _Node, divide: bool = False) -> _Node:
        if divide and b.const == 0:
            raise _Unsupported("division by zero")
        if a.const is not None and b.const is not None:
            return self.number(a.const / b.const if divide else a.const * b.const)
        if divide:
            return self.combine(a, b, lambda x, y: None if y == 0 else x / y)
        return self.combine(a, b, lambda x, y: x * y)

    def pow(self, base: _Node, exponent: Optional[Fraction]) -> _Node:
        if exponent is None or abs(exponent.numerator) > MAX_EXPONENT or exponent.denominator > MAX_EXPONENT:
            raise _Unsupported("exponent")
        if base.const == 0 and exponent < 0:
            raise _Unsupported("division by zero")
        weight = self.weighed(base.weight * max(1, abs(exponent.numerator)))
        if base.const is not None and exponent.denominator == 1:
            return self.number(base.const**exponent.numerator)
        e = exponent.numerator if exponent.denominator == 1 else self.mp.mpf(exponent.numerator) / exponent.denominator
        values = tuple(None if v is None or (v == 0 and exponent < 0) else self.mp.power(v, e) for v in base.values)
        return _Node(weight, None, values, base.variables)

    # -- grammar: expr := term (+|- term)*; term := unary ((*|/|implicit) unary)*;
    #    unary := (+|-) unary | power; power := atom (^ [-] atom)*

    def parse(self) -> _Node:
        node = self.expr()
        if self.peek() is not None:
            raise _Unsupported(self.peek())
        return node

    def expr(self) -> _Node:
        self.depth += 1
        if self.depth > self.MAX_DEPTH:
            raise _Unsupported("nested too deeply")
        node = self.term()
        while self.peek() in ("+", "-"):
            sign = 1 if self.take() == "+" else -1
            node = self.add(node, self.term(), sign)
        self.depth -= 1
        return node

    def term(self) -> _Node:
        node = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", "/", "\\cdot", "\\times", "\\div"):
                self.take()
                node = self.mul(node, self.unary(), divide=tok in ("/", "\\div"))
            elif tok is not None and (tok in self._ATOM_START or (len(tok) == 1 and tok.isalpha())):
                node = self.mul(node, self.power())  # implicit product: 2x, 3(x+1), x\sqrt{2}
            else:
                return node

    def unary(self) -> _Node:
        if self.peek() in ("+", "-"):
            negative = self.take() == "-"
            node = self.unary()
            return self.mul(self.number(Fraction(-1)), node) if negative else node
        return self.power()

    def power(self) -> _Node:
        node = self.atom()
        while self.peek() == "^":
            self.take()
            negative = self.peek() == "-"
            if negative:
                self.take()
            exponent = self.atom().const
            node = self.pow(node, -exponent if negative and exponent is not None else exponent)
        return node

    def group(self) -> _Node:
        """A command's argument: {...}, or one digit or letter (\\frac12, \\sqrt2)."""
        tok = self.peek()
        if tok == "{":
            self.take()
            node = self.expr()
            self.take("}")
            return node
        if tok is not None and tok.isdigit() and len(tok) > 1:  # \frac12: the first digit only
            self.tokens[self.i] = tok[1:]
            return self.number(Fraction(int(tok[0])))
        if tok is not None and (tok.isdigit() or (len(tok) == 1 and tok.isalpha())):
            return self.atom()
        raise _Unsupported("a command's argument")

    def atom(self) -> _Node:
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            if len(tok) > 30:
                raise _Unsupported("number too long")
            return self.number(Fraction(tok))
        if len(tok) == 1 and tok.isalpha():
            return _Node(1, None, tuple(self.mp.mpc(_variable_value(tok, k)) for k in range(POINTS)), True)
        if tok in ("(", "[", "{"):
            node = self.expr()
            self.take({"(": ")", "[": "]", "{": "}"}[tok])
            return node
        if tok == "\\pi":
            return _Node(2, None, (self.mp.mpc(self.mp.pi),) * POINTS, False)
        if tok == "\\frac":
            num = self.group()
            return self.mul(num, self.group(), divide=True)
        if tok == "\\sqrt":
            n = 2
            if self.peek() == "[":
                self.take("[")
                index = self.take()
                self.take("]")
                if not index.isdigit() or not 2 <= int(index) <= MAX_EXPONENT:
                    raise _Unsupported("root index")
                n = int(index)
            return self.pow(self.group(), Fraction(1, n))
        raise _Unsupported(tok)


def _parse_math(text: str) -> Optional[_Node]:
    """A normalised final answer read by the safe converter, or None when it does not read it
    (longer than MAX_EXPR_CHARS, an unknown token or command, an exponent that is no small
    rational, too large)."""
    if len(text) > MAX_EXPR_CHARS:
        return None
    try:
        return _Converter(text).parse()
    except _Unsupported:
        return None
    except (ArithmeticError, ValueError, RecursionError):  # mpmath on an odd value: then it is unread
        return None


def _equivalent(a: _Node, b: _Node, tolerance: float) -> bool:
    """Two converted expressions are equal: exactly, when both are rational constants; else by
    their values at the POINTS fixed points (random identity testing): within `tolerance`
    (relative, plus ABS_TOL) when neither has a variable (they are numbers, compared as
    `numeric` does), else to 1e-15 relative; points where either is undefined are skipped,
    and at least two must agree."""
    if a.const is not None and b.const is not None:
        return abs(a.const - b.const) <= Fraction(tolerance) * max(abs(a.const), abs(b.const)) + Fraction(ABS_TOL)
    mp = _mp()
    variables = a.variables or b.variables
    rel, floor = (mp.mpf("1e-15"), 1) if variables else (mp.mpf(tolerance), 0)
    agreed = 0
    for va, vb in zip(a.values, b.values):
        if va is None or vb is None or not (mp.isfinite(va) and mp.isfinite(vb)):
            continue
        if abs(va - vb) > rel * max(floor, abs(va), abs(vb)) + (0 if variables else ABS_TOL):
            return False
        agreed += 1
    return agreed >= 2


def math_equal(got: str, ref: str, tolerance: float = 1e-4) -> bool:
    """Two final answers are equal: as normalised strings, as numbers (within `tolerance`),
    or as expressions (`_equivalent`)."""
    got, ref = normalize_math(got), normalize_math(ref)
    if got == ref:
        return True
    a, b = _whole_number(got), _whole_number(ref)
    if a is not None and b is not None:
        return _close(a, b, tolerance)
    ea = _parse_math(got)
    eb = _parse_math(ref) if ea is not None else None
    if ea is None or eb is None:
        return False
    try:
        return _equivalent(ea, eb, tolerance)
    except (ArithmeticError, ValueError):  # a comparison mpmath cannot make: not shown equal
        return False


def math(completion: str, sample: dict, tolerance: float = 1e-4) -> float:
    """1 if the completion's final answer (its \\boxed{} / <answer>, else its last number)
    equals the answer's (`math_equal`), else 0."""
    ref_text = _reference(sample, "math")
    ref = final_answer(ref_text) or ref_text.strip()
    if not isinstance(completion, str):
        return 0.0
    got = final_answer(completion)
    if got is None:
        last = _last_number_match(completion)
        if last is None or _number_values(last) is None:
            return 0.0
        got = last.group(0)
    return float(math_equal(got, ref, tolerance))


# --------------------------------------------------------------------------- iou

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


def _valid(box: Box) -> bool:
    x1, y1, x2, y2 = box
    return all(_math.isfinite(v) and v >= 0 for v in box) and x2 > x1 and y2 > y1


def box_iou(a: Box, b: Box) -> float:
    """IoU of two (x1, y1, x2, y2) boxes; 0 when either is degenerate (x2 <= x1 or y2 <= y1)
    or has a negative coordinate."""
    if not (_valid(a) and _valid(b)):
        return 0.0
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return min(1.0, max(0.0, inter / union)) if union > 0 else 0.0


def iou(completion: str, sample: dict) -> float:
    """IoU of the completion's first box with the answer's box (a string in any form
    `first_box` reads, or a list of 4 numbers); 0 when the completion has no valid box."""
    answer = sample.get("answer") if isinstance(sample, dict) else None
    if (
        isinstance(answer, (list, tuple))
        and len(answer) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in answer)
    ):
        ref: Optional[Box] = tuple(float(v) for v in answer)  # type: ignore[assignment]
        ref_text = answer
    else:
        ref_text = _reference(sample, "iou")
        ref = first_box(ref_text)
    if ref is None or not _valid(ref):
        raise ValueError(
            f"reward 'iou': sample {_sample_id(sample)}: the answer {_cut(ref_text)} is no valid "
            f"box [x1, y1, x2, y2] (x2 > x1, y2 > y1, coordinates >= 0)"
        )
    if not isinstance(completion, str):
        return 0.0
    got = first_box(completion)
    return box_iou(got, ref) if got is not None else 0.0


# --------------------------------------------------------------------------- regex


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


def regex(completion: str, sample: dict, pattern: str) -> float:
    """Format reward: 1 if re.fullmatch(pattern, completion.strip(), re.DOTALL), else 0 (also
    for a completion over MAX_REGEX_CHARS). Reads no answer."""
    if not isinstance(completion, str):
        return 0.0
    text = completion.strip()
    if len(text) > MAX_REGEX_CHARS:
        return 0.0
    return float(_compiled(pattern).fullmatch(text) is not None)


# --------------------------------------------------------------------------- factory

TASK_REWARDS: dict[str, Callable[..., float]] = {
    "exact": exact,
    "numeric": numeric,
    "choice": choice,
    "math": math,
    "iou": iou,
    "regex": regex,
}
"""The rewards of this module by registry name."""
PARAMETERS = {"numeric": ("tolerance",), "math": ("tolerance",), "regex": ("pattern",)}
"""The recipe fields (of a reward source) each parametrised reward takes."""
REQUIRED = {"regex": ("pattern",)}
"""Parameters without a default."""


def build_reward(name: str, cfg: Any = None) -> Callable[[str, dict], float]:
    """The reward `name` of TASK_REWARDS with its parameters read from `cfg` (a reward source's
    config: attributes `tolerance`, `pattern`; None: defaults), as a functools.partial when it
    has any. ValueError when a required one is missing or a pattern does not compile."""
    fn = TASK_REWARDS[name]
    params = {p: getattr(cfg, p) for p in PARAMETERS.get(name, ()) if getattr(cfg, p, None) is not None}
    missing = [p for p in REQUIRED.get(name, ()) if p not in params]
    if missing:
        raise ValueError(f"the {name!r} reward needs `{missing[0]}` (set it in an algorithm.rewards entry)")
    if "pattern" in params:
        try:
            _compiled(params["pattern"])
        except (re.error, TypeError, ValueError, OverflowError, RecursionError) as e:
            raise ValueError(f"pattern {_cut(params['pattern'])} does not compile: {e}") from None
    fn = functools.partial(fn, **params) if params else fn
    return _best_of_answers(fn) if name in ANY_ANSWER else fn


ANY_ANSWER = ("exact", "numeric", "choice", "math")
"""Rewards that also accept any of a sample's `meta.answers` (VQA sets list several)."""


def _best_of_answers(fn: Callable[[str, dict], float]) -> Callable[[str, dict], float]:
    """fn scored against each of the sample's `meta.answers` (at most 32) when it lists more than
    one; the best score counts."""

    def scored(completion: str, sample: dict) -> float:
        meta = sample.get("meta") if isinstance(sample, dict) else None
        answers = meta.get("answers") if isinstance(meta, dict) else None
        if isinstance(answers, list) and len(answers) > 1 and all(isinstance(a, str) for a in answers):
            return max(fn(completion, {**sample, "answer": a}) for a in answers[:32])
        return fn(completion, sample)

    return scored
