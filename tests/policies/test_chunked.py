"""``chunked``: decodes and prefill chunks share one token budget, running requests first."""
import pytest

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.common.request import RequestStatus


def engine(policy="chunked", **kw):
    args = dict(model="tiny-llama", policy=policy, max_model_len=512, block_size=16, max_num_batched_tokens=64,
                max_num_seqs=8, check_invariants=True)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def long_prompt_among_decodes(e, prompt_len=300):
    """Three short requests start decoding, then a long prompt arrives. Returns each step's
    output from the long prompt's arrival until its first token, and the long prompt's id."""
    for i in range(3):
        e.add_request(f"short{i}", [5 + i] * 8, greedy(40))
    e.step()
    e.step()
    e.add_request("long", list(range(3, 3 + prompt_len)), greedy(4))
    steps = []
    e.step_callbacks.append(lambda stats, out: steps.append(out))
    while not e.scheduler.requests["long"].num_output_tokens:
        e.step()
    e.step_callbacks.clear()
    e.abort_request([f"short{i}" for i in range(3)] + ["long"])
    e.step()
    return steps


def test_decodes_keep_flowing_while_a_long_prompt_is_prefilled_in_chunks():
    steps = long_prompt_among_decodes(engine())
    chunks = []
    for out in steps:
        counts = {r.request_id: out.num_scheduled_tokens[r.request_id] for r in out.scheduled}
        assert [counts[f"short{i}"] for i in range(3)] == [1, 1, 1], "every decode runs every step"
        chunks.append(counts["long"])
        assert out.total_num_scheduled_tokens <= 64
    assert chunks == [61, 61, 61, 61, 56], "the prompt takes what the decodes leave of the budget"
    assert [r.request_id for r in steps[0].scheduled][:3] == ["short0", "short1", "short2"], "running first"


def test_long_prefill_token_threshold_caps_a_chunk():
    steps = long_prompt_among_decodes(engine(policy_options={"long_prefill_token_threshold": 32}))
    assert [out.num_scheduled_tokens["long"] for out in steps] == [32] * 9 + [12]
    assert all(out.total_num_scheduled_tokens == 35 for out in steps[:-1])


def test_fcfs_stalls_decodes_for_the_same_prompt():
    # The contrast: prefill-first FCFS (with a budget the prompt fits in) runs it alone.
    steps = long_prompt_among_decodes(engine(policy="fcfs", max_num_batched_tokens=512))
    assert [list(out.num_scheduled_tokens.values()) for out in steps] == [[300]]


def test_max_num_seqs_and_admission_order():
    e = engine(max_num_seqs=2)
    for i in range(4):
        e.add_request(str(i), [9 + i] * 5, greedy(3))
    steps = []
    e.step_callbacks.append(lambda stats, out: steps.append(out))
    while e.has_unfinished_requests():
        e.step()
    assert all(out.num_reqs <= 2 for out in steps)
    admitted = [r.request_id for out in steps for r in out.new_requests]
    assert admitted == ["0", "1", "2", "3"]


@pytest.mark.parametrize("threshold", [-1, True, 2.5])
def test_bad_threshold_is_rejected(threshold):
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        engine(policy_options={"long_prefill_token_threshold": threshold})


@pytest.mark.parametrize("policy_name", ["sjf", "priority_swap"])
def test_an_on_waiting_override_that_skips_the_waiting_heap_is_reported(policy_name):
    """The waiting heap (``waiting_key``) is fed by ``on_waiting``: an override that does not
    call it would leave every waiting request unseen, so the policy says so instead."""
    from framework.scheduling.policy import POLICIES
    from tests.policies.harness import sim_engine

    class Forgetful(POLICIES.get(policy_name)):
        def on_waiting(self, request):
            pass

    e = sim_engine(policy_name, Forgetful(), max_model_len=128)
    e.add_request("a", [3] * 10, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match=r"must call super\(\).on_waiting"):
        e.step()


# -- vLLM 0.32's newer defaults (issue 26), each with the earlier behaviour one option away ---------------------
def scheduler(num_blocks=9, budget=16, policy="chunked", num_cpu_blocks=0, max_num_seqs=8, **options):
    """A bare scheduler over blocks of 4 tokens (``num_blocks - 1`` usable), with prefix caching."""
    from framework.common.clock import VirtualClock
    from framework.kv.allocators.paged import PagedBlockAllocator
    from framework.scheduling.policy import POLICIES
    from framework.scheduling.scheduler import Scheduler

    config = EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
                          check_invariants=True)
    return Scheduler(config, POLICIES.create(policy, **options), PagedBlockAllocator(num_blocks, 4, num_cpu_blocks),
                     VirtualClock())


def arrive(s, rid, prompt, max_tokens=20, arrival_time=None):
    from framework.common.request import Request

    request = Request(rid, prompt, greedy(max_tokens),
                      arrival_time=float(len(s.requests)) if arrival_time is None else arrival_time)
    s.add_request(request)
    return request


def run_step(s):
    """One step; every request that reaches the end of its tokens samples token 7. Returns {id: tokens}."""
    out = s.schedule()
    s.update_from_output(out, {r.request_id: 7 for r in out.scheduled
                               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens})
    return {r.request_id: out.num_scheduled_tokens[r.request_id] for r in out.scheduled}


@pytest.mark.parametrize("options, admitted", [({}, {"a": 8}), ({"reserve_full_prompt": True}, {"a": 8}),
                                               ({"reserve_full_prompt": False}, {"a": 8, "b": 8})])
def test_a_prompt_is_admitted_only_when_all_its_blocks_fit(options, admitted):
    # 8 usable blocks; a takes 2, leaving 6: b's first chunk (2 blocks) fits, its whole prompt (7) does not.
    s = scheduler(**options)
    arrive(s, "a", list(range(10, 18)))
    arrive(s, "b", list(range(30, 58)))
    assert run_step(s) == admitted


@pytest.mark.parametrize("held", [True, False])
def test_full_prompt_admission_counts_a_free_cached_hit_as_taken(held):
    # b's prompt (7 blocks) starts with a's first 2 blocks, and 5 blocks are free. Held by a (running), the
    # hit costs no free block: b needs 5, and is admitted. Freed by a (cached, free), the 2 are taken from
    # the pool too: 7 > 5, and b waits (its first chunk, 2 + 2 blocks, would fit). vLLM 0.32 counts so.
    s = scheduler(budget=8)
    shared = list(range(10, 18))
    arrive(s, "a", shared + [99], max_tokens=20 if held else 1)
    run_step(s), run_step(s)
    if not held:  # a finished; c takes 3 blocks that cache nothing, leaving a's 2 cached ones free
        arrive(s, "c", list(range(60, 71)))
        run_step(s), run_step(s)
        assert s.allocator.num_cached_blocks == 2
    assert s.allocator.num_free_blocks == 5
    arrive(s, "b", shared + list(range(40, 60)))
    assert ("b" in run_step(s)) == held


@pytest.mark.parametrize("options, chunks", [({}, [40]), ({"long_prefill_cap_when_alone": False}, [40]),
                                             ({"long_prefill_cap_when_alone": True}, [8] * 5)])
def test_the_long_prefill_cap_is_lifted_for_a_request_alone(options, chunks):
    s = scheduler(num_blocks=40, budget=64, long_prefill_token_threshold=8, **options)
    arrive(s, "a", list(range(10, 50)), max_tokens=1)
    assert [run_step(s)["a"] for _ in chunks] == chunks


def test_the_long_prefill_cap_holds_when_another_request_waits_or_runs():
    s = scheduler(num_blocks=40, budget=64, long_prefill_token_threshold=8)
    arrive(s, "a", list(range(10, 50)), max_tokens=1)
    arrive(s, "b", list(range(60, 100)), max_tokens=1)
    assert run_step(s) == {"a": 8, "b": 8}


@pytest.mark.parametrize("option, value", [("reserve_full_prompt", "yes"), ("long_prefill_cap_when_alone", 1)])
@pytest.mark.parametrize("policy", ["chunked", "priority_swap", "sjf"])
def test_a_flag_that_is_not_a_bool_is_refused(policy, option, value):
    with pytest.raises(ValueError, match=f"^{option} must be true or false, got {value!r}$"):
        scheduler(policy=policy, **{option: value})


# -- swapped requests coming back ----------------------------------------------------------------------------------
def swap_out_by_hand(s, *requests):
    """One step in which the policy swaps ``requests`` out (as a shortage of blocks would), then runs nothing."""
    schedule = s.policy.schedule
    s.policy.schedule = lambda sch, step: [sch.preempt(step, r, "swap") for r in requests] and None
    try:
        run_step(s)
    finally:
        s.policy.schedule = schedule
    assert all(r.status == RequestStatus.SWAPPED for r in requests)


def test_nothing_is_swapped_in_when_the_running_requests_take_the_whole_budget():
    # Swapped in with no tokens, a request would hold device blocks without running, step after step.
    s = scheduler(num_blocks=20, budget=4, num_cpu_blocks=8, max_num_seqs=4, preemption_mode="swap")
    b = arrive(s, "b", list(range(3, 7)))
    run_step(s)
    arrive(s, "a", list(range(10, 34)))
    run_step(s)
    swap_out_by_hand(s, b)
    for _ in range(3):
        assert run_step(s) == {"a": 4}
        assert b.status == RequestStatus.SWAPPED and not b.block_ids
    for rid in ("a", "b"):
        s.abort_request(rid)


def test_swapped_requests_come_back_in_arrival_time_order_not_the_order_received():
    s = scheduler(num_blocks=20, budget=8, num_cpu_blocks=8, preemption_mode="swap")
    x = arrive(s, "x", list(range(3, 7)), arrival_time=5.0)  # received first, arrived later
    y = arrive(s, "y", list(range(20, 24)), arrival_time=1.0)
    run_step(s)
    swap_out_by_hand(s, y, x)
    out = s.schedule()
    assert [r.request_id for r in out.swapped_in] == ["y", "x"]
    for rid in ("x", "y"):
        s.abort_request(rid)
