"""Verifiable rewards for real tasks: exact answers, numbers, multiple choice, maths,
grounding boxes, and a format check, each registered in `REWARDS` (base.py) with its traits.

Each is a plain reward, fn(completion: str, sample: dict) -> float, reading the sample's
reference `answer` (except `regex`, which checks the completion's format alone):

    exact     SQuAD-normalised exact match of the final answer
    numeric   the completion's final number vs the answer's, relative `tolerance`
    choice    the multiple-choice letter (A-J)
    math      final answer equal as a string, as a number, or as an expression
    iou       intersection over union of the completion's first box and the answer's
    regex     1 when the stripped completion fully matches `pattern`

Design: this module holds the rewards and their registrations only; what they read out of a
text (the *final answer*: the last `<answer>...</answer>`, and in it or the whole text the last
`\\boxed{...}`; numbers, letters, boxes) is in `answers.py`, and `math`'s expression equivalence
(a safe converter, never Python's eval) in `expressions.py`. `exact`, `numeric`, `choice` and
`math` read the final answer when the completion has one, else what each says below; they are
registered `any_answer` (a sample's `meta.answers` all count), the parametrised ones with the
source fields they take (`params`).

Guarantees: on any completion (empty, garbage, 1 MB long, huge numbers, unbalanced
braces) a reward returns a float in [0, 1] and never raises, in time linear in a bounded
slice of the text: the final answer is looked for in the last MAX_SCAN characters (the
first MAX_SCAN for `iou`'s first box), a number longer than MAX_NUMBER_CHARS (answers.py)
is no number, `math` converts at most MAX_EXPR_CHARS characters (expressions.py) with bounded
exponents and number sizes, `regex` checks at most MAX_REGEX_CHARS. A *sample* without an answer (missing,
null, blank), or whose answer has no number / letter / box where the reward needs one, is
a data error: ValueError naming the sample id.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

from loomrl.platform.rewards.answers import (
    LETTERS,
    MAX_SCAN,
    Box,
    box_iou,
    choice_letter,
    close,
    final_answer,
    first_box,
    last_number,
    last_number_match,
    normalize_text,
    number_values,
    quote,
    reference,
    sample_id,
    unwrap_text,
    valid_box,
)
from loomrl.platform.rewards.base import REWARDS
from loomrl.platform.rewards.expressions import math_equal

MAX_REGEX_CHARS = 50_000
"""`regex`: a longer completion is not checked (reward 0)."""


@REWARDS.register("exact", any_answer=True)
def exact(completion: str, sample: dict) -> float:
    """1 if the final answer (else the whole completion) equals the answer after SQuAD
    normalisation, else 0. A completion over MAX_SCAN characters without a final answer is 0."""
    ref = reference(sample, "exact")
    if not isinstance(completion, str):
        return 0.0
    ref = final_answer(ref) or ref
    got = final_answer(completion)
    if got is None:
        got = completion.strip()
        if len(got) > MAX_SCAN:
            return 0.0
    return float(normalize_text(unwrap_text(got)) == normalize_text(unwrap_text(ref)))


@REWARDS.register("numeric", params=("tolerance",), any_answer=True)
def numeric(completion: str, sample: dict, tolerance: float = 1e-4) -> float:
    """1 if the completion's final number (from its final answer, else its last number) is
    within `tolerance` (relative, plus ABS_TOL) of the answer's (last) number, else 0. A
    percentage "12%" stands for 12 or 0.12; commas group thousands; "3/4" is 0.75."""
    ref_text = reference(sample, "numeric")
    ref = last_number(final_answer(ref_text) or ref_text)
    if ref is None:
        raise ValueError(
            f"reward 'numeric': sample {sample_id(sample)}: the answer {quote(ref_text)} has no (finite) number"
        )
    if not isinstance(completion, str):
        return 0.0
    got = last_number(final_answer(completion) or completion)
    return float(got is not None and close(got, ref, tolerance))


@REWARDS.register("choice", any_answer=True)
def choice(completion: str, sample: dict) -> float:
    """1 if the completion chooses the answer's letter (A-J; the answer as "B" or "(B) some
    text"), else 0."""
    ref_text = reference(sample, "choice")
    ref = choice_letter(ref_text)
    if ref is None:
        raise ValueError(
            f"reward 'choice': sample {sample_id(sample)}: the answer {quote(ref_text)} "
            f"names no letter {LETTERS[0]}-{LETTERS[-1]}"
        )
    if not isinstance(completion, str):
        return 0.0
    return float(choice_letter(completion) == ref)


@REWARDS.register("math", params=("tolerance",), any_answer=True)
def math(completion: str, sample: dict, tolerance: float = 1e-4) -> float:
    """1 if the completion's final answer (its \\boxed{} / <answer>, else its last number)
    equals the answer's (`math_equal`), else 0."""
    ref_text = reference(sample, "math")
    ref = final_answer(ref_text) or ref_text.strip()
    if not isinstance(completion, str):
        return 0.0
    got = final_answer(completion)
    if got is None:
        last = last_number_match(completion)
        if last is None or number_values(last) is None:
            return 0.0
        got = last.group(0)
    return float(math_equal(got, ref, tolerance))


@REWARDS.register("iou")
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
        ref_text = reference(sample, "iou")
        ref = first_box(ref_text)
    if ref is None or not valid_box(ref):
        raise ValueError(
            f"reward 'iou': sample {sample_id(sample)}: the answer {quote(ref_text)} is no valid "
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


def check_pattern(pattern: str) -> None:
    """`regex`'s check of its parameter: ValueError when `pattern` does not compile."""
    try:
        _compiled(pattern)
    except (re.error, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise ValueError(f"pattern {quote(pattern)} does not compile: {e}") from None


@REWARDS.register("regex", params=("pattern",), required=("pattern",), check_params=check_pattern)
def regex(completion: str, sample: dict, pattern: str) -> float:
    """Format reward: 1 if re.fullmatch(pattern, completion.strip(), re.DOTALL), else 0 (also
    for a completion over MAX_REGEX_CHARS). Reads no answer."""
    if not isinstance(completion, str):
        return 0.0
    text = completion.strip()
    if len(text) > MAX_REGEX_CHARS:
        return 0.0
    return float(_compiled(pattern).fullmatch(text) is not None)
