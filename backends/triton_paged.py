"""Paged attention in Triton: one store-K/V launch and one attention launch per layer, for any
mix of decodes, full prefills, chunked prefills and prefix-cache hits (``triton_kernels.py``).

Without a CUDA device the kernels run through Triton's CPU interpreter (slow but exact): the backend
sets ``TRITON_INTERPRET=1`` itself, with a notice on stderr, before the kernels are decorated.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from framework.execution.attention import BACKENDS, AttentionBackend, AttentionMetadata
from framework.common.registry import UnavailableError

_KERNELS = "backends.triton_kernels"
INTERPRETER_NOTICE = ("servelab: no CUDA device for the triton attention backend; running its kernels "
                      "through Triton's CPU interpreter (TRITON_INTERPRET=1, numpy's BLAS on one thread). "
                      "Correct but slow.")


def load_kernels(device: torch.device) -> ModuleType:
    """Import the kernel module, first switching Triton to its interpreter when ``device`` is
    not a CUDA device. Raises UnavailableError without triton, or when the kernels were already
    compiled for CUDA in this process and ``device`` is not a CUDA device."""
    interpret = device.type != "cuda"
    module = sys.modules.get(_KERNELS)
    if module is None and interpret and not _interpreter_requested():
        os.environ["TRITON_INTERPRET"] = "1"
        print(INTERPRETER_NOTICE, file=sys.stderr, flush=True)
    if interpret:
        _single_threaded_numpy_blas()
    try:
        module = importlib.import_module(_KERNELS)
    except ImportError as exc:
        raise UnavailableError(f"the triton attention backend needs the triton package ({exc}); "
                               f"install it with `pip install triton`") from exc
    if interpret and not module.INTERPRETED:
        raise UnavailableError(
            f"the triton kernels were already compiled for CUDA in this process, so they cannot run on "
            f"device {device}; use a CUDA device, or start a new process with TRITON_INTERPRET=1")
    return module


def _interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` already turns the interpreter on, read as the installed Triton reads
    it (3.3 and later: 1/true/on/yes in any case; earlier: only "1"). False without triton: importing
    the kernels then reports it."""
    try:
        import triton
    except ImportError:
        return False
    if hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _single_threaded_numpy_blas() -> None:
    """Limit OpenBLAS (not torch) to one thread: the interpreter runs every ``tl.dot`` as a small numpy
    matmul, and waking the thread pool costs far more than such a product (30 ms against 0.02 ms)."""
    from threadpoolctl import ThreadpoolController

    ThreadpoolController().select(internal_api="openblas").limit(limits=1)


@dataclass
class TritonMetadata:
    common: AttentionMetadata
    launch: Any  # triton_kernels.LaunchPlan: tile sizes and work list, planned once per step (None: empty)


@BACKENDS.register("triton")
class TritonBackend(AttentionBackend):
    max_head_size = 256

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, dtype, device)
        self.kernels = load_kernels(self.device)

    def build_metadata(self, meta: AttentionMetadata) -> TritonMetadata:
        if not meta.num_reqs:  # an empty step: nothing to tile or launch
            return TritonMetadata(meta, None)
        qsl = meta.query_start_loc_cpu[: meta.num_reqs + 1]
        launch = self.kernels.plan(qsl, meta.seq_lens_cpu[: meta.num_reqs], self.num_heads, self.num_kv_heads,
                                   self.head_dim, meta.block_table.device)
        return TritonMetadata(meta, launch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache.stride(-1) != 1 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("the triton backend needs q, k, v and kv_cache contiguous in head_dim")
        out = torch.empty_like(q) if out is None else out
        common = meta.common
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.kernels.store_kv(k, v, k_cache, v_cache, common.slot_mapping)
        if meta.launch is None:
            return out
        return self.kernels.paged_attention(out, q, k_cache, v_cache, common.block_table, self.scale, meta.launch)
