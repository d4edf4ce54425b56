"""``EngineLoop`` over a real engine, in process: outputs reach their streams, a stream left early aborts its request,
a failed step ends every request with ``EngineDeadError`` and frees their blocks, ``stop`` ends the thread."""
from __future__ import annotations

import asyncio

import pytest

from framework.common.sampling_params import RequestOutputKind, SamplingParams
from framework.engine.llm_engine import LLMEngine
from framework.server.engine_loop import EngineDeadError, EngineLoop
from framework.server.errors import APIError
from framework.testing.leaks import assert_no_kv_leaks


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)


def serve(engine: LLMEngine, body) -> object:
    """Run ``body(loop)`` on a fresh asyncio loop with an ``EngineLoop`` over ``engine``, stopped afterwards."""
    async def main():
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        try:
            return await asyncio.wait_for(body(loop), 60)  # a stream nobody ends fails, not hangs
        finally:
            await asyncio.to_thread(loop.stop, 30)
            assert not loop.alive
    return asyncio.run(main())


def assert_all_done_and_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert_no_kv_leaks(engine)


def test_a_stream_yields_its_outputs_up_to_the_final_one(engine):
    async def body(loop):
        return [out async for out in loop.stream("r", [5, 6, 7], params(4), 0.0)]

    outs = serve(engine, body)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 4
    assert_all_done_and_free(engine)


def test_a_stream_closed_early_aborts_its_request(engine):
    async def body(loop):
        stream = loop.stream("r", [5, 6, 7], params(200), 0.0)
        first = await stream.__anext__()
        await stream.aclose()
        in_flight = loop.num_in_flight()
        after = [out async for out in loop.stream("next", [5, 6], params(2), 0.0)]  # queued behind the abort
        return first, in_flight, engine.is_finished("r"), after[-1].finished

    first, in_flight, finished, next_finished = serve(engine, body)
    assert not first.finished and in_flight == 0 and finished and next_finished


def test_a_request_the_engine_refuses_is_the_clients_error(engine, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("SamplingParams.top_p must be in (0, 1], got 9")

    monkeypatch.setattr(engine, "add_request", refuse)

    async def body(loop):
        with pytest.raises(APIError) as refused:
            async for _ in loop.stream("r", [5, 6], params(2), 0.0):
                pass
        return refused.value, loop.alive

    error, alive = serve(engine, body)
    assert error.status == 400 and error.param == "top_p" and alive


def test_a_failed_step_ends_the_requests_in_flight_and_later_ones_at_once(engine, monkeypatch):
    step = engine.step
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("as a bug below would")
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", failing)

    async def body(loop):
        got = []
        with pytest.raises(EngineDeadError, match="RuntimeError: as a bug below would"):
            async for out in loop.stream("r", [5, 6, 7], params(50), 0.0):
                got.append(out)
        alive = loop.alive
        with pytest.raises(EngineDeadError):
            async for _ in loop.stream("later", [5, 6], params(2), 0.0):
                pass
        return got, alive, loop.num_in_flight()

    got, alive, in_flight = serve(engine, body)
    assert len(got) == 1 and not alive and in_flight == 0
    assert_all_done_and_free(engine)


def test_stop_aborts_what_is_in_flight_and_ends_the_thread(engine):
    async def body(loop):
        stream = loop.stream("r", [5, 6, 7], params(200), 0.0)
        first = await stream.__anext__()
        await asyncio.to_thread(loop.stop, 30)
        rest = [out async for out in stream]
        return first, rest, loop.alive

    first, rest, alive = serve(engine, body)
    assert not first.finished and rest and rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "abort" and not alive
    assert_all_done_and_free(engine)
