"""The ``AttentionBackend`` interface and the per-step ``AttentionMetadata`` it consumes.

The model's attention layers call the backend; the input preparer builds the common metadata
once per step; the backend turns it into whatever its kernel needs (``build_metadata``) once
per step, and every layer's ``forward`` reuses that.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from framework.registry import Registry


@dataclass
class AttentionMetadata:
    """One step's flat batch, as attention sees it (vLLM v1's common attention metadata).

    Requests are laid out back to back: request ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]``, has ``num_computed_tokens[i]`` tokens already in
    the cache and ``seq_lens[i]`` tokens once this step's are written. ``block_table[i, j]`` is the
    device block of its ``j``-th block (0, the null block, past its end). ``slot_mapping[t]`` is
    the cache slot (``block * block_size + offset``) where token ``t``'s K/V go. The ``*_cpu``
    arrays are host copies for backends that plan on the CPU.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    num_computed_tokens_cpu: np.ndarray
    block_table_cpu: np.ndarray
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class AttentionBackend(ABC):
    """Stores a step's new K/V in the paged cache and computes causal attention over each
    request's cached context plus its new tokens.

    ``forward(q, k, v, kv_cache, meta)``: ``q`` is ``[T, num_heads, head_dim]``, ``k``/``v`` are
    ``[T, num_kv_heads, head_dim]`` for the ``T = meta.num_actual_tokens`` new tokens;
    ``kv_cache`` is this layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` slice.
    Token ``t`` of request ``i`` attends to the request's first ``num_computed_tokens[i] + (t -
    query_start_loc[i]) + 1`` tokens. Returns ``[T, num_heads, head_dim]`` in ``q``'s dtype,
    written into ``out`` when one is given (and then ``out`` itself is returned). It writes only
    the slots in ``slot_mapping`` and never lets a cache slot past a request's ``seq_len`` affect
    its output.
    """

    name: ClassVar[str] = ""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    supported_block_sizes: ClassVar[tuple[int, ...] | None] = None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self._check_supported()

    def _check_supported(self) -> None:
        who = f"attention backend {self.name!r}"
        if self.dtype not in self.supported_dtypes:
            raise ValueError(f"{who} does not support dtype {self.dtype}; it supports {list(self.supported_dtypes)}")
        if self.supported_head_sizes and self.head_dim not in self.supported_head_sizes:
            raise ValueError(f"{who} does not support head size {self.head_dim}; it supports {list(self.supported_head_sizes)}")
        if self.supported_block_sizes and self.block_size not in self.supported_block_sizes:
            raise ValueError(
                f"{who} does not support block_size={self.block_size}; it supports {list(self.supported_block_sizes)}")

    def build_metadata(self, meta: AttentionMetadata) -> Any:
        """Per-step preparation shared by all layers (default: use the common metadata as is)."""
        return meta

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, out: torch.Tensor | None = None) -> torch.Tensor: ...


BACKENDS: Registry[AttentionBackend] = Registry(
    "backend", AttentionBackend, entry_point_group="framework.backends", builtin="backends")
