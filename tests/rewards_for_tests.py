"""A reward with variance from the first step, so short test runs really update the
policy (the demo's slot reward is 0 until the format is learned)."""


def distinct_words(completion: str, sample: dict) -> float:
    return len(set(completion.split())) / 16
