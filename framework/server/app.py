"""``build_app``: the FastAPI application, vLLM's OpenAI-server routes over one ``Serving``."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from framework.server.chat import ChatJob
from framework.server.completions import CompletionJob
from framework.server.engine_loop import EngineDeadError
from framework.server.errors import APIError, error_body
from framework.server.prometheus import CONTENT_TYPE, ServerMetrics
from framework.server.protocol import ChatCompletionRequest, CompletionRequest
from framework.server.serving import Serving

log = logging.getLogger(__name__)

#: Paths the API key guards, as vLLM's: /health, /metrics and the rest stay open.
GUARDED_PREFIXES = ("/v1",)


def build_app(serving: Serving, metrics: ServerMetrics, api_key: str | None = None, version: str = "0.1.0") -> FastAPI:
    """The routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``,
    ``/version``. Bad requests get OpenAI's error body (400, 401, 404), never a traceback."""
    app = FastAPI(title="servelab", version=version)
    engine_loop = serving.loop

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(_validation_message(exc), 400, param=_validation_param(exc)), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 503), status_code=503)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine_loop.alive else 503)

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": serving.model_name, "object": "model", "created": int(time.time()), "owned_by": "servelab",
            "root": serving.engine.config.model, "parent": None, "max_model_len": serving.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        job = CompletionJob(serving, body, request.state.arrival_time)
        return await _answer(job, body.stream, request, engine_loop.abort)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        job = ChatJob(serving, body, request.state.arrival_time)
        return await _answer(job, body.stream, request, engine_loop.abort)

    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    app.add_middleware(ArrivalStamp, clock=engine_loop.engine.clock)  # the outermost: first to see a request
    return app


async def _answer(job: CompletionJob | ChatJob, stream: bool | None, request: Request,
                  abort: Callable[[str], None]) -> Response:
    """Stream ``job``'s events, or wait for its whole response; either way a client that leaves aborts its requests."""
    if stream:
        return AbortingStream(job.events(), on_close=lambda: [abort(rid) for rid in job.ids],
                              media_type="text/event-stream")
    answer = asyncio.ensure_future(job.response())
    left = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answer, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not answer.done():
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
        for rid in job.ids:
            abort(rid)
    if answer.cancelled():
        return Response(status_code=499)  # nobody is left to read it (nginx's "client closed request")
    return JSONResponse(answer.result())


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read already, so ``receive`` waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class AbortingStream(StreamingResponse):
    """A streamed response that calls ``on_close`` however it ends: finished, failed or cut by the client."""

    def __init__(self, content: Any, on_close: Callable[[], Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ArrivalStamp:
    """Stamps each request with its arrival on the engine's clock (``request.state.arrival_time``) before its body is
    read and checked, so that the latencies the server records start when a client's do, less the network."""

    def __init__(self, app: ASGIApp, clock: Any) -> None:
        self.app = app
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_time"] = self.clock.now()
        await self.app(scope, receive, send)


class APIKeyCheck:
    """Refuses a request to ``/v1/*`` without ``Authorization: Bearer KEY``: 401 and ``{"error": "Unauthorized"}``,
    as vLLM's ``--api-key``. Keys are compared by their hashes in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope["path"].startswith(GUARDED_PREFIXES):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            given = hashlib.sha256(token.encode()).digest()
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.digest):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> str:
    """Pydantic's errors as one line: ``field: problem; ...`` (a body that is no JSON: where it breaks, and why)."""
    parts = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":  # its location is ("body", character offset), no field
            why = error.get("ctx", {}).get("error", "")
            return f"the body is not valid JSON: {why + ' ' if why else ''}at character {error['loc'][-1]}"
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def _validation_param(exc: RequestValidationError) -> str | None:
    errors = exc.errors()
    if not errors or errors[0].get("type") == "json_invalid":
        return None
    loc = [p for p in errors[0].get("loc", ()) if p != "body"]
    return str(loc[0]) if loc else None
