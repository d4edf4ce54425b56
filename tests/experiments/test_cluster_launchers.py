"""Sweeps on Hydra's cluster launchers: Submitit (``hydra/launcher=slurm``, checked with its local executor) and Ray
(``hydra/launcher=ray``, a local Ray cluster; only where the ``cluster`` extra is installed). A simulated run is
deterministic, so each launcher's jobs must write the very metrics, and the sweep the very comparison, that the
basic launcher's do. An interrupted sweep keeps its finished jobs' metrics."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOBS = ["executor=sim", "workload.num_requests=4", "plots=false", "progress=false", "+policy=fcfs,chunked"]
#: Keys of a summary that say when, where or how fast (in wall-clock time) a run ran, not what it measured.
UNMEASURED = {"wall_time_s", "run_dir", "group"}
RAY_LOCAL = ["hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
             "+hydra.launcher.ray.init.include_dashboard=false"]


def sweep(tmp_path: Path, name: str, *overrides: str) -> Path:
    """Run ``python -m framework.run -m`` with ``overrides`` and the two jobs; returns the sweep's folder."""
    out = tmp_path / name
    result = subprocess.run([sys.executable, "-m", "framework.run", "-m", *overrides, *JOBS,
                             f"hydra.sweep.dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def measured(sweep_dir: Path) -> dict[str, dict]:
    """Each job's summary (by job number) without ``UNMEASURED``."""
    return {p.parent.name: {k: v for k, v in json.loads(p.read_text()).items() if k not in UNMEASURED}
            for p in sorted(sweep_dir.glob("*/summary.json"))}


def comparison(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "comparison.csv") as f:
        return [{k: v for k, v in row.items() if k != "run_dir"} for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def basic(tmp_path_factory) -> Path:
    return sweep(tmp_path_factory.mktemp("basic"), "basic")


def test_the_slurm_option_selects_submitits_slurm_launcher():
    from tests.hydra_support import compose_config

    launcher = compose_config("hydra/launcher=slurm", return_hydra_config=True).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.cpus_per_task, launcher.tasks_per_node, launcher.partition) == (1, 1, None)


def test_submitit_jobs_measure_and_compare_as_the_basic_launchers(basic, tmp_path):
    out = sweep(tmp_path, "submitit", "hydra/launcher=submitit_local")
    assert measured(out) == measured(basic) and len(measured(out)) == 2
    assert comparison(out) == comparison(basic)


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                    reason="Hydra's Ray launcher is in the cluster extra: pip install -e '.[cluster]'")
def test_ray_jobs_measure_and_compare_as_the_basic_launchers(basic, tmp_path):
    out = sweep(tmp_path, "ray", *RAY_LOCAL)
    assert measured(out) == measured(basic) and len(measured(out)) == 2
    assert comparison(out) == comparison(basic)


def test_an_interrupted_submitit_sweep_keeps_its_finished_jobs_metrics(tmp_path):
    """Job 0 is simulated (seconds), job 1 real with requests arriving over a minute: the parent alone is
    interrupted once job 0 has finished; it stops job 1 through Submitit's controller and compares both."""
    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "framework.run", "-m", "hydra/launcher=submitit_local",
                             "executor=sim,model", "backend=naive", "workload=poisson", "workload.rate=0.3",
                             "workload.num_requests=20", "engine.num_threads=1", "plots=false", "progress=false",
                             f"hydra.sweep.dir={out}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while status(out / "0") != "completed":
            assert time.monotonic() < deadline and proc.poll() is None, "job 0 never finished"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=90)  # the jobs end first: they hold its pipes
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    rows = {Path(r["run_dir"]).name: r for r in csv.DictReader(open(out / "comparison.csv"))}
    summary = json.loads((out / "0" / "summary.json").read_text())
    assert rows["0"]["status"] == "completed" and rows["0"]["completed"] == "20"
    assert float(rows["0"]["mean_ttft_ms"]) == pytest.approx(summary["mean_ttft_ms"], rel=1e-3)
    # Job 1 was stopped (SIGTERM through Submitit's controller) and wrote how it ended.
    assert rows["1"]["status"] == "interrupted" and status(out / "1") == "interrupted"


def status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        return None
