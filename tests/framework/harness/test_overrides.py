"""Command-line overrides checked against conf/ before Hydra sees them."""
import pytest
from hydra.errors import HydraException, MissingConfigException

from framework.harness.overrides import hydra_error_line, non_string_group_overrides, null_group_overrides
from tests.hydra_support import compose_config


def test_a_null_option_of_one_of_hydras_own_groups_is_left_to_hydra():
    assert null_group_overrides(["hydra/launcher=null", "engine.seed=1"]) == (["hydra/launcher=null", "engine.seed=1"],
                                                                              None)


def test_a_null_group_with_a_null_default_drops_its_earlier_overrides_only():
    assert null_group_overrides(["executor=sim", "engine.seed=1", "executor=null", "backend=naive"]) == (
        ["engine.seed=1", "backend=naive"], None)


def test_a_mapping_given_to_a_group_is_left_to_hydra_to_merge():
    assert non_string_group_overrides(["backend={name: naive}"]) is None
    assert "5 is not an option of the config group 'backend'" in non_string_group_overrides(["backend={name: naive},5"])


@pytest.mark.parametrize("override, choose", [
    ("executor.fused_ops=false", "add executor=model (the real forward pass, the default) or executor=sim first"),
    ("cost_model.calibration=cal.yaml", "add executor=sim first"),
    ("hardware.memory_gb=80", "add +hardware=NAME and executor=sim first"),
    ("policy.preemption_mode=swap", "add +policy=NAME first"),
])
def test_an_option_of_a_group_the_defaults_leave_out_says_what_to_choose_first(override, choose):
    group = override.split(".")[0]
    with pytest.raises(HydraException) as error:
        compose_config(override)
    line = hydra_error_line(error.value)
    assert line.startswith(f"config: no {group} is selected, so {group}.* cannot be set: ") and choose in line


def test_the_ray_launcher_missing_says_which_extra_brings_it():
    # As Hydra words it where the cluster extra (hydra-ray-launcher) is not installed.
    missing = MissingConfigException("In 'hydra/config': Could not find 'hydra/launcher/ray'\n\nAvailable options in "
                                     "'hydra/launcher':\n\tbasic\n\tjoblib\nConfig search path:\n\tprovider=hydra",
                                     missing_cfg_file="hydra/launcher/ray")
    assert hydra_error_line(missing) == (
        "In 'hydra/config': Could not find 'hydra/launcher/ray'; Available options in 'hydra/launcher': basic, joblib; "
        "the ray launcher comes with the cluster extra: pip install '.[cluster]'")
