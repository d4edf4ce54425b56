"""Request state: what the scheduler, the allocator and the runner share about one sequence."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from framework.common.detokenizer import IncrementalDetokenizer
    from framework.common.sampling_params import SamplingParams


#: The id standing for a token the step in flight samples, until it is known (async scheduling).
PLACEHOLDER = -1


class RequestStatus(enum.IntEnum):
    """A request's state and finish reason, as vLLM v0's ``SequenceStatus`` (seed 004)."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason: an ignored (too long) prompt also reports "length", as vLLM does."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


class Request:
    """One sequence to serve. ``token_ids`` is prompt then output; ``num_computed_tokens`` counts those whose
    K/V are cached (0 after a recompute preemption). Only the allocator writes ``block_ids`` and
    ``cpu_block_ids``. ``extra`` holds a researcher's own state (the class has slots)."""

    __slots__ = (
        "request_id", "prompt_token_ids", "token_ids", "sampling_params", "arrival_time", "priority",
        "status", "num_computed_tokens", "num_cached_tokens", "block_ids", "cpu_block_ids",
        "block_hashes", "stop_reason", "status_message", "eos_token_ids", "max_model_len", "max_tokens",
        "generator", "parent_id", "index", "prompt", "first_scheduled_time", "first_token_time",
        "token_times", "finished_time", "num_preemptions", "num_swaps", "forks", "extra", "arrival_order",
        "run_order",
        "detokenizer",
        "logprobs", "cumulative_logprob", "prompt_logprobs", "num_placeholders", "cache_salt",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        prompt: str | None = None,
        parent_id: str | None = None,
        index: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        #: Prefix-cache hits come only from requests of the same salt (vLLM's ``cache_salt``; None: no salt).
        self.cache_salt = cache_salt
        if hasattr(prompt_token_ids, "tolist"):  # a numpy array: Python ints, not numpy scalars
            prompt_token_ids = prompt_token_ids.tolist()
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.cpu_block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.stop_reason: int | str | None = None
        self.status_message: str | None = None
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        #: The most output tokens this request generates: ``sampling_params.max_tokens``, or when
        #: that is None (vLLM's "up to the context"), what ``max_model_len`` leaves after the
        #: prompt. Computed once here: everyone who needs the limit reads this, never the params.
        self.max_tokens: int = sampling_params.max_tokens if sampling_params.max_tokens is not None else (
            _context_left(max_model_len, len(self.prompt_token_ids)))
        self.generator: Any = None
        self.parent_id = parent_id
        self.index = index
        self.prompt = prompt
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.num_swaps = 0
        #: Parallel samples still to fork from this request when its prompt completes (vLLM v0's
        #: parallel sampling, see ``InputPreparer.forks_parallel_samples``); empty otherwise.
        self.forks: list[Request] = []
        self.extra: dict[str, Any] = {}
        #: Position in which the scheduler received the request (``Scheduler.add_request`` or a
        #: fork), 0 before: it orders requests that tie in everything else, as a queue would.
        self.arrival_order = 0
        #: Position in which it last entered the scheduler's running queue (vLLM's running-list order), 0 before.
        self.run_order = 0
        #: The output text decoded as it grows (set by the engine for a request with stop strings
        #: or DELTA outputs), else None.
        self.detokenizer: IncrementalDetokenizer | None = None
        #: With ``sampling_params.logprobs``: one ``{token_id: Logprob}`` per output token, and the
        #: sum of the output tokens' logprobs (the engine appends them); None otherwise.
        self.logprobs: list[dict[int, Any]] | None = None if sampling_params.logprobs is None else []
        self.cumulative_logprob: float | None = None if sampling_params.logprobs is None else 0.0
        #: With ``sampling_params.prompt_logprobs``: None for the first prompt token, then one
        #: ``{token_id: Logprob}`` per prompt token computed so far (the engine appends them chunk
        #: by chunk; ``len - 1`` prompt positions are done, and never computed again); else None.
        self.prompt_logprobs: list[dict[int, Any] | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None])
        #: 1 while the last of ``token_ids`` is a ``PLACEHOLDER`` for a token a step in flight samples
        #: (async scheduling: ``Scheduler.commit``), else 0.
        self.num_placeholders = 0

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked for and some are still to be computed."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether it may start from prefix-cache hits, and its lookups count in the hit rate: not when it asks
        for prompt logprobs, which a hit would skip (vLLM's ``skip_reading_prefix_cache``, for its whole life)."""
        return self.sampling_params.prompt_logprobs is None

    @property
    def is_prefill(self) -> bool:
        """True while more than the last known token is still to be computed (prompt or recompute)."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    # -- progress --------------------------------------------------------------------------------
    def append_output_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def append_placeholder(self) -> None:
        """Stand a ``PLACEHOLDER`` for the token the step in flight samples (async scheduling). RuntimeError if
        one stands already: the step before's token was never resolved."""
        if self.num_placeholders:
            raise RuntimeError(f"{self.request_id} already has a token in flight; the step before's token was "
                               f"never resolved")
        self.token_ids.append(PLACEHOLDER)
        self.num_placeholders = 1

    def resolve_placeholder(self, token_id: int, now: float) -> None:
        """The placeholder's token became known: it replaces it, as ``append_output_token`` at ``now``."""
        self.drop_placeholder()
        self.append_output_token(token_id, now)

    def drop_placeholder(self) -> None:
        """Forget the token in flight (an aborted request's, or a failed step's)."""
        if self.num_placeholders:
            self.token_ids.pop()
            self.num_placeholders = 0

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last appended token implies, or None to keep generating. A
        stop string the token's text completes ends the sequence even on its last allowed token
        (as vLLM); an EOS or stop token's text is decoded only with ``include_stop_str_in_output``."""
        last = self.token_ids[-1]
        params = self.sampling_params
        eos = not params.ignore_eos and last in self.eos_token_ids
        if eos or last in params.stop_token_ids:
            self.stop_reason = None if eos else last
            if self.detokenizer is not None and params.include_stop_str_in_output:
                stop = self.detokenizer.append(last, final=True)
                if stop is not None:  # vLLM's stop strings are searched in the text the token adds too
                    self.stop_reason = stop
            return RequestStatus.FINISHED_STOPPED
        capped = (self.num_output_tokens >= self.max_tokens
                  or self.max_model_len is not None and self.num_tokens >= self.max_model_len)
        if self.detokenizer is not None:
            # On the last token, text held back for an incomplete character is searched too.
            stop = self.detokenizer.append(last, final=capped)
            if stop is not None:
                self.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH_CAPPED if capped else None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")


def _context_left(max_model_len: int | None, num_prompt_tokens: int) -> int:
    """The output tokens ``max_model_len`` leaves after a prompt: 0 for a prompt that fills it (which
    still samples one token, as in vLLM) or is longer (which the scheduler ignores). ValueError without a
    ``max_model_len``, which ``max_tokens=None`` needs (the engine always gives one)."""
    if max_model_len is None:
        raise ValueError("SamplingParams.max_tokens=None generates up to max_model_len, and this request has none")
    return max(max_model_len - num_prompt_tokens, 0)
