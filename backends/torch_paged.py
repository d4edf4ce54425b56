"""Paged attention in torch, vectorised over the batch through the block table.

``build_metadata`` plans each step on the host: decodes form one group, the other requests are cut
into padded groups by length (``prefill_groups``), each with its token rows, blocks to gather and
additive mask; every layer then runs one gather and one SDPA call per group. The mask gives slots past
a request's end zero weight, which needs them finite (the engine zero-initialises the cache). On a
CPU a C++ kernel (``backends/csrc``) takes decodes and prefills instead, every token one query row of
its causal length, reading K/V from the cache: nothing gathered, padded or masked.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from backends.naive import write_kv
from framework.common.registry import UnavailableError
from framework.execution.attention import BACKENDS, AttentionBackend, AttentionMetadata
from framework.execution.cpu_features import cpu_has_matmul_instructions
from framework.execution.host_memory import to_device

logger = logging.getLogger(__name__)

#: ``decode_kernel`` and ``prefill_kernel``: ``auto``, ``cpp``, ``sdpa``. ``auto``: the C++ kernel on a CPU when
#: it builds, else SDPA; but prefills in a half-precision dtype the CPU multiplies natively go to SDPA, whose
#: tiled products ran them 1.6x faster than the kernel's row at a time (bf16 on AMX).
KERNELS = ("auto", "cpp", "sdpa")


def check_kernels(device: torch.device, decode_kernel: str = "auto", prefill_kernel: str = "auto") -> None:
    """ValueError naming a kernel option that is none of ``KERNELS``, or ``cpp`` off a CPU."""
    for key, value in (("decode_kernel", decode_kernel), ("prefill_kernel", prefill_kernel)):
        if value not in KERNELS:
            raise ValueError(f"backend.{key} must be one of {', '.join(KERNELS)}, got {value!r}")
        if value == "cpp" and device.type != "cpu":
            raise ValueError(f"backend.{key}=cpp runs on a CPU, not {device}; use auto or sdpa")


@dataclass
class PagedGroup:
    """Requests that run in one SDPA call, padded to ``q_len`` queries and ``num_blocks`` blocks.

    When every padded query is real and the rows run consecutively from ``out_start``, queries
    and results are slices there; otherwise ``token_rows[j]`` is the flat token row of padded
    query ``j`` (padded queries repeat a real row of their request), ``out_rows`` picks the real
    padded queries and ``out_index`` says which flat rows they go to.
    ``mask`` is ``[num_reqs, 1, rows, num_blocks * block_size]``, rows ``q_len`` (with
    ``fold_masked_gqa`` and ``q_len > 1``: ``q_len`` x query heads per K/V head): 0 where a query may
    attend, -inf elsewhere (past the request's ``seq_len``, in the causal future, null-block padding);
    None for a lone full prefill of two or more tokens, which SDPA runs as ``is_causal``.
    """

    num_reqs: int
    q_len: int
    num_blocks: int
    token_rows: torch.Tensor | None
    block_ids: torch.Tensor
    mask: torch.Tensor | None
    out_start: int | None
    out_rows: torch.Tensor | None
    out_index: torch.Tensor | None
    #: For the C++ kernel, whose rows are tokens (``num_reqs`` of them, ``q_len`` 1; ``block_ids`` their
    #: requests' blocks, ``num_blocks`` per request): each token's causal length, its position + 1, and
    #: ``table_rows``, the index of its request's blocks in ``block_ids`` (int64, on the host).
    seq_lens: torch.Tensor | None = None
    table_rows: torch.Tensor | None = None


@dataclass
class TorchPagedMetadata:
    common: AttentionMetadata
    groups: list[PagedGroup]


#: The fixed cost of one more SDPA group, in (query, key) pairs of attention work: on a 2-core CPU
#: (tiny presets, 64 requests) 4096 to 16384 measured equally fast; the GPU's is an estimate.
GROUP_COST_PAIRS = {"cpu": 16384, "cuda": 1 << 20}


def prefill_groups(q_lens: np.ndarray, seq_lens: np.ndarray, group_cost: int) -> list[np.ndarray]:
    """Indices (into the arrays given) of the non-decode requests, sorted by length and cut into groups
    that each run as one padded SDPA call, minimising the padded work (requests x longest query x longest
    sequence per group) plus ``group_cost`` per group (an exact O(n^2) dynamic programme)."""
    order = np.lexsort((-q_lens, -seq_lens))
    q, n = q_lens[order], seq_lens[order]
    m = len(order)
    best = np.full(m + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(m + 1, dtype=np.int64)
    for j in range(1, m + 1):
        # A group order[i:j] is padded to q.max() over it and to n[i] (the sort puts it first).
        longest_q = np.maximum.accumulate(q[j - 1::-1])[::-1]
        cost = best[:j] + (j - np.arange(j)) * longest_q * n[:j] + group_cost
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    groups = []
    j = m
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


@BACKENDS.register("torch_paged")
class TorchPagedBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int,
                 dtype: torch.dtype, device: torch.device, decode_kernel: str = "auto",
                 prefill_kernel: str = "auto") -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, dtype, device)
        check_kernels(self.device, decode_kernel, prefill_kernel)
        # Whether a masked prefill group's query heads go in as rows of their K/V head (see _attend):
        # on CUDA SDPA has no fused kernel for a mask with GQA; a CPU's flash kernel takes both, and
        # ran 1.2-2x faster than the folded rows (2 cores, head_dim 32-128).
        self.fold_masked_gqa = self.device.type != "cpu"
        self._kernel = None
        if self.device.type == "cpu" and (decode_kernel, prefill_kernel) != ("sdpa", "sdpa"):
            from backends.cpu_kernels import paged_decode

            try:
                self._kernel = paged_decode()
            except UnavailableError as exc:
                if "cpp" in (decode_kernel, prefill_kernel):
                    raise
                logger.warning("torch_paged: %s; attention uses SDPA", exc)
        if (prefill_kernel == "auto" and self.device.type == "cpu" and dtype != torch.float32
                and cpu_has_matmul_instructions(dtype)):
            prefill_kernel = "sdpa"
        #: Which requests the C++ kernel takes: decodes, and prefills (every other request).
        self.kernel_decodes = self._kernel is not None and decode_kernel != "sdpa"
        self.kernel_prefills = self._kernel is not None and prefill_kernel != "sdpa"

    def build_metadata(self, meta: AttentionMetadata) -> TorchPagedMetadata:
        qsl = meta.query_start_loc_cpu[: meta.num_reqs + 1]
        q_lens = np.diff(qsl)
        device = meta.block_table.device
        is_decode = q_lens == 1
        in_kernel = (is_decode & self.kernel_decodes) | (~is_decode & self.kernel_prefills)
        groups = [self._plan_rows(meta, np.flatnonzero(in_kernel), device)] if in_kernel.any() else []
        decodes = np.flatnonzero(is_decode & ~in_kernel)
        others = np.flatnonzero(~is_decode & ~in_kernel)
        plans = [decodes] if len(decodes) else []
        if len(others):
            cost = GROUP_COST_PAIRS.get(device.type, GROUP_COST_PAIRS["cuda"])
            plans += [others[g] for g in prefill_groups(q_lens[others], meta.seq_lens_cpu[others], cost)]
        return TorchPagedMetadata(meta, groups + [self._plan(meta, reqs, device) for reqs in plans])

    def _plan_rows(self, meta: AttentionMetadata, reqs: np.ndarray, device: torch.device) -> PagedGroup:
        """The C++ kernel's group: every token of ``reqs`` one query row, pointing at its request's blocks,
        with its causal length (a decode's row is its request's)."""
        qsl = meta.query_start_loc_cpu
        starts, q_lens, seq_lens = qsl[reqs], qsl[reqs + 1] - qsl[reqs], meta.seq_lens_cpu[reqs]
        req_of = np.repeat(np.arange(len(reqs)), q_lens)
        first = np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        offset = np.arange(len(req_of)) - first  # the token's index within its request's new tokens
        rows = starts[req_of] + offset
        num_blocks = -(-int(seq_lens.max()) // meta.block_size)
        block_ids = meta.block_table_cpu[reqs, :num_blocks]
        contiguous = rows[-1] - rows[0] + 1 == len(rows)  # rows ascend, so no gap means one slice
        return PagedGroup(
            num_reqs=len(rows), q_len=1, num_blocks=num_blocks, mask=None,
            token_rows=None if contiguous else to_device(rows, device, torch.long),
            block_ids=to_device(block_ids.ravel(), device, torch.long),
            out_start=int(rows[0]) if contiguous else None, out_rows=None,
            out_index=None if contiguous else to_device(rows, device, torch.long),
            seq_lens=to_device((seq_lens - q_lens)[req_of] + offset + 1, device, torch.long),
            table_rows=to_device(req_of, device, torch.long))

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
        # Only a lone full prefill of two or more tokens goes without one (SDPA's is_causal hides
        # its block's tail); the decode call has no is_causal, so a lone one-token prompt needs it.
        needs_mask = len(reqs) > 1 or seq_lens[0] != q_lens[0] or q_pad == 1
        block_ids = meta.block_table_cpu[reqs, :num_blocks]
        out_start = out_rows = out_index = None
        first = int(starts[0])
        if real.all() and np.array_equal(token_rows.ravel(), np.arange(first, first + real.size)):
            out_start = first
        else:
            out_rows = np.flatnonzero(real.ravel())
            out_index = token_rows.ravel()[out_rows]

        def dev(a: np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return to_device(a, device, dtype)

        mask = None
        if needs_mask:
            # Folded, SDPA's rows are (token, query head) of each K/V head (see _attend); a decode's
            # one row per request broadcasts over its K/V head's query heads.
            fold = q_pad > 1 and self.fold_masked_gqa
            rows = np.repeat(q_pos, self.num_heads // self.num_kv_heads, axis=1) if fold else q_pos
            mask = self._mask(dev(rows), num_blocks * bs)

        return PagedGroup(
            num_reqs=len(reqs), q_len=q_pad, num_blocks=num_blocks,
            token_rows=None if out_start is not None else dev(token_rows.ravel()),
            block_ids=dev(block_ids.ravel()), mask=mask, out_start=out_start,
            out_rows=None if out_rows is None else dev(out_rows),
            out_index=None if out_index is None else dev(out_index))

    def _mask(self, row_pos: torch.Tensor, length: int) -> torch.Tensor:
        """``[reqs, 1, rows, length]`` in the backend's dtype: 0 where key position <= the row's
        position, -inf elsewhere; built on the device from the rows' positions."""
        hidden = torch.arange(length, device=row_pos.device) > row_pos[:, :, None]
        mask = torch.zeros(hidden.shape, dtype=self.dtype, device=row_pos.device).masked_fill_(hidden, float("-inf"))
        return mask[:, None]

    def workspace_bytes(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The gather buffer at its largest group (decodes are one group; other groups hold requests of
        >= 2 tokens; what the C++ kernel takes, it reads in place) and one step's masks."""
        length = -(-max_model_len // self.block_size) * self.block_size
        itemsize = self.dtype.itemsize
        decode_reqs = 0 if self.kernel_decodes else max_num_seqs
        prefill_reqs = 0 if self.kernel_prefills else min(max_num_seqs, max_num_batched_tokens // 2)
        gather = 2 * max(decode_reqs, prefill_reqs) * length * self.num_kv_heads * self.head_dim * itemsize
        # The planner pads at most the real (query, key) pairs plus its cost of a group per request
        # but one (or it would run them alone); a folded prefill's mask row repeats per query head.
        cost = GROUP_COST_PAIRS.get(self.device.type, GROUP_COST_PAIRS["cuda"])
        pairs = 0 if self.kernel_decodes and self.kernel_prefills else (
            max_num_batched_tokens * length + cost * (max_num_seqs - 1))
        rows_per_token = self.num_heads // self.num_kv_heads if self.fold_masked_gqa else 1
        return gather + rows_per_token * pairs * itemsize

    _workspace: torch.Tensor | None = None

    def _buffer(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``shape`` view of a workspace that only ever grows."""
        numel = math.prod(shape)
        ws = self._workspace
        # One made under torch.inference_mode (as the engine runs) cannot be written outside it.
        if (ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device
                or (ws.is_inference() and not torch.is_inference_mode_enabled())):
            ws = self._workspace = torch.empty(numel, dtype=like.dtype, device=like.device)
        return ws[:numel].view(shape)

    def kv_slots(self, meta: TorchPagedMetadata) -> torch.Tensor:
        return meta.common.slot_mapping

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: TorchPagedMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        if k is not None and v is not None:
            write_kv(k, v, kv_cache, meta.common.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        for group in meta.groups:
            self._attend(q, kv_cache, group, out)
        return out

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, g: PagedGroup, out: torch.Tensor) -> None:
        n, q_len, length = g.num_reqs, g.q_len, g.num_blocks * self.block_size
        if g.seq_lens is not None:
            self._kernel_rows(q, kv_cache, g, out)
            return
        # Gather from kv_cache[0] and [1], each contiguous (index_select would copy the strided layer
        # slice whole), into a buffer kept across layers: a fresh one costs more in CPU page faults.
        gathered = self._buffer((2, n * g.num_blocks, *kv_cache.shape[2:]), kv_cache)
        torch.index_select(kv_cache[0], 0, g.block_ids, out=gathered[0])
        torch.index_select(kv_cache[1], 0, g.block_ids, out=gathered[1])
        shape = (n, length, self.num_kv_heads, self.head_dim)
        keys = gathered[0].view(shape).transpose(1, 2)
        values = gathered[1].view(shape).transpose(1, 2)
        if g.out_start is not None:
            queries = q[g.out_start:g.out_start + n * q_len]
        else:
            queries = q.index_select(0, g.token_rows)
        kv_heads, group, head_dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        if g.mask is None or (q_len > 1 and not self.fold_masked_gqa):
            # Without a mask the group is one full prefill: top-left causal alignment is right, and it
            # hides the tail of the last block too (CUDA's flash kernel takes enable_gqa).
            queries = queries.view(n, q_len, self.num_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, is_causal=g.mask is None,
                                               scale=self.scale, enable_gqa=group > 1)
            o = o.transpose(1, 2)
        else:
            # The query heads sharing a K/V head go in as (token, query head) rows of that head, so
            # each K/V head is read once and SDPA sees no GQA: with a mask, CUDA's fused kernel (the
            # memory-efficient one) takes no enable_gqa and SDPA would fall back to its math kernel.
            # (Decodes: measured 1.1-2x faster than enable_gqa on a CPU at head_dim 32.)
            queries = queries.view(n, q_len, kv_heads, group, head_dim).transpose(1, 2)
            queries = queries.reshape(n, kv_heads, q_len * group, head_dim)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=self.scale)
            o = o.view(n, kv_heads, q_len, group, head_dim).transpose(1, 2)
        o = o.reshape(n * q_len, self.num_heads, head_dim)
        if g.out_start is not None:
            out[g.out_start:g.out_start + n * q_len] = o
        else:
            out.index_copy_(0, g.out_index, o.index_select(0, g.out_rows))

    def _kernel_rows(self, q: torch.Tensor, kv_cache: torch.Tensor, g: PagedGroup, out: torch.Tensor) -> None:
        """The kernel's group (``_plan_rows``) through the C++ kernel, reading K/V from the cache where they lie."""
        if g.out_start is not None:
            queries = q[g.out_start:g.out_start + g.num_reqs].contiguous()
        else:
            queries = q.index_select(0, g.token_rows)
        o = torch.empty_like(queries)
        self._kernel(queries, kv_cache[0], kv_cache[1], g.block_ids.view(-1, g.num_blocks), g.table_rows, g.seq_lens,
                     self.scale, o)
        if g.out_start is not None:
            out[g.out_start:g.out_start + g.num_reqs] = o
        else:
            out.index_copy_(0, g.out_index, o)
