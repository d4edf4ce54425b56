"""What the engine returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` plus timing."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability in one generated position, as vLLM's ``Logprob``: ``rank`` is
    its 1-based rank in that position's distribution (1 = most likely), ``decoded_token`` its text as vLLM
    gives it (``framework.engine.logprobs.token_text``; None without a tokenizer or with ``detokenize=False``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sequence's output. ``token_ids`` are every sampled token, a stop token (EOS, or one of
    ``stop_token_ids``) included; ``text`` is their decoded text without the stop token's, as
    vLLM gives it: decoded after the prompt's last tokens, so that prompt text + ``text`` reads
    as the whole sequence (a SentencePiece word keeps its leading space); empty without a
    tokenizer or with ``detokenize=False``. ``finish_reason`` is ``stop``, ``length`` or
    ``abort`` once finished; ``stop_reason`` the stop token id or stop string that ended it (None
    for EOS). A stop string (``SamplingParams.stop``) is cut from ``text`` with what follows it
    (kept with ``include_stop_str_in_output``), while ``token_ids`` keep the token that completed
    it; until finished, ``text`` then lacks its last ``len(longest stop) - 1`` characters.

    With ``SamplingParams.logprobs = k``, ``logprobs[i]`` maps the token sampled at position ``i``
    and the ``k`` most likely tokens there to their ``Logprob`` (``k`` or ``k + 1`` entries, the
    sampled token first), and ``cumulative_logprob`` is the sum of the sampled tokens' logprobs;
    both are None without it. As vLLM v1's default (raw logprobs), they are of the model's own
    distribution: float32 ``log_softmax`` of the logits before penalties, temperature, min-p,
    top-k and top-p."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """One request's times, in seconds on the engine's clock. ``token_times[i]`` is when output token ``i``
    was produced (TTFT, TPOT, ITLs follow); with ``n > 1`` it has one entry per step in which any sequence
    produced one, as a streaming client sees them, so TPOT and ITLs are a sequence's pace."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2el(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request's output so far: its ``n`` sequences in ``outputs``.

    With ``SamplingParams.prompt_logprobs = k``, ``prompt_logprobs`` has one entry per prompt
    token, as vLLM's: None for the first (nothing predicts it), then for token ``i`` a
    ``{token_id: Logprob}`` of that token (first) and the ``k`` most likely tokens at its position
    (``k`` or ``k + 1`` entries), of the distribution the model predicts from tokens ``< i`` (the
    raw float32 ``log_softmax``, as ``CompletionOutput.logprobs``). Computed once for all ``n``
    sequences; a streamed output carries them from the step that completes the prompt. None
    without it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    #: Why the request ended early (e.g. an ignored prompt), else None.
    status_message: str | None = None
    priority: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
