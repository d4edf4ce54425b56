"""``python -m framework.run [+policy=NAME] [backend=NAME] [workload=NAME] [key=value ...]``.

Composes ``conf/config.yaml`` with Hydra and runs one experiment per composed config (several
with ``-m``), writing its files to Hydra's run directory (``outputs/DATE/TIME`` or
``multirun/DATE/TIME/N``): ``config.yaml``, ``workload.jsonl``, ``summary.json``,
``requests.csv``, ``steps.csv`` and the plots. A multirun also gets a comparison of its runs
(``comparison.md``/``.csv`` and plots) at its root.

A configuration error (an unknown policy, a bad option value, a config the run cannot read) or a
part that cannot run on this machine (flash_attn without CUDA) prints one clear line and exits
with status 2; any other failure keeps its traceback. Either way the run's ``summary.json`` says
``failed``, with the error. Errors Hydra reports itself (an unknown config group option such as
``+policy=NAME``, a key the config does not have, an override it cannot parse) come before any
run directory exists; they exit with status 2 too, in a sweep as in a single run. Ctrl-C stops
the run, keeps what it measured and exits with status 130 (SIGTERM, as a batch scheduler sends
at its time limit, likewise, with status 143); a sweep stopped so also gets the comparison of
the runs it made. A parallel sweep's parent (``hydra/launcher=parallel``) that gets the signal
alone (``kill -INT PID`` from a scheduler or a supervisor) forwards it to its workers and waits,
30 s at most, for their jobs to write their summaries (a second signal stops the waiting); a
terminal's Ctrl-C, which reaches the workers too, waits likewise. In a sweep, a job that fails
is logged (a configuration error in one line, anything else with its traceback) and marked
``failed`` in its summary; the other jobs run, the comparison is written, and the sweep exits
with status 1.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from framework.common.registry import UnavailableError
from framework.harness.compare import CompareCallback
from framework.harness.experiment import run_experiment
from framework.harness.overrides import CONF_DIR, legacy_overrides, non_string_group_overrides, null_group_overrides
from framework.harness.supervision import (EXIT_INTERRUPTED, EXIT_TERMINATED, compare_stopped, mark, stop,
                                           stopped_status, terminate)

log = logging.getLogger("framework.run")


EXIT_CONFIG_ERROR = 2


def _run_name(hc: object) -> str | None:
    """A readable name for a sweep job: its overrides (``+policy=fcfs,workload.rate=4``)."""
    name = hc.job.override_dirname  # type: ignore[attr-defined]
    return name or None


#: Jobs this process has started; none when Hydra itself stopped the command (see ``cli``).
_jobs_started = 0


#: Set when a job of this process was interrupted: a parallel sweep's worker that picks up a job
#: queued before the interrupt stops it at once, as Ctrl-C stops the sweep in a single process.
_job_interrupted = False


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    global _jobs_started, _job_interrupted
    _jobs_started += 1
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread (a launcher running jobs in threads): leave it
        previous = None
    try:
        if _job_interrupted and multiprocessing.parent_process() is not None:
            raise KeyboardInterrupt  # a worker's next job, queued before its last one was interrupted
        group = str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
        summary = run_experiment(cfg, run_dir, run_name=_run_name(hc), group=group)
    except KeyboardInterrupt:
        # Ctrl-C outside the serving loop (which handles its own): while the engine was built,
        # or a second one while the plots were drawn. What was measured is written already.
        _job_interrupted = True
        measured = mark(run_dir, "interrupted")
        print(f"interrupted: {'what was measured is' if measured else 'nothing was measured yet; the run is'} "
              f"in {run_dir}", file=sys.stderr)
        sys.exit(stopped_status())
    except Exception as exc:
        mark(run_dir, "failed", exc)
        # run_experiment raises ValueError only for configuration errors; UnavailableError is a
        # part that cannot run on this machine; an OmegaConf error is a config it cannot read (a
        # group dropped with ~workload, an interpolation that does not resolve). None needs a
        # traceback to be understood.
        config_error = isinstance(exc, (ValueError, UnavailableError, OmegaConfBaseException))
        if config_error:
            log.debug("configuration error", exc_info=True)
        if hc.mode == RunMode.MULTIRUN:
            # One failed job must not cost the sweep its other runs and its comparison (Hydra stops
            # a sweep at the first exception, SystemExit included): the job's summary.json says
            # "failed", and the sweep exits non-zero at the end (CompareCallback).
            if config_error:
                log.error("run failed (%s): error: %s; the sweep goes on", run_dir, exc)
            else:
                log.exception("run failed (%s); the sweep goes on", run_dir)
            return
        if config_error:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if summary.get("interrupted"):
        _job_interrupted = True
        print(f"interrupted: what was measured is in {run_dir}", file=sys.stderr)
        sys.exit(stopped_status())


def _hydra_config_error(exc: SystemExit) -> bool:
    """Whether Hydra's exit 1 was a configuration error it reported itself. Hydra exits inside
    the ``except`` that caught the error, so the exit's context is that error: a composition or
    override error (an unknown option, a key not in the config, an unparsable override), in a
    sweep as in a single run (a sweep's jobs may run in other processes, but their configs are
    composed where Hydra reports them). Any other error before a single run's job started is one
    too (a Hydra internal such as a malformed defaults entry). A sweep's jobs may all have run in
    other processes (joblib's workers), so a sweep that started counts as started jobs, whether
    ``-m`` or a named experiment's ``hydra.mode: MULTIRUN`` made it one."""
    if isinstance(exc.__context__, (CompactHydraException, OmegaConfBaseException)):
        return True
    multirun = any(a in ("-m", "--multirun") for a in sys.argv[1:]) or CompareCallback.multirun_started
    return _jobs_started == 0 and not multirun


def cli() -> None:
    """``python -m framework.run`` and the ``servelab-run`` script."""
    argv, error = null_group_overrides(legacy_overrides(sys.argv)[1:])
    sys.argv = [sys.argv[0], *argv]
    error = error or non_string_group_overrides(argv)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    # SIGTERM stops the whole command as Ctrl-C does, not only a job under way: outside a job
    # (composing, between sweep jobs, a joblib sweep's parent waiting on its workers) its default
    # action would kill the process on the spot, with no comparison and, in a parallel sweep, the
    # workers left running as orphans with summaries that say "running". Either signal, sent to a
    # parallel sweep's parent alone (a scheduler's, a supervisor's), reaches its workers (stop).
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        main()
    except KeyboardInterrupt:  # outside a run (composing the config, between sweep jobs, comparing)
        print("interrupted", file=sys.stderr)
        compare_stopped()
        sys.exit(stopped_status())
    except ValueError as exc:
        # Hydra checks its command-line flags (-m with --cfg, --info or -r: "Only one of --run,
        # --multirun, --cfg, --info and --shell_completion can be specified") before it reports
        # errors itself, so that one escaped as a traceback. A job's own errors never reach here.
        if _jobs_started or CompareCallback.multirun_started:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    except SystemExit as exc:
        if exc.code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            compare_stopped()
        # Hydra prints its own errors and exits 1: configuration errors get the status every
        # other one gets.
        elif exc.code == 1 and _hydra_config_error(exc):
            sys.exit(EXIT_CONFIG_ERROR)
        elif exc.code and CompareCallback.sweep_dir is not None:
            # The sweep neither ended (its end clears sweep_dir) nor was stopped: its launcher
            # failed, and Hydra printed the error. The jobs it took down say "running" no more.
            compare_stopped(exc.__context__ or RuntimeError(f"the sweep failed (status {exc.code})"))
        raise
