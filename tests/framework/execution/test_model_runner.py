"""``ModelRunner.apply_block_ops``: swap and copy lists applied before the forward pass."""
import torch

from framework.execution.model_runner import ModelRunner
from framework.scheduling.output import SchedulerOutput


def runner(num_blocks=6, num_cpu_blocks=4):
    # [2, layers, blocks, block_size, kv_heads, head_dim]; block b of K holds the value b, of V -b.
    cache = torch.zeros(2, 2, num_blocks, 4, 1, 2)
    for b in range(num_blocks):
        cache[0, :, b], cache[1, :, b] = b, -b
    r = ModelRunner(None, None, None, None, cache, num_cpu_blocks)
    for c in range(num_cpu_blocks):
        r.cpu_cache[0, :, c], r.cpu_cache[1, :, c] = 100 + c, -100 - c
    return r


def block(cache, b):
    return cache[0, 0, b, 0, 0, 0].item(), cache[1, 0, b, 0, 0, 0].item()


def test_swap_block_freed_by_a_swap_in_can_take_a_swap_out_in_the_same_step():
    # Swap block 1 goes back to device block 2 and is freed; the same step swaps device block 5
    # out into it. The swap-in must still get the old contents of swap block 1.
    r = runner()
    r.apply_block_ops(SchedulerOutput(blocks_to_swap_in=[(1, 2)], blocks_to_swap_out=[(5, 1)]))
    assert block(r.kv_cache, 2) == (101, -101)
    assert block(r.cpu_cache, 1) == (5, -5)


def test_device_block_freed_by_a_swap_out_can_take_a_swap_in_in_the_same_step():
    r = runner()
    r.apply_block_ops(SchedulerOutput(blocks_to_swap_out=[(3, 0)], blocks_to_swap_in=[(2, 3)]))
    assert block(r.cpu_cache, 0) == (3, -3)
    assert block(r.kv_cache, 3) == (102, -102)


def test_the_swap_space_may_hold_more_blocks_than_the_device():
    r = runner(num_blocks=3, num_cpu_blocks=8)
    assert r.cpu_cache.shape[2] == 8
    r.apply_block_ops(SchedulerOutput(blocks_to_swap_out=[(2, 7)]))
    assert block(r.cpu_cache, 7) == (2, -2)


def test_copies_read_their_sources_before_the_swaps_write_and_leave_other_blocks_alone():
    # Device block 4 is a copy's source and a swap-in's destination: freed during the step and
    # reused, so the copy takes what it held before the step.
    r = runner()
    before = r.kv_cache.clone()
    r.apply_block_ops(SchedulerOutput(blocks_to_swap_in=[(0, 4)], blocks_to_copy=[(4, 1)]))
    assert block(r.kv_cache, 1) == (4, -4) and block(r.kv_cache, 4) == (100, -100)
    untouched = [0, 2, 3, 5]
    assert torch.equal(r.kv_cache[:, :, untouched], before[:, :, untouched])


def test_a_copy_on_write_source_freed_and_swapped_into_in_the_same_step_is_copied_first():
    """A forked child writes into the partial block it shares with its parent (copy-on-write),
    then the parent is preempted (freeing that block) and a swapped request comes back into it,
    all through the scheduler's operations in one step. The child's private copy must hold the
    prompt's K/V, not the swapped-in request's."""
    from framework.kv.allocators.paged import PagedBlockAllocator
    from framework.common.clock import VirtualClock
    from framework.common.config import EngineConfig
    from framework.common.request import Request
    from framework.common.sampling_params import SamplingParams
    from framework.scheduling.policy import RECOMPUTE, SWAP, SchedulerPolicy
    from framework.scheduling.scheduler import Scheduler

    class Manual(SchedulerPolicy):
        plan = None

        def schedule(self, scheduler, step):
            self.plan(scheduler, step)

    bs = 4
    config = EngineConfig(block_size=bs, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32,
                          check_invariants=True)
    sched = Scheduler(config, Manual(SWAP), PagedBlockAllocator(5, bs, num_cpu_blocks=4), VirtualClock())
    cache = torch.zeros(2, 1, 5, bs, 1, 1)
    r = ModelRunner(None, None, None, None, cache, 4)

    def step(plan):
        """Schedule, move blocks, and 'compute' each scheduled token: its K and V are its id."""
        sched.policy.plan = plan
        out = sched.schedule()
        r.apply_block_ops(out)
        for req in out.scheduled:
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + out.num_scheduled_tokens[req.request_id]):
                cache[:, 0, req.block_ids[pos // bs], pos % bs] = float(req.token_ids[pos])
        return out

    def kv(req, n):
        return [cache[0, 0, req.block_ids[i // bs], i % bs, 0, 0].item() for i in range(n)]

    params = SamplingParams(max_tokens=20, ignore_eos=True)
    parent, other = Request("p", [3, 4, 5, 6, 7, 8], params, 0.0), Request("q", [9, 10, 11], params, 0.0)
    sched.add_request(parent)
    sched.add_request(other)
    out = step(lambda s, st: (s.schedule_request(st, parent, 6), s.schedule_request(st, other, 3)))
    child = Request("c", list(parent.token_ids), params, 0.0)
    sched.fork(parent, child, 50)  # shares both blocks, the second one partial
    sched.update_from_output(out, {"p": 40, "q": 41})
    sched.update_from_output(step(lambda s, st: s.preempt(st, other, SWAP)), {})

    def cow_preempt_swap_in(s, st):
        assert s.schedule_request(st, child, 1)  # writes position 6: a private copy of the shared block
        s.preempt(st, parent, RECOMPUTE)         # the shared block is free again ...
        assert s.swap_in(st, other)              # ... and takes the swapped request back
    out = step(cow_preempt_swap_in)
    (src, dst), = out.blocks_to_copy
    assert dst == child.block_ids[1] and [d for _, d in out.blocks_to_swap_in] == [src]
    assert kv(child, 7) == [3, 4, 5, 6, 7, 8, 50]
    assert kv(other, 3) == [9, 10, 11]


def test_the_model_executor_applies_num_threads():
    import torch

    from framework import EngineConfig, LLMEngine

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
