"""Paged attention in Triton: one store-K/V launch and one attention launch per layer, for any
mix of decodes, full prefills, chunked prefills and prefix-cache hits (``triton_kernels.py``).

On a CUDA device the kernels are compiled; on any other they run through Triton's CPU interpreter
(slow but exact) from a second copy of the kernel module, decorated with the interpreter switched on
for that import only, so the two coexist in one process and nothing else in it runs interpreted.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from framework.execution.attention import BACKENDS, AttentionBackend, AttentionMetadata
from framework.common.registry import UnavailableError

_KERNELS = "backends.triton_kernels"
INTERPRETER_NOTICE = ("servelab: the triton attention backend on a CPU runs its kernels through Triton's "
                      "interpreter (numpy's BLAS on one thread). Correct but slow.")


def load_kernels(device: torch.device) -> ModuleType:
    """The kernel module for ``device``: compiled for a CUDA device (interpreted only if the user's
    ``TRITON_INTERPRET`` says so), interpreted for any other. UnavailableError without triton."""
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        raise UnavailableError(f"the triton attention backend needs the triton package ({exc}); "
                               f"install it with `pip install triton`") from exc
    if device.type == "cuda":
        return importlib.import_module(_KERNELS)
    if _KERNELS + INTERPRETED_SUFFIX not in sys.modules:
        print(INTERPRETER_NOTICE, file=sys.stderr, flush=True)
    module = import_interpreted(_KERNELS)
    assert module.INTERPRETED, "the kernels were not decorated for the interpreter"
    _single_threaded_numpy_blas()
    return module


#: The interpreted copy of a kernel module is that source executed as this name plus the suffix.
INTERPRETED_SUFFIX = "_interpreted"


def import_interpreted(name: str) -> ModuleType:
    """Module ``name`` executed once more as ``name + INTERPRETED_SUFFIX`` with the interpreter on (cached):
    ``triton.jit`` picks the interpreter when a kernel is decorated, so the switch need not outlive the import.
    The modules of Triton functions it imports (``triton_uses``) come as their interpreted copies too."""
    alias = name + INTERPRETED_SUFFIX
    if alias in sys.modules:
        return sys.modules[alias]
    uses = triton_uses(name)
    copies = {dep: import_interpreted(dep) for dep in uses}
    originals = {dep: sys.modules.get(dep) for dep in uses}
    origin = importlib.util.find_spec(name).origin
    spec = importlib.util.spec_from_file_location(alias, origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module  # dataclasses look their module up while it executes
    sys.modules.update(copies)
    try:
        with _interpreter_switched_on():
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[alias]
        raise
    finally:
        for dep, original in originals.items():
            if original is None:
                sys.modules.pop(dep, None)
            else:
                sys.modules[dep] = original
    return module


def triton_uses(name: str) -> list[str]:
    """The modules ``name`` imports from at its top level (``from X import f``) that define ``@triton.jit``
    functions, found in their source without importing them: a compiled Triton function cannot be called from an
    interpreted kernel."""
    found = []
    for node in _source_tree(name).body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and node.module.split(".")[0] != "triton" and node.module not in found:
            spec = importlib.util.find_spec(node.module)
            if spec is not None and spec.origin and spec.origin.endswith(".py") and _defines_triton_functions(
                    _source_tree(node.module)):
                found.append(node.module)
    return found


def _source_tree(name: str) -> ast.Module:
    return ast.parse(Path(importlib.util.find_spec(name).origin).read_text())


def _defines_triton_functions(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)
               for node in tree.body)


@contextlib.contextmanager
def _interpreter_switched_on() -> Iterator[None]:
    """Triton's interpreter on inside, and ``TRITON_INTERPRET`` and Triton's runtime knobs as they
    were after (Triton before 3.3 has no knobs and reads the variable)."""
    import triton

    if hasattr(triton, "knobs"):
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = True
            yield
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


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
    """Option ``fuse_rotary`` (default false): a graph-captured decode step's attention launch also rotates q
    and k and stores the new K/V (``forward_rotary``), one launch a layer less; bfloat16 and float16 only (in
    float32 the launch's fused multiply-adds would round RoPE's products otherwise than transformers)."""

    max_head_size = 256
    graph_decode = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device, fuse_rotary: bool = False) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, dtype, device)
        if not isinstance(fuse_rotary, bool):
            raise ValueError(f"backend.fuse_rotary must be true or false, got {fuse_rotary!r}")
        if fuse_rotary and dtype == torch.float32:
            raise ValueError("backend.fuse_rotary needs engine.dtype bfloat16 or float16 (in float32 the launch's "
                             "fused multiply-adds would round RoPE otherwise than transformers); got float32")
        self.fuse_rotary = fuse_rotary
        self.kernels = load_kernels(self.device)

    def workspace_bytes(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The key splits' partial results (GPU only: the interpreter never splits)."""
        if self.kernels.INTERPRETED or self.device.type != "cuda":
            return 0
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return self.kernels.split_workspace_bytes(self.num_heads, self.num_kv_heads, self.head_dim,
                                                  max_num_batched_tokens, self.kernels._num_sms(index))

    def build_metadata(self, meta: AttentionMetadata) -> TritonMetadata:
        if not meta.num_reqs:  # an empty step: nothing to tile or launch
            return TritonMetadata(meta, None)
        qsl = meta.query_start_loc_cpu[: meta.num_reqs + 1]
        launch = self.kernels.plan(qsl, meta.seq_lens_cpu[: meta.num_reqs], self.num_heads, self.num_kv_heads,
                                   self.head_dim, meta.block_table.device)
        return TritonMetadata(meta, launch)

    def build_graph_metadata(self, meta: AttentionMetadata) -> TritonMetadata:
        launch = self.kernels.decode_plan(meta.seq_lens[: meta.num_reqs], self.num_heads, self.num_kv_heads,
                                          self.head_dim, meta.max_seq_len)
        return TritonMetadata(meta, launch)

    def graph_max_seq_lens(self, num_reqs: int, max_model_len: int) -> list[int]:
        return self.kernels.decode_bounds(num_reqs, self.num_heads, self.num_kv_heads, self.head_dim, max_model_len,
                                          self.device)

    def kv_slots(self, meta: TritonMetadata) -> torch.Tensor:
        return meta.common.slot_mapping

    def forward_rotary(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, meta: TritonMetadata) -> torch.Tensor | None:
        launch = meta.launch
        if not self.fuse_rotary or launch is None or not launch.decode:
            return None
        if qkv.stride(-1) != 1 or kv_cache.stride(-1) != 1:
            raise ValueError("the triton backend needs qkv and kv_cache contiguous in head_dim")
        out = qkv.new_empty(qkv.shape[0], self.num_heads, self.head_dim)
        rotary = self.kernels.Rotary(cos, sin, meta.common.slot_mapping)  # positions: seq_lens - 1
        return self.kernels.paged_attention(out, qkv, kv_cache[0], kv_cache[1], meta.common.block_table, self.scale,
                                            launch, rotary)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: TritonMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        if kv_cache.stride(-1) != 1 or q.stride(-1) != 1 or any(t is not None and t.stride(-1) != 1 for t in (k, v)):
            raise ValueError("the triton backend needs q, k, v and kv_cache contiguous in head_dim")
        out = torch.empty_like(q) if out is None else out
        common = meta.common
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if k is not None:
            self.kernels.store_kv(k, v, k_cache, v_cache, common.slot_mapping)
        if meta.launch is None:
            return out
        return self.kernels.paged_attention(out, q, k_cache, v_cache, common.block_table, self.scale, meta.launch)
