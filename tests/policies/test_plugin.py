"""A policy shipped in its own package and found through the ``framework.policies`` entry point,
exactly as docs/writing-a-policy.md tells a researcher to do it: the package is built and
installed (offline, into a temporary folder) and then used by name."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from framework import POLICIES, LLMEngine, SamplingParams
from framework.harness.plugin_configs import store_plugin_options
from framework.common.registry import BadOptionsError
from framework.run import engine_config
from framework.testing.registries import forget_registrations
from tests.conf.test_compose import compose_with
from tests.hydra_support import CONF
from tests.policies.harness import Arrival, drive, shadow_engine

PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "my-policies"
version = "0.1.0"

[project.entry-points."framework.policies"]
srpt = "my_policies.srpt:ShortestOutputFirst"

[project.entry-points."framework.preparers"]
v1_plain = "my_policies.srpt:PlainV1"
"""

POLICY = '''\
"""Shortest remaining processing time, with max_tokens as the estimate of a request's work."""
from policies.chunked import ChunkedPolicy


class ShortestOutputFirst(ChunkedPolicy):
    """`chunked`, admitting the waiting request that asks for the fewest tokens first."""

    def waiting_key(self, request):
        return request.max_tokens, request.arrival_time


def __getattr__(name):  # the preparer loads torch: only when asked for
    if name == "PlainV1":
        from framework.execution.preparers.v1 import FlatBatchPreparer
        return type("PlainV1", (FlatBatchPreparer,), {})
    raise AttributeError(name)
'''


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    src = tmp_path / "my-policies"
    (src / "my_policies").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "my_policies" / "__init__.py").write_text("")
    (src / "my_policies" / "srpt.py").write_text(textwrap.dedent(POLICY))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(src)], check=True, capture_output=True, text=True)
    assert list(site.glob("my_policies-0.1.0.dist-info/entry_points.txt")), "pip did not install the metadata"
    monkeypatch.syspath_prepend(str(site))
    forget_registrations(monkeypatch, POLICIES)  # forget the plugin afterwards
    POLICIES.refresh_plugins()
    yield
    sys.modules.pop("my_policies.srpt", None)
    sys.modules.pop("my_policies", None)
    POLICIES.refresh_plugins()


def test_the_entry_point_policy_is_listed_and_runs(installed_plugin):
    assert "srpt" in POLICIES.list()
    cls = POLICIES.get("srpt")
    assert cls.__module__ == "my_policies.srpt" and cls.name == "srpt"
    arrivals = [Arrival(str(i), 0, [3 + i] * 5, SamplingParams(max_tokens=n, ignore_eos=True))
                for i, n in enumerate([9, 2, 6, 4])]
    run = drive(shadow_engine("srpt", num_blocks=64, max_num_seqs=1), arrivals, max_steps=100)
    assert [r.request_id for out in run.steps for r in out.new_requests] == ["1", "3", "2", "0"]


def test_the_entry_point_policy_is_selectable_from_hydra(installed_plugin):
    config = engine_config(compose_with(["+policy=chunked", "policy.name=srpt", "scheduler.check_invariants=true"]))
    assert config.policy == "srpt" and config.check_invariants
    assert config.policy_options == {"preemption_mode": "recompute", "long_prefill_token_threshold": 0,
                                     "long_prefill_cap_when_alone": False, "reserve_full_prompt": True}
    assert type(POLICIES.create(config.policy, **config.policy_options)).__name__ == "ShortestOutputFirst"


def test_the_entry_point_policy_is_a_policy_option_of_its_own(installed_plugin):
    # A plugin cannot add conf/policy/srpt.yaml: the option comes from its entry point, and its
    # options from its constructor (chunked's), set with +policy.KEY=VALUE.
    config = engine_config(compose_with(["+policy=srpt"]))
    assert config.policy == "srpt" and config.policy_options == {}
    config = engine_config(compose_with(["+policy=srpt", "+policy.long_prefill_token_threshold=64"]))
    policy = POLICIES.create(config.policy, **config.policy_options)
    assert type(policy).__name__ == "ShortestOutputFirst" and policy.long_prefill_token_threshold == 64


def test_a_misspelt_option_of_the_plugin_lists_the_ones_it_takes(installed_plugin):
    config = engine_config(compose_with(["+policy=srpt", "+policy.long_prefil=64"]))
    with pytest.raises(BadOptionsError, match="policy 'srpt': .*'long_prefil'; its options: preemption_mode, "
                                              "long_prefill_token_threshold"):
        LLMEngine(dataclasses.replace(config, executor="sim"))


def test_other_kinds_of_plugin_are_options_of_their_groups_too(installed_plugin):
    config = engine_config(compose_with(["preparer=v1_plain"]))
    assert config.preparer == "v1_plain" and config.preparer_options == {}


def test_a_config_file_of_the_plugins_name_wins_over_the_generated_option(installed_plugin, tmp_path):
    shutil.copytree(CONF / "policy", tmp_path / "policy")  # the shipped files: only srpt's is new
    (tmp_path / "policy" / "srpt.yaml").write_text("name: srpt\nlong_prefill_token_threshold: 32\n")
    assert "policy/srpt" not in store_plugin_options(tmp_path)
    assert "policy/srpt" in store_plugin_options(CONF)


def test_the_entry_point_policy_runs_from_the_command_line(installed_plugin, tmp_path):
    site = next(p for p in sys.path if p.endswith("site"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "framework.run", "+policy=srpt", "executor=sim", "workload.num_requests=8",
         "plots=false", "progress=false", f"hydra.run.dir={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] == 8
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["policy"] == {"name": "srpt"}


@pytest.mark.parametrize("override, said", [
    ("+policy=null", "+policy=null: the config group 'policy' needs one of its options: "),
    ("+policy=5", "+policy=5: 5 is not an option of the config group 'policy'; its options: "),
])
def test_a_group_given_no_option_lists_the_plugins_options_too(installed_plugin, tmp_path, override, said):
    # Answered with the group's options, which were conf/policy's files only.
    site = next(p for p in sys.path if p.endswith("site"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "framework.run", override, f"hydra.run.dir={tmp_path}"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert said + "chunked, fcfs, least_computed, priority_swap, sjf, srpt\n" in result.stderr


def test_the_package_is_the_one_the_walkthrough_shows():
    """docs/writing-a-policy.md says this exact package is the one tested here."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-policy.md").read_text()
    shown = doc.split("# my_policies/srpt.py\n", 1)[1].split("```", 1)[0]
    assert shown.strip() in POLICY
    assert PYPROJECT.split("[project.entry-points.\"framework.policies\"]\n")[1].startswith(
        doc.split("[project.entry-points.\"framework.policies\"]\n")[1].split("```")[0])


def doc_file(name: str) -> str:
    """The code block of docs/writing-a-policy.md that starts with the comment ``# NAME``."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-policy.md").read_text()
    return doc.split(f"# {name}\n", 1)[1].split("```", 1)[0]


def test_the_plugins_property_test_passes_outside_the_repository(installed_plugin, tmp_path):
    """The walkthrough's test files, in the plugin's own folder, import framework.testing (no tests.policies)."""
    tests = tmp_path / "my-policies" / "tests"
    tests.mkdir()
    (tests / "test_srpt.py").write_text(doc_file("my-policies/tests/test_srpt.py"))
    quick = 'from hypothesis import settings\nsettings.register_profile("quick", max_examples=8, deadline=None)\n'
    (tests / "conftest.py").write_text(doc_file("my-policies/tests/conftest.py") + quick)
    site = next(p for p in sys.path if p.endswith("site"))
    env = {**os.environ, "PYTHONPATH": site}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             "--hypothesis-profile=quick", "tests"], cwd=tests.parent, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout


def test_a_registered_policy_without_a_config_file_is_an_option(monkeypatch):
    """In tree (a file in policies/) or in a notebook: registered, it needs no conf/policy/NAME.yaml."""
    from policies.fcfs import FCFSPolicy

    forget_registrations(monkeypatch, POLICIES)
    POLICIES.register("fcfs_without_file")(type("FcfsWithoutFile", (FCFSPolicy,), {}))
    assert "policy/fcfs_without_file" in store_plugin_options()  # the package's conf/, as a notebook calls it
    config = engine_config(compose_with(["+policy=fcfs_without_file", "+policy.preemption_mode=swap"]))
    assert config.policy == "fcfs_without_file" and config.policy_options == {"preemption_mode": "swap"}


def test_an_option_of_a_policy_without_a_config_file_set_without_plus_says_to_add_it(monkeypatch):
    """Its node holds only ``name``: Hydra refuses ``policy.KEY=VALUE``, and the error says to add the key with a +
    (``name`` alone as the valid key would read as if the policy took no options)."""
    from hydra.errors import HydraException

    from framework.harness.overrides import hydra_error_line
    from policies.fcfs import FCFSPolicy

    forget_registrations(monkeypatch, POLICIES)
    POLICIES.register("fcfs_without_file")(type("FcfsWithoutFile", (FCFSPolicy,), {}))
    store_plugin_options(CONF)
    with pytest.raises(HydraException) as error:
        compose_with(["+policy=fcfs_without_file", "policy.preemption_mode=swap"])
    assert hydra_error_line(error.value) == (
        "policy: unknown key preemption_mode; valid: name; options of a part without a config file are added: "
        "+policy.preemption_mode=VALUE")


def test_without_the_package_the_name_is_unknown():
    POLICIES.refresh_plugins()
    assert "srpt" not in POLICIES.list()
