"""Builds a C++ source into a torch extension for this CPU, on first use, cached per user.

A build takes about a minute and is kept under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), named by the instruction set and a hash of the source, its headers, flags and
paths: two checkouts would otherwise take turns rebuilding one folder (ninja rebuilds for another path).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

import torch

from framework.common.registry import UnavailableError

#: Vector flags per torch's CPU capability, instead of -march=native: a cached build must not use
#: instructions that another machine sharing the cache lacks.
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
             "AVX2": ["-mavx2", "-mfma", "-mf16c"]}
#: Headers shared by the kernels (``fast_exp.h``).
INCLUDE = Path(__file__).resolve().parent / "csrc"
#: -fopenmp makes at::parallel_for parallel (it is serial without it); -fassociative-math lets the
#: compiler vectorise float sums (it needs the two after it).
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


#: The programs of a build (``/proc/PID/comm``): a shell that was left in the folder builds nothing.
BUILD_TOOLS = frozenset({"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "as", "ld", "collect2", "clang", "clang++"})


def working_in(folder: Path) -> bool:
    """Whether a build's program (``BUILD_TOOLS``: ninja, the compiler, the linker) runs in ``folder``, its working
    directory; False where ``/proc`` does not tell."""
    target = str(folder.resolve())
    for process in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(process / "cwd") == target and (process / "comm").read_text().strip() in BUILD_TOOLS:
                return True
        except OSError:  # gone, or another user's
            continue
    return False


@functools.lru_cache(maxsize=None)
def load_cpu_extension(name: str, source: Path, what: str, extra_flags: tuple[str, ...] = ()) -> ModuleType:
    """The extension built from ``source`` (with ``extra_flags``); UnavailableError naming ``what`` and
    the reason when it cannot be built here (no compiler, no ninja, a failed build)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = [*CFLAGS, *ISA_FLAGS.get(capability, []), *extra_flags]
    headers = b"".join(h.read_bytes() for h in sorted(INCLUDE.glob("*.h")))
    paths = f"{source.resolve()}\0{INCLUDE}".encode()
    digest = hashlib.sha1(source.read_bytes() + headers + " ".join(flags).encode() + paths).hexdigest()[:12]
    full_name = f"servelab_{name}_{capability.lower().replace(' ', '_')}_{digest}"
    if shutil.which("ninja") is None:  # pip's ninja sits in the venv's bin, off PATH when it is not activated
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        build_dir = Path(_get_build_directory(full_name, verbose=False))
        with open(build_dir / "servelab.lock", "w") as held:
            # torch's own lock is a file it waits on for good, left behind by a build whose process was killed.
            # The flock goes with its process, so holding it means no live load of this extension; a killed one's
            # compilers may still run (in the folder), and are waited for rather than raced.
            fcntl.flock(held, fcntl.LOCK_EX)
            if (build_dir / "lock").exists():
                while working_in(build_dir):
                    time.sleep(1)
                (build_dir / "lock").unlink(missing_ok=True)
            return load(full_name, [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                        extra_include_paths=[str(INCLUDE)], verbose=False)
    except Exception as exc:  # the reason is in the first lines
        reason = " ".join(str(exc).split())[:300]
        raise UnavailableError(f"{what} could not be built ({type(exc).__name__}: {reason}); it needs a C++ "
                               f"compiler and ninja") from exc
