"""Arrival processes: rates and burstiness within statistical tolerance over many samples."""
import numpy as np
import pytest

from framework.harness.workloads.arrivals import arrival_times

N = 40_000


def gaps(rate, burstiness, seed=0):
    t = arrival_times(N, rate, burstiness, np.random.default_rng(seed))
    return np.diff(np.concatenate([[0.0], t]))


def test_all_at_once():
    assert not arrival_times(5, None, 1.0, np.random.default_rng(0)).any()
    assert not arrival_times(5, float("inf"), 1.0, np.random.default_rng(0)).any()


@pytest.mark.parametrize("rate", [2.0, 8.0, 50.0])
def test_poisson_rate_and_exponential_gaps(rate):
    g = gaps(rate, 1.0)
    # Mean gap 1/rate; an exponential's coefficient of variation is 1 and P(gap > mean) = 1/e.
    # Standard errors at N=40000 are ~0.5%; the tolerances are ~6 of them.
    assert g.mean() == pytest.approx(1 / rate, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.03)
    assert (g > 1 / rate).mean() == pytest.approx(np.exp(-1), abs=0.015)
    assert np.all(np.diff(arrival_times(100, rate, 1.0, np.random.default_rng(1))) >= 0)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_variance(burstiness):
    # Gamma gaps with shape k and mean 1/rate have CV^2 = 1/k: bursty below 1, regular above.
    g = gaps(8.0, burstiness)
    assert g.mean() == pytest.approx(1 / 8.0, rel=0.04)
    assert (g.std() / g.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.08)


def test_same_seed_same_times_and_rate_only_rescales():
    a = arrival_times(50, 4.0, 0.5, np.random.default_rng(3))
    assert np.array_equal(a, arrival_times(50, 4.0, 0.5, np.random.default_rng(3)))
    assert np.allclose(arrival_times(50, 8.0, 0.5, np.random.default_rng(3)), a / 2)
    assert not np.array_equal(a, arrival_times(50, 4.0, 0.5, np.random.default_rng(4)))


@pytest.mark.parametrize("rate, burstiness, match", [(0, 1.0, "rate"), (-2, 1.0, "rate"), ("fast", 1.0, "rate"),
                                                    (True, 1.0, "rate"), (float("nan"), 1.0, "rate"),
                                                    (4.0, 0, "burstiness"), (4.0, float("inf"), "burstiness")])
def test_bad_arguments(rate, burstiness, match):
    with pytest.raises(ValueError, match=match):
        arrival_times(3, rate, burstiness, np.random.default_rng(0))


def test_a_rate_spreading_arrivals_past_float_precision_is_refused():
    """At 1e-200 requests/s a 10 ms step is below the spacing of floats near the arrival times: every latency
    would be 0."""
    with pytest.raises(ValueError, match=r"^rate 1e-200 spreads 4 requests over about 4e\+200 s, more than 1e\+09 s"):
        arrival_times(4, 1e-200, 1.0, np.random.default_rng(0))
    assert arrival_times(4, 1e-8, 1.0, np.random.default_rng(0))[-1] > 1e7  # 4e8 s: within the limit
