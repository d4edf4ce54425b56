"""The two one-hook example policies: ``sjf`` (waiting order) and ``least_computed`` (victim)."""
import inspect

import pytest

from framework import POLICIES, SamplingParams
from framework.common.request import Request
from policies.least_computed import LeastComputedFirstPolicy
from policies.sjf import ShortestPromptFirstPolicy
from tests.policies.harness import Arrival, drive, shadow_engine


@pytest.mark.parametrize("cls", [ShortestPromptFirstPolicy, LeastComputedFirstPolicy])
def test_a_one_hook_policy_fits_in_fifteen_lines(cls):
    assert len(inspect.getsource(cls).splitlines()) <= 15
    assert POLICIES.get(cls.name) is cls


def test_sjf_admits_the_shortest_prompt_first():
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    lengths = [30, 5, 17, 9, 12]
    arrivals = [Arrival(str(i), 0, [3] * n, params) for i, n in enumerate(lengths)]
    run = drive(shadow_engine("sjf", num_blocks=64, max_num_seqs=1), arrivals, max_steps=200)
    admitted = [r.num_prompt_tokens for out in run.steps for r in out.new_requests]
    assert admitted == sorted(lengths)


def request(rid, computed):
    r = Request(rid, [3] * 40, SamplingParams(), arrival_time=0.0)
    r.num_computed_tokens = computed
    return r


def test_least_computed_preempts_the_request_with_least_work_done():
    policy = LeastComputedFirstPolicy()
    a, b, c, me = request("a", 30), request("b", 4), request("c", 4), request("me", 20)
    assert policy.select_victim([a, b, c], me) is c, "fewest computed tokens; the newest among equals"
    assert policy.select_victim([a], me) is None, "the requester itself has done less: it goes"
    assert policy.select_victim([], me) is None


def test_least_computed_in_an_engine():
    # The three prompts fill all 22 blocks; long0's first decode needs a 23rd. The victim is the
    # one with least computed (short), not the newest (long1) as under `chunked`.
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    arrivals = [Arrival("long0", 0, [3] * 40, params), Arrival("short", 0, [4] * 6, params),
                Arrival("long1", 0, [5] * 38, params)]
    victims = {}
    for policy in ("least_computed", "chunked"):
        run = drive(shadow_engine(policy, num_blocks=23, max_num_seqs=3, max_num_batched_tokens=128,
                                  max_model_len=80), arrivals, max_steps=500)
        assert run.steps[0].num_reqs == 3 and run.engine.scheduler.num_preemptions > 0
        victims[policy] = [r.request_id for r in run.steps[1].preempted]
    assert victims == {"least_computed": ["short"], "chunked": ["long1"]}
