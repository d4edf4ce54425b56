"""experiments/gpu_e2e.py (run by experiments/gpu_check.sh on a GPU): its usage errors, and a dry run of
the speed comparison on a tiny model on the CPU."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "gpu_e2e.py"


def run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_without_cuda_is_a_usage_error():
    done = run("speed")
    assert done.returncode == 2 and "CUDA is not available here; use --device cpu --tiny" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_speed_dry_run_compares_each_backend_with_transformers():
    done = run("speed", "--device", "cpu", "--tiny", "--batches", "3", "--tokens", "4", "--prompt-len", "12")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("E2E")]
    assert re.match(r"E2E batch 3: hf_generate \d+ tok/s .* roofline [\d.]+ ms$", lines[0])
    for backend, line in zip(["torch_paged", "triton"], lines[1:], strict=True):
        assert re.match(rf"E2E batch 3 {backend} +graphs=False +\d+ tok/s = [\d.]+x hf_generate; decode step "
                        rf"[\d.]+ ms = \d+% of the roofline; greedy == HF for 3/3$", line), line
