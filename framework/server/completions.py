"""``/v1/completions``: a checked request becomes a ``CompletionJob``, answered whole or streamed as server-sent events."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from framework.common.outputs import CompletionOutput, Logprob, RequestOutput
from framework.server.errors import APIError
from framework.server.protocol import CompletionRequest
from framework.server.serving import Serving, clamp_logprob, sse_events, token_text, usage


@dataclass
class _Choice:
    """One (prompt, sample) choice as its deltas come: text, token count, logprobs and how it ended."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: dict[str, list] | None = None
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionJob:
    """One ``/v1/completions`` request, checked on construction (APIError, 400 or 404, for a bad one): its prompts,
    one engine request each (``ids``), with ``n`` samples. Choice ``i * n + j`` is prompt ``i``'s sample ``j``."""

    object_name = "text_completion"

    def __init__(self, serving: Serving, body: CompletionRequest, arrival_time: float) -> None:
        serving.check_model(body.model)
        body.check_supported()
        self.serving, self.body, self.arrival_time = serving, body, arrival_time
        self.prompts = [serving.token_ids(p) for p in body.prompts()]
        self.params = [body.sampling_params(serving.max_tokens(len(p), body.max_tokens), body.logprobs,
                                             serving.sampling_defaults)
                       for p in self.prompts]
        for params in self.params:
            serving.check_params(params, body.fields)
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.ids = [f"{self.id}-{i}" for i in range(len(self.prompts))]
        self.created = int(time.time())
        self.n = body.n
        self.num_prompt_tokens = sum(map(len, self.prompts))

    def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self.serving.run(self.ids, self.prompts, self.params, self.arrival_time, self.body.priority,
                                self.body.cache_salt)

    def _update(self, choice: _Choice, delta: CompletionOutput) -> dict[str, Any] | None:
        """Fold ``delta`` into ``choice``; returns the delta's logprobs in OpenAI's completions form (or None)."""
        choice.text.append(delta.text)
        choice.num_tokens += len(delta.token_ids)
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.logprobs is None:
            return None
        part, choice.text_offset = _logprobs(delta.logprobs, delta.token_ids, self.serving.tokenizer, choice.text_offset)
        if choice.logprobs is None:
            choice.logprobs = {key: [] for key in part}
        for key, values in part.items():
            choice.logprobs[key].extend(values)
        return part

    async def response(self) -> dict[str, Any]:
        """The whole answer, once every prompt's samples finished."""
        choices: dict[int, _Choice] = {}
        async with aclosing(self._outputs()) as outputs:
            async for i, out in outputs:
                _check_ran(out)
                for delta in out.outputs:
                    self._update(choices.setdefault(i * self.n + delta.index, _Choice()), delta)
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.serving.model_name,
                "choices": [{"index": k, "text": "".join(c.text), "logprobs": c.logprobs,
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                            for k, c in sorted(choices.items())],
                "usage": usage(self.num_prompt_tokens, sum(c.num_tokens for c in choices.values()))}

    def events(self) -> AsyncIterator[str]:
        """The answer as server-sent events: a chunk per choice per step, then the usage (when asked), ``[DONE]``."""
        choices: dict[int, _Choice] = {}

        def final() -> dict[str, Any] | None:
            if not self.body.include_usage:
                return None
            return {**self._chunk([]), "usage": usage(self.num_prompt_tokens, sum(c.num_tokens for c in choices.values()))}
        return sse_events(self._chunks(choices), final)

    async def _chunks(self, choices: dict[int, _Choice]) -> AsyncGenerator[dict[str, Any], None]:
        body = self.body
        async with aclosing(self._outputs()) as outputs:
            async for i, out in outputs:
                _check_ran(out)
                for delta in out.outputs:
                    k = i * self.n + delta.index
                    choice = choices.setdefault(k, _Choice())
                    logprobs = self._update(choice, delta)
                    chunk = self._chunk([{"index": k, "text": delta.text, "logprobs": logprobs,
                                          "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}])
                    if body.include_usage and body.continuous_usage:
                        chunk["usage"] = usage(self.num_prompt_tokens, sum(c.num_tokens for c in choices.values()))
                    yield chunk

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.serving.model_name,
                "choices": choices, "usage": None}


def _check_ran(out: RequestOutput) -> None:
    """Raise APIError (400) with the engine's reason when ``out`` finished without running (its prompt never fits)."""
    if out.finished and out.status_message and not out.metrics.num_generated_tokens:
        raise APIError(out.status_message, param="prompt")


def _logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], tokenizer: Any,
              offset: int) -> tuple[dict[str, list], int]:
    """OpenAI's completions logprobs of these tokens (``text_offset`` counting from ``offset``), and the next offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        text = token_text(token_id, sampled, tokenizer)
        tokens.append(text)
        token_logprobs.append(clamp_logprob(sampled.logprob))
        top.append({token_text(t, lp, tokenizer): clamp_logprob(lp.logprob) for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}, offset
