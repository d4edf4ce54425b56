"""experiments/bench_decode_tiles.py: bad arguments are usage errors before anything is timed, and every
variant of the decode launch gives the engine's plan's output."""
import re

import pytest

import experiments.bench_decode_tiles as bench
from tests.experiments.test_bench_attention import usage_error


@pytest.mark.parametrize("argv, match", [
    (["--block-ns", "48"], "--block-ns must be powers of two, at least 16, got 48"),
    (["--splits", "0,2"], "--splits must be in 1-16, got 0"),
    (["--warps", "3"], "--warps must be powers of two up to 32, got 3"),
    (["--contexts", "100,2048"], "--contexts must be in [0, --max-model-len), got 2048"),
    (["--heads", "6", "--kv-heads", "4"], "--heads (6) must be a multiple of --kv-heads (4)"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--iters", "0"], "--iters must be at least 1, got 0"),
    (["--flush-mb", "-1"], "--flush-mb must be at least 0, got -1"),
    (["--warps", "64"], "--warps must be powers of two up to 32, got 64"),
])
def test_bad_arguments_are_usage_errors(argv, match, capsys, monkeypatch):
    assert match in usage_error(bench, argv, capsys, monkeypatch)


def test_every_variant_gives_the_plans_output(capsys):
    bench.main(["--device", "cpu", "--batch", "2", "--contexts", "0,40", "--heads", "4", "--kv-heads", "2",
                "--head-dim", "16", "--block-ns", "16,32", "--splits", "1,3", "--warps", "4", "--iters", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if " warps=" in line and "max |diff|" in line]
    # Per context: the plan and the four variants (16 and 32 keys a tile, 1 and 3 key ranges).
    assert len(rows) == 2 * 5
    assert sum("engine's plan" in row for row in rows) == 2
    for row in rows:
        assert float(re.search(r"max \|diff\| (\S+)", row).group(1)) < 1e-5, row
