"""Property tests: random workloads (lengths, arrivals, priorities, aborts, shared prefixes) under
small KV pools and swap spaces, through the real engine, scheduler and paged allocator with the
shadow executor. Every step the scheduler checks its invariants (``check_invariants=True``) and
the executor checks that each request reads back exactly its own tokens; at the end every
request finished with its reason and the right tokens, nothing leaked, and each policy kept its
own promises, step by step. The recipe lives in ``framework.testing.properties``."""
from __future__ import annotations

import pytest
from hypothesis import given

from framework.testing.properties import (POLICY_CHECKS, priority_checks, run_workload, setups, swapped_return_first,
                                          workloads)

CASES = [(policy, "") for policy in sorted(POLICY_CHECKS)] + [("fcfs", "swap"), ("chunked", "swap"), ("sjf", "swap")]


@pytest.mark.parametrize("policy, mode", CASES)
@given(setup=setups(), arrivals=workloads())
def test_random_workloads_keep_every_invariant(policy, mode, setup, arrivals):
    if not mode:
        run_workload(policy, setup, arrivals, POLICY_CHECKS[policy])
    else:
        run_workload(policy, setup, arrivals, POLICY_CHECKS[policy] + [swapped_return_first], preemption_mode=mode)


@pytest.mark.parametrize("policy, mode", [("fcfs", ""), ("chunked", ""), ("chunked", "swap"), ("priority_swap", "swap")])
@given(setup=setups(), arrivals=workloads())
def test_random_workloads_under_async_scheduling_keep_every_invariant(policy, mode, setup, arrivals):
    """Each step scheduled while the one before is in flight, its tokens placeholders: the same invariants,
    the same KV reads and the same outputs, through aborts, stop tokens, preemption, swaps and prefix hits."""
    options = {"preemption_mode": mode} if mode else {}
    run = run_workload(policy, setup, arrivals, POLICY_CHECKS[policy], async_scheduling=True, **options)
    assert run.engine.async_scheduling


@given(setup=setups(), arrivals=workloads())
def test_chunked_as_before_vllm_0_32_keeps_every_invariant(setup, arrivals):
    """The earlier behaviour, one option away: first-chunk admission, the cap applied to a request alone."""
    run_workload("chunked", setup, arrivals, POLICY_CHECKS["chunked"], reserve_full_prompt=False,
                 long_prefill_cap_when_alone=True)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@given(setup=setups(max_blocks=24), arrivals=workloads(later_is_more_urgent=True))
def test_priority_swap_under_constant_preemption(mode, setup, arrivals):
    run = run_workload("priority_swap", setup, arrivals, [priority_checks], preemption_mode=mode)
    swapped = sum(len(out.swapped_out) for out in run.steps)
    assert mode == "swap" or swapped == 0
