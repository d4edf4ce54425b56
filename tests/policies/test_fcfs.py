"""FCFS: prefill-first batches, arrival order, newest-first recompute preemption."""
import pytest

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.common.request import RequestStatus
from framework.scheduling.policy import POLICIES
from framework.testing.registries import forget_registrations
from policies.fcfs import FCFSPolicy


def engine(**kw):
    # max_model_len no more than the budget: fcfs is refused a budget that a prompt it takes could exceed.
    args = dict(model="tiny-llama", max_model_len=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                check_invariants=True)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def drain(e, record):
    e.step_callbacks.append(lambda stats, out: record.append(out))
    while e.has_unfinished_requests():
        e.step()


def test_steps_are_all_prefill_or_all_decode_and_respect_budgets():
    e = engine()
    for i in range(6):
        e.add_request(str(i), list(range(3, 3 + 10 + 5 * i)), greedy(5))
    steps = []
    drain(e, steps)
    for out in steps:
        counts = list(out.num_scheduled_tokens.values())
        prefill = [r for r in out.scheduled if out.num_scheduled_tokens[r.request_id] > 1]
        assert not prefill or len(prefill) == len(counts), "fcfs never mixes prefills with decodes"
        assert sum(counts) <= 64 and len(counts) <= 4
    first_admitted = [r.request_id for r in steps[0].new_requests]
    assert first_admitted == sorted(first_admitted, key=int), "admitted in arrival order"


def test_newest_request_is_preempted_and_everyone_finishes():
    # 9 usable blocks of 4 tokens: three 10-token prompts fit, then decodes run out of blocks.
    e = engine(num_gpu_blocks_override=10, max_model_len=32)
    for i in range(3):
        e.add_request(str(i), list(range(3, 13)), greedy(12))
    steps = []
    drain(e, steps)
    preempted = [r.request_id for out in steps for r in out.preempted]
    assert preempted and preempted[0] == "2", "the most recently admitted request goes first"
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for out in steps for r in out.scheduled
               if r.is_finished)
    assert not e.has_unfinished_requests()


class LastComeFirstServed(FCFSPolicy):
    def waiting_order(self, waiting):
        return reversed(waiting)  # an Iterable, as the hook may return: a view of the queue


def test_waiting_order_may_return_a_view_of_the_queue(monkeypatch):
    """FCFS iterated the hook's answer while admitting (so removing from the queue): a reversed
    view failed with 'deque mutated during iteration'."""
    forget_registrations(monkeypatch, POLICIES)
    POLICIES.register("test_lifo")(LastComeFirstServed)
    e = engine(policy="test_lifo", max_num_seqs=2)
    for i in range(5):
        e.add_request(str(i), list(range(3, 13)), greedy(3))
    steps = []
    drain(e, steps)
    admitted = [[r.request_id for r in out.new_requests] for out in steps if out.new_requests]
    assert admitted == [["4", "3"], ["2", "1"], ["0"]]  # newest first, two at a time


def test_a_watermark_holds_back_prompts_that_would_leave_too_few_free_blocks():
    """vLLM v0's admission watermark: with 19 usable blocks and watermark 0.3 (5 kept free), a
    third 20-token prompt (5 blocks) waits while two run (10 blocks held, 9 free), though it
    fits; without the watermark all three start at once. A 68-token prompt (17 blocks, more than
    the 14 the watermark ever admits) is finished as ignored, naming the watermark."""
    admitted = {}
    for watermark in (0.0, 0.3):
        e = engine(num_gpu_blocks_override=20, max_model_len=72, max_num_batched_tokens=72,
                   policy_options={"watermark": watermark})
        for i in range(3):
            e.add_request(str(i), list(range(3 + 20 * i, 23 + 20 * i)), greedy(4))  # no shared blocks
        steps = []
        drain(e, steps)
        admitted[watermark] = [[r.request_id for r in out.new_requests] for out in steps if out.new_requests]
        alloc = e.allocator
        assert alloc.num_free_blocks == alloc.num_usable_blocks == 19
    assert admitted[0.0] == [["0", "1", "2"]]
    assert admitted[0.3] == [["0", "1"], ["2"]]
    e = engine(num_gpu_blocks_override=20, max_model_len=72, max_num_batched_tokens=72,
               policy_options={"watermark": 0.3})
    e.add_request("long", list(range(3, 71)), greedy(4))
    e.add_request("short", list(range(3, 11)), greedy(4))
    outs = {}
    while e.has_unfinished_requests():
        outs.update({o.request_id: o for o in e.step() if o.finished})
    assert outs["long"].outputs[0].token_ids == []  # ignored, as vLLM ignores a prompt that never fits
    assert "needs 17 KV blocks but policy 'fcfs' admits at most 14 (watermark=0.3 keeps 5 of 19 free)" in \
        outs["long"].status_message
    assert len(outs["short"].outputs[0].token_ids) == 4


@pytest.mark.parametrize("watermark", [-0.1, 1.0, float("nan"), "0.1", True])
def test_a_bad_watermark_is_named(watermark):
    with pytest.raises(ValueError, match=r"watermark must be a fraction of the KV blocks in \[0, 1\)"):
        POLICIES.create("fcfs", watermark=watermark)


def test_the_watermark_never_turns_away_a_request_preempted_after_it_ran():
    # vLLM v0 checks the watermark only for a prompt that has not run yet: a request that has grown past what the
    # watermark admits, then been preempted, is re-admitted, not finished as ignored with its outputs cut.
    from tests.policies.test_chunked import arrive, run_step, scheduler

    s = scheduler(num_blocks=9, budget=64, policy="fcfs", watermark=0.5)  # 8 usable blocks of 4, 4 kept free
    a = arrive(s, "a", list(range(3, 15)), max_tokens=30)  # 3 blocks: admitted
    for _ in range(9):
        run_step(s)
    assert a.num_tokens == 21 and s.allocator.blocks_needed(21) == 6  # more than the 4 the watermark admits
    schedule = s.policy.schedule
    s.policy.schedule = lambda sch, step: sch.preempt(step, a, "recompute")
    run_step(s)
    s.policy.schedule = schedule
    assert a.status == RequestStatus.WAITING
    assert run_step(s) == {"a": 1}  # its 20 computed tokens hit the prefix cache
    assert a.status == RequestStatus.RUNNING and a.num_computed_tokens == 21
    s.abort_request("a")
