"""The ``AttentionBackend`` interface and the per-step ``AttentionMetadata`` it consumes.

Each step the input preparer builds the common metadata, the backend's ``build_metadata`` turns it
into what its kernel needs, and every attention layer's ``forward`` reuses that.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from framework.common.registry import Registry


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

    @classmethod
    def from_host(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                  slot_mapping: np.ndarray, block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """The metadata of a step given as int64 host arrays, the rest derived (tests and
        benchmarks; input preparers build theirs with one transfer, ``InputPreparer.model_input``)."""
        q_lens = np.diff(query_start_loc)
        computed = seq_lens - q_lens
        prefill = q_lens > 1
        dev = torch.device(device)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev)

        return cls(
            num_reqs=len(seq_lens), num_actual_tokens=int(query_start_loc[-1]), max_query_len=int(q_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)), block_size=block_size, query_start_loc=t(query_start_loc),
            seq_lens=t(seq_lens), num_computed_tokens=t(computed), block_table=t(block_table),
            slot_mapping=t(slot_mapping), query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=computed, block_table_cpu=block_table, num_prefills=int(prefill.sum()),
            num_prefill_tokens=int(q_lens[prefill].sum()), num_decode_tokens=int((q_lens == 1).sum()))


#: The constructor arguments the framework gives every backend (``ModelExecutor``): not user options.
BACKEND_ARGUMENTS = ("num_heads", "num_kv_heads", "head_dim", "scale", "block_size", "dtype", "device")


class AttentionBackend(ABC):
    """Stores a step's new K/V in the paged cache and computes causal attention over each
    request's cached context plus its new tokens.

    ``forward(q, k, v, kv_cache, meta, out=None)``: ``q`` is ``[T, num_heads, head_dim]``, ``k``/``v``
    ``[T, num_kv_heads, head_dim]`` for the ``T = meta.num_actual_tokens`` new tokens, ``kv_cache``
    this layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` slice. Token ``t`` of request
    ``i`` attends to its first ``num_computed_tokens[i] + (t - query_start_loc[i]) + 1`` tokens.
    Returns ``[T, num_heads, head_dim]`` in ``q``'s dtype (``out`` itself when given). Writes only the
    slots in ``slot_mapping``; a cache slot past a request's ``seq_len`` never affects its output.
    ``k`` and ``v`` are None when the model stored them already (``kv_slots``).
    """

    name: ClassVar[str] = ""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    max_head_size: ClassVar[int | None] = None
    block_size_multiple: ClassVar[int] = 1  # block_size must be a multiple of this
    graph_decode: ClassVar[bool] = False  # has build_graph_metadata: decode steps can be CUDA graphs
    fuse_rotary: bool = False  # forward_rotary may take RoPE into a step's attention (the model asks only then)

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

    @classmethod
    def unsupported(cls, head_dim: int, block_size: int, dtype: torch.dtype) -> list[str]:
        """What in these settings the class's limits (``supported_dtypes``, ``max_head_size``,
        ``block_size_multiple``) rule out, one phrase each; empty when nothing."""
        problems = []
        if dtype not in cls.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            problems.append(f"dtype {dtype} is not supported, only {names} "
                            f"(set engine.dtype={str(cls.supported_dtypes[-1]).removeprefix('torch.')})")
        if cls.max_head_size is not None and head_dim > cls.max_head_size:
            problems.append(f"head size {head_dim} is too large: it supports head sizes up to {cls.max_head_size}")
        if block_size % cls.block_size_multiple:
            problems.append(f"block_size={block_size} is not a multiple of {cls.block_size_multiple} "
                            f"(run with engine.block_size={cls.block_size_multiple})")
        return problems

    def _check_supported(self) -> None:
        problems = self.unsupported(self.head_dim, self.block_size, self.dtype)
        if problems:
            raise ValueError(f"attention backend {self.name!r} cannot run with these settings: " + "; ".join(problems))

    def workspace_bytes(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Device bytes this backend may hold besides the KV cache and its inputs and outputs during a
        step within these limits (buffers it keeps, per-step plans): KV sizing leaves them free."""
        return 0

    def build_metadata(self, meta: AttentionMetadata) -> Any:
        """Per-step preparation shared by all layers (default: use the common metadata as is)."""
        return meta

    def build_graph_metadata(self, meta: AttentionMetadata) -> Any:
        """``build_metadata`` for a decode-only step (request i's one query at row i) run inside CUDA-graph
        capture and replayed with new values in ``meta``'s tensors: only device work on them, no host reads;
        ``meta.max_seq_len`` bounds every replay's lengths. Backends with ``graph_decode`` implement it."""
        raise NotImplementedError(f"attention backend {self.name!r} has no capturable decode")

    def kv_slots(self, meta: Any) -> torch.Tensor | None:
        """The cache slots [T] where the model may write this step's new K/V itself (this layer's ``kv_cache``
        at ``[0]`` and ``[1]``) and then call ``forward(q, None, None, ...)``; None (the default): ``forward``
        stores them."""
        return None

    def forward_rotary(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, meta: Any) -> torch.Tensor | None:
        """``forward`` of the step's unrotated ``qkv`` ``[T, (num_heads + 2 num_kv_heads) head_dim]``, q and k
        rotated (rotate half) at ``positions`` [T] by RoPE's ``cos``/``sin`` tables ``[positions, head_dim / 2]``
        and the new K/V stored in the same pass, where this backend can for ``meta`` (``fuse_rotary`` set); None
        (the default) where it cannot, and the model rotates and calls ``forward``."""
        return None

    def graph_max_seq_lens(self, num_reqs: int, max_model_len: int) -> list[int]:
        """The ``max_seq_len`` bounds, ascending and the last ``max_model_len``, at which decode steps of
        ``num_reqs`` rows are captured, one graph each: a step replays the smallest at or above its longest
        sequence. Default one; a backend whose launch depends on the bound (key splits) lists more."""
        return [max_model_len]

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, out: torch.Tensor | None = None) -> torch.Tensor: ...


BACKENDS: Registry[AttentionBackend] = Registry(
    "backend", AttentionBackend, entry_point_group="framework.backends", builtin="backends")
