"""A run refuses what its engine could never serve before anything is generated or written: a length past
``max_model_len`` (``workload.prompt_len=100000000`` grew to 23 GB and was killed), a prefill-first policy's
token budget below the longest prompt (every longer one would be dropped, with exit 0). A request that still cannot
be served is counted in the summary and printed, not only a row of requests.csv."""
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from framework.harness.experiment import run_experiment
from framework.harness.workloads.sharegpt import ShareGPTWorkload
from framework.harness.workloads.synthetic import SyntheticWorkload
from framework.harness.workloads.trace import TraceWorkload
from tests.hydra_support import compose_config, read_csv

ROOT = Path(__file__).resolve().parents[3]
BASE = ["progress=false", "plots=false", "warmup=0"]


@pytest.fixture
def nothing_generated(monkeypatch):
    """Fails a run that generates its workload: these lengths would take minutes and gigabytes to build."""
    def refuse(self, ctx):
        raise AssertionError(f"{type(self).__name__} was generated")
    for cls in (SyntheticWorkload, TraceWorkload, ShareGPTWorkload):
        monkeypatch.setattr(cls, "generate", refuse)


@pytest.mark.parametrize("overrides, message", [
    (["workload.prompt_len=100000000"], r"^workload.prompt_len=100000000 is beyond max_model_len=1024: lower it or "
                                        r"raise engine.max_model_len$"),
    (["workload.output_len=100000000"], r"^workload.output_len=100000000 is beyond 1023, the most output "
                                        r"max_model_len=1024 leaves after a 1-token prompt"),
    (["workload.prompt_len=[1,100000000]"], r"^workload.prompt_len: max=100000000 is beyond max_model_len=1024"),
    (["~workload.prompt_len", "+workload.prompt_len={dist: lognormal, mean: 100000000, std: 10}"],
     r"^workload.prompt_len: dist lognormal without a max drew \d+, beyond max_model_len=1024: give it a max"),
    (["workload=shared_prefix", "workload.prompt_len=[16,800]"],
     r"^workload.prompt_len: max=800 is beyond 768, what max_model_len=1024 leaves after the shared prefix of 256"),
    (["workload=sharegpt", "workload.output_len=100000"],
     r"^workload.output_len=100000 leaves no room within max_model_len=1024 for a prompt of min_len=4 tokens"),
    # The limit is the engine's own: the model's context when max_model_len is left out.
    (["engine.max_model_len=null", "workload.prompt_len=100000"], r"^workload.prompt_len=100000 is beyond "
                                                                  r"max_model_len=4096"),
    (["executor=sim", "workload.prompt_len=[1,100000000]"], r"^workload.prompt_len: max=100000000 is beyond "
                                                            r"max_model_len=4096"),
])
def test_a_length_the_engine_can_never_take_is_refused_before_anything_is_generated(tmp_path, nothing_generated,
                                                                                     overrides, message):
    with pytest.raises(ValueError, match=message):
        run_experiment(compose_config(*BASE, *overrides), tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_trace_length_the_engine_can_never_take_is_refused_before_anything_is_drawn(tmp_path, nothing_generated):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt_len": 8, "output_len": 4}\n{"prompt_len": 100000000, "output_len": 4}\n')
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"^{path}:2: prompt_len 100000000 is beyond max_model_len=1024"):
        run_experiment(compose_config(*BASE, "workload=trace", f"workload.path={path}"), run_dir)
    assert not run_dir.exists()


def test_the_cli_refuses_a_huge_length_in_one_line_with_status_2(tmp_path):
    # Address space capped at 4 GiB: a run that built the workload before checking it fails fast, not by swapping.
    done = subprocess.run([sys.executable, "-m", "framework.run", "executor=sim", "workload.prompt_len=100000000",
                           *BASE, f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == ["error: workload.prompt_len=100000000 is beyond max_model_len=4096: "
                                                "lower it or raise engine.max_model_len"]
    assert not (tmp_path / "workload.jsonl").exists() and not (tmp_path / "requests.csv").exists()


@pytest.mark.parametrize("executor", [[], ["executor=sim", "engine.max_num_seqs=8"]], ids=["model", "sim"])
def test_fcfs_whose_budget_is_below_the_longest_prompt_is_refused_before_anything_is_generated(tmp_path, executor,
                                                                                               nothing_generated):
    # Run, it would drop every prompt over the budget and report latencies of the short ones only.
    cfg = compose_config(*BASE, *executor, "engine.max_num_batched_tokens=64", "workload.prompt_len=[40,200]")
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens=64 is below the longest prompt sent \(200 tokens\) "
                                         r"and policy 'fcfs' prefills each prompt whole, so it could never run: raise "
                                         r"max_num_batched_tokens to >= 200, send shorter prompts, or use a policy "
                                         r"that chunks prefills \(chunked\)$"):
        run_experiment(cfg, tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_budget_below_max_model_len_serves_a_workload_whose_prompts_it_holds(tmp_path):
    # +experiment=chunked_vs_fcfs's setting: fcfs with a budget of 512 under max_model_len 1024, prompts <= 500.
    summary = run_experiment(compose_config(*BASE, "executor=sim", "engine.max_model_len=1024",
                                            "engine.max_num_batched_tokens=512", "engine.max_num_seqs=8",
                                            "workload=mixed_long", "workload.num_requests=12"), tmp_path)
    assert summary["completed"] == 12 and summary["num_ignored"] == 0 and "failure_reasons" not in summary


@pytest.mark.parametrize("executor", [[], ["executor=sim"]], ids=["model", "sim"])
def test_a_request_that_still_cannot_be_served_is_counted_and_printed(tmp_path, capsys, executor):
    # A trace's prompt given as ids is replayed as given; one too long for the engine is refused by it.
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival_time": 0.01 * i, "prompt_token_ids": [5 + i] * n, "output_len": 3})
                             + "\n" for i, n in enumerate((10, 60, 20))))
    run_dir = tmp_path / "run"
    summary = run_experiment(compose_config(*BASE, *executor, "engine.max_model_len=48", "workload=trace",
                                            f"workload.path={trace}"), run_dir)
    assert summary["status"] == "completed" and summary["completed"] == 2 and summary["failed"] == 1
    assert summary["num_ignored"] == 1
    assert summary["failure_reasons"] == {"prompt of N tokens is longer than max_model_len=48": 1}
    assert json.loads((run_dir / "summary.json").read_text())["num_ignored"] == 1
    out = capsys.readouterr().out
    assert re.search(r"^Failed requests: +1\n  of which never run \(ignored\): +1$", out, re.M)
    assert "  1 x prompt of N tokens is longer than max_model_len=48" in out
    assert [r["status"] for r in read_csv(run_dir / "requests.csv") if r["request_id"] == "1"] == ["ignored"]
