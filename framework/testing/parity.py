"""Greedy parity with Hugging Face transformers, the correctness oracle, for any choice of parts:
``check_greedy_parity(path, model, backend=NAME)`` serves a workload that chunks, batches and preempts through
the engine and asserts its tokens equal transformers' greedy ``generate`` for the same random weights.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import torch

from framework.common.sampling_params import SamplingParams
from framework.engine.llm import LLM
from framework.engine.llm_engine import StepStats
from framework.common.outputs import RequestOutput
from framework.testing.leaks import assert_no_kv_leaks

#: A checkpoint small enough to build in a second and run a workload in a few.
TINY_HF = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
MAX_TOKENS = 24
BLOCK_SIZE = 8
#: The parity workload's engine: 26 blocks of 8 tokens hold about 2 of its 16 requests at their longest, so
#: requests are preempted; a 160-token budget chunks and batches prompts of up to 90 tokens.
PARITY_ENGINE = dict(block_size=BLOCK_SIZE, max_model_len=160, max_num_batched_tokens=160, num_gpu_blocks_override=26,
                     max_num_seqs=8, check_invariants=True)


def make_hf_checkpoint(path: str | Path, arch: str = "llama", seed: int = 0, with_tokenizer: bool = False,
                       **overrides: Any) -> Any:
    """Save a random-weight transformers model (``llama``, ``qwen2`` or ``mistral``; ``TINY_HF`` sizes unless
    ``overrides`` say otherwise) to ``path``; return the transformers model in eval mode, for references."""
    import transformers

    torch.manual_seed(seed)
    kw = {**TINY_HF, **overrides}
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **kw))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **kw))
    else:
        raise ValueError(f"unknown architecture {arch!r}: choose llama, qwen2 or mistral")
    model.eval()
    model.save_pretrained(path)
    if with_tokenizer:
        save_word_tokenizer(path, kw["vocab_size"])
    return model


def save_word_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A deterministic word-level tokenizer (no download) saved next to a checkpoint: token i >= 3 is "w{i-3}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def hf_greedy(model: Any, prompt: list[int], max_tokens: int, stop_at_eos: bool = False,
              **generate_kwargs: Any) -> list[int]:
    """transformers' greedy ``generate`` (``generate_kwargs`` go to it, e.g. ``repetition_penalty``).
    Without ``stop_at_eos`` it runs exactly ``max_tokens`` with no EOS handling at all
    (``min_new_tokens`` would instead mask EOS out of the argmax)."""
    saved = model.generation_config.eos_token_id
    if not stop_at_eos:
        model.generation_config.eos_token_id = None  # generate() falls back to it otherwise
    try:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             **generate_kwargs)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def parity_prompts(n: int = 16, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of 2 to 89 tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 90))] for _ in range(n)]


_REFERENCES: WeakKeyDictionary[Any, list[list[int]]] = WeakKeyDictionary()


def parity_references(model: Any) -> list[list[int]]:
    """``model``'s greedy ``MAX_TOKENS`` tokens for each ``parity_prompts()``, computed once per model."""
    if model not in _REFERENCES:
        _REFERENCES[model] = [hf_greedy(model, p, MAX_TOKENS) for p in parity_prompts()]
    return _REFERENCES[model]


def run_parity_workload(path: str | Path, **engine_options: Any
                        ) -> tuple[LLM, list[list[int]], list[RequestOutput], list[StepStats]]:
    """Greedy ``MAX_TOKENS`` tokens for each ``parity_prompts()`` on an ``LLM`` of ``PARITY_ENGINE`` and
    ``engine_options``: the engine, the prompts, their outputs and every step's stats."""
    stats: list[StepStats] = []
    llm = LLM(model=str(path), **{**PARITY_ENGINE, **engine_options})
    llm.engine.step_callbacks.append(lambda s, out: stats.append(s))
    prompts = parity_prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return llm, prompts, outs, stats


def check_greedy_parity(path: str | Path, model: Any, **engine_options: Any) -> LLM:
    """Run the parity workload on the checkpoint at ``path`` with ``engine_options`` (say ``backend="mine"``) and
    assert it batched several requests, preempted some, freed every KV block and gave exactly ``model``'s greedy
    tokens (``model``: that checkpoint in transformers, as ``make_hf_checkpoint`` returns it). Returns the engine."""
    llm, prompts, outs, stats = run_parity_workload(path, **engine_options)
    assert max(s.num_scheduled_reqs for s in stats) > 1, "no step batched several requests"
    assert llm.engine.scheduler.num_preemptions > 0, "no request was preempted: the KV pool is not small enough"
    for i, (prompt, out, want) in enumerate(zip(prompts, outs, parity_references(model))):
        got = out.outputs[0].token_ids
        if got != want:
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(f"prompt {i} ({len(prompt)} tokens): first difference at output token {first}: "
                                 f"{got} vs transformers' {want}")
    assert_no_kv_leaks(llm.engine)
    return llm
