"""``ModelRunner.apply_block_ops``: swap and copy lists applied before the forward pass."""
import torch

from framework.model_runner import ModelRunner
from framework.scheduler import SchedulerOutput


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


def test_copies_run_after_swaps_and_leave_other_blocks_alone():
    r = runner()
    before = r.kv_cache.clone()
    r.apply_block_ops(SchedulerOutput(blocks_to_swap_in=[(0, 4)], blocks_to_copy=[(4, 1)]))
    assert block(r.kv_cache, 1) == (100, -100) and block(r.kv_cache, 4) == (100, -100)
    untouched = [0, 2, 3, 5]
    assert torch.equal(r.kv_cache[:, :, untouched], before[:, :, untouched])


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
