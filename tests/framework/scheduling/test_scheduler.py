"""The scheduler's mechanism, driven by hand: preemption by swap and recompute, swap-in, the
same-step rules that keep swap copies correct, and the invariant checks catching broken books."""
from types import SimpleNamespace

import pytest

from framework.kv.allocators.paged import PagedBlockAllocator
from framework.common.clock import VirtualClock
from framework.common.config import EngineConfig
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams
from framework.scheduling.policy import RECOMPUTE, SWAP, SchedulerPolicy
from framework.scheduling.scheduler import Scheduler


class Manual(SchedulerPolicy):
    """Runs whatever the test hands it this step; records the victim candidates it was offered."""

    def __init__(self, preemption_mode=SWAP):
        super().__init__(preemption_mode)
        self.plan = lambda scheduler, step: None
        self.offered = []

    def select_victim(self, candidates, requester):
        self.offered.append([r.request_id for r in candidates])
        return super().select_victim(candidates, requester)

    def schedule(self, scheduler, step):
        self.plan(scheduler, step)


def make(num_blocks=9, num_cpu_blocks=8, max_num_seqs=4, budget=32):
    config = EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=32,
                          check_invariants=True)
    return Scheduler(config, Manual(), PagedBlockAllocator(num_blocks, 4, num_cpu_blocks), VirtualClock())


def add(s, rid, n):
    r = Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=len(s.requests))
    s.add_request(r)
    return r


def step(s, plan):
    """One scheduler step running ``plan``, then every scheduled request computes its tokens."""
    s.policy.plan = plan
    out = s.schedule()
    sampled = {r.request_id: 7 for r in out.scheduled
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
    s.update_from_output(out, sampled)
    return out


def admit(*reqs):
    def plan(s, st):
        for r in reqs:
            assert s.schedule_request(st, r, r.num_tokens - r.num_computed_tokens)
    return plan


def test_swap_out_and_back_in_keeps_progress():
    s = make()
    a, b = add(s, "a", 10), add(s, "b", 6)
    step(s, admit(a, b))
    out = step(s, lambda s_, st: s_.preempt(st, b))
    assert b.status == RequestStatus.SWAPPED and b.block_ids == [] and len(b.cpu_block_ids) == 2
    assert out.swapped_out == [b] and len(out.blocks_to_swap_out) == 2 and "b" in out.finished_req_ids
    assert s.num_swap_outs == 1 and b.num_computed_tokens == 6

    def back(s_, st):
        assert s_.swap_in(st, b)
        s_.schedule_request(st, b, 1)
    out = step(s, back)
    assert b.status == RequestStatus.RUNNING and b.cpu_block_ids == [] and b.num_computed_tokens == 7
    assert out.resumed_requests == [b] and [d for _, d in out.blocks_to_swap_in] == b.block_ids
    assert s.allocator.num_free_cpu_blocks == 8


def test_swap_in_with_tokens_needs_room_for_them_too():
    # Four usable blocks. b (9 tokens, 8 computed: 2 blocks) is swapped out; its next token needs
    # a third block, and a holds three of the four.
    s = make(num_blocks=5)
    a, b = add(s, "a", 8), add(s, "b", 8)
    step(s, admit(a, b))
    step(s, lambda s_, st: s_.preempt(st, b))
    assert s.allocator.allocate_slots(a, 1) and len(a.block_ids) == 3

    def refused(s_, st):
        assert not s_.swap_in(st, b, 1)
    out = step(s, refused)
    assert b.status == RequestStatus.SWAPPED and not out.blocks_to_swap_in and not out.scheduled
    s.abort_request("a")
    out = step(s, lambda s_, st: s_.swap_in(st, b, 1))
    assert out.swapped_in == [b] and out.num_scheduled_tokens == {"b": 1} and len(b.block_ids) == 3


def test_swap_falls_back_to_recompute_when_the_swap_space_is_full():
    s = make(num_cpu_blocks=2)
    a = add(s, "a", 10)  # three blocks: more than the swap space
    step(s, admit(a))
    modes = []
    out = step(s, lambda s_, st: modes.append(s_.preempt(st, a)))
    assert modes == [RECOMPUTE] and out.preempted == [a] and not out.blocks_to_swap_out
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 0 and a.block_ids == []
    assert s.num_preemptions == 1 and s.num_swap_outs == 0


class SwapTypo(Manual):
    def preemption_mode_for(self, victim):
        return "Swap"


@pytest.mark.parametrize("policy, mode", [(SwapTypo(), None), (Manual(), "swapped")])
def test_an_unknown_preemption_mode_is_refused_not_taken_for_recompute(policy, mode):
    """From preemption_mode_for or preempt's mode: it silently recomputed."""
    s = make()
    s.policy = policy
    a = add(s, "a", 6)
    step(s, admit(a))
    with pytest.raises(ValueError, match="a: preemption mode must be 'recompute' or 'swap', got '(Swap|swapped)'"):
        step(s, lambda s_, st: s_.preempt(st, a, mode))
    assert a.status == RequestStatus.RUNNING and s.running == [a] and s.num_preemptions == 0  # nothing changed


def test_no_request_is_swapped_out_and_in_within_one_step():
    s = make()
    a = add(s, "a", 6)
    step(s, admit(a))

    def out_then_in(s_, st):
        s_.preempt(st, a)
        s_.swap_in(st, a)
    with pytest.raises(ValueError, match="swapped out during this step"):
        step(s, out_then_in)


def test_a_request_swapped_in_this_step_is_neither_preemptable_nor_offered_as_a_victim():
    # Three usable blocks: a (2) is swapped out and back in while b (1 full block) needs a second;
    # a must not be offered as b's victim, so b preempts itself.
    s = make(num_blocks=4)
    a, b = add(s, "a", 6), add(s, "b", 4)
    step(s, admit(a, b))
    step(s, lambda s_, st: s_.preempt(st, a))

    def plan(s_, st):
        assert s_.swap_in(st, a)
        with pytest.raises(ValueError, match="swapped in during this step"):
            s_.preempt(st, a)
        assert not s_.schedule_or_preempt(st, b, 1)  # needs a 3rd block; only a could give one
    out = step(s, plan)
    assert s.policy.offered == [[]] and out.swapped_out == [b]


def test_schedule_or_preempt_admits_a_waiting_request_with_its_prefix():
    s = make(num_blocks=7, max_num_seqs=2)
    a = add(s, "a", 12)
    step(s, admit(a))
    c = add(s, "c", 9)
    d = Request("d", a.prompt_token_ids[:8] + [99, 98], SamplingParams(max_tokens=5), arrival_time=9)
    s.add_request(d)
    step(s, admit(c))  # 6 blocks held, none free; max_num_seqs reached too

    def plan(s_, st):
        hit = s_.find_prefix(d)
        assert hit.num_tokens == 8
        assert s_.schedule_or_preempt(st, d, 2, hit)
    out = step(s, plan)
    assert out.swapped_out == [c] and d.num_cached_tokens == 8 and d.block_ids[:2] == a.block_ids[:2]


# -- the invariant checks catch broken books -----------------------------------------------------
def scheduled_state():
    s = make()
    a, b = add(s, "a", 10), add(s, "b", 6)
    step(s, admit(a, b))
    return s, a, b


def check_after(s, plan):
    s.policy.plan = plan
    return s.schedule()


def test_invariants_catch_a_token_without_a_block():
    s, a, _ = scheduled_state()

    def plan(s_, st):
        s_.schedule_request(st, a, 1)
        a.block_ids.pop()  # a's next token (position 10) lives in its third block
    with pytest.raises(AssertionError, match="cannot hold tokens up to position 11"):
        check_after(s, plan)


def test_invariants_catch_a_write_into_a_block_another_request_holds():
    s, a, b = scheduled_state()

    def plan(s_, st):
        s_.schedule_request(st, b, 1)
        # Then b's second block (where position 6 goes) is swapped for a's partially filled third.
        alloc = s_.allocator
        alloc._release_all(SimpleNamespace(block_ids=[b.block_ids[1]]))  # b lets go of that one block
        b.block_ids[1] = a.block_ids[2]
        alloc._blocks[a.block_ids[2]].ref_count += 1
    with pytest.raises(AssertionError, match="shared by 2 requests"):
        check_after(s, plan)


def test_invariants_catch_swap_space_accounting_errors():
    s, _, b = scheduled_state()
    step(s, lambda s_, st: s_.preempt(st, b))
    lost = b.cpu_block_ids.pop()
    with pytest.raises(AssertionError, match="1 swap blocks for 6 computed tokens"):
        check_after(s, lambda s_, st: None)
    b.cpu_block_ids.append(lost)
    s.allocator._cpu_free.append(lost)  # now it is both held and free
    with pytest.raises(AssertionError, match="the live requests hold 2 swap blocks but the allocator counts 1 used"):
        check_after(s, lambda s_, st: None)


def test_invariants_catch_a_swapped_request_holding_device_blocks():
    s, a, b = scheduled_state()
    step(s, lambda s_, st: s_.preempt(st, b))
    b.block_ids = [a.block_ids[0]]
    with pytest.raises(AssertionError, match="swapped with device blocks"):
        check_after(s, lambda s_, st: None)


def test_invariants_catch_budget_and_sequence_overruns():
    s, a, b = scheduled_state()

    def plan(s_, st):
        s_.schedule_request(st, a, 1)
        s_.schedule_request(st, b, 1)
        s_.max_num_batched_tokens = 1
    with pytest.raises(AssertionError, match="2 tokens > max_num_batched_tokens"):
        check_after(s, plan)
    s.max_num_batched_tokens, s.max_num_seqs = 32, 1
    with pytest.raises(AssertionError, match="2 seats taken > max_num_seqs"):
        check_after(s, lambda s_, st: None)



def test_the_policy_is_told_of_every_request_that_enters_the_waiting_queue():
    # priority_swap keeps its own heap of the waiting requests from these calls: one missed path
    # (arrival, recompute preemption, a forked sample waiting for a seat) would strand a request.
    from framework.engine.llm_engine import LLMEngine
    from policies.chunked import ChunkedPolicy

    told, kinds = [], []

    class Recording(ChunkedPolicy):
        def on_waiting(self, request):
            assert request.status == RequestStatus.WAITING and request in engine.scheduler.waiting
            told.append(request)
            kinds.append("recompute" if request.num_preemptions else "fork" if request.num_output_tokens else "arrival")

    engine = LLMEngine(EngineConfig(model="llama-3-8b", executor="sim", preparer="v0", policy="chunked",
                                    max_model_len=128, num_gpu_blocks_override=16, max_num_seqs=3,
                                    max_num_batched_tokens=64, executor_options={"fast_forward": False}))
    engine.policy = engine.scheduler.policy = Recording()
    for i in range(6):
        engine.add_request(str(i), list(range(10 + i, 70 + i)), SamplingParams(n=2, max_tokens=40, ignore_eos=True))
    seen, not_waiting = 0, set()

    def check(stats, out):
        # A request waiting now that was not waiting after the last step was told of in this one.
        nonlocal seen, not_waiting
        assert all(r in told[seen:] for r in engine.scheduler.waiting if r in not_waiting)
        seen = len(told)
        not_waiting = {r for r in engine.scheduler.requests.values() if r.status != RequestStatus.WAITING}

    engine.step_callbacks.append(check)
    while engine.has_unfinished_requests():
        engine.step()
    assert kinds.count("arrival") == 6 and "recompute" in kinds and "fork" in kinds, kinds


@pytest.mark.parametrize("policy", ["chunked", "sjf"])
def test_requests_of_a_failed_step_wait_in_the_order_they_ran(policy):
    # A failed step sends its requests back to the front of the waiting queue to be recomputed;
    # they went there reversed, so the newest was re-admitted first.
    from framework.engine.llm_engine import LLMEngine
    from framework.scheduling.policy import POLICIES

    config = EngineConfig(model="llama-3-8b", executor="sim", policy=policy, block_size=4, max_model_len=32,
                          max_num_seqs=3, max_num_batched_tokens=32, check_invariants=True,
                          executor_options={"fast_forward": False})
    engine = LLMEngine(config)
    assert isinstance(engine.policy, POLICIES.get(policy))
    s = engine.scheduler
    for i in range(5):  # equal prompts and arrival times: only the queue's order tells them apart
        engine.add_request(str(i), [3] * 6, SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["0", "1", "2"]
    s.step_failed(out)
    assert [r.request_id for r in s.waiting] == ["0", "1", "2", "3", "4"]
    admitted = [r.request_id for r in s.schedule().scheduled]
    assert admitted == ["0", "1", "2"]


def test_a_request_preempted_with_a_token_in_flight_preempts_nobody_to_come_back():
    """Async scheduling: a request preempted while its token is in flight waits for that token, not for blocks;
    asked back in the same step, schedule_or_preempt says no at once and takes no victim."""
    s = make(num_blocks=30)
    a, b, c = add(s, "a", 4), add(s, "b", 4), add(s, "c", 4)
    s.policy.plan = admit(a, b, c)
    s.commit(s.schedule())
    answers = []

    def plan(sch, st):
        sch.preempt(st, c, "recompute")
        answers.append(sch.schedule_or_preempt(st, c, 1))

    s.policy.plan = plan
    out = s.schedule()
    assert answers == [False]
    assert [r.request_id for r in out.preempted] == ["c"] and s.running == [a, b]


def test_a_second_placeholder_is_refused():
    """A request holds at most one token in flight: a second placeholder means a token was never resolved."""
    s = make()
    a = add(s, "a", 4)
    a.append_placeholder()
    with pytest.raises(RuntimeError, match="a already has a token in flight"):
        a.append_placeholder()


def test_commit_stands_placeholders_for_tokens_in_flight_and_uncommit_undoes_it():
    """Async scheduling: commit advances the scheduled requests and gives each that samples a placeholder;
    one whose placeholder is its last token leaves the running queue, keeping its blocks; uncommit restores
    all of it; the tokens, once known, replace the placeholders."""
    s = make()
    a, b = add(s, "a", 5), add(s, "b", 3)
    a.max_tokens = 1
    s.policy.plan = admit(a, b)
    out = s.schedule()
    before = [(r.num_computed_tokens, list(r.token_ids), list(r.block_ids)) for r in (a, b)]
    s.commit(out)
    assert [(r.num_computed_tokens, r.token_ids[-1], r.num_placeholders) for r in (a, b)] == [(5, -1, 1), (3, -1, 1)]
    assert s.running == [b] and s._finishing == [a] and a.block_ids
    s.uncommit(out)
    assert [(r.num_computed_tokens, list(r.token_ids), list(r.block_ids)) for r in (a, b)] == before
    assert sorted(r.request_id for r in s.running) == ["a", "b"] and not s._finishing  # step_failed follows
    s.commit(out)
    progressed = s.update_from_committed(out, {"a": 9, "b": 8})
    assert progressed == [a, b] and a.output_token_ids == [9] and b.output_token_ids == [8]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and not a.block_ids and s.running == [b]
    assert not b.num_placeholders
    s.abort_request("b")


def test_a_request_whose_last_token_is_in_flight_keeps_its_seat_until_the_token_is_known():
    """Async scheduling, as vLLM's AsyncScheduler: a request finishing by length leaves ``running`` at commit but
    still counts against ``max_num_seqs``, so a waiting request is admitted only once that token is known."""
    s = make(num_blocks=30, max_num_seqs=1)
    a, b = add(s, "a", 4), add(s, "b", 4)
    a.max_tokens = 1
    s.policy.plan = admit(a)
    first = s.schedule()
    s.commit(first)
    assert s.running == [] and s.seats_taken == 1
    s.policy.plan = lambda sch, st: (sch.schedule_request(st, b, 4) and None)
    assert s.schedule().scheduled == []
    s.update_from_committed(first, {"a": 9})
    assert a.is_finished and s.seats_taken == 0
    assert s.schedule().scheduled == [b]


def test_a_request_preempted_with_a_token_in_flight_caches_only_the_blocks_computed_so_far():
    """Async scheduling, as vLLM's: the block the step in flight completes is not cached when its request is
    preempted (vLLM caches a block once the step computing it returns to a running request), so the request's
    readmission hits only the blocks before it."""
    s = make(num_blocks=30)
    a = add(s, "a", 7)  # its 8th token, sampled by the prefill, fills its second block of 4
    s.policy.plan = admit(a)
    prefill = s.schedule()
    s.commit(prefill)
    s.policy.plan = lambda sch, st: sch.schedule_request(st, a, 1)
    decode = s.schedule()  # computes position 7 while the prefill's token is in flight
    s.update_from_committed(prefill, {"a": 9})
    s.commit(decode)
    s.policy.plan = lambda sch, st: sch.preempt(st, a, RECOMPUTE)
    s.schedule()  # the decode still in flight
    s.update_from_committed(decode, {"a": 10})
    assert s.find_prefix(a).num_tokens == 4


def test_a_request_asking_for_prompt_logprobs_never_reads_the_prefix_cache_nor_counts_in_the_hit_rate():
    """As vLLM's ``skip_reading_prefix_cache``: no hit even after a preemption, when its prompt logprobs are all
    known; its lookups stay out of the hit rate, since none is made."""
    s = make(num_blocks=30)
    a = add(s, "a", 8)
    s.policy.plan = admit(a)
    step(s, s.policy.plan)
    r = Request("r", list(range(3, 11)), SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=1),
                arrival_time=1.0)
    s.add_request(r)
    assert s.find_prefix(r).num_tokens == 0
    step(s, admit(r))
    r.prompt_logprobs = [None] * 8  # all known, as the runner would leave them
    step(s, lambda sch, st: sch.preempt(st, r, RECOMPUTE))
    assert not r.needs_prompt_logprobs and s.find_prefix(r).num_tokens == 0
    stats = s.allocator.stats
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.preempted_query_tokens) == (8, 0, 0)


@pytest.mark.parametrize("first, victim", [("a", "b"), ("b", "a")])
def test_a_request_whose_last_token_is_in_flight_is_preempted_as_vllm_pops_its_running_queue(first, victim):
    """Async scheduling: vLLM keeps such a request in its running queue and preempts the newest there, the
    requester included. So ``b`` (last token in flight) gives its block to ``a`` when it entered after ``a``;
    entered before, ``a`` preempts itself. A preempted ``b`` still finishes by the token in flight."""
    s = make(num_blocks=3)  # two usable blocks of 4: one each
    a, b = add(s, "a", 4), add(s, "b", 4)
    b.max_tokens = 1
    order = [a, b] if first == "a" else [b, a]
    s.policy.plan = admit(*order)
    prefill = s.schedule()
    s.commit(prefill)
    s.policy.plan = lambda sch, st: sch.schedule_or_preempt(st, a, 1)
    out = s.schedule()  # a's fifth token needs a block
    assert [r.request_id for r in out.preempted + out.swapped_out] == [victim]
    s.update_from_committed(prefill, {"a": 9, "b": 9})
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.output_token_ids == [9]
    s.abort_request("a")
    assert s.allocator.num_free_blocks == 2 and s.allocator.num_free_cpu_blocks == 8  # a swapped-out b's too


def test_a_prompt_needs_room_for_one_output_token_within_max_model_len():
    # As vLLM 0.32: a prompt of max_model_len tokens is refused (one token more would pass it), a longer one too.
    s = make(num_blocks=30)
    fits, full, too_long = add(s, "fits", 31), add(s, "full", 32), add(s, "long", 33)
    assert fits.status == RequestStatus.WAITING and fits in s.waiting
    assert full.status == RequestStatus.FINISHED_IGNORED
    assert full.status_message == "prompt of 32 tokens leaves no room for an output token within max_model_len=32"
    assert too_long.status == RequestStatus.FINISHED_IGNORED and "longer than max_model_len=32" in too_long.status_message
    step(s, admit(fits))
    assert fits.num_output_tokens == 1
    s.abort_request("fits")


def test_a_request_refused_before_its_arrival_time_does_not_finish_before_it_arrives():
    # Its end-to-end latency would come out negative.
    s = make()
    r = Request("r", list(range(3, 43)), SamplingParams(max_tokens=4), arrival_time=5.0)
    s.add_request(r)
    assert s.clock.now() < 5.0 and r.status == RequestStatus.FINISHED_IGNORED
    assert r.finished_time == r.arrival_time


def test_a_row_dropped_before_an_idle_step_is_dropped_by_the_next_output_that_runs():
    # An idle output never reaches the runner: the aborted request's row would stay in its batch.
    s = make(num_blocks=30)
    a = add(s, "a", 4)
    step(s, admit(a))
    s.abort_request("a")
    s.policy.plan = lambda sch, st: None
    idle = s.schedule()
    assert not idle.runs
    c = add(s, "c", 4)
    s.policy.plan = admit(c)
    out = s.schedule()
    assert out.runs and out.finished_req_ids == {"a"}
    s.abort_request("c")


def test_the_rows_a_failed_step_was_to_drop_are_dropped_by_the_next_output():
    s = make(num_blocks=30)
    a, b = add(s, "a", 4), add(s, "b", 4)
    a.max_tokens = 1
    step(s, admit(a, b))  # a finishes by length
    s.policy.plan = lambda sch, st: sch.schedule_request(st, b, 1)
    failed = s.schedule()
    assert failed.finished_req_ids == {"a"}
    s.step_failed(failed)
    s.policy.plan = admit(b)
    assert s.schedule().finished_req_ids == {"a"}
    s.abort_request("b")


def test_a_request_whose_last_token_is_in_flight_has_its_row_dropped_by_the_next_output():
    # Async scheduling: it leaves the batch at commit, so the step scheduled next must drop its row.
    s = make(num_blocks=30)
    a, b = add(s, "a", 4), add(s, "b", 4)
    a.max_tokens = 1
    s.policy.plan = admit(a, b)
    first = s.schedule()
    s.commit(first)
    s.policy.plan = lambda sch, st: sch.schedule_request(st, b, 1)
    second = s.schedule()
    assert second.scheduled == [b] and second.finished_req_ids == {"a"}
    s.update_from_committed(first, {"a": 9, "b": 9})
    s.commit(second)
    s.update_from_committed(second, {"b": 9})
    s.abort_request("b")


def test_a_failed_swap_in_sends_its_request_back_to_recompute_even_from_a_partial_block():
    # The swap-in's copy never happened, so the block holding its 2 computed tokens was never written.
    s = make(num_blocks=20)
    r = add(s, "r", 2)
    step(s, admit(r))
    step(s, lambda sch, st: sch.preempt(st, r, SWAP))
    assert r.status == RequestStatus.SWAPPED and r.num_computed_tokens == 2
    s.policy.plan = lambda sch, st: sch.swap_in(st, r) and None  # back in, no tokens this step
    out = s.schedule()
    assert out.blocks_to_swap_in and r.status == RequestStatus.RUNNING
    s.step_failed(out)
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0 and r in s.waiting
    s.abort_request("r")


def test_a_recompute_chunk_past_the_prompt_counts_as_prefill_not_as_a_decode_token():
    s = make(num_blocks=30)
    a = add(s, "a", 4)
    step(s, admit(a))
    for _ in range(3):
        step(s, lambda sch, st: sch.schedule_request(st, a, 1))
    step(s, lambda sch, st: sch.preempt(st, a, RECOMPUTE))
    assert a.num_computed_tokens == 0 and a.num_tokens == 8
    step(s, lambda sch, st: sch.schedule_request(st, a, 4))  # the prompt again
    out = step(s, lambda sch, st: sch.schedule_request(st, a, 3))  # then its outputs, past the prompt
    assert out.num_decode_tokens == 0
    assert step(s, lambda sch, st: sch.schedule_request(st, a, 1)).num_decode_tokens == 1
    s.abort_request("a")
