"""experiments/bench_throughput.py: bad arguments are usage errors, before any model is built."""
import importlib.util
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "bench_throughput", Path(__file__).resolve().parents[2] / "experiments" / "bench_throughput.py")
bench_throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_throughput)


@pytest.mark.parametrize("argv, match", [
    # --threads 0 used to raise from torch.set_num_threads, --hf-batch 0 from range(), the engine
    # options from deep in the engine's construction; --num-requests 0 printed a table of zeros.
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--num-requests", "0"], "--num-requests must be at least 1, got 0"),
    (["--hf-batch", "0"], "--hf-batch must be at least 1, got 0"),
    (["--max-num-seqs", "-1"], "--max-num-seqs must be at least 1"),
    (["--backend", "nope"], "unknown backend 'nope'; registered backends: "),
    (["--max-num-batched-tokens", "100"], "max_num_batched_tokens (100) must be >= max_num_seqs (256)"),
    # Refused before the checkpoint is built (the tests run on a CPU).
    (["--backend", "flash_attn"], "attention backend 'flash_attn' cannot run here"),
])
def test_bad_arguments_are_usage_errors(argv, match, capsys, monkeypatch):
    monkeypatch.setattr(bench_throughput, "build_checkpoint",
                        lambda *a, **k: pytest.fail("built a model despite a bad argument"))
    monkeypatch.setattr(sys, "argv", ["bench_throughput.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench_throughput.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
