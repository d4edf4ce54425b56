"""The model executor's process-wide settings."""
import pytest
import torch

from framework import EngineConfig, LLMEngine


@pytest.fixture
def threads():
    """torch's thread count, set to 3 (the caller's own choice) for the test and restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def test_an_engine_without_num_threads_runs_on_the_process_count_after_one_with(threads):
    # The jobs of a sweep share a process: `engine.num_threads=1,null` ran its second job on 1 thread.
    LLMEngine(EngineConfig(num_threads=1, max_model_len=64, num_gpu_blocks_override=8))
    assert torch.get_num_threads() == 1
    LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8))
    assert torch.get_num_threads() == 3


def test_a_count_the_caller_sets_after_an_engine_is_kept(threads):
    LLMEngine(EngineConfig(num_threads=1, max_model_len=64, num_gpu_blocks_override=8))
    torch.set_num_threads(2)
    LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8))
    assert torch.get_num_threads() == 2
