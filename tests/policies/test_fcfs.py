"""FCFS: prefill-first batches, arrival order, newest-first recompute preemption."""
from framework import EngineConfig, LLMEngine, SamplingParams
from framework.request import RequestStatus
from framework.scheduler import POLICIES
from policies.fcfs import FCFSPolicy


def engine(**kw):
    args = dict(model="tiny-llama", max_model_len=128, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
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
    monkeypatch.setattr(POLICIES, "_classes", dict(POLICIES._classes))
    POLICIES.register("test_lifo")(LastComeFirstServed)
    e = engine(policy="test_lifo", max_num_seqs=2)
    for i in range(5):
        e.add_request(str(i), list(range(3, 13)), greedy(3))
    steps = []
    drain(e, steps)
    admitted = [[r.request_id for r in out.new_requests] for out in steps if out.new_requests]
    assert admitted == [["4", "3"], ["2", "1"], ["0"]]  # newest first, two at a time
