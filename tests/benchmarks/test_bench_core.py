"""Speed guards for the core (``make bench``; in the default test run each body runs once, untimed).

``make bench`` shows each case beside the saved baseline (``tests/benchmarks/baselines``, taken with
``make bench-baseline``); ratios between cases in one run are what to read, since the machine drifts by
tens of percent between runs.
"""
import json
import random

import numpy as np
import pytest
import torch

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.kv.allocators.paged import PagedBlockAllocator
from framework.execution.preparers.v1 import FlatBatchPreparer
from framework.common.request import Request, RequestStatus
from framework.scheduling.output import SchedulerOutput
from framework.harness.workload import WorkloadContext
from framework.harness.workloads.trace import TraceError, load_trace


@pytest.mark.parametrize("batch", [8, 64])
def test_engine_decode_step(benchmark, batch):
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=512, max_num_seqs=batch))
    for i in range(batch):
        engine.add_request(str(i), list(range(3, 3 + 64)), SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill; every later step is a pure decode of `batch` requests
    benchmark(engine.step)
    engine.abort_request([str(i) for i in range(batch)])
    engine.step()


class NoModel(torch.nn.Module):
    """Stands in for the model so that a step costs only its CPU side: hidden states and logits of
    the right shapes, made once (the logits favour one token, so greedy sampling has one answer)."""

    def __init__(self, hidden: int, vocab: int, max_rows: int) -> None:
        super().__init__()
        self.hidden = torch.zeros(max_rows, hidden)
        self.logits = torch.zeros(max_rows, vocab)
        self.logits[:, 7] = 1.0

    def forward(self, input_ids, positions, kv_cache, meta):
        return self.hidden[:len(input_ids)]

    def compute_logits(self, hidden):
        return self.logits[:len(hidden)]


@pytest.mark.parametrize("running", [64, 256])
def test_step_loop_cpu_side(benchmark, running):
    """One decode step of ``running`` requests without the forward pass: scheduler, input
    preparation, attention metadata, sampler and outputs (final only, as ``LLM.generate`` asks),
    the CPU work every step adds."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=2048, max_num_seqs=running,
                                    max_num_batched_tokens=max(2048, running)))
    cfg = engine.model_config
    engine.executor.runner.model = NoModel(cfg.hidden_size, cfg.vocab_size, max(2048, running))
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(running):
        engine.add_request(str(i), list(range(3, 3 + 16 + i % 32)), params)
    while engine.scheduler.waiting:
        engine.step()  # the prefills; every later step is a pure decode of `running` requests
    benchmark(engine.step, final_only=True)
    assert len(engine.scheduler.running) == running
    engine.abort_request([str(i) for i in range(running)])
    engine.step()


@pytest.mark.parametrize("running", [64, 256])
def test_async_step_loop_cpu_side(benchmark, running):
    """``test_step_loop_cpu_side`` with async scheduling: commit and placeholders instead of the update,
    the runner's deferred tokens (read the ratio to that case: what the overlap has to hide)."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=2048, max_num_seqs=running,
                                    max_num_batched_tokens=max(2048, running), async_scheduling=True))
    cfg = engine.model_config
    engine.executor.runner.model = NoModel(cfg.hidden_size, cfg.vocab_size, max(2048, running))
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(running):
        engine.add_request(str(i), list(range(3, 3 + 16 + i % 32)), params)
    while engine.scheduler.waiting or engine.scheduler.requests["0"].num_computed_tokens < 64:
        engine.step()
    benchmark(engine.step, final_only=True)
    assert len(engine.scheduler.running) == running
    engine.abort_request([str(i) for i in range(running)])
    engine.step()


@pytest.mark.parametrize("argmax", ["torch", "fused"])
def test_greedy_sampling_at_a_llama3_vocabulary(benchmark, argmax):
    """Greedy sampling of 64 rows of a 128,256-token vocabulary: torch's argmax against the fused
    operator the model executor gives the sampler on a CPU (read the two cases' ratio)."""
    from framework.execution.input_preparer import SamplingMetadata
    from framework.execution.sampler import Sampler
    from models.cpu_ops import fused_ops

    logits = torch.randn(64, 128256, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(fused_ops=fused_ops() if argmax == "fused" else None)
    tokens = benchmark(sampler, logits, SamplingMetadata(temperature=torch.zeros(64)))
    assert torch.equal(tokens, logits.argmax(dim=-1))


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


def test_allocator_decode_step(benchmark):
    """One token for each of 64 running requests, as a decode step asks: most need no new block."""
    alloc = PagedBlockAllocator(num_blocks=4097, block_size=32)
    reqs = [Request(str(i), list(range(3, 43 + i)), SamplingParams(), 0.0) for i in range(64)]
    for r in reqs:
        assert alloc.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens - 1

    def step():
        for r in reqs:
            alloc.allocate_slots(r, 1)

    benchmark(step)
    assert all(len(r.block_ids) == -(-r.num_tokens // 32) for r in reqs)
    for r in reqs:
        alloc.free(r)
    alloc.check_invariants([])


@pytest.mark.parametrize("num_reqs", [64, 256])
def test_v1_prepare(benchmark, num_reqs):
    """A steady step: every request moved on by one step (decodes feed back their sampled token,
    prompts continue with their next chunk). Each round refills the preparer with the step before
    (untimed): v1's rows advance with every step they prepare."""
    bs, max_len = 16, 2048
    prep = FlatBatchPreparer(max_num_reqs=num_reqs, max_model_len=max_len, block_size=bs, max_num_batched_tokens=8192)
    rng = random.Random(0)
    reqs, nxt, counts, next_counts, next_block = [], [], {}, {}, 1
    for i in range(num_reqs):
        n = rng.randrange(32, 1024)
        decode = i % 4 != 0
        r = Request(str(i), list(range(n)), SamplingParams(), 0.0)
        r.status = RequestStatus.RUNNING
        r.block_ids = list(range(next_block, next_block + n // bs + 1))  # room for one more token
        next_block += len(r.block_ids)
        r.num_computed_tokens = n - 1 if decode else 0
        counts[r.request_id] = 1 if decode else 32
        q = Request(r.request_id, r.prompt_token_ids, r.sampling_params, 0.0)
        q.status, q.block_ids = RequestStatus.RUNNING, r.block_ids
        q.num_computed_tokens = r.num_computed_tokens + counts[r.request_id]
        q.token_ids = r.token_ids + [7] if q.num_computed_tokens == n else list(r.token_ids)
        next_counts[q.request_id] = min(32, q.num_tokens - q.num_computed_tokens)
        reqs.append(r)
        nxt.append(q)
    fill = SchedulerOutput(scheduled=reqs, num_scheduled_tokens=counts, new_requests=reqs)
    steady = SchedulerOutput(scheduled=nxt, num_scheduled_tokens=next_counts)

    def setup():
        prep.prepare(SchedulerOutput(finished_req_ids=set(counts)))
        model_input = prep.prepare(fill)
        prep.record_sampled(model_input, np.full(len(model_input.sample_req_ids), 7, dtype=np.int64))
        return (steady,), {}

    out = benchmark.pedantic(prep.prepare, setup=setup, rounds=max(10, 2000 // num_reqs), warmup_rounds=1)
    assert out.attn_metadata.num_actual_tokens == sum(next_counts.values())


def test_trace_with_a_late_duplicate_id_is_refused(benchmark, tmp_path):
    # Finding the duplicated id called list.count per id: 3 s for 20,000 requests, 12 s for 40,000.
    path = tmp_path / "trace.jsonl"
    n = 20_000
    path.write_text("".join(json.dumps({"request_id": str(min(i, n - 2)), "prompt_token_ids": [5, 6, 7], "output_len": 4,
                                        "arrival_time": i / 100}) + "\n" for i in range(n)))

    def load():
        with pytest.raises(TraceError, match=f"'{n - 2}' appears more than once"):
            load_trace(path, WorkloadContext(vocab_size=1000))

    benchmark(load)
