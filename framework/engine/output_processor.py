"""Requests' outputs: ``RequestOutput``s built from their sequences as each request's output kind says."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from framework.common.detokenizer import DETOKENIZE_CONTEXT
from framework.common.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import RequestOutputKind


class OutputProcessor:
    """Holds each unfinished request's sequences (``requests``: request id -> sequences) until its
    final output is made, and how far each DELTA sequence was streamed. Single-threaded."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, list[Request]] = {}
        #: How far each sequence of a DELTA request has been streamed, by sequence id.
        self._streams: dict[str, _Stream] = {}

    def final_outputs(self, reqs: Iterable[Request]) -> list[RequestOutput]:
        """The complete final outputs of the requests among ``reqs``' sequences that finished."""
        return [o for o in self.make_outputs(list(reqs), True) if o.finished]

    def make_outputs(self, reqs: list[Request], final: bool = False) -> list[RequestOutput]:
        """One output per request among ``reqs``' sequences, as its ``output_kind`` says (none
        for an unfinished FINAL_ONLY one); with ``final``, cumulative whatever the kind."""
        seen: dict[str, RequestOutput | None] = {}
        for req in reqs:
            parent_id = req.parent_id or req.request_id
            if parent_id in seen:
                continue
            children = self.requests.get(parent_id)
            if children is None:
                continue
            kind = children[0].sampling_params.output_kind
            if kind is RequestOutputKind.CUMULATIVE or final:
                output = self._output(parent_id, children)
            elif kind is RequestOutputKind.DELTA:
                output = self._delta_output(parent_id, children)
            else:  # FINAL_ONLY
                output = self._output(parent_id, children) if all(r.is_finished for r in children) else None
            seen[parent_id] = output
            if output is not None and output.finished:
                del self.requests[parent_id]
                if kind is RequestOutputKind.DELTA:
                    for child in children:
                        self._streams.pop(child.request_id, None)
        return [o for o in seen.values() if o is not None]

    def _output(self, request_id: str, children: list[Request]) -> RequestOutput:
        first = children[0]
        completions = []
        for req in children:
            ids = req.output_token_ids
            text = ""
            if req.detokenizer is not None:
                # The text decoded as it grew: cut at a stop string, held back while one may start.
                text = req.detokenizer.output_text(req.is_finished)
            elif self.tokenizer is not None and req.sampling_params.detokenize and ids:
                # The stop token's text is left out (a non-special EOS or stop id would show), unless asked for.
                dropped = (req.status == RequestStatus.FINISHED_STOPPED
                           and not req.sampling_params.include_stop_str_in_output)
                shown = ids[:-1] if dropped else ids
                text = decode_continuation(self.tokenizer, first.prompt_token_ids, shown)
                if not req.is_finished:
                    # A character whose bytes are still coming shows as U+FFFD, which its next token would
                    # replace: held back, as a DELTA stream holds it, so a streamed text only grows.
                    text = text.rstrip("\ufffd")
            logprobs = req.logprobs
            if logprobs is not None and not req.is_finished:
                logprobs = list(logprobs)  # a running request's list still grows
            completions.append(CompletionOutput(req.index, text, ids, req.status.finish_reason, req.stop_reason,
                                                req.cumulative_logprob, logprobs))
        # n > 1: one time per step that gave any sequence a token, as a streaming client receives
        # them, so TPOT and the ITLs are a sequence's pace, not the pace of all tokens together.
        token_times = first.token_times if len(children) == 1 else sorted({t for r in children for t in r.token_times})
        if not all(r.is_finished for r in children):
            token_times = list(token_times)  # a finished request's never change: its output may share them
        return self._request_output(request_id, children, completions, token_times, _prompt_logprobs(first))

    def _delta_output(self, request_id: str, children: list[Request]) -> RequestOutput:
        """A DELTA request's output: per sequence with new tokens or a new finish since the last
        output, a completion of only the new ids, text and logprobs (the texts add up to the whole);
        ``metrics.token_times`` holds the new tokens' times, the other metrics are cumulative."""
        first = children[0]
        num_prompt = first.num_prompt_tokens
        completions = []
        new_times: list[float] = []
        for req in children:
            stream = self._streams.get(req.request_id)
            if stream is None:
                stream = self._streams[req.request_id] = _Stream(num_prompt)
            # Tokens are only appended (a recompute preemption keeps them): nothing streamed is sent again.
            ids = req.token_ids[stream.num_tokens:]
            newly_finished = req.is_finished and not stream.finished
            if not ids and not newly_finished:
                continue
            sent = stream.num_tokens - num_prompt  # output tokens already streamed
            new_times.extend(req.token_times[sent:])
            text = ""
            if req.detokenizer is not None:
                text = req.detokenizer.output_text(req.is_finished, stream.num_chars)
                stream.num_chars += len(text)
            stream.num_tokens = req.num_tokens
            stream.finished = req.is_finished
            logprobs = req.logprobs[sent:] if req.logprobs is not None else None
            completions.append(CompletionOutput(req.index, text, ids, req.status.finish_reason, req.stop_reason,
                                                req.cumulative_logprob, logprobs))
        token_times = new_times if len(children) == 1 else sorted(set(new_times))
        # Prompt logprobs go out once, with the first output that has them (as vLLM's DELTA).
        head = self._streams[first.request_id]
        prompt_logprobs = None if head.sent_prompt_logprobs else _prompt_logprobs(first)
        head.sent_prompt_logprobs |= prompt_logprobs is not None
        return self._request_output(request_id, children, completions, token_times, prompt_logprobs)

    @staticmethod
    def _request_output(request_id: str, children: list[Request], completions: list[CompletionOutput],
                        token_times: list[float], prompt_logprobs: list[dict[int, Logprob] | None] | None
                        ) -> RequestOutput:
        """The ``RequestOutput`` of ``children``' completions: the request's metrics so far,
        with ``token_times`` as the output kind gives them."""
        first = children[0]
        finished = all(r.is_finished for r in children)
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=_min(r.first_scheduled_time for r in children),
            first_token_time=_min(r.first_token_time for r in children),
            last_token_time=_max(r.token_times[-1] if r.token_times else None for r in children),
            finished_time=_max(r.finished_time for r in children) if finished else None,
            token_times=token_times,
            num_prompt_tokens=first.num_prompt_tokens,
            num_generated_tokens=sum(r.num_output_tokens for r in children),
            num_cached_tokens=first.num_cached_tokens,
            num_preemptions=sum(r.num_preemptions for r in children),
            num_swaps=sum(r.num_swaps for r in children))
        return RequestOutput(
            request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=finished, metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
            status_message=next((r.status_message for r in children if r.status_message), None),
            priority=first.priority, prompt_logprobs=prompt_logprobs)


def _prompt_logprobs(req: Request) -> list[dict[int, Logprob] | None] | None:
    """``req``'s prompt logprobs for an output: None until the prompt's are all computed (a
    request prefilled over several steps streams them with its first token), and never the
    list still growing."""
    if req.prompt_logprobs is None or len(req.prompt_logprobs) < req.num_prompt_tokens:
        return None
    return req.prompt_logprobs


@dataclass
class _Stream:
    """A DELTA sequence's progress: ``num_tokens`` of its ``token_ids`` (prompt included) sent,
    ``num_chars`` of its text; for the first sequence, whether the request's prompt logprobs
    went out."""

    num_tokens: int
    num_chars: int = 0
    finished: bool = False
    sent_prompt_logprobs: bool = False


def decode_continuation(tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The text ``output_ids`` add after ``prompt_ids``, keeping a SentencePiece word's leading space
    as vLLM does: ``decode(tail + output)`` minus ``decode(tail)`` for the prompt's last few tokens,
    or the output decoded alone when the tail's text is no prefix of the whole (a split character)."""
    tail = list(prompt_ids[-DETOKENIZE_CONTEXT:])
    if not tail:
        return tokenizer.decode(output_ids, skip_special_tokens=True)
    prefix = tokenizer.decode(tail, skip_special_tokens=True)
    whole = tokenizer.decode(tail + list(output_ids), skip_special_tokens=True)
    if whole.startswith(prefix):
        return whole[len(prefix):]
    return tokenizer.decode(output_ids, skip_special_tokens=True)


def _min(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
