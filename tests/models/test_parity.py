"""Greedy outputs must equal Hugging Face transformers' for the same weights, while batches mix
prefills and decodes and requests get preempted."""
import random

import pytest

from framework import LLM, SamplingParams
from tests.conftest import hf_greedy

MAX_TOKENS = 24


def parity_prompts(n=16, vocab=512, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 90))] for _ in range(n)]


def run_engine(path, **kwargs):
    stats = []
    llm = LLM(model=str(path), block_size=8, max_model_len=160, max_num_batched_tokens=128,
              num_gpu_blocks_override=26, max_num_seqs=8, check_invariants=True, **kwargs)
    llm.engine.step_callbacks.append(lambda s, out: stats.append(s))
    prompts = parity_prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return llm, prompts, outs, stats


@pytest.mark.parametrize("backend", ["naive", "torch_paged", "triton"])
@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt", "mistral_ckpt"])
def test_greedy_matches_transformers(ckpt, backend, request):
    path, hf_model = request.getfixturevalue(ckpt)
    llm, prompts, outs, stats = run_engine(path, backend=backend)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool should be small enough to force preemption"
    assert max(s.num_scheduled_reqs for s in stats) > 1, "batches should hold several requests"
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert out.outputs[0].finish_reason == "length"


def test_text_prompts_use_the_checkpoint_tokenizer(llama_ckpt):
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), max_model_len=128)
    tok = llm.get_tokenizer()
    text = "w5 w17 w3 w300 w42"
    out = llm.generate(text, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    ids = tok.encode(text)
    assert out.prompt_token_ids == ids and out.prompt == text
    assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 8)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
