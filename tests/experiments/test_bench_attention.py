"""experiments/bench_attention.py: bad arguments are usage errors, before anything is timed."""
import pytest
import torch

import experiments.bench_attention as bench_attention


@pytest.mark.parametrize("argv, match", [
    # 0 used to mean "the default" for these (silently timing 30 iterations, 8 heads, ...).
    (["--iters", "0"], "--iters must be at least 1, got 0"),
    (["--heads", "0"], "--heads must be at least 1, got 0"),
    (["--head-dim", "0"], "--head-dim must be at least 1, got 0"),
    # These crashed in the cases: ZeroDivisionError, an empty reduction, attention's ValueError.
    (["--block-size", "0"], "--block-size must be at least 1, got 0"),
    (["--decode-batches", "0,8"], "--decode-batches must be positive, got 0,8"),
    (["--prefill-lens", "-4"], "--prefill-lens must be positive"),
    (["--decode-contexts", "-1"], "--decode-contexts must be >= 0"),
    (["--heads", "6", "--kv-heads", "4"], "--heads (6) must be a multiple of --kv-heads (4)"),
])
def test_bad_arguments_are_usage_errors(argv, match, capsys, monkeypatch):
    assert match in usage_error(bench_attention, argv, capsys, monkeypatch)


@pytest.mark.parametrize("device, match", [
    ("tpu", "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),  # checked before torch is asked for it
    pytest.param("cuda", "--device cuda: device 'cuda' requested but CUDA is not available; use --device cpu or auto",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")),
])
def test_a_device_this_machine_cannot_use_is_a_usage_error(device, match, capsys, monkeypatch):
    monkeypatch.setattr(bench_attention, "copy_bandwidth", lambda *a: pytest.fail("timed despite a bad device"))
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main(["--device", device])
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def usage_error(bench, argv: list[str], capsys, monkeypatch) -> str:
    """What ``bench.main(argv)`` on the CPU prints to stderr, having exited 2 before timing anything."""
    monkeypatch.setattr(bench, "copy_bandwidth", lambda *a: pytest.fail("timed despite a bad argument"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*argv, "--device", "cpu"])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_a_small_run_prints_every_case_and_backend(capsys):
    bench_attention.main(["--device", "cpu", "--iters", "2", "--flush-mb", "0", "--decode-batches", "2",
                          "--decode-contexts", "0,16", "--prefill-batches", "1", "--prefill-lens", "8"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("decode", "prefill"))]
    assert len(rows) == 3 * 2  # three cases, naive and torch_paged


def test_one_cache_serves_every_block_size_with_the_same_kv():
    """flash_attn's 256-token blocks and the others' small blocks are views of one cache, with each
    request's K/V at the same slots: the reference backend gives the same output through either."""
    import torch

    from framework import BACKENDS

    case = bench_attention.Case("prefill", batch=3, context=300, q_len=5)
    q, k, v, views = bench_attention.make_inputs(case, 4, 2, 16, 16, torch.float32, torch.device("cpu"), [16, 256])
    assert views[16][0].data_ptr() == views[256][0].data_ptr()
    outs = []
    for size in (16, 256):
        cache, meta = views[size]
        backend = BACKENDS.create("naive", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, block_size=size,
                                  dtype=torch.float32, device="cpu")
        outs.append(backend.forward(q, k, v, cache, backend.build_metadata(meta)))
    assert torch.equal(outs[0], outs[1])


def test_each_case_frees_its_cache_before_the_next_is_made(monkeypatch, capsys):
    import gc
    import weakref

    caches = []
    make_inputs = bench_attention.make_inputs

    def tracked(*args, **kwargs):
        gc.collect()
        assert all(ref() is None for ref in caches), "an earlier case's cache is still alive"
        q, k, v, views = make_inputs(*args, **kwargs)
        view = next(iter(views.values()))[0]
        caches.append(weakref.ref(view._base if view._base is not None else view))
        return q, k, v, views

    monkeypatch.setattr(bench_attention, "make_inputs", tracked)
    bench_attention.main(["--device", "cpu", "--iters", "1", "--flush-mb", "0", "--decode-batches", "2",
                          "--decode-contexts", "0,16", "--prefill-batches", "1", "--prefill-lens", "8"])
    assert len(caches) == 3
