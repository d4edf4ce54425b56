"""Stop strings (``SamplingParams.stop``), checked against a reference written here: decode the
whole greedy continuation with the transformers tokenizer after each token and find the first
occurrence of a stop string by hand."""
from __future__ import annotations

import pytest

from framework import LLM, EngineConfig, LLMEngine, SamplingParams
from framework.common.detokenizer import IncrementalDetokenizer
from framework.engine.output_processor import decode_continuation
from framework.common.request import Request
from framework.testing.parity import hf_greedy

PROMPT_TEXT = "w5 w17 w3 w300 w42"
MAX = 20


def reference(tok, prompt, tokens, stops, include=False):
    """(text, token ids, finish reason, stop reason) of ``tokens`` sampled after ``prompt`` and
    stopped at the first token whose text completes one of ``stops`` (the earliest one in the
    text), decoding the whole sequence anew after each token."""
    before = tok.decode(prompt, skip_special_tokens=True)
    for k in range(1, len(tokens) + 1):
        whole = tok.decode(prompt + tokens[:k], skip_special_tokens=True)
        assert whole.startswith(before)
        text = whole[len(before):]
        hits = sorted((text.find(s), i, s) for i, s in enumerate(stops) if s in text)
        if hits:
            at, _, stop = hits[0]
            return text[:at + len(stop) if include else at], tokens[:k], "stop", stop
    text = tok.decode(prompt + tokens, skip_special_tokens=True)[len(before):]
    return text, tokens, "length", None


@pytest.fixture(scope="module")
def setup(llama_ckpt):
    """An LLM on the tiny checkpoint, its tokenizer, a prompt, its greedy continuation and that
    continuation's text."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), max_model_len=128, block_size=4, seed=0)
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPT_TEXT)
    greedy = hf_greedy(hf_model, prompt, MAX)
    text = reference(tok, prompt, greedy, [])[0]
    return llm, tok, prompt, greedy, text


def greedy_params(**kw):
    return SamplingParams(**{"max_tokens": MAX, "temperature": 0.0, "ignore_eos": True, **kw})


def check(out, ref):
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ref


def word_span(text, first, last):
    """The text from the middle of word ``first`` to the middle of word ``last`` (spaces kept)."""
    starts = [i for i, c in enumerate(text) if c == " "] + [len(text)]
    return text[starts[first] + 2:starts[last] + 3]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("span", [(4, 5), (6, 8), (0, 0), (2, 2)], ids=["two-words", "three-words", "first-token", "one-word"])
def test_a_stop_string_cuts_the_greedy_output_where_the_reference_finds_it(setup, span, include):
    llm, tok, prompt, greedy, text = setup
    stop = word_span(text, *span)
    if span == (0, 0):
        stop = text[1:3]  # "w4" of " w40": inside the first token's text
    ref = reference(tok, prompt, greedy, [stop], include)
    assert ref[2] == "stop" and len(ref[1]) < MAX  # it really stops early
    out = llm.generate(prompt, greedy_params(stop=stop, include_stop_str_in_output=include))[0].outputs[0]
    check(out, ref)
    if span == (0, 0):
        assert out.token_ids == greedy[:1]


@pytest.mark.parametrize("stop", [None, "zz"], ids=["plain", "stop-string"])
def test_a_prompt_ending_in_special_tokens_still_gives_the_outputs_leading_space(setup, stop):
    # A chat-style prompt ending in "</s><s>": decoded alone after those tokens, which decoding skips,
    # the output would lose the space the full decode puts between the prompt's last word and it.
    llm, tok, prompt, _, _ = setup
    ended = prompt + [tok.eos_token_id, tok.bos_token_id]
    out = llm.generate(ended, greedy_params(stop=stop))[0].outputs[0]
    text = reference(tok, ended, out.token_ids, [])[0]
    assert text.startswith(" ") and out.text == text


def test_of_several_stop_strings_the_earliest_in_the_text_ends_it(setup):
    llm, tok, prompt, greedy, text = setup
    late, early = word_span(text, 4, 5), word_span(text, 1, 2)
    ref = reference(tok, prompt, greedy, [late, early])
    assert ref[3] == early
    check(llm.generate(prompt, greedy_params(stop=[late, early]))[0].outputs[0], ref)
    # Both completed by one token: the text is still cut at the earlier (vLLM would take the
    # one listed first, leaving the other in the text).
    word = text.split()[3]
    both = [word, text[text.index(word) - 3:text.index(word) + len(word)]]
    ref = reference(tok, prompt, greedy, both)
    assert ref[3] == both[1] and len(ref[1]) == 4
    check(llm.generate(prompt, greedy_params(stop=both))[0].outputs[0], ref)
    # One that never shows changes nothing.
    ref = reference(tok, prompt, greedy, [])
    check(llm.generate(prompt, greedy_params(stop=["w9999", "zz"]))[0].outputs[0], ref)


def test_max_tokens_stop_tokens_and_stop_strings_whichever_comes_first(setup):
    llm, tok, prompt, greedy, text = setup
    stop = word_span(text, 5, 6)
    k = len(reference(tok, prompt, greedy, [stop])[1])
    # max_tokens first: the whole text, "length".
    ref = reference(tok, prompt, greedy[:k - 1], [stop])
    assert ref[2] == "length"
    check(llm.generate(prompt, greedy_params(stop=stop, max_tokens=k - 1))[0].outputs[0], ref)
    # The stop string on the last allowed token: "stop", as vLLM.
    check(llm.generate(prompt, greedy_params(stop=stop, max_tokens=k))[0].outputs[0],
          reference(tok, prompt, greedy, [stop]))
    # A stop token first: it ends the sequence, its text is not shown.
    out = llm.generate(prompt, greedy_params(stop=stop, stop_token_ids=[greedy[2]]))[0].outputs[0]
    assert greedy[2] not in greedy[:2]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (greedy[:3], "stop", greedy[2])
    assert out.text == reference(tok, prompt, greedy[:2], [])[0]
    # A stop token whose own text holds the stop string: the token's text is never decoded, so
    # the token, not the string, ends it (as vLLM: the stop token is left out of detokenization).
    word = tok.decode([greedy[3]])
    assert word not in text[:text.index(word)] and greedy[3] not in greedy[:3]
    out = llm.generate(prompt, greedy_params(stop=word, stop_token_ids=[greedy[3]]))[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (greedy[:4], "stop", greedy[3])


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
@pytest.mark.parametrize("stop", [None, "zz"], ids=["no-stop-string", "stop-string"])
def test_include_stop_str_in_output_shows_a_stop_tokens_text(llama_ckpt, setup, kind, stop):
    """As vLLM's detokenizer: the stop token's text is left out unless ``include_stop_str_in_output``, on either
    path (incremental text with stop strings or deltas, decoded at the end)."""
    _, tok, prompt, greedy, text = setup
    assert greedy[2] not in greedy[:2]
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt[0]), max_model_len=128, block_size=4, seed=0))
    for include in (False, True):
        engine.add_request(str(include), prompt, greedy_params(stop=stop, stop_token_ids=[greedy[2]], output_kind=kind,
                                                               include_stop_str_in_output=include))
    texts = {"False": "", "True": ""}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done = out.outputs[0]
            texts[out.request_id] = texts[out.request_id] + done.text if kind == "delta" else done.text
            if out.finished:
                assert (done.finish_reason, done.stop_reason) == ("stop", greedy[2])
    assert texts == {"False": reference(tok, prompt, greedy[:2], [])[0],
                     "True": reference(tok, prompt, greedy[:3], [])[0]}
    assert texts["True"] != texts["False"]


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_never_shows_what_a_stop_string_cuts(llama_ckpt, setup, include):
    _, tok, prompt, greedy, text = setup
    stop = word_span(text, 5, 6)  # "28 w2": "...w328" shows a step before it completes
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt[0]), max_model_len=128, block_size=4, seed=0))
    engine.add_request("0", prompt, greedy_params(stop=stop, include_stop_str_in_output=include))
    streamed = []
    while engine.has_unfinished_requests():
        streamed += [o.outputs[0] for o in engine.step()]
    final = streamed[-1]
    check(final, reference(tok, prompt, greedy, [stop], include))
    assert [o.finished() for o in streamed] == [False] * (len(streamed) - 1) + [True]
    for out in streamed[:-1]:
        assert final.text.startswith(out.text)
        # vLLM holds back the last len(stop) - 1 characters, which the stop string may cut; none when it cuts nothing.
        whole = reference(tok, prompt, out.token_ids, [])[0]
        held = 0 if include else len(stop) - 1
        assert out.text == whole[:max(len(whole) - held, 0)]


@pytest.mark.parametrize("preparer", ["v0", "v1"])
def test_parallel_samples_each_stop_on_their_own(llama_ckpt, preparer):
    llm = LLM(model=str(llama_ckpt[0]), max_model_len=128, block_size=4, seed=0, preparer=preparer)
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPT_TEXT)
    params = SamplingParams(n=3, max_tokens=MAX, temperature=1.0, seed=7, ignore_eos=True)
    free = llm.generate(prompt, params)[0].outputs  # seeded: the same tokens with stop strings
    texts = [reference(tok, prompt, o.token_ids, [])[0] for o in free]
    stops = [word_span(texts[0], 2, 3), word_span(texts[1], 9, 10)]
    refs = [reference(tok, prompt, o.token_ids, stops) for o in free]
    assert len({len(r[1]) for r in refs}) > 1 and all(len(r[1]) < MAX for r in refs[:2])
    outs = llm.generate(prompt, SamplingParams(n=3, max_tokens=MAX, temperature=1.0, seed=7, ignore_eos=True,
                                               stop=stops))[0].outputs
    for out, ref in zip(outs, refs):
        check(out, ref)


def test_the_stop_check_decodes_a_few_tokens_per_token(setup, monkeypatch):
    # Linear, not quadratic: each token decodes its context and itself, never the whole text.
    llm, tok, prompt, greedy, text = setup
    lengths = []
    decode = type(tok).decode
    monkeypatch.setattr(type(tok), "decode", lambda self, ids, **kw: lengths.append(len(ids)) or decode(self, ids, **kw))
    out = llm.generate(prompt, greedy_params(stop="w9999"))[0].outputs[0]
    assert len(out.token_ids) == MAX and out.text == text
    assert len(lengths) == 2 * MAX and max(lengths) <= 6


def test_multibyte_characters_split_across_tokens_are_matched_whole():
    # A byte-level tokenizer, one token per byte: "é" and "€" take two and three tokens, and the
    # text shows them only once their last byte comes.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    prompt = tok.encode("prix: ")
    tokens = tok.encode("café 3€ et thé, 5€ à emporter")
    for stops, include in [(["€ e"], False), (["é,", "€ à"], True), (["3€"], False), (["zz"], False)]:
        detok = IncrementalDetokenizer(tok, prompt, stops, include)
        for k, token in enumerate(tokens, 1):
            stop = detok.append(token)
            if stop is not None:
                break
        text, ids, reason, ref_stop = reference(tok, prompt, tokens, stops, include)
        assert (detok.text, tokens[:k], stop if stop else None) == (text, ids, ref_stop)
        assert reason == ("stop" if stop else "length")


def chunk_tokenizer(chunks):
    """A byte-level tokenizer with one token per byte plus one per chunk of bytes in ``chunks``
    (so a token may end part-way through a character), and the chunks' token ids."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte-to-character map, which the ByteLevel decoder inverts.
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    to_char = {b: chr(b if b in shown else next(extra)) for b in range(256)}
    spell = ["".join(to_char[b] for b in chunk) for chunk in chunks]
    vocab = {c: i for i, c in enumerate(sorted(to_char.values()))}
    for word in spell:
        vocab.setdefault(word, len(vocab))
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=raw), [vocab[w] for w in spell]


def test_of_stop_strings_found_at_the_same_place_the_one_listed_first_ends_it():
    tok, (ab,) = chunk_tokenizer([b"ab"])
    prompt = [tok.convert_tokens_to_ids("p")]
    assert IncrementalDetokenizer(tok, prompt, ["ab", "a"]).append(ab) == "ab"
    assert IncrementalDetokenizer(tok, prompt, ["a", "ab"]).append(ab) == "a"


def test_a_stop_string_before_an_incomplete_character_ends_the_sequence_at_its_token():
    # "テ" and the first byte of "キ" in one token: the text is "aテ" plus an incomplete
    # character. The stop string is there now (the reference finds it); waiting for the
    # character to complete stopped a token late, or, on the last allowed token, not at all.
    tok, tokens = chunk_tokenizer([b"a", "テ".encode() + "キ".encode()[:1], "キ".encode()[1:] + b"b", b"c"])
    prompt = [tok.convert_tokens_to_ids("p")]
    for stops, include in [(["テ"], False), (["aテ"], True), (["zz"], False)]:
        for max_tokens in (2, 4):
            req = Request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stops,
                                                      include_stop_str_in_output=include), 0.0)
            req.detokenizer = IncrementalDetokenizer(tok, prompt, req.sampling_params.stop, include)
            for token in tokens:
                req.append_output_token(token, 0.0)
                status = req.check_stop()
                if status is not None:
                    break
            text, ids, reason, stop = reference(tok, prompt, tokens[:max_tokens], stops, include)
            assert (req.detokenizer.output_text(True), req.output_token_ids, status.finish_reason,
                    req.stop_reason) == (text, ids, reason, stop)


def test_finished_text_ends_as_the_full_decode_does():
    # Bytes that never make a character (0x80 alone), or an incomplete one cut by the finish
    # (a length cap, an abort, an EOS), show as U+FFFD, as the full decode (and the engine's text
    # without stop strings) shows them; they were dropped from a stop-string request's text.
    tok, tokens = chunk_tokenizer([b"ab", b"\x80", b"\x80", "テ".encode()[:2]])
    prompt = [tok.convert_tokens_to_ids("p")]
    for k in range(1, len(tokens) + 1):
        # The last allowed token, or a finish check_stop never saw (an abort).
        for max_tokens, finish in [(k, "length"), (k + 1, None)]:
            req = Request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop="zz"), 0.0)
            req.detokenizer = IncrementalDetokenizer(tok, prompt, ["zz"])
            for token in tokens[:k]:
                req.append_output_token(token, 0.0)
                status = req.check_stop()
            assert getattr(status, "finish_reason", None) == finish
            assert req.detokenizer.output_text(True) == reference(tok, prompt, tokens[:k], [])[0]


@pytest.mark.parametrize("char", ["é", "€"])
def test_a_character_split_across_the_prompts_end_shows_as_without_stop_strings(char):
    # The prompt ends with the first byte of the character, the output starts with the rest (one byte a token):
    # decoded after the prompt's text, the output's first characters were taken by position from a text that had
    # merged them, so a stop-string request's text lost them, unlike the same request without stop strings
    # (decode_continuation decodes such an output alone). "€" has 3 bytes: the first output token leaves it open.
    raw = char.encode()
    tok, (first, *rest, ab, stop) = chunk_tokenizer([raw[i:i + 1] for i in range(len(raw))] + [b"ab", b"zz"])
    prompt = [tok.convert_tokens_to_ids("p"), first]
    tokens = [*rest, ab, stop]
    for k in range(1, len(tokens) + 1):
        detok = IncrementalDetokenizer(tok, prompt, ["zz"])
        found = [detok.append(t, final=i == k - 1) for i, t in enumerate(tokens[:k])]
        text = decode_continuation(tok, prompt, tokens[:k])
        if "zz" in text:
            assert found[-1] == "zz" and detok.output_text(True) == text[:text.index("zz")]
        else:
            assert set(found) == {None} and detok.output_text(True) == text


# -- what cannot stop on text -------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(stop=""), "stop must be None, a non-empty string or a list of them"),
    (dict(stop=["a", ""]), "stop must be None, a non-empty string or a list of them"),
    (dict(stop=[3]), "stop must be None"),
    (dict(stop=b"a"), "stop must be None"),
    (dict(stop="a", detokenize=False), "SamplingParams.stop .* needs detokenize=True"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be True or False"),
])
def test_bad_stop_options_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_a_single_stop_string_is_a_list_of_one():
    assert SamplingParams(stop="ab").stop == ["ab"] and SamplingParams().stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(model="tiny-llama"), "model 'tiny-llama' has no tokenizer"),
    (dict(model="tiny-llama", executor="sim", executor_options={"hardware": "cpu"}),
     "executor=sim samples synthetic tokens with no text: it cannot simulate SamplingParams.stop"),
])
def test_stop_strings_without_text_are_refused_with_nothing_queued(kwargs, match):
    llm = LLM(max_model_len=128, **kwargs)
    params = SamplingParams(max_tokens=4, stop="x")
    with pytest.raises(ValueError, match=match) as info:
        llm.engine.add_request("0", [5, 6, 7], params)
    assert "\n" not in str(info.value) and not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=match):  # generate checks every prompt before queueing any
        llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=4), params])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4
