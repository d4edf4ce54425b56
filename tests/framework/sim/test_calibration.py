"""The least-squares fit behind ``framework.profile``: it recovers known parameters."""
import itertools
import random

import numpy as np
import pytest

from framework.sim.calibration import fit_max_linear, nnls, predict
from framework.sim.cost_model import BatchShape
from framework.sim.cost_models.roofline import RooflineCostModel
from framework.sim.hardware import load_hardware
from models.config import ModelConfig
from models.presets import PRESETS


def test_nnls_matches_brute_force_over_active_sets():
    rng = np.random.default_rng(0)
    for _ in range(20):
        A = rng.normal(size=(12, 4))
        b = rng.normal(size=12)
        x = nnls(A, b)
        assert (x >= 0).all()
        best = np.inf
        for k in range(5):  # the optimum is an unconstrained fit on some subset, clipped nowhere
            for subset in itertools.combinations(range(4), k):
                z = np.zeros(4)
                if subset:
                    z[list(subset)] = np.linalg.lstsq(A[:, subset], b, rcond=None)[0]
                if (z >= 0).all():
                    best = min(best, float(np.sum((A @ z - b) ** 2)))
        assert float(np.sum((A @ x - b) ** 2)) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_fit_of_a_max_of_linear_model_recovers_its_parameters():
    # t = max(a * x, b * y) + c, sampled on both sides of the ridge.
    rng = random.Random(1)
    rows, times = [], []
    for _ in range(60):
        x, y = rng.uniform(0, 1), rng.uniform(0, 1)
        groups = [[(0, x), (1, y)], [(2, 1.0)]]
        rows.append((0.0, groups))
        times.append(predict(0.0, groups, [3.0, 2.0, 0.5]))
    theta = fit_max_linear(rows, times, [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    assert theta == pytest.approx([3.0, 2.0, 0.5], rel=1e-6)


def test_more_alternations_never_fit_worse_even_when_the_leg_choices_cycle():
    # Random max-of-linear problems where the model cannot fit the times exactly, so the
    # alternation between leg choices and solves may wander off its best iterate.
    rng = np.random.default_rng(0)
    for _ in range(100):
        rows = [(0.0, [[(int(i), float(rng.uniform(0.1, 2))) for i in rng.choice(3, 2, replace=False)]
                       for _ in range(rng.integers(1, 3))]) for _ in range(rng.integers(2, 5))]
        times = rng.uniform(0.5, 3, len(rows))
        start = list(rng.uniform(0.1, 2, 3))

        def error(theta):
            return sum((predict(o, g, theta) / t - 1) ** 2 for (o, g), t in zip(rows, times))

        first = fit_max_linear(rows, times, start, [0.0] * 3, max_iter=1)
        assert error(fit_max_linear(rows, times, start, [0.0] * 3)) <= error(first) * (1 + 1e-12)


TRUTH = dict(matmul_efficiency=0.3, memory_efficiency=0.9, attention_efficiency=0.05, kv_efficiency=0.4,
             step_overhead_us=800.0, seq_overhead_us=30.0, token_overhead_us=2.0)


def grid_samples(model, counts=(1, 2, 4, 8, 16, 32, 64), lengths=(16, 64, 256, 1024), noise=0.0, seed=0):
    """A prefill and a decode shape per (count, length), timed by ``model`` (times ``1 + noise * N(0, 1)``)."""
    rng = np.random.default_rng(seed)
    samples = []
    for m, length in itertools.product(counts, lengths):
        for shape in (BatchShape(num_seqs=m, num_tokens=m * length, num_sampled=m, num_prefill_seqs=m,
                                 prefill_tokens=m * length, prefill_context=m * length,
                                 prefill_pairs=m * length * (length + 1) // 2),
                      BatchShape(num_seqs=m, num_tokens=m, num_sampled=m, num_decode_seqs=m,
                                 decode_context=m * (length + 1))):
            samples.append((shape, model.step_time(shape) * (1 + noise * rng.standard_normal())))
    return samples


def squared_error(model, samples):
    return sum((model.step_time(shape) / t - 1) ** 2 for shape, t in samples)


@pytest.mark.parametrize("curve", [None, {1: 0.0, 2: 1.0, 4: 1.5, 8: 3.0, 16: 2.5, 32: 2.5, 64: 4.0}])
def test_roofline_calibration_recovers_efficiencies_and_overheads_from_its_own_times(curve):
    cfg = ModelConfig.from_hf(PRESETS["tiny-llama"])
    hw = load_hardware("cpu")
    samples = grid_samples(RooflineCostModel(cfg, hw, 4, extra_weight_passes=curve, **TRUTH))
    fitted = RooflineCostModel.calibrate(samples, cfg, hw, 4)
    refit = RooflineCostModel(cfg, hw, 4, **fitted)
    for shape, t in samples:
        assert refit.step_time(shape) == pytest.approx(t, rel=1e-6)
    for name in ("matmul_efficiency", "attention_efficiency", "step_overhead_us", "seq_overhead_us",
                 "token_overhead_us"):
        assert fitted[name] == pytest.approx(TRUTH[name], rel=1e-4), name
    # Knots at the decode batch sizes measured; a curve that is not there fits as zeros.
    expected = curve or dict.fromkeys([1, 2, 4, 8, 16, 32, 64], 0.0)
    assert fitted["extra_weight_passes"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_with_noise_the_curve_never_fits_worse_than_the_roofline_without_it(seed):
    cfg = ModelConfig.from_hf(PRESETS["tiny-llama"])
    hw = load_hardware("cpu")
    samples = grid_samples(RooflineCostModel(cfg, hw, 4, **TRUTH), noise=0.05, seed=seed)
    with_curve = RooflineCostModel(cfg, hw, 4, **RooflineCostModel.calibrate(samples, cfg, hw, 4))
    probe = RooflineCostModel(cfg, hw, 4)  # the fit without a curve, as calibrate ran it before the curve
    theta = fit_max_linear([probe.legs(shape) for shape, _ in samples], [t for _, t in samples],
                           probe.fit_vector(), [0.01] * 4 + [0.0] * 3)
    plain = [predict(*probe.legs(shape), theta) for shape, _ in samples]
    assert squared_error(with_curve, samples) <= sum((p / t - 1) ** 2 for p, (_, t) in zip(plain, samples)) + 1e-12


def test_one_decode_batch_size_fits_no_curve():
    cfg = ModelConfig.from_hf(PRESETS["tiny-llama"])
    hw = load_hardware("cpu")
    fitted = RooflineCostModel.calibrate(grid_samples(RooflineCostModel(cfg, hw, 4, **TRUTH), counts=(1,)), cfg, hw, 4)
    assert "extra_weight_passes" not in fitted and RooflineCostModel(cfg, hw, 4, **fitted).extra_weight_passes == {}


def test_calibration_needs_enough_positive_samples():
    cfg = ModelConfig.from_hf(PRESETS["tiny-llama"])
    shape = BatchShape(num_seqs=1, num_tokens=1, num_sampled=1, num_decode_seqs=1, decode_context=5)
    with pytest.raises(ValueError, match="at least 7 measured steps"):
        RooflineCostModel.calibrate([(shape, 0.01)] * 3, cfg, load_hardware("cpu"), 4)
    with pytest.raises(ValueError, match="must be > 0"):
        fit_max_linear([(0.0, [[(0, 1.0)]])], [0.0], [1.0], [0.0])
