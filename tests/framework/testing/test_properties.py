"""The property-test recipe: the shipped policies' per-step promises (``POLICY_CHECKS``) hold what each policy
promises, no more; the workloads draw what the recipe says; ``run_workload`` and ``check_outcomes`` fail a policy or
an allocator that breaks a request's outcome."""
from types import SimpleNamespace

import pytest
from hypothesis import given, settings

from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams
from framework.kv.allocators.paged import PagedBlockAllocator
from framework.kv.block_allocator import ALLOCATORS
from framework.scheduling.policy import POLICIES
from framework.testing.properties import (MAX_MODEL_LEN, POLICY_CHECKS, SYSTEM_PROMPT, StepLog, check_outcomes,
                                          run_workload, sjf_checks, swapped_return_first, workloads)
from framework.testing.registries import forget_registrations
from framework.testing.shadow import Arrival
from policies.fcfs import FCFSPolicy


def request(rid, prompt_len, arrival):
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(), arrival_time=arrival)


def test_sjf_promises_the_order_of_admissions_not_of_swapped_requests_coming_back():
    # chunked, and so sjf, brings a swapped request back before admitting anyone, however long it is.
    longer, shorter = request("long", 20, 0.0), request("short", 3, 1.0)
    scheduler = SimpleNamespace(waiting=[shorter])
    swapped_back = SimpleNamespace(new_requests=[], resumed_requests=[longer], swapped_in=[longer])
    sjf_checks({}, swapped_back, scheduler)
    admitted = SimpleNamespace(new_requests=[longer], resumed_requests=[], swapped_in=[])
    with pytest.raises(AssertionError):
        sjf_checks({}, admitted, scheduler)


def step(**lists):
    """A ``SchedulerOutput``-like step: the given request lists and scheduled token counts, the rest empty."""
    out = SimpleNamespace(new_requests=[], resumed_requests=[], swapped_in=[], preempted=[], swapped_out=[],
                          scheduled=[], num_scheduled_tokens={})
    for name, value in lists.items():
        setattr(out, name, value)
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def queues(policy="chunked", waiting=(), swapped=(), budget=32, threshold=0, **policy_options):
    """A scheduler-like view: its queues and its policy (built with ``policy_options``), as the checks read them."""
    built = POLICIES.create(policy, long_prefill_token_threshold=threshold, **policy_options)
    return SimpleNamespace(waiting=list(waiting), swapped=list(swapped), max_num_batched_tokens=budget, policy=built)


def broken(policy, before, out, scheduler):
    """Whether the policy's own checks (``POLICY_CHECKS``) reject this step."""
    try:
        for check in POLICY_CHECKS[policy]:
            check(before, out, scheduler)
    except AssertionError:
        return True
    return False


def running(*requests):
    for r in requests:
        r.status = RequestStatus.RUNNING
    return {"running": list(requests), "computed": {r.request_id: r.num_computed_tokens for r in requests},
            "num_requests": len(requests)}


def test_a_swapped_request_comes_back_before_anyone_is_admitted_oldest_first():
    older, younger, other = request("old", 4, 0.0), request("young", 4, 1.0), request("other", 4, 2.0)
    swapped_return_first({}, step(swapped_in=[older]), queues(swapped=[younger]))
    for out, still_swapped in ((step(swapped_in=[younger]), [older]), (step(new_requests=[other]), [older]),
                               (step(resumed_requests=[other]), [older])):  # re-admitted after a recompute
        with pytest.raises(AssertionError):
            swapped_return_first({}, out, queues(swapped=still_swapped))


@pytest.mark.parametrize("policy", ["chunked", "sjf"])
def test_chunked_checks_reject_an_admission_beside_a_victim_or_a_skipped_running_request(policy):
    a, b, c = request("a", 8, 0.0), request("b", 8, 1.0), request("c", 8, 2.0)
    before = running(a, b)
    assert not broken(policy, before, step(scheduled=[a, b, c], num_scheduled_tokens={"a": 1, "b": 1, "c": 8},
                                           new_requests=[c]), queues(policy))
    assert broken(policy, before, step(scheduled=[a], num_scheduled_tokens={"a": 1}, swapped_out=[b],
                                       resumed_requests=[c]), queues(policy))
    for entered in ({"new_requests": [c]}, {"resumed_requests": [c]}):
        skipped = step(scheduled=[a, c], num_scheduled_tokens={"a": 1, "c": 8}, **entered)
        assert broken(policy, before, skipped, queues(policy))


@pytest.mark.parametrize("policy", ["chunked", "sjf"])
def test_the_long_prefill_cap_binds_every_request_unless_one_is_alone(policy):
    a, b = request("a", 20, 0.0), request("b", 20, 1.0)
    capped = queues(policy, threshold=4)
    over = step(scheduled=[a, b], num_scheduled_tokens={"a": 1, "b": 6})
    assert broken(policy, {**running(a, b), "num_requests": 2}, over, capped)
    alone = step(scheduled=[a], num_scheduled_tokens={"a": 6})
    assert not broken(policy, {**running(a), "num_requests": 1}, alone, capped)
    assert broken(policy, {**running(a), "num_requests": 1}, alone,
                  queues(policy, threshold=4, long_prefill_cap_when_alone=True))


def test_priority_checks_reject_a_victim_ranked_above_a_scheduled_request_or_a_swapped_one_passed_over():
    urgent, middle, lax = (Request(rid, [3, 4], SamplingParams(), arrival_time=0.0, priority=p)
                           for rid, p in (("urgent", 0), ("middle", 1), ("lax", 2)))
    s = queues("priority_swap")
    assert not broken("priority_swap", running(urgent, middle), step(scheduled=[urgent], swapped_out=[middle]), s)
    assert broken("priority_swap", running(urgent, lax, middle), step(scheduled=[urgent, lax], preempted=[middle]), s)
    for entered in ({"new_requests": [lax]}, {"resumed_requests": [lax], "swapped_in": [lax]}):
        assert broken("priority_swap", {}, step(**entered), queues("priority_swap", swapped=[middle]))
    assert not broken("priority_swap", {}, step(new_requests=[urgent]), queues("priority_swap", swapped=[middle]))


def test_least_computed_preempts_a_request_that_computed_no_more_than_any_left_unscheduled():
    fresh, old, busy = request("fresh", 8, 2.0), request("old", 8, 0.0), request("busy", 8, 1.0)
    fresh.num_computed_tokens, old.num_computed_tokens, busy.num_computed_tokens = 2, 8, 5
    before = running(fresh, old, busy)
    assert not broken("least_computed", before, step(scheduled=[busy], num_scheduled_tokens={"busy": 1},
                                                     preempted=[fresh]), None)
    assert broken("least_computed", before, step(scheduled=[busy], num_scheduled_tokens={"busy": 1},
                                                 preempted=[old]), None)


def test_sjf_checks_reject_a_longer_prompt_admitted_over_a_shorter_one():
    longer, shorter = request("long", 20, 0.0), request("short", 3, 1.0)
    assert broken("sjf", running(), step(new_requests=[longer], scheduled=[longer],
                                         num_scheduled_tokens={"long": 20}), queues("sjf", waiting=[shorter]))


def test_each_check_sees_the_queues_the_step_before_left_and_the_count_its_scheduling_started_with():
    a, b, c = (SimpleNamespace(request_id=rid, num_computed_tokens=0) for rid in "abc")
    a.num_computed_tokens = 4
    scheduler = SimpleNamespace(running=[a], waiting=[b], swapped=[], schedule=lambda: "scheduled")
    seen = []
    log = StepLog(SimpleNamespace(scheduler=scheduler), [lambda before, out, s: seen.append(dict(before))])
    assert scheduler.schedule() == "scheduled"
    a.num_computed_tokens, b.num_computed_tokens = 8, 5  # the step ran: b admitted, c swapped out
    scheduler.running, scheduler.waiting, scheduler.swapped = [a, b], [], [c]
    log(None, "scheduled")
    scheduler.schedule()
    log(None, "scheduled")
    assert seen == [{"running": [a], "computed": {"a": 4}, "num_requests": 2},
                    {"running": [a, b], "computed": {"a": 8, "b": 5}, "num_requests": 3}]


def test_workloads_draw_shared_system_prompts_aborts_and_stop_tokens():
    drawn = set()

    @settings(database=None, max_examples=100)
    @given(arrivals=workloads())
    def draw(arrivals):
        for a in arrivals:
            drawn.update(name for name, seen in (("shared", a.prompt[:len(SYSTEM_PROMPT)] == SYSTEM_PROMPT),
                                                 ("abort", a.abort_after is not None),
                                                 ("stop", bool(a.params.stop_token_ids))) if seen)

    draw()
    assert drawn == {"shared", "abort", "stop"}


@given(arrivals=workloads(later_is_more_urgent=True))
def test_later_arrivals_are_more_urgent_when_asked(arrivals):
    for a in arrivals:
        for b in arrivals:
            if a.step < b.step:
                assert b.priority < a.priority


SETUP = dict(num_blocks=20, num_cpu_blocks=0, max_num_seqs=4, max_num_batched_tokens=64, threshold=4,
             prefix_caching=False)


def test_a_setup_reaches_the_engine_and_the_policy():
    run = run_workload("chunked", SETUP, [Arrival("a", 0, [3] * 10, SamplingParams(max_tokens=2, ignore_eos=True))])
    assert run.engine.policy.long_prefill_token_threshold == 4 and not run.engine.config.enable_prefix_caching
    run = run_workload("chunked", {**SETUP, "prefix_caching": True},
                       [Arrival("b", 0, [3] * 10, SamplingParams(max_tokens=2, ignore_eos=True))])
    assert run.engine.config.enable_prefix_caching


def test_engine_options_choose_the_allocator_under_test(monkeypatch):
    forget_registrations(monkeypatch, ALLOCATORS)

    @ALLOCATORS.register("mine")
    class Mine(PagedBlockAllocator):
        pass

    run = run_workload("chunked", SETUP, [Arrival("a", 0, [3] * 10, SamplingParams(max_tokens=2))],
                       engine_options={"allocator": "mine"})
    assert type(run.engine.allocator) is Mine


@pytest.mark.parametrize("prompt_len", [20, MAX_MODEL_LEN - 1])
def test_a_policy_that_ignores_a_prompt_that_fits_fails_the_recipe(prompt_len):
    # fcfs's watermark keeps 15 of the 19 blocks free, so it ignores a prompt of more than 4 blocks.
    arrivals = [Arrival("a", 0, [3] * prompt_len, SamplingParams(max_tokens=1, ignore_eos=True))]
    run_workload("fcfs", SETUP, arrivals)
    with pytest.raises(AssertionError):
        run_workload("fcfs", SETUP, arrivals, watermark=0.8)


def test_a_prefill_first_policy_of_the_researchers_own_passes_with_prompts_beyond_its_budget(monkeypatch):
    forget_registrations(monkeypatch, POLICIES)
    POLICIES.register("my_fcfs")(type("MyFCFS", (FCFSPolicy,), {}))
    arrivals = [Arrival("long", 0, [3] * 30, SamplingParams(max_tokens=2, ignore_eos=True)),
                Arrival("short", 0, [4] * 6, SamplingParams(max_tokens=2, ignore_eos=True))]
    run = run_workload("my_fcfs", {**SETUP, "max_num_batched_tokens": 16}, arrivals)
    assert "does not chunk prefills" in run.outputs["long"].status_message
    assert len(run.outputs["short"].outputs[0].token_ids) == 2


def tamper(run, rid, **fields):
    choice = run.outputs[rid].outputs[0]
    for name, value in fields.items():
        setattr(choice, name, value(getattr(choice, name)) if callable(value) else value)


ARRIVALS = [Arrival("long", 0, [3] * 6, SamplingParams(max_tokens=12, ignore_eos=True)),
            Arrival("aborted", 0, [4] * 6, SamplingParams(max_tokens=30, ignore_eos=True), abort_after=3)]


@pytest.mark.parametrize("rid, fields", [
    ("long", {"token_ids": lambda t: t[:-1]}),  # one token short
    ("long", {"token_ids": lambda t: t[:-1] + [t[-1] + 1]}),
    ("long", {"finish_reason": "stop"}),
    ("aborted", {"token_ids": lambda t: t[:-1] + [t[-1] + 1]}),
], ids=["short", "wrong-token", "wrong-reason", "aborted-wrong-token"])
def test_check_outcomes_rejects_a_wrong_output(rid, fields):
    run = run_workload("chunked", SETUP, ARRIVALS)
    assert "aborted" in run.aborted and run.outputs["aborted"].outputs[0].token_ids
    tamper(run, rid, **fields)
    with pytest.raises(AssertionError):
        check_outcomes(run, ARRIVALS, run.engine)


def test_check_outcomes_rejects_a_kv_block_still_held():
    run = run_workload("chunked", SETUP, ARRIVALS)
    stray = Request("stray", [3] * 9, SamplingParams(max_tokens=1), arrival_time=0.0)
    assert run.engine.allocator.allocate_slots(stray, 9)
    try:
        with pytest.raises(AssertionError, match="leaked"):
            check_outcomes(run, ARRIVALS, run.engine)
    finally:
        run.engine.allocator.free(stray)  # or this test's engine would fail the suite's own leak check
