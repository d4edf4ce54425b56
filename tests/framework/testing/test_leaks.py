"""framework.testing's KV-leak check: it passes an engine whose requests are done or in flight, and fails
one whose allocator still holds blocks that no request of the engine will give back."""
import pytest

from framework.common.request import Request
from framework.common.sampling_params import SamplingParams
from framework.testing.leaks import assert_no_kv_leaks, kv_leaks_checked
from framework.testing.shadow import shadow_engine


def test_an_engine_with_requests_in_flight_passes_once_they_are_aborted():
    with kv_leaks_checked() as engines:
        engine = shadow_engine("chunked", num_blocks=20)
        engine.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()
        assert engine.allocator.num_free_blocks < engine.allocator.num_usable_blocks
    assert engines == [engine]


def test_blocks_held_outside_any_request_are_a_leak():
    engine = shadow_engine("chunked", num_blocks=20)
    stray = Request("stray", list(range(3, 12)), SamplingParams(max_tokens=1), arrival_time=0.0)
    assert engine.allocator.allocate_slots(stray, 9)
    with pytest.raises(AssertionError, match="KV blocks leaked: 3 of 19 still held"):
        assert_no_kv_leaks(engine)
    engine.allocator.free(stray)  # or this test's own engine would fail the suite's check too
