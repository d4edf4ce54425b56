"""Triton kernels of the ``triton`` attention backend: a K/V store through ``slot_mapping`` and
one paged-attention kernel over a mixed flat batch.

Imported only when a ``TritonBackend`` is constructed (``backends/triton_paged.py`` decides
first whether Triton must run through its CPU interpreter, which it reads when the kernels
below are decorated). Both kernels accept any power-of-two block size and any head size up to
256 (padded to a power of two with masks); K/V tiles are gathered position by position through
the block table, so a tile may span several cache blocks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Whether these kernels were decorated for Triton's CPU interpreter.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


# tl.max and tl.sum are jitted helpers around tl.reduce; under the interpreter every call of a
# jitted helper re-patches triton.language (about a millisecond). Reducing with their combine
# functions directly is the same operation without that cost.
_max_combine = getattr(tl.standard, "_elementwise_max", None)
_sum_combine = getattr(tl.standard, "_sum_combine", None)
if _max_combine is None or _sum_combine is None:  # pragma: no cover - other Triton versions
    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _sum_combine(a, b):
        return a + b


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Program i copies the K and V of tokens [i * BLOCK_T, (i + 1) * BLOCK_T), all heads, to
    their slots. Columns are (head, dim) pairs."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, HEADS_PAD * HEAD_DIM_PAD)
    col_head = cols // HEAD_DIM_PAD
    col_dim = cols % HEAD_DIM_PAD
    token_ok = tokens < num_tokens
    mask = token_ok[:, None]
    if HEAD_DIM != HEAD_DIM_PAD or NUM_KV_HEADS != HEADS_PAD:
        mask = mask & ((col_dim < HEAD_DIM) & (col_head < NUM_KV_HEADS))[None, :]
    slots = tl.load(slot_ptr + tokens, mask=token_ok, other=0)
    dst = ((slots // BLOCK_SIZE) * stride_cb + (slots % BLOCK_SIZE) * stride_cs)[:, None] + \
        (col_head * stride_ch + col_dim)[None, :]
    k = tl.load(k_ptr + (tokens * stride_kt)[:, None] + (col_head * stride_kh + col_dim)[None, :], mask=mask)
    v = tl.load(v_ptr + (tokens * stride_vt)[:, None] + (col_head * stride_vh + col_dim)[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (request, kv-head tile, query tile) attends BLOCK_Q query tokens of one request,
    for the query heads of KV_HEADS consecutive K/V heads, to the request's cached keys, BLOCK_N
    positions at a time, with an online softmax. Query token j of a request sits at position
    ``seq_len - q_len + j`` and sees keys up to it: one rule for decodes, full and chunked
    prefills and prefix-cache hits.

    Rows of a tile are (kv head, token, query head of the group) and columns (kv head, key
    position); with KV_HEADS > 1 a row only sees its own head's columns (one 2-D dot covers all
    heads, which suits the interpreter). With KV_HEADS == 1 (GPUs) every query head of a group
    shares each K/V tile load. The ``if`` on constexprs below drop masks that cannot be false.
    """
    ROWS: tl.constexpr = KV_HEADS * BLOCK_Q * GROUP_PAD
    # int64 index arithmetic: addresses need it anyway, and the interpreter checks every int32
    # add and multiply for overflow.
    req = tl.program_id(0).to(tl.int64)
    q_tile = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        context = seq_len - q_len
        rows = tl.arange(0, ROWS).to(tl.int64)
        member = rows % GROUP_PAD
        token = q_tile * BLOCK_Q + (rows // GROUP_PAD) % BLOCK_Q
        row_ok = token < q_len
        if GROUP != GROUP_PAD:
            row_ok = row_ok & (member < GROUP)
        dims = tl.arange(0, HEAD_DIM_PAD)
        cols = tl.arange(0, KV_HEADS * BLOCK_N).to(tl.int64)
        col_pos = cols % BLOCK_N
        if KV_HEADS == 1:
            row_kv = tl.program_id(1).to(tl.int64)
            col_kv = row_kv
        else:
            first_kv = tl.program_id(1).to(tl.int64) * KV_HEADS
            row_kv = first_kv + rows // (BLOCK_Q * GROUP_PAD)
            col_kv = first_kv + cols // BLOCK_N
            if NUM_KV_HEADS % KV_HEADS != 0:
                row_ok = row_ok & (row_kv < NUM_KV_HEADS)
        q_mask = row_ok[:, None]
        if HEAD_DIM != HEAD_DIM_PAD:
            q_mask = q_mask & (dims < HEAD_DIM)[None, :]
        row_token = q_start + token
        row_head = row_kv * GROUP + member
        q_rows = row_token * stride_qt + row_head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = (context + token)[:, None]
        # Keys past the tile's last query are in every row's causal future.
        kv_end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)
        col_head = col_kv * stride_ch
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.full([ROWS], 0.0, tl.float32)
        acc = tl.full([ROWS, HEAD_DIM_PAD], 0.0, tl.float32)
        table = block_table_ptr + req * stride_bt
        for start in range(0, kv_end, BLOCK_N):
            pos = start + col_pos
            pos_ok = pos < kv_end
            if NUM_KV_HEADS % KV_HEADS != 0:
                pos_ok = pos_ok & (col_kv < NUM_KV_HEADS)
            block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            slot = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + col_head
            kv_mask = pos_ok[:, None]
            if HEAD_DIM != HEAD_DIM_PAD:
                kv_mask = kv_mask & (dims < HEAD_DIM)[None, :]
            kv_ptrs = slot[:, None] + dims[None, :]
            k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
            # A real row's q_pos is below kv_end, so this also hides the masked-off positions.
            visible = pos[None, :] <= q_pos
            if KV_HEADS > 1:
                visible = visible & (row_kv[:, None] == col_kv[None, :])
            s = tl.where(visible, s, float("-inf"))
            # Position 0 of its own head is in the first tile and visible to every row, so
            # m_new is finite and no row divides by zero.
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
            v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
            if v_cache_ptr.dtype.element_ty != tl.float32:
                # P is rounded to the cache dtype as on a GPU's tensor cores, even when the
                # interpreter then multiplies in float32.
                p = p.to(v_cache_ptr.dtype.element_ty)
                if DOT_FP32:
                    p = p.to(tl.float32)
                    v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new
        out_rows = row_token * stride_ot + row_head * stride_oh
        tl.store(out_ptr + out_rows[:, None] + dims[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=q_mask)


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ``[T, kv_heads, head_dim]`` of the first ``len(slot_mapping)`` tokens
    to slots ``slot_mapping`` of ``k_cache``/``v_cache`` ``[blocks, block_size, kv_heads,
    head_dim]``. Touches no other slot."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    heads_pad, head_dim_pad = _pow2(num_kv_heads), _pow2(head_dim, 16)
    # The interpreter pays per program, not per element: one program covers a whole step.
    block_t = min(_pow2(num_tokens), 4096) if INTERPRETED else max(1, 4096 // (heads_pad * head_dim_pad))
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_T=block_t)


def tile_sizes(group_pad: int, kv_heads: int, head_dim: int, max_query_len: int,
               max_seq_len: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N) for one launch.

    Under the interpreter each operation costs tens of microseconds whatever its size, so the
    key tile covers a whole request where it can (up to 2048 columns) and the query tile is as
    large as about 2**19 score elements allow: larger would make the decode programs of a mixed
    batch pay for rows they mask off. On a GPU tiles are sized for registers: at least 16 rows
    for ``tl.dot``, fewer rows and keys per tile for large heads."""
    if INTERPRETED:
        block_n = min(_pow2(max_seq_len, 16), max(16, 2048 // kv_heads))
        rows_budget = (1 << 19) // (kv_heads * block_n)
        return min(_pow2(max_query_len), max(1, rows_budget // (group_pad * kv_heads))), block_n
    rows = 64 if head_dim <= 128 else 32
    min_q = _pow2(-(-16 // group_pad))
    block_q = max(min_q, min(_pow2(max_query_len), max(1, rows // group_pad)))
    return block_q, (64 if head_dim <= 128 else 32)


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, max_query_len: int, max_seq_len: int) -> torch.Tensor:
    """Causal attention of the flat batch ``q`` ``[T, heads, head_dim]`` over each request's
    cache (through ``block_table``), written into ``out``; one launch for the whole batch."""
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    # The interpreter pays per program and per operation, not per element: there one program
    # takes every K/V head of its request.
    kv_heads = _pow2(num_kv_heads) if INTERPRETED else 1
    block_q, block_n = tile_sizes(group_pad, kv_heads, head_dim, max_query_len, max_seq_len)
    grid = (num_reqs, triton.cdiv(num_kv_heads, kv_heads), triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=_pow2(head_dim, 16), BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q, BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # The interpreter multiplies bfloat16 as raw integers, and float16 without BLAS.
        DOT_FP32=INTERPRETED and q.dtype != torch.float32)
    return out
