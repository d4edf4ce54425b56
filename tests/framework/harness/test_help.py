"""``python -m framework.run --help`` lists each config group with what it picks and its options, the simulator's
model presets and the sweep launchers."""
import subprocess
import sys

from framework.harness.help import GROUPS, LAUNCHERS, model_presets
from framework.harness.overrides import group_options


def test_help_lists_every_group_its_options_and_the_model_presets(tmp_path):
    result = subprocess.run([sys.executable, "-m", "framework.run", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    page = result.stdout
    for group, (given, what) in GROUPS.items():
        assert f"{given:<18} {what}\n{'':<18} options: {', '.join(group_options(group))}\n" in page
    assert "options: chunked, fcfs, least_computed, priority_swap, sjf" in page
    random_weights, shapes = model_presets()
    assert "llama-3-70b" in shapes and "tiny-llama" in random_weights
    assert f"for executor=sim only: {', '.join(shapes)}" in page
    assert all(name in page for name in LAUNCHERS)
    assert "--hydra-help : Hydra's help" in page  # Hydra's flags, after this project's page
    assert not list(tmp_path.iterdir())  # nothing ran


def test_every_conf_group_is_described():
    from tests.hydra_support import CONF

    assert {p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"} == set(GROUPS)
