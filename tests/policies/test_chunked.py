"""``chunked``: decodes and prefill chunks share one token budget, running requests first."""
import pytest

from framework import EngineConfig, LLMEngine, SamplingParams


def engine(policy="chunked", **kw):
    args = dict(model="tiny-llama", policy=policy, max_model_len=512, block_size=16, max_num_batched_tokens=64,
                max_num_seqs=8, check_invariants=True)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def long_prompt_among_decodes(e, prompt_len=300):
    """Three short requests start decoding, then a long prompt arrives. Returns each step's
    output from the long prompt's arrival until its first token, and the long prompt's id."""
    for i in range(3):
        e.add_request(f"short{i}", [5 + i] * 8, greedy(40))
    e.step()
    e.step()
    e.add_request("long", list(range(3, 3 + prompt_len)), greedy(4))
    steps = []
    e.step_callbacks.append(lambda stats, out: steps.append(out))
    while not e.scheduler.requests["long"].num_output_tokens:
        e.step()
    e.step_callbacks.clear()
    e.abort_request([f"short{i}" for i in range(3)] + ["long"])
    e.step()
    return steps


def test_decodes_keep_flowing_while_a_long_prompt_is_prefilled_in_chunks():
    steps = long_prompt_among_decodes(engine())
    chunks = []
    for out in steps:
        counts = {r.request_id: out.num_scheduled_tokens[r.request_id] for r in out.scheduled}
        assert [counts[f"short{i}"] for i in range(3)] == [1, 1, 1], "every decode runs every step"
        chunks.append(counts["long"])
        assert out.total_num_scheduled_tokens <= 64
    assert chunks == [61, 61, 61, 61, 56], "the prompt takes what the decodes leave of the budget"
    assert [r.request_id for r in steps[0].scheduled][:3] == ["short0", "short1", "short2"], "running first"


def test_long_prefill_token_threshold_caps_a_chunk():
    steps = long_prompt_among_decodes(engine(policy_options={"long_prefill_token_threshold": 32}))
    assert [out.num_scheduled_tokens["long"] for out in steps] == [32] * 9 + [12]
    assert all(out.total_num_scheduled_tokens == 35 for out in steps[:-1])


def test_fcfs_stalls_decodes_for_the_same_prompt():
    # The contrast: prefill-first FCFS (with a budget the prompt fits in) runs it alone.
    steps = long_prompt_among_decodes(engine(policy="fcfs", max_num_batched_tokens=512))
    assert [list(out.num_scheduled_tokens.values()) for out in steps] == [[300]]


def test_max_num_seqs_and_admission_order():
    e = engine(max_num_seqs=2)
    for i in range(4):
        e.add_request(str(i), [9 + i] * 5, greedy(3))
    steps = []
    e.step_callbacks.append(lambda stats, out: steps.append(out))
    while e.has_unfinished_requests():
        e.step()
    assert all(out.num_reqs <= 2 for out in steps)
    admitted = [r.request_id for out in steps for r in out.new_requests]
    assert admitted == ["0", "1", "2", "3"]


@pytest.mark.parametrize("threshold", [-1, True, 2.5])
def test_bad_threshold_is_rejected(threshold):
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        engine(policy_options={"long_prefill_token_threshold": threshold})


@pytest.mark.parametrize("policy_name", ["sjf", "priority_swap"])
def test_an_on_waiting_override_that_skips_the_waiting_heap_is_reported(policy_name):
    """The waiting heap (``waiting_key``) is fed by ``on_waiting``: an override that does not
    call it would leave every waiting request unseen, so the policy says so instead."""
    from framework.scheduling.policy import POLICIES
    from tests.policies.harness import sim_engine

    class Forgetful(POLICIES.get(policy_name)):
        def on_waiting(self, request):
            pass

    e = sim_engine(policy_name, Forgetful(), max_model_len=128)
    e.add_request("a", [3] * 10, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match=r"must call super\(\).on_waiting"):
        e.step()
