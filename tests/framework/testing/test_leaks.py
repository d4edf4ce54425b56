"""framework.testing's KV-leak check: it passes an engine whose requests are done or in flight, and fails
one whose allocator still holds blocks that no request of the engine will give back."""
from types import SimpleNamespace

import pytest

from framework.common.request import Request
from framework.engine.llm_engine import LLMEngine
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


def test_a_single_block_held_is_a_leak():
    engine = shadow_engine("chunked", num_blocks=20)
    stray = Request("stray", [3, 4], SamplingParams(max_tokens=1), arrival_time=0.0)
    assert engine.allocator.allocate_slots(stray, 2)
    try:
        with pytest.raises(AssertionError, match="KV blocks leaked: 1 of 19 still held"):
            assert_no_kv_leaks(engine)
    finally:
        engine.allocator.free(stray)


def test_leaving_the_block_restores_engine_construction_and_checks_every_engine_built():
    init = LLMEngine.__init__
    with pytest.raises(AssertionError, match="KV blocks leaked"):
        with kv_leaks_checked():
            engine = shadow_engine("chunked", num_blocks=20)
            stray = Request("stray", list(range(3, 12)), SamplingParams(max_tokens=1), arrival_time=0.0)
            assert engine.allocator.allocate_slots(stray, 9)
    engine.allocator.free(stray)
    assert LLMEngine.__init__ is init


def _stub_engine(allocator):
    return SimpleNamespace(abort_request=lambda ids: None, output_processor=SimpleNamespace(requests={}),
                           allocator=allocator)


def test_swap_blocks_held_are_a_leak():
    allocator = SimpleNamespace(num_free_blocks=9, num_usable_blocks=9, num_free_cpu_blocks=3, num_cpu_blocks=4,
                                check_invariants=lambda requests: None)
    with pytest.raises(AssertionError, match="swap blocks leaked"):
        assert_no_kv_leaks(_stub_engine(allocator))


def test_inconsistent_allocator_books_fail_the_check():
    def check_invariants(requests):
        assert list(requests) != [], "books inconsistent"

    allocator = SimpleNamespace(num_free_blocks=9, num_usable_blocks=9, num_free_cpu_blocks=4, num_cpu_blocks=4,
                                check_invariants=check_invariants)
    with pytest.raises(AssertionError, match="books inconsistent"):
        assert_no_kv_leaks(_stub_engine(allocator))
