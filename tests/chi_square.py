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
    chi2 = sum((obs - (x + y) * n / (na + nb)) ** 2 / ((x + y) * n / (na + nb))
               for x, y in cells for obs, n in ((x, na), (y, nb)))
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
