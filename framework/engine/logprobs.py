"""Logprobs the executor returned, appended to their requests with their tokens' text decoded."""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from framework.common.outputs import Logprob
from framework.common.request import Request

#: The most tokens before a logprob's token read to complete its character (a UTF-8 character has at most 4 bytes).
CONTEXT_TOKENS = 4


def append_logprobs(reqs: Iterable[Request], logprobs: Mapping[str, dict[int, Logprob]], tokenizer: Any | None,
                    executor: str) -> None:
    """Give each of ``reqs`` that asks for logprobs those of the token it just appended, its
    tokens' text decoded as vLLM does (``token_text``, after the sequence's earlier output tokens). Appended as
    the token is, once: a request recomputed after preemption samples only past its known tokens, so nothing
    repeats."""
    for req in reqs:
        if req.logprobs is None:
            continue
        entry = logprobs.get(req.request_id)
        if entry is None:
            raise RuntimeError(f"executor {executor!r} returned no logprobs for {req.request_id}, "
                               f"which asks for them")
        if tokenizer is not None and req.sampling_params.detokenize:
            # As vLLM: the context is the output's own tokens, not the prompt's.
            decode_entry(tokenizer, entry, req.output_token_ids[-1 - CONTEXT_TOKENS:-1])
        req.logprobs.append(entry)
        req.cumulative_logprob += entry[req.token_ids[-1]].logprob


def append_prompt_logprobs(requests: Mapping[str, Request], prompt_logprobs: Mapping[str, list[dict[int, Logprob]]],
                           tokenizer: Any | None, executor: str) -> None:
    """Extend each request's prompt logprobs with the entries its prompt chunk computed this
    step (the executor computes only the positions the request lacks)."""
    for rid, entries in prompt_logprobs.items():
        req = requests.get(rid)
        if req is None or req.prompt_logprobs is None:
            raise RuntimeError(f"executor {executor!r} returned prompt logprobs for {rid}, "
                               f"which does not ask for them")
        if len(req.prompt_logprobs) + len(entries) > req.num_prompt_tokens:
            raise RuntimeError(f"executor {executor!r} returned more prompt logprobs for {rid} "
                               f"than its prompt has tokens")
        if tokenizer is not None and req.sampling_params.detokenize:
            prompt = req.prompt_token_ids
            for position, entry in enumerate(entries, len(req.prompt_logprobs)):
                decode_entry(tokenizer, entry, prompt[max(position - CONTEXT_TOKENS, 0):position])
        req.prompt_logprobs.extend(entries)


def decode_entry(tokenizer: Any, entry: dict[int, Logprob], context: Sequence[int]) -> None:
    """Set the text of each of ``entry``'s tokens, as they would follow ``context`` (``token_text``)."""
    for token_id, logprob in entry.items():
        logprob.decoded_token = token_text(tokenizer, token_id, context)


def token_text(tokenizer: Any, token_id: int, context: Sequence[int]) -> str:
    """``token_id``'s text as vLLM gives it in a logprob: the token decoded alone, with the leading spaces of a
    SentencePiece piece that decoding strips; where that ends in an incomplete character (U+FFFD), what the token
    adds after ``context`` (the sequence's tokens before it, at most ``CONTEXT_TOKENS``) once the character is whole,
    the text of context tokens that were its first bytes included, or "" while it is not."""
    text = tokenizer.decode([token_id])
    marker = space_marker(tokenizer)
    if marker is not None:
        piece = tokenizer.convert_ids_to_tokens(token_id) or ""
        markers = len(piece) - len(piece.lstrip(marker))
        text = " " * max(markers - (len(text) - len(text.lstrip(" "))), 0) + text
    if not text.endswith("\ufffd"):
        return text
    for n in range(1, min(len(context), CONTEXT_TOKENS) + 1):
        before = list(context[-n:])
        whole = tokenizer.decode([*before, token_id])
        if whole.endswith("\ufffd"):
            continue
        # Context tokens that were incomplete alone are bytes of the character this token completes: their text is
        # this token's, as each of them showed "".
        clean = n
        while clean and tokenizer.decode([before[clean - 1]]).endswith("\ufffd"):
            clean -= 1
        prefix = tokenizer.decode(before[:clean]) if clean else ""
        return whole[len(os.path.commonprefix([prefix, whole])):]
    return ""


@functools.lru_cache(maxsize=16)
def space_marker(tokenizer: Any) -> str | None:
    """The character a SentencePiece (Metaspace) tokenizer writes for a space, which decoding a piece alone strips
    from its start; None for other tokenizers (byte-level BPE keeps its spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except ValueError:
        return None
    for step in [pre, *pre.get("pretokenizers", ())]:
        if step.get("type") == "Metaspace":
            return step.get("replacement", "\u2581")
    return None
