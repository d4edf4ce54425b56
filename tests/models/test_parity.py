"""Greedy outputs must equal Hugging Face transformers' for the same weights, while batches mix
prefills and decodes and requests get preempted, whichever input preparer builds the batches."""
import random

import pytest

from framework import LLM, POLICIES, PREPARERS, SamplingParams
from tests.conftest import TINY_HF, hf_greedy, make_hf_checkpoint, runnable_backends

MAX_TOKENS = 24
BLOCK_SIZE = 8


def parity_prompts(n=16, vocab=512, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 90))] for _ in range(n)]


def run_engine(path, **kwargs):
    stats = []
    llm = LLM(model=str(path), block_size=BLOCK_SIZE, max_model_len=160, max_num_batched_tokens=128,
              num_gpu_blocks_override=26, max_num_seqs=8, check_invariants=True, **kwargs)
    llm.engine.step_callbacks.append(lambda s, out: stats.append(s))
    prompts = parity_prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return llm, prompts, outs, stats


_REFERENCES: dict[str, list[list[int]]] = {}


def reference(path, hf_model):
    """transformers' greedy outputs for the parity prompts (computed once per checkpoint)."""
    if str(path) not in _REFERENCES:
        _REFERENCES[str(path)] = [hf_greedy(hf_model, p, MAX_TOKENS) for p in parity_prompts()]
    return _REFERENCES[str(path)]


#: Every CPU backend under the default preparer, and the reference backend under v0; the test
#: below covers every policy x backend under both preparers. Named, not discovered, so that a
#: backend that stops building fails here instead of silently dropping out.
BACKEND_PREPARER = [("naive", "v1"), ("torch_paged", "v1"), ("triton", "v1"), ("naive", "v0")]


@pytest.mark.parametrize("backend, preparer", BACKEND_PREPARER)
@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt", "mistral_ckpt"])
def test_greedy_matches_transformers(ckpt, backend, preparer, request):
    path, hf_model = request.getfixturevalue(ckpt)
    llm, prompts, outs, stats = run_engine(path, backend=backend, preparer=preparer)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool should be small enough to force preemption"
    assert max(s.num_scheduled_reqs for s in stats) > 1, "batches should hold several requests"
    assert [o.outputs[0].token_ids for o in outs] == reference(path, hf_model)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def policy_backend_pairs():
    """Every policy with the reference backend and every backend with the default policy: the
    preparer meets policies through the scheduler output and backends through the attention
    metadata, independently, so the full cross product would only add (interpreted-Triton) time."""
    head_dim = TINY_HF["hidden_size"] // TINY_HF["num_attention_heads"]
    backends = runnable_backends(TINY_HF["num_attention_heads"], TINY_HF["num_key_value_heads"], head_dim, BLOCK_SIZE)
    policies = POLICIES.list()
    assert {"naive", "torch_paged", "triton"} <= set(backends), f"CPU backends missing: {backends}"
    return sorted({(p, "naive") for p in policies} | {("fcfs", b) for b in backends})


@pytest.mark.parametrize("policy, backend", policy_backend_pairs())
def test_preparers_give_identical_greedy_outputs(policy, backend, llama_ckpt):
    path, hf_model = llama_ckpt
    outputs = {}
    for preparer in PREPARERS.list():
        _, _, outs, _ = run_engine(path, policy=policy, backend=backend, preparer=preparer)
        outputs[preparer] = [o.outputs[0].token_ids for o in outs]
    assert {"v0", "v1"} <= set(outputs)
    for preparer, tokens in outputs.items():
        assert tokens == reference(path, hf_model), f"preparer {preparer} under {policy}/{backend}"


def test_text_prompts_use_the_checkpoint_tokenizer(llama_ckpt):
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), max_model_len=128)
    tok = llm.get_tokenizer()
    text = "w5 w17 w3 w300 w42"
    out = llm.generate(text, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    ids = tok.encode(text)
    assert out.prompt_token_ids == ids and out.prompt == text
    assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 8)
    # As vLLM: the output's text continues the prompt's (here " w12 w7 ...", with its space).
    assert text + out.outputs[0].text == tok.decode(ids + out.outputs[0].token_ids, skip_special_tokens=True)


def test_a_stop_tokens_text_is_left_out_of_the_output_text(llama_ckpt):
    # As vLLM: the stop token stays in token_ids, its text (a plain word here) is not shown.
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), max_model_len=128)
    tok = llm.get_tokenizer()
    ids = tok.encode("w5 w17 w3 w300 w42")
    greedy = hf_greedy(hf_model, ids, 8)
    stop = greedy[3]
    out = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                           stop_token_ids=[stop]))[0].outputs[0]
    cut = greedy.index(stop) + 1
    assert out.token_ids == greedy[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert tok.decode(ids) + out.text == tok.decode(ids + greedy[:cut - 1], skip_special_tokens=True)


def _save_sentencepiece_style_tokenizer(path, vocab_size: int) -> None:
    """Words with SentencePiece's "▁" (a space before them), as Llama's and Mistral's are: decoded
    first in a text they lose that space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"▁w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(words)}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def test_output_text_keeps_the_leading_space_of_a_sentencepiece_word(tmp_path):
    # Decoded alone, "▁w7 ▁w9" reads "w7 w9": appended to the prompt's text it would glue the
    # first word to the prompt's last. vLLM decodes the output after the prompt's last tokens.
    model = make_hf_checkpoint(tmp_path, "llama")
    _save_sentencepiece_style_tokenizer(tmp_path, model.config.vocab_size)
    llm = LLM(model=str(tmp_path), max_model_len=128)
    tok = llm.get_tokenizer()
    prompts = [[1, 40, 41, 42, 43, 44, 45, 46], [50], [1]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        assert completion.token_ids == hf_greedy(model, prompt, 6)
        whole = tok.decode(prompt + completion.token_ids, skip_special_tokens=True)
        assert tok.decode(prompt, skip_special_tokens=True) + completion.text == whole
    assert outs[0].outputs[0].text.startswith(" w")
