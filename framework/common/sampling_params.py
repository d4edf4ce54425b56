"""Per-request sampling parameters, named and defaulted as in vLLM's offline API."""
from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from framework.common.config import is_finite_number, is_int, names_valid_keywords


#: float32's smallest normal and largest finite magnitudes: a number between them keeps its value's sign.
_FLOAT32_NORMAL, _FLOAT32_MAX = 2.0 ** -126, 3.4028234663852886e38


def _check_float32(name: str, value: float, valid: str, span: str, positive: bool = False) -> None:
    """ValueError naming ``name``, ``valid`` and its float32 ``span`` unless ``value`` stays finite (and > 0 when
    ``positive``) as the float32 the sampler computes with: a repetition penalty of 1e-300 rounds to 0 there."""
    if value == 0 or _FLOAT32_NORMAL <= abs(value) <= _FLOAT32_MAX:  # no cast for the usual values (every request)
        return
    x = array("f", [float(value)])[0]
    if not math.isfinite(x) or positive and x <= 0:
        raise ValueError(f"SamplingParams.{name} must be {valid} ({span} in float32, the sampler's type), "
                         f"got {value!r}")


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step`` returns for a request, as vLLM's enum of the name: ``CUMULATIVE``
    every token and the text so far on each step; ``DELTA`` only what is new since the request's
    last output (token ids, text, token times); ``FINAL_ONLY`` one output, when it finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@names_valid_keywords
@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 and ``top_p`` of 1.0 disable those
    filters, as does ``min_p`` of 0 (else tokens less likely than ``min_p`` times the most likely
    one, after temperature, are dropped). ``seed`` makes one request's samples reproducible
    whatever else is in the batch (-1, as None: unseeded, as vLLM reads it). ``max_tokens`` counts
    generated tokens (None: as many as the engine's ``max_model_len`` leaves after the prompt, as
    vLLM); generation also stops at ``max_model_len``. ``stop_token_ids`` of None is an empty list.
    ``stop`` (one string or a list) ends a sequence when its output text contains one of them, as
    vLLM's: ``finish_reason`` "stop", ``stop_reason`` the string, the text cut before it (after
    it with ``include_stop_str_in_output``); it needs ``detokenize`` and a tokenizer.
    ``repetition_penalty`` (1 = off) divides the positive logits and multiplies the negative ones
    of every token in the prompt or the output so far; ``presence_penalty`` and
    ``frequency_penalty`` (0 = off) subtract from the logit of each token the output holds, once
    and once per occurrence (OpenAI's definition; the prompt does not count). Penalties apply to
    greedy requests too, as in vLLM.
    ``logprobs = k`` returns, for every generated token, the logprobs of the sampled token and the
    ``k`` most likely ones (``CompletionOutput.logprobs``; at most the engine's ``max_logprobs``).
    ``output_kind`` (a ``RequestOutputKind`` or its name: ``'cumulative'``, ``'delta'``,
    ``'final_only'``) says what ``LLMEngine.step`` returns for the request; ``LLM.generate`` and
    ``framework.sim.fast_forward.advance`` return complete final outputs whatever it is.
    ``prompt_logprobs = k`` returns, for every prompt token after the first, the logprobs of that
    token and the ``k`` most likely ones at its position (``RequestOutput.prompt_logprobs``; same
    cap); such a request computes its whole prompt, without prefix-cache hits, as in vLLM v1.
    """

    # New fields go last, so that positional construction keeps its meaning.
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = field(default_factory=list)
    detokenize: bool = True
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"SamplingParams.max_tokens must be None (up to max_model_len) or an integer >= 1, "
                             f"got {self.max_tokens!r}")
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        _check_float32("temperature", self.temperature, "a finite number >= 0", "at most 3.4e38")
        # Any k at or past the vocabulary keeps every token; past 64 bits it would fail mid-step, in the batch's rows.
        if not is_int(self.top_k) or not -1 <= self.top_k < 2**63:
            raise ValueError(f"SamplingParams.top_k must be -1, 0 (disabled) or a positive integer below 2**63, got "
                             f"{self.top_k!r}")
        if not is_finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        _check_float32("top_p", self.top_p, "in (0, 1]", "at least about 1.4e-45", positive=True)
        if not is_finite_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_finite_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {value!r}")
        if not is_finite_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0, got "
                             f"{self.repetition_penalty!r}")
        _check_float32("repetition_penalty", self.repetition_penalty, "a finite number > 0", "about 1.4e-45 to 3.4e38",
                       positive=True)
        # The seed feeds a 64-bit torch generator: a larger one would fail mid-step, not here. Signed, as vLLM's.
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed must be None or a signed 64-bit integer, in [-2**63, 2**63), "
                             f"got {self.seed!r}")
        if self.seed is not None:  # a numpy integer fails torch's manual_seed and overflows seed + i
            self.seed = None if self.seed == -1 else int(self.seed)
        if self.stop_token_ids is None:  # as vLLM: None is no stop tokens
            self.stop_token_ids = []
        listed = isinstance(self.stop_token_ids, Iterable) and not isinstance(self.stop_token_ids, (str, bytes))
        ids = list(self.stop_token_ids) if listed else []
        if not listed or not all(is_int(t) for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be None or a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in ids]
        # As vLLM: one string is one stop string, None none; kept as a list.
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        listed = isinstance(stop, Iterable) and not isinstance(stop, bytes)
        stop = list(stop) if listed else []
        if not listed or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop must be None, a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stop
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"SamplingParams.{name} must be None (off) or an integer >= 0, got {value!r}")
            if value is not None:  # a numpy integer would reach torch.topk and the engine's checks
                setattr(self, name, int(value))
        for name in ("ignore_eos", "detokenize", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be True or False, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop matches the output text: it needs detokenize=True")
        kind = self.output_kind
        if isinstance(kind, str) and kind.upper() in RequestOutputKind.__members__:
            self.output_kind = RequestOutputKind[kind.upper()]
        elif not isinstance(kind, RequestOutputKind):
            raise ValueError(f"SamplingParams.output_kind must be one of cumulative, delta, final_only, got {kind!r}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on (the sampler then counts the tokens seen)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
