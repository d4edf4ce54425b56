"""SamplingParams.logprobs end to end: every generated token's logprobs, ranks and top-k set
against a float64 log_softmax of Hugging Face transformers' logits for the same checkpoint,
under both preparers, preemption by recompute and by swap, parallel sampling and streaming."""
import pytest
import torch

from framework import LLM, LLMEngine, SamplingParams
from framework.testing.parity import hf_greedy, parity_prompts

TOL = 1e-4  # float32 logits of two implementations of the same model


def hf_logprobs(hf_model, prompt, output):
    """float64 log_softmax of transformers' logits at each position that generated ``output``."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1:-1].double().log_softmax(dim=-1)


def check_completion(completion, reference, k):
    """``completion``'s logprobs are ``reference``'s (one row per generated token), ties aside."""
    ids, logprobs = completion.token_ids, completion.logprobs
    assert logprobs is not None and len(logprobs) == len(ids) == len(reference)
    total = 0.0
    for token, entry, ref in zip(ids, logprobs, reference):
        check_entry(entry, token, ref, k)
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, rel=1e-12)


def check_entry(entry, token, ref, k):
    """One position's ``{token_id: Logprob}``: ``token`` (the sampled or prompt token) first, with
    ``ref``'s value and rank, then the ``k`` most likely tokens in order, ties aside."""
    assert next(iter(entry)) == token, "the position's own token comes first"
    assert entry[token].logprob == pytest.approx(ref[token].item(), abs=TOL)
    # Its rank counts the tokens at least as likely; near-ties may go either way.
    assert (ref > ref[token] + TOL).sum() + 1 <= entry[token].rank <= (ref >= ref[token] - TOL).sum()
    # The token keeps its place (first) when it is one of the top k too.
    top = sorted((t for t in entry if t != token or len(entry) == k), key=lambda t: entry[t].rank)
    assert len(top) == k and len(entry) in (k, k + 1)
    kth = ref.topk(k).values[-1].item() if k else float("inf")
    for rank, t in enumerate(top, 1):
        assert entry[t].logprob == pytest.approx(ref[t].item(), abs=TOL)
        assert entry[t].rank == rank and ref[t] >= kth - TOL, "the k most likely tokens, in order"


@pytest.mark.parametrize("preparer", ["v0", "v1"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_logprobs_match_transformers_through_preemption(llama_ckpt, preparer, mode):
    path, hf_model = llama_ckpt
    # max_model_len holds every request (prompts < 90 tokens, 16 out) and, as fcfs needs, fits the budget.
    llm = LLM(model=str(path), preparer=preparer, backend="naive", block_size=8, max_model_len=128,
              max_num_batched_tokens=128, num_gpu_blocks_override=26, max_num_seqs=8,
              policy_options={"preemption_mode": mode}, check_invariants=True)
    prompts = parity_prompts(n=10)
    ks = [i % 4 for i in range(len(prompts))]  # 0 (the sampled token alone) to 3
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=k) for k in ks])
    assert llm.engine.scheduler.num_preemptions > 0
    assert mode == "recompute" or sum(o.metrics.num_swaps for o in outs) > 0
    for prompt, k, out in zip(prompts, ks, outs):
        completion = out.outputs[0]
        assert completion.token_ids == hf_greedy(hf_model, prompt, 16)
        check_completion(completion, hf_logprobs(hf_model, prompt, completion.token_ids), k)


@pytest.mark.parametrize("preparer", ["v0", "v1"])
def test_parallel_samples_each_get_their_own_logprobs(llama_ckpt, preparer):
    """n > 1 (v0 forks its samples from the leader's logits row): each sample's list follows its
    own tokens, and is of the raw distribution whatever the temperature and top-k."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), preparer=preparer, backend="naive", block_size=8, max_model_len=64,
              max_num_seqs=8, check_invariants=True)
    prompt = parity_prompts(n=1)[0]
    params = SamplingParams(n=3, max_tokens=8, temperature=1.3, top_k=50, seed=7, ignore_eos=True, logprobs=2)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "the samples should differ"
    for completion in out.outputs:
        check_completion(completion, hf_logprobs(hf_model, prompt, completion.token_ids), 2)


def preempting_engine(path, option, value, **engine_options):
    """An engine with a KV pool small enough to preempt (by recompute), serving 10 greedy requests
    of 16 tokens, the odd ones with ``SamplingParams(option=value)``; and their prompts."""
    args = dict(model=str(path), backend="naive", block_size=8, max_model_len=160, num_gpu_blocks_override=26,
                max_num_seqs=8, check_invariants=True)
    engine = LLMEngine(**{**args, **engine_options})
    prompts = parity_prompts(n=10)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                     **{option: value if i % 2 else None}))
    return engine, prompts


def test_streamed_outputs_grow_without_repeats(llama_ckpt):
    """engine.step() outputs: every step's logprobs list one entry per token so far, and what a
    step returned is never changed after (a request preempted by recompute keeps its list)."""
    path, hf_model = llama_ckpt
    engine, prompts = preempting_engine(path, "logprobs", 1, max_num_batched_tokens=128, max_model_len=128)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            if int(out.request_id) % 2 == 0:
                assert completion.logprobs is None and completion.cumulative_logprob is None
                continue
            logprobs = completion.logprobs
            assert len(logprobs) == len(completion.token_ids)
            before = seen.get(out.request_id, [])
            assert logprobs[:len(before)] == before
            seen[out.request_id] = [dict(e) for e in logprobs]
            assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                                      zip(completion.token_ids, logprobs)))
    assert engine.scheduler.num_preemptions > 0
    for rid, logprobs in seen.items():
        prompt = prompts[int(rid)]
        ref = hf_logprobs(hf_model, prompt, hf_greedy(hf_model, prompt, 16))
        assert [e[next(iter(e))].logprob for e in logprobs] == pytest.approx(ref.max(dim=-1).values.tolist(), abs=TOL)


def test_decoded_tokens_are_each_token_alone(llama_ckpt):
    path, _ = llama_ckpt
    llm = LLM(model=str(path), backend="naive", max_model_len=64)
    outs = llm.generate(["w1 w2 w3"] * 2, [SamplingParams(max_tokens=3, temperature=0.0, logprobs=2),
                                           SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, detokenize=False)])
    tokenizer = llm.engine.tokenizer
    for entry in outs[0].outputs[0].logprobs:
        assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in entry.items())
    assert all(lp.decoded_token is None for entry in outs[1].outputs[0].logprobs for lp in entry.values())


def test_logprobs_off_by_default_and_capped(llama_ckpt):
    path, _ = llama_ckpt
    llm = LLM(model=str(path), backend="naive", max_model_len=64, max_logprobs=3)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    # Refused before anything is queued, the good request before it included.
    with pytest.raises(ValueError, match=r"^SamplingParams.logprobs=4 exceeds the engine's max_logprobs \(3\)"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams(logprobs=3), SamplingParams(logprobs=4)])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0"):
        LLM(model=str(path), max_logprobs=-1)
    with pytest.raises(ValueError, match="SamplingParams.logprobs must be None"):
        SamplingParams(logprobs=-1)
    big = LLMEngine(model=str(path), backend="naive", max_model_len=64, max_logprobs=1000)
    with pytest.raises(ValueError, match=r"exceeds the model's vocabulary size \(512\)"):
        big.add_request("a", [5, 6], SamplingParams(logprobs=513))


def test_simulated_executor_refuses_logprobs():
    engine = LLMEngine(model="tiny-llama", executor="sim")
    with pytest.raises(ValueError, match=r"^executor=sim cannot return logprobs \(SamplingParams.logprobs=1\)"):
        engine.add_request("a", [5, 6], SamplingParams(logprobs=1))
    assert not engine.has_unfinished_requests()
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
