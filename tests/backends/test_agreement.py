"""Every attention backend agrees with a float64 reference on random batches, fills every output
element, and writes exactly the cache slots it is given (nothing else): the cases of
``framework.testing.attention``, which a plugin's tests run through ``check_backend``.

Outputs start as NaN, so an element a backend forgets to write fails the NaN check; every unused
cache slot (block tails, spare blocks, the null block that pads the block table) holds large random
values, so a backend that lets one into a softmax fails the error check.
"""
from __future__ import annotations

import pytest
import torch

from framework.testing.attention import cases, run_case

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (backend, device): every backend on CPU, and on CUDA when a GPU is present. flash_attn has its
# own file (it needs CUDA, half precision and 256-token blocks).
TARGETS = [("naive", "cpu"), ("torch_paged", "cpu"), ("triton", "cpu")] + [
    pytest.param(name, "cuda", marks=[gpu, needs_cuda]) for name in ("naive", "torch_paged", "triton")]
CASES = cases()


@pytest.mark.parametrize("name, device", TARGETS)
@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c.kind}-{c.layout}" for i, c in enumerate(CASES)])
def test_backend_matches_float64_reference(name, device, case):
    run_case(name, case, device)
