"""Serving a timed stream of requests on one or more engine replicas: a discrete-event driver.

Each replica is an ``LLMEngine`` with its own clock. Events are processed in time order: an
arrival is routed (``framework/router.py``) and queued on its replica before any step that starts
at or after its arrival time; otherwise the replica whose clock is earliest takes its next step
(or, when the sim executor allows it, a run of pure-decode steps: ``framework/fast_forward.py``).
An idle replica's clock jumps to its next arrival. With one replica on the model executor and
wall time the same loop serves requests in real time (waiting for arrivals by sleeping).
"""
from __future__ import annotations

import dataclasses
import gc
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from framework.clock import VirtualClock
from framework.config import EngineConfig
from framework.engine import LLMEngine
from framework.outputs import RequestOutput
from framework.request import Request
from framework.router import ROUTERS, Replica, Router
from framework.sampling_params import SamplingParams


@dataclass
class Arrival:
    """One request of a workload: when it arrives, its prompt and how to sample it."""

    time: float
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


OnOutput = Callable[[int, RequestOutput], None]


class Cluster:
    """``engines`` are the replicas (all on virtual clocks when there are several); ``router``
    is a ``Router`` or a registered name, created with ``router_options``."""

    def __init__(self, engines: Sequence[LLMEngine], router: Router | str = "round_robin",
                 router_options: dict[str, Any] | None = None) -> None:
        if not engines:
            raise ValueError("a cluster needs at least one replica")
        if len(engines) > 1 and not all(isinstance(e.clock, VirtualClock) for e in engines):
            raise ValueError("several replicas share one machine only in simulated time: use executor=sim")
        if len({id(e.clock) for e in engines}) != len(engines):
            raise ValueError("each replica needs its own clock")
        self.engines = list(engines)
        self.router = ROUTERS.create(router, **(router_options or {})) if isinstance(router, str) else router
        self.replicas = [Replica(i, e) for i, e in enumerate(self.engines)]
        self._wall = not isinstance(self.engines[0].clock, VirtualClock)

    @classmethod
    def build(cls, config: EngineConfig, num_replicas: int = 1, router: Router | str = "round_robin",
              router_options: dict[str, Any] | None = None) -> Cluster:
        """``num_replicas`` identical engines of ``config``, each on its executor's default clock."""
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        engines = [LLMEngine(dataclasses.replace(config)) for _ in range(num_replicas)]
        return cls(engines, router, router_options)

    def run(self, arrivals: Iterable[Arrival], on_output: OnOutput | None = None) -> list[tuple[int, RequestOutput]]:
        """Serve ``arrivals`` (in time order; a generator is fine) to completion. Each finished
        request's output goes to ``on_output(replica_index, output)`` as it finishes, or, with no
        callback, into the returned list."""
        results: list[tuple[int, RequestOutput]] = []
        emit = on_output or (lambda i, o: results.append((i, o)))
        # Serving allocates millions of small acyclic objects (token lists, floats, blocks' tuples);
        # CPython's cycle collector would rescan the growing heap again and again for nothing
        # (about a tenth of a simulated run), so it is paused while serving.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._serve(iter(arrivals), emit)
        finally:
            if collecting:
                gc.enable()
        return results

    def _serve(self, source: Iterator[Arrival], emit: OnOutput) -> None:
        engines, replicas, router = self.engines, self.replicas, self.router
        ready: list[tuple[float, int]] = []       # (clock, replica) of replicas with work
        busy = [False] * len(engines)
        finishes: list[tuple[float, int]] = []    # (finish time, replica), applied at routing
        nxt = next(source, None)
        last_arrival = -math.inf
        while True:
            if not ready:
                t = math.inf
            else:
                t = engines[0].clock.now() if self._wall else ready[0][0]
            if nxt is not None and nxt.time <= t:
                a = nxt.time
                if a < last_arrival:
                    raise ValueError(f"arrivals must come in time order: {nxt.request_id} at {a} after {last_arrival}")
                last_arrival = a
                while finishes and finishes[0][0] <= a:
                    replicas[heapq.heappop(finishes)[1]].num_finished += 1
                i = router.route(Request(nxt.request_id, nxt.prompt_token_ids, nxt.params, a, nxt.priority),
                                 replicas) if len(engines) > 1 else 0
                if not 0 <= i < len(engines):
                    raise ValueError(f"router {router.name!r} picked replica {i} of {len(engines)}")
                engine = engines[i]
                engine.clock.wait_until(a)
                engine.add_request(nxt.request_id, nxt.prompt_token_ids, nxt.params, arrival_time=a,
                                   priority=nxt.priority)
                replicas[i].num_routed += 1
                if not busy[i]:
                    busy[i] = True
                    heapq.heappush(ready, (engine.clock.now(), i))
                nxt = next(source, None)
                continue
            if not ready:
                break
            _, i = heapq.heappop(ready)
            engine = engines[i]
            for out in engine.advance(nxt.time if nxt is not None else math.inf):
                emit(i, out)
                heapq.heappush(finishes, (out.metrics.finished_time, i))
            if engine.has_unfinished_requests():
                heapq.heappush(ready, (engine.clock.now(), i))
            else:
                busy[i] = False
