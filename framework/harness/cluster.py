"""The serving loop every run uses: a timed stream of requests on one or more engine replicas.

Each replica is an ``LLMEngine`` with its own clock, and events go in time order: a request
(``framework.harness.workload.WorkloadRequest``) is routed (``framework/sim/router.py``) and queued
before any step that starts at or after its arrival, so queueing delay is real; otherwise the
replica whose clock is earliest steps (or runs decode steps at once: ``framework/sim/fast_forward.py``).
An idle replica waits on its clock: a virtual clock jumps, a wall clock sleeps. A KeyboardInterrupt
stops serving (unsent requests dropped, unfinished ones aborted, the result says ``interrupted``, no
re-raise); any other exception aborts the unfinished requests, then propagates.
"""
from __future__ import annotations

import bisect
import dataclasses
import gc
import heapq
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from framework.common.clock import VirtualClock
from framework.common.config import EngineConfig, check_positive_int, is_int
from framework.engine.llm_engine import LLMEngine
from framework.execution.executor import simulates_time
from framework.sim.fast_forward import DecodePlan, advance, commit_decode_run, plan_decode_run
from framework.common.outputs import RequestOutput
from framework.common.request import Request
from framework.sim.router import ROUTERS, Replica, Router
from framework.harness.interrupts import Hold
from framework.harness.workload import WorkloadRequest, sampling_params

logger = logging.getLogger(__name__)

OnOutput = Callable[[int, RequestOutput], None]


@dataclass
class ServeResult:
    """``start_time`` / ``end_time`` are on the replicas' clocks (the end is the latest
    replica's). ``outputs`` holds ``(replica, output)`` of every finished request when ``run``
    was given no ``on_output``."""

    start_time: float
    end_time: float
    num_sent: int
    num_finished: int
    interrupted: bool = False
    unfinished: list[str] = field(default_factory=list)
    outputs: list[tuple[int, RequestOutput]] = field(default_factory=list)


#: Why several replicas need simulated time (real ones would share this machine's cores).
NEEDS_SIMULATED_TIME = "several replicas share one machine only in simulated time: use executor=sim"


class Cluster:
    """``engines`` are the replicas (all on virtual clocks when there are several); ``router``
    is a ``Router`` or a registered name, created with ``router_options``."""

    def __init__(self, engines: Sequence[LLMEngine], router: Router | str = "round_robin",
                 router_options: dict[str, Any] | None = None) -> None:
        if not engines:
            raise ValueError("a cluster needs at least one replica")
        if len(engines) > 1 and not all(isinstance(e.clock, VirtualClock) for e in engines):
            raise ValueError(NEEDS_SIMULATED_TIME)
        if len({id(e.clock) for e in engines}) != len(engines):
            raise ValueError("each replica needs its own clock")
        self.engines = list(engines)
        options = check_router_options(router_options)
        if options and not isinstance(router, str):  # they would be dropped: the router is already made
            raise ValueError(f"router_options are for a router given by name; router {router.name or router!r} "
                             f"was given made, with its own options")
        self.router = ROUTERS.create_with(router, options) if isinstance(router, str) else router
        self.replicas = [Replica(i, e) for i, e in enumerate(self.engines)]
        for replica in self.replicas:  # replicas may differ (block size included): see Replica.prefix_tokens
            replica._own_hashes = replica.engine.allocator.block_size != self.engines[0].allocator.block_size
        self._wall = not isinstance(self.engines[0].clock, VirtualClock)

    @classmethod
    def build(cls, config: EngineConfig, num_replicas: int = 1, router: Router | str = "round_robin",
              router_options: dict[str, Any] | None = None) -> Cluster:
        """``num_replicas`` identical engines of ``config``, each on its executor's default clock; the router is
        checked (and made, when named) before any engine is built."""
        check_num_replicas(num_replicas, config.executor)
        if isinstance(router, str):
            router, router_options = ROUTERS.create_with(router, check_router_options(router_options)), None
        engines = [LLMEngine(dataclasses.replace(config)) for _ in range(num_replicas)]
        return cls(engines, router, router_options)

    def run(self, requests: Iterable[WorkloadRequest], sampling: dict[str, Any] | None = None,
            on_output: OnOutput | None = None, start: float | None = None) -> ServeResult:
        """Serve ``requests`` (in arrival order, any iterable) until done or interrupted. ``sampling``:
        the options all requests share (``framework.harness.workload.sampling_params``); arrivals count
        from ``start`` (default: the latest replica's now); outputs go to ``on_output``, else ``outputs``."""
        start = max(e.clock.now() for e in self.engines) if start is None else start
        result = ServeResult(start, start, 0, 0)
        # Sent and not yet handed to on_output: not the engines' unfinished requests, since an
        # interrupt can land after an engine finished a request and before its output went out.
        in_flight: set[str] = set()

        def emit(i: int, out: RequestOutput) -> None:
            in_flight.discard(out.request_id)
            result.num_finished += 1
            if on_output is None:
                result.outputs.append((i, out))
            else:
                on_output(i, out)

        try:
            with gc_paused(not self._wall), Hold() as hold:
                self._serve(iter(requests), sampling or {}, start, emit, in_flight, result, hold)
        except KeyboardInterrupt:
            result.interrupted = True
            logger.warning("interrupted: %d of %d requests sent finished", result.num_finished, result.num_sent)
        except BaseException:
            # A failure (a policy's, a workload's or a callback's bug) propagates, but the requests
            # it left in flight give their KV blocks back first: no block outlives the run.
            _abort(self.engines, in_flight)
            raise
        finally:
            # The run's settle closure reaches its whole state (on_output, and through it the
            # caller's records): a replica outliving the run must not keep it alive.
            for replica in self.replicas:
                replica._settle = lambda index, t: None
                # Every request sent is finished or aborted: none is outstanding for a later run.
                replica.num_finished = replica.num_routed
        result.end_time = max(e.clock.now() for e in self.engines)
        result.unfinished = sorted(in_flight, key=lambda rid: (len(rid), rid))
        if result.interrupted:
            _abort(self.engines, in_flight)
        return result

    def _serve(self, source: Iterator[WorkloadRequest], sampling: dict[str, Any], start: float, emit: OnOutput,
               in_flight: set[str], result: ServeResult, hold: Hold) -> None:
        """The loop of ``run``. Each turn is one event (an arrival, a step or a decode run), with interrupts held
        until it ends (``interrupts.Hold``), but for a wall clock's sleep: a stop finds every engine, and the records,
        between two events."""
        engines, replicas, router = self.engines, self.replicas, self.router
        n = len(engines)
        # The routed request's length limit (its max_tokens=None's): the longest any replica takes.
        route_len = max(e.config.max_model_len or 0 for e in engines) or None
        # Lazy: several replicas on a deterministic cost model plan each decode run to its end and
        # apply it only when an event needs its state, so an arrival routed elsewhere costs nothing.
        # Otherwise runs stop at the next arrival (and at another replica's next step).
        lazy = n > 1 and all(getattr(getattr(e.executor, "cost_model", None), "deterministic", False) for e in engines)
        # (time, kind, replica, version): a replica's next step, or the last step of its plan (which
        # applies the plan); kind 1: an arrival at that time joins the step. A settle bumps the
        # replica's version, voiding its queued event.
        events: list[tuple[float, int, int, int]] = []
        version = [0] * n
        plans: list[DecodePlan | None] = [None] * n
        busy = [False] * n
        # (finish time, replica), applied at routing: only routers read Replica.num_finished.
        finishes: list[tuple[float, int]] = []
        # Requests ignored on arrival: counted finished at once, though a lazy plan may put off
        # their outputs (they come with the replica's next step) past later arrivals.
        counted: set[str] = set()
        # Replicas holding such a request: stepping delivers it on their next step, so that step
        # is taken as one (a lazy plan would deliver it with its last step, after other replicas').
        ignored = [False] * n

        def emit_all(i: int, outputs: list[RequestOutput]) -> None:
            for out in outputs:
                emit(i, out)
                if n > 1:
                    if out.request_id in counted:
                        counted.discard(out.request_id)
                    else:
                        heapq.heappush(finishes, (out.metrics.finished_time, i))

        def settle(i: int, t: float) -> None:
            """Apply replica i's planned steps that start before t, and drop the rest of the plan."""
            plan = plans[i]
            if plan is None:
                return
            plans[i] = None
            version[i] += 1
            taken = bisect.bisect_left(plan.end_times, t) + 1  # step k starts at end_times[k - 1]
            if plan.start_time < t:
                emit_all(i, commit_decode_run(engines[i], plan, min(taken, len(plan.end_times))))
            if engines[i].has_unfinished_requests():
                heapq.heappush(events, (engines[i].clock.now(), 1, i, version[i]))
            else:
                busy[i] = False

        for replica in replicas:
            replica._settle = settle
        nxt = next(source, None)
        a = math.inf if nxt is None else start + nxt.arrival_time  # nxt's arrival on the clocks
        last_arrival = -math.inf
        while True:
            hold.release()  # an interrupt held during the last event acts here
            hold.held = True
            if not events:
                t, kind = math.inf, 1
            else:
                t, kind = (engines[0].clock.now(), 1) if self._wall else events[0][:2]
            if nxt is not None and (a < t or a == t and kind == 1):
                if a < last_arrival:
                    raise ValueError(f"requests must come in arrival order: {nxt.request_id} at "
                                     f"{nxt.arrival_time} s after one at {last_arrival - start} s")
                last_arrival = a
                params = sampling_params(nxt, sampling)
                while finishes and finishes[0][0] <= a:
                    replicas[heapq.heappop(finishes)[1]].num_finished += 1
                if n > 1:
                    # A replica refuses an id it is serving; another replica would not know it, and
                    # the two requests' outputs (and this run's bookkeeping) would be confused.
                    if nxt.request_id in in_flight:
                        raise ValueError(f"request id {nxt.request_id!r} is already in use")
                    for replica in replicas:
                        replica._now = a
                    i = router.route(Request(nxt.request_id, nxt.prompt_token_ids, params, a, nxt.priority,
                                             max_model_len=route_len), replicas)
                    # Any integer index, numpy's too (a router's np.argmin over its replicas' loads).
                    if not (is_int(i) and 0 <= i < n):
                        raise ValueError(f"router {router.name!r} picked replica {i!r} of {n}")
                    i = int(i)
                else:
                    i = 0
                settle(i, a)
                engine = engines[i]
                hold.release()  # a wall clock sleeps here: an interrupt stops the wait
                engine.clock.wait_until(a)
                hold.held = True
                prompt = nxt.prompt_token_ids if nxt.prompt is None else {
                    "prompt_token_ids": nxt.prompt_token_ids, "prompt": nxt.prompt}
                engine.add_request(nxt.request_id, prompt, params, arrival_time=a, priority=nxt.priority)
                in_flight.add(nxt.request_id)
                result.num_sent += 1
                replicas[i].num_routed += 1
                if n > 1 and engine.is_finished(nxt.request_id):
                    replicas[i].num_finished += 1
                    counted.add(nxt.request_id)
                    ignored[i] = True
                if not busy[i]:
                    busy[i] = True
                    heapq.heappush(events, (engine.clock.now(), 1, i, version[i]))
                nxt = next(source, None)
                a = math.inf if nxt is None else start + nxt.arrival_time
                continue
            if not events:
                hold.release()  # one that came during the last event: the run counts as stopped, as it was
                break
            _, _, i, v = heapq.heappop(events)
            if v != version[i]:
                continue  # superseded by a settle
            engine = engines[i]
            plan = plans[i]
            if plan is not None:  # its end: every planned step is due
                plans[i] = None
                emit_all(i, commit_decode_run(engine, plan, len(plan.end_times)))
            elif not lazy:  # a step, or a run through finishes up to the next arrival
                # Several replicas: and up to another replica's next step, whose outputs stepping
                # gives before those of this replica's later steps (the run would give them first).
                emit_all(i, advance(engine, min(a, events[0][0]) if events else a))
            else:
                # A lazy plan ends at its first finish, so that the finish is an event.
                plan = None if ignored[i] else plan_decode_run(engine, through_finishes=False)
                ignored[i] = False
                if plan is None:
                    emit_all(i, engine.step(final_only=True))
                else:
                    plans[i] = plan
                    # Applied when its last (finishing) step starts, so outputs come out in
                    # stepping's order across replicas; an arrival routed here at that start
                    # settles the plan first and joins the step.
                    last_start = plan.end_times[-2] if len(plan.end_times) > 1 else plan.start_time
                    heapq.heappush(events, (last_start, 1, i, version[i]))
                    continue
            if engine.has_unfinished_requests():
                heapq.heappush(events, (engine.clock.now(), 1, i, version[i]))
            else:
                busy[i] = False


@contextmanager
def gc_paused(pause: bool = True) -> Iterator[None]:
    """Pause CPython's cycle collector (if ``pause`` and it is on; nested pauses are free): a
    simulated run's millions of small acyclic objects, which refcounting frees anyway, would be
    rescanned for about a tenth of the run. Survivors stay young, so a run's cycles are soon collected."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def check_num_replicas(num_replicas: Any, executor: str | None = None) -> None:
    """ValueError unless a positive integer, and 1 for an executor in wall time (the replicas would
    share this machine's cores). Call before building replicas: it fails before weights load."""
    check_positive_int("num_replicas", num_replicas)
    if num_replicas > 1 and executor is not None and not simulates_time(executor):
        raise ValueError(NEEDS_SIMULATED_TIME)


def check_router_options(options: Any) -> dict[str, Any]:
    """``router_options`` as a dict: a mapping of option names to values, or None for none."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):  # dict() would fail on 5 naming no option, and read a list as pairs
        raise ValueError(f"router_options must be a mapping of option names to values, got {options!r}")
    return dict(options)


def _abort(engines: Sequence[LLMEngine], in_flight: set[str]) -> None:
    """Abort what is still in flight and let one empty step hand back the aborted requests, so
    every engine ends with every KV block free. Best effort: the measurements are already safe."""
    for engine in engines:
        if not (in_flight and engine.has_unfinished_requests()):
            continue
        callbacks, engine.step_callbacks = engine.step_callbacks, []  # this step is no measurement
        try:
            engine.abort_request(sorted(in_flight))
            engine.step()
        except Exception as exc:  # an interrupt may have left the step half done
            logger.warning("could not abort the unfinished requests cleanly: %s", exc)
        finally:
            engine.step_callbacks = callbacks
