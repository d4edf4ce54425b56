"""docs/writing-a-part.md as a researcher follows it: its three parts, installed from their own package through the
entry points it shows, pass the tests it shows from outside this repository and run from the command line; its
allocator also forks and copies correctly, and its preparer matches v1 beyond greedy."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework import ALLOCATORS, BACKENDS, LLM, PREPARERS, SamplingParams
from framework.testing.parity import parity_prompts
from framework.testing.registries import forget_registrations

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-part.md"
PARTS = ("my_parts/no_cache.py", "my_parts/padded_sdpa.py", "my_parts/rebuild.py")
REGISTRIES = (ALLOCATORS, BACKENDS, PREPARERS)


def doc_block(first_line: str) -> str:
    """The code block of the guide that starts with ``first_line``."""
    return DOC.read_text().split(f"{first_line}\n", 1)[1].split("```", 1)[0]


def pyproject() -> str:
    entry_points = doc_block('[project.entry-points."framework.allocators"]')
    return ('[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
            '[project]\nname = "my-parts"\nversion = "0.1.0"\n\n'
            '[project.entry-points."framework.allocators"]\n' + entry_points)


@pytest.fixture
def forgetting_registries(monkeypatch):
    """Parts registered in the test are gone after it."""
    forget_registrations(monkeypatch, *REGISTRIES)
    yield
    for module in [name for name in sys.modules if name == "my_parts" or name.startswith("my_parts.")]:
        del sys.modules[module]
    for registry in REGISTRIES:
        registry.refresh_plugins()


@pytest.fixture
def installed_parts(tmp_path, monkeypatch, forgetting_registries):
    """The guide's package, built and installed (offline) into a folder of its own: its path."""
    src = tmp_path / "my-parts"
    (src / "my_parts").mkdir(parents=True)
    (src / "pyproject.toml").write_text(pyproject())
    (src / "my_parts" / "__init__.py").write_text("")
    for part in PARTS:
        (src / part).write_text(doc_block(f"# {part}"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(src)], check=True, capture_output=True, text=True)
    monkeypatch.syspath_prepend(str(site))
    for registry in REGISTRIES:
        registry.refresh_plugins()
    return site


def test_the_installed_parts_are_listed_and_the_guides_tests_pass_outside_the_repository(installed_parts, tmp_path):
    assert "no_cache" in ALLOCATORS.list() and "padded_sdpa" in BACKENDS.list() and "rebuild" in PREPARERS.list()
    assert PREPARERS.get("rebuild").__module__ == "my_parts.rebuild"
    tests = tmp_path / "my-parts" / "tests"
    tests.mkdir()
    (tests / "test_parts.py").write_text(doc_block("# my-parts/tests/test_parts.py"))
    (tests / "conftest.py").write_text(
        "from hypothesis import settings\n"
        "settings.register_profile('quick', max_examples=10, deadline=None)\n"
        + doc_block("# my-parts/tests/conftest.py"))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             "--hypothesis-profile=quick", "tests"], cwd=tests.parent,
                            env={**os.environ, "PYTHONPATH": str(installed_parts)}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "5 passed" in result.stdout


def test_the_installed_parts_are_options_of_their_groups_on_the_command_line(installed_parts, tmp_path):
    out = tmp_path / "multirun"
    result = subprocess.run(
        [sys.executable, "-m", "framework.run", "-m", "backend=torch_paged,padded_sdpa", "allocator=no_cache",
         "preparer=rebuild", "workload.num_requests=6", "warmup=0", "plots=false", "progress=false",
         "scheduler.check_invariants=true", f"hydra.sweep.dir={out}"],
        env={**os.environ, "PYTHONPATH": str(installed_parts)}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for job, backend in enumerate(["torch_paged", "padded_sdpa"]):
        summary = json.loads((out / str(job) / "summary.json").read_text())
        assert summary["completed"] == 6
        run_config = (out / str(job) / "config.yaml").read_text()
        assert f"name: {backend}" in run_config and "name: no_cache" in run_config and "name: rebuild" in run_config
    compared = subprocess.run([sys.executable, "-m", "framework.compare", str(out)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(installed_parts)}, timeout=300)
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert "padded_sdpa" in compared.stdout


@pytest.fixture
def guide_parts(forgetting_registries):
    """The guide's three files run in this interpreter, as a notebook would import them."""
    for part in PARTS:
        exec(compile(doc_block(f"# {part}"), part, "exec"), {"__name__": part[:-3].replace("/", ".")})


def _run(path, params, **parts):
    llm = LLM(model=str(path), block_size=8, max_model_len=160, max_num_batched_tokens=64, num_gpu_blocks_override=30,
              max_num_seqs=6, check_invariants=True, policy="chunked", **parts)
    outs = llm.generate([{"prompt_token_ids": p} for p in parity_prompts()], params)
    return llm, outs


def test_the_allocator_forks_and_copies_parallel_samples_as_paged_does(guide_parts, llama_ckpt):
    path, _ = llama_ckpt
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.9, seed=i, n=2 if i % 3 else 1,
                             ignore_eos=True) for i in range(16)]
    paged, paged_outs = _run(path, params, preparer="v0", enable_prefix_caching=False)
    mine, outs = _run(path, params, preparer="v0", allocator="no_cache")
    assert mine.engine.allocator.stats.cow_copies > 0, "no fork wrote a shared block: the copies went untested"
    assert mine.engine.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in paged_outs]


def test_the_preparer_gives_v1s_tokens_and_logprobs_with_every_sampling_option(guide_parts, llama_ckpt):
    path, _ = llama_ckpt
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=20 if i % 2 else 0, top_p=0.9 if i % 3 else 1.0,
                             min_p=0.05 if i % 4 == 1 else 0.0, seed=i, n=2 if i % 5 == 0 else 1,
                             repetition_penalty=1.2 if i % 3 == 0 else 1.0, presence_penalty=0.5 if i % 4 == 0 else 0.0,
                             frequency_penalty=0.3 if i % 7 == 0 else 0.0, logprobs=2 if i % 2 else None,
                             prompt_logprobs=1 if i % 6 == 0 else None, ignore_eos=True) for i in range(16)]
    results = {}
    for preparer in ("v1", "rebuild"):
        llm, outs = _run(path, params, preparer=preparer)
        assert llm.engine.scheduler.num_preemptions > 0
        results[preparer] = [([c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs], o.prompt_logprobs)
                             for o in outs]
    assert results["rebuild"] == results["v1"]
