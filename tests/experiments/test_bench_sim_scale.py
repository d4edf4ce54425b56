"""experiments/bench_sim_scale.py: bad arguments are usage errors, before anything runs."""
import re
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
    (["--router", "bogus"], "--router bogus routes among replicas: give --replicas 2 or more"),  # one replica has no routing to do
])
def test_bad_arguments_are_usage_errors(argv, match, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), *argv, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert match in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, match", [
    # These ended in a traceback from Hydra or from the run.
    (["--replicas", "2", "--router", "bogus"], "error: Could not find 'cluster/bogus'; Available options in "
                                             "'cluster': .*prefix_aware"),
    (["--hardware", "h100"], "error: Could not find 'hardware/h100'; Available options in 'hardware': .*h100-sxm"),
    (["--model", "llama-3-7b"], "error: model 'llama-3-7b' is neither a preset .*llama-3-8b"),
    (["--", "+engine.max_num_seq=8"], r"error: engine: unknown key\(s\) max_num_seq; valid: .*max_num_seqs"),
])
def test_configuration_errors_are_one_clear_message(argv, match, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "20", "--out", str(tmp_path / "out"), *argv],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert re.search(match, done.stderr, re.S) and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "Config search path" not in done.stderr
