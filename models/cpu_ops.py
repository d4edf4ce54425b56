"""The model's C++ operators for CPUs (``models/csrc``), built on first use: the fused elementwise ones, and the
bf16 linear layers on AMX tiles."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from framework.common.registry import UnavailableError
from framework.execution.cpp_extension import load_cpu_extension
from framework.execution.cpu_features import cpu_has_amx_bf16

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_fused_ops.cpp"
AMX_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_amx_linear.cpp"
AMX_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mamx-tile", "-mamx-bf16")


def fused_ops() -> ModuleType:
    """The module with ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``qkv_rotary``,
    ``qkv_rotary_into_cache`` and the sampler's ``argmax_rows`` (see the source); UnavailableError when it
    cannot be built here."""
    # No FMA contraction: float32 results then round as transformers' separate multiplies and adds.
    return load_cpu_extension("fused_ops", SOURCE, "the fused C++ operators for CPUs", ("-ffp-contract=off",))


def amx_linear() -> ModuleType:
    """The module with ``pack_weight`` and ``amx_linear`` (see the source); UnavailableError, naming why, where
    this CPU has no AMX bf16 tiles, the build fails, or Linux does not grant this process the tiles."""
    if not cpu_has_amx_bf16():
        raise UnavailableError("this CPU has no AMX tiles for bf16 (amx_tile and amx_bf16 in /proc/cpuinfo)")
    # Every CPU with the tiles has AVX-512, which the kernel's rounding uses, whatever torch's own capability is set
    # to (ATEN_CPU_CAPABILITY=avx2 would otherwise leave it out of the build flags).
    module = load_cpu_extension("amx_linear", AMX_SOURCE, "the AMX linear layers for CPUs", AMX_FLAGS)
    if not module.available():
        raise UnavailableError("Linux did not grant this process the AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM; "
                               "Linux 5.16 or later)")
    return module
