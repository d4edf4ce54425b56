"""The property-test recipe for a scheduling policy (needs hypothesis): random workloads (lengths, arrivals,
priorities, aborts, shared prefixes) under small KV pools and swap spaces through the shadow engine.

``run_workload(policy, setup, arrivals)`` with ``setup`` from ``setups()`` and ``arrivals`` from ``workloads()``
asserts the scheduler's invariants and each request's tokens every step, and at the end that every request
finished with its reason and the right tokens and no KV block leaked. ``POLICY_CHECKS`` holds the shipped
policies' own per-step promises.
"""
from __future__ import annotations

import inspect

from hypothesis import strategies as st

from framework.common.request import RequestStatus
from framework.common.sampling_params import SamplingParams
from framework.scheduling.policy import POLICIES
from framework.testing.leaks import assert_no_kv_leaks
from framework.testing.shadow import EOS, VOCAB, Arrival, drive, reference_output, shadow_engine

MAX_MODEL_LEN = 64
SYSTEM_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks of 4, shared by some prompts


@st.composite
def workloads(draw, max_requests=24, later_is_more_urgent=False):
    """Up to ``max_requests`` ``Arrival``s: random prompts (some behind a shared system prompt), lengths, stop
    tokens, arrival steps, priorities and aborts. ``later_is_more_urgent``: priority falls with arrival, so newcomers keep preempting."""
    arrivals = []
    for i in range(draw(st.integers(1, max_requests))):
        prompt = draw(st.lists(st.integers(EOS + 1, EOS + VOCAB - 1), min_size=1, max_size=60))
        if draw(st.booleans()):
            prompt = SYSTEM_PROMPT + prompt
        params = SamplingParams(max_tokens=draw(st.integers(1, 40)), temperature=0.0,
                                ignore_eos=draw(st.booleans()),
                                stop_token_ids=draw(st.lists(st.integers(EOS + 1, EOS + VOCAB - 1), max_size=1)))
        abort = draw(st.one_of(st.none(), st.integers(0, 30))) if draw(st.integers(0, 4)) == 0 else None
        step = draw(st.integers(0, 40))
        priority = -step if later_is_more_urgent else draw(st.integers(0, 3))
        arrivals.append(Arrival(str(i), step, prompt, params, priority, abort))
    return arrivals


@st.composite
def setups(draw, max_blocks=40):
    """A shadow engine's sizes: KV and swap blocks, batch limits, a long-prefill cap, prefix caching on or off."""
    return dict(num_blocks=draw(st.integers(17, max_blocks)), num_cpu_blocks=draw(st.sampled_from([0, 4, 12, 64])),
                max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=draw(st.sampled_from([8, 16, 32])),
                threshold=draw(st.sampled_from([0, 0, 4, 12])), prefix_caching=draw(st.booleans()))


def run_workload(policy, setup, arrivals, checks=(), async_scheduling=False, engine_options=None, **options):
    """Serve ``arrivals`` under ``policy`` (its ``options``) in a shadow engine of ``setup`` (a ``setups()`` draw),
    the scheduler's invariants and each of ``checks`` (``check(before, out, scheduler)``) asserted every step and
    ``check_outcomes`` at the end; ``async_scheduling`` as the engine's, ``engine_options`` other ``EngineConfig``
    fields (say ``{"allocator": "mine"}``). Returns the ``Run``."""
    if "long_prefill_token_threshold" in inspect.signature(POLICIES.get(policy)).parameters:  # chunked and kin
        options["long_prefill_token_threshold"] = setup["threshold"]
    # A prefill-first policy with a budget below MAX_MODEL_LEN is refused unless told its prompts fit the budget:
    # told so, it is built, and the longer prompts it is sent anyway are ignored (check_outcomes expects it).
    prefill_first = not POLICIES.get(policy).chunks_prefills
    engine = shadow_engine(policy, setup["num_blocks"], setup["num_cpu_blocks"], options,
                           setup["max_num_batched_tokens"] if prefill_first else None,
                           max_num_seqs=setup["max_num_seqs"], max_num_batched_tokens=setup["max_num_batched_tokens"],
                           max_model_len=MAX_MODEL_LEN, enable_prefix_caching=setup["prefix_caching"],
                           async_scheduling=async_scheduling, **(engine_options or {}))
    log = StepLog(engine, checks)
    total = sum(len(a.prompt) + a.params.max_tokens for a in arrivals)
    # "No request waits forever": a generous bound on steps, far above what any policy needs.
    run = drive(engine, arrivals, max_steps=60 + 12 * total, on_step=log)
    check_outcomes(run, arrivals, engine)
    return run


def check_outcomes(run, arrivals, engine):
    """Every request finished with its reason and the tokens a correct engine produces; no leak."""
    budget = engine.config.max_num_batched_tokens
    for a in arrivals:
        out = run.outputs[a.request_id]
        assert out is not None and out.finished, f"{a.request_id} never finished"
        tokens, reason = out.outputs[0].token_ids, out.outputs[0].finish_reason
        expected = reference_output(a.prompt, a.params, MAX_MODEL_LEN)
        if a.request_id in run.aborted:
            assert reason == "abort" and tokens == expected[:len(tokens)]
        elif out.status_message:  # ignored: it could never run
            too_long = len(a.prompt) >= MAX_MODEL_LEN or (not engine.policy.chunks_prefills and len(a.prompt) > budget)
            assert too_long and reason == "length" and tokens == []
        else:
            assert tokens == expected
            stopped = (not a.params.ignore_eos and tokens[-1] == EOS) or tokens[-1] in a.params.stop_token_ids
            assert reason == ("stop" if stopped else "length")
    assert not engine.has_unfinished_requests()
    assert_no_kv_leaks(engine)


class StepLog:
    """The queues just before each step (= just after the previous one) next to its output, and
    ``num_requests`` (running, waiting and swapped) as the step's scheduling starts (after arrivals)."""

    def __init__(self, engine, checks):
        self.scheduler = engine.scheduler
        self.before = self._snapshot()
        self.checks = checks
        schedule = self.scheduler.schedule

        def counted_schedule():
            s = self.scheduler
            self.before["num_requests"] = len(s.running) + len(s.waiting) + len(s.swapped)
            return schedule()
        self.scheduler.schedule = counted_schedule

    def _snapshot(self):
        s = self.scheduler
        return {"running": list(s.running), "computed": {r.request_id: r.num_computed_tokens for r in s.running}}

    def __call__(self, stats, out):
        for check in self.checks:
            check(self.before, out, self.scheduler)
        self.before = self._snapshot()


def entered(out):
    """Requests that came onto the device this step (admitted, re-admitted or swapped in)."""
    return out.new_requests + out.resumed_requests


def admitted(out):
    """Requests admitted from the waiting queue this step (first run or after recompute)."""
    return out.new_requests + [r for r in out.resumed_requests if r not in out.swapped_in]


def swapped_return_first(before, out, s):
    assert not (s.swapped and admitted(out)), "a request was admitted while another stays swapped out"
    for r in out.swapped_in:
        for w in s.swapped:
            assert (w.arrival_time, w.arrival_order) > (r.arrival_time, r.arrival_order), (
                f"{r.request_id} was swapped in while the older {w.request_id} stays swapped out")


def chunked_checks(before, out, s):
    victims = out.preempted + out.swapped_out
    assert not (victims and entered(out)), "a step that preempts admits nobody"
    if entered(out) and out.total_num_scheduled_tokens < s.max_num_batched_tokens:
        for r in before["running"]:
            assert out.num_scheduled_tokens.get(r.request_id) or r in victims or r.is_finished, (
                f"{r.request_id} was running but skipped while waiting requests were admitted")
    threshold = s.policy.long_prefill_token_threshold
    if before["num_requests"] > 1 or s.policy.long_prefill_cap_when_alone:  # else nobody to starve: no cap
        assert not threshold or max(out.num_scheduled_tokens.values(), default=0) <= threshold


def priority_checks(before, out, s):
    rank = s.policy.rank
    victims = out.preempted + out.swapped_out
    if victims and out.scheduled:
        assert max(map(rank, out.scheduled)) < min(map(rank, victims)), (
            "a request was preempted while one of lower priority ran")
    for r in entered(out):
        for swapped in s.swapped:
            assert rank(swapped) > rank(r), "a swapped request was passed over"


def sjf_checks(before, out, s):
    # Admissions from the waiting queue only: a swapped request comes back before anyone is admitted (chunked's).
    for r in admitted(out):
        for w in s.waiting:
            assert (w.num_prompt_tokens, w.arrival_time) > (r.num_prompt_tokens, r.arrival_time)


def least_computed_checks(before, out, s):
    # Every request still running unscheduled was a candidate whenever a victim was picked.
    for v in out.preempted:
        for r in before["running"]:
            if r.status == RequestStatus.RUNNING and r.request_id not in out.num_scheduled_tokens:
                assert before["computed"][v.request_id] <= before["computed"][r.request_id]


POLICY_CHECKS = {"fcfs": [], "chunked": [chunked_checks], "sjf": [chunked_checks, sjf_checks],
                 "least_computed": [least_computed_checks], "priority_swap": [priority_checks]}
