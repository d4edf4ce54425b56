"""Greedy parity with Hugging Face transformers for the chunked and priority policies, on the
core parity workload (tests/models/test_parity.py) where requests get chunked and preempted."""
import pytest

from framework.testing.parity import MAX_TOKENS, hf_greedy, run_parity_workload

_HF: dict = {}


def hf_outputs(ckpt, model, prompts):
    if ckpt not in _HF:
        _HF[ckpt] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    return _HF[ckpt]


@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt"])
@pytest.mark.parametrize("policy", ["chunked", "priority_swap"])
def test_greedy_matches_transformers(policy, ckpt, request):
    path, hf_model = request.getfixturevalue(ckpt)
    llm, prompts, outs, stats = run_parity_workload(path, policy=policy)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, "the pool should be small enough to force preemption"
    if policy == "priority_swap":
        assert scheduler.num_swap_outs > 0
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats), "prefill chunks ride with decodes"
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs(ckpt, hf_model, prompts)
