"""What this CPU's instruction set offers the engine's choices of kernel."""
from __future__ import annotations

from pathlib import Path

import torch

#: CPU flags (``/proc/cpuinfo``) of matrix or dot-product instructions per half-precision dtype.
MATMUL_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}
#: The flags of Intel's AMX tiles with their bf16 products (``models.cpu_ops.amx_linear``).
AMX_BF16_FLAGS = ("amx_tile", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The first CPU's flags; None where ``cpuinfo`` cannot be read or lists none."""
    try:
        return set(next(line for line in Path(cpuinfo).read_text().splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return None


def cpu_has_matmul_instructions(dtype: torch.dtype, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies ``dtype`` matrices natively; True where its flags cannot be read."""
    flags = cpu_flags(cpuinfo)
    return flags is None or any(flag in flags for flag in MATMUL_FLAGS.get(dtype, ()))


def cpu_has_amx_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX tiles that multiply bf16; False where its flags cannot be read (a kernel using
    them would die of an illegal instruction)."""
    flags = cpu_flags(cpuinfo)
    return flags is not None and all(flag in flags for flag in AMX_BF16_FLAGS)
