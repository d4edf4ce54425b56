"""C++ kernels for CPUs (``backends/csrc``), built on first use (``framework.execution.cpp_extension``)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from framework.common.registry import UnavailableError
from framework.execution.cpp_extension import load_cpu_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_paged_decode.cpp"


def paged_decode() -> Callable[..., None]:
    """``paged_decode(q, k_cache, v_cache, block_table, table_rows, seq_lens, scale, out)`` (see the source);
    UnavailableError, naming what is missing, when it cannot be built here."""
    try:
        return load_cpu_extension("paged_decode", SOURCE, "the C++ attention kernel for CPUs").paged_decode
    except UnavailableError as exc:
        raise UnavailableError(f"{exc}; or set backend.decode_kernel=sdpa backend.prefill_kernel=sdpa") from exc
