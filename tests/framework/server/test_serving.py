"""What both endpoints share: the server-sent events of a stream and how they end, logprobs JSON can carry."""
from __future__ import annotations

import asyncio
import json

import pytest

from framework import EngineConfig, LLMEngine
from framework.common.outputs import Logprob
from framework.server.completions import _logprobs
from framework.server.engine_loop import EngineDeadError, EngineLoop
from framework.server.errors import APIError
from framework.server.serving import Serving, sse_events


def events(*items, last=None) -> list:
    """The events ``sse_events`` sends for chunks ``items`` (an exception ends them), as JSON or ``[DONE]``."""
    async def chunks():
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def collect():
        return [e async for e in sse_events(chunks(), lambda: last)]

    sent = asyncio.run(collect())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in sent)
    return [e[6:-2] if e[6:-2] == "[DONE]" else json.loads(e[6:-2]) for e in sent]


def test_a_stream_sends_its_chunks_then_the_last_one_then_done():
    assert events({"a": 1}, {"a": 2}, last={"usage": 3}) == [{"a": 1}, {"a": 2}, {"usage": 3}, "[DONE]"]
    assert events({"a": 1}) == [{"a": 1}, "[DONE]"]


def test_a_failed_stream_ends_with_its_error_event_and_done_without_the_last_one():
    refused = events({"a": 1}, APIError("too long", param="prompt"), last={"usage": 3})
    assert refused[0] == {"a": 1} and refused[-1] == "[DONE]" and len(refused) == 3
    assert refused[1]["error"]["code"] == 400 and refused[1]["error"]["param"] == "prompt"
    dead = events(EngineDeadError("the engine failed"), last={"usage": 3})
    assert dead[0]["error"]["code"] == 503 and dead[1:] == ["[DONE]"]


def test_an_impossible_token_is_sent_with_vllms_finite_logprob():
    entry = {5: Logprob(float("-inf"), rank=2, decoded_token="w5"), 6: Logprob(-0.5, rank=1, decoded_token="w6")}
    got, _ = _logprobs([entry], [5], None, 0)
    json.dumps(got, allow_nan=False)
    assert got["token_logprobs"] == [-9999.0] and got["top_logprobs"] == [{"w5": -9999.0, "w6": -0.5}]


def test_a_text_prompt_to_a_model_without_a_tokenizer_is_told_to_send_token_ids():
    serving = Serving(EngineLoop(LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64))), "tiny-llama")
    with pytest.raises(APIError, match=r'no tokenizer, so a text prompt cannot be encoded; send "prompt" as a list '
                                       r'of token ids') as refused:
        serving.token_ids("Hello")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert serving.token_ids([5, 6, 7]) == [5, 6, 7]
