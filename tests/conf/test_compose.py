"""Every YAML file under conf/ composes, and every group option builds a working engine on CPU."""
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from framework.engine import LLMEngine
from framework.run import engine_config

CONF = Path(__file__).resolve().parents[2] / "conf"
#: Groups not in the defaults list are added with '+'.
OPTIONAL_GROUPS = {"policy", "experiment", "logger", "executor", "hardware", "cluster"}
#: Options that need hardware CI does not have; they must fail with a clear message instead.
NEEDS_CUDA = {("backend", "flash_attn")}


def group_options():
    for path in sorted(CONF.glob("*/*.yaml")):
        yield path.parent.name, path.stem


def overrides_for(group, option):
    prefix = "+" if group in OPTIONAL_GROUPS else ""
    return [f"{prefix}{group}={option}"]


def compose_with(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_root_config_composes():
    cfg = compose_with([])
    assert engine_config(cfg).policy == "fcfs"


@pytest.mark.parametrize("group, option", list(group_options()))
def test_every_group_option_composes_and_builds(group, option):
    cfg = compose_with(overrides_for(group, option))
    config = engine_config(cfg)
    if group in ("workload", "logger", "experiment", "hardware", "cluster", "executor"):
        return  # these shape runs, not the engine; their own tests run them
    config.max_model_len = min(config.max_model_len or 256, 256)
    config.num_gpu_blocks_override = 64
    if (group, option) in NEEDS_CUDA and not torch.cuda.is_available():
        with pytest.raises((RuntimeError, ImportError, ValueError), match="(?i)cuda|flash"):
            LLMEngine(config)
        return
    LLMEngine(config)
