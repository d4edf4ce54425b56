"""Speed guards for the C++ operators against the torch operators they replace, on the engine-speed benchmark's
model (``make bench``; read each C++ case against its torch case in the same run): the fused ones on a prefill
step's 2,048 rows, the AMX linear layers on a decode step's 50. The inputs are random: all-zero ones hid SiLU's
denormal results, 6x its time."""
import pytest
import torch
import torch.nn.functional as F

from framework.execution.cpu_features import cpu_has_amx_bf16
from models.cpu_ops import amx_linear, fused_ops
from models.rope import RotaryEmbedding

ROWS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2048, 8, 4, 32, 768
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)


@DTYPES
@pytest.mark.parametrize("impl", ["fused", "torch"])
def test_silu_and_mul(benchmark, impl, dtype):
    x = torch.randn(ROWS, 2 * INTERMEDIATE, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = torch.empty(ROWS, INTERMEDIATE, dtype=dtype)
    if impl == "fused":
        benchmark(fused_ops().silu_and_mul, x, out)
    else:
        benchmark(lambda: F.silu(x[:, :INTERMEDIATE]) * x[:, INTERMEDIATE:])


@DTYPES
@pytest.mark.parametrize("impl", ["fused", "fused_into_cache", "torch"])
def test_qkv_rotary(benchmark, impl, dtype):
    """The split of q/k/v with RoPE on q and k; ``fused_into_cache`` also stores K/V in a paged cache, where the
    others leave them in tensors of their own (torch's then needs a store of its own too)."""
    gen = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(HEAD_DIM, 512, 10000.0, None, 512, dtype)
    qkv = torch.randn(ROWS, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (ROWS,), generator=gen)
    q = torch.empty(ROWS, HEADS, HEAD_DIM, dtype=dtype)
    k, v = torch.empty(ROWS, KV_HEADS, HEAD_DIM, dtype=dtype), torch.empty(ROWS, KV_HEADS, HEAD_DIM, dtype=dtype)
    cache = torch.zeros(2, ROWS // 32 + 1, 32, KV_HEADS, HEAD_DIM, dtype=dtype)
    slots = torch.randperm(cache.shape[1] * 32, generator=gen)[:ROWS]
    ops = fused_ops()
    if impl == "fused":
        benchmark(ops.qkv_rotary, qkv, positions, rotary.cos, rotary.sin, q, k, v)
    elif impl == "fused_into_cache":
        benchmark(ops.qkv_rotary_into_cache, qkv, positions, rotary.cos, rotary.sin, q, cache[0], cache[1], slots)
    else:
        def split_and_rotate():
            rq, rk, rv = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            return rotary(positions, rq.reshape(ROWS, HEADS, HEAD_DIM), rk.reshape(ROWS, KV_HEADS, HEAD_DIM)), rv

        benchmark(split_and_rotate)


@pytest.mark.parametrize("impl", [pytest.param("amx", marks=pytest.mark.skipif(
    not cpu_has_amx_bf16(), reason="needs a CPU with AMX bf16 tiles")), "torch"])
@pytest.mark.parametrize("in_features, out_features", [(256, 1536), (768, 256)], ids=["gate_up", "down"])
def test_decode_linear(benchmark, impl, in_features, out_features):
    """A bf16 product of a decode step (50 rows): oneDNN's per-call cost against the work, the kernel's against
    torch's ``F.linear``."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(50, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    if impl == "amx":
        ops = amx_linear()
        packed, out = ops.pack_weight(weight), torch.empty(50, out_features, dtype=torch.bfloat16)
        benchmark(ops.amx_linear, x, packed, None, out)
    else:
        benchmark(F.linear, x, weight)
