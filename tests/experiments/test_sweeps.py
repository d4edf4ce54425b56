"""The W&B sweep files drive the same CLI: every trial they can launch composes."""
import itertools
from pathlib import Path

import pytest
import yaml
from framework.harness.experiment import engine_config
from tests.hydra_support import compose_config

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted((ROOT / "experiments" / "sweeps").glob("*.yaml"))
MACROS = {"${env}", "${interpreter}", "${args_no_hyphens}"}


def trials(path):
    """(sweep, overrides): the fixed arguments of its command plus each combination of values,
    as the agent's ${args_no_hyphens} writes them (key=value)."""
    spec = yaml.safe_load(path.read_text())
    command = spec["command"]
    assert command[:4] == ["${env}", "${interpreter}", "-m", "framework.run"] and command[-1] == "${args_no_hyphens}"
    fixed = [a for a in command[4:] if a not in MACROS]
    params = spec["parameters"]
    axes = [[f"{k}={str(v).lower() if isinstance(v, bool) else v}" for v in p["values"]] for k, p in params.items()]
    for combo in itertools.product(*axes):
        yield path.stem, fixed + list(combo)


@pytest.mark.parametrize("sweep, overrides", [t for p in SWEEPS for t in trials(p)])
def test_every_sweep_trial_composes(sweep, overrides):
    for o in overrides:
        key, value = o.lstrip("+").split("=", 1)
        if key == "policy" and not (ROOT / "conf" / "policy" / f"{value}.yaml").exists():
            pytest.skip(f"conf/policy/{value}.yaml is not in this checkout (another branch adds it)")
    cfg = compose_config(*overrides)
    assert cfg.logger.name == "wandb"
    engine_config(cfg)


def test_sweeps_exist_and_name_a_metric_the_run_logs():
    from framework.harness.metrics import summarize

    logged = set(summarize([], 1.0))
    assert len(SWEEPS) >= 2
    for path in SWEEPS:
        spec = yaml.safe_load(path.read_text())
        assert spec["metric"]["name"] in logged, path.name
