"""The ``Router`` interface: which replica of a cluster serves an arriving request.

The cluster driver (``framework/harness/cluster.py``) calls ``route`` once per arrival, in arrival order,
with a ``Replica`` view of every replica as of the arrival time.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from framework.common.registry import Registry
from framework.common.request import Request

if TYPE_CHECKING:
    from framework.engine.llm_engine import LLMEngine


class Replica:
    """What a router may read about one replica: load and cache contents. Counts are exact at
    the routing time; cache contents are as of the end of the replica's latest step that started
    before it (a step's effects are applied when it is simulated, up to one step early)."""

    def __init__(self, index: int, engine: LLMEngine) -> None:
        self.index = index
        self.engine = engine
        self.num_routed = 0
        self.num_finished = 0
        # Set by the cluster: the routing time, and how to bring the replica's state up to it.
        self._now = 0.0
        self._settle: Callable[[int, float], None] = lambda index, t: None
        # Set by the cluster when this replica's block size differs from the first's: the request's
        # block_hashes, filled by the replicas asked before, would match none of its blocks.
        self._own_hashes = False

    @property
    def num_outstanding(self) -> int:
        """Requests routed here and not finished by the routing time."""
        return self.num_routed - self.num_finished

    @property
    def kv_usage(self) -> float:
        self._settle(self.index, self._now)
        return self.engine.allocator.usage

    def prefix_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s prompt this replica's prefix cache holds (whole blocks); 0
        for a request that will not use them (``Request.reads_prefix_cache``)."""
        self._settle(self.index, self._now)
        if not request.reads_prefix_cache:
            return 0  # it will compute its whole prompt (Scheduler.find_prefix)
        if not self._own_hashes:
            return self.engine.allocator.find_prefix(request).num_tokens
        shared, request.block_hashes = request.block_hashes, []
        try:
            return self.engine.allocator.find_prefix(request).num_tokens
        finally:
            request.block_hashes = shared


class Router(ABC):
    """Picks a replica for each request. ``route`` may keep state (a round-robin pointer) but
    must not change the replicas. Options come from ``cluster.router_options`` as keyword
    arguments; unknown options are rejected."""

    name: ClassVar[str] = ""

    @abstractmethod
    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Index into ``replicas`` of the replica to serve ``request`` (a fresh ``Request``
        holding no blocks: the prompt, its sampling parameters and arrival time)."""


def least_loaded(replicas: Sequence[Replica]) -> Replica:
    """Fewest outstanding requests; ties go to the replica routed fewest requests, then the first."""
    return min(replicas, key=lambda r: (r.num_outstanding, r.num_routed, r.index))


ROUTERS: Registry[Router] = Registry("router", Router, entry_point_group="framework.routers", builtin="framework.sim.routers")
