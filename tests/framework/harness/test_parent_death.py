"""A parallel sweep's workers end when their parent is SIGKILLed (it stops none of them itself)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.processes import children

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states in /proc")


def _alive(pid):
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pids, seconds):
    """The pids still alive after up to ``seconds``; each is SIGKILLed then, so no test leaves one behind."""
    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


#: A parent that starts one worker the way loky does (a child process with a multiprocessing parent) running a
#: job under ``parent_watched`` with run._job's SIGTERM handler; the job writes "stopped" when it is stopped.
FAKE_PARENT = textwrap.dedent("""
    import multiprocessing, signal, sys, time
    from pathlib import Path

    def job(out):
        from framework.harness import supervision
        signal.signal(signal.SIGTERM, supervision.terminate)
        with supervision.parent_watched():
            Path(out).write_text("running")
            try:
                time.sleep(120)
            except KeyboardInterrupt:
                Path(out).write_text("stopped")

    if __name__ == "__main__":
        worker = multiprocessing.get_context("spawn").Process(target=job, args=(sys.argv[1],))
        worker.start()
        print(worker.pid, flush=True)
        worker.join()
""")


def test_a_worker_whose_parent_is_sigkilled_stops_its_job_and_ends(tmp_path):
    script, out = tmp_path / "parent.py", tmp_path / "job"
    script.write_text(FAKE_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(out)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              text=True)
    worker = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == "running"
    parent.kill()
    parent.wait()
    assert _wait_gone([worker], 5) == []
    assert out.read_text() == "stopped"  # stopped as SIGTERM stops a job: what it measured is kept


@pytest.mark.slow
def test_a_parallel_sweep_sigkilled_leaves_no_worker_and_keeps_what_its_jobs_measured(tmp_path):
    # Two workers of such a sweep were alive 395 s after its parent was SIGKILLed, their summaries "running".
    sweep = tmp_path / "sweep"
    with open(tmp_path / "out.txt", "w") as log:  # not a pipe: the workers would hold it open
        parent = subprocess.Popen([sys.executable, "-m", "framework.run", "-m", "hydra/launcher=parallel",
                                   "executor=sim", "workload.num_requests=100000", "workload.rate=1000,2000",
                                   "progress=false", "plots=false", "save_workload=false", f"hydra.sweep.dir={sweep}"],
                                  cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    summaries = [sweep / str(i) / "summary.json" for i in range(2)]
    requests = [sweep / str(i) / "requests.csv" for i in range(2)]

    def measured(path):  # a request row past the header (rows are flushed at least every second)
        return path.is_file() and path.read_text().count("\n") > 1

    deadline = time.monotonic() + 240
    while parent.poll() is None and not all(map(measured, requests)) and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = children(parent.pid, "LokyProcess")
    assert len(workers) == 2 and parent.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
    parent.kill()
    parent.wait()
    assert _wait_gone(workers, 20) == []
    for path in summaries:
        summary = json.loads(path.read_text())
        assert summary["status"] == "interrupted" and summary["completed"] > 0
