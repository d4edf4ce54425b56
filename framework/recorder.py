"""The local files of one run, written as the run goes so an interrupted run keeps its data.

In the run directory: ``config.yaml`` (the resolved config), ``workload.jsonl`` (the requests
sent, replayable as a trace), ``requests.csv`` (a row per finished request, appended as it
finishes), ``steps.csv`` (a row per engine step) and ``summary.json`` (written at the start with
``status: running`` and rewritten at the end with ``completed`` or ``interrupted``).
"""
from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

import yaml

from framework.metrics import REQUEST_COLUMNS, STEP_COLUMNS, RequestRecord
from framework.workload import WorkloadRequest
from framework.workloads.trace import save_trace


class RunRecorder:
    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._requests, self._request_writer = self._open_csv("requests.csv", REQUEST_COLUMNS)
        self._steps, self._step_writer = self._open_csv("steps.csv", STEP_COLUMNS)

    def _open_csv(self, name: str, columns: list[str]) -> tuple[TextIO, csv.DictWriter]:
        f = open(self.run_dir / name, "w", newline="")
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        f.flush()
        return f, writer

    def write_config(self, config: dict[str, Any]) -> None:
        with open(self.run_dir / "config.yaml", "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)

    def write_workload(self, requests: list[WorkloadRequest]) -> None:
        save_trace(self.run_dir / "workload.jsonl", requests)

    def add_request(self, record: RequestRecord) -> None:
        self._request_writer.writerow(record.row())
        self._requests.flush()

    def add_step(self, row: dict[str, Any]) -> None:
        self._step_writer.writerow(row)
        self._steps.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Replace ``summary.json`` atomically (a reader never sees half a file)."""
        tmp = self.run_dir / "summary.json.tmp"
        with open(tmp, "w") as f:
            json.dump(_jsonable(summary), f, indent=2)
        os.replace(tmp, self.run_dir / "summary.json")

    def close(self) -> None:
        self._requests.close()
        self._steps.close()


def _jsonable(value: Any) -> Any:
    """NaN and infinities become null: JSON has no such numbers."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
