"""Arrival processes: all at once, Poisson at a rate, or gamma with a burstiness factor.

As in ``vllm bench serve``: the gaps between requests are gamma distributed with shape
``burstiness`` and mean ``1 / rate``. ``burstiness == 1`` is a Poisson process; smaller values
are burstier (same mean rate, larger variance), larger values more regular.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from framework.common.config import is_finite_number


#: The longest a synthetic workload's arrivals may spread (float64 seconds keep sub-microsecond steps below it).
MAX_SPAN_S = 1e9


def check_rate(rate: float | None, burstiness: float = 1.0, what: str = "rate") -> None:
    # An infinite rate is all at once too; a bool is no rate.
    if rate is not None and not (isinstance(rate, numbers.Real) and not isinstance(rate, bool) and rate > 0):
        raise ValueError(f"{what} must be a positive number of requests per second, or null for all at once; got {rate!r}")
    if not (is_finite_number(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be > 0 (1 = Poisson, < 1 burstier, > 1 more regular); got {burstiness!r}")


def arrival_times(n: int, rate: float | None, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds, non-decreasing) of ``n`` requests, the first after one gap; all 0 for a
    ``rate`` of None or inf. Gaps are drawn at unit rate and divided by ``rate``, so another rate
    only rescales the same times."""
    if isinstance(rate, float) and math.isinf(rate):
        rate = None
    check_rate(rate, burstiness)
    if rate is None:
        return np.zeros(n)
    if n / rate > MAX_SPAN_S:
        raise ValueError(f"rate {rate:g} spreads {n} requests over about {n / rate:.3g} s, more than {MAX_SPAN_S:g} s "
                         f"(30 years): simulated times that large lose step durations to float rounding; raise the rate")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=n)
    return np.cumsum(gaps) / rate
