"""Test helpers for runs composed from the project's Hydra configs and for the CSVs they write."""
from __future__ import annotations

import csv
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
