"""``servelab-serve``'s own checks of its command line, before Hydra composes anything."""
from __future__ import annotations

import sys

import pytest

from framework.server.command import EXIT_CONFIG_ERROR, cli


@pytest.mark.parametrize("flag", ["-m", "--multirun"])
def test_a_multirun_is_refused_in_one_line(flag, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["servelab-serve", flag, "+server.prot=1"])
    with pytest.raises(SystemExit) as stopped:
        cli()
    assert stopped.value.code == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: a server runs one configuration: leave -m/--multirun out"]
