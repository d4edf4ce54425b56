"""Every attention backend agrees with a float64 reference on random batches, fills every output
element, and writes exactly the cache slots it is given (nothing else).

Each case draws fresh random inputs (its seed comes from its parameters). Outputs start as NaN,
so an element a backend forgets to write fails the NaN check; every unused cache slot (block
tails, spare blocks, the null block that pads the block table) holds large random values, so a
backend that lets one into a softmax fails the error check.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from framework import BACKENDS
from framework.execution.attention import AttentionMetadata
from tests.backends.batches import Batch, mixed_specs, random_batch, relative_error

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # query heads per K/V head: 1, 2, 4, 8
KINDS = ["mixed", "decode", "prefill"]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (backend, device): every backend on CPU, and on CUDA when a GPU is present. flash_attn has its
# own file (it needs CUDA, half precision and 256-token blocks).
TARGETS = [("naive", "cpu"), ("torch_paged", "cpu"), ("triton", "cpu")] + [
    pytest.param(name, "cuda", marks=[gpu, needs_cuda]) for name in ("naive", "torch_paged", "triton")]


def seed_of(*params: object) -> int:
    return zlib.crc32(repr(params).encode())


def batch_specs(kind: str, rng: np.random.Generator, block_size: int) -> list[tuple[int, int]]:
    """(num_computed, q_len) per request. "mixed" has every kind in one batch; "decode" includes
    an empty-context decode and lengths that end exactly on a block boundary; "prefill" mixes
    full prefills with a prefix-cache hit and a chunk that crosses a block boundary."""
    if kind == "mixed":
        return mixed_specs(rng, block_size, num_reqs=7, max_len=70)
    if kind == "decode":
        return [(0, 1), (block_size - 1, 1), (block_size, 1)] + [(int(c), 1) for c in rng.integers(1, 90, size=4)]
    return [(0, int(n)) for n in rng.integers(2, 60, size=3)] + [(2 * block_size, 9), (block_size - 2, 5)]


def run(name: str, batch: Batch, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
        dtype: torch.dtype, device: str, use_out: bool = True) -> torch.Tensor:
    backend = BACKENDS.create(name, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              scale=batch.scale, block_size=block_size, dtype=dtype, device=device)
    meta = backend.build_metadata(batch.meta)
    out = torch.full_like(batch.q, float("nan")) if use_out else None
    result = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, out=out)
    if use_out:
        assert result.data_ptr() == out.data_ptr(), "forward(out=...) must write into out and return it"
    assert result.shape == batch.q.shape and result.dtype == dtype
    return result


def check(result: torch.Tensor, batch: Batch, cache_before: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(result).any(), "an output element was never written (or became NaN)"
    err = relative_error(result, batch.expected)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} vs the float64 reference"
    expected_cache = cache_before.clone()
    flat = expected_cache.view(2, -1, *expected_cache.shape[-2:])
    slots = batch.meta.slot_mapping
    flat[0, slots] = batch.k
    flat[1, slots] = batch.v
    assert torch.equal(batch.kv_cache, expected_cache), "the K/V store touched slots outside slot_mapping"


@pytest.mark.parametrize("name, device", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("kind", KINDS)
def test_backend_matches_float64_reference(name, device, dtype, num_heads, num_kv_heads, kind):
    block_size, head_dim = 16, 32
    seed = seed_of(name, device, str(dtype), num_heads, num_kv_heads, kind)
    specs = batch_specs(kind, np.random.default_rng(seed), block_size)
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, device=device)
    before = batch.kv_cache.clone()
    result = run(name, batch, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
    check(result, batch, before, dtype)


@pytest.mark.parametrize("name, device", TARGETS)
def test_strided_qkv_views_as_the_model_passes_them(name, device):
    """The model hands q, k, v as column slices of one fused projection (row stride larger than
    heads x head_dim), and asks for a fresh output tensor."""
    num_heads, num_kv_heads, head_dim, block_size, dtype = 8, 2, 32, 8, torch.float32
    seed = seed_of("strided", name, device)
    specs = mixed_specs(np.random.default_rng(seed), block_size, num_reqs=6, max_len=40)
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, device=device)
    fused = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = fused.split([q_size, kv_size, kv_size], dim=1)
    batch.q = q.view(-1, num_heads, head_dim)
    batch.k = k.view(-1, num_kv_heads, head_dim)
    batch.v = v.view(-1, num_kv_heads, head_dim)
    before = batch.kv_cache.clone()
    result = run(name, batch, num_heads, num_kv_heads, head_dim, block_size, dtype, device, use_out=False)
    check(result, batch, before, dtype)


@pytest.mark.parametrize("name", ["naive", "torch_paged", "triton"])
def test_block_table_padding_wider_than_any_request(name):
    """The preparer's block table can be wider than the step needs; the extra columns are the
    null block and must be ignored."""
    num_heads, num_kv_heads, head_dim, block_size, dtype = 4, 2, 32, 16, torch.float32
    seed = seed_of("wide", name)
    batch = random_batch([(5, 1), (0, 12), (20, 3)], num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    meta = batch.meta
    meta.block_table_cpu = np.pad(meta.block_table_cpu, ((0, 0), (0, 3)))
    meta.block_table = torch.from_numpy(meta.block_table_cpu)
    before = batch.kv_cache.clone()
    result = run(name, batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu")
    check(result, batch, before, dtype)


@pytest.mark.parametrize("name", ["naive", "torch_paged", "triton"])
@pytest.mark.parametrize("specs", [[(0, 1)], [(0, 1), (0, 9)], [(0, 7)]], ids=["one-token-prompt", "with-prefill",
                                                                              "lone-prefill"])
def test_a_request_alone_in_its_group(name, specs):
    """A one-token prompt is the only decode-shaped row of its step (alone, or next to a
    prefill), or a prompt is the step's only prefill: a backend that plans per group must still
    hide the rest of the request's block."""
    num_heads, num_kv_heads, head_dim, block_size, dtype = 4, 2, 32, 16, torch.float32
    seed = seed_of("alone", name, specs)
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    before = batch.kv_cache.clone()
    result = run(name, batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu")
    check(result, batch, before, dtype)


@pytest.mark.parametrize("name", ["naive", "torch_paged", "triton"])
def test_an_empty_step(name):
    """A step of no requests (from_host of empty arrays) computes nothing and writes nothing, on
    every backend."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    none = np.zeros(0, dtype=np.int64)
    meta = AttentionMetadata.from_host(np.zeros(1, dtype=np.int64), none, np.zeros((0, 1), dtype=np.int64), none,
                                       block_size)
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len) == (0, 0, 0, 0)
    backend = BACKENDS.create(name, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              scale=head_dim ** -0.5, block_size=block_size, dtype=torch.float32, device="cpu")
    cache = torch.randn(2, 3, block_size, num_kv_heads, head_dim)
    before = cache.clone()
    q, kv = torch.zeros(0, num_heads, head_dim), torch.zeros(0, num_kv_heads, head_dim)
    out = backend.forward(q, kv, kv, cache, backend.build_metadata(meta))
    assert out.shape == (0, num_heads, head_dim)
    assert torch.equal(cache, before)
