"""Least outstanding requests: the replica with the fewest requests routed and not finished."""
from __future__ import annotations

from collections.abc import Sequence

from framework.common.request import Request
from framework.sim.router import ROUTERS, Replica, Router, least_loaded


@ROUTERS.register("least_outstanding")
class LeastOutstandingRouter(Router):
    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        return least_loaded(replicas).index
