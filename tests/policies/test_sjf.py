"""``sjf``: the waiting queue kept in prompt-length order across steps (a heap fed by
``on_waiting``), with the schedules of sorting the whole queue every step."""
import random

import pytest

from framework import SamplingParams
from framework.common.request import Request
from policies.sjf import ShortestPromptFirstPolicy
from tests.policies import harness


class SortEveryStep(ShortestPromptFirstPolicy):
    """``sjf`` as it was written before it kept a heap: the whole waiting queue sorted every step
    (``sorted`` is stable: equal keys keep the queue's order, preempted requests first)."""

    def waiting_order(self, waiting):
        return sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_time))


def sim_engine(policy=None, mode="recompute", **kw):
    return harness.sim_engine("sjf", policy, mode, **{"num_gpu_blocks_override": 40, "max_num_seqs": 8,
                                                       "max_num_batched_tokens": 128, **kw})


@pytest.mark.parametrize("preparer", ["v1", "v0"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(3))
def test_steps_are_those_of_sorting_the_queue_every_step(preparer, mode, seed):
    # Replays one random workload through both: arrivals between steps (several in one step share
    # their arrival time, and prompt lengths repeat, so keys tie), preemptions, swaps, aborts,
    # parallel samples (v0: forked from their leader, into the front of the waiting queue when
    # no seat is free). Every step must be the same.
    def trace(policy):
        rng = random.Random(seed)
        e = sim_engine(policy, mode, check_invariants=True, preparer=preparer)
        steps = harness.schedule_trace(e)
        for i in range(70):
            prompt = [7] * rng.choice([0, 32]) + [rng.randrange(10, 1000) for _ in range(rng.choice([5, 40, 90, 150]))]
            e.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 80), ignore_eos=True,
                                                          n=rng.choice([1, 1, 1, 3])))
            if i % 9 == 8:
                e.abort_request(f"r{rng.randrange(i)}")
            for _ in range(rng.choice([0, 0, 0, 1, 4])):
                e.step()
        while e.has_unfinished_requests():
            e.step()
        return steps, e.scheduler

    got, scheduler = trace(None)
    assert got == trace(SortEveryStep(mode))[0]
    assert scheduler.num_preemptions > 0


def test_a_step_reads_the_requests_it_reaches_not_the_whole_queue(monkeypatch):
    # Every step sorted the whole waiting queue: a burst of 16k requests took a minute of sorting.
    # Now the prompt lengths read in a step do not depend on how many requests wait behind the
    # ones the step reaches.
    reads = []
    length = Request.num_prompt_tokens
    monkeypatch.setattr(Request, "num_prompt_tokens", property(lambda r: reads.append(r) or length.fget(r)))

    def reads_in_a_step(num_requests):
        e = sim_engine()
        for i in range(num_requests):
            e.add_request(f"r{i}", [10 + i % 50] * (100 + i % 7), SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(3):
            e.step()
        reads.clear()
        e.step()
        assert e.scheduler.waiting and e.scheduler.running
        return len(reads)

    assert reads_in_a_step(400) == reads_in_a_step(40)


def test_a_subclass_overriding_waiting_order_gets_its_own_order():
    class LongestFirst(ShortestPromptFirstPolicy):
        def waiting_order(self, waiting):
            return sorted(waiting, key=lambda r: -r.num_prompt_tokens)

    e = sim_engine(LongestFirst(), max_num_seqs=1)
    lengths = [30, 5, 17, 9, 12]
    for i, n in enumerate(lengths):
        e.add_request(str(i), [3] * n, SamplingParams(max_tokens=2, ignore_eos=True))
    admitted = []
    e.step_callbacks.append(lambda stats, out: admitted.extend(r.num_prompt_tokens for r in out.new_requests))
    while e.has_unfinished_requests():
        e.step()
    assert admitted == sorted(lengths, reverse=True)


def test_prompts_of_equal_length_go_in_arrival_time_order_not_the_order_received():
    from tests.policies.test_chunked import arrive, run_step, scheduler

    s = scheduler(num_blocks=20, budget=8, policy="sjf", max_num_seqs=1)
    arrive(s, "x", list(range(3, 7)), arrival_time=5.0)  # received first, arrived later
    arrive(s, "y", list(range(20, 24)), arrival_time=1.0)
    assert run_step(s) == {"y": 4}
    for rid in ("x", "y"):
        s.abort_request(rid)
