"""For the same scheduler output, the v0 and v1 preparers build equivalent model inputs (equal
after mapping their request order), and every attention backend computes the same thing from
either: on random single steps (hypothesis), on random multi-step schedules driven by every
registered policy (preemption, swap, aborts, parallel-sampling forks with copy-on-write), and
through each backend that runs on this machine."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.kv.allocators.paged import PagedBlockAllocator
from framework.execution.attention import BACKENDS
from framework.common.clock import VirtualClock
from framework.common.config import EngineConfig
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams
from framework.scheduling.output import SchedulerOutput
from framework.scheduling.policy import POLICIES
from framework.scheduling.scheduler import Scheduler
from tests.conftest import runnable_backends
from tests.framework.execution.preparers.support import assert_equivalent, penalties_by_request, preparer_pair, record

MAX_LEN = 96


# -- random single steps --------------------------------------------------------------------------
request_specs = st.lists(st.tuples(
    st.integers(1, 60),                     # prompt tokens
    st.integers(0, 12),                     # output tokens
    st.floats(0, 1),                        # fraction of the tokens already computed
    st.floats(0, 1),                        # fraction of the rest scheduled now
    st.sampled_from([0.0, 0.7, 1.0]),       # temperature
    st.sampled_from([0, 5]),                # top-k
), min_size=1, max_size=12)


def build_requests(specs, block_size, rng):
    """Running requests in the given states, each holding exactly the blocks its step needs,
    drawn from a shuffled pool (so block tables are not contiguous)."""
    pool = list(range(1, 1 + sum(-(-(p + o) // block_size) for p, o, *_ in specs)))
    rng.shuffle(pool)
    reqs, counts = [], {}
    for i, (num_prompt, num_out, done, frac, temperature, top_k) in enumerate(specs):
        num_tokens = num_prompt + num_out
        computed = min(int(done * num_tokens), num_tokens - 1)
        n = max(1, round(frac * (num_tokens - computed)))
        tokens = [rng.randrange(3, 500) for _ in range(num_tokens)]
        r = Request(f"r{i}", tokens[:num_prompt], SamplingParams(temperature=temperature, top_k=top_k), 0.0)
        r.token_ids = tokens
        r.num_computed_tokens = computed
        r.status = RequestStatus.RUNNING
        r.block_ids = [pool.pop() for _ in range(-(-(computed + n) // block_size))]
        reqs.append(r)
        counts[r.request_id] = n
    return reqs, counts


def advance(reqs, counts, block_size, rng):
    """What one step does to the requests: count the tokens computed and append a sampled token
    to those that reached their end."""
    for r in reqs:
        r.num_computed_tokens += counts[r.request_id]
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(rng.randrange(3, 500))


def allocate(reqs, counts, block_size):
    """Give each request the blocks its next step needs, as the allocator would."""
    next_block = 1 + max(b for r in reqs for b in r.block_ids)
    for r in reqs:
        while len(r.block_ids) * block_size < r.num_computed_tokens + counts[r.request_id]:
            r.block_ids.append(next_block)
            next_block += 1


@settings(max_examples=2 * settings().max_examples)  # twice the profile's: cheap examples
@given(specs=request_specs, block_size=st.sampled_from([1, 2, 4, 16]), seed=st.integers(0, 2**16),
       keep=st.lists(st.booleans(), min_size=12, max_size=12), runner_records=st.booleans())
def test_random_steps_give_equivalent_inputs(specs, block_size, seed, keep, runner_records):
    """With ``runner_records`` v1 learns the sampled tokens from the runner, as in an engine;
    without, it reads them off the requests."""
    rng = random.Random(seed)
    v0, v1 = preparer_pair(block_size)
    reqs, counts = build_requests(specs, block_size, rng)
    out = SchedulerOutput(scheduled=reqs, num_scheduled_tokens=counts, new_requests=list(reqs))
    mi1 = v1.prepare(out)
    assert_equivalent(v0.prepare(out), mi1)
    # A second step extends the persistent state; some requests finish, the rest carry on.
    advance(reqs, counts, block_size, rng)
    if runner_records:
        record(v1, mi1, {r.request_id: r.token_ids[-1] for r in reqs})
    live = [r for r, k in zip(reqs, keep) if k]
    if not live:
        return
    counts = {r.request_id: 1 if r.num_tokens - r.num_computed_tokens == 1
              else rng.randint(1, r.num_tokens - r.num_computed_tokens) for r in live}
    allocate(live, counts, block_size)
    out = SchedulerOutput(scheduled=live, num_scheduled_tokens=counts,
                          finished_req_ids={r.request_id for r in reqs if r not in live})
    assert_equivalent(v0.prepare(out), v1.prepare(out))
    assert set(v0.seqs) == set(v1.row_of) == {r.request_id for r in live}


# -- random schedules from every policy ---------------------------------------------------------
def drive(policy: str, seed: int, num_requests: int = 28):
    """Run a real scheduler (policy + paged allocator, no model) over a random workload, feeding
    each step to both preparers; sampled tokens are random. Requests with n > 1 run as v0 does:
    a leader whose prompt logits are sampled for each fork, then forked copy-on-write."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    config = EngineConfig(policy=policy, block_size=bs, max_num_seqs=6, max_num_batched_tokens=48,
                          max_model_len=MAX_LEN, check_invariants=True)
    allocator = PagedBlockAllocator(num_blocks=MAX_LEN // bs + 1 + rng.randint(2, 12), block_size=bs,
                                    num_cpu_blocks=MAX_LEN // bs + 8)
    clock = VirtualClock()
    scheduler = Scheduler(config, POLICIES.create(policy), allocator, clock)
    v0, v1 = preparer_pair(bs, max_num_reqs=config.max_num_seqs)
    leaders: dict[str, Request] = {}
    fork_of: dict[str, str] = {}
    pending = list(range(num_requests))
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if not pending:
                break
            i = pending.pop()
            params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=rng.choice([0.0, 0.8]), ignore_eos=True,
                                    min_p=rng.choice([0.0, 0.0, 0.1]), repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
                                    presence_penalty=rng.choice([0.0, 0.0, 0.5]),
                                    frequency_penalty=rng.choice([0.0, 0.0, -0.25]))
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
            seqs = [Request(f"{i}#{k}", prompt, params, clock.now(), priority=rng.randint(0, 3), max_model_len=MAX_LEN,
                            parent_id=str(i), index=k) for k in range(rng.choice([1, 1, 2, 3]))]
            leader = seqs[0]
            leader.forks = seqs[1:]
            fork_of.update({c.request_id: leader.request_id for c in leader.forks})
            scheduler.add_request(leader)
            if leader.forks and not leader.is_finished:
                leaders[leader.request_id] = leader
        out = scheduler.schedule()
        mi0, mi1 = v0.prepare(out), v1.prepare(out)
        assert (mi0 is None) == (mi1 is None) == (not out.scheduled)
        sampled = {}
        if mi0 is not None:
            assert_equivalent(mi0, mi1, forks=fork_of)
            check_penalties(mi1, {r.request_id: r for r in out.scheduled})
            sampled = {rid: rng.randrange(3, 500) for rid in mi0.sample_req_ids}
            if mi1.sample_req_ids:
                record(v1, mi1, sampled)  # as the model runner does; v1 checks its rows every step
        for rid in [rid for rid in leaders if rid in sampled]:
            leader = leaders.pop(rid)
            for child in leader.forks:
                scheduler.fork(leader, child, sampled[child.request_id])
            leader.forks = []
        scheduler.update_from_output(out, sampled)
        scheduler.take_finished_outside_step()
        if rng.random() < 0.03 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            if scheduler.abort_request(victim) is not None and victim in leaders:
                leaders.pop(victim).forks = []
        clock.advance(0.01)
        steps += 1
        assert steps < 5000, "the schedule does not finish"
    allocator.check_invariants([])
    return steps, scheduler.num_preemptions, allocator.stats.cow_copies


def check_penalties(mi, requests: dict) -> None:
    """Each penalised sample carries its request's prompt and output tokens; min-p and the
    penalties are None exactly when no sampled request uses them (the sampler then does nothing)."""
    got = penalties_by_request(mi)
    reqs = [requests[rid] for rid in mi.sample_req_ids]
    assert (mi.sampling.min_p is None) == (not any(r.sampling_params.min_p for r in reqs))
    assert (mi.sampling.penalties is None) == (not any(r.sampling_params.penalized for r in reqs))
    for r in reqs:
        p = r.sampling_params
        want = (np.float32(p.min_p).item(),)
        if p.penalized:
            want += ((p.presence_penalty, p.frequency_penalty, np.float32(p.repetition_penalty).item()),
                     r.prompt_token_ids, r.output_token_ids)
        assert got[r.request_id] == want, r.request_id


@pytest.mark.parametrize("policy", POLICIES.list())
def test_random_schedules_of_every_policy_give_equivalent_inputs(policy):
    preemptions = cow_copies = 0
    for seed in range(3):
        _, p, c = drive(policy, seed)
        preemptions, cow_copies = preemptions + p, cow_copies + c
    assert preemptions > 0, "the pools should be small enough to preempt"
    assert cow_copies > 0, "parallel samples should have copied shared blocks on write"


# -- every backend, from either preparer's metadata -----------------------------------------------
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32


def token_order(mi):
    """(request, position) of each token of a model input."""
    qsl, pos = mi.host["query_start_loc"], mi.host["positions"].tolist()
    return [(rid, pos[t]) for i, rid in enumerate(mi.req_ids) for t in range(int(qsl[i]), int(qsl[i + 1]))]


@pytest.mark.parametrize("backend", runnable_backends(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 16))
def test_every_backend_computes_the_same_attention_from_either_preparer(backend):
    bs, rng = 16, random.Random(7)
    specs = [(40, 0, 0.0, 1.0, 0.0, 0), (70, 3, 1.0, 1.0, 0.0, 0), (33, 0, 0.5, 0.5, 0.0, 0),
             (5, 9, 1.0, 1.0, 0.0, 0), (90, 0, 0.3, 0.4, 0.0, 0), (17, 1, 0.0, 1.0, 0.0, 0)]
    reqs, counts = build_requests(specs, bs, rng)
    out = SchedulerOutput(scheduled=reqs, num_scheduled_tokens=counts, new_requests=list(reqs))
    v0, v1 = preparer_pair(bs)
    mi0, mi1 = v0.prepare(out), v1.prepare(out)
    order0, order1 = token_order(mi0), token_order(mi1)
    perm = torch.tensor([order1.index(key) for key in order0])
    attn = BACKENDS.create(backend, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                           scale=HEAD_DIM ** -0.5, block_size=bs, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    num_blocks = 1 + max(b for r in reqs for b in r.block_ids)
    cache = torch.randn(2, num_blocks, bs, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    t = len(order1)
    q = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    cache1, cache0 = cache.clone(), cache.clone()
    o1 = attn.forward(q, k, v, cache1, attn.build_metadata(mi1.attn_metadata))
    o0 = attn.forward(q[perm], k[perm], v[perm], cache0, attn.build_metadata(mi0.attn_metadata))
    torch.testing.assert_close(o0, o1[perm], rtol=1e-5, atol=1e-5)
    assert torch.equal(cache0, cache1), "both wrote the same K/V to the same slots"
    assert not np.array_equal(mi0.host["slot_mapping"], mi1.host["slot_mapping"]), "the layouts should differ"
