"""The Triton operators for CUDA compute what the torch operators they replace compute: on a CPU through
Triton's interpreter (the same kernel source), on a GPU compiled (``gpu`` cases); and a model on a GPU samples
the same with them as without."""
import pytest
import torch
import torch.nn.functional as F

from models.rope import RotaryEmbedding
from tests.models.test_cpu_ops import assert_close, assert_norms_as_transformers

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
