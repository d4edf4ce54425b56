"""The ``RunLogger`` interface: where a run's measurements go besides its local files.

The run (``framework/harness/experiment.py``) always writes its local files; a logger sends the same
things elsewhere (an experiment tracker). The Hydra ``logger`` group picks it (``logger=wandb``) and
holds its options. Every call goes through ``Guarded``: a logger that fails is switched off with a
warning and never fails the run.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from framework.common.registry import Registry

logger = logging.getLogger(__name__)


class RunLogger:
    """Hooks in the order the run calls them: ``start`` once, ``log_step`` after every engine
    step, then ``log_summary``, ``log_requests``, ``log_plots`` and ``finish``; a run that fails
    while serving calls ``log_summary`` (``status: failed``, its ``error`` and the metrics of the
    requests finished before it) and ``finish``. Every hook is optional (the defaults do
    nothing). Rows are plain dicts of numbers and strings."""

    name: ClassVar[str] = ""

    def start(self, config: dict[str, Any], run_dir: Path, run_name: str, group: str | None = None) -> None:
        """``group`` names the sweep a run belongs to (None for a single run)."""

    def log_step(self, row: dict[str, Any]) -> None: ...

    def log_summary(self, summary: dict[str, Any]) -> None: ...

    def log_requests(self, columns: list[str], rows: list[dict[str, Any]]) -> None: ...

    def log_plots(self, plots: dict[str, Path]) -> None: ...

    def finish(self, interrupted: bool) -> None: ...


LOGGERS: Registry[RunLogger] = Registry(
    "logger", RunLogger, entry_point_group="framework.loggers", builtin="framework.harness.loggers")


def create_logger(options: dict[str, Any]) -> RunLogger:
    """The logger a Hydra ``logger`` node describes: ``{name: ..., **options}``."""
    return LOGGERS.create_from(options, default="none")


class Guarded:
    """Calls a logger's hooks; the first exception disables it with a warning."""

    def __init__(self, inner: RunLogger) -> None:
        self.inner = inner
        self.failed: str | None = None

    def implements(self, hook: str) -> bool:
        """Whether the logger does something in ``hook`` (so the run need not build its input)."""
        return self.failed is None and getattr(type(self.inner), hook) is not getattr(RunLogger, hook)

    def __getattr__(self, hook: str) -> Any:
        method = getattr(self.inner, hook)

        def call(*args: Any, **kwargs: Any) -> None:
            if self.failed is not None:
                return
            try:
                method(*args, **kwargs)
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                logger.warning("logger %r failed in %s and is switched off for this run (%s); the local files "
                               "are complete", self.inner.name, hook, self.failed)

        return call
