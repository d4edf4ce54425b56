"""The Triton backend beyond the common agreement cases: head sizes 64/80/128/256, block sizes
16/32/64, tiles smaller than the requests, the interpreter switch and its notice.

On a machine without CUDA these run through Triton's interpreter (set by the backend itself);
the ``gpu`` cases compile the same kernels for a GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.triton_paged import INTERPRETER_NOTICE, load_kernels
from framework import BACKENDS
from tests.backends.batches import mixed_specs, random_batch
from tests.backends.test_agreement import check, run, seed_of, skip_interpreter_on_cuda_machines

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def mixed_batch(name, num_heads, num_kv_heads, head_dim, block_size, dtype, device, num_reqs=5, max_len=2):
    seed = seed_of(name, num_heads, num_kv_heads, head_dim, block_size, str(dtype), device)
    specs = mixed_specs(np.random.default_rng(seed), block_size, num_reqs=num_reqs, max_len=max_len * block_size)
    return random_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_head_and_block_sizes(head_dim, block_size, device):
    batch = mixed_batch("sizes", 4, 2, head_dim, block_size, torch.float32, device)
    before = batch.kv_cache.clone()
    check(run("triton", batch, 4, 2, head_dim, block_size, torch.float32, device), batch, before, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [80, 128])
def test_half_precision_with_padded_and_plain_heads(head_dim, dtype, device):
    batch = mixed_batch("half", 8, 2, head_dim, 16, dtype, device)
    before = batch.kv_cache.clone()
    check(run("triton", batch, 8, 2, head_dim, 16, dtype, device), batch, before, dtype)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(12, 4), (6, 6)])
def test_groups_and_head_counts_that_are_not_powers_of_two(num_heads, num_kv_heads):
    batch = mixed_batch("npow2", num_heads, num_kv_heads, 32, 16, torch.float32, "cpu")
    before = batch.kv_cache.clone()
    check(run("triton", batch, num_heads, num_kv_heads, 32, 16, torch.float32, "cpu"), batch, before, torch.float32)


@pytest.mark.parametrize("block_q, block_n", [(1, 16), (2, 16), (4, 32)])
def test_tiles_smaller_than_the_requests(monkeypatch, block_q, block_n):
    """Long prefills split over several query tiles and long contexts over several key tiles
    (and key tiles that end mid-block) give the same answer."""
    skip_interpreter_on_cuda_machines("triton", "cpu")
    monkeypatch.setattr(load_kernels(torch.device("cpu")), "tile_sizes", lambda *args: (block_q, block_n))
    batch = mixed_batch("tiles", 4, 2, 32, 8, torch.float32, "cpu", num_reqs=6, max_len=5)
    before = batch.kv_cache.clone()
    check(run("triton", batch, 4, 2, 32, 8, torch.float32, "cpu"), batch, before, torch.float32)


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_key_ranges_merge_to_the_same_answer(monkeypatch, splits, dtype):
    """Flash-decoding (chosen on GPUs for few long requests) forced on. With 4-token query
    tiles and 16-key tiles, the tile of positions 30..33 of request (30, 6) has a split starting
    at key 32, where rows 30 and 31 see no key at all; short requests get empty splits."""
    skip_interpreter_on_cuda_machines("triton", "cpu")
    kernels = load_kernels(torch.device("cpu"))
    monkeypatch.setattr(kernels, "tile_sizes", lambda *args: (4, 16))
    monkeypatch.setattr(kernels, "num_splits", lambda *args: splits)
    specs = [(30, 6), (0, 1), (45, 1), (0, 21), (16, 9), (7, 1)]
    seed = seed_of("splits", splits, str(dtype))
    batch = random_batch(specs, 8, 2, 32, 8, dtype, seed)
    before = batch.kv_cache.clone()
    check(run("triton", batch, 8, 2, 32, 8, dtype, "cpu"), batch, before, dtype)


def test_a_long_step_with_many_kv_heads_is_stored():
    """1025 new tokens of 8 K/V heads of size 128 (a Llama-3-8B prompt): one interpreter program
    for the whole step would be a 2048 x 1024 tile, twice the largest Triton accepts."""
    skip_interpreter_on_cuda_machines("triton", "cpu")
    kernels = load_kernels(torch.device("cpu"))
    num_tokens, kv_heads, head_dim, block_size = 1025, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    cache = torch.randn(2, 70, block_size, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(69 * block_size, generator=gen)[:num_tokens] + block_size  # never the null block
    expected = cache.clone()
    expected[0].view(-1, kv_heads, head_dim)[slots] = k
    expected[1].view(-1, kv_heads, head_dim)[slots] = v
    kernels.store_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


def test_a_chunk_on_a_long_context_with_many_heads():
    """A 16-token chunk on 1000 cached tokens, 64 query heads on 8 K/V heads: the cheapest
    tiles by the interpreter's cost model would give a 1024 x 2048 score tile, twice the largest
    Triton accepts."""
    num_heads, num_kv_heads, head_dim, block_size, dtype = 64, 8, 32, 16, torch.float32
    batch = random_batch([(1000, 16)], num_heads, num_kv_heads, head_dim, block_size, dtype,
                         seed_of("long-chunks"))
    before = batch.kv_cache.clone()
    check(run("triton", batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu"), batch, before, dtype)


def test_head_size_above_256_is_refused():
    with pytest.raises(ValueError, match="head sizes up to 256"):
        BACKENDS.create("triton", num_heads=2, num_kv_heads=2, head_dim=512, scale=1.0, block_size=16,
                        dtype=torch.float32, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_switches_to_the_interpreter_once_with_a_notice():
    """And keeps numpy's BLAS (which runs the interpreter's dots) on one thread."""
    code = ("import os, torch, triton\n"  # triton already imported: the switch must still work
            "from framework import BACKENDS\n"
            "from tests.backends.batches import random_batch, relative_error\n"
            "kw = dict(num_heads=2, num_kv_heads=1, head_dim=16, scale=0.25, block_size=16, dtype=torch.float32)\n"
            "a = BACKENDS.create('triton', device='cpu', **kw)\n"
            "b = BACKENDS.create('triton', device='cpu', **kw)\n"
            "x = random_batch([(20, 1), (0, 5)], 2, 1, 16, 16, torch.float32, seed=0)\n"
            "assert relative_error(b.forward(x.q, x.k, x.v, x.kv_cache, b.build_metadata(x.meta)), x.expected) < 1e-4\n"
            "from threadpoolctl import threadpool_info\n"
            "blas = {i['num_threads'] for i in threadpool_info() if i['internal_api'] == 'openblas'}\n"
            "print(os.environ['TRITON_INTERPRET'], a.kernels.INTERPRETED, blas <= {1})\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.split() == ["1", "True", "True"]
    assert out.stderr.count(INTERPRETER_NOTICE) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("value", ["false", "Off"])
def test_without_a_gpu_an_interpreter_switched_off_by_any_spelling_is_switched_on(value):
    """Triton reads TRITON_INTERPRET=false or off as off, as it reads 0: the backend must switch
    the interpreter on for those too, not refuse as if the kernels had been compiled for CUDA."""
    code = ("import os, torch\n"
            "from framework import BACKENDS\n"
            "from tests.backends.batches import random_batch, relative_error\n"
            "b = BACKENDS.create('triton', num_heads=2, num_kv_heads=1, head_dim=16, scale=0.25, block_size=16,\n"
            "                    dtype=torch.float32, device='cpu')\n"
            "x = random_batch([(20, 1), (0, 5)], 2, 1, 16, 16, torch.float32, seed=0)\n"
            "assert relative_error(b.forward(x.q, x.k, x.v, x.kv_cache, b.build_metadata(x.meta)), x.expected) < 1e-4\n"
            "print(os.environ['TRITON_INTERPRET'], b.kernels.INTERPRETED)\n")
    env = {**os.environ, "TRITON_INTERPRET": value}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]
    assert out.stderr.count(INTERPRETER_NOTICE) == 1
