"""``python -m framework.run [+policy=NAME] [backend=NAME] [workload=NAME] [key=value ...]``.

Composes ``conf/config.yaml`` with Hydra and runs one experiment per composed config (several with
``-m``) in Hydra's run directory (``outputs/DATE/TIME`` or ``multirun/DATE/TIME/N``): ``config.yaml``,
``workload.jsonl``, ``summary.json``, ``requests.csv``, ``steps.csv`` and plots. A multirun also writes
the comparison of its runs (``comparison.md``/``.csv``, ``runs.csv`` and figures) at its root; ``repeat=0,1,2`` (or a
swept ``workload.seed``) runs each configuration again, every configuration once before any a second time
(``overrides.interleave_repeats``), and the comparison averages its repeats. A folder used again
(``hydra.run.dir=DIR`` twice) is cleared of the earlier run's files and log when the job starts; one that a live run
holds (``recorder.claim_run_dir``) is refused as a configuration error, and nothing in it is touched (in a sweep:
reported at its end, which exits 1; a sweep's folder another live sweep holds is refused before any job).

Exit statuses: 2 for a configuration error (Hydra's own included, in a sweep too) or a part this
machine cannot run, printed as one line; any other failure keeps its traceback. 130 for Ctrl-C, 143
for SIGTERM: the run keeps what it measured, and a stopped sweep still gets its comparison. 1 for a
sweep with a failed job: the job is logged and marked ``failed``, the other jobs run and are compared (a sweep
whose every job its configuration refuses is refused before any job, with status 2; ``compare.sweep_refusals``).
A failed run's ``summary.json`` says ``failed``, with the error. A parallel sweep's parent
(``hydra/launcher=parallel``) forwards a signal to its workers and waits up to 30 s for their
summaries (a second signal stops the waiting); SIGKILLed, it leaves workers that stop their jobs as
SIGTERM does and end (``supervision.parent_watched``).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from contextlib import ExitStack, suppress
from pathlib import Path

import hydra
from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from framework.common.registry import UnavailableError
from framework.harness.compare import REFUSED_FILE, CompareCallback
from framework.harness.console import finished_lines
from framework.harness.experiment import clear_run_dir, run_experiment
from framework.harness.help import help_overrides
from framework.harness.overrides import (CONF_DIR, hidden_composition_error, hold_back_hydra_reports,
                                        hydra_error_line, interleave_repeats, legacy_overrides,
                                        non_string_group_overrides, null_group_overrides, restore_hydra_reports,
                                        skip_composed_jobs_check, swept_group_options)
from framework.harness.recorder import claim_run_dir
from framework.harness.supervision import (EXIT_INTERRUPTED, EXIT_TERMINATED, compare_stopped, mark, parent_watched,
                                           stop, stopped_status, terminate)

log = logging.getLogger("framework.run")


EXIT_CONFIG_ERROR = 2


def _run_name(hc: object) -> str | None:
    """A readable name for a sweep job: its overrides (``+policy=fcfs,workload.rate=4``)."""
    name = hc.job.override_dirname  # type: ignore[attr-defined]
    return name or None


def _start_afresh(cfg: DictConfig, run_dir: Path) -> None:
    """Clear what an earlier run left in the job's folder (``hydra.run.dir`` given again): its files, and the log
    Hydra appends to, so that nothing of that run's (its metrics in a failure's summary) mixes with this one's."""
    clear_run_dir(cfg, run_dir)
    folder = run_dir.resolve()
    for handler in logging.getLogger().handlers:
        # Opened for appending before the job started: truncated, it goes on at its new end.
        if isinstance(handler, logging.FileHandler) and handler.mode == "a" and \
                Path(handler.baseFilename).parent == folder:
            handler.flush()
            with suppress(FileNotFoundError):
                os.truncate(handler.baseFilename, 0)


#: Jobs this process has started; none when Hydra itself stopped the command (see ``cli``).
_jobs_started = 0


#: Set when a job of this process was interrupted: a parallel sweep's worker that picks up a job
#: queued before the interrupt stops it at once, as Ctrl-C stops the sweep in a single process.
_job_interrupted = False


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    # A parallel sweep's worker must not outlive its parent: SIGKILLed, that one stops none of its workers.
    with parent_watched():
        _job(cfg)


def _job(cfg: DictConfig) -> None:
    """One run (a sweep's job) in Hydra's job folder, held until it ends: exits as the module's docstring says."""
    global _jobs_started
    _jobs_started += 1
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweep = hc.mode == RunMode.MULTIRUN
    with ExitStack() as held:
        try:
            # Before the folder is cleared: another live run's files, log and summary there stay as they are.
            held.enter_context(claim_run_dir(run_dir, "hydra.sweep.dir" if sweep else "hydra.run.dir"))
        except ValueError as exc:
            print(f"error: {exc}{'; the sweep goes on' if sweep else ''}", file=sys.stderr)
            if not sweep:
                sys.exit(EXIT_CONFIG_ERROR)
            # Counted at the sweep's end (CompareCallback), from whichever process ran the job.
            (Path(hc.sweep.dir) / REFUSED_FILE.format(hc.job.num)).write_text(f"{run_dir}: {exc}\n")
            return
        _held_job(cfg, hc, run_dir)


def _held_job(cfg: DictConfig, hc: HydraConf, run_dir: Path) -> None:
    """``_job`` in the folder it holds."""
    global _job_interrupted
    _start_afresh(cfg, run_dir)
    previous = {}
    with suppress(ValueError):  # not the main thread (a launcher running jobs in threads): leave them
        for sig in (signal.SIGTERM, *_submitit_signal()):
            previous[sig] = signal.signal(sig, terminate)
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
    except SystemExit:
        mark(run_dir, "interrupted")  # exited from within (a launcher's handler): it keeps what was measured
        raise
    except Exception as exc:
        mark(run_dir, "failed", exc)
        # Configuration errors (run_experiment's ValueError), parts this machine cannot run and
        # configs OmegaConf cannot read (~workload, a broken interpolation) need no traceback.
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # Where the files are; whether the times are simulated; the wandb sync line.
    print("\n".join(finished_lines(run_dir, summary, bool(cfg.progress))))
    if summary.get("interrupted"):
        _job_interrupted = True
        print(f"interrupted: what was measured is in {run_dir}", file=sys.stderr)
        sys.exit(stopped_status())


def _submitit_signal() -> list[signal.Signals]:
    """In a job Submitit runs, its signal before a SLURM time limit or a preemption (``SUBMITIT_PREEMPT_SIGNAL``,
    USR2 by default), which stops the run as SIGTERM does: Submitit's own handler would fail the job, or requeue
    it to start the measurement over, the metrics measured so far unwritten."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return []
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper()
    sig = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
    return [sig] if isinstance(sig, signal.Signals) else []


def _hydra_config_error(exc: SystemExit) -> bool:
    """Whether Hydra's exit 1 reported a configuration error: the exit's context (Hydra exits in its
    ``except``) is a composition or override error, or a single run failed before its job started. A
    started sweep counts as started jobs: they may all have run in joblib's worker processes."""
    if isinstance(exc.__context__, (CompactHydraException, OmegaConfBaseException)):
        return True
    multirun = any(a in ("-m", "--multirun") for a in sys.argv[1:]) or CompareCallback.multirun_started
    return _jobs_started == 0 and not multirun


def cli() -> None:
    """``python -m framework.run`` and the ``servelab-run`` script."""
    argv, error = null_group_overrides(swept_group_options(legacy_overrides(sys.argv)[1:]))
    sys.argv = [sys.argv[0], *argv, *help_overrides(argv)]  # --help: this project's page
    error = error or non_string_group_overrides(argv)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    # SIGTERM stops the whole command as Ctrl-C does: outside a job its default action would kill
    # the process with no comparison, leaving a parallel sweep's workers orphaned. ``stop`` forwards
    # either signal to those workers.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    interleave_repeats()  # repeat=0,1,2: every configuration once, then each again, not back to back
    skip_composed_jobs_check()  # the sweep's check (CompareCallback) composed them
    hold_back_hydra_reports()
    try:
        main()
    except KeyboardInterrupt:  # outside a run (composing the config, between sweep jobs, comparing)
        print("interrupted", file=sys.stderr)
        compare_stopped()
        sys.exit(stopped_status())
    except (HydraException, OmegaConfBaseException) as exc:
        if not restore_hydra_reports():  # a job's, or the user's own HYDRA_FULL_ERROR: Hydra's traceback
            raise
        line = hydra_error_line(exc)
        if line.startswith(("Ambiguous value for argument", "Sweep parameters")):
            line = hidden_composition_error(argv) or line
        print(f"error: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    except ValueError as exc:
        # Hydra checks its own flags (-m with --cfg, --info or -r) before its error reporting
        # starts, so their ValueError reaches here; a job's own errors never do.
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
            # failed, and Hydra printed the error. The jobs it took down are marked failed.
            compare_stopped(exc.__context__ or RuntimeError(f"the sweep failed (status {exc.code})"))
        raise
    finally:
        restore_hydra_reports()  # a caller in this process (a test, a script) gets its environment back
