"""Greedy outputs do not depend on how a request was scheduled: whole or chunked prefill,
recompute preemption, or a trip through the swap space (whose KV must come back bit-exact)."""
import random

import pytest

from framework import EngineConfig, LLMEngine, SamplingParams
from tests.policies.test_priority_swap import swap_spy

MAX_TOKENS = 24


def workload():
    rng = random.Random(4)
    shared = [rng.randrange(3, 1024) for _ in range(32)]  # two full blocks, for prefix hits
    prompts = []
    for i in range(8):
        own = [rng.randrange(3, 1024) for _ in range(rng.randrange(8, 140))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def generate(policy, **kw):
    """Requests arrive one per step, later ones more urgent (for ``priority_swap``). Returns the
    outputs, the number of prefill chunks that did not finish a prompt, the engine, and the
    swapped-in blocks that were compared bit for bit."""
    args = dict(model="tiny-llama", policy=policy, max_model_len=256, block_size=16, max_num_batched_tokens=2048,
                max_num_seqs=8, check_invariants=True)
    args.update(kw)
    e = LLMEngine(EngineConfig(**args))
    checked = swap_spy(e)
    chunks, outs = [], {}
    # After a step, a request still short of its last token got only a chunk of its prefill.
    e.step_callbacks.append(lambda stats, out: chunks.append(sum(r.is_prefill for r in out.scheduled)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(workload()))
    while pending or e.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            e.add_request(str(i), prompt, params, priority=-i)
        outs.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
    return outs, sum(chunks), e, checked


@pytest.fixture(scope="module")
def reference():
    outs, chunks, e, _ = generate("fcfs")
    assert e.scheduler.num_preemptions == 0 and chunks == 0
    return outs


def test_chunked_prefill(reference):
    outs, chunks, e, _ = generate("chunked", max_num_batched_tokens=32)
    assert chunks > 10 and e.scheduler.num_preemptions == 0
    assert outs == reference


def test_recompute_preemption(reference):
    outs, _, e, _ = generate("chunked", max_num_batched_tokens=64, num_gpu_blocks_override=17)
    assert e.scheduler.num_preemptions > 0 and e.scheduler.num_swap_outs == 0
    assert e.allocator.stats.prefix_hit_tokens > 0
    assert outs == reference


def test_swap_preemption_with_chunked_prefill(reference):
    outs, chunks, e, checked = generate("priority_swap", max_num_batched_tokens=64, num_gpu_blocks_override=17)
    assert e.scheduler.num_swap_outs > 0 and chunks > 0
    assert len(checked) == e.allocator.stats.blocks_swapped_in > 0, "every swapped-in block was compared"
    assert outs == reference
