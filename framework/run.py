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

import json
import logging
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from framework.compare import CompareCallback, compare_stopped_sweep
from framework.experiment import engine_config, run_experiment
from framework.plugin_configs import store_plugin_options
from framework.recorder import write_summary
from framework.registry import UnavailableError

__all__ = ["engine_config", "main"]

log = logging.getLogger("framework.run")

EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a command stopped by Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143

#: Set when SIGTERM stopped the run, for its exit status.
_terminated = False


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (a batch scheduler's time limit, ``kill``, a sweep launcher stopping its workers)
    stops a run as Ctrl-C does, so it keeps what it measured, instead of dying mid-write."""
    global _terminated
    _terminated = True
    raise KeyboardInterrupt("SIGTERM")


def _stopped() -> int:
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


def _started_jobs(sweep_dir: Path) -> list[Path]:
    """The folders of the sweep's jobs that have started: Hydra writes a job's ``.hydra`` folder
    before the job's function runs, so a folder with one and no ``summary.json`` is a job still
    building its engine or warming up (``run_experiment`` writes its ``running`` summary next)."""
    return sorted(path.parent for path in sweep_dir.glob("*/.hydra"))


def _running(sweep_dir: Path) -> bool:
    """Whether a job of the sweep has yet to write how it ended: its summary says ``running`` (or
    is half written), or it started and has written none yet."""
    if any(not (job / "summary.json").exists() for job in _started_jobs(sweep_dir)):
        return True
    for path in sweep_dir.glob("*/summary.json"):
        try:
            if json.loads(path.read_text()).get("status") == "running":
                return True
        except (OSError, ValueError):
            return True
    return False


def _stop(signum: int, frame: object) -> None:
    """The command's SIGINT and SIGTERM handler: a KeyboardInterrupt, as Python's Ctrl-C handler
    raises (SIGTERM also sets the exit status 143). In a parallel sweep's parent it first forwards
    the signal to the workers and waits (``WORKERS_GRACE_S`` at most, or until the next signal)
    until every job that started has a summary that says how it ended (``_running``), one still
    building its engine included: joblib kills its workers with SIGKILL as soon as the
    parent is interrupted, and a job killed so keeps no metrics. A worker stops its job as on
    Ctrl-C and writes its summary. A terminal's Ctrl-C reaches the workers too, and the forwarded
    signal is dropped as a repeat (``framework.experiment``); the waiting then spares them the
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


def _run_name(hc: object) -> str | None:
    """A readable name for a sweep job: its overrides (``+policy=fcfs,workload.rate=4``)."""
    name = hc.job.override_dirname  # type: ignore[attr-defined]
    return name or None


#: conf/ by its absolute path: Hydra resolves a relative one against the calling module's package
#: when run as a console script (``servelab-run``), and conf/ is not a package.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
#: ``GROUP/NAME`` options of parts from installed packages (+policy=NAME for such a policy).
PLUGIN_OPTIONS = store_plugin_options(CONF_DIR)


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
        previous = signal.signal(signal.SIGTERM, _terminate)
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
        measured = _mark(run_dir, "interrupted")
        print(f"interrupted: {'what was measured is' if measured else 'nothing was measured yet; the run is'} "
              f"in {run_dir}", file=sys.stderr)
        sys.exit(_stopped())
    except Exception as exc:
        _mark(run_dir, "failed", exc)
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
        sys.exit(_stopped())


def _mark(run_dir: Path, status: str, exc: Exception | None = None) -> bool:
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


def _legacy_overrides(argv: list[str]) -> list[str]:
    """``+executor=NAME`` (from before executor had a default) as ``executor=NAME``; Hydra would
    refuse it as a second value for the group. One difference from then: an ``+experiment``
    file's engine settings now win over the executor's whatever the order on the command line
    (the executor is composed first, from the defaults list)."""
    return [a[1:] if a.startswith("+executor=") else a for a in argv]


def _compare_stopped_sweep(failure: BaseException | None = None) -> None:
    """A sweep stopped by Ctrl-C still gets the comparison of the runs it made. A job whose summary
    still says ``running``, or that started and wrote none, was killed where no handler runs
    (joblib's launcher SIGKILLs its workers once the parent is interrupted: the parent waits for
    their summaries first, see ``_stop``, but not past ``WORKERS_GRACE_S`` or a second Ctrl-C):
    it is marked ``interrupted``;
    or ``failed``, with ``failure``, when the launcher itself failed mid-sweep (a joblib worker
    killed by the OS, which takes the other workers' jobs down with it)."""
    sweep_dir = CompareCallback.sweep_dir
    if sweep_dir is not None:
        jobs = {path.parent for path in sweep_dir.glob("*/summary.json")} | set(_started_jobs(sweep_dir))
        for job in sorted(jobs):
            summary = job / "summary.json"
            if failure is None:
                _mark(job, "interrupted")  # leaves a summary that says how its run ended
            elif not summary.exists() or json.loads(summary.read_text()).get("status") == "running":
                _mark(job, "failed", failure)
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


def _null_group_overrides(argv: list[str]) -> tuple[list[str], str | None]:
    """``GROUP=null`` overrides, which Hydra fails on with a traceback from its own internals
    ("Config group override must be a string or a list"). For a group whose default in
    ``conf/config.yaml`` is null (``executor``) it means that default: the override is dropped,
    with any earlier choice for the group (the last value given wins, as for any other). Any
    other group of conf/ needs one of its options (or ``~GROUP`` to drop an optional one).
    Returns the arguments to hand Hydra, and the error naming those options, or None."""
    conf = Path(CONF_DIR)
    defaults = (yaml.safe_load((conf / "config.yaml").read_text()) or {}).get("defaults") or []
    null_defaults = {g for d in defaults if isinstance(d, dict) for g, v in d.items() if v is None}
    out: list[str] = []
    for arg in argv:
        group, sep, value = arg.partition("=")
        if not (sep and value == "null"):
            out.append(arg)
        elif group in null_defaults:
            out = [a for a in out if a.partition("=")[0] != group]
        # Hydra's own groups (hydra/launcher=...) have options outside conf/: left to Hydra.
        elif "/" not in group and (conf / group.lstrip("+")).is_dir():
            name = group.lstrip("+")
            return out, f"{arg}: the config group '{name}' needs one of its options: {', '.join(_group_options(name))}"
        else:
            out.append(arg)
    return out, None


def _non_string_group_overrides(argv: list[str]) -> str | None:
    """The error naming a conf/ group's options for an override that gives the group a value its
    override grammar reads as no name (``backend=5``, ``logger=true``, ``workload=1.5``, a sweep
    ``backend=5,naive``, a list ``backend=[naive,5]``), which Hydra fails on with a traceback from
    its own internals ("Config group override must be a string or a list"); None when there is
    none. Overrides Hydra cannot parse, and its own groups, are left to Hydra's own errors. Runs
    after ``_null_group_overrides``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    conf = Path(CONF_DIR)
    parser = None
    for arg in argv:
        group = arg.partition("=")[0].lstrip("+~")
        if "/" in group or not group or not (conf / group).is_dir():
            continue
        parser = parser or OverridesParser.create()
        try:
            override = parser.parse_override(arg)
            if override.is_delete():
                continue
            value = override.value()
            values = list(override.sweep_iterator()) if override.is_sweep_override() else (
                value if isinstance(value, list) else [value])
        except Exception:  # unparsable, or a sweep only Hydra expands (glob): Hydra's to report
            continue
        # A plain GROUP=null is gone (_null_group_overrides), so a null here is one value of a sweep
        # or a list (executor=null,sim), which a job cannot take as the group's default. A mapping
        # merges into the group's node, as Hydra reports.
        bad = [v for v in values if not isinstance(v, (str, dict))]
        if bad:
            return (f"{arg}: {json.dumps(bad[0])} is not an option of the config group '{group}'; "
                    f"its options: {', '.join(_group_options(group))}")
    return None


def _group_options(group: str) -> list[str]:
    """The options of conf/ group ``group``: its files', and those installed plugins add (an
    installed plugin's option is one of the group's as much as a file's is)."""
    return sorted({p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")}
                  | {o.partition("/")[2] for o in PLUGIN_OPTIONS if o.partition("/")[0] == group})


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
    argv, error = _null_group_overrides(_legacy_overrides(sys.argv)[1:])
    sys.argv = [sys.argv[0], *argv]
    error = error or _non_string_group_overrides(argv)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    # SIGTERM stops the whole command as Ctrl-C does, not only a job under way: outside a job
    # (composing, between sweep jobs, a joblib sweep's parent waiting on its workers) its default
    # action would kill the process on the spot, with no comparison and, in a parallel sweep, the
    # workers left running as orphans with summaries that say "running". Either signal, sent to a
    # parallel sweep's parent alone (a scheduler's, a supervisor's), reaches its workers (_stop).
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        main()
    except KeyboardInterrupt:  # outside a run (composing the config, between sweep jobs, comparing)
        print("interrupted", file=sys.stderr)
        _compare_stopped_sweep()
        sys.exit(_stopped())
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
            _compare_stopped_sweep()
        # Hydra prints its own errors and exits 1: configuration errors get the status every
        # other one gets.
        elif exc.code == 1 and _hydra_config_error(exc):
            sys.exit(EXIT_CONFIG_ERROR)
        elif exc.code and CompareCallback.sweep_dir is not None:
            # The sweep neither ended (its end clears sweep_dir) nor was stopped: its launcher
            # failed, and Hydra printed the error. The jobs it took down say "running" no more.
            _compare_stopped_sweep(exc.__context__ or RuntimeError(f"the sweep failed (status {exc.code})"))
        raise


if __name__ == "__main__":
    cli()
