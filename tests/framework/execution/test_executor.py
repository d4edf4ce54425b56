"""KV-cache sizing shared by the executors."""
import pytest

from framework import EngineConfig
from framework.execution.executor import check_kv_capacity, size_kv_cache


def no_budget():
    raise AssertionError("the device budget should not be asked for")


def test_swap_space_holds_at_most_the_blocks_every_running_request_can_use():
    # 100 tokens in blocks of 16: a request uses 7 blocks, the last one partly.
    config = EngineConfig(max_model_len=100, block_size=16, max_num_seqs=3, swap_space=1, num_gpu_blocks_override=50)
    assert size_kv_cache(config, 1024, no_budget) == (50, 3 * 7)


def test_the_cache_must_hold_one_request_of_max_model_len_besides_the_null_block():
    config = EngineConfig(max_model_len=64, block_size=16, num_gpu_blocks_override=5)
    check_kv_capacity(config, 5)
    with pytest.raises(ValueError, match=r"holds 3 blocks x 16 tokens = 48 tokens, less than one request of "
                                         r"max_model_len=64; raise num_gpu_blocks_override \(now 5\)"):
        check_kv_capacity(config, 4)
