"""Means and 95% confidence intervals over a configuration's repeats (Student's t; no scipy).

The interval of ``n`` values is ``mean +- t(0.975, n - 1) * s / sqrt(n)`` with ``s`` the sample
standard deviation: exact for normally distributed repeats, and the usual choice for the 3-10 repeats
a sweep affords (a bootstrap needs more). The t quantiles are tabulated to 4 decimals up to 30
degrees of freedom; beyond, the Cornish-Fisher expansion around the normal quantile (error < 1e-4).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

#: t(0.975, df) for df = 1 .. 30.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
_Z975 = 1.959963984540054


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    # Abramowitz and Stegun 26.7.5, three terms past the normal quantile.
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def mean_ci95(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """``(mean, low, high)`` of ``values`` (non-finite ones left out): the 95% t interval of the
    mean; ``low`` and ``high`` are None for fewer than two values, everything for none."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return None, None, None
    mean = math.fsum(v) / len(v)
    if len(v) < 2:
        return mean, None, None
    s = math.sqrt(math.fsum((x - mean) ** 2 for x in v) / (len(v) - 1))
    half = t975(len(v) - 1) * s / math.sqrt(len(v))
    return mean, mean - half, mean + half


def overlap(a: tuple[float | None, float | None], b: tuple[float | None, float | None]) -> bool | None:
    """Whether intervals ``(low, high)`` ``a`` and ``b`` overlap (then their means differ by no more
    than noise explains); None when either is unknown."""
    if None in (*a, *b):
        return None
    return a[0] <= b[1] and b[0] <= a[1]  # type: ignore[operator]
