"""A reward with variance from the first step, so short test runs really update the
policy (the demo's slot reward is 0 until the format is learned)."""


def distinct_words(completion: str, sample: dict) -> float:
    return len(set(completion.split())) / 16


def varied(completion: str, sample: dict) -> float:
    """Differs between any two completions with different characters (almost surely within a group
    of sampled completions), so every step of a short test run has a gradient."""
    return sum(map(ord, completion)) % 11 / 10
