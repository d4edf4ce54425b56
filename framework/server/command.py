"""``python -m framework.serve [key=value ...]``: the run command's Hydra overrides, served over HTTP until stopped.

Composes ``conf/config.yaml`` as ``framework.run`` does (the ``workload`` node is unused: clients are the workload)
and serves vLLM's OpenAI-compatible API on ``server.host:server.port`` (docs/server.md). SIGINT or SIGTERM aborts
what is in flight and stops it, exit 0, with ``config.yaml``, ``requests.csv``, ``steps.csv`` and ``summary.json``
of what it served in Hydra's run directory. A configuration error, an address already taken, or a run directory
another live run holds is one line and exit 2, before the model is loaded.
"""
from __future__ import annotations

import logging
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from framework.common.registry import UnavailableError
from framework.harness.overrides import (CONF_DIR, hold_back_hydra_reports, hydra_error_line, legacy_overrides,
                                        non_string_group_overrides, null_group_overrides, restore_hydra_reports)
from framework.harness.recorder import claim_run_dir
from framework.harness.report import format_summary
from framework.harness.supervision import stopped_status, terminate
from framework.server.server import LabServer

log = logging.getLogger("framework.serve")

EXIT_CONFIG_ERROR = 2

#: Whether the server was built: after that, Hydra's exit status 1 is no configuration error.
_built = False


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    global _built
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with ExitStack() as held:
        try:
            # Taken before the folder is cleared, held until the server stops: another live run's files stay intact.
            held.enter_context(claim_run_dir(run_dir))
            server = LabServer(cfg, run_dir)
        except (ValueError, UnavailableError, OmegaConfBaseException) as exc:
            log.debug("configuration error", exc_info=True)
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
        _built = True
        print(f"serving {server.model_name} on {server.url} (Ctrl-C to stop); run dir {run_dir}", file=sys.stderr,
              flush=True)
        summary = server.serve()
    print(format_summary(summary, f"served {summary['num_requests']} requests ({server.model_name})"))


def cli() -> None:
    """``python -m framework.serve`` and the ``servelab-serve`` script."""
    argv, error = null_group_overrides(legacy_overrides(sys.argv)[1:])
    error = error or non_string_group_overrides(argv)
    if error is None and any(a in ("-m", "--multirun") for a in argv):
        error = "a server runs one configuration: leave -m/--multirun out"
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    sys.argv = [sys.argv[0], *argv]
    signal.signal(signal.SIGTERM, terminate)  # while loading: stop as Ctrl-C does (serving takes over both)
    hold_back_hydra_reports()
    try:
        main()
    except KeyboardInterrupt:  # while the model was loading or warming up: nothing was served
        print("interrupted", file=sys.stderr)
        sys.exit(stopped_status())
    except (HydraException, OmegaConfBaseException) as exc:
        if not restore_hydra_reports():  # a job's, or the user's own HYDRA_FULL_ERROR: Hydra's traceback
            raise
        print(f"error: {hydra_error_line(exc)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    except SystemExit as exc:
        if exc.code == 1 and not _built:  # Hydra's own composition or override error, printed by Hydra
            sys.exit(EXIT_CONFIG_ERROR)
        raise
    finally:
        restore_hydra_reports()  # a caller in this process (a test, a script) gets its environment back
