"""The official ``openai`` client against a real server: completions and chat, streamed and not, n > 1, logprobs,
stop strings, usage, the API key, and greedy outputs equal to ``LLM.generate``'s."""
from __future__ import annotations

import httpx
import openai
import pytest

from framework import LLM, SamplingParams
from tests.framework.server.support import API_KEY

PROMPT = "w5 w6 w7 w8"
#: vLLM's extra sampling field, which the openai client sends in its body.
IGNORE_EOS = {"ignore_eos": True}


def test_greedy_completion_equals_llm_generate(client, chat_ckpt, server):
    got = client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body=IGNORE_EOS)
    llm = LLM(model=str(chat_ckpt), backend="naive", max_model_len=256, max_num_batched_tokens=256)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0]
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(llm.get_tokenizer().encode(PROMPT))
    assert got.usage.completion_tokens == 8 and got.model == str(chat_ckpt) and got.object == "text_completion"
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_completion_adds_up_to_the_whole_one_with_usage_last(client, chat_ckpt):
    whole = client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body=IGNORE_EOS)
    chunks = list(client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=6, temperature=0,
                                            extra_body=IGNORE_EOS, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6  # one chunk per token
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(client, chat_ckpt):
    def stream(**options):
        return list(client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=4, temperature=0,
                                              extra_body=IGNORE_EOS, stream=True, stream_options=options))

    chunks = stream(include_usage=True, continuous_usage_stats=True)
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 4]
    assert chunks[-1].choices == [] and all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)
    # As vLLM's, the running usage comes only with include_usage.
    assert all(c.usage is None for c in stream(continuous_usage_stats=True))


def test_n_samples_and_a_batch_of_prompts(client, chat_ckpt):
    got = client.completions.create(model=str(chat_ckpt), prompt=[PROMPT, "w9 w10"], n=3, max_tokens=4,
                                    temperature=1.0, seed=7, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in got.choices) == list(range(6))
    assert got.usage.completion_tokens == 24
    again = client.completions.create(model=str(chat_ckpt), prompt=[PROMPT, "w9 w10"], n=3, max_tokens=4,
                                      temperature=1.0, seed=7, extra_body=IGNORE_EOS)
    assert [c.text for c in again.choices] == [c.text for c in got.choices]  # seeded
    streamed = list(client.completions.create(model=str(chat_ckpt), prompt=PROMPT, n=2, max_tokens=3, stream=True,
                                              temperature=1.0, seed=7, extra_body=IGNORE_EOS))
    per_choice = {i: "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in (0, 1)}
    assert per_choice == {0: got.choices[0].text[:len(per_choice[0])], 1: per_choice[1]} and all(per_choice.values())


def test_choices_are_numbered_prompt_by_prompt_streamed_or_not(client, chat_ckpt):
    kwargs = dict(model=str(chat_ckpt), prompt=[PROMPT, "w9 w10"], n=2, max_tokens=3, temperature=1.0, seed=3,
                  extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    streamed = list(client.completions.create(**kwargs, stream=True))
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(4)}
    assert texts == {c.index: c.text for c in whole.choices}


def test_completion_logprobs(client, chat_ckpt):
    got = client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body=IGNORE_EOS)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert " ".join(lp.tokens) == got.choices[0].text.strip()  # the word tokenizer's tokens, one word each
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == value
        assert value == max(top.values())  # greedy: the sampled token is the most likely
    assert lp.text_offset[0] == 0
    assert lp.text_offset[1:] == [offset + len(token) for offset, token in zip(lp.text_offset, lp.tokens)][:-1]


def test_stop_string_ends_the_text_before_it(client, chat_ckpt):
    free = client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body=IGNORE_EOS)
    words = free.choices[0].text.split()
    stop = " " + words[2]
    got = client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                    extra_body=IGNORE_EOS)
    assert got.choices[0].finish_reason == "stop" and got.choices[0].stop_reason == stop
    assert got.choices[0].text == free.choices[0].text[:free.choices[0].text.index(stop)]
    streamed = client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=8, temperature=0, stop=stop,
                                         extra_body=IGNORE_EOS, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text
    kept = client.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={**IGNORE_EOS, "include_stop_str_in_output": True})
    assert kept.choices[0].text == got.choices[0].text + stop


def test_chat_streamed_and_not(client, chat_ckpt):
    messages = [{"role": "user", "content": "w11 w12"}]
    whole = client.chat.completions.create(model=str(chat_ckpt), messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content and whole.choices[0].finish_reason == "length"
    # The template's rendering, tokenized without added special tokens: "w1 w11 w12 </s> w2" is 5 tokens.
    assert whole.usage.prompt_tokens == 5 and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=str(chat_ckpt), messages=messages, max_tokens=5,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].usage.completion_tokens == 5 and all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model=str(chat_ckpt), messages=messages, max_tokens=5, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
    assert all(c.choices and c.usage is None for c in plain) and len(plain) == len(chunks) - 1


def test_chat_logprobs_and_n(client, chat_ckpt):
    got = client.chat.completions.create(model=str(chat_ckpt), messages=[{"role": "user", "content": "w3"}], n=2,
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.0,
                                                     "repetition_penalty": 1.0, "priority": 1})
    assert [c.index for c in got.choices] == [0, 1]
    assert got.choices[0].message.content == got.choices[1].message.content  # greedy
    content = got.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        assert item.bytes == list(item.token.encode())


def test_chat_logprobs_without_top_logprobs_give_each_tokens_logprob_alone(client, chat_ckpt):
    got = client.chat.completions.create(model=str(chat_ckpt), messages=[{"role": "user", "content": "w3"}],
                                         max_tokens=3, temperature=0, logprobs=True, extra_body=IGNORE_EOS)
    content = got.choices[0].logprobs.content
    assert len(content) == 3 and all(item.top_logprobs == [] and item.logprob <= 0 for item in content)


def test_chat_template_kwargs_reach_the_template(client, chat_ckpt, server, monkeypatch):
    template = server.server.engine.tokenizer.chat_template
    monkeypatch.setattr(server.server.engine.tokenizer, "chat_template",
                        "{% if extra_turn %}w9 w9 w9 {% endif %}" + template)

    def prompt_tokens(**kwargs) -> int:
        return client.chat.completions.create(model=str(chat_ckpt), messages=[{"role": "user", "content": "w3"}],
                                              max_tokens=1, extra_body=kwargs).usage.prompt_tokens

    assert prompt_tokens(chat_template_kwargs={"extra_turn": True}) == prompt_tokens() + 3


def test_chat_max_completion_tokens_wins_over_max_tokens(client, chat_ckpt):
    got = client.chat.completions.create(model=str(chat_ckpt), messages=[{"role": "user", "content": "w3"}],
                                         max_tokens=5, max_completion_tokens=2, extra_body=IGNORE_EOS)
    assert got.usage.completion_tokens == 2


def test_continue_final_message_leaves_the_last_turn_open(client, chat_ckpt):
    def prompt_tokens(**kwargs) -> int:
        return client.chat.completions.create(model=str(chat_ckpt), max_tokens=1, extra_body=kwargs, messages=[
            {"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4 w5"}]).usage.prompt_tokens

    closed = prompt_tokens(add_generation_prompt=False)
    assert prompt_tokens(add_generation_prompt=False, continue_final_message=True) == closed - 1  # no </s> after it


def test_chat_without_a_template_is_a_clear_400(client, chat_ckpt, server, monkeypatch):
    monkeypatch.setattr(server.server.engine.tokenizer, "chat_template", None)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=str(chat_ckpt), messages=[{"role": "user", "content": "w3"}])


def test_models_health_and_the_api_key(server, chat_ckpt):
    assert httpx.get(f"{server.url}/health").status_code == 200  # open, as vLLM's
    refused = httpx.get(f"{server.url}/v1/models")
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=str(chat_ckpt), prompt=PROMPT, max_tokens=1)
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [str(chat_ckpt)] and models["data"][0]["max_model_len"] == 256
