"""Weights & Biases logger: a run's resolved config, step timeline, summary, request table and plots.

The mode is the logger config's ``mode``, else ``WANDB_MODE``, else online when an API key is
configured (``WANDB_API_KEY`` or a ``~/.netrc`` / ``$NETRC`` entry for the W&B host), else offline.
Offline runs land in ``<run dir>/wandb/offline-run-*`` (``wandb sync`` uploads them). A failed online
start logs offline instead; a later failure switches the logger off (``run_logger.Guarded``).
"""
from __future__ import annotations

import logging
import netrc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from framework.common.config import check_positive_int, is_finite_number
from framework.harness.run_logger import LOGGERS, RunLogger

logger = logging.getLogger(__name__)

MODES = ("online", "offline", "disabled")


def resolve_mode(mode: str | None) -> str:
    """The W&B mode a run uses (see the module docstring for the order)."""
    if mode is not None:
        return mode
    env = os.environ.get("WANDB_MODE")
    if env:
        # W&B's legacy names: "dryrun" is offline, "run" online (and falls back as online does).
        return {"dryrun": "offline", "run": "online"}.get(env, env)
    return "online" if _has_api_key() else "offline"


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:  # W&B, like curl, reads the file NETRC names, else ~/.netrc
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _name(option: str, value: Any) -> str | None:
    """A project, entity, group or tag name as W&B takes it: a string. Hydra reads
    ``logger.group=2024`` as an int, which W&B refuses at start (and the run would go unlogged)."""
    if value is None or isinstance(value, str):
        return value
    if is_finite_number(value):
        return str(value)
    raise ValueError(f"{option} must be a name (a string), got {value!r}")


@LOGGERS.register("wandb")
class WandbLogger(RunLogger):
    """Options: ``project``, ``entity``, ``group`` (default: the sweep's folder), ``tags``, ``mode``
    (online / offline / disabled; null: as the module says), ``init_timeout`` (seconds),
    ``max_step_rows``: each time this many step rows were logged, the stride over steps doubles (a
    log call costs ~0.4 ms; ``steps.csv`` keeps every step); null logs every step."""

    def __init__(self, project: str = "servelab", entity: str | None = None, group: str | None = None,
                 tags: list[str] | None = None, mode: str | None = None, init_timeout: float = 60.0,
                 max_step_rows: int | None = 5000) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"logger.mode must be one of {', '.join(MODES)} or null, got {mode!r}")
        check_positive_int("logger.max_step_rows", max_step_rows, optional=True)
        if not is_finite_number(init_timeout) or init_timeout <= 0:
            raise ValueError(f"logger.init_timeout must be a number of seconds > 0, got {init_timeout!r}")
        if tags is not None and (isinstance(tags, str) or not isinstance(tags, Sequence)):
            # list("abc") would tag the run 'a', 'b' and 'c'.
            raise ValueError(f"logger.tags must be a list of tags (logger.tags=[baseline] or [a,b]) or null, "
                             f"got {tags!r}")
        self.max_step_rows = max_step_rows
        self._steps_seen = self._steps_logged = 0
        self._stride = 1
        self.project, self.entity = _name("logger.project", project), _name("logger.entity", entity)
        self.group = _name("logger.group", group)
        self.tags = [_name("logger.tags", tag) for tag in tags or []]
        self.mode, self.init_timeout = mode, init_timeout
        self.run: Any = None
        self._failed = False

    def start(self, config: dict[str, Any], run_dir: Path, run_name: str, group: str | None = None) -> None:
        import wandb

        mode = resolve_mode(self.mode)
        kwargs = dict(project=self.project, entity=self.entity, group=self.group or group, tags=self.tags, name=run_name,
                      config=config, dir=str(run_dir))
        settings = wandb.Settings(init_timeout=self.init_timeout, console="off", silent=True, disable_git=True)
        try:
            self.run = wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as exc:
            if mode != "online":
                raise
            logger.warning("W&B online start failed (%s); logging offline to %s/wandb instead", exc, run_dir)
            self.run = wandb.init(mode="offline", settings=settings, **kwargs)
        # Plot the timeline against run time rather than W&B's own step counter.
        self.run.define_metric("step/time_s")
        self.run.define_metric("step/*", step_metric="step/time_s")

    def log_step(self, row: dict[str, Any]) -> None:
        self._steps_seen += 1
        if (self._steps_seen - 1) % self._stride:
            return
        self.run.log({f"step/{k}": v for k, v in row.items()})
        self._steps_logged += 1
        if self.max_step_rows is not None and self._steps_logged >= self.max_step_rows:
            self._stride *= 2  # from here on every other of the steps logged so far
            self._steps_logged //= 2

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        self._failed = summary.get("status") == "failed"  # W&B then shows the run as failed

    def log_requests(self, columns: list[str], rows: list[dict[str, Any]]) -> None:
        import wandb

        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self.run.log({"requests": table})

    def log_plots(self, plots: dict[str, Path]) -> None:
        import wandb

        if plots:
            self.run.log({f"plots/{name}": wandb.Image(str(path)) for name, path in plots.items()})

    def finish(self, interrupted: bool) -> None:
        if self.run is not None:
            self.run.summary["interrupted"] = interrupted
            self.run.finish(exit_code=1 if self._failed else 130 if interrupted else 0)
            self.run = None
