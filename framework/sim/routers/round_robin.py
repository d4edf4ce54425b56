"""Round robin: replica 0, 1, ..., n-1, 0, ... whatever their load."""
from __future__ import annotations

from collections.abc import Sequence

from framework.common.request import Request
from framework.sim.router import ROUTERS, Replica, Router


@ROUTERS.register("round_robin")
class RoundRobinRouter(Router):
    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        index = self._next % len(replicas)
        self._next = index + 1
        return index
