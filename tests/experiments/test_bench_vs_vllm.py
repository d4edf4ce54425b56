"""experiments/bench_vs_vllm.py: usage errors come before anything is built, and this engine's worker
serves timed runs whose outputs are the engine's own."""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from framework import LLM, SamplingParams

spec = importlib.util.spec_from_file_location(
    "bench_vs_vllm", Path(__file__).resolve().parents[2] / "experiments" / "bench_vs_vllm.py")
bench_vs_vllm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_vs_vllm)


@pytest.mark.parametrize("argv, match", [
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--num-requests", "-1"], "--num-requests must be at least 1"),
    (["--policies", "fcfs,nope"], "--policies: nope not POLICY[+sdpa|+cpp][:spin]; policies:"),
    (["--policies", "fcfs:fast"], "--policies: fcfs:fast not POLICY"),
    (["--policies", ","], "--policies: (none) not POLICY"),
    (["--vllm-python", "/nonexistent/python"], "no vLLM venv at /nonexistent/python: run with --setup first"),
    (["--dtype", "float16"], "invalid choice: 'float16'"),
    (["--shape", "decodes"], "invalid choice: 'decodes'"),
])
def test_bad_arguments_are_usage_errors(argv, match, capsys, monkeypatch):
    monkeypatch.setattr(bench_vs_vllm, "compare", lambda *a: pytest.fail("compared despite a bad argument"))
    with pytest.raises(SystemExit) as exit_info:
        bench_vs_vllm.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_a_shape_keeps_one_phase_of_the_mixed_workload():
    work = [([1] * 40, 16), ([2] * 250, 128)]
    assert bench_vs_vllm.shaped(work, "mixed") == work
    assert bench_vs_vllm.shaped(work, "prefill") == [([1] * 40, 1), ([2] * 250, 1)]
    assert bench_vs_vllm.shaped(work, "decode") == [([1] * 32, 256), ([2] * 32, 256)]
    assert all(len(p) + m <= bench_vs_vllm.MAX_MODEL_LEN for p, m in bench_vs_vllm.shaped(work, "decode"))


def test_a_servelab_worker_runs_the_workload_as_the_engine_does(llama_ckpt, tmp_path):
    path, _ = llama_ckpt
    work = [([5, 6, 7, 8], 6), ([9, 10], 3), (list(range(20, 60)), 5)]
    (tmp_path / "work.json").write_text(json.dumps(work))
    args = argparse.Namespace(threads=1, dtype="float32", spin_count=1000, shape="mixed")
    worker = bench_vs_vllm.Worker(sys.executable, "chunked:spin", str(path), str(tmp_path / "work.json"), args)
    try:
        first, second = worker.run(), worker.run()
    finally:
        worker.close()
    assert worker.proc.returncode == 0
    llm = LLM(model=str(path), policy="chunked", block_size=32, max_num_seqs=64, max_model_len=512, dtype="float32")
    expected = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p, _ in work],
        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work])]
    assert first["outputs"] == second["outputs"] == expected
    assert first["seconds"] > 0 and first["cpu_seconds"] > 0
