"""Paged attention in plain torch, vectorised over the batch through the block table.

``build_metadata`` splits each step's batch once into decodes (one new token) and the rest
(full prefills, chunked prefills, prefix-cache hits) and plans each group on the host: the
flat token rows, the cache blocks to gather (the block table, null-block padded, flattened)
and an additive mask. Every layer then stores the new K/V, gathers each group's K and V from
the cache with one ``index_select`` and runs one SDPA call per group over the group's longest
sequence. SDPA's ``enable_gqa`` shares each K/V head among its query heads without copying it.
There is no per-request Python loop anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from backends.naive import write_kv
from framework.attention import BACKENDS, AttentionBackend, AttentionMetadata


@dataclass
class PagedGroup:
    """Requests that run in one SDPA call, padded to ``q_len`` queries and ``num_blocks`` blocks.

    ``token_rows[j]`` is the flat token row of padded query ``j`` (padded queries repeat a real
    row of their request). When every padded query is real and the rows run consecutively from
    ``out_start``, the result is copied there in one slice; otherwise ``out_rows`` picks the real
    padded queries and ``out_index`` says which flat rows they go to.
    ``mask`` is ``[num_reqs, 1, q_len, num_blocks * block_size]``: 0 where a query may attend,
    -inf elsewhere (past the request's ``seq_len``, in the causal future, null-block padding).
    """

    num_reqs: int
    q_len: int
    num_blocks: int
    token_rows: torch.Tensor
    block_ids: torch.Tensor
    mask: torch.Tensor
    out_start: int | None
    out_rows: torch.Tensor | None
    out_index: torch.Tensor | None


@dataclass
class TorchPagedMetadata:
    common: AttentionMetadata
    decode: PagedGroup | None
    prefill: PagedGroup | None


@BACKENDS.register("torch_paged")
class TorchPagedBackend(AttentionBackend):
    def build_metadata(self, meta: AttentionMetadata) -> TorchPagedMetadata:
        qsl = meta.query_start_loc_cpu
        q_lens = np.diff(qsl[: meta.num_reqs + 1])
        is_decode = q_lens == 1
        device = meta.block_table.device
        groups = []
        for sel in (is_decode, ~is_decode):
            reqs = np.flatnonzero(sel)
            groups.append(self._plan(meta, reqs, device) if len(reqs) else None)
        return TorchPagedMetadata(meta, *groups)

    def _plan(self, meta: AttentionMetadata, reqs: np.ndarray, device: torch.device) -> PagedGroup:
        bs = meta.block_size
        starts = meta.query_start_loc_cpu[reqs]
        q_lens = meta.query_start_loc_cpu[reqs + 1] - starts
        seq_lens = meta.seq_lens_cpu[reqs]
        q_pad = int(q_lens.max())
        num_blocks = -(-int(seq_lens.max()) // bs)
        # Query j of a request sits at position seq_len - q_len + j; padded queries (j >= q_len)
        # reuse the last real row, so no row of the mask is empty and nothing becomes NaN.
        j = np.arange(q_pad)
        real = j[None, :] < q_lens[:, None]
        j_clamped = np.minimum(j[None, :], q_lens[:, None] - 1)
        token_rows = starts[:, None] + j_clamped
        q_pos = (seq_lens - q_lens)[:, None] + j_clamped
        k_pos = np.arange(num_blocks * bs)
        allowed = k_pos[None, None, :] <= q_pos[:, :, None]
        mask = np.where(allowed, 0.0, -np.inf)[:, None]
        block_ids = meta.block_table_cpu[reqs, :num_blocks]
        out_start = out_rows = out_index = None
        first = int(starts[0])
        if real.all() and np.array_equal(token_rows.ravel(), np.arange(first, first + real.size)):
            out_start = first
        else:
            out_rows = np.flatnonzero(real.ravel())
            out_index = token_rows.ravel()[out_rows]

        def dev(a: np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        return PagedGroup(
            num_reqs=len(reqs), q_len=q_pad, num_blocks=num_blocks, token_rows=dev(token_rows.ravel()),
            block_ids=dev(block_ids.ravel()), mask=dev(mask, self.dtype), out_start=out_start,
            out_rows=None if out_rows is None else dev(out_rows),
            out_index=None if out_index is None else dev(out_index))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TorchPagedMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.common.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        for group in (meta.decode, meta.prefill):
            if group is not None:
                self._attend(q, kv_cache, group, out)
        return out

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, g: PagedGroup, out: torch.Tensor) -> None:
        n, q_len, length = g.num_reqs, g.q_len, g.num_blocks * self.block_size
        # kv_cache[0] and [1] are each contiguous (kv_cache itself is a strided layer slice, which
        # index_select would first copy whole): one gather of n * num_blocks blocks each.
        shape = (n, length, self.num_kv_heads, self.head_dim)
        keys = kv_cache[0].index_select(0, g.block_ids).view(shape).transpose(1, 2)
        values = kv_cache[1].index_select(0, g.block_ids).view(shape).transpose(1, 2)
        queries = q.index_select(0, g.token_rows).view(n, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        o = o.transpose(1, 2).reshape(n * q_len, self.num_heads, self.head_dim)
        if g.out_start is not None:
            out[g.out_start:g.out_start + n * q_len] = o
        else:
            out.index_copy_(0, g.out_index, o.index_select(0, g.out_rows))
