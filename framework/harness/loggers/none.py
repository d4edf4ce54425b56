"""No logger: the run's local files only."""
from __future__ import annotations

from framework.harness.run_logger import LOGGERS, RunLogger


@LOGGERS.register("none")
class NoLogger(RunLogger):
    """Logs nothing beyond the local files every run writes."""
