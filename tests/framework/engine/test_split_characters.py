"""Outputs whose tokens split UTF-8 characters (byte-level tokenizers): a streamed text only grows, and a logprob's
token text is what vLLM gives (the character a token completes, "" while it is incomplete)."""
from __future__ import annotations

from framework import LLMEngine, SamplingParams
from framework.common.sampling_params import RequestOutputKind
from framework.engine.logprobs import token_text
from framework.engine.output_processor import decode_continuation
from framework.testing.parity import make_hf_checkpoint
from tests.framework.common.test_detokenizer import chunk_tokenizer


def test_a_logprobs_token_text_completes_split_characters_as_vllm():
    # vLLM 0.32's decoded tokens for this chain (U+FFFD alone, as before, for each of the first bytes).
    tok, ids = chunk_tokenizer(["é".encode()[:1], "é".encode()[1:], b"a", *("日".encode()[i:i + 1] for i in range(3)),
                                b"b"])
    texts = [token_text(tok, token, ids[:i]) for i, token in enumerate(ids)]
    assert texts == ["", "é", "a", "", "", "日", "b"]
    # Its first byte alone, with nothing before it to complete: still incomplete.
    assert token_text(tok, ids[1], []) == ""


def test_a_sentencepiece_pieces_leading_space_is_kept_as_vllm():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "\u2581hello": 1, "x": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    assert tok.decode([1]) == "hello"  # decoded alone, the piece's space is stripped
    assert (token_text(tok, 1, []), token_text(tok, 2, [1])) == (" hello", "x")


def test_a_streamed_text_only_grows_while_characters_are_split(tmp_path):
    # Decoded whole every step, a character whose bytes were still coming showed as U+FFFD, then as itself: the
    # text was rewritten, and a client taking new[len(old):] lost characters.
    tok, _ = chunk_tokenizer([])
    make_hf_checkpoint(tmp_path, "llama", vocab_size=len(tok))
    tok.save_pretrained(tmp_path)
    engine = LLMEngine(model=str(tmp_path), backend="naive", max_model_len=64, num_gpu_blocks_override=16)
    prompt = tok.encode("hello")
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=40, temperature=1.0, seed=0, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE))
    texts, held_back = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            whole = decode_continuation(tok, prompt, completion.token_ids)
            held_back += not out.finished and whole.endswith("\ufffd")
            texts.append(completion.text)
    assert held_back > 0  # the sampled bytes did split characters
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == decode_continuation(tok, prompt, completion.token_ids)  # finished: the whole decode
