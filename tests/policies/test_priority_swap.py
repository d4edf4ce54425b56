"""``priority_swap``: a late urgent request jumps the queue by swapping out lower-priority work,
whose KV cache comes back bit for bit."""
import random

import pytest
import torch

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.common.request import RequestStatus
from policies.priority_swap import PrioritySwapPolicy
from tests.policies import harness
from tests.policies.harness import Arrival, drive, reference_output, shadow_engine

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def engine(**kw):
    # 8 usable blocks of 16 tokens: two 40-token prompts fill 6 of them.
    args = dict(model="tiny-llama", policy="priority_swap", max_model_len=128, block_size=16,
                num_gpu_blocks_override=9, max_num_batched_tokens=128, max_num_seqs=4, check_invariants=True)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def prompts():
    return {f"low{i}": [10 + i] * 40 for i in range(4)} | {"high": list(range(100, 160))}


def run(e, spy=None):
    """Four low-priority requests, then (two steps later) a high-priority one."""
    p = prompts()
    for i in range(4):
        e.add_request(f"low{i}", p[f"low{i}"], GREEDY, priority=1)
    steps, done = [], {}
    e.step_callbacks.append(lambda stats, out: steps.append(out))
    for _ in range(2):
        e.step()
    e.add_request("high", p["high"], GREEDY, priority=0)
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    return steps, done


def swap_spy(e):
    """Wrap the runner's block ops: every swapped-in block must equal, bit for bit, what the
    device block held when it was swapped out. Returns the list of blocks checked."""
    runner = e.executor.runner
    apply, saved, checked = runner.apply_block_ops, {}, []

    def spy(out):
        expected = {dev: saved.pop(cpu) for cpu, dev in out.blocks_to_swap_in}
        for dev, cpu in out.blocks_to_swap_out:
            saved[cpu] = runner.kv_cache[:, :, dev].clone()
        apply(out)
        for dev, cpu in out.blocks_to_swap_out:
            assert torch.equal(runner.cpu_cache[:, :, cpu], saved[cpu])
        for dev, want in expected.items():
            assert torch.equal(runner.kv_cache[:, :, dev], want), f"block {dev} came back changed"
            checked.append(dev)

    runner.apply_block_ops = spy
    return checked


def test_late_high_priority_request_gets_its_first_token_before_earlier_low_priority_ones():
    e = engine()
    checked = swap_spy(e)
    steps, done = run(e)
    arrival_step = 2
    assert [r.request_id for r in steps[arrival_step].swapped_out] == ["low1"], "the newest low-priority victim"
    assert "high" in steps[arrival_step].num_scheduled_tokens
    first = {rid: o.metrics.first_token_time for rid, o in done.items()}
    assert first["high"] < first["low2"] and first["high"] < first["low3"]
    assert done["high"].metrics.ttft < min(done[r].metrics.ttft for r in ("low2", "low3"))
    # Low-priority requests are admitted only once every swapped one is back, with its KV intact.
    for i, out in enumerate(steps):
        if any(r.request_id in ("low2", "low3") for r in out.new_requests):
            gone = sum(len(o.swapped_out) for o in steps[:i])
            assert gone == sum(len(o.swapped_in) for o in steps[:i + 1]), f"step {i} admitted past a swapped request"
    assert e.scheduler.num_swap_outs >= 1 and len(checked) == e.allocator.stats.blocks_swapped_in > 0

    # Same outputs as without any pressure.
    _, calm = run(engine(num_gpu_blocks_override=None, policy="fcfs"))
    assert {r: o.outputs[0].token_ids for r, o in done.items()} == {r: o.outputs[0].token_ids for r, o in calm.items()}


def test_full_swap_space_falls_back_to_recompute_with_the_same_outputs():
    e = engine(swap_space=2 / 1024 ** 2)  # 2 KiB: less than one block
    assert e.allocator.num_cpu_blocks == 0
    steps, done = run(e)
    assert [r.request_id for r in steps[2].preempted] == ["low1"] and not steps[2].swapped_out
    assert e.scheduler.num_preemptions >= 1 and e.scheduler.num_swap_outs == 0
    _, calm = run(engine(num_gpu_blocks_override=None, policy="fcfs"))
    assert {r: o.outputs[0].token_ids for r, o in done.items()} == {r: o.outputs[0].token_ids for r, o in calm.items()}


def test_no_swap_when_the_victims_blocks_would_not_make_room():
    """The victim shares its prompt's full blocks with a higher-priority request, so swapping it
    out frees only its own last block: too little for the newcomer, so nobody is swapped."""
    e = engine()
    prompt = [7] * 40
    e.add_request("mid", prompt, GREEDY, priority=0)
    e.add_request("low", prompt, GREEDY, priority=1)
    e.step()
    assert e.allocator.num_free_blocks == 4  # mid and low hold 3 blocks each, 2 of them shared
    e.add_request("new", list(range(100, 190)), GREEDY, priority=0)  # 6 blocks
    steps = []
    e.step_callbacks.append(lambda stats, out: steps.append(out))
    e.step()
    assert not steps[0].swapped_out and not steps[0].preempted
    assert "new" not in steps[0].num_scheduled_tokens
    while e.has_unfinished_requests():
        e.step()


def test_samples_of_one_request_tie_in_rank_yet_finish():
    # The two samples share priority and arrival. Each needs the whole cache and is prefilled 3
    # tokens a step, so each runs short of blocks while the other holds some: with equal ranks
    # neither may preempt the other, and they took turns preempting themselves forever.
    e = shadow_engine("priority_swap", num_blocks=7, policy_options={"preemption_mode": "recompute",
                                                                     "long_prefill_token_threshold": 3},
                      max_model_len=24, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompt = list(range(3, 25))
    params = SamplingParams(n=2, max_tokens=1, temperature=0.0, ignore_eos=True)
    run = drive(e, [Arrival("a", 0, prompt, params)], max_steps=60)
    assert [c.token_ids for c in run.outputs["a"].outputs] == [reference_output(prompt, params, 24)] * 2


def test_ties_in_rank_go_in_the_order_received():
    # Equal priority and arrival (a workload with rate=null sends everything at t=0): the queue's
    # order decides, not the ids' (as strings "10" sorts before "9").
    e = engine(max_num_seqs=1)
    for rid in ["9", "10", "11"]:
        e.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                      arrival_time=0.0, priority=1)
    first_run = []
    e.step_callbacks.append(lambda stats, out: first_run.extend(
        r for r in out.num_scheduled_tokens if r not in first_run))
    while e.has_unfinished_requests():
        e.step()
    assert first_run == ["9", "10", "11"]


class SortEveryStep(PrioritySwapPolicy):
    """The policy as its docstring defines it: every request sorted by rank each step, then
    visited in that order (what ``schedule`` did before it kept the waiting queue in a heap)."""

    def schedule(self, scheduler, step):
        blocked = False
        for req in sorted([*scheduler.running, *scheduler.swapped, *scheduler.waiting], key=self._order):
            if step.token_budget == 0:
                break
            if step.was_preempted(req) or step.is_scheduled(req):
                continue
            if req.status == RequestStatus.RUNNING:
                if not scheduler.schedule_or_preempt(step, req, self.num_new_tokens(req, step.token_budget)):
                    blocked = True
            elif blocked or self._ranks_below_a_victim(step, req):
                continue
            elif req.status == RequestStatus.SWAPPED:
                blocked = not scheduler.swap_in(step, req, self.num_new_tokens(req, step.token_budget))
            else:
                blocked = not self._admit(scheduler, step, req)


def sim_engine(policy=None, mode="swap", **kw):
    return harness.sim_engine("priority_swap", policy, mode, **{"num_gpu_blocks_override": 48, "max_num_seqs": 16,
                                                                 "max_num_batched_tokens": 256, **kw})


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("seed", range(3))
def test_steps_are_those_of_sorting_every_request_every_step(mode, seed):
    # Waiting requests are kept in a heap across steps; every step must still be the one that
    # visiting all requests in rank order gives: arrivals between steps, preemptions (by swap and
    # by recompute), swaps back in, aborts, parallel samples.
    def trace(policy):
        rng = random.Random(seed)
        e = sim_engine(policy, mode, check_invariants=True)
        steps = harness.schedule_trace(e)
        for i in range(60):
            prompt = [7] * rng.choice([0, 32]) + [rng.randrange(10, 1000) for _ in range(rng.randint(1, 150))]
            e.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True,
                                                          n=rng.choice([1, 1, 1, 2])), priority=rng.choice([0, 1, 2]))
            if i % 7 == 6:
                e.abort_request(f"r{rng.randrange(i)}")
            for _ in range(rng.choice([0, 0, 1, 3])):
                e.step()
        while e.has_unfinished_requests():
            e.step()
        return steps, e.scheduler

    got, scheduler = trace(None)
    assert got == trace(SortEveryStep(mode))[0]
    assert scheduler.num_preemptions > 0 and (mode == "recompute" or scheduler.num_swap_outs > 0)


def test_a_step_reads_ranks_of_the_requests_it_reaches_not_of_the_whole_queue():
    # Every step sorted the whole waiting queue: a burst of N requests took O(N) work per step,
    # O(N^2) in all. Now the ranks read in a step do not depend on how many more requests wait
    # behind the ones the step reaches.
    def ranks_read_in_a_step(num_requests):
        e = sim_engine()
        for i in range(num_requests):
            e.add_request(f"r{i}", [10 + i % 50] * 100, SamplingParams(max_tokens=50, ignore_eos=True), priority=1)
        for _ in range(3):
            e.step()
        calls = []
        rank = e.policy.rank
        e.policy.rank = lambda req: calls.append(req) or rank(req)
        e.step()
        assert e.scheduler.waiting and e.scheduler.running
        return len(calls)

    assert ranks_read_in_a_step(400) == ranks_read_in_a_step(40)


@pytest.mark.parametrize("options, preempted", [({}, ["l2"]), ({"reserve_full_prompt": False}, [])])
def test_an_urgent_prompt_makes_room_for_all_its_blocks(options, preempted):
    # Two low-priority requests hold 3 of 8 blocks each; an urgent 20-token prompt (5 blocks) arrives. Its
    # first chunk (8 tokens, 2 blocks) fits the 2 free blocks; its whole prompt needs the newer low one out
    # (reserve_full_prompt, as chunked admits), or with the option off is admitted by its chunk alone.
    from framework.common.request import Request
    from tests.policies.test_chunked import run_step, scheduler

    s = scheduler(budget=8, policy="priority_swap", **options)
    for rid in ("l1", "l2"):
        s.add_request(Request(rid, [ord(rid[1])] * 9, GREEDY, arrival_time=len(s.requests), priority=1))
    for _ in range(3):
        run_step(s)
    assert [len(r.block_ids) for r in s.running] == [3, 3]
    s.add_request(Request("high", list(range(100, 120)), GREEDY, arrival_time=9.0, priority=0))
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == preempted
    assert out.num_scheduled_tokens["high"] == 8


def test_no_request_is_swapped_out_for_a_prompt_that_would_not_fit_whole_even_then():
    # reserve_full_prompt: the urgent prompt's 7 blocks do not fit even with every lower-priority request out, so
    # none is swapped out (a swap-out that admits nobody is wasted), though its first chunk would fit.
    from framework.common.request import Request
    from tests.policies.test_chunked import run_step, scheduler

    s = scheduler(num_blocks=9, budget=8, policy="priority_swap", num_cpu_blocks=8)  # 8 usable blocks of 4
    for rid, prompt, priority in (("r0", range(3, 18), -1), ("low", range(30, 37), 5)):
        s.add_request(Request(rid, list(prompt), GREEDY, arrival_time=float(len(s.requests)), priority=priority))
        for _ in range(2):
            run_step(s)
    s.add_request(Request("h", list(range(50, 78)), GREEDY, arrival_time=2.0, priority=0))
    out = s.schedule()
    assert not out.preempted and not out.swapped_out
    assert s.requests["low"] in out.scheduled and s.requests["h"].status == RequestStatus.WAITING
    for rid in ("r0", "low", "h"):
        s.abort_request(rid)
