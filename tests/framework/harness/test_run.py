"""``python -m framework.run``: its command line, checked before anything is composed or built."""
import os
import signal
import sys

import pytest
from hydra.errors import HydraException

from framework.harness import run
from tests.hydra_support import root_log_handlers_restored


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """``run.cli`` installs its own SIGINT and SIGTERM handlers and Hydra's root log handlers: each test leaves the
    process's as they were."""
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with root_log_handlers_restored():
        yield
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])


@pytest.mark.parametrize("argv, message", [
    (["backend=5"], "error: backend=5: 5 is not an option of the config group 'backend'; its options: "),
    (["workload=null"], "error: workload=null: the config group 'workload' needs one of its options: "),
])
def test_a_group_override_naming_no_option_is_one_line_before_hydra_runs(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["framework.run", *argv])
    monkeypatch.setattr(run, "main", lambda: pytest.fail("Hydra ran"))
    with pytest.raises(SystemExit) as exit_info:
        run.cli()
    err = capsys.readouterr().err
    assert exit_info.value.code == run.EXIT_CONFIG_ERROR and err.startswith(message) and err.count("\n") == 1


@pytest.mark.parametrize("env, expected", [
    ({}, []),
    ({"SUBMITIT_EXECUTOR": "slurm"}, [signal.SIGUSR2]),
    ({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "usr1"}, [signal.SIGUSR1]),
    ({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "SIGUSR1"}, [signal.SIGUSR1]),
    ({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "NOSUCH"}, []),
])
def test_a_submitit_job_stops_on_its_preemption_signal_by_either_spelling(monkeypatch, env, expected):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert run._submitit_signal() == expected


@pytest.mark.parametrize("flag", ["-m", "--multirun"])
def test_a_sweep_whose_jobs_ran_elsewhere_failing_is_no_configuration_error(monkeypatch, flag):
    monkeypatch.setattr(sys, "argv", ["framework.run", flag, "engine.seed=1,2"])
    monkeypatch.setattr(run, "_jobs_started", 0)
    monkeypatch.setattr(run.CompareCallback, "multirun_started", False)  # as in a process of its own
    assert not run._hydra_config_error(SystemExit(1))
    monkeypatch.setattr(sys, "argv", ["framework.run", "engine.seed=1"])
    assert run._hydra_config_error(SystemExit(1))


def test_cli_in_a_process_leaves_the_users_own_hydra_full_error_set(monkeypatch, capsys):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["framework.run", "engine.bogus=1", "executor=sim"])
    with pytest.raises(HydraException):  # theirs: Hydra's own report, not one line
        run.cli()
    assert os.environ.get("HYDRA_FULL_ERROR") == "1"


def test_cli_in_a_process_leaves_its_environment_as_it_was(monkeypatch, capsys):
    # It holds back Hydra's reports through HYDRA_FULL_ERROR while composing; a later command's subprocesses
    # would take that for the user's own setting.
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["framework.run", "engine.bogus=1", "executor=sim"])
    with pytest.raises(SystemExit) as exit_info:
        run.cli()
    assert exit_info.value.code == 2 and "error: engine: unknown key bogus" in capsys.readouterr().err
    assert "HYDRA_FULL_ERROR" not in os.environ
