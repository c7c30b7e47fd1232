"""A reward with variance from the first step, so short test runs really update the
policy (the demo's slot reward is 0 until the format is learned)."""

import hashlib
import json


def distinct_words(completion: str, sample: dict) -> float:
    return len(set(completion.split())) / 16


def varied(completion: str, sample: dict) -> float:
    """Differs between any two completions with different characters (almost surely within a group
    of sampled completions), so every step of a short test run has a gradient."""
    return sum(map(ord, completion)) % 11 / 10


def half_flat(completion: str, sample: dict) -> float:
    """About half the prompts (by a hash of the sample) score every completion 0.5, a group without
    spread for dynamic sampling to drop; the others score like `distinct_words`."""
    key = hashlib.sha256(json.dumps(sample, sort_keys=True, default=str).encode()).digest()
    return 0.5 if key[0] % 2 else distinct_words(completion, sample)
