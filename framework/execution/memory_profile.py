"""The device memory a step needs beyond the weights and the KV cache, measured by running worst-case
dummy steps (vLLM's profile run): the model, the attention backend's workspaces, logits and sampling.

Dummy steps read and write only the null block of a one-block cache, so no real cache is needed yet.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from framework.execution.attention import AttentionBackend, AttentionMetadata
from framework.execution.input_preparer import SamplingMetadata
from framework.execution.sampler import Sampler


@dataclass
class DummyStep:
    """``num_reqs`` requests of ``q_len`` new tokens after ``context`` cached ones (all in the null block)."""

    name: str
    num_reqs: int
    q_len: int
    context: int


def dummy_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[DummyStep]:
    """The steps whose peaks bound any step's: the token budget over as many requests as may run, each
    chunk at the end of the longest context (largest attention spans and gathers), and a decode of every
    sequence at the longest context."""
    num_reqs = min(max_num_seqs, max_num_batched_tokens)
    q_len = min(-(-max_num_batched_tokens // num_reqs), max_model_len)
    return [DummyStep("prefill", num_reqs, q_len, max_model_len - q_len),
            DummyStep("decode", max_num_seqs, 1, max_model_len - 1)]


def dummy_metadata(step: DummyStep, block_size: int, device: torch.device) -> AttentionMetadata:
    n, q = step.num_reqs, step.q_len
    seq_lens = np.full(n, step.context + q, dtype=np.int64)
    table = np.zeros((n, -(-(step.context + q) // block_size)), dtype=np.int64)
    return AttentionMetadata.from_host(np.arange(n + 1, dtype=np.int64) * q, seq_lens, table,
                                       np.zeros(n * q, dtype=np.int64), block_size, device)


def run_dummy_step(step: DummyStep, model: torch.nn.Module, backend: AttentionBackend, sampler: Sampler,
                   kv_cache: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Forward ``step`` through ``model`` on ``kv_cache`` (one block is enough), then logits and top-k/top-p
    sampling of each request's last row; returns the sampled tokens."""
    device = kv_cache.device
    meta = dummy_metadata(step, kv_cache.shape[3], device)
    num_tokens = step.num_reqs * step.q_len
    input_ids = torch.arange(num_tokens, device=device) % vocab_size
    positions = (torch.arange(num_tokens, device=device) % step.q_len) + step.context
    with torch.inference_mode():
        hidden = model(input_ids, positions, kv_cache, backend.build_metadata(meta))
        logits = model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
        n = step.num_reqs
        sampling = SamplingMetadata(temperature=torch.ones(n, device=device), all_greedy=False,
                                    top_k=torch.full((n,), 50, device=device),
                                    top_p=torch.full((n,), 0.9, device=device))
        return sampler.sample(logits, sampling).sampled


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """The most CUDA memory ``run`` had allocated at once beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak
