"""Test helpers for runs composed from the project's Hydra configs and for the CSVs they write."""
from __future__ import annotations

import contextlib
import csv
import logging
from collections.abc import Iterator
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from framework.harness.plugin_configs import store_plugin_options

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_config(*overrides: str, return_hydra_config: bool = False) -> DictConfig:
    """``conf/config.yaml`` with ``overrides``, as ``python -m framework.run`` composes it."""
    store_plugin_options(CONF)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)


def read_csv(path: str | Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@contextlib.contextmanager
def root_log_handlers_restored() -> Iterator[None]:
    """A command line run in this process leaves Hydra's root log handlers, one writing to the test's captured
    output, which is closed once the test ends: those it added are removed and closed on leaving."""
    root = logging.getLogger()
    before = root.handlers[:]
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            if handler not in before:
                root.removeHandler(handler)
                handler.close()
