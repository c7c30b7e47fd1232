"""The two-sample chi-square test the sampling-distribution tests share."""

import math


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def two_sample_chi2(a: dict, b: dict, min_count: int = 10) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom for two samples of counts {value: count};
    values seen fewer than min_count times in both together are pooled into one cell."""
    keys = [t for t in set(a) | set(b) if a.get(t, 0) + b.get(t, 0) >= min_count]
    rare = [t for t in set(a) | set(b) if t not in keys]
    cells = [(a.get(t, 0), b.get(t, 0)) for t in keys]
    if rare:
        cells.append((sum(a.get(t, 0) for t in rare), sum(b.get(t, 0) for t in rare)))
    na, nb = sum(x for x, _ in cells), sum(y for _, y in cells)
    chi2 = sum(
        (obs - (x + y) * n / (na + nb)) ** 2 / ((x + y) * n / (na + nb))
        for x, y in cells
        for obs, n in ((x, na), (y, nb))
    )
    return chi2, len(cells) - 1


def tally_positions(counts: list[dict], rollouts) -> None:
    """Add each rollout's token at positions 0..len(counts)-1 to counts (-1: the completion ended)."""
    for r in rollouts:
        for pos, c in enumerate(counts):
            tok = r.completion_ids[pos] if pos < len(r.completion_ids) else -1
            c[tok] = c.get(tok, 0) + 1


def assert_same_per_position(a: list[dict], b: list[dict], min_df: int) -> None:
    """At every position, the two samples' token counts pass the chi-square test at p = 0.001."""
    for pos, (ca, cb) in enumerate(zip(a, b)):
        chi2, df = two_sample_chi2(ca, cb)
        assert df >= min_df
        assert chi2 < chi2_critical(df), f"position {pos}: chi2 {chi2:.1f} over {df} df"


def fit_chi2(observed: dict, expected: dict, n: int, min_expected: float = 5.0) -> tuple[float, int, list]:
    """Goodness-of-fit chi-square of n draws counted in observed {value: count} against the
    probabilities expected {value: p} (values absent from expected are pooled with the rare ones,
    those of expected count < min_expected, into one cell, itself merged into the smallest other
    cell while its expected count is below min_expected). Returns chi2, df and the cells
    (value, observed, expected), largest contribution first."""
    keep = sorted((v for v, p in expected.items() if p * n >= min_expected), key=lambda v: -expected[v])
    cells = [([v], observed.get(v, 0), expected[v] * n) for v in keep]
    rest = (["rest"], n - sum(o for _, o, _ in cells), n - sum(e for _, _, e in cells))
    while rest[2] < min_expected and cells:  # too small a cell for the chi-square: merge it
        v, o, e = cells.pop()
        rest = (v + rest[0], o + rest[1], e + rest[2])
    cells.append(rest)
    cells = [c for c in cells if c[2] > 1e-12 or c[1] > 0]
    terms = [((o - e) ** 2 / e if e > 1e-12 else math.inf, v, o, e) for v, o, e in cells]
    terms.sort(key=lambda t: -t[0])
    return sum(t[0] for t in terms), len(cells) - 1, [(v, o, round(e, 1)) for _, v, o, e in terms]


def assert_fits(observed: dict, expected: dict, n: int, what: str = "", min_df: int = 1) -> None:
    """The counts pass the goodness-of-fit chi-square against expected at p = 0.001."""
    chi2, df, cells = fit_chi2(observed, expected, n)
    assert df >= min_df, f"{what}: {df} df, too few cells for the test to say anything"
    assert chi2 < chi2_critical(df), f"{what}: chi2 {chi2:.1f} over {df} df; worst cells {cells[:4]}"


def tally_prefixes(counts: dict, rollouts, depth: int) -> None:
    """Add each rollout's first `depth` tokens (fewer where it ended: EOS) as a tuple to counts."""
    for r in rollouts:
        key = tuple(r.completion_ids[:depth])
        counts[key] = counts.get(key, 0) + 1
