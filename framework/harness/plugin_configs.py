"""Hydra options for parts with no config file: installed plugins, named by the packages' metadata (nothing of
theirs is imported), and the policies registered in ``POLICIES`` (an in-tree file in ``policies/``).

Such a policy has no file in ``conf/policy/``, yet gets ``+policy=NAME`` as ``{name: NAME}``, with its
constructor's defaults; ``+policy.KEY=VALUE`` sets an option (the ``+`` because no file lists its keys).
"""
from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

from hydra.core.config_store import ConfigStore

#: conf/ by its absolute path: Hydra resolves a relative one against the calling module's package
#: when run as a console script (``servelab-run``), and conf/ is not a package.
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

#: Config group -> the entry-point group its plugins are declared in.
PLUGIN_GROUPS = {
    "policy": "framework.policies",
    "allocator": "framework.allocators",
    "backend": "framework.backends",
    "preparer": "framework.preparers",
}


def store_plugin_options(conf_dir: str | Path = CONF_DIR) -> list[str]:
    """Adds an option ``{name: NAME}`` to each group of ``PLUGIN_GROUPS`` for every plugin of
    that kind (and every registered policy) that has no file ``conf_dir/GROUP/NAME.yaml`` (a file,
    shipped or the user's own, wins). Returns the options added, as ``GROUP/NAME``. Call before Hydra composes
    (again after registering a policy in a running interpreter)."""
    store, added = ConfigStore.instance(), []
    for group, ep_group in PLUGIN_GROUPS.items():
        names = {ep.name for ep in entry_points(group=ep_group)} | set(_registered(group))
        for name in sorted(names):
            if not (Path(conf_dir) / group / f"{name}.yaml").exists():
                store.store(group=group, name=name, node={"name": name})
                added.append(f"{group}/{name}")
    return added


def _registered(group: str) -> list[str]:
    """The names registered in the group's registry: only policies, whose built-ins import no torch."""
    if group != "policy":
        return []
    from framework.scheduling.policy import POLICIES

    return POLICIES.list()
