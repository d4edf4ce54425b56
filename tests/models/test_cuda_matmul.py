"""The split-K product of ``models/cuda_matmul.py`` against float64 under Triton's interpreter, and ``tune``: each
bias-free linear layer runs what was timed fastest for its shape and row bucket, torch's product elsewhere."""
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from backends.triton_paged import import_interpreted

pytest.importorskip("triton")


def kernels():
    return import_interpreted("models.cuda_matmul")


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m, n, k, block_n, block_k, splits", [
    (5, 40, 100, 32, 32, 1),   # partial tiles everywhere, one split (stored directly)
    (5, 40, 100, 32, 32, 3),   # three splits summed; the last split shorter
    (17, 64, 64, 64, 16, 8),   # more splits than K holds: fewer run
])
def test_split_k_products_equal_a_float64_product(m, n, k, block_n, block_k, splits, swap):
    mm = kernels()
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    got = mm.splitk_linear(x, w, mm.Config(block_n, block_k, splits, swap))
    assert got.shape == (m, n)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)


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
