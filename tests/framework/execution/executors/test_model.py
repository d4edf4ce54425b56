"""The model executor's process-wide settings."""
import pytest
import torch

from framework import EngineConfig, LLMEngine
from framework.execution.executor import activation_peak_bytes


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


def test_engines_in_the_suite_run_on_the_cpu_in_float32_even_where_cuda_is_available(monkeypatch):
    # The references they are checked against run in float32 on the CPU (tests/conftest.py pins "auto").
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8))
    assert engine.executor.device == "cpu" and engine.executor.dtype == torch.float32


def test_kv_sizing_on_a_gpu_leaves_the_backends_workspace_free(monkeypatch):
    """The CUDA budget (utilization x total - used - activations) also leaves free what the attention
    backend declares (torch_paged: its gather buffer and masks), so the KV cache loses exactly those
    bytes' worth of blocks. Shown on a CPU engine asked for its CUDA budget, the card's figures stubbed."""
    engine = LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=64,
                                    gpu_memory_utilization=1.0, backend="torch_paged",
                                    backend_options={"decode_kernel": "sdpa"}))
    executor, config = engine.executor, engine.executor.config
    workspace = executor.backend.workspace_bytes(config.max_num_seqs, config.max_model_len,
                                                 config.max_num_batched_tokens)
    model = executor.source.config
    assert workspace >= 2 * 8 * 256 * model.num_key_value_heads * model.head_dim * 4, "at least the gather buffer"
    per_block = executor.bytes_per_block
    activations = activation_peak_bytes(model, config, executor.dtype.itemsize)
    total = activations + workspace + 10 * per_block  # an idle card: all of it free
    monkeypatch.setattr(executor, "_device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    monkeypatch.setattr(config, "num_gpu_blocks_override", None)
    assert executor.kv_block_counts()[0] == 10
    monkeypatch.setattr(executor.backend, "workspace_bytes", lambda *args: 0)
    assert executor.kv_block_counts()[0] == 10 + workspace // per_block
