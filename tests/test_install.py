"""A plain (not editable) install works from any folder: the wheel carries conf/ (the Hydra configs and the
simulator's hardware presets), and ``python -m framework.run`` and ``servelab-run`` run a simulated experiment
from a folder outside the repository."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What the wheel is built from (copied, so the build leaves nothing in the working tree).
SOURCES = ["framework", "policies", "backends", "models", "conf", "pyproject.toml", "README.md"]
RUN = ["executor=sim", "+hardware=h100-sxm", "model.name=llama-3-8b", "workload.num_requests=4", "plots=false",
       "progress=false"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project's wheel, installed (without its dependencies, which the test's venv has) into a folder."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                         if (ROOT / name).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")],
                   check=True, capture_output=True, text=True, cwd=tmp)
    wheel = next((tmp / "dist").glob("servelab-*.whl"))
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, cwd=tmp)
    return site


def run_from(site: Path, cwd: Path, command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy only, not the repository
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_wheel_ships_the_configs_and_hardware_presets(installed):
    assert (installed / "conf" / "config.yaml").is_file()
    assert (installed / "conf" / "hardware" / "h100-sxm.yaml").is_file()
    assert {p.stem for p in (installed / "conf" / "policy").glob("*.yaml")} >= {"fcfs", "chunked"}


def test_the_wheel_ships_the_cpu_kernels_sources(installed):
    from backends.cpu_kernels import SOURCE as decode
    from framework.execution.cpp_extension import INCLUDE
    from models.cpu_ops import AMX_SOURCE as amx
    from models.cpu_ops import SOURCE as fused

    for source in (decode, fused, amx, INCLUDE / "fast_exp.h"):
        assert (installed / source.relative_to(ROOT)).is_file(), source


@pytest.mark.parametrize("how", ["module", "script"])
def test_a_plain_install_runs_a_simulated_experiment_from_any_folder(installed, tmp_path, how):
    out = tmp_path / "out"
    command = ([sys.executable, "-m", "framework.run"] if how == "module" else [str(installed / "bin" / "servelab-run")])
    where = run_from(installed, tmp_path, [sys.executable, "-c", "import framework; print(framework.__file__)"])
    assert where.stdout.startswith(str(installed)), where.stdout + where.stderr
    result = run_from(installed, tmp_path, [*command, *RUN, f"hydra.run.dir={out}"])
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["completed"] == 4
    assert f"results: {out}" in result.stdout


@pytest.mark.parametrize("workload", ["trace", "sharegpt"])
def test_a_plain_install_replays_the_shipped_sample_workloads_from_any_folder(installed, tmp_path, workload):
    # Their sample files sat in experiments/, which the wheel does not ship: both failed outside a checkout.
    out = tmp_path / "out"
    count = "workload.max_requests=4" if workload == "trace" else "workload.num_requests=4"
    run = [a for a in RUN if not a.startswith("workload.")]
    result = run_from(installed, tmp_path, [sys.executable, "-m", "framework.run", *run, f"workload={workload}", count,
                                            f"hydra.run.dir={out}"])
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["completed"] == 4
