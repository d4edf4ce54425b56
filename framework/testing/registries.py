"""Parts a test registers, forgotten after it."""
from __future__ import annotations

import importlib
from typing import Any

from framework.common.registry import Registry


def forget_registrations(monkeypatch: Any, *registries: Registry[Any]) -> None:
    """Whatever a test registers in ``registries`` is gone once ``monkeypatch`` (pytest's) undoes. Their built-in and
    lazy parts are imported first: one first imported during the test would register only into the copy thrown away,
    and the registry, counting it imported, would never name it again."""
    for registry in registries:
        registry.list()  # the built-ins
        for module in registry._lazy.values():
            importlib.import_module(module)
        monkeypatch.setattr(registry, "_classes", dict(registry._classes))
