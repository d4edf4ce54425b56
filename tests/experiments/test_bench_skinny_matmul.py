"""experiments/bench_skinny_matmul.py (run by experiments/gpu_check.sh on a GPU): the dry run under Triton's
interpreter and its usage errors (the kernel itself: tests/models/test_cuda_matmul.py)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench_skinny_matmul.py"


def test_the_dry_run_times_every_shape_against_torch():
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--rows", "3"], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("MATMUL M=3 ")]
    assert [line.split()[2] for line in lines] == ["qkv", "down"]
    assert all(re.search(r"triton/torch [\d.]+$", line) for line in lines), lines
    assert "WRONG" not in done.stdout


@pytest.mark.parametrize("argv, env, message", [
    (["--device", "cpu", "--tiny", "--rows", "0"], {"TRITON_INTERPRET": "1"}, "--rows must be positive, got 0"),
    (["--device", "cpu", "--tiny"], {"TRITON_INTERPRET": "0"}, "set TRITON_INTERPRET=1"),
])
def test_usage_errors(argv, env, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
