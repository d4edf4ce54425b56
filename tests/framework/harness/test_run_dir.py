"""A run directory used again (``hydra.run.dir=SAME`` twice) holds the new run's files only; one a live run holds
is refused, untouched, and runs started in the same second get a folder each."""
import fcntl
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from framework.harness.experiment import run_experiment
from framework.harness.recorder import RUN_FILES
from tests.hydra_support import compose_config

ROOT = Path(__file__).resolve().parents[3]
SIM = ["executor=sim", "progress=false", "workload.num_requests=6", "workload.prompt_len=[8,24]",
       "workload.output_len=[2,5]"]
#: Takes a run's lock on the folder argv[1] (an exclusive flock on the folder itself), says so, and holds it until
#: its stdin closes.
HOLD = ("import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDONLY), fcntl.LOCK_EX); "
        "print('held', flush=True); sys.stdin.read()")


@contextmanager
def held_by_another_process(run_dir):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def held(run_dir):
    """Whether a run holds ``run_dir``: another open of it cannot take the lock."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def files(run_dir, skip=()):
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
            if p.is_file() and p.relative_to(run_dir).parts[0] not in skip}


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


def test_a_run_in_a_used_run_dir_clears_the_earlier_runs_wandb_runs(tmp_path):
    """``wandb sync <run dir>/wandb/offline-run-*`` must upload this run's offline run alone."""
    earlier = tmp_path / "wandb" / "offline-run-20261128_000000-earlier"
    earlier.mkdir(parents=True)
    (earlier / "run-earlier.wandb").write_bytes(b"\0")
    (tmp_path / "wandb" / "latest-run").symlink_to(earlier)
    assert run_experiment(compose_config(*SIM), tmp_path)["status"] == "completed"
    assert not (tmp_path / "wandb").exists()
    # A workload read from there is the run's input: kept.
    earlier.mkdir(parents=True)
    (earlier / "trace.jsonl").write_text((tmp_path / "workload.jsonl").read_text())
    replay = ["executor=sim", "progress=false", "workload=trace", f"workload.path={earlier / 'trace.jsonl'}"]
    assert run_experiment(compose_config(*replay), tmp_path)["completed"] == 6


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


def test_a_run_into_a_folder_another_live_run_holds_is_refused_before_anything_there_is_touched(tmp_path):
    run_experiment(compose_config(*SIM), tmp_path)
    before = files(tmp_path)
    with held_by_another_process(tmp_path):
        with pytest.raises(ValueError, match=rf"^run directory {re.escape(str(tmp_path))} is in use by another run; "
                                             r"give each concurrent run its own hydra.run.dir$"):
            run_experiment(compose_config(*SIM, "plots=false"), tmp_path)
        assert files(tmp_path) == before
    assert run_experiment(compose_config(*SIM, "plots=false"), tmp_path)["status"] == "completed"


def test_the_cli_refuses_a_folder_another_live_run_holds_in_one_line_with_status_2_leaving_its_files(tmp_path):
    # Its summary not marked failed, its log not truncated: they are the live run's.
    run_experiment(compose_config(*SIM), tmp_path)
    (tmp_path / "run.log").write_text("[the live run's log]\n")
    before = files(tmp_path)
    with held_by_another_process(tmp_path):
        done = subprocess.run([sys.executable, "-m", "framework.run", *SIM, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                              env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [f"error: run directory {tmp_path} is in use by another run; give each "
                                                f"concurrent run its own hydra.run.dir"]
    assert files(tmp_path, skip={".hydra"}) == before  # .hydra/ is Hydra's, written before any job starts


def test_a_run_holds_its_folder_until_it_ends_or_fails(tmp_path):
    seen = []

    def fail(engine):
        seen.append(held(tmp_path))
        raise RuntimeError("the engine broke")

    run_experiment(compose_config(*SIM), tmp_path, on_engine=lambda engine: seen.append(held(tmp_path)))
    assert seen == [True] and not held(tmp_path)
    with pytest.raises(RuntimeError, match="the engine broke"):
        run_experiment(compose_config(*SIM), tmp_path, on_engine=fail)
    assert seen == [True, True] and not held(tmp_path)
    with pytest.raises(ValueError, match="block_size"):
        run_experiment(compose_config(*SIM, "engine.block_size=3"), tmp_path)
    assert not held(tmp_path)


def test_runs_and_sweeps_started_in_the_same_second_get_a_folder_each():
    first, second = (compose_config(return_hydra_config=True).hydra for _ in range(2))
    assert first.run.dir != second.run.dir and first.sweep.dir != second.sweep.dir


def sweep(sweep_dir):
    return subprocess.run([sys.executable, "-m", "framework.run", "-m", *SIM, "workload.seed=1,2",
                           f"hydra.sweep.dir={sweep_dir}"], cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
                          capture_output=True, text=True, timeout=300)


def test_a_sweep_into_a_folder_a_live_sweep_holds_is_refused_before_any_job(tmp_path):
    with held_by_another_process(tmp_path):
        done = sweep(tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (f"error: run directory {tmp_path} is in use by another run; give "
                                                    f"each concurrent run its own hydra.sweep.dir")
    assert not (tmp_path / "0").exists() and not (tmp_path / "1").exists()


def test_a_sweep_job_refused_its_folder_is_reported_and_fails_the_sweep_leaving_that_folder(tmp_path):
    job = tmp_path / "0"
    run_experiment(compose_config(*SIM, "plots=false"), job)
    (job / "run.log").write_text("[the live run's log]\n")
    before = files(job, skip={".hydra"})
    with held_by_another_process(job):
        done = sweep(tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"1 run(s) not started: {job}: run directory {job} is in use by another run" in done.stderr
    assert "its own hydra.sweep.dir" in done.stderr
    assert files(job, skip={".hydra"}) == before  # .hydra/ is Hydra's, written before any job starts
    assert json.loads((tmp_path / "1" / "summary.json").read_text())["status"] == "completed"
    assert sweep(tmp_path).returncode == 0  # the marker of the refused job is gone with the folder free again


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_a_run_dir_that_cannot_be_a_folder_is_one_line_with_status_2(tmp_path, multirun):
    """A file where the folder goes is a configuration error, answered before Hydra would give a traceback."""
    (tmp_path / "afile").write_text("mine\n")
    setting = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    for where, why in ((tmp_path / "afile", "File exists"), (tmp_path / "afile" / "sub", "Not a directory")):
        done = subprocess.run([sys.executable, "-m", "framework.run", *(["-m"] if multirun else []), *SIM,
                               f"{setting}={where}"], cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1] == f"error: {setting}={where} cannot be made a folder: {why}"
        assert "Traceback" not in done.stderr
    assert (tmp_path / "afile").read_text() == "mine\n"
