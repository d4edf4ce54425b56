"""Triton kernels of the ``triton`` attention backend: a K/V store through ``slot_mapping`` and one
paged-attention kernel over a mixed flat batch.

Imported only through ``backends/triton_paged.py: load_kernels``, which also executes this source a
second time, as another module, with Triton's interpreter on (read when the kernels are decorated).
Any power-of-two block size and head sizes up to 256; K/V tiles are gathered position by position
through the block table, so a tile may span blocks.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from framework.execution.host_memory import to_device
from framework.execution.triton_rotary import rotated

#: Whether these kernels were decorated for Triton's CPU interpreter (Triton before 3.3 has no
#: ``knobs`` and reads the variable directly).
INTERPRETED: bool = (bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs")
                     else os.environ.get("TRITON_INTERPRET", "0") == "1")


# The kernels call no jitted helper of triton.language (tl.max, tl.sum, ...): under the interpreter
# each call costs about a millisecond, and helpers decorated before TRITON_INTERPRET was set cannot be
# called from an interpreted kernel at all. Reducing with their combine functions is the same operation.
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
    out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
    tile_req_ptr, tile_row_ptr, tile_len_ptr, tile_pos_ptr, tile_end_ptr, scale_log2e,
    stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    stride_cb, stride_cs, stride_ch, stride_bt, cos_ptr, sin_ptr, slot_ptr, stride_cos,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, DECODE: tl.constexpr, ROTARY: tl.constexpr,
):
    """Program (query tile, kv-head tile) attends up to BLOCK_Q consecutive query tokens of one request,
    for the query heads of KV_HEADS consecutive K/V heads, to that request's keys up to each token's own
    position, BLOCK_N at a time, with an online softmax. Tiles are ``LaunchPlan.tiles`` (a decode is one
    tile, a prefill one per BLOCK_Q tokens). With DECODE, tile i is request i's one query at row i and
    ``tile_end_ptr`` its ``seq_lens``: nothing is planned on the host (``decode_plan``).

    Tile rows are (kv head, token, query head of the group), columns (kv head, key position); with
    KV_HEADS > 1 a row sees only its own head's columns (one 2-D dot for all heads suits the
    interpreter). With NUM_SPLITS > 1 (flash-decoding) program axis 2 takes one of NUM_SPLITS equal key
    ranges and writes its normalised partial output to ``out[split]`` and its log2-sum-exp to
    ``lse[split]``, merged by ``_combine_splits_kernel``.

    With ROTARY (and DECODE) ``q_ptr`` is the step's unrotated q/k/v rows (``stride_qh`` the head size): the
    program rotates its query heads and its K/V heads' new key at position ``seq_len - 1`` by the ``cos``/``sin``
    tables (``rotated``, as ``models.cuda_ops`` does) and attends to the new key and value from q/k/v, storing
    them at ``slot_ptr[req]`` after its loop (the split holding that position).
    """
    ROWS: tl.constexpr = KV_HEADS * BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    if DECODE:
        req = tile.to(tl.int64)
        first_row = req
        num_tokens = 1
        kv_end = tl.load(tile_end_ptr + tile).to(tl.int64)
        first_pos = kv_end - 1
    else:
        req = tl.load(tile_req_ptr + tile)
        first_row = tl.load(tile_row_ptr + tile)
        num_tokens = tl.load(tile_len_ptr + tile)
        first_pos = tl.load(tile_pos_ptr + tile)
        kv_end = tl.load(tile_end_ptr + tile)
    # int64 index arithmetic: addresses need it anyway, and the interpreter checks every int32
    # add and multiply for overflow.
    rows = tl.arange(0, ROWS).to(tl.int64)
    member = rows % GROUP_PAD
    token = (rows // GROUP_PAD) % BLOCK_Q
    row_ok = token < num_tokens
    if GROUP != GROUP_PAD:
        row_ok = row_ok & (member < GROUP)
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
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_mask = row_ok[:, None]
    if HEAD_DIM != HEAD_DIM_PAD:
        q_mask = q_mask & (dims < HEAD_DIM)[None, :]
    row_token = first_row + token
    row_head = row_kv * GROUP + member
    q_rows = q_ptr + (row_token * stride_qt + row_head * stride_qh)[:, None]
    q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)
    if ROTARY:
        # Rotate half: dimension d < D/2 pairs with d + D/2 (minus its sine term), d >= D/2 with d - D/2.
        # Loaded here, rotated once the first key tile's block-table entries are asked for too.
        upper = dims >= HEAD_DIM // 2
        partner = tl.where(upper, dims - HEAD_DIM // 2, dims + HEAD_DIM // 2)
        sign = tl.where(upper, 1.0, -1.0)
        new_pos = first_pos  # a decode's one token is its last
        angle = new_pos * stride_cos + tl.where(upper, dims - HEAD_DIM // 2, dims)
        dim_ok = dims < HEAD_DIM
        cos = tl.load(cos_ptr + angle, mask=dim_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + angle, mask=dim_ok, other=0.0).to(tl.float32)
        q_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
    # A row sees column c if c is its own head's and the key is not in its future; every real
    # row's position is below kv_end, so this also hides the positions a tile loads past it.
    last_visible = (first_pos + token)[:, None]
    if KV_HEADS > 1:
        last_visible = tl.where(row_kv[:, None] == col_kv[None, :], last_visible, -1)
    col_head = col_kv * stride_ch
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.full([ROWS], 0.0, tl.float32)
    acc = tl.full([ROWS, HEAD_DIM_PAD], 0.0, tl.float32)
    table = block_table_ptr + req * stride_bt
    kv_start = 0
    if NUM_SPLITS > 1:
        chunk = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        kv_start = tl.program_id(2) * chunk
        kv_end = tl.minimum(kv_end, kv_start + chunk)
    # Each tile's K and V loads go out together, and the next tile's block-table entries with them:
    # a tile then waits on one memory round trip instead of three (table, K, then V after the softmax).
    col_end = kv_end
    if NUM_KV_HEADS % KV_HEADS != 0:
        col_end = tl.where(col_kv < NUM_KV_HEADS, kv_end, 0)  # a padding head's columns see no key
    pos = kv_start + col_pos
    pos_ok = pos < col_end
    if ROTARY:
        # The new token's key and value: each column's head's (heads H + kv and H + KVH + kv of its q/k/v row).
        new_cols = q_ptr + req * stride_qt + ((NUM_KV_HEADS * GROUP + col_kv + 0 * cols) * stride_qh)[:, None]
        holds_new = (kv_start <= new_pos) & (new_pos < kv_end)  # this split's keys: the one program to store it
        first_col = (col_pos == 0) & pos_ok  # one column of each real head (its first key)
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    if ROTARY:
        q = rotated(q, q_partner, cos, sin, sign)
    if DOT_FP32:
        q = q.to(tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        slot = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + col_head
        kv_mask = pos_ok[:, None]
        if HEAD_DIM != HEAD_DIM_PAD:
            kv_mask = kv_mask & (dims < HEAD_DIM)[None, :]
        kv_ptrs = slot[:, None] + dims[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        if ROTARY:
            if start + BLOCK_N > new_pos:  # the tile holding the new token: its key and value from q/k/v
                new = (pos == new_pos)[:, None] & kv_mask
                k = tl.where(new, rotated(tl.load(new_cols + dims[None, :], mask=new, other=0.0),
                                          tl.load(new_cols + partner[None, :], mask=new, other=0.0), cos, sin,
                                          sign), k)
                v = tl.where(new, tl.load(new_cols + NUM_KV_HEADS * stride_qh + dims[None, :], mask=new, other=0.0),
                             v)
        next_pos = pos + BLOCK_N
        next_ok = next_pos < col_end
        block = tl.load(table + next_pos // BLOCK_SIZE, mask=next_ok, other=0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        s = tl.where(pos[None, :] <= last_visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        if NUM_SPLITS > 1:
            # A split can hold no key a row may see; keep its row at exactly zero, not NaN.
            # (Unsplit, position 0 is in the first tile and visible to every row.)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        if v_cache_ptr.dtype.element_ty != tl.float32:
            # P is rounded to the cache dtype as on a GPU's tensor cores, even when the
            # interpreter then multiplies in float32.
            p = p.to(v_cache_ptr.dtype.element_ty)
            if DOT_FP32:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
        pos, pos_ok = next_pos, next_ok
    if ROTARY:
        # Stored after the loop, which takes them from q/k/v: no program reads a slot this launch writes.
        if holds_new:
            new_mask = first_col[:, None] & dim_ok[None, :]
            new_k = rotated(tl.load(new_cols + dims[None, :], mask=new_mask, other=0.0),
                            tl.load(new_cols + partner[None, :], mask=new_mask, other=0.0), cos, sin, sign)
            new_v = tl.load(new_cols + NUM_KV_HEADS * stride_qh + dims[None, :], mask=new_mask, other=0.0)
            new_slot = tl.load(slot_ptr + req)
            dst = (new_slot // BLOCK_SIZE) * stride_cb + (new_slot % BLOCK_SIZE) * stride_cs + col_head + 0 * cols
            tl.store(k_cache_ptr + dst[:, None] + dims[None, :], new_k, mask=new_mask)
            tl.store(v_cache_ptr + dst[:, None] + dims[None, :], new_v, mask=new_mask)
    out_rows = row_token * stride_ot + row_head * stride_oh
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
    else:
        split = tl.program_id(2)
        out_rows += split * stride_os
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + row_token * stride_lt + row_head, lse, mask=row_ok)
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_ptr, lse_ptr, num_heads,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Program t merges the NUM_SPLITS partial outputs of token t, all heads: weights
    2**(lse_split - max lse), normalised."""
    token = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    sh_mask = (splits < NUM_SPLITS)[:, None] & (heads < num_heads)[None, :]
    lse = tl.load(lse_ptr + splits[:, None] * stride_ls + token * stride_lt + heads[None, :], mask=sh_mask,
                  other=float("-inf"))
    top = tl.reduce(lse, 0, _max_combine)
    weight = tl.exp2(lse - top[None, :])  # [splits, heads]; split 0 always saw position 0
    weight = weight / tl.reduce(weight, 0, _sum_combine)[None, :]
    offs = splits[:, None, None] * stride_ps + heads[None, :, None] * stride_ph + dims[None, None, :]
    mask = sh_mask[:, :, None] & (dims < HEAD_DIM)[None, None, :]
    part = tl.load(part_ptr + token * stride_pt + offs, mask=mask, other=0.0)
    out = tl.reduce(part * weight[:, :, None], 0, _sum_combine)
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(heads < num_heads)[:, None] & (dims < HEAD_DIM)[None, :])


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` current for a launch: Triton launches on the current CUDA device, not on
    the tensors' (``cuda:1`` while ``cuda:0`` is current would run on the wrong GPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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
    block_t = store_block_t(num_tokens, heads_pad, head_dim_pad)
    with device_guard(k_cache.device):
        _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
            k, v, k_cache, v_cache, slot_mapping, num_tokens,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_T=block_t)


def store_block_t(num_tokens: int, heads_pad: int, head_dim_pad: int) -> int:
    """Tokens per ``_store_kv_kernel`` program. The interpreter pays per program, not per
    element: there one program covers a whole step, or as much of it as fits in the largest
    tile Triton allows (``tl.TRITON_MAX_TENSOR_NUMEL`` elements)."""
    if INTERPRETED:
        return min(_pow2(num_tokens), 4096, max(1, tl.TRITON_MAX_TENSOR_NUMEL // (heads_pad * head_dim_pad)))
    return max(1, 4096 // (heads_pad * head_dim_pad))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for ``dtype`` operands: exact for float32 (the float64
    reference checks it), tensor cores' tf32 otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass
class LaunchPlan:
    """One step's tiling, shared by every layer: tile sizes and the list of query tiles the
    attention kernel's first grid axis runs over, as ``tiles`` int64 ``[5, num_tiles]`` rows:
    request, first token row, number of tokens, position of the first token, end of its keys
    (``tile_rows``: the five rows, the kernel's arguments). With splits, ``part`` and ``lse`` are
    the float32 partial outputs ``[splits, T, heads, head_dim]`` and log-sum-exps ``[splits, T,
    heads]`` every layer writes and combines (layers run one after another). A ``decode`` plan
    (``decode_plan``) has ``tiles`` = the step's ``seq_lens`` as ``[1, num_reqs]``, read on the device;
    ``num_warps`` is the launch's."""

    block_q: int
    block_n: int
    kv_heads: int    # K/V heads per program
    num_splits: int  # key ranges per tile (flash-decoding); 1 = none
    tiles: torch.Tensor
    tile_rows: tuple[torch.Tensor, ...] = ()
    part: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    decode: bool = False
    num_warps: int = 4


# What the interpreter spends, measured on a 2-core CPU (``tile_sizes`` weighs candidates with
# it): per query tile and per key-tile iteration in fixed operations, and per element of the
# score tile and of the K/V tiles.
_TILE_S, _ITER_S, _SCORE_S, _KV_S = 2.2e-3, 1.5e-3, 20e-9, 30e-9


def tile_sizes(group_pad: int, kv_heads: int, head_dim: int, q_lens: np.ndarray,
               seq_lens: np.ndarray) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N) for one step: on a GPU sized for registers (at least 16 rows for ``tl.dot``);
    under the interpreter the cheapest power-of-two pair for the step's lengths by the measured costs
    ``_TILE_S`` etc., among those whose score tile Triton accepts (``tl.TRITON_MAX_TENSOR_NUMEL``)."""
    max_q, max_seq = int(q_lens.max()), int(seq_lens.max())
    if not INTERPRETED:
        rows = 64 if head_dim <= 128 else 32
        min_q = _pow2(-(-16 // group_pad))
        block_q = max(min_q, min(_pow2(max_q), max(1, rows // group_pad)))
        return block_q, (64 if head_dim <= 128 else 32)
    context = seq_lens - q_lens
    best = (float("inf"), 1, 16)
    block_q = 1
    while block_q <= _pow2(max_q) and block_q * group_pad * kv_heads <= 1024:
        block_n = 16
        while block_n <= _pow2(max_seq, 16) and block_n * kv_heads <= 2048:
            rows, cols = kv_heads * block_q * group_pad, kv_heads * block_n
            if rows * cols > tl.TRITON_MAX_TENSOR_NUMEL:  # the score tile would be larger than Triton allows
                break
            tiles = -(-q_lens // block_q)
            # Tile t reads keys up to min(seq_len, context + (t + 1) * block_q).
            t = np.arange(int(tiles.max()))[None, :]
            kv_end = np.minimum(seq_lens[:, None], context[:, None] + (t + 1) * block_q)
            iters = np.where(t < tiles[:, None], -(-kv_end // block_n), 0).sum()
            cost = (tiles.sum() * _TILE_S + iters * (_ITER_S + rows * cols * _SCORE_S + cols * head_dim * _KV_S))
            best = min(best, (cost, block_q, block_n))
            block_n *= 2
        block_q *= 2
    return best[1], best[2]


def plan(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int,
         device: torch.device) -> LaunchPlan:
    """Tile sizes and work list for a step (host arrays in, the work list moved to ``device``)."""
    q_lens = np.diff(query_start_loc)
    group_pad = _pow2(num_heads // num_kv_heads)
    # The interpreter pays per program and per operation more than per element: there one
    # program takes every K/V head of its request.
    kv_heads = _pow2(num_kv_heads) if INTERPRETED else 1
    block_q, block_n = tile_sizes(group_pad, kv_heads, head_dim, q_lens, seq_lens)
    per_req = -(-q_lens // block_q)
    req = np.repeat(np.arange(len(q_lens), dtype=np.int64), per_req)
    offset = (np.arange(int(per_req.sum()), dtype=np.int64) - np.repeat(np.cumsum(per_req) - per_req, per_req)) * block_q
    first_pos = (seq_lens - q_lens)[req] + offset
    num_tokens = np.minimum(q_lens[req] - offset, block_q)
    kv_end = first_pos + num_tokens  # keys past the tile's last token are in every row's future
    tiles = to_device(np.stack([req, query_start_loc[req] + offset, num_tokens, first_pos, kv_end]), device)
    splits = num_splits(len(req) * num_kv_heads // kv_heads, int(kv_end.max()), block_n, device)
    part = lse = None
    if splits > 1:
        num_tokens_total = int(query_start_loc[-1])
        part = torch.empty((splits, num_tokens_total, num_heads, head_dim), dtype=torch.float32, device=device)
        lse = torch.empty((splits, num_tokens_total, num_heads), dtype=torch.float32, device=device)
    return LaunchPlan(block_q, block_n, kv_heads, splits, tiles, tuple(tiles), part, lse)


def decode_plan(seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                max_seq_len: int) -> LaunchPlan:
    """The launch of a decode-only step (one query per request, request i's at row i) that reads its
    lengths ``seq_lens`` on the device: no host work per step, so a CUDA graph can capture it. Tile
    sizes and key splits are fixed for any context up to ``max_seq_len`` (``decode_bounds`` lists those
    worth capturing)."""
    num_reqs, device = seq_lens.shape[0], seq_lens.device
    kv_heads, block_q, block_n = _decode_tiles(num_heads, num_kv_heads, head_dim, max_seq_len)
    splits = num_splits(num_reqs * num_kv_heads // kv_heads, max_seq_len, block_n, device)
    part = lse = None
    if splits > 1:
        part = torch.empty((splits, num_reqs, num_heads, head_dim), dtype=torch.float32, device=device)
        lse = torch.empty((splits, num_reqs, num_heads), dtype=torch.float32, device=device)
    return LaunchPlan(block_q, block_n, kv_heads, splits, seq_lens[None], (seq_lens,) * 5, part, lse, decode=True)


def _decode_tiles(num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int) -> tuple[int, int, int]:
    """(K/V heads a program takes, BLOCK_Q, BLOCK_N) of a decode-only launch up to ``max_seq_len``."""
    kv_heads = _pow2(num_kv_heads) if INTERPRETED else 1
    block_q, block_n = tile_sizes(_pow2(num_heads // num_kv_heads), kv_heads, head_dim, np.ones(1, np.int64),
                                  np.array([max_seq_len]))
    if not INTERPRETED and head_dim <= 64:
        # A decode tile's rows are one token's heads: its registers hold twice the keys of a prefill
        # tile's, and a program then waits on half as many memory round trips.
        block_n *= 2
    return kv_heads, block_q, block_n


#: The fewest key tiles a split range gets (``num_splits``).
SPLIT_TILES = 8


def num_splits(num_programs: int, longest: int, block_n: int, device: torch.device) -> int:
    """Key ranges per tile: enough programs for about two per GPU multiprocessor when a few
    long requests would leave most idle, at least ``SPLIT_TILES`` key tiles per range, at most 16
    ranges. Always 1 under the interpreter, where more programs only cost more."""
    if INTERPRETED or device.type != "cuda":
        return 1
    wanted = -(-2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device()) // num_programs)
    return max(1, min(wanted, longest // (SPLIT_TILES * block_n), 16))


def decode_bounds(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_model_len: int,
                  device: torch.device) -> list[int]:
    """The ``max_seq_len`` values worth a ``decode_plan`` (a CUDA graph each) for ``num_reqs`` decodes, ascending,
    the last ``max_model_len``: one per split count among 1, 2, 4, 8 below the most ``num_splits`` gives them, and
    that most. At the smallest bound at or above a step's longest sequence it gets at least its own split count."""
    kv_heads, _, block_n = _decode_tiles(num_heads, num_kv_heads, head_dim, max_model_len)
    most = num_splits(num_reqs * num_kv_heads // kv_heads, max_model_len, block_n, device)
    # Bound (s + 1) * SPLIT_TILES * block_n - 1 is the longest sequence num_splits gives s splits (s < most).
    return [(s + 1) * SPLIT_TILES * block_n - 1 for s in (1, 2, 4, 8) if s < most] + [max_model_len]


def split_workspace_bytes(num_heads: int, num_kv_heads: int, head_dim: int, max_tokens: int, num_sms: int) -> int:
    """The most bytes ``plan`` allocates for key splits (``LaunchPlan.part`` and ``lse``) in a step of up
    to ``max_tokens`` tokens on a GPU with ``num_sms`` multiprocessors."""
    # num_splits <= 2 * num_sms / programs + 1, programs >= tokens * num_kv_heads / BLOCK_Q (<= 64 rows),
    # so splits * tokens <= 128 * num_sms / num_kv_heads + tokens; and at most 16 splits.
    rows = min(16 * max_tokens, -(-128 * num_sms // num_kv_heads) + max_tokens)
    return rows * num_heads * (head_dim + 1) * 4


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass
class Rotary:
    """What a decode launch needs to rotate q and k and store the new K/V itself (``paged_attention``): RoPE's
    ``cos``/``sin`` tables ``[positions, head_dim / 2]`` and each request's cache ``slots`` ``[num_reqs]``
    (int64). A decode's position is its length less one, which the launch reads already."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, scale: float, launch: LaunchPlan,
                    rotary: Rotary | None = None) -> torch.Tensor:
    """Causal attention of the flat batch ``q`` ``[T, heads, head_dim]`` over each request's
    cache (through ``block_table``), written into ``out``; one launch for the whole batch. With ``rotary``
    (a ``decode`` launch) ``q`` is the step's unrotated q/k/v ``[T, (heads + 2 kv_heads) head_dim]``, which
    the launch rotates, storing the new keys and values in the caches."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if rotary is None:
        stride_qt, stride_qh = q.stride(0), q.stride(1)
        tables, slots, stride_cos = (q, q), launch.tiles, 0  # not read
    else:
        if not launch.decode or q.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"rotary needs a decode launch and q/k/v rows of {(num_heads + 2 * num_kv_heads)} "
                             f"heads of {head_dim}: got decode={launch.decode}, {tuple(q.shape)}")
        stride_qt, stride_qh = q.stride(0), head_dim
        tables, slots, stride_cos = (rotary.cos, rotary.sin), rotary.slots, rotary.cos.stride(0)
    splits = launch.num_splits
    if splits == 1:
        part, lse = out[None], out  # lse is not touched without splits
    else:
        part, lse = launch.part, launch.lse
    grid = (launch.tiles.shape[1], triton.cdiv(num_kv_heads, launch.kv_heads), splits)
    with device_guard(q.device):
        _paged_attention_kernel[grid](
            part, lse, q, k_cache, v_cache, block_table, *launch.tile_rows,
            scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
            stride_qt, stride_qh, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), *tables, slots,
            stride_cos, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=_pow2(group), KV_HEADS=launch.kv_heads,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=_pow2(head_dim, 16), BLOCK_SIZE=k_cache.shape[1],
            BLOCK_Q=launch.block_q, BLOCK_N=launch.block_n, NUM_SPLITS=splits,
            DOT_PRECISION=dot_precision(q.dtype),
            # The interpreter multiplies bfloat16 as raw integers, and float16 without BLAS.
            DOT_FP32=INTERPRETED and q.dtype != torch.float32, DECODE=launch.decode, ROTARY=rotary is not None,
            num_warps=launch.num_warps)
        if splits > 1:
            _combine_splits_kernel[(out.shape[0],)](
                out, part, lse, num_heads, out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
                lse.stride(0), lse.stride(1), NUM_SPLITS=splits, SPLITS_PAD=_pow2(splits), HEADS_PAD=_pow2(num_heads),
                HEAD_DIM=head_dim, HEAD_DIM_PAD=_pow2(head_dim, 16))
    return out
