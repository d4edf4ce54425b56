"""``check_greedy_parity`` passes the shipped parts and names what a wrong part or a too-easy workload gets wrong."""
from __future__ import annotations

import pytest

from backends.naive import NaiveBackend
from framework import BACKENDS
from framework.testing.parity import check_greedy_parity, hf_greedy


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
