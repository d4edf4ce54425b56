"""Logprobs the executor returned, appended to their requests with their tokens' text decoded."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from framework.common.outputs import Logprob
from framework.common.request import Request


def append_logprobs(reqs: Iterable[Request], logprobs: Mapping[str, dict[int, Logprob]], tokenizer: Any | None,
                    executor: str) -> None:
    """Give each of ``reqs`` that asks for logprobs those of the token it just appended, its
    tokens' text decoded as vLLM does (each alone). Appended as the token is, once: a request
    recomputed after preemption samples only past its known tokens, so nothing repeats."""
    for req in reqs:
        if req.logprobs is None:
            continue
        entry = logprobs.get(req.request_id)
        if entry is None:
            raise RuntimeError(f"executor {executor!r} returned no logprobs for {req.request_id}, "
                               f"which asks for them")
        decode_logprob_tokens(req, [entry], tokenizer)
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
        decode_logprob_tokens(req, entries, tokenizer)
        req.prompt_logprobs.extend(entries)


def decode_logprob_tokens(req: Request, entries: list[dict[int, Logprob]], tokenizer: Any | None) -> None:
    """Each entry's tokens' text, decoded as vLLM does (each token alone), when ``req``
    is detokenized."""
    if tokenizer is not None and req.sampling_params.detokenize:
        for entry in entries:
            for token_id, logprob in entry.items():
                logprob.decoded_token = tokenizer.decode([token_id])
