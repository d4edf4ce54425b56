"""The Triton operators for CUDA compute what the torch operators they replace compute: on a CPU through
Triton's interpreter (the same kernel source), on a GPU compiled (``gpu`` cases); and a model on a GPU samples
the same with them as without."""
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.rope import RotaryEmbedding
from tests.models.test_cpu_ops import assert_close, assert_norms_as_transformers, assert_rotary_into_cache

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ops_for(device: str):
    if device == "cuda":
        import models.cuda_ops

        return models.cuda_ops
    from backends.triton_paged import import_interpreted

    return import_interpreted("models.cuda_ops")


def randn(*shape, gen, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 96), (5, 80), (3, 2048)])
def test_norms_equal_transformers_rms_norm(device, dtype, rows, n):
    ops = ops_for(device)
    gen = torch.Generator().manual_seed(rows * n)
    x, residual, w = (randn(*shape, gen=gen, dtype=dtype, device=device) for shape in [(rows, n), (rows, n), (n,)])
    assert_norms_as_transformers(ops, x, residual, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 80), (4, 1500)])  # a partial last column tile (blocks of 1024)
def test_silu_and_mul_equals_torch(device, dtype, rows, n):
    ops = ops_for(device)
    x = randn(rows, 2 * n, gen=torch.Generator().manual_seed(n), dtype=dtype, device=device, scale=8.0)
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
    ops.silu_and_mul(x, out)
    gate, up = x.chunk(2, dim=-1)
    assert_close(out, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 32), (4, 4, 80)])  # 80: half of it padded to 64
def test_qkv_rotary_splits_and_rotates_as_the_torch_path(device, dtype, heads, kv_heads, head_dim):
    ops = ops_for(device)
    rows = 7
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, 512, dtype).to(device)
    gen = torch.Generator().manual_seed(head_dim)
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype, device=device)
    positions = torch.randint(0, 512, (rows,), generator=gen).to(device)
    q = torch.empty(rows, heads, head_dim, dtype=dtype, device=device)
    k, v = torch.empty(rows, kv_heads, head_dim, dtype=dtype, device=device), torch.empty_like(q[:, :kv_heads])
    ops.qkv_rotary(qkv, positions, rotary.cos, rotary.sin, q, k, v)
    rq, rk, rv = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    eq, ek = rotary(positions, rq.reshape(rows, heads, head_dim), rk.reshape(rows, kv_heads, head_dim))
    assert torch.equal(q, eq) and torch.equal(k, ek)
    assert torch.equal(v, rv.reshape(rows, kv_heads, head_dim))


def test_strided_rows_and_mismatched_shapes_are_one_line_errors():
    ops = ops_for("cpu")
    with pytest.raises(ValueError, match="x must be 2-D with contiguous rows"):
        ops.rms_norm(torch.randn(8, 64)[:, ::2], torch.ones(32), torch.empty(8, 32), 1e-6)
    with pytest.raises(ValueError, match=r"x must be \[T, 2n\] for out \[T, n\]"):
        ops.silu_and_mul(torch.randn(4, 10), torch.empty(4, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_gpu_the_model_samples_the_same_with_and_without_the_fused_operators(llama_ckpt, dtype):
    from framework import LLM, SamplingParams

    outs = {}
    for fused in (True, False):
        llm = LLM(model=str(llama_ckpt[0]), device="cuda", dtype=dtype, backend="triton", max_model_len=128,
                  num_gpu_blocks_override=64, executor_options={"fused_ops": fused})
        assert (llm.engine.executor.model.norm.ops is not None) == fused
        prompts = [[5, 9, 33, 2, 7, 120, 64] * 3, [300, 4, 17], list(range(3, 60))]
        got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3))
        outs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
    tol = 1e-4 if dtype == "float32" else 0.05
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(outs[True], outs[False]):
        assert tokens == ref_tokens
        for got, want in zip(logprobs, ref_logprobs):
            assert all(abs(got[t].logprob - want[t].logprob) < tol for t in got.keys() & want.keys())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(6, 2, 32, 8), (4, 4, 80, 16)])
def test_qkv_rotary_into_cache_writes_the_keys_and_values_at_their_slots_only(device, dtype, heads, kv_heads,
                                                                              head_dim, block_size):
    assert_rotary_into_cache(ops_for(device), dtype, heads, kv_heads, head_dim, block_size, device)


def test_qkv_rotary_into_cache_refuses_mismatched_caches_and_slots():
    ops = ops_for("cpu")
    rotary = RotaryEmbedding(32, 64, 10000.0, None, 64, torch.float32)
    qkv, positions, q = torch.randn(3, 4 * 32), torch.arange(3), torch.empty(3, 2, 32)
    cache = torch.zeros(2, 4, 8, 1, 32)
    with pytest.raises(ValueError, match="slot_mapping has 2 slots for 3 rows of qkv"):
        ops.qkv_rotary_into_cache(qkv, positions, rotary.cos, rotary.sin, q, cache[0], cache[1], torch.arange(2))
    with pytest.raises(ValueError, match="k_cache and v_cache must have one layout"):
        ops.qkv_rotary_into_cache(qkv, positions, rotary.cos, rotary.sin, q, cache[0], cache[1, :2], torch.arange(3))


@pytest.mark.parametrize("backend_name", ["triton", "torch_paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_model_stores_kv_in_the_rotary_pass_where_the_backend_lets_it(dtype, backend_name):
    """A Llama layer stack with the Triton or torch_paged backend and these operators (interpreted) writes K/V in
    the RoPE pass and calls the backend without them: hidden states and cache equal the separate store's, on a
    step of prefills, a chunk on a cached context and decodes."""
    from framework import BACKENDS
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM
    from framework.testing.attention import random_batch

    ops = ops_for("cpu")
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    backend = BACKENDS.create(backend_name, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, block_size=8,
                              dtype=dtype, device="cpu")
    model = LlamaForCausalLM.empty_on(torch.device("cpu"), cfg, backend, 256, dtype, ops)
    model.init_random(0, 0.2)
    batch = random_batch([(0, 11), (16, 5), (30, 1), (7, 1)], 4, 2, 16, 8, dtype, seed=5)
    meta = backend.build_metadata(batch.meta)
    tokens = batch.meta.num_actual_tokens
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    positions = torch.from_numpy(
        np.concatenate([np.arange(c, s) for c, s in zip(batch.meta.num_computed_tokens_cpu, batch.meta.seq_lens_cpu)]))
    cache = batch.kv_cache[:, None].expand(2, 2, *batch.kv_cache.shape[1:]).contiguous()
    results = {}
    for fused in (True, False):
        for layer in model.layers:
            layer.self_attn.into_cache = ops.qkv_rotary_into_cache if fused else None
        stored = []
        forward = backend.forward
        backend.forward = lambda q, k, v, *rest, **kw: (stored.append(k is None), forward(q, k, v, *rest, **kw))[1]
        kv = cache.clone()
        with torch.no_grad():
            results[fused] = (model(ids, positions, kv, meta), kv)
        del backend.forward
        assert stored == [fused] * 2
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


def test_a_launch_asks_for_a_weights_bytes_one_chunk_a_thread():
    """The prefetch's launch arguments: the weight's bytes rounded down to the bulk prefetch's 16, as many chunks
    a program as it has threads; nothing asked for without a weight, nor interpreted (no cache to fill)."""
    import models.cuda_ops as compiled

    like, weight = torch.empty(4), torch.empty(1000, dtype=torch.bfloat16)
    args = compiled._prefetch(weight[:999], like, 8)
    assert (args["pf_bytes"], args["PREFETCH"], args["THREADS"], args["num_warps"]) == (1984, True, 256, 8)
    assert args["pf_ptr"].data_ptr() == weight.data_ptr()
    assert compiled._prefetch(None, like, 4)["PREFETCH"] is False
    assert ops_for("cpu")._prefetch(weight, like, 4)["PREFETCH"] is False
    assert compiled._norm_launch(2048, like, weight)["THREADS"] == 32 * compiled._norm_launch(2048, like, None)["num_warps"]


@pytest.mark.parametrize("kernel, grid, nbytes", [("norm", (5,), 16384 * 23 + 48), ("silu", (3, 2), 16384 * 4),
                                                  ("rotary", (2, 4), 16384 * 700 + 16),
                                                  # chunks past the window more than 2 GiB from its start
                                                  ("norm", (2100,), 16384 * 4)])
def test_each_chunk_of_a_prefetch_is_asked_for_once_every_program_taking_a_share(monkeypatch, kernel, grid, nbytes):
    """The bulk prefetch's chunks over a launch's programs (the interpreter cannot run its instruction: here it
    records the addresses and sizes asked for): [0, nbytes) in 16 KiB chunks, the last one short, each once,
    dealt round the programs of a 1-D or 2-D grid, nothing past the window however far; more chunks than
    threads take more rounds."""
    from types import SimpleNamespace

    from triton.runtime import interpreter

    ops = ops_for("cpu")
    asked = []

    def record(builder, asm, constraints, values, type, is_pure, pack):
        assert "cp.async.bulk.prefetch.L2.global" in asm and not is_pure
        asked.append((builder.grid_idx, values[0].data.copy(), values[1].data.copy()))
        result = interpreter.TensorHandle(np.zeros(values[1].data.shape, dtype=np.int32), interpreter.tl.int32)
        return SimpleNamespace(get_result=lambda i: result)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", record)
    weight = torch.zeros(nbytes // 2 + 50, dtype=torch.bfloat16)
    prefetch = {"pf_ptr": weight, "pf_bytes": nbytes, "PREFETCH": True, "THREADS": 64}
    x = torch.randn(grid[0], 64)
    if kernel == "norm":
        ops._rms_norm_kernel[grid](x, x, torch.ones(64), torch.empty_like(x), 64, 64, 64, 64, 1e-6, ADD=False,
                                   BLOCK=64, **prefetch)
    elif kernel == "silu":
        ops._silu_and_mul_kernel[grid](x, torch.empty(grid[0], 32), 32, 64, 32, BLOCK=16, **prefetch)
    else:
        rotary = RotaryEmbedding(16, 64, 10000.0, None, 64, torch.float32)
        ops._qkv_rotary_kernel[grid](x, torch.arange(grid[0]), rotary.cos, rotary.sin, torch.empty(grid[0], 2, 16),
                                     torch.empty(grid[0], 1, 16), torch.empty(grid[0], 1, 16), torch.arange(grid[0]),
                                     64, rotary.cos.stride(0), 16, 0, 16, HEADS=2, KV_HEADS=1, HEAD_DIM=16,
                                     HALF_PAD=8, BLOCK_SIZE=1, SLOTS=False, **prefetch)
    chunks = []
    programs = {}
    for idx, addresses, sizes in asked:
        live = sizes > 0
        chunks += zip((addresses[live] - weight.data_ptr()).tolist(), sizes[live].tolist())
        programs[idx] = programs.get(idx, 0) + int(live.sum())
    starts = range(0, nbytes, 16384)
    assert sorted(chunks) == [(start, min(16384, nbytes - start)) for start in starts]
    assert len(programs) == np.prod(grid) and min(programs.values()) >= len(starts) // np.prod(grid)
    assert max(programs.values()) <= -(-len(starts) // np.prod(grid))
    rounds = -(-len(starts) // (64 * np.prod(grid)))
    assert len(asked) == rounds * np.prod(grid)


def test_the_model_prefetches_the_next_weights_it_reads_and_computes_the_same():
    """``prefetch_weights(n)``: each fused operator asks for the next n bytes of the packed weights from the
    product it precedes (the norms from q/k/v's and gate/up's, RoPE from o's, SiLU from down's, on into the next
    layer's, the last layer's cut at the end), the last norm for the LM head's; 0 asks for none; the outputs
    do not change."""
    from types import SimpleNamespace

    from framework import BACKENDS
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM
    from framework.testing.attention import random_batch

    ops = ops_for("cpu")
    asked = []

    def spy(fn):
        def call(*args, prefetch=None):
            asked.append(None if prefetch is None else (fn.__name__, prefetch.data_ptr(),
                                                        prefetch.numel() * prefetch.element_size()))
            return fn(*args, prefetch=prefetch)
        return call

    names = ("rms_norm", "add_rms_norm", "silu_and_mul", "qkv_rotary", "qkv_rotary_into_cache")
    spied = SimpleNamespace(**{name: spy(getattr(ops, name)) for name in names})
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    backend = BACKENDS.create("triton", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, block_size=8,
                              dtype=torch.float32, device="cpu")
    model = LlamaForCausalLM.empty_on(torch.device("cpu"), cfg, backend, 256, torch.float32, spied, pack_weights=True)
    model.init_random(0, 0.2)
    batch = random_batch([(0, 5), (9, 1)], 4, 2, 16, 8, torch.float32, seed=3)
    meta = backend.build_metadata(batch.meta)
    ids = torch.randint(0, 256, (batch.meta.num_actual_tokens,), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([0, 1, 2, 3, 4, 9])
    cache = batch.kv_cache[:, None].expand(2, 2, *batch.kv_cache.shape[1:]).contiguous()
    packed = model.packed_weights
    end = packed.data_ptr() + packed.nbytes
    outs = {}
    for max_bytes in (0, 30000):  # more than down's 24576 bytes: its window runs into the next layer's q/k/v
        model.prefetch_weights(max_bytes)
        asked.clear()
        with torch.no_grad():
            outs[max_bytes] = model(ids, positions, cache.clone(), meta)
        if not max_bytes:
            assert asked == [None] * 9
            continue
        starts = [lin.weight.data_ptr() for lin in model.read_order()]
        want = [(start, min(30000, end - start)) for start in starts] + [(model.lm_head.weight.data_ptr(), 30000)]
        assert [(ptr, size) for _, ptr, size in asked] == want
        assert asked[3][1] + asked[3][2] > model.layers[1].self_attn.qkv_proj.weight.data_ptr()
        assert asked[7][2] < 30000, "the last layer's window ends with the packed weights"
        assert [name for name, _, _ in asked] == ["rms_norm", "qkv_rotary_into_cache", "add_rms_norm", "silu_and_mul",
                                                  "add_rms_norm", "qkv_rotary_into_cache", "add_rms_norm",
                                                  "silu_and_mul", "add_rms_norm"]
    assert torch.equal(outs[0], outs[30000])
    model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(64, 96))
    with pytest.raises(ValueError, match=re.escape("prefetch_weights needs the layers' weights packed by "
                                                   "LlamaForCausalLM.empty_on(pack_weights=True)")):
        model.prefetch_weights(1 << 20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_with_fuse_rotary_a_graph_decode_step_leaves_rope_to_the_attention_launch(dtype):
    """A Llama layer stack on a decode step planned as CUDA graphs plan it, with the Triton backend's
    ``fuse_rotary``: no RoPE launch, the attention launch rotates and stores; hidden states and cache are the
    bits of the separate RoPE pass's."""
    from types import SimpleNamespace

    from framework import BACKENDS
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM
    from framework.testing.attention import random_batch

    ops = ops_for("cpu")
    rotations = []
    counted = SimpleNamespace(**{name: getattr(ops, name) for name in ("rms_norm", "add_rms_norm", "silu_and_mul")},
                              qkv_rotary=ops.qkv_rotary,
                              qkv_rotary_into_cache=lambda *a, **k: (rotations.append(1), ops.qkv_rotary_into_cache(*a, **k)))
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    batch = random_batch([(0, 1), (16, 1), (30, 1), (7, 1)], 4, 2, 16, 8, dtype, seed=9)
    batch.meta.max_seq_len = 64
    ids = torch.randint(0, 256, (4,), generator=torch.Generator().manual_seed(3))
    positions = batch.meta.seq_lens - 1
    cache = batch.kv_cache[:, None].expand(2, 2, *batch.kv_cache.shape[1:]).contiguous()
    results = {}
    for fuse in (True, False):
        backend = BACKENDS.create("triton", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, block_size=8,
                                  dtype=dtype, device="cpu", fuse_rotary=fuse)
        model = LlamaForCausalLM.empty_on(torch.device("cpu"), cfg, backend, 256, dtype, counted)
        model.init_random(0, 0.2)
        rotations.clear()
        kv = cache.clone()
        with torch.no_grad():
            results[fuse] = (model(ids, positions, kv, backend.build_graph_metadata(batch.meta)), kv)
        assert len(rotations) == (0 if fuse else 2)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
