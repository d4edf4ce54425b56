"""``EngineLoop``: the engine steps in a thread of its own; requests go in and outputs come out on the asyncio loop."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from framework.common.outputs import RequestOutput
from framework.common.sampling_params import SamplingParams
from framework.engine.llm_engine import LLMEngine
from framework.server.errors import APIError

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed mid-step: every request in flight ends with this, and the server reports unhealthy."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    cache_salt: str | None


class EngineLoop:
    """Owns ``engine`` once started: only its thread calls the engine (``LLMEngine`` is single-threaded), taking
    adds and aborts between steps. ``stream``, ``abort`` and ``stop`` are called from the asyncio loop given to
    ``start``; ``on_output`` gets every output on the engine thread, before the request's stream does."""

    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine = engine
        self.on_output = on_output
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._commands: list[_Add | str | None] = []  # an add, an id to abort, or None: abort everything
        self._stopping = False
        self._queues: dict[str, asyncio.Queue] = {}  # unfinished requests' output queues (asyncio loop only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- the asyncio side --------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    async def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     arrival_time: float, priority: int = 0,
                     cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue one request and yield its outputs (``params.output_kind`` says which) up to its final one.
        Left early (the caller cancelled, or closed this), the request is aborted and its blocks freed."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._send(_Add(request_id, prompt_token_ids, params, arrival_time, priority, cache_salt))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, ValueError):  # the engine refused the request: the client's error
                    raise APIError.from_value_error(item)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` if it is still unfinished (a finished or unknown one is left alone)."""
        if self._queues.pop(request_id, None) is not None:
            self._send(request_id)

    def abort_all(self) -> None:
        """Abort every request in flight; each stream still gets its final output (``finish_reason`` abort) and ends."""
        self._send(None)

    def num_in_flight(self) -> int:
        return len(self._queues)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request in flight, let the engine finish them (their blocks freed), end the thread."""
        with self._cv:
            self._commands.append(None)
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0f s", timeout)

    def _send(self, command: _Add | str | None) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def _deliver(self, outputs: list[RequestOutput], errors: list[tuple[str, BaseException]]) -> None:
        """On the asyncio loop: hand each output (or error) to its request's queue."""
        for request_id, exc in errors:
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(exc)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue  # its client left: aborted, nobody reads it
            queue.put_nowait(out)
            if out.finished:
                del self._queues[out.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        """On the asyncio loop: every request in flight ends with ``exc``."""
        for queue in self._queues.values():
            queue.put_nowait(exc)
        self._queues.clear()

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                    self._cv.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            errors = self._apply(commands)
            outputs: list[RequestOutput] = []
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # a bug below: fail what is in flight, free its blocks, stop
                    log.exception("engine step failed; the server stops serving")
                    self.error = exc
                    self._call(self._fail_all, EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))
                    self._drain()
                    return
                if self.on_output is not None:
                    for out in outputs:
                        self.on_output(out)
            if outputs or errors:
                self._call(self._deliver, outputs, errors)
            if stopping and not engine.has_unfinished_requests():
                with self._cv:
                    if not self._commands:
                        return

    def _apply(self, commands: list[_Add | str | None]) -> list[tuple[str, BaseException]]:
        """Queue the adds and make the aborts, in the order they came; the adds the engine refused, with why."""
        engine, errors = self.engine, []
        for command in commands:
            if isinstance(command, _Add):
                try:
                    prompt = {"prompt_token_ids": command.prompt_token_ids, "cache_salt": command.cache_salt}
                    engine.add_request(command.request_id, prompt, command.params, arrival_time=command.arrival_time,
                                       priority=command.priority)
                except ValueError as exc:
                    errors.append((command.request_id, exc))
                except Exception as exc:  # a bug the request found: it fails alone, the engine serves the others
                    log.exception("adding request %s failed", command.request_id)
                    errors.append((command.request_id, exc))
            elif command is None:
                engine.abort_request(list(engine.output_processor.requests))
            else:
                engine.abort_request(command)
        return errors

    def _drain(self) -> None:
        """After a failed step: abort everything and step the aborts out, so the blocks come back if they can."""
        try:
            self.engine.abort_request(list(self.engine.output_processor.requests))
            for _ in range(3):
                if not self.engine.has_unfinished_requests():
                    break
                self.engine.step()
        except Exception:
            log.exception("could not abort the requests in flight after the failure")

    def _call(self, fn: Callable, *args: object) -> None:
        """Run ``fn(*args)`` on the asyncio loop (dropped once that loop is closed: nobody is left to read)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass
