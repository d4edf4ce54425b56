"""Speed guards for the CPU attention backends (``make bench``; in the default test run each body
runs once, untimed). Read the ratios within a group, not absolute times: torch_paged / naive, and
torch_paged's C++ kernel / its SDPA path for decodes and prefills (``torch_paged[sdpa]``).

``experiments/bench_attention.py`` sweeps more shapes and reports bandwidth and TFLOP/s.
"""
import numpy as np
import pytest
import torch

from framework import BACKENDS
from framework.testing.attention import mixed_specs, random_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 32, 16  # the tiny presets' attention shape


def decode_batch(num_reqs: int, context: int):
    rng = np.random.default_rng(num_reqs)
    specs = [(int(c), 1) for c in rng.integers(context // 2, context, size=num_reqs)]
    return random_batch(specs, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, seed=0)


def mixed_batch(num_reqs: int):
    specs = mixed_specs(np.random.default_rng(0), BLOCK_SIZE, num_reqs=num_reqs, max_len=256)
    return random_batch(specs, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, seed=0)


def bench_forward(benchmark, name, batch):
    name, _, kernel = name.partition("[")
    options = {"decode_kernel": kernel.rstrip("]"), "prefill_kernel": kernel.rstrip("]")} if kernel else {}
    backend = BACKENDS.create(name, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=batch.scale,
                              block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu", **options)
    meta = backend.build_metadata(batch.meta)
    out = torch.empty_like(batch.q)
    with torch.inference_mode():
        benchmark(backend.forward, batch.q, batch.k, batch.v, batch.kv_cache, meta, out=out)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("name", ["naive", "torch_paged", "torch_paged[sdpa]"])
@pytest.mark.parametrize("num_reqs, context", [(64, 256), (8, 256), (64, 1024)])
def test_decode(benchmark, name, num_reqs, context):
    benchmark.group = f"attention decode {num_reqs} reqs, context <= {context}"
    bench_forward(benchmark, name, decode_batch(num_reqs, context))


@pytest.mark.parametrize("name", ["naive", "torch_paged", "torch_paged[sdpa]"])
def test_mixed_64(benchmark, name):
    benchmark.group = "attention mixed batch, 64 reqs"
    bench_forward(benchmark, name, mixed_batch(64))


@pytest.mark.parametrize("name", ["torch_paged", "torch_paged[sdpa]"])
def test_prefill_14_fresh_prompts(benchmark, name):
    """A prefill step of the engine-speed workload: 14 prompts of 32-256 tokens, nothing cached."""
    benchmark.group = "attention prefill, 14 fresh prompts"
    lengths = np.random.default_rng(14).integers(32, 257, size=14)
    batch = random_batch([(0, int(n)) for n in lengths], HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, seed=0)
    bench_forward(benchmark, name, batch)
