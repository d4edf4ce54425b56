"""``Scheduler.fork``: the mechanism operation behind vLLM v0's parallel sampling."""
import pytest

from framework.kv.allocators.paged import PagedBlockAllocator
from framework.common.clock import VirtualClock
from framework.common.config import EngineConfig
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams
from framework.scheduling.invariants import check_invariants
from framework.scheduling.policy import POLICIES
from framework.scheduling.scheduler import Scheduler

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def setup(max_num_seqs=4):
    config = EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                          check_invariants=True)
    alloc = PagedBlockAllocator(num_blocks=20, block_size=4)
    sched = Scheduler(config, POLICIES.create("fcfs"), alloc, VirtualClock())
    return sched, alloc


def prefilled_leader(sched, prompt):
    leader = Request("p#0", prompt, PARAMS, 0.0)
    sched.add_request(leader)
    out = sched.schedule()
    assert out.scheduled == [leader]
    return leader, out


def forked_pair():
    """A leader prefilled over a 6-token prompt (blocks of 4) and its child forked with token 77."""
    sched, alloc = setup()
    prompt = list(range(3, 9))
    leader, out = prefilled_leader(sched, prompt)
    child = Request("p#1", prompt, PARAMS, 0.0)
    sched.fork(leader, child, 77)
    sched.update_from_output(out, {"p#0": 50})
    return sched, alloc, prompt, leader, child


def test_fork_shares_blocks_and_announces_the_child_as_new():
    sched, alloc, prompt, leader, child = forked_pair()
    assert child.status == RequestStatus.RUNNING and child.block_ids == leader.block_ids
    assert child.token_ids == prompt + [77] and child.num_computed_tokens == 6
    assert [alloc._blocks[b].ref_count for b in leader.block_ids] == [2, 2]
    out = sched.schedule()  # both decode; the first writer into the shared partial block copies it
    assert child in out.new_requests and leader not in out.new_requests
    assert len(out.blocks_to_copy) == 1 and leader.block_ids[1] != child.block_ids[1]
    assert sched.schedule().new_requests == [], "announced once"


def test_a_fork_is_announced_by_the_first_output_that_runs():
    # A policy may idle a step; the engine skips an output with nothing to run, so announcing the
    # child there left the runner without its row when it was scheduled (a KeyError in v0).
    sched, _, _, leader, child = forked_pair()
    sched.policy.schedule = lambda scheduler, step: None  # the policy idles this step
    idle = sched.schedule()
    del sched.policy.schedule
    assert not idle.scheduled and idle.new_requests == []
    assert child in sched.schedule().new_requests


def test_a_child_without_a_seat_waits_and_one_finished_by_its_first_token_never_runs():
    sched, alloc = setup(max_num_seqs=1)
    prompt = list(range(3, 9))
    leader, out = prefilled_leader(sched, prompt)
    waiting = Request("p#1", prompt, PARAMS, 0.0)
    sched.fork(leader, waiting, 77)
    assert waiting.status == RequestStatus.WAITING and not waiting.block_ids and waiting.num_computed_tokens == 0
    assert sched.waiting[0] is waiting and waiting.token_ids == prompt + [77]
    done = Request("p#2", prompt, SamplingParams(max_tokens=1), 0.0)
    sched.fork(leader, done, 78)
    assert done.status == RequestStatus.FINISHED_LENGTH_CAPPED and done.output_token_ids == [78]
    assert "p#2" not in sched.requests
    sched.update_from_output(out, {"p#0": 50})
    check_invariants(sched, sched.schedule())


@pytest.mark.parametrize("policy", ["fcfs", "chunked", "sjf", "priority_swap"])
def test_samples_forked_to_wait_in_one_step_are_admitted_in_the_order_forked(policy):
    # Each waiting sample was put first in the queue, so the step's samples waited (and were
    # admitted) last forked first: the later request's samples ahead of the earlier one's.
    config = EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                          check_invariants=True)
    sched = Scheduler(config, POLICIES.create(policy), PagedBlockAllocator(num_blocks=40, block_size=4), VirtualClock())
    leaders = [Request(f"{rid}#0", list(range(3, 9)), PARAMS, 0.0) for rid in "AB"]
    for leader in leaders:
        sched.add_request(leader)
    out = sched.schedule()
    assert out.scheduled == leaders
    for leader in leaders:
        for i in (1, 2):
            sched.fork(leader, Request(f"{leader.request_id[0]}#{i}", list(leader.token_ids), PARAMS, 0.0), 77)
    forked = ["A#1", "A#2", "B#1", "B#2"]
    assert [r.request_id for r in sched.waiting] == forked
    sched.update_from_output(out, {r.request_id: 50 for r in leaders})
    admitted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        admitted += [r.request_id for r in out.new_requests + out.resumed_requests]
        sched.update_from_output(out, {r.request_id: 50 for r in out.scheduled
                                       if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens})
    assert admitted == forked


@pytest.mark.parametrize("case", ["parent has output", "child known", "other prompt"])
def test_fork_rejects_misuse(case):
    sched, _ = setup()
    prompt = list(range(3, 9))
    leader, out = prefilled_leader(sched, prompt)
    child = Request("p#1", prompt if case != "other prompt" else prompt[:-1] + [99], PARAMS, 0.0)
    if case == "parent has output":
        sched.update_from_output(out, {"p#0": 50})
    if case == "child known":
        sched.add_request(child)
    with pytest.raises(ValueError, match="fork"):
        sched.fork(leader, child, 7)
