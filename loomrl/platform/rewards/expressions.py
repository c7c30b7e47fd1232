"""Maths answers compared as expressions, by a safe converter: `math_equal` (the `math` reward).

Design: model text is never evaluated as code (no sympify / parse_expr, which run Python's eval).
`_Converter` tokenizes a normalised final answer itself (numbers, single-letter variables,
+ - * / ^, parentheses and braces, \\frac, \\sqrt, \\cdot, \\times, \\div, \\pi), and builds each value
from the tokens: exact rationals for constants, and for expressions with variables their values at
POINTS fixed points (mpmath, sympy's numeric library, at DIGITS digits): equal values there is
equivalence (random identity testing: 2x+x and 3x, (x+1)^2 and x^2+2x+1). Sympy's own expressions
are not used: their automatic evaluation took 1.6 s on a 45-character answer here, and evalf on
unevaluated products grows exponentially with their nesting (99 s for 20 factors), while rewards
must stay cheap whatever the model writes.

Bounds: at most MAX_EXPR_CHARS characters are converted, exponents are small rationals
(MAX_EXPONENT), an expression's size with exponents multiplied in is capped (MAX_WEIGHT) and so is
its nesting (`_Converter.MAX_DEPTH`). Anything the converter does not read (`_Unsupported`) falls
back to string equality of the normalised answers (`normalize_math`).
"""

from __future__ import annotations

import functools
import random
import re
from fractions import Fraction
from typing import Callable, NamedTuple, Optional

from loomrl.platform.rewards.answers import ABS_TOL, close, unwrap_text, whole_number

MAX_EXPR_CHARS = 200
"""`math` converts final answers up to this long (after normalisation) to expressions."""
MAX_EXPONENT = 64
"""`math`: exponents are rationals p/q with |p|, q <= this."""
MAX_WEIGHT = 10_000
"""`math`: bound on an expression's size, exponents multiplied in (about the bits of its
largest exact number), so nested powers cannot allocate without bound."""


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
    s = _MATH_DROP.sub("", unwrap_text(s)).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
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
    a, b = whole_number(got), whole_number(ref)
    if a is not None and b is not None:
        return close(a, b, tolerance)
    ea = _parse_math(got)
    eb = _parse_math(ref) if ea is not None else None
    if ea is None or eb is None:
        return False
    try:
        return _equivalent(ea, eb, tolerance)
    except (ArithmeticError, ValueError):  # a comparison mpmath cannot make: not shown equal
        return False
