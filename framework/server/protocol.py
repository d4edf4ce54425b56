"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's fields plus vLLM's extra sampling
ones), and the ``SamplingParams`` each asks for."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from framework.common.sampling_params import RequestOutputKind, SamplingParams
from framework.server.errors import APIError

#: The most samples a request may ask for (OpenAI's limit): a request's samples are built at once, on the
#: engine's thread, which serves no other client meanwhile.
MAX_N = 128

#: vLLM's sampling fields this server cannot honour, with the values that ask for nothing (accepted).
UNSUPPORTED_VLLM_FIELDS: dict[str, tuple[Any, ...]] = {
    "min_tokens": (0,), "use_beam_search": (False,), "length_penalty": (1, 1.0), "bad_words": ([],),
    "allowed_token_ids": (), "prompt_logprobs": (), "truncate_prompt_tokens": (), "logits_processors": ([],),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "guided_decoding_backend": (),
    "structured_outputs": (),
}
#: The sampling fields that an omitted (null) value leaves to the model's generation config, as vLLM's server does.
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
_NEUTRAL = SamplingParams()


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are accepted and ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, le=MAX_N)  # n < 1: SamplingParams says what n takes
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-2**63, le=2**63 - 1)  # a signed 64-bit integer, as vLLM's
    cache_salt: str | None = Field(None, min_length=1)  # prefix-cache hits only among requests of one salt

    def check_supported(self) -> None:
        """APIError (400) for fields this server cannot honour, rather than answers that silently ignore them."""
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this server", param="logit_bias")
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_VLLM_FIELDS and value is not None and value not in UNSUPPORTED_VLLM_FIELDS[name]:
                raise APIError(f"{name}={value!r} is not supported by this server", param=name)
        if not self.skip_special_tokens:
            raise APIError("skip_special_tokens=false is not supported by this server: output text always skips "
                           "special tokens", param="skip_special_tokens")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options can only be given when stream is true", param="stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: Mapping[str, Any]) -> SamplingParams:
        """The request's ``SamplingParams`` (streamed as deltas): an omitted sampling field takes its value from
        ``defaults`` (the model's generation config, ``LLMEngine.sampling_defaults``), else ``SamplingParams()``'s, as
        vLLM's server; APIError (400) naming the bad field."""
        sampling = {}
        for name in DEFAULTED_FIELDS:
            value = getattr(self, name)
            sampling[name] = value if value is not None else defaults.get(name, getattr(_NEUTRAL, name))
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, **sampling, seed=self.seed, ignore_eos=self.ignore_eos,
                stop_token_ids=self.stop_token_ids, stop=self.stop,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                output_kind=RequestOutputKind.DELTA)
        except ValueError as exc:
            raise APIError.from_value_error(exc, fields=self.fields) from None

    @property
    def fields(self) -> dict[str, str]:
        """The request fields that set ``SamplingParams`` options of another name (an error names the field)."""
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError("echo is not supported by this server", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"best_of={self.best_of} is not supported (only best_of = n)", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or token-id list, or a batch of either."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise APIError("prompt is empty: send text, token ids or a non-empty list of either", param="prompt")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template takes it: its text parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(f"only text content parts are supported, got one of type {part.get('type')!r}",
                                   param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError("tools are not supported by this server", param="tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise APIError("response_format other than text is not supported by this server", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError("add_generation_prompt and continue_final_message cannot both be true",
                           param="continue_final_message")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def fields(self) -> dict[str, str]:
        used = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return {"max_tokens": used, **({"logprobs": "top_logprobs"} if self.top_logprobs is not None else {})}

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
