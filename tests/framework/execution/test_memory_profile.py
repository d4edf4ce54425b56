"""The dummy steps KV sizing profiles on a GPU: their shapes, and that they run through every CPU backend
touching nothing but the null block. The ``gpu`` case checks the profile bounds a real run's peak."""
import pytest
import torch

from framework import LLM, EngineConfig, LLMEngine, SamplingParams
from framework.execution.memory_profile import DummyStep, dummy_steps, run_dummy_step
from framework.execution.sampler import Sampler


@pytest.mark.parametrize("budget, seqs, max_len, prefill", [
    (2048, 64, 1024, DummyStep("prefill", 64, 32, 992)),
    (1024, 256, 4096, DummyStep("prefill", 256, 4, 4092)),
    (8192, 4, 1024, DummyStep("prefill", 4, 1024, 0)),   # a chunk never exceeds a sequence
    (16, 64, 512, DummyStep("prefill", 16, 1, 511)),
])
def test_dummy_steps_fill_the_budget_at_the_longest_context(budget, seqs, max_len, prefill):
    assert dummy_steps(budget, seqs, max_len) == [prefill, DummyStep("decode", seqs, 1, max_len - 1)]


@pytest.mark.parametrize("backend", ["naive", "torch_paged", "triton"])
def test_dummy_steps_run_in_the_null_block_only(backend):
    engine = LLMEngine(EngineConfig(backend=backend, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                                    num_gpu_blocks_override=8, block_size=16))
    executor, cfg = engine.executor, engine.executor.source.config
    cache = torch.randn(2, cfg.num_hidden_layers, 3, 16, cfg.num_key_value_heads, cfg.head_dim)
    before = cache.clone()
    for step in dummy_steps(64, 4, 64):
        tokens = run_dummy_step(step, executor.model, executor.backend, Sampler(torch.Generator().manual_seed(0)),
                                cache, cfg.vocab_size)
        assert tokens.shape == (step.num_reqs,) and 0 <= int(tokens.min()) and int(tokens.max()) < cfg.vocab_size
    assert torch.equal(cache[:, :, 1:], before[:, :, 1:]), "a dummy step wrote outside the null block"
    assert not torch.equal(cache[:, :, 0], before[:, :, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch_paged", "triton"])
def test_on_a_gpu_the_profile_bounds_a_full_runs_peak(backend):
    """A run that fills the token budget and every sequence at the longest context needs no more memory
    beyond the KV cache than the profile reserved (graphs' pool included)."""
    llm = LLM(backend=backend, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512, device="cuda",
              num_gpu_blocks_override=16 * 32 + 1, block_size=16)
    executor = llm.engine.executor
    reserved = executor.profile_step_bytes()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(400)]} for i in range(16)]
    llm.generate(prompts, SamplingParams(max_tokens=111, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= reserved
