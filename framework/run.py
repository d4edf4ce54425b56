"""``python -m framework.run [+policy=NAME] [backend=NAME] [workload=NAME] [key=value ...]``.

Composes ``conf/config.yaml`` with Hydra and runs one experiment per composed config (several
with ``-m``), writing its files to Hydra's run directory (``outputs/DATE/TIME`` or
``multirun/DATE/TIME/N``): ``config.yaml``, ``workload.jsonl``, ``summary.json``,
``requests.csv``, ``steps.csv`` and the plots. A multirun also gets a comparison of its runs
(``comparison.md``/``.csv`` and plots) at its root.

A configuration error (an unknown policy, a bad option value) prints one clear line and exits
with status 2; Ctrl-C stops the run, keeps what it measured and exits with status 130. In a
sweep, a job that fails (a configuration error included) is logged and marked ``failed`` in
its summary; the other jobs run, the comparison is written, and the sweep exits with status 1.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from framework.experiment import engine_config, run_experiment
from framework.recorder import write_summary

__all__ = ["engine_config", "main"]

log = logging.getLogger("framework.run")

EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130


def _run_name(hc: object) -> str | None:
    """A readable name for a sweep job: its overrides (``+policy=fcfs,workload.rate=4``)."""
    name = hc.job.override_dirname  # type: ignore[attr-defined]
    return name or None


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    try:
        group = str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
        summary = run_experiment(cfg, hc.runtime.output_dir, run_name=_run_name(hc), group=group)
    except Exception as exc:
        if hc.mode == RunMode.MULTIRUN:
            # One failed job must not cost the sweep its other runs and its comparison (Hydra stops
            # a sweep at the first exception, SystemExit included): the job's summary.json says
            # "failed", and the sweep exits non-zero at the end (CompareCallback).
            _mark_failed(Path(hc.runtime.output_dir), exc)
            log.exception("run failed (%s); the sweep goes on", hc.runtime.output_dir)
            return
        if isinstance(exc, ValueError):  # run_experiment raises these only for configuration errors
            log.debug("configuration error", exc_info=True)
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
        raise
    if summary.get("interrupted"):
        print(f"interrupted: what was measured is in {hc.runtime.output_dir}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def _mark_failed(run_dir: Path, exc: Exception) -> None:
    """Make the run's summary.json say ``failed``, also when the run failed before writing one
    (a configuration error, building the engine, generating the workload)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    if summary.get("status") != "failed":
        run_dir.mkdir(parents=True, exist_ok=True)
        write_summary(run_dir, {**summary, "status": "failed", "interrupted": False,
                                "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
