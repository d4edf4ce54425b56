"""Online arrivals: requests enter the engine when their time comes, so queueing is real."""
import time

import pytest

from framework import EngineConfig, LLMEngine
from framework.clock import VirtualClock, WallClock
from framework.driver import drive
from framework.workload import WorkloadRequest

STEP = 0.1  # seconds each step takes on the virtual clock


def engine_on(clock, **kw):
    """An engine whose forward passes take STEP seconds on a virtual clock, as a simulator's would."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=128, num_gpu_blocks_override=64, **kw), clock=clock)
    if isinstance(clock, VirtualClock):
        execute = engine.executor.execute
        engine.executor.execute = lambda out: (clock.advance(STEP), execute(out))[1]
    return engine


def req(rid, arrival, prompt_len=8, output_len=3, priority=0):
    return WorkloadRequest(rid, list(range(3, 3 + prompt_len)), output_len, arrival, priority)


def test_requests_enter_at_step_boundaries_and_the_clock_jumps_when_idle():
    clock = VirtualClock(start=10.0)
    engine = engine_on(clock)
    outs = {}
    # a and b at t=0; c arrives while the first steps run; d long after everything is done.
    result = drive(engine, [req("a", 0.0), req("b", 0.0), req("c", 0.15), req("d", 5.0)],
                   on_output=lambda o: outs.setdefault(o.request_id, o))
    assert result.start_time == 10.0 and not result.interrupted and result.num_finished == 4
    a, c, d = outs["a"].metrics, outs["c"].metrics, outs["d"].metrics
    assert a.arrival_time == 10.0 and a.first_scheduled_time == 10.0 and a.ttft == pytest.approx(STEP)
    # c arrived at 10.15, inside the step that ran 10.1-10.2; it entered at 10.2 and waited there.
    assert c.arrival_time == pytest.approx(10.15)
    assert c.first_scheduled_time == pytest.approx(10.2) and c.time_in_queue == pytest.approx(0.05)
    assert c.ttft == pytest.approx(0.15)
    # The engine was idle before d: the clock jumped to its arrival, so d did not queue at all.
    assert d.arrival_time == 15.0 and d.first_scheduled_time == 15.0 and d.time_in_queue == 0
    assert d.ttft == pytest.approx(STEP) and d.token_times == pytest.approx([15.1, 15.2, 15.3])
    assert result.end_time == pytest.approx(15.3)


def test_outputs_are_reported_once_each_in_finish_order():
    clock = VirtualClock()
    engine = engine_on(clock)
    seen = []
    drive(engine, [req("long", 0.0, output_len=6), req("short", 0.0, output_len=2)],
          on_output=lambda o: seen.append((o.request_id, o.finished)))
    assert seen == [("short", True), ("long", True)]


def test_wall_clock_waits_for_arrivals():
    engine = engine_on(WallClock())
    outs = {}
    t0 = time.perf_counter()
    drive(engine, [req("a", 0.0, output_len=2), req("b", 0.3, output_len=2)],
          on_output=lambda o: outs.setdefault(o.request_id, o))
    elapsed = time.perf_counter() - t0
    b = outs["b"].metrics
    assert elapsed >= 0.3
    assert b.arrival_time - outs["a"].metrics.arrival_time == pytest.approx(0.3)
    assert b.first_scheduled_time >= b.arrival_time


def test_interrupt_stops_aborts_the_rest_and_frees_every_block():
    clock = VirtualClock()
    engine = engine_on(clock)

    def stop_at_step_4(stats, out):
        if stats.step == 4:
            raise KeyboardInterrupt

    engine.step_callbacks.append(stop_at_step_4)
    finished = []
    result = drive(engine, [req("a", 0.0, output_len=1), req("b", 0.0, output_len=20), req("c", 0.05, output_len=20),
                            req("never", 100.0)], on_output=finished.append)
    assert result.interrupted and [o.request_id for o in finished] == ["a"]
    assert result.num_sent == 3 and result.unfinished == ["b", "c"]
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks
    assert engine.step_callbacks[-1] is stop_at_step_4  # the callbacks are back after the clean-up step
