"""Prompts in: text, token ids or a vLLM-style dict, checked and tokenized before anything is queued."""
from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from framework.common.config import is_finite_number
from framework.common.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
#: The keys of a vLLM-style prompt dict that this engine reads.
PROMPT_KEYS = frozenset(("prompt_token_ids", "prompt", "cache_salt"))


def tokenize(prompt: Prompt, tokenizer: Any | None, vocab_size: int, model: str) -> tuple[list[int], str | None]:
    """Token ids and text of ``prompt`` (text needs ``tokenizer``); ValueError, naming the problem,
    for a prompt of no such form, ids outside ``[0, vocab_size)`` or none at all."""
    text: str | None = None
    if isinstance(prompt, dict):
        # vLLM's other keys (multi_modal_data, ...) ask for what this engine does not do: taken silently, the
        # prompt would run without them.
        unknown = sorted(map(str, set(prompt) - PROMPT_KEYS))
        if unknown:
            raise ValueError(f"a prompt dict's key(s) {', '.join(unknown)} are not supported: it takes "
                             f"{', '.join(repr(k) for k in sorted(PROMPT_KEYS))}")
        if "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif "prompt" in prompt:
            text = prompt["prompt"]
            ids = None
        else:
            raise ValueError(f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
    elif isinstance(prompt, str):
        text, ids = prompt, None
    else:
        ids = prompt
    # None (bare, or as a dict's value) is no text to tokenize, and bytes are no token ids
    # (they would pass as their byte values).
    if (ids is None and not isinstance(text, str)) or isinstance(ids, (bytes, bytearray)):
        raise ValueError(f"a prompt is text (str), token ids (a list of ints) or a dict with 'prompt_token_ids' "
                         f"or 'prompt'; got {type(prompt).__name__}: {prompt!r}")
    if ids is None:
        if tokenizer is None:
            raise ValueError(f"model {model!r} has no tokenizer; pass prompt_token_ids instead of text")
        ids = tokenizer.encode(text)
    return token_ids(ids, vocab_size), text


def cache_salt(prompt: Prompt) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's): its prefix-cache hits come only from prompts of the same salt. None
    for none; ValueError unless a non-empty string."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def check_request_args(params: Any, arrival_time: Any = None, priority: Any = 0) -> None:
    """ValueError naming the argument unless ``params`` is a ``SamplingParams``, ``arrival_time``
    None or a finite number and ``priority`` a finite number. The scheduler compares priorities
    and times mid-step, where a string or NaN would fail every later step too."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}: {params!r}")
    if arrival_time is not None and not is_finite_number(arrival_time):
        raise ValueError(f"arrival_time must be a finite number or None, got {arrival_time!r}")
    if not is_finite_number(priority):
        raise ValueError(f"priority must be a finite number, got {priority!r}")


def token_ids(ids: Iterable[Any], vocab_size: int) -> list[int]:
    """``ids`` (a list, a 1-D integer numpy array or any iterable of ints) as a non-empty list of
    ints in ``[0, vocab_size)``; ValueError otherwise (floats, bools and non-integer arrays included)."""
    # Simulated workloads send millions of ids: arrays are checked in numpy, and a list of plain
    # ints (its set of element types is built in C) is kept as is, with no Python step per token.
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"prompt token ids must be a 1-D integer array, got shape {ids.shape} of {ids.dtype}")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            _out_of_vocabulary(ids.tolist(), vocab_size)
        ids = ids.tolist()
    else:
        if type(ids) is not list or not set(map(type, ids)) <= {int}:
            try:
                ids = list(ids)
                # operator.index takes numpy ints and refuses floats, but takes bools as 0 and 1.
                if any(type(t) is bool for t in ids):
                    raise TypeError("a bool is not a token id")
                ids = list(map(operator.index, ids))
            except TypeError as exc:
                raise ValueError(f"prompt token ids must be integers: {exc}") from None
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            _out_of_vocabulary(ids, vocab_size)
    if not ids:
        raise ValueError("prompt is empty: a request needs at least one prompt token")
    return ids


def _out_of_vocabulary(ids: list[int], vocab_size: int) -> None:
    bad = next(t for t in ids if not 0 <= t < vocab_size)
    raise ValueError(f"prompt token id {bad} is out of the vocabulary [0, {vocab_size})")
