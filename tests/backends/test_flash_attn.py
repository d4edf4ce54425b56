"""flash_attn: refuses at construction, naming every missing requirement, wherever it cannot
run; on a CUDA GPU with flash-attn installed it agrees with the float64 reference."""
from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest
import torch

import backends.flash_attn as module
from backends.flash_attn import missing_requirements
from framework import BACKENDS
from framework.common.registry import UnavailableError
from framework.testing.attention import GQA, check_result, mixed_specs, random_batch, run_named, seed_of

HAVE_FLASH = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def create(**overrides):
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125, block_size=256, dtype=torch.bfloat16,
              device="cuda" if torch.cuda.is_available() else "cpu")
    kw.update(overrides)
    return BACKENDS.create("flash_attn", **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_on_cpu_construction_names_everything_missing():
    with pytest.raises(UnavailableError) as err:
        create(block_size=16, dtype=torch.float32, device="cpu")
    message = str(err.value)
    assert "'flash_attn' cannot run here" in message
    assert "CUDA is not available" in message
    assert "block_size=16 is not a multiple of 256" in message and "engine.block_size=256" in message
    assert "float32" in message
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash-attn package is not installed" in message


def test_an_installed_package_that_cannot_be_imported_is_a_one_line_error(monkeypatch):
    """A CUDA machine whose flash-attn wheel was built for another torch: its import fails with an
    ImportError (an undefined symbol), which must come out as UnavailableError like every other
    missing piece, not as a traceback."""
    monkeypatch.setattr(module, "missing_requirements", lambda *args: [])
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # importing it raises ImportError
    with pytest.raises(UnavailableError, match="flash-attn package is installed but cannot be imported"):
        create(device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_on_gpu_small_blocks_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 256"):
        create(block_size=16)


@pytest.mark.skipif(not HAVE_FLASH, reason="needs a CUDA GPU and flash-attn")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", GQA)
@pytest.mark.parametrize("decode_only", [False, True])
def test_matches_float64_reference(dtype, num_heads, num_kv_heads, decode_only):
    block_size, head_dim = 256, 128
    seed = seed_of("flash", str(dtype), num_heads, num_kv_heads, decode_only)
    rng = np.random.default_rng(seed)
    if decode_only:
        specs = [(0, 1), (255, 1), (256, 1)] + [(int(c), 1) for c in rng.integers(1, 700, size=5)]
    else:
        specs = mixed_specs(rng, block_size, num_reqs=7, max_len=600)
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, device="cuda")
    before = batch.kv_cache.clone()
    result = run_named("flash_attn", batch, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
    check_result(result, batch, before, dtype)


def test_a_flash_attn_without_the_functions_is_a_one_line_error(monkeypatch):
    """An installed flash-attn of another major version: its import fails on a missing name."""
    monkeypatch.setattr(module, "missing_requirements", lambda *args: [])
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    with pytest.raises(UnavailableError, match="flash-attn package is installed but cannot be imported"):
        create(device="cpu")


def test_one_missing_requirement_is_enough_to_refuse(monkeypatch):
    monkeypatch.setattr(module, "missing_requirements", lambda *args: ["the one problem"])
    with pytest.raises(UnavailableError, match=r"^attention backend 'flash_attn' cannot run here: the one problem$"):
        create(device="cpu")


def test_a_cpu_device_on_a_machine_with_cuda_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "device cpu is not a CUDA device" in missing_requirements(256, torch.bfloat16, torch.device("cpu"), 64)
