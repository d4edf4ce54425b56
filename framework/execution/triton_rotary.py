"""Triton device functions shared by the model's RoPE operator (``models.cuda_ops``) and attention kernels that
rotate q and k themselves, so that both give the same bits: rounding to a dtype, and the rotate-half rotation."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest-even in ``dtype``. bfloat16 by its bits: Triton's interpreter (the
    CPU tests) truncates to bfloat16 where a GPU rounds."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def rotated(x, partner, cos, sin, sign):
    """One rotate-half RoPE element in ``x``'s dtype: x * cos + sign * partner * sin (sign -1 for the first half
    of a head, +1 for the second), each product and the sum rounded to the dtype, as transformers computes it.
    ``cos``, ``sin`` float32. In float32 only a launch without fused multiply-adds rounds the products."""
    dt = x.dtype
    xc = rounded(x.to(tl.float32) * cos, dt).to(tl.float32)
    ps = rounded(partner.to(tl.float32) * sin, dt).to(tl.float32)
    return rounded(xc + sign * ps, dt)
