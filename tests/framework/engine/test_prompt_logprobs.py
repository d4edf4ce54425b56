"""SamplingParams.prompt_logprobs end to end: every prompt token's logprob, rank and top-k set
against a float64 log_softmax of Hugging Face transformers' logits over the prompt, for the same
checkpoint, under both preparers, chunked prefill, preemption by recompute (mid-prompt too) and
by swap, prefix caching, parallel sampling and streaming."""
import pytest
import torch

from framework import LLM, LLMEngine, SamplingParams
from tests.framework.engine.test_logprobs import TOL, check_entry, preempting_engine
from framework.testing.parity import parity_prompts


def hf_prompt_logprobs(hf_model, prompt):
    """Row ``i``: float64 log_softmax of transformers' logits at prompt position ``i`` (the
    distribution of token ``i + 1``)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return logits.double().log_softmax(dim=-1)


def check_prompt_logprobs(prompt_logprobs, prompt, reference, k):
    """vLLM's layout: None for the first token, then token ``i`` (first) and the ``k`` most
    likely tokens at its position, with ``reference[i - 1]``'s values and ranks, ties aside."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for token, entry, ref in zip(prompt[1:], prompt_logprobs[1:], reference):
        check_entry(entry, token, ref, k)


def count_positions(llm, chunks=None):
    """Spy on the sampler: how many prompt positions it computed logprobs of, per request (and into ``chunks``
    the rows of each batch of logits it asked for)."""
    sampler = llm.engine.executor.runner.sampler
    counted: dict[str, int] = {}
    compute = sampler.prompt_logprobs

    def spy(logits_of, meta, max_rows):
        rows = []

        def recorded(part):
            logits = logits_of(part)
            rows.append(logits.shape[0])
            return logits

        result = compute(recorded, meta, max_rows)
        assert sum(rows) == sum(meta.counts), "logits only of the positions asked for"
        assert max(rows) <= max_rows == llm.engine.config.max_num_seqs, "at most max_num_seqs rows of logits at once"
        if chunks is not None:
            chunks.extend(rows)
        for rid, count in zip(meta.req_ids, meta.counts):
            counted[rid] = counted.get(rid, 0) + count
        return result

    sampler.prompt_logprobs = spy
    return counted


@pytest.mark.parametrize("preparer", ["v0", "v1"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_match_transformers_chunked_and_preempted(llama_ckpt, preparer, mode):
    """Prompts prefilled in chunks of at most 16 tokens, under memory pressure: every position
    is computed once (a request preempted mid-prompt does not compute its done ones again)."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), preparer=preparer, policy="chunked", backend="naive", block_size=8,
              max_model_len=160, max_num_batched_tokens=16, num_gpu_blocks_override=26, max_num_seqs=8,
              policy_options={"preemption_mode": mode}, check_invariants=True)
    mid_prompt = []
    llm.engine.step_callbacks.append(lambda stats, out: mid_prompt.extend(
        r for r in out.preempted if r.prompt_logprobs is not None and 1 < len(r.prompt_logprobs) < r.num_prompt_tokens))
    chunks = []
    counted = count_positions(llm, chunks)
    prompts = parity_prompts(n=10)
    ks = [None if i % 4 == 0 else i % 3 for i in range(len(prompts))]  # off, or 0 to 2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=k) for k in ks])
    assert llm.engine.scheduler.num_preemptions > 0
    assert mode == "swap" or mid_prompt, "a request should be preempted mid-prompt"
    assert mode == "recompute" or sum(o.metrics.num_swaps for o in outs) > 0
    for prompt, k, out in zip(prompts, ks, outs):
        if k is None:
            assert out.prompt_logprobs is None and out.request_id not in counted
            continue
        check_prompt_logprobs(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf_model, prompt), k)
        assert counted[out.request_id] == len(prompt) - 1, "each prompt position computed once"
    assert max(chunks) == 8 and len(chunks) > len(set(counted)), "a step's 16 positions should come 8 at a time"


@pytest.mark.parametrize("preparer", ["v0", "v1"])
def test_prefix_cache_hit_is_not_used_for_prompt_logprobs(llama_ckpt, preparer):
    """A second request sharing a cached prefix still gets its full prompt logprobs (it computes
    its whole prompt, as in vLLM v1); one that does not ask still uses the cache."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), preparer=preparer, backend="naive", block_size=8, max_model_len=128,
              enable_prefix_caching=True, check_invariants=True)
    shared = (parity_prompts(n=1, seed=3)[0] + [7] * 40)[:40]  # five whole blocks
    prompts = [shared + [11, 12, 13], shared + [21, 22], shared + [31]]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (first,) = llm.generate([prompts[0]], params)
    assert first.prompt_logprobs is None
    (second,) = llm.generate([prompts[1]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                          prompt_logprobs=3))
    assert second.num_cached_tokens == 0
    check_prompt_logprobs(second.prompt_logprobs, prompts[1], hf_prompt_logprobs(hf_model, prompts[1]), 3)
    (third,) = llm.generate([prompts[2]], params)
    assert third.num_cached_tokens == 40


@pytest.mark.parametrize("preparer", ["v0", "v1"])
def test_parallel_samples_share_one_computation(llama_ckpt, preparer):
    """n > 1: the prompt logprobs are the request's (RequestOutput), computed once."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), preparer=preparer, backend="naive", block_size=8, max_model_len=128,
              max_num_seqs=8, enable_prefix_caching=False, check_invariants=True)
    counted = count_positions(llm)
    prompt = parity_prompts(n=2)[1]
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5, ignore_eos=True, prompt_logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert len(out.outputs) == 3
    check_prompt_logprobs(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf_model, prompt), 1)
    assert sum(counted.values()) == len(prompt) - 1


def test_streamed_outputs_carry_them_once_the_prompt_is_done(llama_ckpt):
    """engine.step() outputs: None until the prompt's last chunk ran (the step of the first
    token), then the whole list, never changed after (through recompute preemption)."""
    path, hf_model = llama_ckpt
    engine, prompts = preempting_engine(path, "prompt_logprobs", 2, policy="chunked", max_num_batched_tokens=16)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if int(out.request_id) % 2 == 0 or not out.outputs[0].token_ids:
                assert out.prompt_logprobs is None
                continue
            if out.request_id in seen:
                assert out.prompt_logprobs == seen[out.request_id]
            seen[out.request_id] = [None] + [dict(e) for e in out.prompt_logprobs[1:]]
    assert engine.scheduler.num_preemptions > 0 and len(seen) == 5
    for rid, prompt_logprobs in seen.items():
        prompt = prompts[int(rid)]
        check_prompt_logprobs(prompt_logprobs, prompt, hf_prompt_logprobs(hf_model, prompt), 2)


def test_decoded_tokens_and_short_prompts(llama_ckpt):
    path, _ = llama_ckpt
    llm = LLM(model=str(path), backend="naive", max_model_len=64)
    outs = llm.generate(["w1 w2 w3", "w5", "w1 w2"],
                        [SamplingParams(max_tokens=1, prompt_logprobs=2),
                         SamplingParams(max_tokens=1, prompt_logprobs=2),
                         SamplingParams(max_tokens=1, prompt_logprobs=2, detokenize=False)])
    tokenizer = llm.engine.tokenizer
    assert all(lp.decoded_token == tokenizer.decode([t]) for e in outs[0].prompt_logprobs[1:] for t, lp in e.items())
    assert outs[1].prompt_logprobs == [None]  # one prompt token: nothing predicts it
    assert all(lp.decoded_token is None for e in outs[2].prompt_logprobs[1:] for lp in e.values())


def test_prompt_logprobs_capped_and_validated(llama_ckpt):
    path, _ = llama_ckpt
    llm = LLM(model=str(path), backend="naive", max_model_len=64, max_logprobs=3)
    with pytest.raises(ValueError, match=r"^SamplingParams.prompt_logprobs=4 exceeds the engine's max_logprobs \(3\)"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams(prompt_logprobs=3), SamplingParams(prompt_logprobs=4)])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs must be None"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs must be None"):
        SamplingParams(prompt_logprobs=True)


def test_requests_not_asking_prepare_no_prompt_positions(llama_ckpt):
    """The hot path: without a request asking, no step carries prompt positions (nor logits)."""
    path, _ = llama_ckpt
    for preparer in ("v0", "v1"):
        llm = LLM(model=str(path), preparer=preparer, backend="naive", max_model_len=64)
        runner = llm.engine.executor.runner
        prepare, inputs = runner.preparer.prepare, []
        runner.preparer.prepare = lambda out: inputs.append(prepare(out)) or inputs[-1]
        llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=3, logprobs=1))
        assert inputs and all(i is None or i.prompt_logprobs is None for i in inputs)


def test_simulated_executor_refuses_prompt_logprobs():
    engine = LLMEngine(model="tiny-llama", executor="sim")
    with pytest.raises(ValueError, match=r"^executor=sim cannot return prompt logprobs "
                                         r"\(SamplingParams.prompt_logprobs=0\)"):
        engine.add_request("a", [5, 6], SamplingParams(prompt_logprobs=0))
    assert not engine.has_unfinished_requests()


def test_a_request_aborted_mid_prompt_ends_without_a_partial_list(llama_ckpt):
    path, _ = llama_ckpt
    engine = LLMEngine(model=str(path), backend="naive", policy="chunked", max_model_len=64,
                       max_num_batched_tokens=16, max_num_seqs=4, check_invariants=True)
    engine.add_request("r", list(range(5, 45)), SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert engine.step() == []
    assert engine.scheduler.requests["r"].prompt_logprobs, "the first chunk's logprobs were computed"
    engine.abort_request("r")
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.prompt_logprobs is None
