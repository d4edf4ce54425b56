"""``servelab-serve``'s exit status: its own checks of its command line, a configuration error, a failure."""
from __future__ import annotations

import signal
import sys

import pytest

from framework.server import command
from framework.server.command import EXIT_CONFIG_ERROR, cli
from tests.hydra_support import root_log_handlers_restored


@pytest.mark.parametrize("flag", ["-m", "--multirun"])
def test_a_multirun_is_refused_in_one_line(flag, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["servelab-serve", flag, "+server.prot=1"])
    with pytest.raises(SystemExit) as stopped:
        cli()
    assert stopped.value.code == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: a server runs one configuration: leave -m/--multirun out"]


def run_cli(monkeypatch, tmp_path, *overrides):
    """``cli()`` in this process: its exit status; the SIGTERM handler and root log handlers it installs are gone."""
    monkeypatch.setattr(sys, "argv", ["servelab-serve", *overrides, f"hydra.run.dir={tmp_path}"])
    monkeypatch.setattr(command, "_built", False)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with root_log_handlers_restored(), pytest.raises(SystemExit) as stopped:
            cli()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return stopped.value.code


def test_a_configuration_error_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    assert run_cli(monkeypatch, tmp_path, "executor=sim") == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.strip().splitlines()[-1:] == [
        "error: executor=sim runs on simulated time; a server answers clients in wall time: leave executor out "
        "(the real forward pass)"]


def test_a_server_that_fails_while_serving_exits_1_not_as_a_configuration_error(monkeypatch, tmp_path, capsys):
    class Failing:
        model_name, url = "m", "http://127.0.0.1:1"

        def __init__(self, cfg, run_dir):
            pass

        def serve(self):
            raise RuntimeError("the engine broke")

    monkeypatch.setattr(command, "LabServer", Failing)
    assert run_cli(monkeypatch, tmp_path) == 1
