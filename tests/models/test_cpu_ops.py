"""The fused C++ operators compute what the torch operators they replace compute, and the model
runs the same with them as without."""
import logging

import pytest
import torch
import torch.nn.functional as F

from framework import LLM, SamplingParams
from framework.common.registry import UnavailableError
from models.cpu_ops import fused_ops
from models.rope import RotaryEmbedding

ROWS = [1, 7, 300]  # one row, fewer rows than a task, several tasks


def torch_norm(x, w, eps):
    y = x.float()
    return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def assert_close(actual, expected, dtype):
    # float32: the order of a sum apart; half types: one rounding step of the dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(actual, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ROWS)
def test_norms_equal_transformers_rms_norm(rows, dtype):
    ops = fused_ops()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    assert_norms_as_transformers(ops, x, residual, w)


def assert_norms_as_transformers(ops, x, residual, w) -> None:
    """``ops.rms_norm`` and ``ops.add_rms_norm`` (of a C++ or Triton operator module) against torch's."""
    out = torch.empty_like(x)
    ops.rms_norm(x, w, out, 1e-6)
    assert_close(out, torch_norm(x, w, 1e-6), x.dtype)
    summed = residual + x
    x2, r2 = x.clone(), residual.clone()
    ops.add_rms_norm(x2, r2, w, 1e-6)
    assert torch.equal(r2, summed), "the residual is the sum rounded to the dtype, as transformers adds"
    assert_close(x2, torch_norm(summed, w, 1e-6), x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_equals_torch_over_the_whole_range(rows, dtype):
    ops = fused_ops()
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 80, generator=gen) * 30).to(dtype)  # past exp's clamp at both ends
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    out = torch.empty(rows, 80, dtype=dtype)
    ops.silu_and_mul(x, out)
    gate, up = x.chunk(2, dim=-1)
    assert_close(out, F.silu(gate) * up, dtype)


def rotary_inputs(rows, heads, kv_heads, head_dim, dtype):
    """A RoPE table and a qkv batch whose first row holds NaN, infinities and bfloat16 rounding ties."""
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, 512, dtype)
    gen = torch.Generator().manual_seed(rows + head_dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qkv[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0 + 2.0 ** -8])
    return rotary, qkv, torch.randint(0, 512, (rows,), generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])  # 80: head_dim read at run time, not compiled in
@pytest.mark.parametrize("rows", ROWS)
def test_qkv_rotary_splits_and_rotates_exactly_as_the_torch_path(rows, head_dim, dtype):
    ops = fused_ops()
    heads, kv_heads = 6, 2
    rotary, qkv, positions = rotary_inputs(rows, heads, kv_heads, head_dim, dtype)
    q = torch.empty(rows, heads, head_dim, dtype=dtype)
    k, v = torch.empty(rows, kv_heads, head_dim, dtype=dtype), torch.empty(rows, kv_heads, head_dim, dtype=dtype)
    ops.qkv_rotary(qkv, positions, rotary.cos, rotary.sin, q, k, v)
    rq, rk, rv = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    eq, ek = rotary(positions, rq.reshape(rows, heads, head_dim), rk.reshape(rows, kv_heads, head_dim))
    exactly = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(q, eq, **exactly)
    torch.testing.assert_close(k, ek, **exactly)
    assert torch.equal(v, rv.reshape(rows, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, block_size", [(32, 8), (80, 16)])
def test_qkv_rotary_into_cache_writes_the_keys_and_values_at_their_slots_only(head_dim, block_size, dtype):
    assert_rotary_into_cache(fused_ops(), dtype, 6, 2, head_dim, block_size)


def assert_rotary_into_cache(ops, dtype, heads, kv_heads, head_dim, block_size, device="cpu") -> None:
    """``ops.qkv_rotary_into_cache`` (of a C++ or Triton operator module) gives q as ``ops.qkv_rotary`` does, and
    the rotated keys and the values at each row's slot of one layer of a [2, layers, ...] paged cache (blocks out
    of order, slots mid-block); every other slot and layer as it was."""
    rows, blocks = 9, 5
    rotary, qkv, positions = rotary_inputs(rows, heads, kv_heads, head_dim, dtype)
    rotary, qkv, positions = rotary.to(device), qkv.to(device), positions.to(device)
    q = torch.empty(rows, heads, head_dim, dtype=dtype, device=device)
    k = torch.empty(rows, kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.empty_like(k)
    ops.qkv_rotary(qkv, positions, rotary.cos, rotary.sin, q, k, v)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(3))[:rows].to(device)
    cache = torch.randn(2, 3, blocks, block_size, kv_heads, head_dim).to(device=device, dtype=dtype)
    before, layer = cache.clone(), cache[:, 1]
    fused_q = torch.empty_like(q)
    ops.qkv_rotary_into_cache(qkv, positions, rotary.cos, rotary.sin, fused_q, layer[0], layer[1], slots)
    exactly = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(fused_q, q, **exactly)
    flat, flat_before = layer.reshape(2, -1, kv_heads, head_dim), before[:, 1].reshape(2, -1, kv_heads, head_dim)
    torch.testing.assert_close(flat[0, slots], k, **exactly)
    torch.testing.assert_close(flat[1, slots], v, **exactly)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])
    assert torch.equal(cache[:, [0, 2]], before[:, [0, 2]]), "the other layers are not written"


def test_qkv_rotary_into_cache_refuses_mismatched_caches_and_slots_outside_them():
    ops = fused_ops()
    rotary = RotaryEmbedding(32, 64, 10000.0, None, 64, torch.float32)
    qkv, positions, q = torch.randn(3, 4 * 32), torch.arange(3), torch.empty(3, 2, 32)
    cache = torch.zeros(2, 4, 8, 1, 32)
    with pytest.raises(RuntimeError, match=r"slot_mapping must be contiguous int64 \[T\]"):
        ops.qkv_rotary_into_cache(qkv, positions, rotary.cos, rotary.sin, q, cache[0], cache[1], torch.arange(2))
    with pytest.raises(RuntimeError, match="k_cache and v_cache must be .* of one layout"):
        ops.qkv_rotary_into_cache(qkv, positions, rotary.cos, rotary.sin, q, cache[0], cache[1, :2], torch.arange(3))
    with pytest.raises(RuntimeError, match="slot 32 is outside the cache's 32 slots"):
        ops.qkv_rotary_into_cache(qkv, positions, rotary.cos, rotary.sin, q, cache[0], cache[1],
                                  torch.tensor([0, 32, 1]))
    with pytest.raises(RuntimeError, match=r"positions must be contiguous int64 \[T\]"):
        ops.qkv_rotary_into_cache(qkv, positions[:1], rotary.cos, rotary.sin, q, cache[0], cache[1], torch.arange(3))
    with pytest.raises(RuntimeError, match="position 64 is outside cos and sin's 64 rows"):
        ops.qkv_rotary_into_cache(qkv, torch.tensor([0, 64, 1]), rotary.cos, rotary.sin, q, cache[0], cache[1],
                                  torch.arange(3))
    with pytest.raises(RuntimeError, match=r"q must be contiguous \[T, H, D\]"):
        ops.qkv_rotary_into_cache(qkv, positions, rotary.cos, rotary.sin, q[:1], cache[0], cache[1], torch.arange(3))
    assert not cache.any(), "nothing written before a refusal"


def test_qkv_rotary_refuses_outputs_and_tables_of_other_shapes():
    ops = fused_ops()
    rotary = RotaryEmbedding(32, 64, 10000.0, None, 64, torch.float32)
    qkv, positions = torch.randn(3, 4 * 32), torch.arange(3)
    q, k, v = torch.empty(3, 2, 32), torch.empty(3, 1, 32), torch.empty(3, 1, 32)
    with pytest.raises(RuntimeError, match=r"k and v must be contiguous \[T, KVH, D\]"):
        ops.qkv_rotary(qkv, positions, rotary.cos, rotary.sin, q, k[:1], v[:1])
    with pytest.raises(RuntimeError, match=r"q must be contiguous \[T, H, D\]"):
        ops.qkv_rotary(qkv, positions, rotary.cos, rotary.sin, q[:2], k, v)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[max_positions, D / 2\]"):
        ops.qkv_rotary(qkv, positions, rotary.cos[:, :8], rotary.sin[:, :8], q, k, v)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1024, 32000])
@pytest.mark.parametrize("rows", ROWS)
def test_argmax_rows_picks_torchs_index_ties_and_infinities_included(rows, n):
    """The first of equal maxima (a tie within a 64-column block, across blocks, at the end), rows of
    -inf (top-k/top-p filtered), +inf, and a row view of a wider tensor."""
    ops = fused_ops()
    gen = torch.Generator().manual_seed(rows * n)
    wide = torch.randn(rows, n + 3, generator=gen)
    x = wide[:, :n]
    top = x.max() + 1
    for r in range(rows):
        cols = torch.randint(0, n, (3,), generator=gen)
        x[r, cols] = top  # up to three tied maxima
    if rows > 2:
        x[1] = float("-inf")
        x[2, -1] = float("inf")
    out = torch.full((rows,), -1, dtype=torch.int64)
    ops.argmax_rows(x, out)
    assert torch.equal(out, x.argmax(dim=-1))


def test_argmax_rows_skips_a_nan_where_torch_would_pick_it():
    ops = fused_ops()
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("nan")] * 3])
    out = torch.empty(2, dtype=torch.int64)
    ops.argmax_rows(x, out)
    assert out.tolist() == [2, 0]


def test_the_sampler_takes_its_argmax_from_the_fused_operator(monkeypatch):
    from framework.execution.input_preparer import SamplingMetadata
    from framework.execution.sampler import Sampler

    ops = fused_ops()
    calls = []
    fused = type("Ops", (), {"argmax_rows": staticmethod(lambda x, out: (calls.append(x.shape), ops.argmax_rows(x, out)))})
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    greedy = SamplingMetadata(temperature=torch.zeros(5))
    assert torch.equal(Sampler(fused_ops=fused)(logits, greedy), logits.argmax(-1))
    sampled = SamplingMetadata(temperature=torch.full((5,), 0.7), all_greedy=False)
    tokens = Sampler(torch.Generator().manual_seed(1), fused)(logits, sampled)
    expected = Sampler(torch.Generator().manual_seed(1))(logits, sampled)
    assert torch.equal(tokens, expected) and calls == [(5, 300)] * 3, "greedy, then greedy and Gumbel-max rows"


def test_a_tensor_with_strided_rows_is_refused_not_misread():
    x = torch.randn(8, 64)[:, ::2]
    with pytest.raises(RuntimeError, match="contiguous rows"):
        fused_ops().rms_norm(x, torch.ones(32), torch.empty(8, 32), 1e-6)


def generate(path, dtype="auto", **options):
    """The engine, its greedy tokens and logprobs, and for each attention call whether the model had stored
    the new K/V already (the backend got none)."""
    llm = LLM(model=str(path), dtype=dtype, max_model_len=128, block_size=8, executor_options=options)
    backend, stored = llm.engine.executor.backend, []
    forward = backend.forward
    backend.forward = lambda q, k, v, *rest, **kw: (stored.append(k is None), forward(q, k, v, *rest, **kw))[1]
    prompts = [[5, 9, 33, 2, 7, 120, 64] * 3, [300, 4, 17], list(range(3, 60))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3))
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], stored


def test_the_model_samples_the_same_with_and_without_the_fused_operators(llama_ckpt):
    """With them, the RoPE pass stores the keys and values in torch_paged's cache (the backend gets none)."""
    path, _ = llama_ckpt
    fused, fused_out, fused_stored = generate(path)
    plain, plain_out, plain_stored = generate(path, fused_ops=False)
    assert fused.engine.executor.model.norm.ops is not None and plain.engine.executor.model.norm.ops is None
    assert fused.engine.executor.backend.name == "torch_paged"
    assert fused_stored and all(fused_stored) and plain_stored and not any(plain_stored)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(fused_out, plain_out):
        assert tokens == ref_tokens
        for got, want in zip(logprobs, ref_logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)


def test_without_a_compiler_the_model_warns_and_runs_torchs_operators(llama_ckpt, monkeypatch, caplog):
    import framework.execution.executors.model as model_executor

    def no_compiler():
        raise UnavailableError("the fused C++ operators for CPUs could not be built (no compiler)")

    monkeypatch.setattr(model_executor, "fused_ops", no_compiler)
    with caplog.at_level(logging.WARNING):
        llm, _, stored = generate(llama_ckpt[0])
    assert "no compiler" in caplog.text and "executor.fused_ops=false" in caplog.text
    assert llm.engine.executor.model.norm.ops is None
    assert stored and not any(stored), "the backend stores the keys and values"


def test_a_fused_ops_value_that_is_not_a_bool_is_a_one_line_error(llama_ckpt):
    with pytest.raises(ValueError, match="executor.fused_ops must be true or false, got 'yes'"):
        LLM(model=str(llama_ckpt[0]), max_model_len=64, executor_options={"fused_ops": "yes"})
