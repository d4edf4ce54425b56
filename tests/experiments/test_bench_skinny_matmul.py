"""experiments/bench_skinny_matmul.py (run by experiments/gpu_check.sh on a GPU): the split-K kernel against
a float64 product under Triton's interpreter, the dry run, and its usage errors."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.triton_paged import import_interpreted

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench_skinny_matmul.py"


@pytest.mark.parametrize("m, n, k, block_n, block_k, splits", [
    (5, 40, 100, 32, 32, 1),   # partial tiles everywhere, one split (stored directly)
    (5, 40, 100, 32, 32, 3),   # three splits summed; the last split shorter
    (17, 64, 64, 64, 16, 8),   # more splits than K holds: fewer run
])
def test_split_k_products_equal_a_float64_product(m, n, k, block_n, block_k, splits):
    bench = import_interpreted("experiments.bench_skinny_matmul")
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    got = bench.splitk_linear(x, w, bench.Config(block_n, block_k, splits))
    assert got.shape == (m, n)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)


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
