"""flash-attn 2 over the paged cache: ``flash_attn_with_kvcache`` for decode-only steps,
``flash_attn_varlen_func`` (with ``block_table``) for every other mix, one call per layer.

It runs only on CUDA, in float16/bfloat16, with blocks of a multiple of 256 tokens; the constructor
names whatever is missing and is the only place that imports ``flash_attn``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from backends.naive import write_kv
from framework.execution.attention import BACKENDS, AttentionBackend, AttentionMetadata
from framework.common.registry import UnavailableError


@dataclass
class FlashAttnMetadata:
    common: AttentionMetadata
    cu_seqlens_q: torch.Tensor    # int32 [num_reqs + 1]
    cu_seqlens_k: torch.Tensor    # int32 [num_reqs + 1]
    seq_lens: torch.Tensor        # int32 [num_reqs]
    block_table: torch.Tensor     # int32 [num_reqs, max_blocks]


def missing_requirements(block_size: int, dtype: torch.dtype, device: torch.device, head_dim: int) -> list[str]:
    """What keeps flash-attn from running here, one phrase per problem (empty when nothing)."""
    problems = []
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} " + ("has no CUDA device" if torch.version.cuda else "is a CPU-only build")
        problems.append(f"CUDA is not available ({build})")
    elif device.type != "cuda":
        problems.append(f"device {device} is not a CUDA device")
    if importlib.util.find_spec("flash_attn") is None:
        problems.append("the flash-attn package is not installed (pip install 'flash-attn>=2.6', "
                        "or this project's [cuda] extra)")
    return problems + FlashAttnBackend.unsupported(head_dim, block_size, dtype)


@BACKENDS.register("flash_attn")
class FlashAttnBackend(AttentionBackend):
    supported_dtypes = (torch.float16, torch.bfloat16)
    max_head_size = 256
    block_size_multiple = 256  # what flash-attn 2's paged KV cache reads
    graph_decode = True  # build_metadata is device work only

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        problems = missing_requirements(block_size, dtype, torch.device(device), head_dim)
        if problems:
            raise UnavailableError("attention backend 'flash_attn' cannot run here: " + "; ".join(problems))
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, dtype, device)
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as exc:  # installed but unusable: typically built for another torch or CUDA
            raise UnavailableError(f"attention backend 'flash_attn' cannot run here: the flash-attn package is "
                                   f"installed but cannot be imported ({exc}); reinstall it for torch "
                                   f"{torch.__version__}") from exc

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def build_metadata(self, meta: AttentionMetadata) -> FlashAttnMetadata:
        seq_lens = meta.seq_lens.to(torch.int32)
        cu_seqlens_k = torch.zeros(meta.num_reqs + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_seqlens_k[1:])
        return FlashAttnMetadata(meta, meta.query_start_loc.to(torch.int32), cu_seqlens_k, seq_lens,
                                 meta.block_table.to(torch.int32))

    def build_graph_metadata(self, meta: AttentionMetadata) -> FlashAttnMetadata:
        return self.build_metadata(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: FlashAttnMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        common = meta.common
        write_kv(k, v, kv_cache, common.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        kwargs: dict[str, Any] = dict(softmax_scale=self.scale, causal=True, block_table=meta.block_table)
        if common.max_query_len == 1:
            o = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens, **kwargs)
            o = o.squeeze(1)
        else:
            # Causal masks are aligned bottom-right: query j of a request sees keys up to
            # seq_len - q_len + j, which covers chunked prefills and prefix-cache hits.
            o = self._varlen(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, common.max_query_len,
                             common.max_seq_len, **kwargs)
        if out is None:
            return o
        out.copy_(o)
        return out
