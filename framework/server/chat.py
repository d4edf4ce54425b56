"""``/v1/chat/completions``: messages through the tokenizer's chat template, answered whole or streamed."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from framework.common.outputs import CompletionOutput, Logprob
from framework.server.completions import _check_ran, _Choice
from framework.server.errors import APIError
from framework.server.protocol import ChatCompletionRequest
from framework.server.serving import Serving, clamp_logprob, sse_events, token_text, usage


def chat_prompt(serving: Serving, body: ChatCompletionRequest) -> list[int]:
    """The token ids of ``body``'s messages as the tokenizer's chat template renders them (special tokens come from
    the template, none are added); APIError (400) when the checkpoint has no template or the template fails."""
    tokenizer = serving.tokenizer
    if tokenizer is None:
        raise APIError(f"model {serving.model_name!r} has no tokenizer, so chat messages cannot be rendered; use "
                       f"/v1/completions with token ids", param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(f"model {serving.model_name!r} has no chat template (its tokenizer_config.json sets no "
                       f"chat_template), so chat messages cannot be rendered; use /v1/completions, or a checkpoint "
                       f"whose tokenizer has one", param="messages")
    messages = [m.as_template_input() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message,
                                             **(body.chat_template_kwargs or {}))
    except Exception as exc:  # the template's own errors (jinja's, a raise_exception in it)
        raise APIError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                       param="messages") from None
    return serving.token_ids(tokenizer.encode(text, add_special_tokens=False))


class ChatJob:
    """One ``/v1/chat/completions`` request, checked on construction (APIError for a bad one); ``n`` choices."""

    def __init__(self, serving: Serving, body: ChatCompletionRequest, arrival_time: float) -> None:
        serving.check_model(body.model)
        body.check_supported()
        self.serving, self.body, self.arrival_time = serving, body, arrival_time
        self.prompt = chat_prompt(serving, body)
        self.params = body.sampling_params(
            serving.max_tokens(len(self.prompt), body.requested_max_tokens, body.fields["max_tokens"]),
            body.num_logprobs, serving.sampling_defaults)
        serving.check_params(self.params, body.fields)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.ids = [self.id]
        self.created = int(time.time())

    def _outputs(self):
        return self.serving.run(self.ids, [self.prompt], [self.params], self.arrival_time, self.body.priority,
                                self.body.cache_salt)

    def _update(self, choice: _Choice, delta: CompletionOutput) -> list[dict[str, Any]] | None:
        choice.text.append(delta.text)
        choice.num_tokens += len(delta.token_ids)
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.logprobs is None:
            return None
        part = _logprobs(delta.logprobs, delta.token_ids, self.serving.tokenizer, self.body.top_logprobs or 0)
        if choice.logprobs is None:
            choice.logprobs = {"content": []}
        choice.logprobs["content"].extend(part)
        return part

    async def response(self) -> dict[str, Any]:
        choices: dict[int, _Choice] = {}
        async with aclosing(self._outputs()) as outputs:
            async for _, out in outputs:
                _check_ran(out)
                for delta in out.outputs:
                    self._update(choices.setdefault(delta.index, _Choice()), delta)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.serving.model_name,
                "choices": [{"index": k, "message": {"role": "assistant", "content": "".join(c.text)},
                             "logprobs": c.logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                            for k, c in sorted(choices.items())],
                "usage": usage(len(self.prompt), sum(c.num_tokens for c in choices.values()))}

    def events(self) -> AsyncIterator[str]:
        """Per choice: a first chunk with the role, then one with each step's text; then the usage (when asked)
        and ``[DONE]``."""
        choices: dict[int, _Choice] = {}

        def final() -> dict[str, Any] | None:
            if not self.body.include_usage:
                return None
            return {**self._chunk(None), "usage": usage(len(self.prompt), sum(c.num_tokens for c in choices.values()))}
        return sse_events(self._chunks(choices), final)

    async def _chunks(self, choices: dict[int, _Choice]) -> AsyncGenerator[dict[str, Any], None]:
        body = self.body
        async with aclosing(self._outputs()) as outputs:
            async for _, out in outputs:
                _check_ran(out)
                for delta in out.outputs:
                    if delta.index not in choices:
                        choices[delta.index] = _Choice()
                        yield self._chunk({"index": delta.index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None})
                    part = self._update(choices[delta.index], delta)
                    chunk = self._chunk({"index": delta.index, "delta": {"content": delta.text},
                                         "logprobs": None if part is None else {"content": part},
                                         "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason})
                    if body.include_usage and body.continuous_usage:
                        chunk["usage"] = usage(len(self.prompt), sum(c.num_tokens for c in choices.values()))
                    yield chunk

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.serving.model_name, "choices": [] if choice is None else [choice], "usage": None}


def _logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], tokenizer: Any, top: int) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs of these tokens: each with its ``top`` most likely alternatives, by rank."""
    def item(token_id: int, lp: Logprob) -> dict[str, Any]:
        text = token_text(token_id, lp, tokenizer)
        return {"token": text, "logprob": clamp_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        content.append({**item(token_id, entry[token_id]), "top_logprobs": [item(t, lp) for t, lp in ranked[:top]]})
    return content
