"""Speed guards for the core (``make bench``; in the default test run each body runs once, untimed).

Compare runs with ``pytest tests/benchmarks --benchmark-enable --benchmark-autosave`` then
``--benchmark-compare``; ratios between cases in one run are what to read, not absolute times.
"""
import random

import pytest

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.allocators.paged import PagedBlockAllocator
from framework.preparers.v1 import FlatBatchPreparer
from framework.request import Request, RequestStatus
from framework.scheduler import SchedulerOutput


@pytest.mark.parametrize("batch", [8, 64])
def test_engine_decode_step(benchmark, batch):
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=512, max_num_seqs=batch))
    for i in range(batch):
        engine.add_request(str(i), list(range(3, 3 + 64)), SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill; every later step is a pure decode of `batch` requests
    benchmark(engine.step)
    engine.abort_request([str(i) for i in range(batch)])
    engine.step()


def test_allocator_allocate_and_free(benchmark):
    alloc = PagedBlockAllocator(num_blocks=4097, block_size=16)
    rng = random.Random(0)
    reqs = [Request(str(i), [rng.randrange(1000) for _ in range(rng.randrange(16, 512))], SamplingParams(), 0.0)
            for i in range(64)]

    def cycle():
        for r in reqs:
            hit = alloc.find_prefix(r)
            alloc.allocate_slots(r, r.num_tokens - hit.num_tokens, hit)
        for r in reqs:
            alloc.free(r)

    benchmark(cycle)
    alloc.check_invariants([])


@pytest.mark.parametrize("num_reqs", [64, 256])
def test_v1_prepare(benchmark, num_reqs):
    bs, max_len = 16, 2048
    prep = FlatBatchPreparer(max_num_reqs=num_reqs, max_model_len=max_len, block_size=bs, max_num_batched_tokens=8192)
    rng = random.Random(0)
    reqs, counts, next_block = [], [], 1
    for i in range(num_reqs):
        n = rng.randrange(32, 1024)
        r = Request(str(i), list(range(n)), SamplingParams(), 0.0)
        r.status = RequestStatus.RUNNING
        r.block_ids = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(r.block_ids)
        decode = i % 4 != 0
        r.num_computed_tokens = n - 1 if decode else 0
        reqs.append(r)
        counts.append(1 if decode else min(n, 32))
    out = SchedulerOutput(scheduled=reqs, num_scheduled_tokens={r.request_id: c for r, c in zip(reqs, counts)},
                          new_requests=reqs)
    prep.prepare(out)
    steady = SchedulerOutput(scheduled=reqs, num_scheduled_tokens=out.num_scheduled_tokens)
    benchmark(prep.prepare, steady)
