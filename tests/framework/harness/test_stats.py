"""Means and 95% t intervals over repeats, checked against hand-computed values."""
import math

import pytest

from framework.harness.stats import mean_ci95, overlap, t975


def test_t_quantiles_match_the_table_and_the_expansion_past_it():
    assert t975(1) == 12.7062 and t975(2) == 4.3027 and t975(30) == 2.0423
    # Past the table: within 1e-4 of Student's t (values from numerical integration of its density).
    for df, expected in ((31, 2.0395), (40, 2.0211), (60, 2.0003), (120, 1.9799)):
        assert t975(df) == pytest.approx(expected, abs=1e-4)
    assert t975(10 ** 9) == pytest.approx(1.95996, abs=1e-5)
    with pytest.raises(ValueError, match="at least 1"):
        t975(0)


def test_mean_and_interval_of_three_repeats():
    # 10, 12, 14: mean 12, s = 2, half-width t(0.975, 2) * 2 / sqrt(3) = 4.3027 * 1.1547 = 4.9683.
    mean, low, high = mean_ci95([10.0, 12.0, 14.0])
    assert mean == 12.0
    assert (low, high) == pytest.approx((12 - 4.3027 * 2 / math.sqrt(3), 12 + 4.3027 * 2 / math.sqrt(3)))
    assert high - mean == pytest.approx(4.9683, abs=1e-4)


def test_too_few_values_give_no_interval():
    assert mean_ci95([]) == (None, None, None)
    assert mean_ci95([5.0]) == (5.0, None, None)
    assert mean_ci95([5.0, None, math.nan]) == (5.0, None, None)  # unknowns left out
    assert mean_ci95([3.0, 3.0]) == (3.0, 3.0, 3.0)


def test_overlap():
    assert overlap((1.0, 2.0), (1.5, 3.0)) is True
    assert overlap((1.0, 2.0), (2.0, 3.0)) is True  # touching
    assert overlap((1.0, 2.0), (2.1, 3.0)) is False
    assert overlap((None, None), (1.0, 2.0)) is None


def test_overlap_does_not_depend_on_the_order_of_the_intervals():
    assert overlap((2.1, 3.0), (1.0, 2.0)) is False
    assert overlap((5.0, 6.0), (1.0, 2.0)) is False and overlap((1.0, 2.0), (5.0, 6.0)) is False
    assert overlap((1.0, 2.0), (None, None)) is None and overlap((1.0, 2.0), (1.5, None)) is None
