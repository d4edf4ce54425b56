"""Host memory: keep freed memory in the process, so CPU forward passes reuse their activation
buffers; zeros that take memory only as they are written; move host arrays to the device through
pinned memory."""
from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys

import numpy as np
import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
#: glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); bigger blocks are always mapped.
MAX_MMAP_THRESHOLD = 32 << 20
#: Environment variables through which a user tunes glibc malloc; if any is set, it is left alone.
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_kept = False


def user_tuned_malloc() -> bool:
    """Whether the environment already sets glibc malloc's thresholds."""
    return any(name in os.environ for name in MALLOC_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Turn off heap trimming and raise the mmap threshold to its maximum (Linux with glibc, unless the
    user tuned malloc: ``MALLOC_ENV``, ``GLIBC_TUNABLES``), so the process keeps its peak heap.
    Returns whether malloc is set so, also by an earlier call."""
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux") or user_tuned_malloc():
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library already loaded into this process
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (musl has mallopt but ignores it)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # By default each step's activations land on fresh pages and page-fault (about 5x the faults, 7% slower
    # generation on a 2-core CPU). -1 turns trimming off (mallopt(3)); a fixed mmap threshold also stops
    # glibc from adjusting it as blocks are freed.
    _kept = mallopt(_M_TRIM_THRESHOLD, -1) == 1 and mallopt(_M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1
    if _kept:
        logger.debug("glibc malloc: trimming off, mmap threshold %d bytes", MAX_MMAP_THRESHOLD)
    return _kept


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU an anonymous mapping whose pages the OS maps, zeroed, on first write,
    so a KV cache of gigabytes takes memory (and start-up time) only as its blocks fill."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, numel * dtype.itemsize))  # page-aligned; the tensor keeps it alive
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (in ``dtype``, if given): on the CPU without a copy when the
    dtype is its own; elsewhere staged in pinned memory and copied without blocking the host, so the
    copy overlaps the step's earlier kernels and ``array`` may change as soon as this returns."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor if dtype is None else tensor.to(dtype)
    return tensor.pin_memory().to(device, dtype, non_blocking=True)
