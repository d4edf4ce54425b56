"""Shared fixtures: tiny random-weight Hugging Face checkpoints, and a leak check on every engine."""
from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Engines built with device="auto" run on the CPU in float32, as the references they are checked
# against do, also on a machine with a GPU (and in the subprocesses tests start); `gpu`-marked
# tests get the real "auto" back (`unpinned_device_for_gpu_tests`).
os.environ["SERVELAB_DEVICE"] = "cpu"
# Caches the engine keeps between runs (the tuned matrix products' choices) go to a folder of this session.
os.environ["SERVELAB_CACHE_DIR"] = tempfile.mkdtemp(prefix="servelab-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import framework  # noqa: E402,F401  (sets OMP_WAIT_POLICY before torch spins up threads)
from framework.testing.leaks import kv_leaks_checked  # noqa: E402
from framework.testing.parity import make_hf_checkpoint  # noqa: E402

# The property tests' example counts: "ci" (the default) keeps the suite to a few minutes;
# `pytest --hypothesis-profile=long` runs them at length (3,000 examples per property test,
# about ten minutes for tests/policies/test_properties.py on two cores).
_PROPERTY = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=40, **_PROPERTY)
settings.register_profile("long", max_examples=3000, **_PROPERTY)


def pytest_configure(config: pytest.Config) -> None:
    # Before collection, so the tests' @settings take the profile's example count.
    if not config.getoption("hypothesis_profile", None):
        settings.load_profile("ci")

@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-hf")
    model = make_hf_checkpoint(path, "llama", with_tokenizer=True)
    return path, model


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-hf")
    return path, make_hf_checkpoint(path, "qwen2", seed=1)


@pytest.fixture(scope="session")
def mistral_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mistral-hf")
    return path, make_hf_checkpoint(path, "mistral", seed=2)


def runnable_backends(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                      dtype: torch.dtype = torch.float32) -> list[str]:
    """Registered attention backends that build on this machine for that shape (those needing
    CUDA, or another head size or block size, do not)."""
    from framework.execution.attention import BACKENDS

    names = []
    for name in BACKENDS.list():
        try:
            BACKENDS.create(name, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            scale=head_dim ** -0.5, block_size=block_size, dtype=dtype, device="cpu")
        except (RuntimeError, ImportError, ValueError):
            continue
        names.append(name)
    return names


@pytest.fixture(autouse=True)
def unpinned_device_for_gpu_tests(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.delenv("SERVELAB_DEVICE", raising=False)


@pytest.fixture(autouse=True)
def no_kv_block_leaks():
    """Every engine a test builds must end with all KV blocks free (cached prefix blocks count as
    free: they are reclaimable) and consistent books, once its requests are done; an engine left
    with requests in flight must get every block back by aborting them."""
    with kv_leaks_checked():
        yield


def step_through_interrupts(engine) -> tuple[dict, int]:
    """Step ``engine`` until it has no unfinished request, stepping on after each step that
    raised KeyboardInterrupt. Returns the final outputs by request id and the number of
    interrupted steps."""
    outs, interrupted = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        except KeyboardInterrupt:
            interrupted += 1
    return outs, interrupted
