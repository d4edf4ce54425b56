"""A served checkpoint's generation_config.json fills the sampling fields a request omits, as vLLM's server does;
fields the request sends win."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.framework.server.support import API_KEY, ThreadServer, chat_checkpoint

PROMPT = "w5 w6 w7 w8"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server of a checkpoint whose generation config keeps the top token alone (top_k 1) at temperature 0.7,
    and 3 new tokens."""
    path = chat_checkpoint(tmp_path_factory.mktemp("gen-config-chat"))
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 1, "max_new_tokens": 3}))
    running = ThreadServer(path, tmp_path_factory.mktemp("served-gen-config"), f"server.api_key={API_KEY}")
    yield running, str(path)
    running.stop()


def complete(served, **body) -> dict:
    server, model = served
    response = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=60,
                          json={"model": model, "prompt": PROMPT, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_omitted_fields_take_the_generation_config(served):
    greedy = complete(served, temperature=0, max_tokens=8)["choices"][0]["text"]
    # top_k 1 from the file: every seed gives the greedy text (at temperature 0.7, unfiltered, they would differ).
    texts = {complete(served, seed=seed, max_tokens=8)["choices"][0]["text"] for seed in range(4)}
    assert texts == {greedy}
    # A field the request sends wins: top_k 0 samples the whole vocabulary.
    sampled = {complete(served, seed=seed, max_tokens=8, top_k=0)["choices"][0]["text"] for seed in range(4)}
    assert len(sampled) > 1


def test_max_new_tokens_is_chat_s_default_and_completions_keep_openai_s(served):
    server, model = served
    def chat(**body):
        response = httpx.post(f"{server.url}/v1/chat/completions", headers=HEADERS, timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "w5 w6"}], "ignore_eos": True, **body})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["completion_tokens"]

    assert chat() == 3 and chat(max_tokens=5) == 5
    # A completion's max_tokens defaults to 16 (OpenAI's, as vLLM's); only an explicit null leaves it to the file.
    assert complete(served)["usage"]["completion_tokens"] == 16
    assert complete(served, max_tokens=None)["usage"]["completion_tokens"] == 3
