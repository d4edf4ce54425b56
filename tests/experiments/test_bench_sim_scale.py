"""experiments/bench_sim_scale.py: bad arguments are usage errors, before anything runs."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_sim_scale.py"


@pytest.mark.parametrize("argv, match", [
    # --replicas 0 used to run one replica silently; --requests 0 and --rate -1 ended in a
    # ValueError traceback from the workload.
    (["--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--requests", "0"], "--requests must be at least 1, got 0"),
    (["--tp", "0"], "--tp must be at least 1, got 0"),
    (["--rate", "-1"], "--rate must be a positive number"),
    (["--rate", "0"], "--rate must be a positive number"),
])
def test_bad_arguments_are_usage_errors(argv, match, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), *argv, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert match in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
