"""framework/'s sub-packages import only the layers below them, each says so in its docstring, and the
top-level plugin packages reach framework only through its interfaces."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Each layer of framework/ with the layers it may import, bottom first; ``models`` is the model code.
LAYERS = {
    "common": set(),
    "kv": {"common"},
    "scheduling": {"common", "kv"},
    "execution": {"common", "kv", "scheduling", "models"},
    "engine": {"common", "kv", "scheduling", "execution", "models"},
    "sim": {"common", "kv", "scheduling", "execution", "engine", "models"},
    "harness": {"common", "kv", "scheduling", "execution", "engine", "sim", "models"},
    "server": {"common", "kv", "scheduling", "execution", "engine", "sim", "harness", "models"},
    # Test helpers for policies (framework.testing): the engine and what it stands on, as a policy's tests see it.
    "testing": {"common", "kv", "scheduling", "execution", "engine"},
}
#: Top-level packages of implementations: the framework layers they may import.
PLUGINS = {
    "policies": {"common", "kv", "scheduling"},
    "backends": {"common", "execution"},
    "models": {"common", "execution"},
}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (under ``TYPE_CHECKING`` and in functions too)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
            # ``from framework.harness import plots`` imports framework.harness.plots
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def layer_of(module: str) -> str | None:
    """The framework layer (or ``models``) that ``module`` belongs to; None for anything else."""
    parts = module.split(".")
    if parts[0] == "models":
        return "models"
    if parts[0] == "framework" and len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return None


def layer_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for layer in LAYERS:
        for path in (ROOT / "framework" / layer).rglob("*.py"):
            edges[layer] |= {layer_of(m) for m in imported_modules(path)} - {None, layer}
    return edges


@pytest.mark.parametrize("layer", list(LAYERS))
def test_a_layer_imports_only_the_layers_below_it(layer):
    for path in sorted((ROOT / "framework" / layer).rglob("*.py")):
        for module in sorted(imported_modules(path)):
            used = layer_of(module)
            assert used in (None, layer) or used in LAYERS[layer], (
                f"{path.relative_to(ROOT)} imports {module}: {layer} may import only {sorted(LAYERS[layer])}")
        # policies/ and backends/ are found by name through their registries, never imported
        assert not {m.split(".")[0] for m in imported_modules(path)} & {"policies", "backends"}, path


def test_the_layers_import_no_cycle():
    edges = layer_edges()
    done: set[str] = set()

    def visit(layer: str, path: list[str]) -> None:
        assert layer not in path, f"import cycle: {' -> '.join(path + [layer])}"
        if layer in done or layer == "models":
            return
        for below in edges[layer]:
            visit(below, path + [layer])
        done.add(layer)

    for layer in LAYERS:
        visit(layer, [])


def test_nothing_below_the_harness_imports_it_and_nothing_below_sim_imports_sim():
    edges = layer_edges()
    assert [layer for layer, used in edges.items() if "harness" in used] in ([], ["server"])
    assert not [layer for layer, used in edges.items() if "server" in used]  # the top layer
    assert [layer for layer, used in edges.items() if "sim" in used] == ["harness"]


@pytest.mark.parametrize("package", list(PLUGINS))
def test_plugin_packages_use_only_framework_interfaces(package):
    for path in sorted((ROOT / package).rglob("*.py")):
        for module in imported_modules(path):
            used = layer_of(module)
            if module.startswith("framework") and used != package:
                assert used in PLUGINS[package], f"{path.relative_to(ROOT)} imports {module}"


@pytest.mark.parametrize("layer", list(LAYERS))
def test_each_layer_says_what_lives_there_and_what_it_may_import(layer):
    doc = importlib.import_module(f"framework.{layer}").__doc__ or ""
    summary, _, rest = doc.strip().partition("\n")
    assert summary and not summary.startswith(" "), f"framework.{layer} has no one-line docstring"
    said = re.search(r"May import: (.*)", rest)
    assert said, f"framework.{layer}'s docstring does not say what it may import"
    named = set(re.findall(r"``(?:framework\.)?([a-z_]+)``", said.group(1)))
    assert named == LAYERS[layer], f"framework.{layer} says it may import {sorted(named)}, the rule is {sorted(LAYERS[layer])}"
