"""experiments/machine_noise.py: window medians, ratios and correlations, and a short real run."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

spec = importlib.util.spec_from_file_location(
    "machine_noise", Path(__file__).resolve().parents[2] / "experiments" / "machine_noise.py")
machine_noise = importlib.util.module_from_spec(spec)
spec.loader.exec_module(machine_noise)


def test_summary_names_the_probe_that_moves_with_the_steps():
    step = np.repeat([2.0, 3.0, 2.0, 4.0], 10)  # four windows of 10
    follows = step / 4 + np.tile([0.0, 0.01], 20)  # the same spells, a little jitter inside windows
    flat = np.repeat([1.0, 1.02, 1.02, 1.0], 10)  # moves 2%, not with the steps
    summary = machine_noise.summarize({"step": step, "follows": follows, "flat": flat}, window=10)
    assert summary["step"]["window_medians"] == [2.0, 3.0, 2.0, 4.0]
    assert summary["step"]["max_over_min"] == pytest.approx(2.0)
    assert summary["follows"]["corr_with_step"] == pytest.approx(1.0)
    assert summary["follows"]["max_over_min"] == pytest.approx(1.005 / 0.505)
    assert summary["flat"]["max_over_min"] == pytest.approx(1.02)
    assert summary["flat"]["corr_with_step"] == pytest.approx(-0.30, abs=0.01)
    assert machine_noise.summarize({"step": step, "flat": np.ones(40)}, window=10)["flat"]["corr_with_step"] is None
    with pytest.raises(ValueError, match="fewer than two windows of 30: measure longer"):
        machine_noise.summarize({"step": step}, window=30)


def test_steps_are_taken_at_a_typical_context():
    positions = np.tile(np.arange(4), 3)  # three requests of four steps, each step slower than the last
    step = 1.0 + 0.5 * positions
    assert np.allclose(machine_noise.at_typical_context(step, positions), np.median(step))
    step[4:8] *= 1.2  # the machine slowed during the second request
    normal = machine_noise.at_typical_context(step, positions)
    assert np.allclose(normal[4:8], normal[4:8][0]) and normal[4] > normal[0] == normal[8]
    # One request and the start of a second: the positions only the first reached would come
    # out exactly typical whatever the machine did (a whole run of one request, a flat table).
    with pytest.raises(ValueError, match="2 of 4 step positions were reached by one request only"):
        machine_noise.at_typical_context(step[:6], positions[:6])


def test_a_short_run_times_decode_steps_and_every_probe(capsys):
    summary = machine_noise.main(["--seconds", "2", "--window", "10", "--max-tokens", "8"])
    assert set(summary) == {"step", "python", "torch_ops", "gemm", "memory"}
    windows = {len(s["window_medians"]) for s in summary.values()}
    assert len(windows) == 1 and windows.pop() >= 2  # every series has a value per step
    assert all(m > 0 for s in summary.values() for m in s["window_medians"])
    assert "correlation with the steps" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    # --seconds 0 or -1 used to end in numpy's "zero-size array to reduction operation maximum",
    # a run too short for two windows in a ValueError traceback.
    (["--seconds", "0"], "--seconds must be a positive number, got 0.0"),
    (["--seconds", "-1"], "--seconds must be a positive number"),
    (["--seconds", "nan"], "--seconds must be a positive number"),
    (["--seconds", "0.5", "--window", "100000", "--max-tokens", "4"], "fewer than two windows of 100000"),
    # A run of one long request used to print a table of identical medians, with no word.
    (["--seconds", "0.5", "--window", "5", "--max-tokens", "3000"], "reached by one request only"),
])
def test_bad_arguments_are_usage_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        machine_noise.main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_no_steps_at_a_typical_context_are_no_steps():
    assert machine_noise.at_typical_context(np.array([]), np.array([], dtype=np.int64)).size == 0
