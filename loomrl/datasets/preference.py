"""Preference pairs (DPO, `algorithm.name: dpo`): a sample that holds two answers to its prompt and
media, the `chosen` one and the `rejected` one.

Manifest lines carry them as the keys `chosen` and `rejected` (strings), beside the prompt and
media; `shards make` stores them in the sample's header as the fields `chosen` and `rejected`:

    {"question": "what is this ?", "image": "img/cat.png", "chosen": "a cat", "rejected": "a dog"}

A line with either key must make a pair: both present, each a non-empty string, and different (after
stripping spaces); anything else is a `bad-pair` rejection (counted and reported like every other
rejection, never an exception). A line with neither is an ordinary sample. A run that trains on pairs
skips (and counts, as `bad-pair`) a sample of its shards without one, and `loomrl run --dry-run`
refuses shards without any (`pair_census`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from loomrl.datasets.shards import MAX_MEMBER_BYTES, open_shard, read_header, scan_shard

PAIR_FIELDS = ("chosen", "rejected")
BAD_PAIR = "bad-pair"


def pair_problem(chosen: object, rejected: object) -> Optional[str]:
    """Why (chosen, rejected) is not a preference pair (one readable sentence), or None when it is:
    both non-empty strings that differ once stripped."""
    for name, value in zip(PAIR_FIELDS, (chosen, rejected)):
        if value is None:
            return f"no {name!r} answer (a preference pair needs both 'chosen' and 'rejected')"
        if not isinstance(value, str):
            return f"field {name!r} must be a string, got {type(value).__name__}"
        if not value.strip():
            return f"field {name!r} is empty"
    assert isinstance(chosen, str) and isinstance(rejected, str)
    if chosen.strip() == rejected.strip():
        return "'chosen' and 'rejected' are the same answer: the pair prefers nothing"
    return None


def line_pair(chosen: object, rejected: object) -> Optional[str]:
    """A manifest line's pair check: None for a line with neither key (not a pair) or a good pair,
    else the problem (the line is then a `bad-pair` rejection)."""
    if chosen is None and rejected is None:
        return None
    return pair_problem(chosen, rejected)


@dataclass
class PairCensus:
    """The samples of some shards and how many of them hold a good preference pair."""

    samples: int = 0
    pairs: int = 0
    first_bad: str = ""  # "shard:key: why" of the first sample without a good pair


def pair_census(files: list[str], max_member_bytes: int = MAX_MEMBER_BYTES) -> PairCensus:
    """Count the samples of `files` holding a good pair, from the headers alone (no medium is
    read). ShardError on a damaged shard."""
    census = PairCensus()
    for f in files:
        with open_shard(f) as fh:
            for ref in scan_shard(f, max_member_bytes):
                header = read_header(fh, ref)
                census.samples += 1
                problem = pair_problem(header.get("chosen"), header.get("rejected"))
                if problem is None:
                    census.pairs += 1
                elif not census.first_bad:
                    census.first_bad = f"{ref.shard}:{ref.key}: {problem}"
    return census
