"""The model's fused elementwise operators for CPUs (``models/csrc``), built on first use."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from framework.execution.cpp_extension import load_cpu_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_fused_ops.cpp"


def fused_ops() -> ModuleType:
    """The module with ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``qkv_rotary``,
    ``qkv_rotary_into_cache`` and the sampler's ``argmax_rows`` (see the source); UnavailableError when it
    cannot be built here."""
    # No FMA contraction: float32 results then round as transformers' separate multiplies and adds.
    return load_cpu_extension("fused_ops", SOURCE, "the fused C++ operators for CPUs", ("-ffp-contract=off",))
