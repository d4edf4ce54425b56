"""The local files of one run, written as the run goes so an interrupted run keeps its data.

In the run directory: ``config.yaml`` (the resolved config), ``workload.jsonl`` (the requests sent,
replayable as a trace), ``requests.csv`` (a row per finished request, in the order of the steps that
finish them, a cluster's by start time, fast-forwarded or not), ``steps.csv`` (a row per engine step)
and ``summary.json`` (``status: running`` at the start, then ``completed``, ``interrupted`` or
``failed``). A cluster run's CSVs have a ``replica`` column (after ``request_id`` in
``requests.csv``, first in ``steps.csv``); step rows come in chunks per replica, each in step order.
Rows are written at least every ``flush_interval`` seconds of wall time and every ``CHUNK_ROWS``
steps, so a killed run loses at most that much.
"""
from __future__ import annotations

import csv
import fcntl
import json
import logging
import math
import os
import shutil
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from itertools import repeat
from operator import attrgetter
from pathlib import Path
from typing import Any, TextIO

import yaml

from framework.engine.llm_engine import StepStats
from framework.sim.fast_forward import DecodeRun
from framework.harness.metrics import REQUEST_COLUMNS, STATS_COLUMNS, STEP_COLUMNS, RequestRecord, StepTotals
from framework.scheduling.output import SchedulerOutput
from framework.harness.workload import WorkloadRequest
from framework.harness.workloads.trace import save_trace

log = logging.getLogger(__name__)

#: Step rows buffered per replica before they are written, whatever the time.
CHUNK_ROWS = 1 << 14
_FLOAT_FORMATS = {"start_time": "%.12g", "duration": "%.12g", "kv_usage": "%.6g"}
#: A ``steps.csv`` row (without the replica): ``time_s``, then the ``StepStats`` columns.
_ROW_FORMAT = "%.6f," + ",".join(_FLOAT_FORMATS.get(name, "%d") for name in STATS_COLUMNS) + "\n"
#: The same for a step of a decode run, whose steps schedule one token per running request and
#: nothing else: the columns that are zero on every such step are written as constants.
_DECODE_ZEROS = {"num_prefill_tokens", "num_waiting", "num_swapped", "num_preempted", "num_swapped_out_blocks",
                 "num_swapped_in_blocks"}
_DECODE_FORMAT = "%.6f," + ",".join("0" if name in _DECODE_ZEROS else _FLOAT_FORMATS.get(name, "%d")
                                    for name in STATS_COLUMNS) + "\n"
#: The columns a decode run's rows fill in, in ``_DECODE_FORMAT`` order.
_DECODE_COLUMNS = [name for name in STEP_COLUMNS if name not in _DECODE_ZEROS]
_stats_values = attrgetter(*STATS_COLUMNS)
#: What the timeline plot reads, kept compactly (float32 / int32) when plots are wanted.
TIMELINE_COLUMNS = {"time_s": "f", "duration": "f", "num_prefill_tokens": "i", "num_decode_tokens": "i",
                    "num_running": "i", "num_waiting": "i", "num_swapped": "i", "kv_usage": "f", "replica": "i"}

StepListener = Callable[[dict[str, Any]], None]

#: The files a run writes in its directory, plots included (``experiment._plots``'s): a run starting in a
#: folder used before removes them, so it mixes nothing of an earlier run's. Hydra's ``.hydra/`` and log are Hydra's.
RUN_FILES = ("config.yaml", "workload.jsonl", "summary.json", "summary.json.tmp", "requests.csv", "steps.csv",
             "latency_cdf.png", "latency_cdf.pdf", "timeline.png", "timeline.pdf")


#: The folders a run writes in its directory: W&B's offline runs (``wandb sync <run dir>/wandb/offline-run-*``
#: would upload an earlier run's beside this one's).
RUN_FOLDERS = ("wandb",)


#: The run directories this process's threads hold, as (device, inode, thread): a run claims its folder in
#: ``framework.run``'s job and again in ``run_experiment``, and must not be refused by its own claim.
_claimed: set[tuple[int, int, int]] = set()


@contextmanager
def claim_run_dir(run_dir: str | Path, setting: str = "hydra.run.dir") -> Iterator[None]:
    """Hold ``run_dir`` (an exclusive ``flock`` on the folder itself) for the ``with`` block; ValueError, one line naming
    ``setting``, while another run holds it. A claim within the same thread's is free; a folder it made goes if empty."""
    path = Path(run_dir)
    created = not path.is_dir()
    make_run_dir(path, setting)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        key = _key(fd)
        if key in _claimed:
            yield
            return
        while not _lock(fd, path, setting):
            # The folder was removed (left empty by a claim that made it) after it was opened here: claim the new one.
            os.close(fd)
            created = True
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            key = _key(fd)
        _claimed.add(key)
        try:
            yield
        finally:
            _claimed.discard(key)
            if created:
                with suppress(OSError):  # not empty: the run wrote its files
                    path.rmdir()
    finally:
        os.close(fd)  # releases the lock


def make_run_dir(path: Path, setting: str = "hydra.run.dir") -> None:
    """Make the folder ``path`` (and its parents) unless it is one; ValueError, one line naming ``setting``, where it
    cannot be (a file in the way, no permission)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{setting}={path} cannot be made a folder: {exc.strerror or exc}"
                         f"{f' ({exc.filename})' if exc.filename and str(exc.filename) != str(path) else ''}") from None


def _key(fd: int) -> tuple[int, int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino, threading.get_ident()


def _lock(fd: int, path: Path, setting: str) -> bool:
    """``flock`` the folder open as ``fd``; whether that folder is still at ``path``. ValueError when another run holds
    it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"run directory {path} is in use by another run; give each concurrent run its own "
                         f"{setting}") from None
    except OSError as exc:
        # A file system without flock (some NFS set-ups): runs there go unguarded rather than not at all.
        log.warning("cannot lock run directory %s (%s): runs sharing it are not detected", path, exc)
        return True
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return _key(fd)[:2] == (now.st_dev, now.st_ino)


def clear_run_files(run_dir: str | Path, keep: Iterable[str] = ()) -> None:
    """Remove the ``RUN_FILES`` and ``RUN_FOLDERS`` an earlier run left in ``run_dir`` (a ``hydra.run.dir`` given
    twice means to overwrite, as Hydra's fresh default folders do), but none that holds or is a path in ``keep``
    (the run's inputs)."""
    kept = {_resolved(name) for name in keep}
    for name in RUN_FILES:
        path = Path(run_dir) / name
        if path.resolve() not in kept:
            path.unlink(missing_ok=True)  # a link itself, not what it points to
    for name in RUN_FOLDERS:
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink() and not any(k and k.is_relative_to(path.resolve()) for k in kept):
            shutil.rmtree(path)


def _resolved(name: str) -> Path | None:
    """``name`` as an absolute path, or None where it is none (a NUL character)."""
    try:
        return Path(name).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> None:
    """Replace ``run_dir/summary.json`` atomically (a reader never sees half a file); NaN and
    infinities become null."""
    tmp = Path(run_dir) / "summary.json.tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(summary), f, indent=2)
    os.replace(tmp, Path(run_dir) / "summary.json")


class RunRecorder:
    """Owns the run directory's files: ``step_log`` makes a replica's step callback, ``add_request``
    takes finished requests, ``close`` writes what is buffered. ``replica_column`` adds the ``replica``
    columns; ``step_listener`` gets each step row as a dict; ``keep_timeline`` keeps ``timeline()``."""

    def __init__(self, run_dir: str | Path, replica_column: bool = False, step_listener: StepListener | None = None,
                 keep_timeline: bool = True, flush_interval: float = 1.0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.replica_column = replica_column
        self.step_columns = (["replica"] if replica_column else []) + STEP_COLUMNS
        self.request_columns = list(REQUEST_COLUMNS)
        if replica_column:
            self.request_columns.insert(1, "replica")
        self._requests, self._request_writer = self._open_csv("requests.csv", self.request_columns)
        self._steps, _ = self._open_csv("steps.csv", self.step_columns)
        self._listener = step_listener
        self._logs: list[StepLog] = []
        self.step_totals = StepTotals()
        self._timeline = {name: array(code) for name, code in TIMELINE_COLUMNS.items()} if keep_timeline else None
        self.flush_interval = flush_interval
        self._deadline = time.monotonic() + flush_interval

    def _open_csv(self, name: str, columns: list[str]) -> tuple[TextIO, Any]:
        f = open(self.run_dir / name, "w", newline="")
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        f.flush()
        return f, writer

    def write_config(self, config: dict[str, Any]) -> None:
        with open(self.run_dir / "config.yaml", "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)

    def write_workload(self, requests: list[WorkloadRequest], sampling: dict[str, Any] | None = None) -> None:
        """``workload.jsonl``: ``requests`` with the sampling they are sent with (``sampling``, the
        workload's keys, under each request's own)."""
        save_trace(self.run_dir / "workload.jsonl", requests, sampling)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_summary(self.run_dir, summary)

    # -- as the run goes -------------------------------------------------------------------------
    def step_log(self, replica: int = 0, run_start: float = 0.0) -> StepLog:
        """The step callback for replica ``replica``'s engine; ``time_s`` counts from ``run_start``."""
        log = StepLog(self, replica, run_start)
        self._logs.append(log)
        return log

    def request_values(self, record: RequestRecord, replica: int = 0) -> list[Any]:
        """``record``'s ``requests.csv`` row, in ``request_columns`` order."""
        values = record.values()
        if self.replica_column:
            values.insert(1, replica)
        return values

    def add_request(self, record: RequestRecord, replica: int = 0) -> None:
        self._request_writer.writerow(self.request_values(record, replica))
        if time.monotonic() >= self._deadline:
            self.flush()

    def flush(self) -> None:
        """Write every buffered row and hand them to the disk."""
        for log in self._logs:
            if log.rows:
                self._steps.write("".join(log.rows))
                log.rows = []
        self._requests.flush()
        self._steps.flush()
        self._deadline = time.monotonic() + self.flush_interval

    def timeline(self) -> dict[str, Any]:
        """The timeline columns of every step so far (numpy arrays; empty when the recorder
        keeps none)."""
        import numpy as np

        return {name: np.asarray(values) for name, values in (self._timeline or {}).items()}

    def close(self) -> None:
        self.flush()
        self._requests.close()
        self._steps.close()


class StepLog:
    """A step callback making one ``steps.csv`` row per step of one replica, written by the recorder's
    ``flush``. ``on_decode_run`` keeps a simulated engine fast-forwarding (a callback without it
    switches the fast path off) and makes exactly the rows stepping one by one would."""

    def __init__(self, recorder: RunRecorder, replica: int, run_start: float) -> None:
        self.recorder = recorder
        self.replica = replica
        self.run_start = run_start
        self.rows: list[str] = []
        prefix = f"{replica}," if recorder.replica_column else ""
        self._format, self._decode_format = prefix + _ROW_FORMAT, prefix + _DECODE_FORMAT
        self._totals = recorder.step_totals
        self._timeline = recorder._timeline
        self._listener = recorder._listener

    def __call__(self, stats: StepStats, out: SchedulerOutput) -> None:
        row = (stats.start_time - self.run_start, *_stats_values(stats))
        self.rows.append(self._format % row)
        self._totals.add(1, (stats.kv_usage,), stats.num_scheduled_tokens, stats.num_prefill_tokens,
                         stats.num_swapped_out_blocks, stats.num_swapped_in_blocks)
        if self._timeline is not None:
            self._keep(row[:1], [stats.duration], [stats.num_prefill_tokens], [stats.num_decode_tokens],
                       [stats.num_running], [stats.num_waiting], [stats.num_swapped], [stats.kv_usage])
        if self._listener is not None:
            self._listen(row)
        self._after()

    def on_decode_run(self, run: DecodeRun) -> None:
        num, ends, sizes = len(run.end_times), run.end_times, run.batch_sizes
        starts = [run.start_time] + ends[:-1]
        times = [t - self.run_start for t in starts]
        durations = [end - start for start, end in zip(starts, ends)]
        running = list(sizes)
        for step, group in run.finished:
            running[step - 1] -= len(group)
        finished = [0] * num
        for step, count in run.outputs_finished.items():
            finished[step - 1] = count
        usage = [u / run.num_usable_blocks for u in run.kv_blocks_used]
        # Every STEP_COLUMNS column but the _DECODE_ZEROS ones.
        columns = {"time_s": times, "step": range(run.first_step, run.first_step + num), "start_time": starts,
                   "duration": durations, "num_scheduled_reqs": sizes, "num_scheduled_tokens": sizes,
                   "num_decode_tokens": sizes, "num_running": running, "kv_blocks_used": run.kv_blocks_used,
                   "kv_usage": usage, "num_finished": finished}
        fmt = self._decode_format
        self.rows += [fmt % row for row in zip(*[columns[name] for name in _DECODE_COLUMNS])]
        self._totals.add(num, usage, sum(sizes), 0, 0, 0)
        if self._timeline is not None:
            zeros = [0] * num
            self._keep(times, durations, zeros, sizes, running, zeros, zeros, usage)
        if self._listener is not None:
            for row in zip(*[columns.get(name, repeat(0)) for name in STEP_COLUMNS]):
                self._listen(row)
        self._after()

    def _keep(self, *columns: Sequence[Any]) -> None:
        """Append to the timeline (``TIMELINE_COLUMNS`` order, less the replica)."""
        timeline = self._timeline
        for values, column in zip(timeline.values(), columns):
            values.extend(column)
        timeline["replica"].extend(repeat(self.replica, len(columns[0])))

    def _listen(self, row: tuple) -> None:
        names = self.recorder.step_columns
        self._listener(dict(zip(names, (self.replica, *row) if self.recorder.replica_column else row)))

    def _after(self) -> None:
        if len(self.rows) >= CHUNK_ROWS or time.monotonic() >= self.recorder._deadline:
            self.recorder.flush()


def _jsonable(value: Any) -> Any:
    """NaN and infinities become null: JSON has no such numbers."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
