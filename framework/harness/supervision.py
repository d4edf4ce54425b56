"""Stopping well: SIGINT and SIGTERM handling that keeps what was measured, in a run and in a sweep."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

from framework.harness.compare import CompareCallback, compare_stopped_sweep
from framework.harness.recorder import write_summary

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a command stopped by Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143


#: Set when SIGTERM stopped the run, for its exit status.
_terminated = False


def terminate(signum: int, frame: object) -> None:
    """A job's SIGTERM handler (a batch scheduler's time limit, ``kill``, a launcher stopping its
    workers): stops the run as Ctrl-C does, so it keeps what it measured."""
    global _terminated
    _terminated = True
    raise KeyboardInterrupt("SIGTERM")


def stopped_status() -> int:
    return EXIT_TERMINATED if _terminated else EXIT_INTERRUPTED


#: How long a parallel sweep's parent, stopped, waits for its workers' jobs to write their summaries.
WORKERS_GRACE_S = 30.0


#: Set while the parent waits for them: a second signal stops the waiting.
_waiting = False


class _Worker(NamedTuple):
    """A process running this process's sweep jobs, and the signal that stops its jobs as ``signum`` would."""

    pid: int
    is_alive: Callable[[], bool]
    signal_for: Callable[[int], int]


def _workers() -> list[_Worker]:
    """The processes running a sweep's jobs this process started: a parallel sweep's loky workers, and Submitit's
    local job controllers (``hydra/launcher=submitit_local``), which pass SIGTERM on to their job (a SIGINT they
    answer by killing it a second later)."""
    if CompareCallback.sweep_dir is None:
        return []
    loky = [_Worker(p.pid, p.is_alive, lambda signum: signum)
            for p in multiprocessing.active_children() if type(p).__name__ == "LokyProcess"]
    return loky + [_Worker(pid, lambda pid=pid: _alive(pid), lambda signum: signal.SIGTERM)
                   for pid in _children("submitit.local._local")]


def _children(module: str) -> list[int]:
    """This process's child processes running ``python -m module`` (Linux: read from /proc; elsewhere none)."""
    pids: list[int] = []
    for children in Path("/proc/self/task").glob("*/children"):
        with suppress(OSError):
            pids += [int(pid) for pid in children.read_text().split()]
    found = []
    for pid in pids:
        with suppress(OSError):
            if module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (it is not gone, nor a zombie); read from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def started_jobs(sweep_dir: Path) -> list[Path]:
    """The folders of the sweep's jobs that have started (Hydra writes ``.hydra`` before the job
    runs); one without ``summary.json`` is still building its engine or warming up."""
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
    """The command's SIGINT and SIGTERM handler: raises KeyboardInterrupt (SIGTERM also sets status
    143). A parallel (or submitit_local) sweep's parent first forwards the signal to its workers and waits, up to
    ``WORKERS_GRACE_S`` or the next signal, for their summaries: joblib SIGKILLs them once this raises."""
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
        # A worker that got a terminal's Ctrl-C too drops this repeat (experiment._repeats_dropped).
        for worker in workers:
            try:
                os.kill(worker.pid, worker.signal_for(signum))
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


#: How often a parallel sweep's worker checks that its parent lives, and how long it then leaves its job to stop as
#: SIGTERM stops it (keeping what it measured) before it ends the process.
PARENT_POLL_S = 0.5
ORPHAN_GRACE_S = 10.0


#: Jobs under way in this process (``parent_watched``), and whether its parent watchdog runs.
_jobs_running = 0
_watching = False


@contextmanager
def parent_watched() -> Iterator[None]:
    """Around a job of a process that has a multiprocessing parent (a parallel sweep's loky worker): once the parent
    dies (SIGKILLed, it stops no worker), the job stops as SIGTERM stops it, and the process ends when the job has
    or ``ORPHAN_GRACE_S`` later; idle, at once. One watchdog thread per process, polling its parent pid."""
    global _jobs_running, _watching
    parent = multiprocessing.parent_process()
    # A parent pid that is not ours (a fork server's child) cannot be watched through getppid.
    if not _watching and parent is not None and parent.pid == os.getppid():
        _watching = True
        threading.Thread(target=_watch, args=(parent.pid,), name="parent-watchdog", daemon=True).start()
    _jobs_running += 1
    try:
        yield
    finally:
        _jobs_running -= 1


def _watch(parent_pid: int) -> None:
    """Wait for the parent's death (the process is then another's child), stop the job and end the process."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    deadline = time.monotonic() + ORPHAN_GRACE_S
    if _jobs_running:
        _write_out(f"the sweep's parent process ({parent_pid}) is gone: this job stops\n")
        os.kill(os.getpid(), signal.SIGTERM)  # the job's handler (run._job) stops it as a time limit would
    while _jobs_running and time.monotonic() < deadline:
        time.sleep(0.05)
    _write_out("")
    os._exit(EXIT_TERMINATED)


def _write_out(message: str) -> None:
    """Write ``message`` to stderr and flush both streams, for a second at most: the pipe they may write to can
    have lost its reader with the parent, or be full."""
    def write() -> None:
        try:
            sys.stderr.write(message)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        except (OSError, ValueError):  # a broken pipe, a closed stream
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(1.0)


def mark(run_dir: Path, status: str, exc: Exception | None = None) -> bool:
    """Make the run's summary.json say ``status`` (``failed`` or ``interrupted``), writing one if there is none (the
    job cleared an earlier run's: only this run's is kept); an interrupt keeps a summary that says how the run
    ended, a failure overrides it. Returns whether the summary holds measurements."""
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
    """Compare the runs a stopped sweep made. Its jobs still ``running`` (or started with no summary:
    SIGKILLed, see ``stop``) are marked ``interrupted``, or ``failed`` with ``failure`` when the
    launcher itself failed (a worker killed by the OS takes the other workers' jobs down)."""
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
        # A second Ctrl-C stops the comparison (the plots take seconds); the caller still exits
        # with the stopped status, not a traceback.
        print("interrupted: the comparison of the runs so far was not finished", file=sys.stderr)
        return
    if table is not None:
        print(f"comparison of the runs so far: {table}", file=sys.stderr)
