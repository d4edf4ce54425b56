"""The model's fused elementwise operators for CUDA, in Triton: ``models.cpu_ops``' interface (``rms_norm``,
``add_rms_norm``, ``silu_and_mul``, ``qkv_rotary``), one launch each where torch runs 7-16 kernels, which
bounds a decode step (graph-captured or not) more than its bytes do; and ``qkv_rotary_into_cache``, which
also stores the keys and values in the paged cache (for backends that let the model do it). Arithmetic in
float32, each result rounded to the tensor's dtype where transformers rounds it, no fused multiply-adds (as
its separate kernels). Each takes ``prefetch``: a weight whose bytes it asks the L2 cache for as it starts (the
next matrix product's, so that the product reads them from L2 instead of waiting on HBM).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.execution.triton_rotary import rotated, rounded

# No jitted helper of triton.language in the kernels (see backends/triton_kernels.py): the tests run this
# source under Triton's interpreter, decorated after the helpers were.
_sum_combine = getattr(tl.standard, "_sum_combine", None)
if _sum_combine is None:  # pragma: no cover - other Triton versions
    @triton.jit
    def _sum_combine(a, b):
        return a + b

#: Launch options: float32 products and sums rounded separately, as transformers' kernels compute them.
_EXACT = {"enable_fp_fusion": False}

#: Whether these kernels were decorated for Triton's CPU interpreter, which has no cache to prefetch into
#: (and runs no inline assembly).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False

#: Bytes one bulk prefetch asks for: each thread of a launch issues one a chunk, the chunks dealt out across
#: the programs, so that a decode step's few programs ask for megabytes in a handful of instructions.
PREFETCH_CHUNK = tl.constexpr(16384)


@triton.jit
def _prefetch_l2(ptr, nbytes, program, programs, THREADS: tl.constexpr):
    """Asks L2 for bytes [0, nbytes) from ``ptr`` (a multiple of 16; Hopper's ``cp.async.bulk.prefetch``, no
    result, nothing waits on it), one chunk a thread: chunk ``c`` goes to program ``c % programs``, so that
    every program's SM takes a share. THREADS is the launch's thread count, so no two threads ask for one."""
    base = ptr.to(tl.pointer_type(tl.int8))
    for first in range(0, (nbytes + PREFETCH_CHUNK - 1) // PREFETCH_CHUNK, programs * THREADS):
        offset = (first + tl.arange(0, THREADS) * programs + program).to(tl.int64) * PREFETCH_CHUNK
        # Clamped in 64 bits: past the window the difference would wrap to a positive 32-bit size.
        size = tl.maximum(tl.minimum(nbytes - offset, PREFETCH_CHUNK), 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + offset, size], dtype=tl.int32, is_pure=False, pack=1)


def _prefetch(weight: torch.Tensor | None, like: torch.Tensor, num_warps: int) -> dict:
    """A launch's prefetch arguments: ``weight``'s bytes (rounded down to 16), none without one or interpreted."""
    nbytes = 0 if weight is None or INTERPRETED else weight.numel() * weight.element_size() // 16 * 16
    return {"pf_ptr": weight if nbytes else like, "pf_bytes": nbytes, "PREFETCH": nbytes > 0,
            "THREADS": 32 * num_warps, "num_warps": num_warps}


def _norm_launch(n: int, like: torch.Tensor, prefetch: torch.Tensor | None) -> dict:
    block = triton.next_power_of_2(n)
    return {"BLOCK": block, **_prefetch(prefetch, like, max(1, min(16, block // 256))), **_EXACT}


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, stride_x, stride_res, stride_out, eps, pf_ptr, pf_bytes,
                     ADD: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr, THREADS: tl.constexpr):
    """Row ``program_id``: with ADD, residual += x (rounded) first; out = weight * (r * rsqrt(mean(r^2) + eps))."""
    if PREFETCH:
        _prefetch_l2(pf_ptr, pf_bytes, tl.program_id(0), tl.num_programs(0), THREADS)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = rounded(res.to(tl.float32) + x.to(tl.float32), x.dtype)
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.reduce(xf * xf, 0, _sum_combine) / n + eps)  # torch's CUDA rsqrt
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * rounded(xf * inv, x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, rounded(y, x.dtype), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in gate's dtype, silu(gate) rounded to it first, as torch's two operators round
    (``models.cuda_matmul`` applies it to its input too)."""
    g = gate.to(tl.float32)
    act = rounded(g / (1.0 + tl.exp(-g)), gate.dtype).to(tl.float32)
    return rounded(act * up.to(tl.float32), gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_out, pf_ptr, pf_bytes, BLOCK: tl.constexpr,
                         PREFETCH: tl.constexpr, THREADS: tl.constexpr):
    """out[row, cols] = silu(gate) * up, gate and up the halves of x's row."""
    if PREFETCH:
        _prefetch_l2(pf_ptr, pf_bytes, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                     tl.num_programs(0) * tl.num_programs(1), THREADS)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_mul(gate, up), mask=mask)


@triton.jit
def _qkv_rotary_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, stride_qkv, stride_cos,
                       stride_kb, stride_ks, stride_kh, pf_ptr, pf_bytes, HEADS: tl.constexpr,
                       KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, SLOTS: tl.constexpr, PREFETCH: tl.constexpr,
                       THREADS: tl.constexpr):
    """Program (row, head): query heads, then key heads rotated ("rotate half", each product and sum rounded
    to the dtype, as transformers does) into q and k; the value heads copied into v. A key or value head goes
    to ``(slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + head * stride_kh`` of k or v,
    its slot read from ``slot_ptr`` with SLOTS (a paged cache), else the row itself."""
    if PREFETCH:
        _prefetch_l2(pf_ptr, pf_bytes, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                     tl.num_programs(0) * tl.num_programs(1), THREADS)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    cols = tl.arange(0, HALF_PAD)
    mask = cols < half
    src = qkv_ptr + row * stride_qkv + head * HEAD_DIM
    a = tl.load(src + cols, mask=mask, other=0.0)
    b = tl.load(src + half + cols, mask=mask, other=0.0)
    slot = row
    if SLOTS:
        slot = tl.load(slot_ptr + row).to(tl.int64)
    kv_head = (head - HEADS) % KV_HEADS
    kv_dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    if head < HEADS + KV_HEADS:
        pos = tl.load(pos_ptr + row)
        c = tl.load(cos_ptr + pos * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
        o1 = rotated(a, b, c, s, -1.0)
        o2 = rotated(b, a, c, s, 1.0)
        if head < HEADS:
            dst = q_ptr + (row * HEADS + head) * HEAD_DIM
        else:
            dst = k_ptr + kv_dst
        tl.store(dst + cols, o1, mask=mask)
        tl.store(dst + half + cols, o2, mask=mask)
    else:
        dst = v_ptr + kv_dst
        tl.store(dst + cols, a, mask=mask)
        tl.store(dst + half + cols, b, mask=mask)


def _rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with contiguous rows, got shape {tuple(t.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
             prefetch: torch.Tensor | None = None) -> None:
    """out = rms_norm(x) * weight; x, out: [T, n] with contiguous rows; weight: [n]."""
    _rows(x, "x")
    _rows(out, "out")
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.shape[1], x.stride(0), x.stride(0), out.stride(0), eps,
                                        ADD=False, **_norm_launch(x.shape[1], x, prefetch))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 prefetch: torch.Tensor | None = None) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight."""
    _rows(x, "x")
    _rows(residual, "residual")
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, x, x.shape[1], x.stride(0), residual.stride(0),
                                        x.stride(0), eps, ADD=True, **_norm_launch(x.shape[1], x, prefetch))


def silu_and_mul(x: torch.Tensor, out: torch.Tensor, prefetch: torch.Tensor | None = None) -> None:
    """out[:, :n] = silu(x[:, :n]) * x[:, n:]; x: [T, 2n], out: [T, n]."""
    _rows(x, "x")
    _rows(out, "out")
    rows, n = out.shape
    if x.shape != (rows, 2 * n):
        raise ValueError(f"x must be [T, 2n] for out [T, n]: got {tuple(x.shape)} for {tuple(out.shape)}")
    block = min(triton.next_power_of_2(n), 1024)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block,
                                                             **_prefetch(prefetch, x, 4), **_EXACT)


def qkv_rotary(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, prefetch: torch.Tensor | None = None) -> None:
    """Splits qkv [T, (H + 2 KVH) D] into contiguous q [T, H, D], k, v [T, KVH, D], rotating q and k at
    ``positions`` [T] (int64) by the ``cos``/``sin`` tables [positions, D / 2]."""
    if not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape:
        raise ValueError(f"k and v must be contiguous and of one shape: got {tuple(k.shape)}, {tuple(v.shape)}")
    _qkv_rotary(qkv, positions, cos, sin, q, k, v, None, prefetch)


def qkv_rotary_into_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, prefetch: torch.Tensor | None = None) -> None:
    """``qkv_rotary`` with the keys and values written straight into a layer's paged caches [blocks,
    block_size, KVH, D] at ``slot_mapping`` [T] (int64; ``block * block_size + offset``) and nowhere else."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache and v_cache must have one layout, contiguous in head_dim: got shapes "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if slot_mapping.shape[0] != qkv.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {qkv.shape[0]} rows of qkv")
    _qkv_rotary(qkv, positions, cos, sin, q, k_cache, v_cache, slot_mapping, prefetch)


def _qkv_rotary(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None, prefetch: torch.Tensor | None) -> None:
    _rows(qkv, "qkv")
    if not q.is_contiguous():
        raise ValueError("q must be contiguous")
    rows, heads, head_dim = q.shape
    if slots is None:  # k, v [T, KVH, D]: row t's head h at t * KVH * D + h * D
        kv_heads, block_size, strides = k.shape[1], 1, (k.stride(0), 0, k.stride(1))
    else:
        kv_heads, block_size, strides = k.shape[2], k.shape[1], (k.stride(0), k.stride(1), k.stride(2))
    if rows:
        _qkv_rotary_kernel[(rows, heads + 2 * kv_heads)](
            qkv, positions, cos, sin, q, k, v, positions if slots is None else slots, qkv.stride(0), cos.stride(0),
            *strides, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_SIZE=block_size, SLOTS=slots is not None,
            **_prefetch(prefetch, qkv, 4), **_EXACT)
