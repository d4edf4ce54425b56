"""``check_greedy_parity`` passes the shipped parts and names what a wrong part or a too-easy workload gets wrong."""
from __future__ import annotations

import pytest

from backends.naive import NaiveBackend
from framework import BACKENDS, SamplingParams
from framework.common.request import Request
from framework.testing import parity
from framework.testing.parity import MAX_TOKENS, check_greedy_parity, hf_greedy, run_parity_workload


class _LeakyPrefill(NaiveBackend):
    """The reference backend whose prefill queries also see the step's later tokens."""

    def forward(self, q, k, v, kv_cache, meta, out=None):
        if meta.max_query_len == 1:
            return super().forward(q, k, v, kv_cache, meta, out)
        out = super().forward(q, k, v, kv_cache, meta, out)
        return out.copy_(out + 0.5 * out.roll(-1, dims=0))


@pytest.fixture
def leaky_backend():
    BACKENDS.register("leaky_prefill_for_test")(_LeakyPrefill)
    yield
    BACKENDS._classes.pop("leaky_prefill_for_test", None)


def test_the_shipped_parts_pass_and_a_wrong_backend_is_named_by_its_first_wrong_token(llama_ckpt, leaky_backend):
    path, model = llama_ckpt
    llm = check_greedy_parity(path, model, backend="naive", preparer="v0")
    assert llm.engine.config.backend == "naive"
    with pytest.raises(AssertionError, match=r"prompt \d+ \(\d+ tokens\): first difference at output token \d+"):
        check_greedy_parity(path, model, backend="leaky_prefill_for_test")


def test_a_workload_that_never_preempts_is_refused(llama_ckpt):
    path, model = llama_ckpt
    with pytest.raises(AssertionError, match="no request was preempted"):
        check_greedy_parity(path, model, num_gpu_blocks_override=400)
    with pytest.raises(AssertionError, match="no step batched several requests"):
        check_greedy_parity(path, model, max_num_seqs=1)


def test_hf_greedy_runs_its_tokens_past_eos_and_leaves_the_models_eos_as_it_was(llama_ckpt):
    _, model = llama_ckpt
    eos = model.generation_config.eos_token_id
    prompt = [5, 6, 7]
    first = hf_greedy(model, prompt, 1)
    try:
        model.generation_config.eos_token_id = first[0]
        assert len(hf_greedy(model, prompt, 4)) == 4
        assert hf_greedy(model, prompt, 4, stop_at_eos=True) == first
    finally:
        model.generation_config.eos_token_id = eos
    hf_greedy(model, prompt, 2)
    assert model.generation_config.eos_token_id == eos


@pytest.fixture
def served(llama_ckpt, monkeypatch):
    """The parity workload served once; ``check_greedy_parity`` is then handed that run, as altered by the test."""
    llm, prompts, outs, stats = run_parity_workload(llama_ckpt[0])
    monkeypatch.setattr(parity, "run_parity_workload", lambda path, **options: (llm, prompts, outs, stats))
    return llm, outs


def test_an_output_longer_than_transformers_is_named_at_its_first_extra_token(llama_ckpt, served):
    path, model = llama_ckpt
    _, outs = served
    outs[3].outputs[0].token_ids = [*outs[3].outputs[0].token_ids, 5]
    first_extra = rf"prompt 3 \(\d+ tokens\): first difference at output token {MAX_TOKENS}:"
    with pytest.raises(AssertionError, match=first_extra):
        check_greedy_parity(path, model)


def test_a_kv_block_left_held_fails_parity(llama_ckpt, served):
    path, model = llama_ckpt
    allocator = served[0].engine.allocator
    stray = Request("stray", [3, 4], SamplingParams(max_tokens=1), arrival_time=0.0)
    assert allocator.allocate_slots(stray, 2)
    try:
        with pytest.raises(AssertionError, match="KV blocks leaked"):
            check_greedy_parity(path, model)
    finally:
        allocator.free(stray)
