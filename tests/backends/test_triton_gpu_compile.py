"""The Triton kernels compile for an NVIDIA GPU even where there is none. The interpreter checks
their numerics but none of the GPU's rules (tl.dot tile minimums, shared memory, what the
compiler accepts), so this lowers them for sm_90 with the ptxas bundled in Triton's wheel."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def has_nvidia_backend() -> bool:
    """Looked up on disk, without importing triton into the test process."""
    spec = importlib.util.find_spec("triton")
    return spec is not None and (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.slow
@pytest.mark.skipif(not has_nvidia_backend(), reason="this Triton build has no NVIDIA backend")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.backends.gpu_compile", "90"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("attention ") == 20 and out.stdout.count(" rotary: ") == 4 and out.stdout.count("store_kv ") == 5
    assert out.stdout.count("matmul bf16 ") == 19
    assert out.stdout.count("prefetch=True: ok") == out.stdout.count("prefetch=False: ok") == 5
