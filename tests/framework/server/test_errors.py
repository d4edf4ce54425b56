"""Bad requests get OpenAI's error body with a 4xx status, never a 500; ``/metrics`` speaks vLLM's names."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.framework.server.support import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(server, path: str, body: dict | str) -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(f"{server.url}{path}", content=body, headers={**AUTH, "Content-Type": "application/json"})
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH)


def assert_error(response: httpx.Response, status: int, param: str | None = None, match: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert re.search(match, error["message"]), error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("body, param, match", [
    ({"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"top_k": 2**63}, "top_k", "top_k"),  # past 64 bits it had failed the engine mid-step, for every client
    ({"cache_salt": ""}, "cache_salt", "at least 1 character"),
    ({"n": 0}, "n", "n must be"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"logprobs": 50}, "logprobs", "max_logprobs"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"prompt": [100000]}, "prompt", "vocab"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": " ".join(["w4"] * 300)}, "prompt", "maximum context length is 256"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ({"skip_special_tokens": False}, "skip_special_tokens", "skip_special_tokens=false is not supported"),
    ({"n": "many"}, "n", "integer"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"n": 129}, "n", "less than or equal to 128"),
    ({"priority": 10**30}, "priority", "less than or equal to"),
    ({"min_tokens": 8}, "min_tokens", "min_tokens=8 is not supported"),
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"bad_words": ["w5"]}, "bad_words", "not supported"),
    ({"allowed_token_ids": [5]}, "allowed_token_ids", "not supported"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
    ({"truncate_prompt_tokens": 2}, "truncate_prompt_tokens", "not supported"),
    ({"guided_json": {"type": "object"}}, "guided_json", "not supported"),
    ({"echo": True}, "echo", "not supported"),
    ({"suffix": "w9"}, "suffix", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
])
def test_bad_completion_requests_are_400s(server, chat_ckpt, body, param, match):
    assert_error(post(server, "/v1/completions", {"model": str(chat_ckpt), "prompt": "w5 w6", **body}), 400, param,
                 match)


def test_an_unknown_model_is_a_404_as_in_vllm(server, client):
    assert_error(post(server, "/v1/completions", {"model": "gpt-nothing", "prompt": "w5"}), 404, "model", "does not exist")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nothing", messages=[{"role": "user", "content": "w5"}])


@pytest.mark.parametrize("body, param, match", [
    ({"max_completion_tokens": 0}, "max_completion_tokens", "^max_completion_tokens must be"),
    ({"max_tokens": 0}, "max_tokens", "^max_tokens must be"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "^top_logprobs=21 exceeds"),
    ({"max_tokens": 0, "max_completion_tokens": 0}, "max_completion_tokens", "^max_completion_tokens must be"),
])
def test_a_chat_error_names_the_field_the_client_sent(server, chat_ckpt, body, param, match):
    """Chat's output length and logprob count have two names: the error names the one the client sent."""
    assert_error(post(server, "/v1/chat/completions",
                      {"model": str(chat_ckpt), "messages": [{"role": "user", "content": "w5"}], **body}),
                 400, param, match)


@pytest.mark.parametrize("body, param, match", [
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "only text content parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages", "only text content parts"),
    ({"messages": [{"content": "w5"}]}, "messages", r"^messages\.0\.role: "),
])
def test_bad_chat_requests_are_400s(server, chat_ckpt, body, param, match):
    assert_error(post(server, "/v1/chat/completions",
                      {"model": str(chat_ckpt), "messages": [{"role": "user", "content": "w5"}], **body}),
                 400, param, match)


def test_the_largest_n_and_a_best_of_equal_to_n_are_accepted(client, chat_ckpt):
    out = client.completions.create(model=str(chat_ckpt), prompt="w5 w6", n=128, max_tokens=1,
                                    extra_body={"best_of": 128})
    assert len(out.choices) == 128


def test_a_prompt_and_its_max_tokens_must_fit_the_context(server, client, chat_ckpt):
    def prompt(num_tokens: int) -> list[int]:
        return [5] * num_tokens

    assert_error(post(server, "/v1/completions", {"model": str(chat_ckpt), "prompt": prompt(256)}), 400, "prompt",
                 "maximum context length is 256")
    # As vLLM's: a max_tokens beyond the room the prompt leaves is refused, not cut to it.
    assert_error(post(server, "/v1/completions", {"model": str(chat_ckpt), "prompt": prompt(250), "max_tokens": 7}),
                 400, "max_tokens", r"^max_tokens is too large: 7\. This model's maximum context length is 256 tokens "
                                    r"and the prompt has 250, which leaves 6")
    out = client.completions.create(model=str(chat_ckpt), prompt=prompt(250), max_tokens=6,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    out = client.completions.create(model=str(chat_ckpt), prompt=prompt(255), max_tokens=1)
    assert out.usage.completion_tokens == 1
    chat = {"model": str(chat_ckpt), "messages": [{"role": "user", "content": " ".join(["w5"] * 200)}]}
    assert_error(post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 100}), 400,
                 "max_completion_tokens", "max_completion_tokens is too large: 100")


def test_vllm_fields_that_ask_for_nothing_are_accepted(client, chat_ckpt):
    out = client.completions.create(model=str(chat_ckpt), prompt="w5 w6", max_tokens=2, extra_body={
        "min_tokens": 0, "use_beam_search": False, "bad_words": [], "prompt_logprobs": None, "length_penalty": 1.0})
    assert out.usage.completion_tokens >= 1


def test_malformed_bodies_are_400s(server, chat_ckpt):
    assert_error(post(server, "/v1/completions", "{not json"), 400)
    response = post(server, "/v1/completions", '{"prompt": "hi",')
    assert_error(response, 400, match=r"^the body is not valid JSON: .* at character 16$")
    assert response.json()["error"]["param"] is None  # not the offset, as a field name
    assert_error(post(server, "/v1/completions", {"model": str(chat_ckpt)}), 400, "prompt", "prompt")
    assert_error(post(server, "/v1/chat/completions", {"model": str(chat_ckpt), "messages": []}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "tools": [{}]}),
                 400, "tools")


def test_a_bad_request_changes_nothing(server, chat_ckpt):
    before = server.server.engine.num_steps
    post(server, "/v1/completions", {"model": str(chat_ckpt), "prompt": "w5", "top_p": 9})
    assert server.server.engine.num_steps == before and server.server.loop.num_in_flight() == 0


def test_metrics_use_vllms_names(server, client, chat_ckpt):
    client.completions.create(model=str(chat_ckpt), prompt="w5 w6 w7", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text  # open, as vLLM's
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert f"\n{name}{{" in text, name
    count = re.search(r'vllm:e2e_request_latency_seconds_count\{[^}]*\} (\S+)', text)
    assert count and float(count.group(1)) >= 1
    assert 'finished_reason="length"' in text and "_created" not in text


def test_a_one_token_request_counts_in_the_time_per_output_token_histogram_as_vllm(server, client, chat_ckpt):
    # vLLM observes 0 for it, so the histogram counts every finished request; it had been left out.
    def counts() -> tuple[float, float]:
        text = httpx.get(f"{server.url}/metrics").text
        return tuple(float(re.search(rf'vllm:{name}_count{{[^}}]*}} (\S+)', text).group(1))
                     for name in ("request_time_per_output_token_seconds", "e2e_request_latency_seconds"))

    before = counts()
    for max_tokens in (1, 1, 4):
        client.completions.create(model=str(chat_ckpt), prompt="w5 w6", max_tokens=max_tokens,
                                  extra_body={"ignore_eos": True})
    after = counts()
    assert after[0] - before[0] == after[1] - before[1] == 3


def test_a_cache_salt_keeps_a_prompts_cached_prefix_to_its_own_salt(server, client, chat_ckpt):
    def hits() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(re.search(r'vllm:prefix_cache_hits_total{[^}]*} (\S+)', text).group(1))

    prompt = " ".join(f"w{i}" for i in range(10, 60))  # three full blocks of 16 and more
    found = []
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        before = hits()
        client.completions.create(model=str(chat_ckpt), prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        found.append(hits() - before)
    assert found == [0, 0, 48]


def test_a_request_the_engine_fails_to_add_fails_alone(server, chat_ckpt, monkeypatch):
    """An add that raises anything but a ValueError fails its own request: the engine thread goes on serving
    the others."""
    engine = server.server.engine
    add = engine.add_request

    def failing(request_id, *args, **kwargs):
        monkeypatch.setattr(engine, "add_request", add)  # only this one
        raise OverflowError("as a bug below would")

    monkeypatch.setattr(engine, "add_request", failing)
    body = {"model": str(chat_ckpt), "prompt": "w5 w6", "max_tokens": 2}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 500 and "OverflowError" in response.json()["error"]["message"]
    assert post(server, "/v1/completions", body).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_chat_error_about_logprobs_names_top_logprobs_only_where_the_client_sent_it():
    """With ``logprobs: true`` alone, an error about the count (the sim executor returns none) names logprobs."""
    from framework.server.errors import APIError
    from framework.server.protocol import ChatCompletionRequest

    refused = ValueError("executor=sim cannot return logprobs (SamplingParams.logprobs=0)")
    for top, param in ((None, "logprobs"), (3, "top_logprobs")):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "w5"}], logprobs=True, top_logprobs=top)
        assert APIError.from_value_error(refused, fields=body.fields).param == param


def test_a_batch_with_a_prompt_the_engine_fails_to_add_fails_whole(server, chat_ckpt, monkeypatch):
    engine = server.server.engine
    add = engine.add_request

    def failing(request_id, *args, **kwargs):
        monkeypatch.setattr(engine, "add_request", add)  # only the first prompt's
        raise OverflowError("as a bug below would")

    monkeypatch.setattr(engine, "add_request", failing)
    response = post(server, "/v1/completions", {"model": str(chat_ckpt), "prompt": ["w5 w6", "w7 w8"], "max_tokens": 2})
    assert response.status_code == 500 and "OverflowError" in response.json()["error"]["message"]
    assert server.server.loop.num_in_flight() == 0
