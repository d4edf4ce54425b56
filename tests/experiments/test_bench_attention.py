"""experiments/bench_attention.py: bad arguments are usage errors, before anything is timed."""
import pytest

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
    monkeypatch.setattr(bench_attention, "copy_bandwidth", lambda *a: pytest.fail("timed despite a bad argument"))
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main([*argv, "--device", "cpu"])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_a_small_run_prints_every_case_and_backend(capsys):
    bench_attention.main(["--device", "cpu", "--iters", "2", "--flush-mb", "0", "--decode-batches", "2",
                          "--decode-contexts", "0,16", "--prefill-batches", "1", "--prefill-lens", "8"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("decode", "prefill"))]
    assert len(rows) == 3 * 2  # three cases, naive and torch_paged
