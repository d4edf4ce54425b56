"""Online arrivals: feed a workload to an engine as its requests' arrival times come.

A request enters the engine at the first step boundary after its arrival time and carries that
arrival time, so the time it waits (for the running step, then in the queue) counts in its
TTFT, as for a real server. When the engine is idle the driver waits for the next arrival on
the engine's clock: a wall clock sleeps, a virtual clock jumps.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from framework.engine import LLMEngine
from framework.outputs import RequestOutput
from framework.workload import WorkloadRequest, sampling_params

logger = logging.getLogger(__name__)


@dataclass
class DriveResult:
    """``start_time`` / ``end_time`` are on the engine's clock; request times are relative to
    ``start_time`` in the workload, absolute in the outputs."""

    start_time: float
    end_time: float
    num_sent: int
    num_finished: int
    interrupted: bool = False
    unfinished: list[str] = field(default_factory=list)


def drive(engine: LLMEngine, requests: list[WorkloadRequest], sampling: dict[str, Any] | None = None,
          on_output: Callable[[RequestOutput], None] | None = None, start: float | None = None) -> DriveResult:
    """Run ``requests`` (sorted by arrival time) through ``engine`` until all finish or a
    KeyboardInterrupt arrives. ``on_output`` receives every finished ``RequestOutput`` as it
    finishes. On interrupt the unsent requests are dropped, the unfinished ones aborted (their
    KV blocks freed), and the result says ``interrupted``; the exception is not re-raised.
    ``start`` is the clock time arrival times count from (default: now)."""
    clock = engine.clock
    start = clock.now() if start is None else start
    pending = deque(requests)
    params = {r.request_id: sampling_params(r, sampling or {}) for r in requests}
    sent: set[str] = set()
    finished: set[str] = set()
    interrupted = False
    try:
        while pending or engine.has_unfinished_requests():
            now = clock.now()
            while pending and start + pending[0].arrival_time <= now:
                r = pending.popleft()
                prompt: dict[str, Any] = {"prompt_token_ids": r.prompt_token_ids}
                if r.prompt is not None:
                    prompt["prompt"] = r.prompt
                engine.add_request(r.request_id, prompt, params[r.request_id],
                                   arrival_time=start + r.arrival_time, priority=r.priority)
                sent.add(r.request_id)
            if not engine.has_unfinished_requests():
                clock.wait_until(start + pending[0].arrival_time)
                continue
            for out in engine.step():
                if out.finished:
                    finished.add(out.request_id)
                    if on_output is not None:
                        on_output(out)
    except KeyboardInterrupt:
        interrupted = True
        logger.warning("interrupted: %d of %d requests finished", len(finished), len(requests))
    end = clock.now()
    unfinished = sorted(sent - finished, key=lambda rid: (len(rid), rid))
    if interrupted and unfinished:
        _abort(engine, unfinished)
    return DriveResult(start, end, len(sent), len(finished), interrupted, unfinished)


def _abort(engine: LLMEngine, request_ids: list[str]) -> None:
    """Abort what is still in flight and let one empty step hand back the aborted requests, so
    the engine ends with every KV block free. Best effort: the measurements are already safe."""
    callbacks, engine.step_callbacks = engine.step_callbacks, []  # this step is no measurement
    try:
        engine.abort_request(request_ids)
        engine.step()
    except Exception as exc:  # an interrupt may have left the step half done
        logger.warning("could not abort the unfinished requests cleanly: %s", exc)
    finally:
        engine.step_callbacks = callbacks
