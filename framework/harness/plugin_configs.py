"""Hydra options for parts installed as plugins, named by the packages' metadata (nothing is imported).

A plugin policy (an entry point in ``framework.policies``) has no file in ``conf/policy/``, yet gets
``+policy=NAME`` as ``{name: NAME}``, with its constructor's defaults; ``+policy.KEY=VALUE`` sets an
option (the ``+`` because no file lists its keys).
"""
from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

from hydra.core.config_store import ConfigStore

#: Config group -> the entry-point group its plugins are declared in.
PLUGIN_GROUPS = {
    "policy": "framework.policies",
    "allocator": "framework.allocators",
    "backend": "framework.backends",
    "preparer": "framework.preparers",
}


def store_plugin_options(conf_dir: str | Path) -> list[str]:
    """Adds an option ``{name: NAME}`` to each group of ``PLUGIN_GROUPS`` for every plugin of
    that kind that has no file ``conf_dir/GROUP/NAME.yaml`` (a file, shipped or the user's own,
    wins). Returns the options added, as ``GROUP/NAME``. Call before Hydra composes."""
    store, added = ConfigStore.instance(), []
    for group, ep_group in PLUGIN_GROUPS.items():
        for name in sorted({ep.name for ep in entry_points(group=ep_group)}):
            if not (Path(conf_dir) / group / f"{name}.yaml").exists():
                store.store(group=group, name=name, node={"name": name})
                added.append(f"{group}/{name}")
    return added
