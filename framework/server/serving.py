"""``Serving``: what both generation endpoints share: the model check, prompt checks, running a batch of prompts."""
from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from framework.common.outputs import Logprob, RequestOutput
from framework.common.sampling_params import SamplingParams
from framework.server.engine_loop import EngineDeadError, EngineLoop
from framework.server.errors import APIError, error_body

#: What a logprob of -inf is sent as (JSON has no infinities), as vLLM does.
MIN_LOGPROB = -9999.0


class Serving:
    """One served model over an ``EngineLoop``: checks requests against it and runs them."""

    def __init__(self, loop: EngineLoop, model_name: str) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.max_model_len = self.engine.config.max_model_len
        #: The sampling options omitted fields take (the model's generation config: ``LLMEngine.sampling_defaults``).
        self.sampling_defaults = self.engine.sampling_defaults

    def check_model(self, name: str | None) -> None:
        """APIError 404, as vLLM's, for a model this server does not serve (no name means this one)."""
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           HTTPStatus.NOT_FOUND, param="model")

    def token_ids(self, prompt: str | list[int]) -> list[int]:
        """A text or token-id prompt's ids; APIError (400) naming what is wrong with it."""
        if isinstance(prompt, str) and self.tokenizer is None:
            # The engine's message names the Python API's prompt_token_ids, a field /v1/completions does not have.
            raise APIError(f"model {self.model_name!r} has no tokenizer, so a text prompt cannot be encoded; send "
                           "\"prompt\" as a list of token ids", param="prompt")
        try:
            ids, _ = self.engine.tokenize(prompt)
        except ValueError as exc:
            raise APIError.from_value_error(exc, param="prompt") from None
        return ids

    def max_tokens(self, num_prompt_tokens: int, requested: int | None, field: str = "max_tokens") -> int:
        """The output budget: ``requested`` (the request's ``field``), or when None the generation config's
        ``max_new_tokens`` capped at what ``max_model_len`` leaves after the prompt, else all of that. APIError (400),
        as vLLM's, for a prompt that leaves no room for one token, or a ``requested`` below 1 or beyond the room."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                           f"{num_prompt_tokens}, which leaves no room for output: send at most "
                           f"{self.max_model_len - 1} prompt tokens", param="prompt")
        if requested is None:
            return min(self.sampling_defaults.get("max_tokens", room), room)
        if isinstance(requested, bool) or requested < 1:
            raise APIError(f"{field} must be an integer >= 1, got {requested!r}", param=field)
        if requested > room:
            raise APIError(f"{field} is too large: {requested}. This model's maximum context length is "
                           f"{self.max_model_len} tokens and the prompt has {num_prompt_tokens}, which leaves "
                           f"{room}: send {field} <= {room}", param=field)
        return requested

    def check_params(self, params: SamplingParams, fields: dict[str, str]) -> None:
        """APIError (400) for options the engine refuses, naming the request field (``fields``: option -> field)."""
        try:
            self.engine.check_params(params)
        except ValueError as exc:
            raise APIError.from_value_error(exc, fields=fields) from None

    async def run(self, ids: Sequence[str], prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                  arrival_time: float, priority: int,
                  cache_salt: str | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Each prompt's outputs as they come, with the prompt's index, under the engine ids ``ids`` (one a
        prompt). Closing this, or cancelling its reader, aborts the prompts still running."""
        streams = [self.loop.stream(rid, p, sp, arrival_time, priority, cache_salt)
                   for rid, p, sp in zip(ids, prompts, params)]
        try:
            if len(streams) == 1:
                async with aclosing(streams[0]) as stream:
                    async for out in stream:
                        yield 0, out
                return
            async for item in _merged(streams):
                yield item
        finally:
            for rid in ids:
                self.loop.abort(rid)


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Several streams' items as they come, each with its stream's index; the first error ends it."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def token_text(token_id: int, logprob: Logprob, tokenizer: Any) -> str:
    """A token's text alone, as its logprobs name it (``token_id:N`` when there is no text for it)."""
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is not None:
        return tokenizer.decode([token_id])
    return f"token_id:{token_id}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: JSON`` (or the literal ``[DONE]``) and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def sse_events(chunks: AsyncGenerator[dict[str, Any], None],
                     last: Callable[[], dict[str, Any] | None]) -> AsyncIterator[str]:
    """``chunks`` as server-sent events, then ``last()`` (None: nothing) and ``[DONE]``; a bad request or a dead
    engine ends the chunks with its error event instead of ``last()``. Closed early, it closes ``chunks`` at once
    (their request is aborted then, not when collected)."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse(chunk)
    except APIError as exc:
        yield sse(exc.body())
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), 503))
    else:
        final = last()
        if final is not None:
            yield sse(final)
    yield sse("[DONE]")
