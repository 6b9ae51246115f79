"""A two-sample chi-square test of homogeneity (Pearson), for the distribution tests of speculative sampling."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable

import torch


def chi_square_p_value(sample_a: Iterable[Hashable], sample_b: Iterable[Hashable], min_expected: float = 5.0) -> float:
    """P-value that two samples come from one categorical distribution.

    Categories whose pooled expected count in either sample is below ``min_expected`` are merged into one
    (Cochran's rule); the statistic is compared with chi-square on ``categories - 1`` degrees of freedom
    (its survival function is the regularized upper incomplete gamma function).
    """
    counts_a, counts_b = Counter(sample_a), Counter(sample_b)
    n_a, n_b = sum(counts_a.values()), sum(counts_b.values())
    cells: list[tuple[int, int]] = []
    rare = [0, 0]
    for key in counts_a.keys() | counts_b.keys():
        a, b = counts_a[key], counts_b[key]
        pooled = (a + b) / (n_a + n_b)
        if min(pooled * n_a, pooled * n_b) < min_expected:
            rare[0] += a
            rare[1] += b
        else:
            cells.append((a, b))
    if sum(rare):
        cells.append((rare[0], rare[1]))
    if len(cells) < 2:
        return 1.0
    statistic = 0.0
    for a, b in cells:
        pooled = (a + b) / (n_a + n_b)
        statistic += (a - pooled * n_a) ** 2 / (pooled * n_a) + (b - pooled * n_b) ** 2 / (pooled * n_b)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))
