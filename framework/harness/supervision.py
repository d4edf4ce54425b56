"""Stopping well: SIGINT and SIGTERM handling that keeps what was measured, in a run and in a sweep."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from framework.harness.compare import CompareCallback, compare_stopped_sweep
from framework.harness.recorder import write_summary

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a command stopped by Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143


#: Set when SIGTERM stopped the run, for its exit status.
_terminated = False


def terminate(signum: int, frame: object) -> None:
    """SIGTERM (a batch scheduler's time limit, ``kill``, a sweep launcher stopping its workers)
    stops a run as Ctrl-C does, so it keeps what it measured, instead of dying mid-write."""
    global _terminated
    _terminated = True
    raise KeyboardInterrupt("SIGTERM")


def stopped_status() -> int:
    return EXIT_TERMINATED if _terminated else EXIT_INTERRUPTED


#: How long a parallel sweep's parent, stopped, waits for its workers' jobs to write their summaries.
WORKERS_GRACE_S = 30.0


#: Set while the parent waits for them: a second signal stops the waiting.
_waiting = False


def _workers() -> list[multiprocessing.process.BaseProcess]:
    """The worker processes of a parallel sweep (joblib's loky workers) this process started."""
    if CompareCallback.sweep_dir is None:
        return []
    return [p for p in multiprocessing.active_children() if type(p).__name__ == "LokyProcess"]


def started_jobs(sweep_dir: Path) -> list[Path]:
    """The folders of the sweep's jobs that have started: Hydra writes a job's ``.hydra`` folder
    before the job's function runs, so a folder with one and no ``summary.json`` is a job still
    building its engine or warming up (``run_experiment`` writes its ``running`` summary next)."""
    return sorted(path.parent for path in sweep_dir.glob("*/.hydra"))


def _running(sweep_dir: Path) -> bool:
    """Whether a job of the sweep has yet to write how it ended: its summary says ``running`` (or
    is half written), or it started and has written none yet."""
    if any(not (job / "summary.json").exists() for job in started_jobs(sweep_dir)):
        return True
    for path in sweep_dir.glob("*/summary.json"):
        try:
            if json.loads(path.read_text()).get("status") == "running":
                return True
        except (OSError, ValueError):
            return True
    return False


def stop(signum: int, frame: object) -> None:
    """The command's SIGINT and SIGTERM handler: a KeyboardInterrupt, as Python's Ctrl-C handler
    raises (SIGTERM also sets the exit status 143). In a parallel sweep's parent it first forwards
    the signal to the workers and waits (``WORKERS_GRACE_S`` at most, or until the next signal)
    until every job that started has a summary that says how it ended (``_running``), one still
    building its engine included: joblib kills its workers with SIGKILL as soon as the
    parent is interrupted, and a job killed so keeps no metrics. A worker stops its job as on
    Ctrl-C and writes its summary. A terminal's Ctrl-C reaches the workers too, and the forwarded
    signal is dropped as a repeat (``framework.harness.experiment``); the waiting then spares them the
    race against the SIGKILL they used to lose."""
    global _terminated, _waiting
    if signum == signal.SIGTERM:
        _terminated = True
    reason = "SIGTERM" if signum == signal.SIGTERM else ""
    workers = [] if _waiting else _workers()
    sweep_dir = CompareCallback.sweep_dir
    if not workers or sweep_dir is None:
        raise KeyboardInterrupt(reason)
    _waiting = True
    try:
        for worker in workers:
            try:
                os.kill(worker.pid, signum)
            except (OSError, TypeError):  # gone already, or never started (no pid)
                pass
        print(f"interrupted: waiting up to {WORKERS_GRACE_S:.0f} s for the sweep's jobs to write their summaries "
              f"(interrupt again to stop now)", file=sys.stderr)
        deadline = time.monotonic() + WORKERS_GRACE_S
        while _running(sweep_dir) and any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        _waiting = False
    raise KeyboardInterrupt(reason)


def mark(run_dir: Path, status: str, exc: Exception | None = None) -> bool:
    """Make the run's summary.json say ``status`` (``failed`` or ``interrupted``), also when the
    run stopped before writing one (a configuration error, building the engine, warming up). An
    interrupt keeps a summary that already says how the run ended (a Ctrl-C while the plots of a
    finished run were drawn); a failure overrides it with its error. Returns whether the summary
    holds measurements (requests served)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    if status == "failed" or summary.get("status") in (None, "running"):
        run_dir.mkdir(parents=True, exist_ok=True)
        error = {"error": f"{type(exc).__name__}: {exc}"} if exc is not None else {}
        # A failure after an interrupt (drawing plots, logging) still covers only part of the run.
        interrupted = status == "interrupted" or bool(summary.get("interrupted"))
        write_summary(run_dir, {**summary, "status": status, "interrupted": interrupted, **error})
    return summary.get("completed") is not None


def compare_stopped(failure: BaseException | None = None) -> None:
    """A sweep stopped by Ctrl-C still gets the comparison of the runs it made. A job whose summary
    still says ``running``, or that started and wrote none, was killed where no handler runs
    (joblib's launcher SIGKILLs its workers once the parent is interrupted: the parent waits for
    their summaries first, see ``stop``, but not past ``WORKERS_GRACE_S`` or a second Ctrl-C):
    it is marked ``interrupted``;
    or ``failed``, with ``failure``, when the launcher itself failed mid-sweep (a joblib worker
    killed by the OS, which takes the other workers' jobs down with it)."""
    sweep_dir = CompareCallback.sweep_dir
    if sweep_dir is not None:
        jobs = {path.parent for path in sweep_dir.glob("*/summary.json")} | set(started_jobs(sweep_dir))
        for job in sorted(jobs):
            summary = job / "summary.json"
            if failure is None:
                mark(job, "interrupted")  # leaves a summary that says how its run ended
            elif not summary.exists() or json.loads(summary.read_text()).get("status") == "running":
                mark(job, "failed", failure)
    try:
        table = compare_stopped_sweep()
    except KeyboardInterrupt:
        # Ctrl-C again while the comparison is written (matplotlib's import and the plots take
        # seconds) stops it, as a run's repeated Ctrl-C stops its plots: the caller still ends
        # the command with the stopped status, not a traceback from inside the first one's handling.
        print("interrupted: the comparison of the runs so far was not finished", file=sys.stderr)
        return
    if table is not None:
        print(f"comparison of the runs so far: {table}", file=sys.stderr)
