"""Greedy outputs must equal Hugging Face transformers' for the same weights, while batches mix
prefills and decodes and requests get preempted, whichever input preparer builds the batches."""
import random

import pytest

from framework import LLM, POLICIES, PREPARERS, SamplingParams
from framework.testing.parity import (BLOCK_SIZE, MAX_TOKENS, TINY_HF, check_greedy_parity, hf_greedy,
                                      make_hf_checkpoint, parity_prompts, parity_references, run_parity_workload)
from tests.conftest import runnable_backends, step_through_interrupts

#: Every CPU backend under the default preparer, and the reference backend under v0; the test
#: below covers every policy x backend under both preparers. Named, not discovered, so that a
#: backend that stops building fails here instead of silently dropping out.
BACKEND_PREPARER = [("naive", "v1"), ("torch_paged", "v1"), ("triton", "v1"), ("naive", "v0")]


@pytest.mark.parametrize("backend, preparer", BACKEND_PREPARER)
@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt", "mistral_ckpt"])
def test_greedy_matches_transformers(ckpt, backend, preparer, request):
    path, hf_model = request.getfixturevalue(ckpt)
    check_greedy_parity(path, hf_model, backend=backend, preparer=preparer)


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
        _, _, outs, _ = run_parity_workload(path, policy=policy, backend=backend, preparer=preparer)
        outputs[preparer] = [o.outputs[0].token_ids for o in outs]
    assert {"v0", "v1"} <= set(outputs)
    for preparer, tokens in outputs.items():
        assert tokens == parity_references(hf_model), f"preparer {preparer} under {policy}/{backend}"


@pytest.mark.parametrize("preparer", ["v0", "v1"])
def test_repetition_penalty_matches_transformers(llama_ckpt, preparer):
    """Greedy with ``repetition_penalty=1.3`` equals transformers' ``generate(...,
    repetition_penalty=1.3)`` (the penalty over prompt and output tokens) while the pool forces
    preemption, for parallel samples (v0 forks them) and beside requests without a penalty."""
    path, hf_model = llama_ckpt
    prompts = parity_prompts()
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2 if i % 3 == 0 else 1,
                             repetition_penalty=1.3 if i % 2 == 0 else 1.0) for i in range(len(prompts))]
    llm = LLM(model=str(path), block_size=BLOCK_SIZE, max_model_len=160, max_num_batched_tokens=160,
              num_gpu_blocks_override=26, max_num_seqs=8, check_invariants=True, preparer=preparer)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool should be small enough to force preemption"
    changed = 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i % 2:
            want = parity_references(hf_model)[i]
        else:
            want = hf_greedy(hf_model, prompt, MAX_TOKENS, repetition_penalty=1.3)
            changed += want != parity_references(hf_model)[i]
        assert [c.token_ids for c in out.outputs] == [want] * params[i].n, i
    assert changed >= 3, "the penalty should change some greedy outputs"


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


def awkward_workload(block_size: int, max_model_len: int, vocab: int = 512, seed: int = 0):
    """Prompts sharing a prefix of exactly one block, or one token more or less; a duplicate with
    n=2 and a shared one with n=3; prompts that reach max_model_len exactly (after 4 tokens, and
    after 1); one of max_model_len tokens, which leaves no room for output, and one longer."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(4 * block_size + 2)]
    tail = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    bs = block_size
    return [(base[:bs] + tail(5), 7, 1), (base[:bs] + tail(3), 6, 1), (base[:bs + 1] + tail(4), 5, 1),
            (base[:max(bs - 1, 1)] + tail(6), 6, 1), (base[:2 * bs], 5, 1), (base[:2 * bs], 5, 2),
            (base[:bs] + tail(2), 6, 3), (tail(max_model_len - 4), 10, 1), (tail(max_model_len - 1), 5, 1),
            (tail(max_model_len), 5, 1), (tail(max_model_len + 1), 5, 1), (base[:3 * bs + 1], 8, 1)]


#: A sample of the policy x backend x preparer x prefix caching x block size x preemption mode
#: matrix (the whole of it, Triton included, passes; this keeps a few seconds of it).
AWKWARD = [("chunked", "naive", "v0", True, 1, "swap"), ("sjf", "torch_paged", "v1", True, 1, "recompute"),
           ("least_computed", "naive", "v1", True, 2, "recompute"), ("priority_swap", "torch_paged", "v0", True, 2, "swap"),
           ("fcfs", "torch_paged", "v0", True, 16, "swap"), ("fcfs", "naive", "v1", False, 1, "recompute"),
           ("chunked", "triton", "v1", True, 2, "swap")]

#: sjf admits on its first chunk (vLLM before 0.32), which on this pool preempts; the others keep the default.
AWKWARD_OPTIONS = {"sjf": {"reserve_full_prompt": False}}


@pytest.mark.parametrize("policy, backend, preparer, caching, block_size, mode", AWKWARD)
def test_awkward_settings_match_transformers_and_free_every_block(llama_ckpt, policy, backend, preparer, caching,
                                                                  block_size, mode):
    path, hf_model = llama_ckpt
    max_model_len = {1: 24, 2: 26, 16: 40}[block_size]
    # Token budgets that split prompts at odd places (fcfs does not chunk: it takes whole prompts),
    # and a KV pool a few blocks over one max_model_len request, so requests get preempted.
    budget = max_model_len + 3 if policy == "fcfs" else {1: 13, 2: 29, 16: 37}[block_size]
    blocks = -(-max_model_len // block_size) + {1: 10, 2: 6, 16: 2}[block_size]
    llm = LLM(model=str(path), policy=policy, backend=backend, preparer=preparer, enable_prefix_caching=caching,
              block_size=block_size, max_model_len=max_model_len, max_num_batched_tokens=budget, max_num_seqs=4,
              num_gpu_blocks_override=blocks, policy_options={"preemption_mode": mode, **AWKWARD_OPTIONS.get(policy, {})},
              check_invariants=True)
    work = awkward_workload(block_size, max_model_len)
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in work],
                        [SamplingParams(max_tokens=m, n=n, temperature=0.0, ignore_eos=True) for _, m, n in work],
                        priority=[i % 3 for i in range(len(work))])
    assert llm.engine.scheduler.num_preemptions > 0
    for (prompt, max_tokens, n), out in zip(work, outs):
        if len(prompt) >= max_model_len:  # no room for an output token (vLLM 0.32 refuses it too)
            assert [c.token_ids for c in out.outputs] == [[]] * n and f"max_model_len={max_model_len}" in out.status_message
            continue
        want = hf_greedy(hf_model, prompt, min(max_tokens, max_model_len - len(prompt)))
        assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [(want, "length")] * n
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_usable_blocks and alloc.num_free_cpu_blocks == alloc.num_cpu_blocks
    assert caching or alloc.num_cached_blocks == 0
    alloc.check_invariants([])


#: Where a step fails (Ctrl-C or an exception): before its swaps and copies, in the forward pass,
#: or while its inputs are prepared; each with settings that swap, copy (v0 forks) or share prefixes.
FAILING = [("chunked", "v0", 1, "swap", True, "apply_block_ops"), ("fcfs", "v0", 2, "swap", True, "apply_block_ops"),
           ("priority_swap", "v1", 1, "swap", True, "forward"), ("priority_swap", "v0", 4, "swap", False, "prepare"),
           ("sjf", "v1", 2, "recompute", True, "apply_block_ops"), ("chunked", "v1", 4, "swap", True, "forward")]


@pytest.mark.parametrize("policy, preparer, block_size, mode, caching, where", FAILING)
def test_steps_failing_at_random_still_match_transformers_and_free_every_block(llama_ckpt, policy, preparer,
                                                                               block_size, mode, caching, where):
    """An engine stepped on after failed steps recomputes what the failure left unwritten: the
    blocks a failed step was to swap in, copy or fill, and the swap blocks it was to write."""
    path, hf_model = llama_ckpt
    max_model_len = {1: 24, 2: 26, 4: 28}[block_size]
    budget = max_model_len + 3 if policy == "fcfs" else max_model_len // 2 + 3
    llm = LLM(model=str(path), policy=policy, backend="naive", preparer=preparer, enable_prefix_caching=caching,
              block_size=block_size, max_model_len=max_model_len, max_num_batched_tokens=budget, max_num_seqs=4,
              num_gpu_blocks_override=-(-max_model_len // block_size) + 4, policy_options={"preemption_mode": mode},
              check_invariants=True)
    engine, runner, rng = llm.engine, llm.engine.executor.runner, random.Random(block_size)
    work = [(p, m, n if preparer == "v0" else 1) for p, m, n in awkward_workload(block_size, max_model_len)
            if len(p) < max_model_len]
    for i, (prompt, max_tokens, n) in enumerate(work):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True),
                           priority=i % 3)
    target = {"apply_block_ops": runner, "forward": runner.model, "prepare": runner.preparer}[where]
    original, failed = getattr(target, where), []

    def sometimes_fails(*args, **kwargs):
        if rng.random() < 0.3 and len(failed) < 20:
            failed.append(engine.num_steps)
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    setattr(target, where, sometimes_fails)
    outs, interrupted = step_through_interrupts(engine)
    assert interrupted == len(failed) >= 5 and engine.scheduler.num_preemptions > 0
    for i, (prompt, max_tokens, n) in enumerate(work):
        want = hf_greedy(hf_model, prompt, min(max_tokens, max_model_len - len(prompt)))
        assert [c.token_ids for c in outs[str(i)].outputs] == [want] * n, i
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_usable_blocks and alloc.num_free_cpu_blocks == alloc.num_cpu_blocks
    alloc.check_invariants([])
