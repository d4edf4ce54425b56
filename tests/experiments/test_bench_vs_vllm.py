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
    (["--policies", "fcfs,nope"], "--policies: nope not POLICY[+sdpa|+cpp][@KEY=VALUE...][:spin]; policies:"),
    (["--policies", "fcfs:fast"], "--policies: fcfs:fast not POLICY"),
    (["--policies", "fcfs@pad_rows=false"], "--policies: fcfs@pad_rows=false not POLICY[+sdpa|+cpp][@KEY=VALUE...]"),
    (["--policies", "fcfs@pad_matmul_rows"], "--policies: fcfs@pad_matmul_rows not POLICY"),
    (["--policies", "fcfs@backend.kernel=cpp"], "--policies: fcfs@backend.kernel=cpp not POLICY"),
    (["--policies", "fcfs,chunked@pad_matmul_rows=null"],
     "--policies: chunked@pad_matmul_rows=null: executor.pad_matmul_rows must be auto, true or false, got None"),
    (["--policies", "chunked@backend.prefill_kernel=fast"],
     "--policies: chunked@backend.prefill_kernel=fast: backend.prefill_kernel must be one of auto, cpp, sdpa"),
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


@pytest.mark.parametrize("fresh", [False, True])
def test_fresh_prompts_give_every_round_its_own_prompts_and_the_same_lengths(fresh, monkeypatch, capsys):
    seen: dict[str, list] = {}

    class FakeWorker:
        def __init__(self, python, side, model, work, args):
            self.side, self.works = side, json.loads(Path(work).read_text())

        def run(self, index=0):
            seen.setdefault(self.side, []).append(self.works[index])
            return {"seconds": 1.0, "cpu_seconds": 1.0, "outputs": [[index]] * len(self.works[index])}

        def close(self):
            pass

    monkeypatch.setattr(bench_vs_vllm, "Worker", FakeWorker)
    monkeypatch.setattr(bench_vs_vllm, "SETTLE_S", 0.0)
    args = argparse.Namespace(num_requests=4, seed=0, shape="mixed", fresh_prompts=fresh, warmup=1, rounds=2,
                              policies=["chunked"], dtype="float32", threads=1)
    runs = bench_vs_vllm.compare(args, sys.executable)
    assert seen["chunked"] == seen["vllm"] and len(seen["vllm"]) == 3
    prompts = [[p for p, _ in work] for work in seen["vllm"]]
    lengths = {tuple(m for _, m in work) for work in seen["vllm"]}
    assert len(lengths) == 1
    assert (prompts[0] != prompts[1] != prompts[2] != prompts[0]) if fresh else (prompts[0] == prompts[1] == prompts[2])
    assert [r["tokens"] for r in runs["chunked"]] == [sum(lengths.pop())] * 2
    assert "8/8" in capsys.readouterr().out  # both timed rounds of 4 requests compared



def test_each_timed_round_starts_one_side_later(monkeypatch, capsys):
    """No side always runs at the same place in a round; each waits for the one before to settle."""
    order: list[str] = []

    class FakeWorker:
        def __init__(self, python, side, model, work, args):
            self.side, self.works = side, json.loads(Path(work).read_text())

        def run(self, index=0):
            order.append(self.side)
            return {"seconds": 1.0, "cpu_seconds": 1.0, "outputs": [[index]] * len(self.works[index])}

        def close(self):
            pass

    monkeypatch.setattr(bench_vs_vllm, "Worker", FakeWorker)
    pauses = []
    monkeypatch.setattr(bench_vs_vllm.time, "sleep", pauses.append)
    args = argparse.Namespace(num_requests=2, seed=0, shape="mixed", fresh_prompts=False, warmup=1, rounds=3,
                              policies=["fcfs", "chunked"], dtype="float32", threads=1)
    runs = bench_vs_vllm.compare(args, sys.executable)
    assert order[3:] == ["fcfs", "chunked", "vllm", "chunked", "vllm", "fcfs", "vllm", "fcfs", "chunked"]
    assert all(len(runs[side]) == 3 for side in ("fcfs", "chunked", "vllm"))
    assert pauses == [bench_vs_vllm.SETTLE_S] * 9, "a pause before every timed run"

def test_a_servelab_worker_runs_the_workload_as_the_engine_does(llama_ckpt, tmp_path):
    path, _ = llama_ckpt
    work = [([5, 6, 7, 8], 6), ([9, 10], 3), (list(range(20, 60)), 5)]
    (tmp_path / "work.json").write_text(json.dumps([[([1, 2], 2)], work]))
    args = argparse.Namespace(threads=1, dtype="float32", spin_count=1000, shape="mixed")
    worker = bench_vs_vllm.Worker(sys.executable, "chunked:spin", str(path), str(tmp_path / "work.json"), args)
    try:
        first, second = worker.run(1), worker.run(1)
    finally:
        worker.close()
    assert worker.proc.returncode == 0
    llm = LLM(model=str(path), policy="chunked", block_size=32, max_num_seqs=64, max_model_len=512, dtype="float32")
    expected = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p, _ in work],
        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work])]
    assert first["outputs"] == second["outputs"] == expected
    assert first["seconds"] > 0 and first["cpu_seconds"] > 0


def test_a_configuration_is_a_policy_with_backend_and_executor_options():
    assert bench_vs_vllm.configuration("chunked+sdpa@pad_matmul_rows=false@backend.prefill_kernel=cpp:spin") == (
        "chunked", {"decode_kernel": "sdpa", "prefill_kernel": "cpp"}, {"pad_matmul_rows": False})
