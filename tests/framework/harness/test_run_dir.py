"""A run directory used again (``hydra.run.dir=SAME`` twice) holds the new run's files only."""
import json
import os
import subprocess
import sys
from pathlib import Path

from framework.harness.experiment import run_experiment
from framework.harness.recorder import RUN_FILES
from tests.hydra_support import compose_config

ROOT = Path(__file__).resolve().parents[3]
SIM = ["executor=sim", "progress=false", "workload.num_requests=6", "workload.prompt_len=[8,24]",
       "workload.output_len=[2,5]"]


def test_a_configuration_error_in_a_used_run_dir_carries_nothing_of_the_earlier_run(tmp_path):
    # Neither the earlier run's metrics in the failed summary, nor its CSVs, plots, config.yaml or log
    # lines beside it: a reader would take them for this run's.
    run_experiment(compose_config(*SIM), tmp_path)
    (tmp_path / "run.log").write_text("[the earlier run's log]\n")
    done = subprocess.run([sys.executable, "-m", "framework.run", *SIM, "engine.block_size=3",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "block_size must be a power of two" in summary["error"]
    assert not {"completed", "num_requests", "mean_ttft_ms", "policy"} & set(summary)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "run.log", "summary.json"]
    assert "earlier run" not in (tmp_path / "run.log").read_text()


def test_a_run_in_a_used_run_dir_leaves_none_of_the_earlier_runs_files(tmp_path):
    run_experiment(compose_config(*SIM), tmp_path)
    assert {"latency_cdf.png", "timeline.png", "workload.jsonl"} <= {p.name for p in tmp_path.iterdir()}
    summary = run_experiment(compose_config(*SIM, "plots=false", "save_workload=false"), tmp_path)
    assert summary["status"] == "completed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "requests.csv", "steps.csv", "summary.json"]


def test_every_file_a_run_writes_is_one_a_run_starting_there_clears(tmp_path):
    run_experiment(compose_config(*SIM, "workload.rate=4"), tmp_path)
    assert {p.name for p in tmp_path.iterdir()} <= set(RUN_FILES)


def test_a_run_replaying_the_folders_own_workload_keeps_it(tmp_path):
    # The folder's workload.jsonl is this run's input here, not an earlier run's leftover.
    run_experiment(compose_config(*SIM), tmp_path)
    trace = tmp_path / "workload.jsonl"
    sent = trace.read_text()
    replay = ["executor=sim", "progress=false", "workload=trace", f"workload.path={trace}", "save_workload=false"]
    assert run_experiment(compose_config(*replay), tmp_path)["completed"] == 6
    assert trace.read_text() == sent
    done = subprocess.run([sys.executable, "-m", "framework.run", *replay, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert trace.read_text() == sent and json.loads((tmp_path / "summary.json").read_text())["completed"] == 6
