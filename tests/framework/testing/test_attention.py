"""``check_backend`` passes a correct backend and names the first step a broken one gets wrong."""
from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F

from backends import naive
from backends.naive import NaiveBackend
from framework import BACKENDS
from framework.testing.attention import cases, check_backend


class _Broken(NaiveBackend):
    """The reference backend with one defect (``defect``), for check_backend to catch."""

    def __init__(self, *args, defect: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.defect = defect

    def forward(self, q, k, v, kv_cache, meta, out=None):
        if self.defect == "writes the null block":
            kv_cache[:, 0] = 0
        if self.defect == "drops the causal mask":
            sdpa = F.scaled_dot_product_attention
            unmasked = lambda q_, k_, v_, scale, **mask: sdpa(q_, k_, v_, scale=scale)  # noqa: E731
            with patch.object(naive.F, "scaled_dot_product_attention", unmasked):
                return super().forward(q, k, v, kv_cache, meta, out)
        if self.defect == "returns a new tensor" and out is not None:
            return super().forward(q, k, v, kv_cache, meta).clone()
        if self.defect == "ignores K/V head grouping" and self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            result = super().forward(q, k, v, kv_cache, meta, out)
            return result.copy_(result.roll(group, dims=1))
        return super().forward(q, k, v, kv_cache, meta, out)


@pytest.fixture
def broken_backend():
    BACKENDS.register("broken_for_test")(_Broken)
    yield
    BACKENDS._classes.pop("broken_for_test", None)


def test_check_backend_passes_the_reference_and_names_what_breaks(broken_backend):
    assert check_backend("naive") == len(cases())
    for defect, message in [("writes the null block", "touched slots outside slot_mapping"),
                            ("drops the causal mask", "vs the float64 reference"),
                            ("returns a new tensor", "must write into out"),
                            ("ignores K/V head grouping", "vs the float64 reference")]:
        with pytest.raises(AssertionError, match=message) as e:
            check_backend("broken_for_test", defect=defect)
        assert "backend 'broken_for_test' on a" in str(e.value) and "block size 16" in str(e.value)


def test_check_backend_runs_only_the_dtypes_and_block_sizes_a_backend_allows(broken_backend, monkeypatch):
    monkeypatch.setattr(_Broken, "supported_dtypes", (torch.float32,))
    monkeypatch.setattr(_Broken, "block_size_multiple", 32)
    seen = []
    original = _Broken.forward

    def recording(self, q, *args, **kwargs):
        seen.append((q.dtype, self.block_size))
        return original(self, q, *args, **kwargs)

    monkeypatch.setattr(_Broken, "forward", recording)
    check_backend("broken_for_test")
    assert set(seen) == {(torch.float32, 32), (torch.float32, 64)}  # the smallest allowed, and twice it
    monkeypatch.setattr(_Broken, "supported_dtypes", (torch.float64,))
    with pytest.raises(ValueError, match="supports none of"):
        check_backend("broken_for_test")


class _PowerOfTwoGroups(NaiveBackend):
    """Right only when the query heads per K/V head are a power of two: its output heads shift otherwise."""

    def forward(self, q, k, v, kv_cache, meta, out=None):
        result = super().forward(q, k, v, kv_cache, meta, out)
        group = self.num_heads // self.num_kv_heads
        return result.copy_(result.roll(1, dims=1)) if group & (group - 1) else result


class _FirstSixtyFourDims(NaiveBackend):
    """Scores queries against keys over the first 64 dimensions of each head only."""

    def forward(self, q, k, v, kv_cache, meta, out=None):
        if self.head_dim <= 64:
            return super().forward(q, k, v, kv_cache, meta, out)
        q = q.clone()
        q[..., 64:] = 0
        return super().forward(q, k, v, kv_cache, meta, out)


class _SixteenSlotBlocks(NaiveBackend):
    """Stores K/V as if blocks held at most 16 slots."""

    def forward(self, q, k, v, kv_cache, meta, out=None):
        if self.block_size <= 16:
            return super().forward(q, k, v, kv_cache, meta, out)
        slots = meta.slot_mapping
        wrong = slots // self.block_size * self.block_size + slots % self.block_size % 16
        naive.write_kv(k, v, kv_cache, wrong)
        out = torch.empty_like(q) if out is None else out
        return out.copy_(super().forward(q, k, v, kv_cache, meta, None))


@pytest.mark.parametrize("cls, said", [(_PowerOfTwoGroups, "6 query heads over 2 K/V heads"),
                                       (_FirstSixtyFourDims, "K/V heads of size 128"),
                                       (_SixteenSlotBlocks, "block size 32")])
def test_head_groupings_head_sizes_and_block_sizes_past_the_common_ones_are_checked(cls, said):
    BACKENDS.register("narrow_for_test")(cls)
    try:
        with pytest.raises(AssertionError, match=said):
            check_backend("narrow_for_test")
    finally:
        BACKENDS._classes.pop("narrow_for_test", None)


def test_block_size_one_is_checked_with_real_steps():
    assert check_backend("naive", block_size=1, dtypes=(torch.float32,)) == len(cases(1, (torch.float32,)))
