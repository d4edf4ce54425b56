"""The AMX linear layers (``models/csrc/cpu_amx_linear.cpp``, ``models.llama.use_amx_linears``, the executor's
``amx_matmul``): the kernel's products are torch's, the model routes to it only what it takes, and an engine
samples the same with it as without."""
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import framework.execution.executors.model as model_executor
from framework.common.registry import UnavailableError
from framework.execution.cpu_features import cpu_has_amx_bf16
from models.cpu_ops import amx_linear
from models.llama import AMX_MAX_ROWS, use_amx_linears
from tests.models.test_cpu_ops import generate

needs_amx = pytest.mark.skipif(not cpu_has_amx_bf16(), reason="needs a CPU with AMX bf16 tiles (Sapphire Rapids on)")


def bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 48, 63, 64, 65, 200, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_sums_as_torchs_product_and_rounds_once(rows, with_bias):
    """Row counts around each 16-row tile and 64-row block, past them too (the model sends up to 256)."""
    ops = amx_linear()
    x, w = bf16(rows, 96, seed=rows), bf16(48, 96, seed=1000 + rows)
    b = bf16(48, seed=7) if with_bias else None
    out = torch.empty(rows, 48, dtype=torch.bfloat16)
    ops.amx_linear(x, ops.pack_weight(w), b, out)
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    # Float32 sums rounded to bf16 once: within half a bf16 step (2^-9 relative) of the exact product, and torch's
    # own bf16 product (also float32 sums) apart from an order of summation in a rare element.
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-5)
    assert (out == F.linear(x, w, b)).float().mean() > 0.995


@needs_amx
def test_the_kernel_reads_strided_rows_and_carries_nan_and_infinity():
    ops = amx_linear()
    wide = bf16(20, 128, seed=1)
    x = wide[:, 32:96]  # rows 128 apart
    x[3, 5], x[7, 0] = float("nan"), float("inf")
    w = bf16(32, 64, seed=2)
    out = torch.empty(20, 32, dtype=torch.bfloat16)
    ops.amx_linear(x, ops.pack_weight(w), None, out)
    expected = F.linear(x.contiguous(), w)
    assert out[3].isnan().all(), "a NaN input makes its row's every output NaN"
    assert out[7].isinf().all() and torch.equal(out[7], expected[7]), "an infinite input: infinities of torch's signs"
    fine = [r for r in range(20) if r not in (3, 7)]
    torch.testing.assert_close(out[fine].double(), (x[fine].double() @ w.double().T), rtol=2 ** -8, atol=1e-5)


@needs_amx
def test_the_kernel_refuses_what_it_cannot_multiply_in_one_line():
    ops = amx_linear()
    with pytest.raises(RuntimeError, match="multiple of 16 rows and of 32 columns, got 40 x 64"):
        ops.pack_weight(bf16(40, 64, seed=0))
    with pytest.raises(RuntimeError, match="2-D bf16"):
        ops.pack_weight(torch.randn(32, 64))
    packed = ops.pack_weight(bf16(32, 64, seed=0))
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        ops.amx_linear(bf16(4, 96, seed=0), packed, None, torch.empty(4, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"out must be a contiguous bf16 \[M, N\]"):
        ops.amx_linear(bf16(4, 64, seed=0), packed, None, torch.empty(4, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous bf16 \[N\]"):
        ops.amx_linear(bf16(4, 64, seed=0), packed, bf16(16, seed=0), torch.empty(4, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed must come from pack_weight"):
        ops.amx_linear(bf16(4, 64, seed=0), bf16(32, 64, seed=0), None, torch.empty(4, 32, dtype=torch.bfloat16))


class RecordingOps:
    """Stands in for the kernel's module: packs nothing, multiplies with torch, records each call's rows."""

    def __init__(self):
        self.rows = []

    def pack_weight(self, weight):
        return weight.clone()

    def amx_linear(self, x, packed, bias, out):
        self.rows.append(x.shape[0])
        out.copy_(F.linear(x, packed, bias))


def test_only_bf16_layers_of_shapes_the_tiles_take_are_routed_and_only_up_to_the_row_limit():
    model = torch.nn.ModuleDict({
        "taken": torch.nn.Linear(64, 32, bias=True).bfloat16(),
        "odd_out": torch.nn.Linear(64, 24).bfloat16(),  # 24 outputs: not a multiple of 16
        "odd_in": torch.nn.Linear(48, 32).bfloat16(),  # 48 inputs: not a multiple of 32
        "float32": torch.nn.Linear(64, 32),
    })
    ops = RecordingOps()
    assert use_amx_linears(model, ops) == 1
    taken = model["taken"]
    assert "amx_weight" not in taken.state_dict(), "the packed copy is no checkpoint entry"
    for rows in (1, AMX_MAX_ROWS):
        x = bf16(rows, 64, seed=rows)
        assert torch.equal(taken(x), F.linear(x, taken.weight, taken.bias))
    assert ops.rows == [1, AMX_MAX_ROWS]
    taken(bf16(AMX_MAX_ROWS + 1, 64, seed=0))
    taken(bf16(2, 3, 64, seed=0))  # not 2-D
    taken(bf16(4, 128, seed=0)[:, ::2])  # strided columns
    assert ops.rows == [1, AMX_MAX_ROWS], "past the limit, 3-D and strided inputs go to torch"
    for name in ("odd_out", "odd_in", "float32"):
        assert "amx_weight" not in dict(model[name].named_buffers())


def run(path, dtype="bfloat16", **options):
    """The engine and its greedy tokens (``test_cpu_ops.generate``'s prompts), bf16 unless told."""
    llm, outputs, _ = generate(path, dtype=dtype, **options)
    return llm, [tokens for tokens, _ in outputs]


@needs_amx
@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt"])  # qwen2: q/k/v with a bias
def test_an_engine_samples_the_same_with_the_amx_products_as_with_torchs(ckpt, request):
    path = request.getfixturevalue(ckpt)[0]
    amx, amx_tokens = run(path)
    plain, plain_tokens = run(path, amx_matmul=False)
    layers = len(amx.engine.executor.model.layers)
    assert amx.engine.executor.amx_linears == 4 * layers + 1, "auto takes every layer's products and the LM head"
    assert plain.engine.executor.amx_linears == 0
    assert amx_tokens == plain_tokens


def test_auto_leaves_float32_models_and_cpus_without_tiles_to_torch(llama_ckpt, monkeypatch, caplog):
    assert run(llama_ckpt[0], dtype="float32")[0].engine.executor.amx_linears == 0
    monkeypatch.setattr(model_executor, "cpu_has_amx_bf16", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert run(llama_ckpt[0])[0].engine.executor.amx_linears == 0
    assert "AMX" not in caplog.text, "nothing to warn of where the CPU has no tiles"


def test_auto_warns_and_runs_torchs_products_where_the_kernel_cannot_be_had(llama_ckpt, monkeypatch, caplog):
    def not_granted():
        raise UnavailableError("Linux did not grant this process the AMX tiles")

    monkeypatch.setattr(model_executor, "cpu_has_amx_bf16", lambda: True)
    monkeypatch.setattr(model_executor, "amx_linear", not_granted)
    with caplog.at_level(logging.WARNING):
        llm, tokens = run(llama_ckpt[0])
    assert llm.engine.executor.amx_linears == 0 and all(len(t) == 12 for t in tokens)
    assert "did not grant" in caplog.text and "executor.amx_matmul=false" in caplog.text


def test_amx_matmul_true_where_the_kernel_cannot_be_had_fails_before_the_weights_load(llama_ckpt, monkeypatch):
    def not_granted():
        raise UnavailableError("Linux did not grant this process the AMX tiles")

    monkeypatch.setattr(model_executor, "cpu_has_amx_bf16", lambda: True)
    monkeypatch.setattr(model_executor, "amx_linear", not_granted)
    monkeypatch.setattr(model_executor, "iter_checkpoint", SimpleNamespace)  # loading would fail otherwise
    with pytest.raises(UnavailableError, match="executor.amx_matmul=true: Linux did not grant"):
        run(llama_ckpt[0], amx_matmul=True)


def test_the_kernel_is_built_for_avx512_whatever_torchs_own_capability(monkeypatch):
    """Under ATEN_CPU_CAPABILITY=avx2 torch's flags leave AVX-512 out, which every CPU with AMX tiles has and the
    kernel's rounding uses: the build failed on such a machine, every process again."""
    import models.cpu_ops as cpu_ops

    builds = []
    monkeypatch.setattr(cpu_ops, "cpu_has_amx_bf16", lambda: True)
    monkeypatch.setattr(cpu_ops, "load_cpu_extension", lambda *args: builds.append(args) or SimpleNamespace(
        available=lambda: True))
    cpu_ops.amx_linear()
    (name, source, what, flags), = builds
    assert source == cpu_ops.AMX_SOURCE and {"-mavx512f", "-mavx512bw", "-mamx-tile", "-mamx-bf16"} <= set(flags)


@pytest.mark.parametrize("options, dtype, error, message", [
    ({"amx_matmul": "yes"}, "bfloat16", ValueError, "executor.amx_matmul must be auto, true or false, got 'yes'"),
    # 1 == True, and 1 read as off: the kernel silently unused
    ({"amx_matmul": 1}, "bfloat16", ValueError, "executor.amx_matmul must be auto, true or false, got 1"),
    ({"pad_matmul_rows": 0.0}, "bfloat16", ValueError, "executor.pad_matmul_rows must be auto, true or false, got 0.0"),
    ({"amx_matmul": True}, "float32", ValueError, "amx_matmul=true multiplies bf16 on a CPU, and this engine runs "
                                                  "float32 on cpu"),
    ({"amx_matmul": True, "float32_matmul": True}, "bfloat16", ValueError, "set one of them off"),
])
def test_amx_matmul_values_that_cannot_apply_are_one_line_errors(llama_ckpt, options, dtype, error, message):
    with pytest.raises(error, match=message):
        run(llama_ckpt[0], dtype=dtype, **options)


def test_amx_matmul_true_on_a_cpu_without_tiles_fails_before_the_weights_load(llama_ckpt, monkeypatch):
    import models.cpu_ops as cpu_ops

    monkeypatch.setattr(cpu_ops, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(model_executor, "iter_checkpoint", SimpleNamespace)  # loading would fail otherwise
    with pytest.raises(UnavailableError, match="this CPU has no AMX tiles for bf16"):
        run(llama_ckpt[0], amx_matmul=True)
