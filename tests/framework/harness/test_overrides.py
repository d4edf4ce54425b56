"""Command-line overrides checked against conf/ before Hydra sees them."""
from framework.harness.overrides import non_string_group_overrides, null_group_overrides


def test_a_null_option_of_one_of_hydras_own_groups_is_left_to_hydra():
    assert null_group_overrides(["hydra/launcher=null", "engine.seed=1"]) == (["hydra/launcher=null", "engine.seed=1"],
                                                                              None)


def test_a_null_group_with_a_null_default_drops_its_earlier_overrides_only():
    assert null_group_overrides(["executor=sim", "engine.seed=1", "executor=null", "backend=naive"]) == (
        ["engine.seed=1", "backend=naive"], None)


def test_a_mapping_given_to_a_group_is_left_to_hydra_to_merge():
    assert non_string_group_overrides(["backend={name: naive}"]) is None
    assert "5 is not an option of the config group 'backend'" in non_string_group_overrides(["backend={name: naive},5"])
