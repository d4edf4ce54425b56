"""The fidelity script's noise floor: how closely steps of one shape agree with each other."""
import importlib.util
from pathlib import Path

import pytest

from framework.sim.cost_model import BatchShape

spec = importlib.util.spec_from_file_location(
    "sim_fidelity", Path(__file__).resolve().parents[2] / "experiments" / "sim_fidelity.py")
sim_fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_fidelity)


def decode_shape(num_reqs: int, context: int) -> BatchShape:
    shape = BatchShape()
    for _ in range(num_reqs):
        shape.add_row(context, 1, True)
    return shape


def test_noise_floor_is_the_spread_within_shape_groups():
    # Group A (1 decode at ~100 tokens): times 1.0, 1.1, 0.9, 1.2, 1.0 around median 1.0;
    # group B (3 decodes): 2.0 x 5, no spread; a context 16 tokens away is another group.
    steps = [(decode_shape(1, 100 + i), t) for i, t in enumerate([1.0, 1.1, 0.9, 1.2, 1.0])]
    steps += [(decode_shape(3, 200), 2.0)] * 5
    steps += [(decode_shape(1, 140), 5.0)] * 4          # a group of 4: too small to count
    # Deviations: A -> 0, .1, .1, .2, 0 ; B -> 0 x 5: median of ten values is 0.
    assert sim_fidelity.noise_floor(steps) == 0.0
    steps += [(decode_shape(1, 104), 1.3), (decode_shape(1, 105), 1.3)]
    # A's median is now 1.1 (1.0,1.1,0.9,1.2,1.0,1.3,1.3); 12 deviations, six of them 0 (B) ...
    floor = sim_fidelity.noise_floor(steps)
    devs = sorted([abs(t / 1.1 - 1) for t in [1.0, 1.1, 0.9, 1.2, 1.0, 1.3, 1.3]] + [0.0] * 5)
    assert floor == pytest.approx((devs[5] + devs[6]) / 2)
    assert floor > 0


def test_noise_floor_without_large_groups_is_none():
    assert sim_fidelity.noise_floor([(decode_shape(1, 10), 1.0)] * 4) is None


@pytest.mark.parametrize("argv, message", [
    (["--calibration", "no-such-calibration.yaml"], "calibration file 'no-such-calibration.yaml' does not exist"),
    (["--model", "tiny-lama"], "model 'tiny-lama' is neither a preset"),
    (["--model", "llama-3-8b"], "--model llama-3-8b is a shape-only preset (no weights)"),  # the real runs need weights
    (["--calibration", "c.yaml", "--save-calibration", "s.yaml"], "give one of them"),  # silently wrote nothing
    # Failed after the real run, its results lost.
    (["--save-calibration", "/dev/null/s.yaml"], "--save-calibration /dev/null/s.yaml: /dev/null is a file, not a folder"),
])
def test_a_bad_model_or_calibration_is_a_usage_error_before_any_real_run(argv, message, monkeypatch, capsys):
    """Either used to fail with a traceback, the calibration only after a real run of ~20 s."""
    monkeypatch.setattr(sim_fidelity, "serve", lambda *a, **k: pytest.fail("served"))
    monkeypatch.setattr(sim_fidelity, "real_run_with_calibration", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr("sys.argv", ["sim_fidelity.py", "--repeats", "1", *argv])
    with pytest.raises(SystemExit) as exit_:
        sim_fidelity.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--profile-repeats", "0"], "--profile-repeats must be at least 1, got 0"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
])
def test_a_zero_count_is_a_usage_error_before_any_real_run(argv, message, monkeypatch, capsys):
    """--profile-repeats 0 used to fail in calibrate after a real run of ~20 s; --repeats 0
    printed a table with no rows."""
    monkeypatch.setattr(sim_fidelity, "serve", lambda *a, **k: pytest.fail("served"))
    monkeypatch.setattr(sim_fidelity, "real_run_with_calibration", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr("sys.argv", ["sim_fidelity.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        sim_fidelity.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_save_calibration_makes_its_folder(tmp_path, monkeypatch):
    """A calibration path in a folder yet to be made is valid: the folder is made when the calibration is written."""

    class Saved(Exception):
        pass

    real_engine = sim_fidelity.LLMEngine

    def engine(config, *args, **kwargs):  # the simulation after the save: the test is over
        if config.executor_options.get("cost_model", {}).get("calibration") == {"fitted": 1}:
            raise Saved
        return real_engine(config, *args, **kwargs)

    monkeypatch.setattr(sim_fidelity, "real_run_with_calibration", lambda *a, **k: (None, [], {"fitted": 1}))
    monkeypatch.setattr(sim_fidelity, "LLMEngine", engine)
    target = tmp_path / "new" / "folder" / "cal.yaml"
    monkeypatch.setattr("sys.argv", ["sim_fidelity.py", "--repeats", "1", "--save-calibration", str(target)])
    with pytest.raises(Saved):
        sim_fidelity.main()
    assert target.read_text() == "{fitted: 1}\n"  # flow style, as the script writes it
