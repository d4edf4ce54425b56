"""The split-K product of ``models/cuda_matmul.py`` against float64 under Triton's interpreter, and ``tune``: each
bias-free linear layer runs what was timed fastest for its shape and row bucket, torch's product elsewhere."""
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from backends.triton_paged import import_interpreted

pytest.importorskip("triton")


def kernels():
    return import_interpreted("models.cuda_matmul")


@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m, n, k, block_n, block_k, splits", [
    (5, 40, 100, 32, 32, 1),   # partial tiles everywhere, one split (stored directly)
    (5, 40, 100, 32, 32, 3),   # three splits summed; the last split shorter
    (17, 64, 64, 64, 16, 8),   # more splits than K holds: fewer run
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_products_equal_a_float64_product(m, n, k, block_n, block_k, splits, swap, serial, dtype):
    mm = kernels()
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    got = mm.splitk_linear(x, w, mm.Config(block_n, block_k, splits, swap, serial))
    assert got.shape == (m, n) and got.dtype == dtype
    want = x.double() @ w.double().T
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    else:  # float32 sums, rounded once (truncated by the interpreter): within a bfloat16 step of the largest
        assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()


def summed_by_both_paths(mm, device: torch.device, repeats: int):
    """A bf16 product of 3 splits over 5 n tiles, ``repeats`` times by each tile's last program and once by a
    second kernel, and the counters after."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(24, 300, generator=gen, device=device).bfloat16()
    w = torch.randn(140, 300, generator=gen, device=device).bfloat16()
    serial = [mm.splitk_linear(x, w, mm.Config(32, 64, 3)) for _ in range(repeats)]
    return serial, mm.splitk_linear(x, w, mm.Config(32, 64, 3, serial=False)), mm._locks(device, 5)


def test_the_last_program_sums_the_splits_as_the_second_kernel_does_and_leaves_its_counters_zeroed():
    serial, summed, locks = summed_by_both_paths(kernels(), torch.device("cpu"), 2)
    for got in serial:
        assert torch.equal(got, summed), "the same float32 partials in the same order: the same bits"
    assert not locks.any(), "every counter back at 0 for the next product"


@pytest.mark.gpu
def test_serial_split_k_on_a_gpu_equals_the_summed_product_in_every_graph_replay():
    """Programs finish in any order on a GPU: a race between a partial's store and the last program's read would
    show as a replay whose bits differ from the two-kernel sum."""
    import models.cuda_matmul as mm

    device = torch.device("cuda")
    serial, summed, locks = summed_by_both_paths(mm, device, 20)
    assert all(torch.equal(got, summed) for got in serial) and not locks.any()
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(32, 2048, generator=gen, device=device).bfloat16()
    w = torch.randn(2048, 2048, generator=gen, device=device).bfloat16()
    config = mm.Config(32, 128, 8)
    want = mm.splitk_linear(x, w, mm.Config(32, 128, 8, serial=False))
    outs = []
    graph = torch.cuda.CUDAGraph()
    mm.splitk_linear(x, w, config)
    with torch.cuda.graph(graph):
        for _ in range(50):
            outs.append(mm.splitk_linear(x, w, config))
    for _ in range(4):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, want) for out in outs)
    assert not mm._locks(device, 64).any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [(32, 32, 1, False), (32, 32, 3, False), (64, 16, 2, True)])
def test_a_product_of_silu_and_mul_equals_the_operator_then_the_product_bit_for_bit(device, dtype, config):
    if device == "cuda":
        import models.cuda_matmul as mm
        import models.cuda_ops as ops
    else:
        mm, ops = kernels(), import_interpreted("models.cuda_ops")
    gen = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(6, 2 * 90, generator=gen) * 4).to(device=device, dtype=dtype)
    w = torch.randn(40, 90, generator=gen).to(device=device, dtype=dtype)
    act = torch.empty(6, 90, dtype=dtype, device=device)
    ops.silu_and_mul(gate_up, act)
    config = mm.Config(*config)
    assert torch.equal(mm.splitk_linear(gate_up, w, config, glu=True), mm.splitk_linear(act, w, config))
    with pytest.raises(ValueError, match=r"x must be \[M, 180\] for w \(40, 90\) with glu: got \(6, 90\)"):
        mm.splitk_linear(act, w, config, glu=True)


@pytest.mark.parametrize("fused_faster", [True, False])
def test_a_tuned_down_projection_applies_silu_and_mul_in_its_kernel_where_that_was_timed_faster(monkeypatch,
                                                                                                 fused_faster):
    """The Llama MLP with the fused operators. The down projection's kernel is fastest at <= 16 rows; there the
    kernel applying SiLU-and-multiply is timed against the operator's launch then the kernel. Where it wins the
    operator's own launch is skipped, with the same bits as the operator then the kernel; elsewhere it runs."""
    from models.llama import MLP

    mm, ops = kernels(), import_interpreted("models.cuda_ops")
    cfg = SimpleNamespace(hidden_act="silu", hidden_size=32, intermediate_size=48, mlp_bias=False)
    torch.manual_seed(0)
    mlp = MLP(cfg, ops).bfloat16().requires_grad_(False)
    down = tuple(mlp.down_proj.weight.shape)
    config = mm.Config(32, 16, 2)
    timed = []

    def timer(x, w, config, glu=False):
        if glu:
            timed.append((tuple(x.shape), config))
            return 0.3 if config is None else (1.1 if fused_faster else 1.6)  # against 1.0 + 0.3
        return 2.0 if config is None else (1.0 if tuple(w.shape) == down and x.shape[0] <= 16 else 3.0)

    table = mm.tune(mlp, [16, 32], [config], timer)
    assert timed == [((16, 96), config), ((16, 96), None)], "timed where the down projection runs the kernel"
    assert [c.fuses_silu_and_mul for c in table if (c.n, c.k) == down] == [fused_faster, False]
    assert not hasattr(mlp.gate_up_proj, "silu_and_mul_forward")
    gen = torch.Generator().manual_seed(1)
    xs = {rows: torch.randn(rows, 32, generator=gen).bfloat16() for rows in (3, 16, 17)}
    fused = mlp.down_proj.silu_and_mul_forward
    mlp.down_proj.silu_and_mul_forward = None
    want = {rows: mlp(x) for rows, x in xs.items()}
    mlp.down_proj.silu_and_mul_forward = fused
    launched = []
    silu_and_mul = ops.silu_and_mul
    monkeypatch.setattr(ops, "silu_and_mul", lambda *a: (launched.append(a[0].shape[0]), silu_and_mul(*a)))
    for rows, x in xs.items():
        assert torch.equal(mlp(x), want[rows])
    assert launched == ([17] if fused_faster else [3, 16, 17])


def test_the_fusion_choice_is_kept_between_runs(tmp_path):
    from models.llama import MLP

    mm = kernels()
    cfg = SimpleNamespace(hidden_act="silu", hidden_size=32, intermediate_size=48, mlp_bias=False)
    config, timed = mm.Config(32, 16, 2), []

    def timer(x, w, config, glu=False):
        timed.append(glu)
        return (0.1 if config is None else 1.0) if glu else (2.0 if config is None else 1.0)

    cache = tmp_path / "decode_matmul.json"
    first = MLP(cfg, None)
    mm.tune(first, [8], [config], timer, cache)
    assert timed.count(True) == 2 and first.down_proj.silu_and_mul_configs == {16: config}, "1.0 < 1.0 + 0.1"
    timed.clear()
    again = MLP(cfg, None)
    table = mm.tune(again, [8], [config], timer, cache)
    assert timed == [] and again.down_proj.silu_and_mul_configs == {16: config}
    assert [(c.fused_seconds, c.silu_and_mul_seconds) for c in table if c.k == 48] == [(1.0, 0.1)]


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 48, bias=False)
        self.b = nn.Linear(48, 32, bias=False)
        self.a2 = nn.Linear(32, 48, bias=False)  # a's shape: timed once
        self.biased = nn.Linear(32, 32)          # left to torch


def test_tune_installs_the_fastest_per_shape_and_bucket_and_keeps_torch_elsewhere(monkeypatch):
    """A stand-in timer makes the kernel fastest for [48 x 32] at <= 16 rows only, and there the first config:
    that layer (and a2, its shape, timed once) runs it at up to 16 rows, torch's product at 17-32 rows, above 128
    rows and for 3-D inputs; [32 x 48] stays torch's; the biased layer is untouched. Every product equals torch's."""
    mm = kernels()
    candidates = [mm.Config(32, 16, 1), mm.Config(16, 16, 2)]
    timed = []

    def timer(x, w, config):
        timed.append((tuple(w.shape), x.shape[0], config))
        if config is None:
            return 1.5
        return 1.0 if config == candidates[0] and tuple(w.shape) == (48, 32) and x.shape[0] <= 16 else 2.0

    toy = Toy()
    table = mm.tune(toy, [1, 2, 4, 8, 16, 24, 32, 256], candidates, timer)
    # Each shape at the buckets' largest row counts (16, 32), torch's and both candidates, once.
    assert sorted(timed, key=str) == sorted(((shape, m, c) for shape in [(48, 32), (32, 48)] for m in (16, 32)
                                             for c in [None, *candidates]), key=str)
    chosen = {(c.n, c.k, c.bucket): c.config for c in table}
    assert chosen == {(48, 32, 16): candidates[0], (48, 32, 32): None, (32, 48, 16): None, (32, 48, 32): None}
    assert toy.a.matmul_configs == toy.a2.matmul_configs == {16: candidates[0], 32: None}
    assert not hasattr(toy.biased, "matmul_configs")
    calls = []
    splitk = mm.splitk_linear
    monkeypatch.setattr(mm, "splitk_linear", lambda *args, **kw: (calls.append(args[2]), splitk(*args, **kw))[1])
    for rows in (3, 16, 17, 200):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(toy.a(x), x @ toy.a.weight.T, atol=1e-5, rtol=1e-5)
    toy.a(torch.randn(2, 3, 32))
    toy.b(torch.randn(5, 48))
    assert calls == [candidates[0], candidates[0]], "only the 3- and 16-row products of layer a take the kernel"


def test_a_config_whose_product_disagrees_is_left_out(monkeypatch):
    mm = kernels()
    good, bad = mm.Config(32, 16, 1), mm.Config(16, 16, 2)
    splitk = mm.splitk_linear
    monkeypatch.setattr(mm, "splitk_linear", lambda x, w, config, *a: splitk(x, w, config, *a) * (
        1.5 if config == bad else 1.0))
    table = mm.tune(Toy(), [8], [bad, good], lambda x, w, config: {None: 3.0, good: 2.0, bad: 1.0}[config])
    assert all(choice.config == good for choice in table)


def test_choices_are_kept_between_runs_and_timed_again_only_when_new(tmp_path, caplog):
    """A second ``tune`` with the cache times nothing and installs the same choices; other candidates, another
    dtype or more row buckets are timed (those alone); an unreadable cache is timed again and rewritten."""
    mm = kernels()
    cache = tmp_path / "sub" / "decode_matmul.json"
    candidates = [mm.Config(32, 16, 1), mm.Config(16, 16, 2)]
    timed = []

    def timer(x, w, config):
        timed.append((tuple(w.shape), x.shape[0], config))
        return {None: 2.0, candidates[0]: 1.0}.get(config, 3.0)

    first = mm.tune(Toy(), [8], candidates, timer, cache)
    assert len(timed) == 2 * 3 and cache.exists()
    timed.clear()
    toy = Toy()
    again = mm.tune(toy, [8], candidates, timer, cache)
    assert timed == [] and [str(c) for c in again] == [str(c) for c in first]
    assert toy.a.matmul_configs == {16: candidates[0]}
    mm.tune(Toy(), [8, 32], candidates, timer, cache)
    assert sorted({m for _, m, _ in timed}) == [32], "only the new bucket is timed"
    timed.clear()
    mm.tune(Toy(), [8], candidates[:1], timer, cache)
    assert len(timed) == 2 * 2, "other candidates: timed again"
    timed.clear()
    mm.tune(Toy().double(), [8], candidates, timer, cache)
    assert len(timed) == 2 * 3, "another dtype: timed again"
    cache.write_text("{not json")
    timed.clear()
    mm.tune(Toy(), [8], candidates, timer, cache)
    assert len(timed) == 2 * 3 and "unreadable" in caplog.text
    timed.clear()
    mm.tune(Toy(), [8], candidates, timer, cache)
    assert timed == [], "rewritten after the unreadable one"
    assert mm.cache_path().parent == Path(os.environ["SERVELAB_CACHE_DIR"])
