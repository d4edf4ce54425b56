"""The KV-leak check: an engine whose requests are done (or aborted) holds no KV block, on the device or in swap."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from framework.engine.llm_engine import LLMEngine


def assert_no_kv_leaks(engine: LLMEngine) -> None:
    """Abort what ``engine`` still runs, then assert every block is free again (cached prefix blocks count as
    free: they are reclaimable) and the allocator's books are consistent."""
    engine.abort_request(list(engine.output_processor.requests))
    alloc = engine.allocator
    assert alloc.num_free_blocks == alloc.num_usable_blocks, (
        f"KV blocks leaked: {alloc.num_usable_blocks - alloc.num_free_blocks} of {alloc.num_usable_blocks} still held")
    assert alloc.num_free_cpu_blocks == alloc.num_cpu_blocks, "swap blocks leaked"
    alloc.check_invariants([])


@contextmanager
def kv_leaks_checked() -> Iterator[list[LLMEngine]]:
    """Within the block, every ``LLMEngine`` built is kept; on leaving it (without an error), each must pass
    ``assert_no_kv_leaks``. Yields the list of engines built so far."""
    engines: list[LLMEngine] = []  # strong references: a test's locals are gone by then
    original = LLMEngine.__init__

    def tracking_init(self: LLMEngine, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        engines.append(self)

    LLMEngine.__init__ = tracking_init  # type: ignore[method-assign]
    try:
        yield engines
    finally:
        LLMEngine.__init__ = original  # type: ignore[method-assign]
    for engine in engines:
        if hasattr(engine, "allocator"):  # one whose construction failed holds nothing
            assert_no_kv_leaks(engine)
