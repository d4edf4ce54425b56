"""The Triton backend beyond the common agreement cases: head sizes 64/80/128/256, block sizes
16/32/64, tiles smaller than the requests, the interpreter switch and its notice.

On a machine without CUDA these run through Triton's interpreter (set by the backend itself);
the ``gpu`` cases compile the same kernels for a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backends.triton_paged import INTERPRETER_NOTICE, load_kernels
from framework import BACKENDS
from framework.testing.attention import check_result, mixed_specs, random_batch, run_named, seed_of

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
    result = run_named("triton", batch, 4, 2, head_dim, block_size, torch.float32, device)
    check_result(result, batch, before, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [80, 128])
def test_half_precision_with_padded_and_plain_heads(head_dim, dtype, device):
    batch = mixed_batch("half", 8, 2, head_dim, 16, dtype, device)
    before = batch.kv_cache.clone()
    check_result(run_named("triton", batch, 8, 2, head_dim, 16, dtype, device), batch, before, dtype)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(12, 4), (6, 6)])
def test_groups_and_head_counts_that_are_not_powers_of_two(num_heads, num_kv_heads):
    batch = mixed_batch("npow2", num_heads, num_kv_heads, 32, 16, torch.float32, "cpu")
    before = batch.kv_cache.clone()
    result = run_named("triton", batch, num_heads, num_kv_heads, 32, 16, torch.float32, "cpu")
    check_result(result, batch, before, torch.float32)


@pytest.mark.parametrize("block_q, block_n", [(1, 16), (2, 16), (4, 32)])
def test_tiles_smaller_than_the_requests(monkeypatch, block_q, block_n):
    """Long prefills split over several query tiles and long contexts over several key tiles
    (and key tiles that end mid-block) give the same answer."""
    monkeypatch.setattr(load_kernels(torch.device("cpu")), "tile_sizes", lambda *args: (block_q, block_n))
    batch = mixed_batch("tiles", 4, 2, 32, 8, torch.float32, "cpu", num_reqs=6, max_len=5)
    before = batch.kv_cache.clone()
    check_result(run_named("triton", batch, 4, 2, 32, 8, torch.float32, "cpu"), batch, before, torch.float32)


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_key_ranges_merge_to_the_same_answer(monkeypatch, splits, dtype):
    """Flash-decoding (chosen on GPUs for few long requests) forced on. With 4-token query
    tiles and 16-key tiles, the tile of positions 30..33 of request (30, 6) has a split starting
    at key 32, where rows 30 and 31 see no key at all; short requests get empty splits."""
    kernels = load_kernels(torch.device("cpu"))
    monkeypatch.setattr(kernels, "tile_sizes", lambda *args: (4, 16))
    monkeypatch.setattr(kernels, "num_splits", lambda *args: splits)
    specs = [(30, 6), (0, 1), (45, 1), (0, 21), (16, 9), (7, 1)]
    seed = seed_of("splits", splits, str(dtype))
    batch = random_batch(specs, 8, 2, 32, 8, dtype, seed)
    before = batch.kv_cache.clone()
    check_result(run_named("triton", batch, 8, 2, 32, 8, dtype, "cpu"), batch, before, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_graph_decode_launch_reads_its_lengths_on_the_device(monkeypatch, device, splits, dtype):
    """The capturable decode launch (``build_graph_metadata``: no host plan, each program's key count read
    from ``seq_lens``) gives the float64 reference's answer, an empty-context decode and block-boundary
    lengths included; with key splits (fixed for ``max_seq_len``), short requests get empty splits."""
    kernels = load_kernels(torch.device(device))
    if splits > 1:
        monkeypatch.setattr(kernels, "num_splits", lambda *args: splits)
    specs = [(0, 1), (15, 1), (16, 1), (87, 1), (3, 1), (40, 1)]
    batch = random_batch(specs, 8, 2, 32, 16, dtype, seed_of("graph-decode", splits, str(dtype), device), device=device)
    before = batch.kv_cache.clone()
    backend = BACKENDS.create("triton", num_heads=8, num_kv_heads=2, head_dim=32, scale=batch.scale, block_size=16,
                              dtype=dtype, device=device)
    batch.meta.max_seq_len = 256  # what the capture bounds lengths by, not this batch's longest
    meta = backend.build_graph_metadata(batch.meta)
    assert meta.launch.decode and meta.launch.num_splits == splits
    check_result(backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta), batch, before, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 2, 32), (4, 1, 80)])
def test_a_decode_launch_that_applies_rope_gives_the_bits_of_rope_then_attention(monkeypatch, device, splits, dtype,
                                                                                  num_heads, num_kv_heads, head_dim):
    """``fuse_rotary``: the graph decode launch given unrotated q/k/v (``forward_rotary``) equals RoPE with the K/V
    store (``models.cuda_ops``) then the launch, bit for bit: its output and the whole cache (the new tokens'
    slots held poison before); an empty-context decode, block boundaries, key splits and padded heads included."""
    from models.rope import RotaryEmbedding
    from tests.models.test_cuda_ops import ops_for

    kernels = load_kernels(torch.device(device))
    if splits > 1:
        monkeypatch.setattr(kernels, "num_splits", lambda *args: splits)
    specs = [(0, 1), (15, 1), (16, 1), (87, 1), (3, 1), (40, 1)]
    seed = seed_of("rotary-decode", splits, str(dtype), num_kv_heads, device)
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, 16, dtype, seed, device=device)
    backend = BACKENDS.create("triton", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              scale=batch.scale, block_size=16, dtype=dtype, device=device, fuse_rotary=True)
    batch.meta.max_seq_len = 256
    meta = backend.build_graph_metadata(batch.meta)
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None, 256, dtype).to(device)
    positions = batch.meta.seq_lens - 1
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(len(specs), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    separate = batch.kv_cache.clone()
    q = qkv.new_empty(len(specs), num_heads, head_dim)
    ops_for(device).qkv_rotary_into_cache(qkv, positions, rotary.cos, rotary.sin, q, separate[0], separate[1],
                                          batch.meta.slot_mapping)
    want = backend.forward(q, None, None, separate, meta)
    fused = batch.kv_cache.clone()
    got = backend.forward_rotary(qkv, positions, rotary.cos, rotary.sin, fused, meta)
    assert not torch.equal(separate, batch.kv_cache), "the new keys were stored"
    assert torch.equal(got, want) and torch.equal(fused, separate)
    # An eagerly planned step, and a backend without the option, leave RoPE to the model.
    assert backend.forward_rotary(qkv, positions, rotary.cos, rotary.sin, fused, backend.build_metadata(batch.meta)) \
        is None
    plain = BACKENDS.create("triton", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            scale=batch.scale, block_size=16, dtype=dtype, device=device)
    assert plain.forward_rotary(qkv, positions, rotary.cos, rotary.sin, fused, meta) is None


@pytest.mark.parametrize("value, error", [
    ("yes", "backend.fuse_rotary must be true or false, got 'yes'"),
    (True, "backend.fuse_rotary needs engine.dtype bfloat16 or float16 (in float32 the launch's fused multiply-adds "
           "would round RoPE otherwise than transformers); got float32")])
def test_fuse_rotary_is_a_boolean_for_16_bit_dtypes(value, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        BACKENDS.create("triton", num_heads=4, num_kv_heads=2, head_dim=32, scale=0.2, block_size=16,
                        dtype=torch.float32, device="cpu", fuse_rotary=value)


def test_a_long_step_with_many_kv_heads_is_stored():
    """1025 new tokens of 8 K/V heads of size 128 (a Llama-3-8B prompt): one interpreter program
    for the whole step would be a 2048 x 1024 tile, twice the largest Triton accepts."""
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
    result = run_named("triton", batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu")
    check_result(result, batch, before, dtype)


def test_head_size_above_256_is_refused():
    with pytest.raises(ValueError, match="head sizes up to 256"):
        BACKENDS.create("triton", num_heads=2, num_kv_heads=2, head_dim=512, scale=1.0, block_size=16,
                        dtype=torch.float32, device="cpu")


def test_on_a_cpu_it_runs_interpreted_with_one_notice():
    """And keeps numpy's BLAS (which runs the interpreter's dots) on one thread."""
    code = ("import torch, triton\n"  # triton already imported: the switch must still work
            "from framework import BACKENDS\n"
            "from framework.testing.attention import random_batch, relative_error\n"
            "kw = dict(num_heads=2, num_kv_heads=1, head_dim=16, scale=0.25, block_size=16, dtype=torch.float32)\n"
            "a = BACKENDS.create('triton', device='cpu', **kw)\n"
            "b = BACKENDS.create('triton', device='cpu', **kw)\n"
            "x = random_batch([(20, 1), (0, 5)], 2, 1, 16, 16, torch.float32, seed=0)\n"
            "assert relative_error(b.forward(x.q, x.k, x.v, x.kv_cache, b.build_metadata(x.meta)), x.expected) < 1e-4\n"
            "from threadpoolctl import threadpool_info\n"
            "blas = {i['num_threads'] for i in threadpool_info() if i['internal_api'] == 'openblas'}\n"
            "print(a.kernels is b.kernels, a.kernels.INTERPRETED, blas <= {1})\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.split() == ["True", "True", "True"]
    assert out.stderr.count(INTERPRETER_NOTICE) == 1


@pytest.mark.parametrize("imported_before", [True, False])
def test_an_interpreted_module_calls_the_interpreted_copies_of_the_modules_it_uses(imported_before):
    """``import_interpreted(name)``: the Triton helpers ``name`` imports, and those they import, are their
    interpreted copies (a compiled one cannot be called from an interpreted kernel); the modules it found them in
    stay as they were after, imported or not."""
    code = ("import sys\n"
            + ("import models.cuda_ops as compiled\n" if imported_before else "")
            + "from backends.triton_paged import import_interpreted, triton_uses\n"
            "print(triton_uses('models.cuda_matmul') == ['models.cuda_ops'],\n"
            "      triton_uses('models.cuda_ops') == ['framework.execution.triton_rotary'])\n"
            "mm = import_interpreted('models.cuda_matmul')\n"
            "copy = sys.modules['models.cuda_ops_interpreted']\n"
            "rotary = sys.modules['framework.execution.triton_rotary_interpreted']\n"
            "print(mm.silu_mul is copy.silu_mul, type(mm.silu_mul).__name__, copy.rounded is rotary.rounded,\n"
            "      type(copy.rounded).__name__, 'framework.execution.triton_rotary' in sys.modules,\n"
            + ("      sys.modules['models.cuda_ops'] is compiled)\n" if imported_before else
               "      'models.cuda_ops' in sys.modules)\n"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "InterpretedFunction", "True", "InterpretedFunction",
                                  str(imported_before), str(imported_before)]


@pytest.mark.parametrize("value", [None, "0", "false", "Off", "1"])
def test_the_interpreter_does_not_leak_out_of_a_cpu_backend(value):
    """Building a CPU backend leaves TRITON_INTERPRET and Triton's knob as they were, whatever they
    were (false and off are Triton's spellings of off), so the kernels loaded for a CUDA device
    afterwards are compiled, not interpreted (unless the user's TRITON_INTERPRET asks for that)."""
    code = ("import os, torch, triton\n"
            "from framework import BACKENDS\n"
            "from backends.triton_paged import load_kernels\n"
            "from framework.testing.attention import random_batch, relative_error\n"
            "b = BACKENDS.create('triton', num_heads=2, num_kv_heads=1, head_dim=16, scale=0.25, block_size=16,\n"
            "                    dtype=torch.float32, device='cpu')\n"
            "x = random_batch([(20, 1), (0, 5)], 2, 1, 16, 16, torch.float32, seed=0)\n"
            "assert relative_error(b.forward(x.q, x.k, x.v, x.kv_cache, b.build_metadata(x.meta)), x.expected) < 1e-4\n"
            "cuda = load_kernels(torch.device('cuda'))\n"
            "print(os.environ.get('TRITON_INTERPRET'), triton.knobs.runtime.interpret, b.kernels.INTERPRETED,\n"
            "      cuda.INTERPRETED, type(cuda._paged_attention_kernel).__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if value is not None:
        env["TRITON_INTERPRET"] = value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    user_wants_it = value == "1"
    assert out.stdout.split() == [str(value), str(user_wants_it), "True", str(user_wants_it),
                                  "InterpretedFunction" if user_wants_it else "JITFunction"]
    assert out.stderr.count(INTERPRETER_NOTICE) == 1


def test_every_launch_runs_on_the_device_of_its_tensors(monkeypatch):
    """Triton launches on the current CUDA device: each launch is made under a guard for its
    tensors' device (a backend on cuda:1 would otherwise run on cuda:0). Checked with stand-in
    kernels that record the guard they run under."""
    kernels = load_kernels(torch.device("cpu"))
    guards, launches = [], []

    @contextlib.contextmanager
    def guard(device):
        guards.append(device)
        yield
        guards.pop()

    class Launcher:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, list(guards)))

    monkeypatch.setattr(kernels, "device_guard", guard)
    monkeypatch.setattr(kernels, "num_splits", lambda *args: 2)
    for name in ("_store_kv_kernel", "_paged_attention_kernel", "_combine_splits_kernel"):
        monkeypatch.setattr(kernels, name, Launcher(name))
    batch = random_batch([(40, 1), (0, 9)], 4, 2, 16, 16, torch.float32, seed=0)
    backend = BACKENDS.create("triton", num_heads=4, num_kv_heads=2, head_dim=16, scale=batch.scale, block_size=16,
                              dtype=torch.float32, device="cpu")
    backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, backend.build_metadata(batch.meta))
    assert launches == [(name, [batch.q.device]) for name in
                        ("_store_kv_kernel", "_paged_attention_kernel", "_combine_splits_kernel")]


def test_the_guard_selects_the_tensors_cuda_device():
    """``device_guard`` is torch's CUDA device context for a CUDA device (built here without a GPU:
    it only touches the device when entered), and does nothing for a CPU."""
    kernels = load_kernels(torch.device("cpu"))
    guard = kernels.device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    with kernels.device_guard(torch.device("cpu")):
        pass


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(32, 8, 128), (8, 1, 64), (40, 40, 256)])
def test_the_declared_workspace_covers_the_key_splits_a_gpu_step_allocates(monkeypatch, num_heads, num_kv_heads,
                                                                           head_dim):
    """``split_workspace_bytes`` bounds ``plan``'s partial outputs and log-sum-exps for any step of up
    to the token budget, with the GPU's tiling and split rule (a stand-in device with 132 SMs)."""
    kernels = load_kernels(torch.device("cpu"))
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    monkeypatch.setattr(kernels, "_num_sms", lambda index: 132)
    gpu = SimpleNamespace(type="cuda", index=0)
    group_pad = kernels._pow2(num_heads // num_kv_heads)
    rng = np.random.default_rng(head_dim)
    budget = 2048
    declared = kernels.split_workspace_bytes(num_heads, num_kv_heads, head_dim, budget, 132)
    steps = [np.ones(n, dtype=np.int64) for n in (1, 2, 7, 64, 256)] + [np.array([budget])]
    steps += [rng.integers(1, 300, size=rng.integers(1, 12)) for _ in range(30)]
    for q_lens in steps:
        tokens = int(q_lens.sum())
        if tokens > budget:
            continue
        block_q, block_n = kernels.tile_sizes(group_pad, 1, head_dim, q_lens, q_lens + 100_000)
        programs = int((-(-q_lens // block_q)).sum()) * num_kv_heads
        splits = kernels.num_splits(programs, 100_000, block_n, gpu)
        allocated = 0 if splits == 1 else splits * tokens * num_heads * (head_dim + 1) * 4
        assert allocated <= declared, (q_lens, splits)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, max_model_len", [(32, 4, 64, 2048), (32, 8, 128, 16384),
                                                                            (8, 1, 256, 4096), (16, 16, 64, 300)])
def test_decode_graph_bounds_give_each_step_at_least_its_own_key_splits(monkeypatch, num_heads, num_kv_heads,
                                                                        head_dim, max_model_len):
    """``decode_bounds`` on a stand-in GPU (132 SMs), for every capture size: ascending, ending at max_model_len,
    at most 5 graphs; a step of any longest sequence runs at the smallest bound at or above it, where the split
    count is at least what ``num_splits`` gives that sequence, and is 1 where that is 1."""
    from framework.execution.cuda_graphs import capture_sizes

    kernels = load_kernels(torch.device("cpu"))
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    monkeypatch.setattr(kernels, "_num_sms", lambda index: 132)
    gpu = SimpleNamespace(type="cuda", index=0)
    block_n = kernels._decode_tiles(num_heads, num_kv_heads, head_dim, max_model_len)[2]
    for size in capture_sizes(256):
        bounds = kernels.decode_bounds(size, num_heads, num_kv_heads, head_dim, max_model_len, gpu)
        assert bounds == sorted(set(bounds)) and bounds[-1] == max_model_len and len(bounds) <= 5
        for longest in range(1, max_model_len + 1, 7):
            bound = next(b for b in bounds if b >= longest)
            own = kernels.num_splits(size * num_kv_heads, longest, block_n, gpu)
            got = kernels.num_splits(size * num_kv_heads, bound, block_n, gpu)
            assert got >= own and (own > 1 or got == 1), (size, longest, bound)
    short = kernels.decode_bounds(32, 32, 4, 64, 2048, gpu)
    assert short == [2047, 2048], "batch 32 of TinyLlama (128 keys a tile): no splits up to 2047 keys, then 2"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("specs", [[(4000, 1), (2500, 1), (1, 1)], [(3000, 1), (2048, 16), (0, 1)]],
                         ids=["decodes", "chunk-and-decodes"])
def test_on_a_gpu_long_contexts_take_the_split_key_path(specs, dtype):
    """Few programs on long keys: ``num_splits`` splits them (flash-decoding) and the combine kernel
    merges the ranges; the shorter contexts of the other cases never reach that path."""
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed_of("gpu-splits", specs),
                         device="cuda")
    backend = BACKENDS.create("triton", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              scale=batch.scale, block_size=block_size, dtype=dtype, device="cuda")
    meta = backend.build_metadata(batch.meta)
    assert meta.launch.num_splits > 1
    before = batch.kv_cache.clone()
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, out=torch.full_like(batch.q, float("nan")))
    check_result(out, batch, before, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", ["triton", "torch_paged", "naive"])
def test_on_the_second_gpu(name):
    """A backend on cuda:1 while cuda:0 is current computes there (Triton launches on the current
    device unless told otherwise)."""
    assert torch.cuda.current_device() == 0
    batch = mixed_batch("second-gpu", 8, 2, 128, 16, torch.bfloat16, "cuda:1", num_reqs=6, max_len=6)
    before = batch.kv_cache.clone()
    check_result(run_named(name, batch, 8, 2, 128, 16, torch.bfloat16, "cuda:1"), batch, before, torch.bfloat16)


def test_host_arrays_longer_than_the_step_are_read_up_to_num_reqs():
    """A persistent batch's host buffers hold stale entries past the step's requests."""
    batch = random_batch([(20, 1), (0, 5), (16, 7)], 4, 2, 16, 16, torch.float32, seed=4)
    meta = batch.meta
    stale = dataclasses.replace(meta, query_start_loc_cpu=np.concatenate([meta.query_start_loc_cpu, [40, 90]]),
                                seq_lens_cpu=np.concatenate([meta.seq_lens_cpu, [70, 300]]))
    backend = BACKENDS.create("triton", num_heads=4, num_kv_heads=2, head_dim=16, scale=batch.scale, block_size=16,
                              dtype=torch.float32, device="cpu")
    before = batch.kv_cache.clone()
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, backend.build_metadata(stale))
    check_result(out, batch, before, torch.float32)
