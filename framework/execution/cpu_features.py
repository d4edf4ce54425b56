"""What this CPU's instruction set offers the engine's choices of kernel."""
from __future__ import annotations

from pathlib import Path

import torch

#: CPU flags (``/proc/cpuinfo``) of matrix or dot-product instructions per half-precision dtype.
MATMUL_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


def cpu_has_matmul_instructions(dtype: torch.dtype, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies ``dtype`` matrices natively; True where its flags cannot be read."""
    try:
        flags = next(line for line in Path(cpuinfo).read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return True
    return any(flag in flags for flag in MATMUL_FLAGS.get(dtype, ()))
