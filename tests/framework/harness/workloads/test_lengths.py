"""Length distributions: the config forms, their statistics and their errors."""
import math

import numpy as np
import pytest

from framework.harness.workloads.lengths import LengthDist

N = 40_000


def sample(spec, n=N, seed=0):
    return LengthDist.parse(spec, "prompt_len").sample(np.random.default_rng(seed), n)


def test_fixed_and_uniform():
    assert set(sample(64, 100)) == {64}
    assert set(sample({"dist": "fixed", "value": 7}, 100)) == {7}
    u = sample([16, 20])
    assert set(u) == {16, 17, 18, 19, 20}  # inclusive on both ends
    assert np.bincount(u)[16:] / N == pytest.approx([0.2] * 5, abs=0.015)
    assert set(sample({"dist": "uniform", "min": 3, "max": 3}, 10)) == {3}


def test_normal_and_lognormal_match_the_requested_mean_and_std():
    n = sample({"dist": "normal", "mean": 200, "std": 30})
    assert n.mean() == pytest.approx(200, rel=0.01) and n.std() == pytest.approx(30, rel=0.03)
    ln = sample({"dist": "lognormal", "mean": 200, "std": 100, "max": 100_000})
    assert ln.mean() == pytest.approx(200, rel=0.02) and ln.std() == pytest.approx(100, rel=0.06)
    assert np.median(ln) < ln.mean()  # right-skewed
    clipped = sample({"dist": "normal", "mean": 10, "std": 50, "min": 4, "max": 12})
    assert clipped.min() == 4 and clipped.max() == 12


@pytest.mark.parametrize("dist", ["normal", "lognormal"])
def test_normal_and_lognormal_lengths_are_rounded_to_the_nearest(dist):
    assert set(sample({"dist": dist, "mean": 10.6, "std": 0}, 100)) == {11}
    assert set(sample({"dist": dist, "mean": 10.4, "std": 0}, 100)) == {10}


def test_zipf_is_a_bounded_power_law():
    z = sample({"dist": "zipf", "a": 1.5, "min": 10, "max": 400})
    assert z.min() == 10 and z.max() <= 400
    counts = np.bincount(z - 10)
    # P(k) ~ k^-a: P(1)/P(2) = 2^1.5, P(1)/P(4) = 4^1.5.
    assert counts[0] / counts[1] == pytest.approx(2 ** 1.5, rel=0.08)
    assert counts[0] / counts[3] == pytest.approx(4 ** 1.5, rel=0.15)
    weights = np.arange(1, 392) ** -1.5
    assert (z == 10).mean() == pytest.approx(1 / weights.sum(), rel=0.03)


def test_same_seed_same_lengths():
    spec = {"dist": "lognormal", "mean": 50, "std": 20}
    assert np.array_equal(sample(spec, 20, seed=5), sample(spec, 20, seed=5))
    assert not np.array_equal(sample(spec, 20, seed=5), sample(spec, 20, seed=6))


@pytest.mark.parametrize("spec, match", [
    ({"dist": "poisson"}, "dist must be one of fixed, uniform, normal, lognormal, zipf"),
    ([10, 5], "max=5 is below min=10"),
    ([0, 5], "lengths must be >= 1"),
    ([1, 2, 3], r"\[min, max\]"),
    ({"dist": "uniform", "min": 2}, "needs .max."),
    ([2, None], "needs .max."),
    ({"dist": "normal", "mean": 10}, "needs .std."),
    ({"dist": "normal", "mean": 0, "std": 1}, "mean > 0 and std >= 0"),
    ({"dist": "normal", "mean": 10, "std": 1, "sigma": 2}, "unknown key"),
    ({"dist": "zipf", "a": 0, "max": 10}, "exponent"),
    ({"dist": "fixed"}, "needs 'value'"),
    (3.5, "expected an int"),
    ([1.5, 4], "min must be an integer"),
    ([None, 16], "min must be an integer"),
    ([True, 16], "min must be an integer"),
    ({"dist": "lognormal", "mean": "abc", "std": 3}, "mean must be a number"),
    ({"dist": "zipf", "a": None, "max": 10}, "a must be a number"),
])
def test_bad_specs_name_the_problem(spec, match):
    with pytest.raises(ValueError, match=f"prompt_len: .*{match}" if not match.startswith("prompt") else match):
        LengthDist.parse(spec, "prompt_len")


def test_lognormal_parameters_are_derived_not_given():
    d = LengthDist.parse({"dist": "lognormal", "mean": 100, "std": 0}, "x")
    assert set(d.sample(np.random.default_rng(0), 50)) == {100}
    assert math.isclose(d.mean, 100)
