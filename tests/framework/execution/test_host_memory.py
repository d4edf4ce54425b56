import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from framework.execution import host_memory

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")),
                                reason="glibc >= 2.33 malloc (mallinfo2) only")

# In a fresh process (mallopt is process-wide): what glibc does with 8 MiB of 64 KiB blocks, then
# with a 24 MiB block (second: freeing a mapped block raises glibc's default thresholds), read
# from mallinfo2 (heap bytes from sbrk, bytes in mapped blocks).
# host_memory.py is loaded by its path, not through `import framework`: that imports numpy and
# some 270 modules, and one freeing a big mapped block would raise glibc's thresholds first.
MALLOC_PROBE = textwrap.dedent("""
    import ctypes, importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("host_memory", HOST_MEMORY_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    keep_freed_memory = module.keep_freed_memory
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                         "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    kept = keep_freed_memory() if sys.argv[1] == "keep" else False
    def info():
        m = libc.mallinfo2()
        return {"heap": m.arena, "mapped": m.hblkhd}
    out = {"kept": kept, "start": info()}
    small = [libc.malloc(64 << 10) for _ in range(128)]
    out["small"] = info()
    for p in reversed(small):
        libc.free(p)
    out["small_freed"] = info()
    big = libc.malloc(24 << 20)
    out["big"] = info()
    libc.free(big)
    out["big_freed"] = info()
    print(json.dumps(out))
""").replace("HOST_MEMORY_PY", repr(host_memory.__file__))
MiB = 1 << 20


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in host_memory.MALLOC_ENV and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", MALLOC_PROBE, mode], capture_output=True, text=True, check=True,
                         env={**clean, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_glibc_defaults_map_big_blocks_and_trim_the_heap():
    # The premise of keep_freed_memory: without it, freed memory goes back to the kernel.
    out = probe("plain")
    assert out["kept"] is False
    assert out["big"]["mapped"] - out["start"]["mapped"] >= 24 * MiB
    assert out["big_freed"]["mapped"] == out["start"]["mapped"]
    assert out["small"]["heap"] - out["small_freed"]["heap"] >= 4 * MiB  # the heap's top was trimmed


def test_kept_memory_stays_in_the_heap():
    out = probe("keep")
    assert out["kept"] is True
    assert out["big"]["mapped"] == out["start"]["mapped"]  # 24 MiB < the 32 MiB threshold: from the heap
    assert out["big"]["heap"] - out["start"]["heap"] >= 23 * MiB  # (reusing what was free at the start)
    assert out["big_freed"]["heap"] == out["big"]["heap"]  # not trimmed
    assert out["small_freed"]["heap"] == out["small"]["heap"]


def test_a_user_who_tuned_malloc_is_left_alone():
    out = probe("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert out["kept"] is False
    assert out["small"]["heap"] - out["small_freed"]["heap"] >= 4 * MiB  # the user's threshold trims


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])
def test_user_tuning_is_read_from_the_environment(monkeypatch, env):
    monkeypatch.setattr(host_memory, "_kept", False)
    for name in (*host_memory.MALLOC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert not host_memory.user_tuned_malloc()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F")  # not a malloc tunable
    assert not host_memory.user_tuned_malloc()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert host_memory.user_tuned_malloc()
    assert host_memory.keep_freed_memory() is False


def test_once_kept_later_calls_say_so_whatever_the_environment_says_now(monkeypatch):
    for name in (*host_memory.MALLOC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert host_memory.keep_freed_memory() is True  # as every CPU engine in this process does
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host_memory.keep_freed_memory() is True


def test_a_cpu_model_engine_keeps_freed_memory(monkeypatch):
    from framework import LLMEngine

    calls = []
    monkeypatch.setattr("framework.execution.executors.model.keep_freed_memory", lambda: calls.append(1) or True)
    LLMEngine(model="tiny-llama", device="cpu", max_model_len=64, num_gpu_blocks_override=8)
    assert calls == [1]


def test_to_device_on_the_cpu_shares_the_array_unless_a_dtype_is_asked():
    import numpy as np
    import torch

    array = np.arange(6, dtype=np.int64)
    shared = host_memory.to_device(array, torch.device("cpu"))
    array[0] = 42
    assert shared[0] == 42, "a CPU step reads the host array where it lies"
    converted = host_memory.to_device(array[::-2], torch.device("cpu"), torch.float32)
    assert converted.dtype == torch.float32 and converted.tolist() == [5.0, 3.0, 1.0]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_to_device_copies_through_pinned_memory_and_the_host_array_may_change_at_once():
    import numpy as np
    import torch

    array = np.arange(1 << 20, dtype=np.int64)
    on_device = host_memory.to_device(array, torch.device("cuda"), torch.int32)
    array[:] = -1  # the staged pinned copy is what travels
    assert on_device.device.type == "cuda" and on_device.dtype == torch.int32
    assert torch.equal(on_device.cpu(), torch.arange(1 << 20, dtype=torch.int32))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazy_zeros_on_the_cpu_take_memory_only_where_written(dtype):
    before = _rss_bytes()
    zeros = host_memory.lazy_zeros((2, 4, 1 << 25), dtype, torch.device("cpu"))  # 0.5-1 GiB
    assert zeros.shape == (2, 4, 1 << 25) and zeros.dtype == dtype and zeros.is_contiguous()
    zeros[1, 3, -1] = 2.0
    zeros[0, 0, 0] = 1.0
    assert _rss_bytes() - before < 32 << 20
    assert zeros[0, 1, :1000].abs().sum() == 0 and zeros[1, 3, -2:].tolist() == [0.0, 2.0]
