"""C++ kernels for CPUs (``backends/csrc``), built on first use by torch's extension loader.

A build takes about a minute and is cached per user (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) under a name that carries the source's hash and the instruction set.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from framework.common.registry import UnavailableError

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_paged_decode.cpp"
#: Vector flags per torch's CPU capability, instead of -march=native: a cached build must not use
#: instructions that another machine sharing the cache lacks.
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
             "AVX2": ["-mavx2", "-mfma", "-mf16c"]}
#: -fassociative-math lets the compiler vectorise the float sums (it needs the two after it).
CFLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


@functools.lru_cache(maxsize=None)
def paged_decode() -> Callable[..., None]:
    """``paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, out)`` (see the source);
    UnavailableError, naming what is missing, when it cannot be built here."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = [*CFLAGS, *ISA_FLAGS.get(capability, [])]
    digest = hashlib.sha1(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    name = f"servelab_paged_decode_{capability.lower().replace(' ', '_')}_{digest}"
    if shutil.which("ninja") is None:  # pip's ninja sits in the venv's bin, off PATH when it is not activated
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    try:
        from torch.utils.cpp_extension import load

        module = load(name, [str(SOURCE)], extra_cflags=flags, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the reason is in the first lines
        reason = " ".join(str(exc).split())[:300]
        raise UnavailableError(f"the C++ decode kernel for CPUs could not be built ({type(exc).__name__}: {reason}); "
                               f"it needs a C++ compiler and ninja; or set backend.decode_kernel=sdpa") from exc
    return module.paged_decode
